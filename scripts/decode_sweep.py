#!/usr/bin/env python3
"""Split-KV decode geometry sweep (developer tool, GPU machine with torch; repo root):

    python3 scripts/decode_sweep.py                          # every shape, default geometry only
    python3 scripts/decode_sweep.py --shapes B1 B8u --ctas-per-sm 1 2 4 --stages 2 3 --waves 1 2

bf16 queries, Hq32 Hkv8 D128, Sq 1, bf16 caches or (--cache e4m3) fp8 ones with per-token scales; rows at capacity, or (shapes ending in "u") lengths drawn in
[1, capacity]. For each shape and each (CTAs an SM holds, ring depth) whose plan differs from
one already measured (and each grid target in waves), one line ("*" marks the plan decode() ships):

    shape  cps st w  splits grid ctas waves  TB/s  step us | split us  combine us  gap us  span us | err

TB/s counts the live K and V, q and the output (as scripts/bench_decode.py does); step: the
graph-replayed step from CUDA events (bench_common.time_ms); split / combine: average kernel
durations from torch.profiler (CUPTI); gap: combine start minus split end; span: split start
to the last end; err: relative error against torch SDPA on the live keys, eager and replayed.
The overrides reach plan_decode by wrapping ptxattn.ops.decode.plan_decode, which decode()
calls; the public API is untouched.
"""
from __future__ import annotations

import argparse
import itertools
import json
import math
import statistics
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

HQ, HKV, D = 32, 8, 128
# name: (batch, capacity, random lengths, seed); B8u draws the lengths of bench_decode's row
SHAPES = {
    "B1": (1, 32768, False, 0), "B1_16k": (1, 16384, False, 0), "B1_64k": (1, 65536, False, 0),
    "B1_128k": (1, 131072, False, 0), "B8": (8, 8192, False, 0), "B8u": (8, 8192, True, 0),
    "B8u1": (8, 8192, True, 1), "B8u2": (8, 8192, True, 2), "B16u": (16, 8192, True, 0),
    "B64": (64, 8192, False, 0), "B128": (128, 2048, False, 0),
}
REPEAT = 30
PROFILED_STEPS = 20
SPLIT_KERNEL, COMBINE_KERNEL = "decode_split_", "merge_"


