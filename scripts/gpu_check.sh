#!/usr/bin/env bash
# One device call's worth of checks on the GPU machine, most essential first: install, info
# and demo, GPU tests, the same tests again on older archs' PTX, benchmarks, then
# compute-sanitizer (each tool bounded by SANITIZER_TIMEOUT seconds, default 120). Logs go to
# $OUT (or ./gpu_logs).
#   scripts/gpu_check.sh "<pytest args>" "<bench suites>" "<sanitized pytest args>" "<archs>"
# <archs> (e.g. "sm_80 sm_89"): one pass each with PTXATTN_ARCH=<arch>, which loads that
# arch's PTX through the driver's JIT, over $ARCH_TESTS (default: the sdpa, decode, paged and
# fp8 decode GPU tests).
set -uo pipefail
export PYTHONUNBUFFERED=1
out=${OUT:-gpu_logs}; mkdir -p "$out"
tests=${1:-"-m gpu tests"}; suites=${2:-}; sanitized=${3:-}; archs=${4:-}
arch_tests=${ARCH_TESTS:-"tests/test_sdpa_gpu.py tests/test_decode_gpu.py tests/test_paged_gpu.py tests/test_fp8_decode_gpu.py"}
python3 -m pip install -q --no-deps --no-build-isolation -e . > /tmp/install.log 2>&1 || { cat /tmp/install.log; exit 1; }
status=0
python3 -m ptxattn info 2>&1 | tee "$out/start.log"
python3 -m ptxattn demo 2>&1 | tee -a "$out/start.log" || status=1
python3 -m pytest -q -ra $tests 2>&1 | tee "$out/gpu_tests.log" | tail -15 || status=1
for arch in $archs; do
  echo "==== PTXATTN_ARCH=$arch"
  PTXATTN_ARCH=$arch python3 -m ptxattn info 2>&1 | grep -E '^device|PTXATTN_ARCH' || status=1
  PTXATTN_ARCH=$arch python3 -m pytest -q -ra -m gpu $arch_tests 2>&1 | tee "$out/gpu_tests_$arch.log" | tail -8 \
    || status=1
done
if [ -n "$suites" ]; then
  python3 scripts/bench.py --suite $suites --out "$out/bench" 2>&1 | tee "$out/bench.log" | tail -45 || status=1
fi
if [ -n "$sanitized" ]; then
  for tool in memcheck racecheck initcheck synccheck; do
    timeout "${SANITIZER_TIMEOUT:-120}" compute-sanitizer --tool "$tool" --target-processes all --error-exitcode 86 \
      python3 -m pytest -q -x -p no:cacheprovider $sanitized > "/tmp/sanitizer_$tool.log" 2>&1
    rc=$?
    { echo "==== $tool (exit $rc)"; cat "/tmp/sanitizer_$tool.log"; } >> "$out/sanitizers.log"
    echo "compute-sanitizer $tool: exit $rc$([ $rc -eq 124 ] && echo ' (time limit: partial run)'); $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY|passed|failed' "/tmp/sanitizer_$tool.log" | tail -2 | tr '\n' ' ')"
    [ $rc -eq 0 ] || [ $rc -eq 124 ] || status=1
  done
fi
exit $status
