"""The runtime on a real device: contexts restored, external streams, DLPack/CAI exchange
with CuPy and PyTorch, graphs, memory errors and leaks."""
from __future__ import annotations

import gc
import time

import numpy as np
import pytest

import ptxattn
from ptxattn.context import on_device
from ptxattn.driver import CudaError, call, cu
from ptxattn.memory import live_device_bytes
from ptxattn.ops.probe import ProbeParams, probe_kernel

pytestmark = pytest.mark.gpu


@pytest.fixture
def dev():
    return ptxattn.get_device(0)


def _current():
    ctx = call(cu.cuCtxGetCurrent)
    return 0 if ctx is None else int(ctx)


def _store(dev, value, stream=None):
    cell = ptxattn.zeros((1,), np.int32, dev, stream)
    with on_device(dev):
        probe_kernel(dev).launch((1, 1, 1), (32, 1, 1), ProbeParams(cell.ptr, value), ptxattn.as_stream(stream))
    return cell


def test_no_context_current_stays_none(dev):
    while _current():  # start from an empty context stack
        call(cu.cuCtxPopCurrent)
    assert int(_store(dev, 5).get()[0]) == 5
    assert _current() == 0


def test_callers_context_is_used_and_kept(dev):
    call(cu.cuCtxPushCurrent, dev.primary_context)
    try:
        before = _current()
        assert int(_store(dev, 6).get()[0]) == 6
        assert _current() == before
    finally:
        call(cu.cuCtxPopCurrent)


def test_context_restored_on_error(dev):
    while _current():
        call(cu.cuCtxPopCurrent)
    with pytest.raises(CudaError, match="cuLaunchKernel"):
        with on_device(dev):
            # 2048 threads a block is over every device's limit: the launch itself fails.
            probe_kernel(dev).launch((1, 1, 1), (2048, 1, 1), ProbeParams(None, 0), ptxattn.as_stream(None))
    assert _current() == 0
    assert int(_store(dev, 8).get()[0]) == 8  # and the context still works


def test_cuda_error_names_call_result_and_text(dev):
    with on_device(dev), pytest.raises(CudaError) as info:
        call(cu.cuMemFree, 0xDEAD0000)
    err = info.value
    assert err.call == "cuMemFree" and err.result.startswith("CUDA_ERROR_") and err.text


def test_owned_and_external_streams(dev):
    torch = pytest.importorskip("torch")
    with on_device(dev):
        own = ptxattn.Stream.create()
    assert int(_store(dev, 11, own).get(own)[0]) == 11
    own.close()
    ts = torch.cuda.Stream()
    assert int(_store(dev, 12, ts).get(ts)[0]) == 12  # through __cuda_stream__
    assert int(_store(dev, 13, ts.cuda_stream).get(ts.cuda_stream)[0]) == 13  # a raw handle
    ts.synchronize()  # the borrowed stream was not destroyed


def test_streams_and_events_need_no_context_from_the_caller(dev):
    while _current():
        call(cu.cuCtxPopCurrent)
    s = ptxattn.Stream.create()
    start = ptxattn.Event(timing=True).record(s)
    end = ptxattn.Event(timing=True).record(s)
    end.synchronize()
    assert start.elapsed_ms(end) >= 0.0
    assert _current() == 0


def test_events_measure_time(dev):
    """Events bracket the work between them: device-to-device copies of 1 GiB take no less
    than a copy at 20 TB/s (four times the fastest HBM) would, no more than the wall clock
    around them, and four copies take about four times one."""
    nbytes = 1 << 30
    src, dst = ptxattn.empty((nbytes,), np.uint8, dev), ptxattn.empty((nbytes,), np.uint8, dev)
    with on_device(dev):
        s = ptxattn.Stream.create()

        def timed(copies: int) -> float:
            begin = time.perf_counter()
            start = ptxattn.Event(timing=True).record(s)
            for _ in range(copies):
                call(cu.cuMemcpyDtoDAsync, dst.ptr, src.ptr, nbytes, s.handle)
            end = ptxattn.Event(timing=True).record(s)
            end.synchronize()
            wall_ms = (time.perf_counter() - begin) * 1e3
            ms = start.elapsed_ms(end)
            assert 2 * nbytes / 20e12 * 1e3 < ms <= wall_ms, (ms, wall_ms)
            return ms

        timed(1)  # warm-up
        one, four = timed(1), timed(4)
    assert 3.0 < four / one < 5.0, (one, four)


def test_numpy_round_trip_every_dtype(dev, rng):
    for dtype in (np.float16, ptxattn.bfloat16, np.float32, np.int32, np.int64, np.bool_, np.uint8):
        host = (rng.standard_normal((3, 5, 7)) * 10).astype(dtype)
        arr = ptxattn.asarray(host)
        assert arr.dtype == np.dtype(dtype)
        np.testing.assert_array_equal(arr.get(), host)
        np.testing.assert_array_equal(arr[1:, 2].get(), host[1:, 2])


def test_cupy_round_trip(dev, rng):
    cp = pytest.importorskip("cupy")
    host = rng.standard_normal((4, 6)).astype(np.float32)
    arr = ptxattn.asarray(host)
    via_cai = cp.asarray(arr)
    via_dlpack = cp.from_dlpack(arr)
    assert via_cai.data.ptr == arr.ptr == via_dlpack.data.ptr  # no copies
    np.testing.assert_array_equal(cp.asnumpy(via_dlpack), host)
    back = ptxattn.from_dlpack(cp.asarray(host) * 2)
    np.testing.assert_array_equal(back.get(), host * 2)
    cai_back = ptxattn.asarray(cp.asarray(host)[:, ::2])  # strided, through DLPack
    np.testing.assert_array_equal(cai_back.get(), host[:, ::2])


