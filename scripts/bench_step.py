"""A 32-layer decode step (kv_append + decode per layer, bf16 B8 Hq32 Hkv8 D128, capacity
4096, ~2048 live keys): eager, prepared, and one captured graph replayed per token.

host us/step: the time to issue one step with an empty queue (the median over steps, each
after a synchronize), so it is the host's cost alone. device us/step: the time per step of
back-to-back steps between two events, the host running ahead as it does for a user (a step
whose host cost exceeds its kernels' time shows it here). kernel_sum_us: the sum of the
step's kernel durations (CUPTI through torch.profiler, when torch is there); the graph's
device time over it says what the replay adds. With --baseline DIR (a copy of an earlier
ptxattn, importable from DIR) the eager step of that version is measured in a child process,
through the calls both versions have, so "today's eager step" is a number of the same run.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from bench_common import back_to_back_us, host_us_each

LAYERS, B, HQ, HKV, D, CAPACITY, LIVE = 32, 8, 32, 8, 128, 4096, 2048
STEPS = 64


def _build(ptxattn, np, stream):
    """Per-layer inputs, caches and outputs; the eager step uses only calls every version has."""
    bf16 = ptxattn.bfloat16
    rng = np.random.default_rng(0)
    layers = []
    cache = rng.standard_normal((B, HKV, CAPACITY, D)).astype(bf16)
    for _ in range(LAYERS):
        q = ptxattn.asarray(rng.standard_normal((B, HQ, 1, D)).astype(bf16), stream)
        k_new, v_new = (ptxattn.asarray(rng.standard_normal((B, HKV, 1, D)).astype(bf16), stream) for _ in range(2))
        kc, vc = ptxattn.asarray(cache, stream), ptxattn.asarray(cache, stream)
        lens = ptxattn.asarray(np.full(B, LIVE, np.int32), stream)
        out = ptxattn.empty((B, HQ, 1, D), bf16)
        ws = ptxattn.empty((max(ptxattn.decode_workspace_bytes(q, kc, vc), 1),), np.uint8)
        layers.append((q, k_new, v_new, kc, vc, lens, out, ws))
    stream.synchronize()

    def eager():
        for q, k_new, v_new, kc, vc, lens, out, ws in layers:
            ptxattn.kv_append(k_new, v_new, kc, vc, lens, stream=stream)
            ptxattn.decode(q, kc, vc, lens, out=out, workspace=ws, stream=stream)
    return layers, eager


def _reset_lengths(layers, np, stream) -> None:
    """Back to LIVE keys a row, so no mode runs past the capacity."""
    for layer in layers:
        layer[5].set(np.full(B, LIVE, np.int32), stream)


def _kernel_sum_us(replay, stream, replays: int = 10):
    """The summed durations of the kernels one replay runs, from CUPTI (torch.profiler)."""
    try:
        import torch
        from torch.profiler import ProfilerActivity, profile
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    replay()
    stream.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            replay()
        stream.synchronize()
    kernels = [e for e in prof.events() if e.device_type.name == "CUDA" and "memcpy" not in e.name.lower()
               and "memset" not in e.name.lower()]
    return sum(e.device_time_total for e in kernels) / replays if kernels else None


def _baseline_eager_host_us(directory: str):
    """Host us/step of the eager step under an earlier ptxattn importable from `directory`."""
    code = ("import sys, json, numpy as np, ptxattn; sys.path.insert(0, sys.argv[1]); import bench_step as b; "
            "s = ptxattn.Stream.create(); layers, eager = b._build(ptxattn, np, s); "
            "print(json.dumps([ptxattn.__file__, b.host_us_each(eager, s.synchronize, b.STEPS)]))")
    child = subprocess.run([sys.executable, "-c", code, str(Path(__file__).resolve().parent)], capture_output=True,
                           text=True, env={**os.environ, "PYTHONPATH": directory})
    if child.returncode != 0:
        print(f"  (baseline failed: {child.stderr.strip().splitlines()[-1] if child.stderr.strip() else '?'})")
        return None
    where, us = json.loads(child.stdout.strip().splitlines()[-1])
    print(f"  baseline eager step measured with {where}")
    return us


def run(args) -> list[dict]:
    import numpy as np

    import ptxattn
    from ptxattn.context import on_device

    dev = ptxattn.get_device(0)
    with on_device(dev):
        stream = ptxattn.Stream.create()
        layers, eager = _build(ptxattn, np, stream)
        prepared_calls = []
        for q, k_new, v_new, kc, vc, lens, out, ws in layers:
            prepared_calls.append(ptxattn.prepare(ptxattn.kv_append, k_new, v_new, kc, vc, lens, stream=stream))
            prepared_calls.append(ptxattn.prepare(ptxattn.decode, q, kc, vc, lens, out=out, workspace=ws,
                                                  stream=stream))

        def prepared():
            for call in prepared_calls:
                call.run()

        with ptxattn.capture(stream, dev) as graph:
            prepared()
        modes = {"eager": eager, "prepared": prepared, "graph": graph.replay}
        rows = []
        kernel_sum = _kernel_sum_us(graph.replay, stream)
        _reset_lengths(layers, np, stream)
        baseline = _baseline_eager_host_us(args.baseline) if getattr(args, "baseline", None) else None
        for mode, step in modes.items():
            host = host_us_each(step, stream.synchronize, STEPS)
            _reset_lengths(layers, np, stream)
            device = back_to_back_us(step, stream, STEPS)
            _reset_lengths(layers, np, stream)
            row = {"shape": f"{LAYERS} layers B{B} Hq{HQ} Hkv{HKV} D{D} T{CAPACITY} live {LIVE}", "mode": mode,
                   "host_us_per_step": host, "device_us_per_step": device, "kernel_sum_us": kernel_sum,
                   "device_vs_kernel_sum": device / kernel_sum if kernel_sum else None,
                   "launches_per_step": sum(len(c.launches) for c in prepared_calls)}
            if baseline:
                row["baseline_eager_host_us"] = baseline
                row["host_speedup_vs_baseline_eager"] = baseline / host
            rows.append(row)
        graph.close()
    return rows
