"""Timing, inputs and the copy-bandwidth line shared by every benchmark suite (GPU machine).

Everything runs on ptxattn alone: inputs are made with NumPy and uploaded, every timed call
goes to one ptxattn stream (`stream()`), ptxattn events bracket it, and the copy-bandwidth
line is the driver's device-to-device copy. When torch with CUDA is importable (`torch_cuda()`),
suites add PyTorch's columns; torch then runs on that same stream, so the same events
bracket its work.
"""
from __future__ import annotations

import ctypes
import functools
import statistics
import time

import numpy as np

import ptxattn
from ptxattn.context import on_device
from ptxattn.driver import call, cu
from ptxattn.module import Kernel, ParamStruct, load_ptx


@functools.lru_cache(maxsize=None)
def stream() -> ptxattn.Stream:
    """The stream every suite runs and times its work on (device 0)."""
    with on_device(ptxattn.get_device(0)):
        return ptxattn.Stream.create()


@functools.lru_cache(maxsize=None)
def torch_cuda():
    """torch, its current stream set to `stream()`, when torch with CUDA is importable; else
    None (the suites then leave out PyTorch's columns)."""
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    torch.cuda.set_stream(torch.cuda.ExternalStream(stream().ptr))
    return torch


# Spins until `ns` nanoseconds of the global timer have passed since it started.
_SPIN_PTX = b"""
.version 7.0
.target sm_80
.address_size 64

.visible .entry bench_spin(.param .u64 ns)
{
    .reg .pred %p;
    .reg .b64 %start, %now, %ns;
    ld.param.u64 %ns, [ns];
    mov.u64 %start, %globaltimer;
SPIN:
    mov.u64 %now, %globaltimer;
    sub.u64 %now, %now, %start;
    setp.lt.u64 %p, %now, %ns;
    @%p bra SPIN;
    ret;
}
"""


class _SpinParams(ParamStruct):
    _fields_ = [("ns", ctypes.c_uint64)]


@functools.lru_cache(maxsize=None)
def _spin_kernel() -> Kernel:
    device = ptxattn.get_device(0)
    with on_device(device):
        module = load_ptx(_SPIN_PTX, "bench_common spin kernel", device)
        return Kernel("bench_spin", call(cu.cuModuleGetFunction, module, b"bench_spin"), "sm_80")


def spin(ns: int) -> None:
    """Keep `stream()` busy for `ns` nanoseconds (one thread of one SM)."""
    with on_device(ptxattn.get_device(0)):
        _spin_kernel().launch((1, 1, 1), (1, 1, 1), _SpinParams(ns), stream())


SPIN_MARGIN = 2.0  # the spin lasts twice the measured queueing time


def time_ms(fn, *, warmup: int = 5, repeat: int = 30, rotate: int = 1, batch: int = 4) -> float:
    """Device milliseconds per call of `fn(i)` on `stream()`: the median over `repeat`
    samples, each an event pair around max(rotate, batch) back-to-back calls. `fn` receives
    the call index modulo `rotate`, so callers can cycle through input sets that together
    exceed the L2 cache.

    Before each start event the stream gets a spin kernel that outlasts the host's work of
    queueing the sample's calls, so the events bracket the calls' device time alone and a
    backend's host cost per call (ours ~45 us of Python for sdpa, less for PyTorch) cannot
    leave the device idle inside the timed window; `host_ms` reports that cost."""
    calls = max(rotate, batch)
    spin_ns = int(SPIN_MARGIN * calls * host_ms(fn, warmup, rotate) * 1e6)
    start, end = ptxattn.Event(timing=True), ptxattn.Event(timing=True)
    times = []
    for _ in range(repeat):
        spin(spin_ns)
        start.record(stream())
        for i in range(calls):
            fn(i % rotate)
        end.record(stream())
        end.synchronize()
        times.append(start.elapsed_ms(end) / calls)
    return statistics.median(times)


def host_ms(fn, calls: int = 5, rotate: int = 1) -> float:
    """Host milliseconds to queue one call of `fn(i)` (the median of `calls` calls, each
    after a synchronize so none waits on a full queue); the first call also warms up."""
    fn(0)
    stream().synchronize()
    samples = []
    for i in range(calls):
        begin = time.perf_counter()
        fn(i % rotate)
        samples.append((time.perf_counter() - begin) * 1e3)
        stream().synchronize()
    return statistics.median(samples)


