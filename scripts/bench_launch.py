"""Host cost of one kernel launch through ptxattn's path, next to raw cuda-python.

Launches the empty `probe_store` kernel (out=null) many times back to back and divides the
host time; the stream is synchronized only at the end, so the GPU is never the bottleneck.
"""
from __future__ import annotations

import ctypes
import time

import ptxattn
from ptxattn.context import on_device
from ptxattn.driver import cu, hot
from ptxattn.module import get_kernel
from ptxattn.ops.probe import ProbeParams


def _per_launch_us(launch, count: int) -> float:
    for _ in range(200):
        launch()
    start = time.perf_counter()
    for _ in range(count):
        launch()
    return (time.perf_counter() - start) / count * 1e6


def run(args) -> list[dict]:
    count = 2000 if args.quick else 20000
    dev = ptxattn.get_device(0)
    rows = []
    with on_device(dev):
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

        u, vp = ctypes.c_uint, ctypes.c_void_p
        c_launch = hot().lib.cuLaunchKernel
        c_launch.restype, c_launch.argtypes = ctypes.c_int, [vp, u, u, u, u, u, u, u, vp, vp, vp]
        fn_handle, stream_handle = int(kernel.function), stream.ptr

        def raw_ctypes():
            c_launch(fn_handle, 1, 1, 1, 32, 1, 1, 0, stream_handle, argv, None)

        for name, fn in (("raw cuda-python cuLaunchKernel", raw), ("raw ctypes libcuda cuLaunchKernel", raw_ctypes),
                         ("ptxattn Kernel.launch", ours),
                         ("ptxattn context check + kernel lookup + launch", ours_with_lookup)):
            us = min(_per_launch_us(fn, count) for _ in range(3))
            stream.synchronize()
            rows.append({"path": name, "us_per_launch": us})

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
                     "us_per_launch": (time.perf_counter() - start) / (replays * 100) * 1e6})
        graph.close()
        stream.close()
    return rows
