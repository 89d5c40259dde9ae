"""Host cost of launching: a bare kernel launch through ptxattn's path next to raw
cuda-python, then what a user's op call costs on the host (eager on DeviceArrays, on torch
tensors and CuPy arrays, prepared, and the raw cuLaunchKernel calls of the same launches)
beside torch's F.scaled_dot_product_attention, and eager decode and sdpa back to back against
their replayed graphs.

Host microseconds per call are the median over calls each made with an empty queue (after a
synchronize), so they are the host's cost alone. With --baseline DIR the eager op calls of
the ptxattn importable from DIR (an earlier version) are timed too, in a child process.
"""
from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import ptxattn
from ptxattn.context import on_device
from ptxattn.driver import cu, hot
from ptxattn.module import get_kernel
from ptxattn.ops.prepared import programmatic_config
from ptxattn.ops.probe import ProbeParams

from bench_common import back_to_back_us, host_us_each
from bench_prefill import Shape

CALLS = 300


def _per_launch_us(launch, count: int) -> float:
    for _ in range(200):
        launch()
    start = time.perf_counter()
    for _ in range(count):
        launch()
    return (time.perf_counter() - start) / count * 1e6


def _interleaved(fns, sync, rounds: int = 5) -> list[float]:
    """`host_us_each` of each function, measured in turn over several rounds; the best median of
    each, so that a burst of noise on the host does not land on one path only."""
    best = [float("inf")] * len(fns)
    for _ in range(rounds):
        for i, fn in enumerate(fns):
            best[i] = min(best[i], host_us_each(fn, sync, CALLS // 2))
    return best


def _probe_rows(args, dev) -> list[dict]:
    count = 2000 if args.quick else 20000
    rows = []
    stream = ptxattn.Stream.create()
    kernel = get_kernel("probe_store", dev)
    params = ProbeParams(None, 0)

    def ours():
        kernel.launch((1, 1, 1), (32, 1, 1), params, stream)

    def ours_with_lookup():
        with on_device(dev):
            get_kernel("probe_store", dev).launch((1, 1, 1), (32, 1, 1), params, stream)

    argv = params.kernel_args

    def raw():
        cu.cuLaunchKernel(kernel.function, 1, 1, 1, 32, 1, 1, 0, stream.handle, argv, 0)

    # Decode's combine goes out this way on sm_90 (Binding.launch_all: the cached config, the
    # stream set per call), with the programmatic-serialization attribute.
    config = programmatic_config((1, 1, 1), (32, 1, 1), 0)

    def raw_ex():
        config.hStream = stream.ptr
        cu.cuLaunchKernelEx(config, kernel.function, argv, 0)

    u, vp = ctypes.c_uint, ctypes.c_void_p
    c_launch = hot().lib.cuLaunchKernel
    c_launch.restype, c_launch.argtypes = ctypes.c_int, [vp, u, u, u, u, u, u, u, vp, vp, vp]
    fn_handle, stream_handle = int(kernel.function), stream.ptr

    def raw_ctypes():
        c_launch(fn_handle, 1, 1, 1, 32, 1, 1, 0, stream_handle, argv, None)

    for name, fn in (("raw cuda-python cuLaunchKernel", raw),
                     ("raw cuda-python cuLaunchKernelEx, programmatic (as decode's combine)", raw_ex),
                     ("raw ctypes libcuda cuLaunchKernel", raw_ctypes),
                     ("ptxattn Kernel.launch", ours),
                     ("ptxattn context check + kernel lookup + launch", ours_with_lookup)):
        us = min(_per_launch_us(fn, count) for _ in range(3))
        stream.synchronize()
        rows.append({"path": name, "us_per_call": us})

    with ptxattn.capture(stream, dev) as graph:
        for _ in range(100):
            ours()
    graph.replay()
    stream.synchronize()
    start = time.perf_counter()
    replays = 20 if args.quick else 200
    for _ in range(replays):
        graph.replay()
    stream.synchronize()
    rows.append({"path": "graph replay of 100 launches (per kernel, incl. GPU time)",
                 "us_per_call": (time.perf_counter() - start) / (replays * 100) * 1e6})
    graph.close()
    stream.close()
    return rows


def op_cases(np, stream):
    """(name, arrays, eager call) of the op calls timed, on calls every version has: sdpa into
    out=, decode into out= with workspace=."""
    bf16 = ptxattn.bfloat16
    rng = np.random.default_rng(0)

    def rand(*shape):
        return ptxattn.asarray(rng.standard_normal(shape).astype(bf16), stream)

    q, k, v, out = rand(2, 8, 512, 128), rand(2, 8, 512, 128), rand(2, 8, 512, 128), rand(2, 8, 512, 128)
    dq, kc, vc, dout = rand(8, 32, 1, 128), rand(8, 8, 4096, 128), rand(8, 8, 4096, 128), rand(8, 32, 1, 128)
    lens = ptxattn.asarray(np.full(8, 3000, np.int32), stream)
    ws = ptxattn.empty((max(ptxattn.decode_workspace_bytes(dq, kc, vc), 1),), np.uint8)
    stream.synchronize()
    return [
        ("sdpa B2 H8 S512 D128 causal, out=", (q, k, v, out),
         lambda q=q, k=k, v=v, out=out: ptxattn.sdpa(q, k, v, causal=True, out=out, stream=stream)),
        ("decode B8 Hq32 Hkv8 T4096 D128, out= workspace=", (dq, kc, vc, lens, dout, ws),
         lambda q=dq, k=kc, v=vc, lens=lens, out=dout, ws=ws: ptxattn.decode(q, k, v, lens, out=out, workspace=ws,
                                                                            stream=stream)),
    ]


def eager_op_host_us(np) -> dict:
    """{case: host us} of the eager op calls (also run under a baseline version)."""
    stream = ptxattn.Stream.create()
    return {name: host_us_each(call, stream.synchronize, CALLS) for name, _, call in op_cases(np, stream)}


def _baseline_rows(directory: str) -> list[dict]:
    code = ("import sys, json, numpy as np; sys.path.insert(0, sys.argv[1]); import bench_launch as b, ptxattn; "
            "print(json.dumps([ptxattn.__file__, b.eager_op_host_us(np)]))")
    child = subprocess.run([sys.executable, "-c", code, str(Path(__file__).resolve().parent)], capture_output=True,
                           text=True, env={**os.environ, "PYTHONPATH": directory})
    if child.returncode != 0:
        print(f"  (baseline failed: {(child.stderr.strip().splitlines() or ['?'])[-1]})")
        return []
    where, timings = json.loads(child.stdout.strip().splitlines()[-1])
    return [{"path": f"baseline ({where.rsplit('/', 2)[-2]}) eager: {name}", "us_per_call": us}
            for name, us in timings.items()]


def _foreign_rows(np, cases, stream) -> list[dict]:
    """The same eager calls with torch tensors and CuPy arrays passed in, and torch's SDPA."""
    rows, torch_us = [], {}
    try:
        import torch
    except ImportError:
        torch = None
    if torch is not None and torch.cuda.is_available():
        import torch.nn.functional as F

        tstream = torch.cuda.Stream()
        for name, arrays, _ in cases:
            tensors = [torch.from_dlpack(a) for a in arrays]
            if name.startswith("sdpa"):
                q, k, v, out = tensors
                ours = lambda: ptxattn.sdpa(q, k, v, causal=True, out=out, stream=tstream.cuda_stream)  # noqa: E731
                theirs = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True)  # noqa: E731
            else:
                q, k, v, lens, out, ws = tensors
                ours = lambda: ptxattn.decode(q, k, v, lens, out=out, workspace=ws,  # noqa: E731
                                              stream=tstream.cuda_stream)
                theirs = lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True)  # noqa: E731
            with torch.cuda.stream(tstream):
                ours_us, theirs_us = _interleaved((ours, theirs), torch.cuda.synchronize)
            rows.append({"path": f"eager, torch tensors: {name}", "us_per_call": ours_us,
                         "vs_torch_sdpa": ours_us / theirs_us})
            rows.append({"path": f"torch F.scaled_dot_product_attention: {name.split(',')[0]}",
                         "us_per_call": theirs_us})
            torch_us[name] = theirs_us
    try:
        import cupy as cp
    except ImportError:
        return rows
    s = cp.cuda.Stream(non_blocking=True)
    with s:
        for name, arrays, _ in cases:
            if name.startswith("sdpa"):
                continue  # CuPy has no bfloat16; the decode case below is float16
            q, k, v, lens, out, ws = (cp.asarray(a.get().astype(np.float16) if a.dtype == ptxattn.bfloat16 else a.get())
                                      for a in arrays)
            call = lambda: ptxattn.decode(q, k, v, lens, out=out, workspace=ws, stream=s.ptr)  # noqa: E731
            cupy_us = min(_interleaved((call,), s.synchronize))
            rows.append({"path": f"eager, CuPy arrays (float16): {name}", "us_per_call": cupy_us,
                         "vs_torch_sdpa": cupy_us / torch_us[name] if name in torch_us else None})
    return rows


