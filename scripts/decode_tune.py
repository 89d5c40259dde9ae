#!/usr/bin/env python3
"""Decode tuning sweep (developer tool, GPU machine with torch): times the captured decode step
(split kernel + combine) for each split density and K/V ring depth on the issue-4 shapes, so
the defaults in runtime/ops/decode.py (CTAS_PER_SM, MAX_STAGES) rest on a measurement.

    python scripts/decode_tune.py [--quick]
"""
from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_common import rotation_count, time_ms  # noqa: E402

HQ, HKV, D = 32, 8, 128
SHAPES = [(64, 8192), (128, 2048), (1, 32768)]
CTAS_PER_SM = (2, 4, 8, 16)
STAGES = (2, 3, 4)


def capture_each(ptxattn, stream, step, count: int) -> list:
    """One graph per input set, after an eager warm-up (module load, arena growth)."""
    step(0)
    graphs = []
    for i in range(count):
        with ptxattn.capture(stream) as graph:
            step(i)
        graphs.append(graph)
    return graphs


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    import torch

    import ptxattn
    from ptxattn.ops import decode as decode_module

    side = torch.cuda.Stream()
    stream = ptxattn.as_stream(side.cuda_stream)
    repeat = 10 if args.quick else 30
    print(f"{'shape':<12} {'ctas/SM':>7} {'stages':>6} {'splits':>6} {'ms':>8} {'TB/s':>6}")
    with torch.cuda.stream(side):
        for b, cap in SHAPES:
            sets = [tuple(ptxattn.from_dlpack(t, stream) for t in (
                torch.randn(b, HQ, 1, D, device="cuda", dtype=torch.bfloat16),
                torch.randn(b, HKV, cap, D, device="cuda", dtype=torch.bfloat16),
                torch.randn(b, HKV, cap, D, device="cuda", dtype=torch.bfloat16)))
                for _ in range(rotation_count(2 * b * HKV * cap * D * 2))]
            lens = ptxattn.from_dlpack(torch.full((b,), cap, dtype=torch.int32, device="cuda"), stream)
            out = ptxattn.from_dlpack(torch.empty(b, HQ, 1, D, device="cuda", dtype=torch.bfloat16), stream)
            moved = 2 * b * HKV * cap * D * 2 + 2 * b * HQ * D * 2
            for ctas, stages in itertools.product(CTAS_PER_SM, STAGES):
                decode_module.CTAS_PER_SM, decode_module.MAX_STAGES = ctas, stages

                def step(i):
                    q, k, v = sets[i]
                    ptxattn.decode(q, k, v, lens, out=out, stream=stream)

                graphs = capture_each(ptxattn, stream, step, len(sets))
                ms = time_ms(lambda i: graphs[i].replay(stream), repeat=repeat, rotate=len(sets))
                del graphs  # destroyed now, not while the next configuration is being captured
                plan = decode_module.plan_for(ptxattn.get_device(0), sets[0][0], *(
                    decode_module.cache_shape("tune", n, a, "HND") for n, a in (("k", sets[0][1]), ("v", sets[0][2]))),
                    cap)
                print(f"B{b} T{cap:<6} {ctas:>7} {plan.stages:>6} {plan.num_splits:>6} {ms:>8.4f} "
                      f"{moved / (ms * 1e-3) / 1e12:>6.2f}")
            del sets
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
