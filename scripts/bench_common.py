"""Timing helpers shared by every benchmark suite (run on the GPU machine, with torch).

Inputs come from torch (random, never zeros) and reach ptxattn zero-copy through DLPack;
every timed function runs on torch's current stream, so one pair of CUDA events brackets
ours and PyTorch's work alike.
"""
from __future__ import annotations

import statistics
import time


def suite_torch(suite: str):
    """torch with CUDA for a suite (its inputs, timing and comparisons), or None after saying
    the suite is skipped."""
    try:
        import torch
    except ImportError:
        torch = None
    if torch is None or not torch.cuda.is_available():
        print(f"{suite}: needs torch with CUDA (inputs, timing, comparisons); skipped")
        return None
    return torch


def time_ms(fn, *, warmup: int = 5, repeat: int = 30, rotate: int = 1, batch: int = 4) -> float:
    """Device milliseconds per call of `fn(i)`: the median over `repeat` samples, each a
    CUDA-event pair around max(rotate, batch) back-to-back calls. `fn` receives the call
    index modulo `rotate`, so callers can cycle through input sets that together exceed the
    L2 cache.

    Before each start event the stream gets a spin kernel that outlasts the host's work of
    queueing the sample's calls, so the events bracket the calls' device time alone and a
    backend's host cost per call (ours ~45 us of Python for sdpa, less for PyTorch) cannot
    leave the device idle inside the timed window; `host_ms` reports that cost."""
    import torch

    calls = max(rotate, batch)
    spin_cycles = int(SPIN_MARGIN * calls * host_ms(fn, warmup, rotate) * 1e-3 * MAX_CLOCK_HZ)
    torch.cuda.synchronize()
    times = []
    for _ in range(repeat):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(spin_cycles)
        start.record()
        for i in range(calls):
            fn(i % rotate)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / calls)
    return statistics.median(times)


SPIN_MARGIN = 2.0     # the spin lasts twice the measured queueing time
MAX_CLOCK_HZ = 2.0e9  # at or above the H200's boost clock (1.98 GHz): the spin errs long


def host_ms(fn, calls: int = 5, rotate: int = 1) -> float:
    """Host milliseconds to queue one call of `fn(i)` (the median of `calls` calls, each
    after a synchronize so none waits on a full queue); the first call also warms up."""
    import torch

    fn(0)
    torch.cuda.synchronize()
    samples = []
    for i in range(calls):
        begin = time.perf_counter()
        fn(i % rotate)
        samples.append((time.perf_counter() - begin) * 1e3)
        torch.cuda.synchronize()
    return statistics.median(samples)


def copy_bandwidth_tbs(nbytes: int = 2 << 30) -> float:
    """Device-to-device copy bandwidth (bytes read + bytes written per second), in TB/s."""
    import torch

    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    ms = time_ms(lambda i: dst.copy_(src), warmup=3, repeat=20)
    return 2 * nbytes / (ms * 1e-3) / 1e12


def rotation_count(bytes_per_set: int, l2_bytes: int = 60 << 20) -> int:
    """How many input sets make one pass through them at least 4x the L2."""
    return max(1, -(-4 * l2_bytes // max(bytes_per_set, 1)))


def torch_sdpa_backends():
    """{name: callable(q, k, v, is_causal, enable_gqa)} for PyTorch's flash and cuDNN SDPA."""
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel
    import torch.nn.functional as F

    def make(backend):
        def run(q, k, v, is_causal=False, enable_gqa=False):
            with sdpa_kernel([backend]):
                return F.scaled_dot_product_attention(q, k, v, is_causal=is_causal, enable_gqa=enable_gqa)
        return run

    return {"torch_flash": make(SDPBackend.FLASH_ATTENTION), "torch_cudnn": make(SDPBackend.CUDNN_ATTENTION)}


def try_time(fn, **kwargs):
    """time_ms, or None with the reason printed when a backend refuses the shape."""
    try:
        return time_ms(fn, **kwargs)
    except RuntimeError as exc:
        print(f"  (skipped: {str(exc).splitlines()[0][:120]})")
        return None