def _back_to_back_rows(label: str, modes: dict, stream, calls: int, rate) -> list[dict]:
    """A row per mode (name -> call; one is "graph replay") of `label`, its calls queued back to
    back: microseconds a call, `rate(us)` (name, value) and the replay's time over the mode's."""
    times = {mode: back_to_back_us(fn, stream, calls) for mode, fn in modes.items()}
    rows = []
    for mode, us in times.items():
        unit, value = rate(us)
        rows.append({"path": f"{label} back to back: {mode}", "us_per_call": us, unit: value,
                     "vs_graph_replay": times["graph replay"] / us})
    return rows


def _eager_decode_rows(args, np, dev) -> list[dict]:
    """Eager decode back to back (what a user's loop sees), with and without out= and
    workspace=, against the same step replayed from a graph: TB/s of the keys read."""
    rows = []
    bf16 = ptxattn.bfloat16
    stream = ptxattn.Stream.create()
    calls = 20 if args.quick else 100
    for batch, cap in ((64, 8192), (1, 32768)):
        rng = np.random.default_rng(1)
        q = ptxattn.asarray(rng.standard_normal((batch, 32, 1, 128)).astype(bf16), stream)
        block = rng.standard_normal((1, 8, cap, 128)).astype(bf16)
        kc, vc = (ptxattn.asarray(np.broadcast_to(block, (batch, 8, cap, 128)), stream) for _ in range(2))
        lens = ptxattn.asarray(np.full(batch, cap, np.int32), stream)
        out = ptxattn.empty((batch, 32, 1, 128), bf16)
        ws = ptxattn.empty((max(ptxattn.decode_workspace_bytes(q, kc, vc), 1),), np.uint8)
        with ptxattn.capture(stream, dev) as graph:
            ptxattn.decode(q, kc, vc, lens, out=out, workspace=ws, stream=stream)
        modes = {
            "eager, nothing preallocated": lambda: ptxattn.decode(q, kc, vc, lens, stream=stream),
            "eager, out= workspace=": lambda: ptxattn.decode(q, kc, vc, lens, out=out, workspace=ws, stream=stream),
            "graph replay": graph.replay,
        }
        moved = 2 * batch * 8 * cap * 128 * 2 + 2 * batch * 32 * 128 * 2
        rows += _back_to_back_rows(f"decode B{batch} T{cap} bf16 Hq32 Hkv8 D128", modes, stream, calls,
                                   lambda us: ("tb_per_s", moved / (us * 1e-6) / 1e12))
        graph.close()
        del kc, vc
    return rows


