#!/usr/bin/env bash
# One device call's worth of checks on the GPU machine: install, GPU tests, compute-sanitizer
# over the chosen tests, and benchmarks. Logs go to $OUT (or ./gpu_logs).
#   scripts/gpu_check.sh "<pytest args>" "<sanitized pytest args>" "<bench suites>"
set -uo pipefail
export PYTHONUNBUFFERED=1
out=${OUT:-gpu_logs}; mkdir -p "$out"
tests=${1:-"-m gpu tests"}; sanitized=${2:-}; suites=${3:-}
python3 -m pip install -q --no-deps --no-build-isolation -e . > "$out/install.log" 2>&1 || { cat "$out/install.log"; exit 1; }
status=0
python3 -m ptxattn info 2>&1 | tee "$out/info.log"
python3 -m ptxattn demo 2>&1 | tee "$out/demo.log" || status=1
python3 -m pytest -q -ra $tests 2>&1 | tee "$out/gpu_tests.log" | tail -30 || status=1
if [ -n "$sanitized" ]; then
  for tool in memcheck racecheck initcheck synccheck; do
    compute-sanitizer --tool "$tool" --target-processes all --error-exitcode 86 \
      python3 -m pytest -q -x -p no:cacheprovider $sanitized > "$out/sanitizer_$tool.log" 2>&1
    rc=$?
    echo "compute-sanitizer $tool: exit $rc; $(grep -E 'ERROR SUMMARY|passed|failed' "$out/sanitizer_$tool.log" | tail -2 | tr '\n' ' ')"
    [ $rc -eq 0 ] || status=1
  done
fi
if [ -n "$suites" ]; then
  python3 scripts/bench.py --suite $suites --out "$out/bench" 2>&1 | tee "$out/bench.log" | tail -40 || status=1
fi
exit $status
