#!/usr/bin/env python3
"""One call, made three times, for a profiler to catch the third (the first two load modules
and warm caches): bf16 prefill at D128 by ours (ptxattn.sdpa) or cuDNN's (torch SDPA's cuDNN
backend), or our decode step (Hq32 Hkv8 D128, every row at capacity) over a bf16 cache or an
e4m3 one with per-token scales, with bench.py's random data.

    ncu --set full --import-source yes -k regex:flash_fwd --launch-skip 2 --launch-count 1 \\
        -o ours_s512c python3 scripts/ncu_probe.py prefill ours 32 16 512 --causal
    ncu --set full -k 'regex:(?i)sdpa|fprop' --launch-skip 2 --launch-count 1 \\
        -o cudnn_s512c python3 scripts/ncu_probe.py prefill cudnn 32 16 512 --causal
    ncu -i ours_s512c.ncu-rep --page source --csv --print-source sass > ours_s512c.csv
        # a row a SASS instruction: executions and stall samples by reason (flash_fwd_notes v47)
    ncu --set full --import-source yes -k regex:decode_split --launch-skip 2 --launch-count 1 \\
        -o e4m3_b64 python3 scripts/ncu_probe.py decode e4m3 64 8192
"""
from __future__ import annotations

import argparse

import numpy as np

import ptxattn

from bench_common import random_host, stream, upload
from bench_decode import D, HKV, HQ, fp8_cache

CALLS = 3
BF16 = ptxattn.bfloat16


def prefill(who: str, b: int, h: int, s: int, causal: bool) -> None:
    if who == "cudnn":
        import torch
        from torch.nn.attention import SDPBackend, sdpa_kernel

        q, k, v = (torch.randn(b, h, s, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            for _ in range(CALLS):
                torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)
        torch.cuda.synchronize()
        return
    rng = np.random.default_rng(0)
    q, k, v = (upload(random_host(rng, (b, h, s, D), BF16)) for _ in range(3))
    out = ptxattn.empty((b, h, s, D), BF16)
    for _ in range(CALLS):
        ptxattn.sdpa(q, k, v, causal=causal, out=out, stream=stream())
    stream().synchronize()


def decode(cache: str, b: int, capacity: int) -> None:
    rng = np.random.default_rng(0)
    q = upload(random_host(rng, (b, HQ, 1, D), BF16))
    lens = upload(np.full(b, capacity, np.int32))
    out = ptxattn.empty((b, HQ, 1, D), BF16)
    shape = (b, HKV, capacity, D)
    if cache == "bf16":
        k, v = upload(random_host(rng, shape, BF16)), upload(random_host(rng, shape, BF16))
        scales = {}
    else:
        (k, k_scale), (v, v_scale) = fp8_cache(rng, shape), fp8_cache(rng, shape)
        k, v = upload(k), upload(v)
        scales = {"k_scale": upload(k_scale), "v_scale": upload(v_scale)}
    for _ in range(CALLS):
        ptxattn.decode(q, k, v, lens, out=out, stream=stream(), **scales)
    stream().synchronize()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ops = parser.add_subparsers(dest="op", required=True)
    p = ops.add_parser("prefill", help="B H S at D128, bf16")
    p.add_argument("who", choices=("ours", "cudnn"))
    p.add_argument("b", type=int)
    p.add_argument("h", type=int)
    p.add_argument("s", type=int)
    p.add_argument("--causal", action="store_true")
    d = ops.add_parser("decode", help="B and capacity, Hq32 Hkv8 D128")
    d.add_argument("cache", choices=("bf16", "e4m3"))
    d.add_argument("b", type=int)
    d.add_argument("capacity", type=int)
    args = parser.parse_args()
    if args.op == "prefill":
        prefill(args.who, args.b, args.h, args.s, args.causal)
    else:
        decode(args.cache, args.b, args.capacity)


if __name__ == "__main__":
    main()