def kernel_times(torch, replay, rotate: int) -> dict:
    """Average split / combine durations, combine start - split end, and split start -> last
    end (us) over PROFILED_STEPS replays, from the profiler's kernel records."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for i in range(PROFILED_STEPS):
            replay(i % rotate)
        torch.cuda.synchronize()
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        events = json.loads(Path(f.name).read_text())["traceEvents"]
    kernels = sorted((e for e in events if str(e.get("cat", "")).lower() == "kernel" and e.get("ph") == "X"
                      and e["name"].startswith((SPLIT_KERNEL, COMBINE_KERNEL))), key=lambda e: e["ts"])
    splits = [e for e in kernels if e["name"].startswith(SPLIT_KERNEL)]
    combines = [e for e in kernels if e["name"].startswith(COMBINE_KERNEL)]
    out = {"split": statistics.mean(e["dur"] for e in splits) if splits else None,
           "combine": statistics.mean(e["dur"] for e in combines) if combines else None,
           "gap": None, "span": statistics.mean(e["dur"] for e in splits) if splits else None}
    if combines and len(combines) == len(splits):
        out["gap"] = statistics.mean(c["ts"] - (s["ts"] + s["dur"]) for s, c in zip(splits, combines))
        out["span"] = statistics.mean(c["ts"] + c["dur"] - s["ts"] for s, c in zip(splits, combines))
    return out


def fmt(x) -> str:
    return "-" if x is None else f"{x:.1f}"


def sweep_shape(torch, name: str, batch: int, capacity: int, uniform: bool, seed: int, stream, dev, args) -> None:
    import torch.nn.functional as F

    import ptxattn
    from bench_common import rotation_count, time_ms
    from bench_decode import FP8, fp8_cache
    from ptxattn.ops import decode as decode_module
    from ptxattn.ops.prepared import clear_bindings

    gen = torch.Generator(device="cuda").manual_seed(seed)
    lens = (torch.randint(1, capacity + 1, (batch,), dtype=torch.int32, device="cuda", generator=gen) if uniform
            else torch.full((batch,), capacity, dtype=torch.int32, device="cuda"))
    fp8 = args.cache == "e4m3"
    kv_bytes = 1 if fp8 else 2
    rng = np.random.default_rng(seed)
    sets = []
    for _ in range(rotation_count(2 * batch * HKV * capacity * D * kv_bytes)):
        q = torch.randn(batch, HQ, 1, D, device="cuda", dtype=torch.bfloat16, generator=gen)
        if fp8:  # (q, k, k_scale, v, v_scale) as bench_decode makes them, the reference's cache dequantized
            kv = [ptxattn.asarray(x) for _ in range(2) for x in fp8_cache(rng, (batch, HKV, capacity, D))]
            sets.append((q, *kv))
        else:
            sets.append((q, *(torch.randn(batch, HKV, capacity, D, device="cuda", dtype=torch.bfloat16,
                                          generator=gen) for _ in range(2))))
    out = torch.empty(batch, HQ, 1, D, device="cuda", dtype=torch.bfloat16)
    q0 = sets[0][0]
    if fp8:
        k0, v0 = (torch.from_numpy(a.get().astype(np.float32) * s.get()[..., None]).cuda()
                  for a, s in (sets[0][1:3], sets[0][3:5]))
    else:
        k0, v0 = sets[0][1:]
    group = HQ // HKV
    reference_out = torch.cat([F.scaled_dot_product_attention(
        q0[i:i + 1].to(k0.dtype), k0[i:i + 1, :, :int(lens[i])].repeat_interleave(group, 1),
        v0[i:i + 1, :, :int(lens[i])].repeat_interleave(group, 1)) for i in range(batch)]).float()
    del k0, v0
    dev_sets = [tuple(ptxattn.from_dlpack(t, stream) if isinstance(t, torch.Tensor) else t for t in s) for s in sets]
    dev_lens, dev_out = ptxattn.from_dlpack(lens, stream), ptxattn.from_dlpack(out, stream)
    # fp8: the bytes of K and V and of their float32 scales
    moved = 2 * HKV * (D * kv_bytes + (4 if fp8 else 0)) * int(lens.sum()) + 2 * batch * HQ * D * 2
    print(f"{name}: B{batch} capacity {capacity}, {args.cache} cache, "
          f"{int(lens.sum()) / (batch * capacity):.3f} of the keys live", flush=True)

    workspace = {}  # the current plan's, made before its capture

    def step(i):
        if fp8:
            q, k, k_scale, v, v_scale = dev_sets[i]
            ptxattn.decode(q, k, v, dev_lens, k_scale=k_scale, v_scale=v_scale, out=dev_out,
                           workspace=workspace["ws"], stream=stream)
        else:
            q, k, v = dev_sets[i]
            ptxattn.decode(q, k, v, dev_lens, out=dev_out, workspace=workspace["ws"], stream=stream)

    def error() -> float:
        torch.cuda.synchronize()
        return float((out.float() - reference_out).norm() / reference_out.norm())

    shipped_plan = decode_module.plan_decode

    def plan_of(**override):
        return shipped_plan(batch=batch, hq=HQ, hkv=HKV, sq=1, dqk=D, dv=D, capacity=capacity,
                            dtype=ptxattn.bfloat16, cache_dtype=FP8 if fp8 else None, sm_count=dev.sm_count,
                            max_shared=dev.max_shared_per_block_optin, **override)

    default = plan_of()
    seen = {}
    for cps, stages, waves in itertools.product(args.ctas_per_sm or [None], args.stages or [None],
                                                args.waves or [None]):
        label = f"{name:7} cps={cps or '-'} st={stages or '-'} w={waves or '-'}"
        override = {"ctas_per_sm": cps, "stages": stages, "waves": waves or 1}
        try:
            plan = plan_of(**override)
        except ValueError as exc:
            print(f"{label}: does not fit ({exc})", flush=True)
            continue
        key = (plan.grid, plan.stages)
        if key in seen:
            print(f"{label}  same plan as {seen[key]}", flush=True)
            continue
        seen[key] = label.split(None, 1)[1]
        decode_module.plan_decode = lambda **kw: shipped_plan(**{**kw, **override})
        clear_bindings()  # eager calls replan with the override
        workspace["ws"] = ptxattn.empty((max(plan.workspace_bytes, 1),), "uint8")
        graphs = []
        try:
            step(0)  # outside capture: loads modules
            err = error()
            for i in range(len(sets)):
                with ptxattn.capture(stream) as g:
                    step(i)
                graphs.append(g)

            def replay(i):
                graphs[i].replay(stream)

            ms = time_ms(replay, repeat=REPEAT, rotate=len(sets))
            times = kernel_times(torch, replay, len(sets))
            out.fill_(float("nan"))
            replay(0)
            err = max(err, error(), key=lambda e: math.inf if math.isnan(e) else e)
        finally:
            for g in graphs:
                g.close()
            decode_module.plan_decode = shipped_plan
            clear_bindings()
        resident = (dev.max_shared_per_block_optin + 1024) // (plan.shared_bytes + 1024)
        ctas = plan.grid[0] * plan.grid[1] * plan.grid[2]
        mark = "*" if key == (default.grid, default.stages) else " "
        print(f"{label}{mark} splits={plan.num_splits:3d} grid={plan.grid} ctas={ctas:5d} "
              f"waves={ctas / (resident * dev.sm_count):.2f}  {moved / (ms * 1e-3) / 1e12:.2f} TB/s "
              f"step {ms * 1e3:7.1f} | split {fmt(times['split'])} combine {fmt(times['combine'])} "
              f"gap {fmt(times['gap'])} span {fmt(times['span'])} | err {err:.1e}", flush=True)
    del sets, dev_sets, reference_out
    torch.cuda.empty_cache()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", choices=list(SHAPES), default=list(SHAPES))
    parser.add_argument("--ctas-per-sm", nargs="+", type=int, help="CTAs an SM is taken to hold (default: the plan's)")
    parser.add_argument("--stages", nargs="+", type=int, help="ring depths (default: the plan's)")
    parser.add_argument("--cache", choices=["bf16", "e4m3"], default="bf16",
                        help="the caches' dtype (e4m3: per-(token, kv head) scales, as bench_decode's fp8 rows)")
    parser.add_argument("--waves", nargs="+", type=int, help="grid targets in waves of resident CTAs "
                                                             "(default: the plan's)")
    args = parser.parse_args()
    from bench_common import copy_bandwidth_tbs, stream, torch_cuda

    torch = torch_cuda()  # its current stream is bench_common's, which time_ms times
    if torch is None:
        print("decode_sweep: needs torch with CUDA (inputs, the reference, the kernel profile)", file=sys.stderr)
        return 1
    import ptxattn

    dev = ptxattn.get_device(0)
    print(f"{dev.name}: {dev.sm_count} SMs, copy {copy_bandwidth_tbs():.2f} TB/s; bf16 Hq{HQ} Hkv{HKV} D{D} Sq1; "
          f"times in us", flush=True)
    for name in args.shapes:
        sweep_shape(torch, name, *SHAPES[name], stream(), dev, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