def test_torch_round_trip_bf16(dev, rng):
    torch = pytest.importorskip("torch")
    t = torch.randn(8, 16, dtype=torch.bfloat16, device="cuda")
    arr = ptxattn.from_dlpack(t)
    assert arr.dtype == ptxattn.bfloat16 and arr.ptr == t.data_ptr()
    np.testing.assert_array_equal(arr.get().astype(np.float32), t.float().cpu().numpy())
    back = torch.from_dlpack(arr)
    assert back.data_ptr() == arr.ptr and back.dtype == torch.bfloat16
    assert torch.equal(back, t)
    strided = ptxattn.from_dlpack(t.t())  # a transposed view keeps its strides
    np.testing.assert_array_equal(strided.get().astype(np.float32), t.t().float().cpu().numpy())


def test_graph_capture_replay_update(dev):
    with on_device(dev):
        s = ptxattn.Stream.create()
        # Zeroed on s: s is non-blocking, so a memset on the legacy stream would race the reads.
        cell = ptxattn.zeros((1,), np.int32, dev, stream=s)
        params = ProbeParams(cell.ptr, 21)
        kernel = probe_kernel(dev)
        with ptxattn.capture(s, dev) as g:
            kernel.launch((1, 1, 1), (32, 1, 1), params, s)
        assert int(cell.get(s)[0]) == 0  # captured, not run
        g.replay()
        assert int(cell.get(s)[0]) == 21
        params.value = 22  # a new graph with new arguments updates the instantiated one
        with ptxattn.capture(s, dev) as g2:
            kernel.launch((1, 1, 1), (32, 1, 1), params, s)
        g.update(g2)
        g.replay()
        assert int(cell.get(s)[0]) == 22


def test_pool_buffers_are_stream_ordered(dev):
    """A buffer made on a stream comes from ptxattn's pool and goes back to it in the stream's
    order: allocation, use and release queue behind a long kernel without waiting for it."""
    from ptxattn.memory import DeviceBuffer, pool_bytes_in_use

    with on_device(dev):
        s = ptxattn.Stream.create()
        s.synchronize()
        before = pool_bytes_in_use(dev), live_device_bytes()
        buffer = DeviceBuffer(1 << 20, dev, s)
        assert pool_bytes_in_use(dev) >= before[0] + (1 << 20)
        call(cu.cuMemsetD8Async, buffer.ptr, 7, 1 << 20, s.handle)
        host = np.zeros(16, np.uint8)
        call(cu.cuMemcpyDtoHAsync, host.ctypes.data, buffer.ptr, 16, s.handle)
        buffer.close()
        s.synchronize()
        assert (host == 7).all()
        assert (pool_bytes_in_use(dev), live_device_bytes()) == before


def test_out_of_memory_names_bytes(dev):
    with pytest.raises(ptxattn.OutOfMemoryError, match=r"asked for 1,125,899,906,842,624 bytes, [\d,]+ free of [\d,]+"):
        ptxattn.empty((1 << 50,), np.uint8, dev)
    assert int(_store(dev, 3).get()[0]) == 3


def test_no_device_memory_leaked(dev, rng):
    _store(dev, 1).get()  # warm: modules and caches exist before the baseline
    gc.collect()
    before = live_device_bytes()
    for _ in range(20):
        host = rng.standard_normal((64, 64)).astype(np.float32)
        a = ptxattn.asarray(host)
        a[3:].get()
        _store(dev, 2).get()
    del a
    gc.collect()
    assert live_device_bytes() == before


def test_bad_ptx_error_carries_jit_log(dev):
    from ptxattn.module import PtxLoadError, load_ptx

    bad = b".version 8.0\n.target sm_80\n.address_size 64\n.visible .entry broken() { this is not ptx; }\n"
    with on_device(dev), pytest.raises(PtxLoadError, match=r"(?s)loading broken\.ptx .*JIT log:\n.*\S"):
        load_ptx(bad, "broken.ptx", dev)
    assert int(_store(dev, 4).get()[0]) == 4


def test_each_kernel_is_a_module_of_its_own(dev):
    """The driver JIT-compiles a module whole: a kernel's module holds that kernel alone
    (ptx_text.py), from the arch the device loads."""
    from ptxattn.module import get_kernel

    with on_device(dev):
        for name in ("merge_bf16_bf16", "decode_split_bf16_d128", "kv_append"):
            module = call(cu.cuFuncGetModule, get_kernel(name, dev).function)
            assert call(cu.cuModuleGetFunctionCount, module) == 1, name


def test_pinned_buffer_async_copies(dev, rng):
    from ptxattn.memory import PinnedBuffer

    host = rng.standard_normal(4096).astype(np.float32)
    pinned = PinnedBuffer(host.nbytes, dev)
    staged = pinned.array(np.float32, host.shape)
    staged[...] = host
    arr = ptxattn.empty(host.shape, np.float32, dev)
    with on_device(dev):
        s = ptxattn.Stream.create()
        call(cu.cuMemcpyHtoDAsync, arr.ptr, pinned.ptr, host.nbytes, s.handle)
        s.synchronize()  # the copy may still read the pinned bytes until then
        staged[...] = 0
        call(cu.cuMemcpyDtoHAsync, pinned.ptr, arr.ptr, host.nbytes, s.handle)
        s.synchronize()
    np.testing.assert_array_equal(staged, host)
    pinned.close()