def _eager_sdpa_rows(args, np, dev) -> list[dict]:
    """Eager sdpa back to back on a short causal shape with more blocks than SMs, which an sm_90
    GPU runs on the persistent twin, whose output's tensor map an eager call without out=
    re-encodes for each new output: with and without out=, against a graph replay; TFLOP/s."""
    bf16 = ptxattn.bfloat16
    stream = ptxattn.Stream.create()
    rng = np.random.default_rng(2)
    row = Shape(32, 16, 16, 512, 128, 128, True)  # the prefill suite's row, its FLOPs counted as there
    shape = (row.b, row.hq, row.s, row.dqk)
    q, k, v = (ptxattn.asarray(rng.standard_normal(shape).astype(bf16), stream) for _ in range(3))
    out = ptxattn.empty(shape, bf16)
    with ptxattn.capture(stream, dev) as graph:
        ptxattn.sdpa(q, k, v, causal=True, out=out, stream=stream)
    modes = {
        "eager, nothing preallocated": lambda: ptxattn.sdpa(q, k, v, causal=True, stream=stream),
        "eager, out=": lambda: ptxattn.sdpa(q, k, v, causal=True, out=out, stream=stream),
        "graph replay": graph.replay,
    }
    rows = _back_to_back_rows(f"sdpa {row.name} bf16", modes, stream, 20 if args.quick else 100,
                              lambda us: ("tflops", row.flops / (us * 1e-6) / 1e12))
    graph.close()
    return rows


def run(args) -> list[dict]:
    import numpy as np

    dev = ptxattn.get_device(0)
    with on_device(dev):
        rows = _probe_rows(args, dev)
        stream = ptxattn.Stream.create()
        cases = op_cases(np, stream)
        for name, arrays, call in cases:
            prepared = (ptxattn.prepare(ptxattn.sdpa, *arrays[:3], causal=True, out=arrays[3], stream=stream)
                        if name.startswith("sdpa") else
                        ptxattn.prepare(ptxattn.decode, *arrays[:4], out=arrays[4], workspace=arrays[5], stream=stream))
            launches = [(launch.function, *launch.grid, *launch.block, launch.shared, launch.argv)
                        for launch in prepared.launches]

            def raw(launches=launches, handle=stream.handle):
                for fn, gx, gy, gz, bx, by, bz, shared, argv in launches:
                    cu.cuLaunchKernel(fn, gx, gy, gz, bx, by, bz, shared, handle, argv, 0)

            raw_us, prepared_us, eager_us = _interleaved((raw, prepared.run, call), stream.synchronize)
            rows.append({"path": f"eager, DeviceArrays: {name}", "us_per_call": eager_us})
            rows.append({"path": f"prepared run: {name}", "us_per_call": prepared_us,
                         "vs_raw_launches": prepared_us / raw_us})
            rows.append({"path": f"raw cuLaunchKernel x{len(launches)} of the same launches: {name}",
                         "us_per_call": raw_us})
        rows += _foreign_rows(np, cases, stream)
        if getattr(args, "baseline", None):
            rows += _baseline_rows(args.baseline)
        rows += _eager_decode_rows(args, np, dev)
        rows += _eager_sdpa_rows(args, np, dev)
    return rows
