#!/usr/bin/env python3
"""ptxattn benchmarks, run on the GPU machine: prints a table per suite, writes JSON and a
PNG chart. Every suite runs on ptxattn alone (NumPy inputs, ptxattn's events, the driver's
copy as the bandwidth line); PyTorch's columns are added when torch with CUDA is importable.
The prefill and decode suites also print each row as it finishes ("row: ..."), so a run cut
short by a timeout keeps what it measured.

    python scripts/bench.py                       # every suite
    python scripts/bench.py --suite prefill decode --out /tmp/bench
    python scripts/bench.py --suite prefill --quick --rows 'S512|S1024'   # a few rows, by name
"""
from __future__ import annotations

import argparse
import importlib
import json
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

# suite name -> module with run(args) -> list of row dicts (a "chart" entry is drawn).
SUITES = {"launch": "bench_launch", "host": "bench_host", "step": "bench_step", "softmax": "bench_softmax",
          "prefill": "bench_prefill", "decode": "bench_decode", "serving": "bench_serving"}
WITHOUT_GPU = ("host",)  # suites that run on the fake driver


def gpu_unavailable() -> str | None:
    """Why there is nothing to benchmark on (no driver or device), or None."""
    import ptxattn

    try:
        return None if ptxattn.device_count() else "the CUDA driver reports no device"
    except ptxattn.CudaUnavailableError as exc:
        return str(exc)


def print_table(suite: str, rows: list[dict]) -> None:
    if not rows:
        return
    columns = list(dict.fromkeys(k for row in rows for k in row))
    def fmt(v):
        return f"{v:.3g}" if isinstance(v, float) else ("-" if v is None else str(v))
    widths = {c: max(len(c), *(len(fmt(r.get(c))) for r in rows)) for c in columns}
    print(f"\n== {suite} ==")
    print("  ".join(c.ljust(widths[c]) for c in columns))
    for row in rows:
        print("  ".join(fmt(row.get(c)).ljust(widths[c]) for c in columns))


def plot(results: dict, path: Path) -> bool:
    """A bar chart per charted suite into `path`; False when there is none to draw."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("(matplotlib not installed: no chart)")
        return False
    charted = {s: rows for s, rows in results.items() if rows and "chart" in rows[0]}
    if not charted:
        return False
    fig, axes = plt.subplots(len(charted), 1, figsize=(11, 3.6 * len(charted)), squeeze=False)
    for ax, (suite, rows) in zip(axes[:, 0], charted.items()):
        unit = rows[0]["chart"]["unit"]
        series = list(rows[0]["chart"]["series"])
        width = 0.8 / len(series)
        for j, name in enumerate(series):
            values = [r["chart"]["series"].get(name) or 0 for r in rows]
            ax.bar([i + j * width for i in range(len(rows))], values, width, label=name)
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(rows))])
        ax.set_xticklabels([r["shape"] for r in rows], rotation=12, fontsize=7)
        ax.set_ylabel(unit)
        ax.set_title(suite)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--suite", nargs="+", choices=sorted(SUITES), default=list(SUITES))
    parser.add_argument("--out", type=Path, default=Path("bench_results"))
    parser.add_argument("--quick", action="store_true", help="fewer repeats (smoke run)")
    parser.add_argument("--rows", metavar="REGEX", type=re.compile,
                        help="prefill and decode suites: only the rows whose name matches (re.search), chosen "
                             "from every row with or without --quick, e.g. --rows 'S512|S1024' or 'B1 T|B64'")
    parser.add_argument("--sm90-plain", action="store_true",
                        help="prefill suite: also time the plain wgmma sm_90a kernels (PTXATTN_SM90_WS=0) beside the "
                             "default warp-specialized ones, and compare their outputs bit for bit")
    parser.add_argument("--sm90-pingpong", action="store_true",
                        help="prefill suite: also time the warp-specialized kernels' ping-pong twins (the _ws_pp "
                             "kernels, PTXATTN_SM90_PINGPONG=1) at every head dim beside the default ones, and "
                             "compare their outputs bit for bit")
    parser.add_argument("--sm90-ws", action="store_true",
                        help="prefill suite: also time the warp-specialized kernels without ping-pong "
                             "(PTXATTN_SM90_PINGPONG=0) at every head dim beside the default ones, and compare "
                             "their outputs bit for bit")
    parser.add_argument("--sm90-cp-async", action="store_true",
                        help="prefill suite: also time the warp-specialized kernels loading by cp.async rather than "
                             "TMA (PTXATTN_SM90_TMA=0) beside the default ones, and compare their outputs bit for bit")
    parser.add_argument("--sm90-no-persistent", action="store_true",
                        help="prefill suite: also time a CTA a block (PTXATTN_SM90_PERSISTENT=0) where the default "
                             "runs the persistent twins, and compare their outputs bit for bit")
    parser.add_argument("--baseline", metavar="DIR", help="step suite: also time the eager step of the ptxattn "
                                                          "importable from DIR (an earlier version)")
    args = parser.parse_args()
    reason = gpu_unavailable()
    needs_gpu = [s for s in args.suite if s not in WITHOUT_GPU]
    if reason and needs_gpu:
        print(f"bench: {', '.join(needs_gpu)} cannot run without a GPU: {reason} (the host suite can: "
              f"--suite host)", file=sys.stderr)
        return 1
    if needs_gpu:
        from bench_common import torch_cuda

        torch = torch_cuda()
        print(f"PyTorch columns: {'torch ' + torch.__version__ if torch else 'none (torch with CUDA is not importable)'}")
    args.out.mkdir(parents=True, exist_ok=True)
    results = {}
    for suite in args.suite:
        rows = importlib.import_module(SUITES[suite]).run(args)
        results[suite] = rows
        print_table(suite, [{k: v for k, v in r.items() if k != "chart"} for r in rows])
    (args.out / "bench.json").write_text(json.dumps(results, indent=2, default=str))
    charted = plot(results, args.out / "bench.png")
    print(f"\nwrote {args.out / 'bench.json'}" + (f" and {args.out / 'bench.png'}" if charted else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