def host_us_each(fn, sync, calls: int) -> float:
    """Median host microseconds of one call of `fn()` made with an empty queue (`sync()`
    before each): the host's cost alone, on any stream or framework."""
    fn()
    samples = []
    for _ in range(calls):
        sync()
        begin = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - begin)
    sync()
    return statistics.median(samples) * 1e6


def back_to_back_us(fn, stream: ptxattn.Stream, calls: int, warmup: int = 5) -> float:
    """Microseconds per call of `calls` calls of `fn()` queued back to back on `stream` between
    two events, the host running ahead as in a user's loop: a call whose host cost exceeds
    its device time shows here."""
    for _ in range(warmup):
        fn()
    stream.synchronize()
    start = ptxattn.Event(timing=True).record(stream)
    for _ in range(calls):
        fn()
    end = ptxattn.Event(timing=True).record(stream)
    end.synchronize()
    return start.elapsed_ms(end) / calls * 1e3


def try_time(fn, **kwargs):
    """time_ms, or None with the reason printed when a backend refuses the shape."""
    try:
        return time_ms(fn, **kwargs)
    except RuntimeError as exc:
        print(f"  (skipped: {str(exc).splitlines()[0][:120]})")
        return None


def copy_bandwidth_tbs(nbytes: int = 2 << 30) -> float:
    """Device-to-device copy bandwidth through the driver (cuMemcpyDtoDAsync; bytes read +
    bytes written per second), in TB/s: the reference line for memory-bound ops."""
    device = ptxattn.get_device(0)
    src = ptxattn.zeros((nbytes,), np.uint8, device, stream())
    dst = ptxattn.empty((nbytes,), np.uint8, device)

    def copy(i):
        call(cu.cuMemcpyDtoDAsync, dst.ptr, src.ptr, nbytes, stream().handle)

    with on_device(device):
        ms = time_ms(copy, warmup=3, repeat=20)
    return 2 * nbytes / (ms * 1e-3) / 1e12


def finished_row(rows: list[dict], row: dict) -> None:
    """Appends a finished row and prints it at once (flushed), so that a run cut short (a
    timeout) still shows the rows it finished; the suite's table comes at the end."""
    rows.append(row)
    cells = (f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items() if k != "chart")
    print("row: " + " ".join(cells), flush=True)


def rows_named(pattern, rows: list, name_of, suite: str) -> list:
    """The rows whose name (`name_of(row)`) matches bench.py's --rows pattern (re.search); a
    pattern that matches none exits naming every row of the suite."""
    chosen = [row for row in rows if pattern.search(name_of(row))]
    if not chosen:
        raise SystemExit(f"bench.py --rows {pattern.pattern!r}: no {suite} row matches; the rows are "
                         + "; ".join(name_of(row) for row in rows))
    return chosen


def random_host(rng: np.random.Generator, shape, dtype, scale: float = 1.0) -> np.ndarray:
    """Standard-normal values times `scale`, in `dtype` (never zeros)."""
    return (rng.standard_normal(shape, dtype=np.float32) * np.float32(scale)).astype(dtype)


def upload(host: np.ndarray) -> ptxattn.DeviceArray:
    """`host` on device 0, copied on `stream()`."""
    return ptxattn.asarray(host, stream())


def rotation_count(bytes_per_set: int, l2_bytes: int = 60 << 20) -> int:
    """How many input sets make one pass through them at least 4x the L2."""
    return max(1, -(-4 * l2_bytes // max(bytes_per_set, 1)))


def relative_error(got, want) -> float:
    """‖got − want‖ / ‖want‖ in float64."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))


def torch_sdpa_backends():
    """{name: callable(q, k, v, is_causal, enable_gqa, attn_mask)} for PyTorch's flash and cuDNN SDPA."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    import torch.nn.functional as F

    def make(backend):
        def run(q, k, v, is_causal=False, enable_gqa=False, attn_mask=None):
            with sdpa_kernel([backend]):
                return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal,
                                                      enable_gqa=enable_gqa)
        return run

    return {"torch_flash": make(SDPBackend.FLASH_ATTENTION), "torch_cudnn": make(SDPBackend.CUDNN_ATTENTION)}
