"""Checks of the op layer's host logic against ptxattn.fake_driver, one per process (the fake
cannot be removed once installed): `python fake_driver_checks.py <check>` exits 0 when it
holds. tests/test_host_path_cpu.py runs each one."""
from __future__ import annotations

import ctypes
import sys
import threading

import ptxattn.fake_driver as fake

fake.install()

import numpy as np  # noqa: E402  (after the fake, before anything touches the driver)

import ptxattn  # noqa: E402
from ptxattn.faults import fault_buffer  # noqa: E402
from ptxattn.ops import prepared  # noqa: E402
from ptxattn.ops.checks import UNBOUNDED_WINDOW  # noqa: E402

BF16 = ptxattn.bfloat16
E4M3, E5M2 = ptxattn.dtypes.float8_e4m3fn, ptxattn.dtypes.float8_e5m2
STREAM = ptxattn.Stream.create()


def _decode_arrays(batch=2, hq=8, hkv=2, cap=4096, d=128, sq=1):
    e = ptxattn.empty
    q, k, v = e((batch, hq, sq, d), BF16), e((batch, hkv, cap, d), BF16), e((batch, hkv, cap, d), BF16)
    return {"q": q, "k_cache": k, "v_cache": v, "seq_lens": e((batch,), np.int32),
            "sinks": e((hq,), np.float32), "out": e((batch, hq, sq, d), BF16), "out_lse": e((batch, hq, sq), np.float32),
            "workspace": e((ptxattn.decode_workspace_bytes(q, k, v),), np.uint8)}


def _paged_arrays():
    e = ptxattn.empty
    q, pool = e((2, 8, 1, 64), BF16), e((40, 2, 16, 64), BF16)
    table = e((2, 16), np.int32)
    return {"q": q, "k_pool": pool, "v_pool": e(pool.shape, BF16), "block_table": table,
            "seq_lens": e((2,), np.int32), "sinks": e((8,), np.float32), "out": e((2, 8, 1, 64), BF16),
            "out_lse": e((2, 8, 1), np.float32),
            "workspace": e((ptxattn.paged_decode_workspace_bytes(q, pool, pool, table),), np.uint8)}


def _sdpa_arrays():
    e = ptxattn.empty
    return {"q": e((2, 8, 100, 64), BF16), "k": e((2, 2, 120, 64), BF16), "v": e((2, 2, 120, 64), BF16),
            "attn_mask": e((100, 120), np.bool_), "sinks": e((8,), np.float32), "out": e((2, 8, 100, 64), BF16),
            "out_lse": e((2, 8, 100), np.float32)}


def _append_arrays():
    e = ptxattn.empty
    return {"k_new": e((2, 2, 3, 64), BF16), "v_new": e((2, 2, 3, 64), BF16), "k_cache": e((2, 2, 50, 64), BF16),
            "v_cache": e((2, 2, 50, 64), BF16), "seq_lens": e((2,), np.int32)}


def _paged_append_arrays():
    e = ptxattn.empty
    return {"k_new": e((5, 2, 64), BF16), "v_new": e((5, 2, 64), BF16), "k_pool": e((9, 2, 16, 64), BF16),
            "v_pool": e((9, 2, 16, 64), BF16), "slot_mapping": e((5,), np.int64)}


def _fp8_append_arrays(quantize: bool):
    """kv_append into e4m3 caches with per-token scales: bf16 rows quantized, or e4m3 rows
    copied with their own scales."""
    e, e4m3 = ptxattn.empty, ptxattn.dtypes.float8_e4m3fn
    new = BF16 if quantize else e4m3
    arrays = {"k_new": e((2, 2, 3, 64), new), "v_new": e((2, 2, 3, 64), new), "k_cache": e((2, 2, 50, 64), e4m3),
              "v_cache": e((2, 2, 50, 64), e4m3), "seq_lens": e((2,), np.int32), "k_scale": e((2, 2, 50), np.float32),
              "v_scale": e((2, 2, 50), np.float32)}
    if not quantize:
        arrays.update(k_new_scale=e((2, 2, 3), np.float32), v_new_scale=e((2, 2, 3), np.float32))
    return arrays


def _merge_arrays():
    e = ptxattn.empty
    return {"o": e((3, 2, 4, 5, 64), BF16), "lse": e((3, 2, 4, 5), np.float32), "sinks": e((4,), np.float32),
            "out": e((2, 4, 5, 64), BF16), "out_lse": e((2, 4, 5), np.float32)}


def _ragged_arrays():
    e = ptxattn.empty
    return {"q": e((300, 8, 64), BF16), "k": e((500, 2, 64), BF16), "v": e((500, 2, 64), BF16),
            "cu_seqlens_q": e((5,), np.int32), "cu_seqlens_k": e((5,), np.int32), "sinks": e((8,), np.float32),
            "out": e((300, 8, 64), BF16), "out_lse": e((300, 8), np.float32)}


def _paged_attention_arrays():
    e = ptxattn.empty
    q, pool, qo, table = e((70, 8, 64), BF16), e((40, 2, 16, 64), BF16), e((5,), np.int32), e((4, 16), np.int32)
    return {"q": q, "k_pool": pool, "v_pool": e(pool.shape, BF16), "qo_indptr": qo, "block_table": table,
            "seq_lens": e((4,), np.int32), "sinks": e((8,), np.float32), "out": e((70, 8, 64), BF16),
            "out_lse": e((70, 8), np.float32),
            "workspace": e((ptxattn.paged_attention_workspace_bytes(q, pool, pool, qo, table, decode_queries=4,
                                                                    return_lse=True),), np.uint8)}


def _ragged_fp8_arrays():
    """fp8 k / v with per-token scales."""
    e = ptxattn.empty
    return {**_ragged_arrays(), "k": e((500, 2, 64), E4M3), "v": e((500, 2, 64), E4M3),
            "k_scale": e((500, 2), np.float32), "v_scale": e((500, 2), np.float32)}


def _paged_attention_fp8_arrays(per_token: bool = True):
    """fp8 pools, with per-token scale arrays or (per_token False) none: the scales are numbers."""
    e = ptxattn.empty
    q, pool, qo, table = e((70, 8, 64), BF16), e((40, 2, 16, 64), E5M2), e((5,), np.int32), e((4, 16), np.int32)
    workspace = ptxattn.paged_attention_workspace_bytes(q, pool, pool, qo, table, decode_queries=4, return_lse=True)
    scales = {"k_scale": e((40, 2, 16), np.float32), "v_scale": e((40, 2, 16), np.float32)} if per_token else {}
    return {"q": q, "k_pool": pool, "v_pool": e(pool.shape, E5M2), "qo_indptr": qo, "block_table": table,
            "seq_lens": e((4,), np.int32), "sinks": e((8,), np.float32), "out": e((70, 8, 64), BF16),
            "out_lse": e((70, 8), np.float32), "workspace": e((workspace,), np.uint8), **scales}


# (op, arrays maker, options): every op, with every optional array it takes.
CALLS = [
    (ptxattn.sdpa, _sdpa_arrays, {"causal": True, "return_lse": True}),
    (ptxattn.decode, _decode_arrays, {"return_lse": True}),
    (ptxattn.decode, lambda: _decode_arrays(batch=64, hq=32, hkv=8), {"return_lse": True}),  # one split
    (ptxattn.paged_decode, _paged_arrays, {"return_lse": True}),
    (ptxattn.ragged_attention, _ragged_arrays, {"causal": True, "return_lse": True}),
    (ptxattn.paged_attention, _paged_attention_arrays, {"return_lse": True, "decode_queries": 4}),
    (ptxattn.ragged_attention, _ragged_fp8_arrays, {"causal": True, "return_lse": True}),
    (ptxattn.paged_attention, _paged_attention_fp8_arrays, {"return_lse": True, "decode_queries": 4}),
    (ptxattn.paged_attention, lambda: _paged_attention_fp8_arrays(per_token=False),
     {"return_lse": True, "decode_queries": 4, "k_scale": 0.5, "v_scale": 0.25}),
    (ptxattn.kv_append, _append_arrays, {}),
    (ptxattn.paged_kv_append, _paged_append_arrays, {}),
    (ptxattn.kv_append, lambda: _fp8_append_arrays(quantize=True), {}),
    (ptxattn.kv_append, lambda: _fp8_append_arrays(quantize=False), {}),
    (ptxattn.merge_states_n, _merge_arrays, {}),
    (ptxattn.softmax, lambda: {"x": ptxattn.empty((7, 300), np.float32), "out": ptxattn.empty((7, 300), np.float32)},
     {}),
]


def _pointer_fields(launch) -> dict[str, int]:
    params = launch.params
    return {name: getattr(params, name) or 0 for name, ctype in params._fields_ if ctype is ctypes.c_void_p}


def _ranges(arrays: dict) -> dict[str, range]:
    return {name: range(a.ptr, a.ptr + max(a.nbytes, 1)) for name, a in arrays.items()}


def _owner(ptr: int, ranges: dict[str, range]):
    return next((name for name, r in ranges.items() if ptr in r), None)


def no_stale_pointers() -> None:
    """After eager calls with arrays A then B (same shapes), every pointer a launch will read
    lies in B's arrays (or is the fault buffer), none in A's: the cached binding rewrote
    every address it holds."""
    fault = fault_buffer(ptxattn.get_device(0))
    for op, make, options in CALLS:
        first, second = make(), make()
        op(**first, **options, stream=STREAM)
        op(**second, **options, stream=STREAM)
        binding = next(reversed(prepared._cache().values()))
        assert binding.op is op.op
        old, new = _ranges(first), _ranges(second)
        for launch in binding.launches:
            for field, ptr in _pointer_fields(launch).items():
                assert _owner(ptr, old) is None, f"{op.__name__} {launch.name}.{field} still points at the first call's {_owner(ptr, old)}"
                assert ptr in (0, fault) or _owner(ptr, new), f"{op.__name__} {launch.name}.{field} = {ptr:#x} points nowhere"
        print(f"{op.__name__}: {len(binding.launches)} launches, every pointer rewritten")


def prepared_rebinds_only_what_it_is_given() -> None:
    arrays = _decode_arrays()
    step = ptxattn.prepare(ptxattn.decode, **arrays, stream=STREAM)
    q2 = ptxattn.empty(arrays["q"].shape, BF16)
    step.run(q=q2)
    split = _pointer_fields(step.launches[0])
    assert split["q"] == q2.ptr and split["k"] == arrays["k_cache"].ptr, split
    try:
        step.run(q=ptxattn.empty((2, 8, 2, 128), BF16))
    except ValueError as exc:
        assert "decode.run: q must match the prepared one" in str(exc), exc
    else:
        raise AssertionError("a q of another shape was accepted")
    assert _pointer_fields(step.launches[0])["q"] == q2.ptr  # the refused call changed nothing


def options_are_keyed_with_their_types() -> None:
    arrays = _decode_arrays()
    ptxattn.decode(**arrays, scale=1, stream=STREAM)
    try:
        ptxattn.decode(**arrays, scale=True, stream=STREAM)  # True == 1 and hash(True) == hash(1)
    except TypeError as exc:
        assert "scale must be a number or None, got True" in str(exc), exc
    else:
        raise AssertionError("scale=True ran on the binding cached for scale=1")


def ops_with_equal_arguments_keep_their_own_bindings() -> None:
    """softmax and log_softmax take the same arguments: each call must run its own op."""
    x, y = ptxattn.empty((7, 300), np.float32), ptxattn.empty((7, 300), np.float32)
    ran = []
    execute = prepared.Binding.execute
    prepared.Binding.execute = lambda self, *args: ran.append(self) or execute(self, *args)
    for op in (ptxattn.softmax, ptxattn.log_softmax, ptxattn.softmax, ptxattn.log_softmax):
        op(x, out=y, stream=STREAM)
        binding = ran[-1]
        assert binding.op is op.op and binding.launches[0].params.log_softmax == (op is ptxattn.log_softmax), \
            f"{op.__name__} ran {binding.op.name}'s binding"


def _fake_torch():
    """A stand-in for torch: a Tensor type from a module named torch, with the accessors the
    op path reads, over fake device memory (CUDA) or a NumPy array (CPU)."""
    import types

    torch = types.ModuleType("torch")
    torch.float32 = "torch.float32"
    torch._C = types.SimpleNamespace(_cuda_getCurrentRawStream=lambda index: STREAM.ptr)
    sys.modules["torch"] = torch

    class Tensor:
        def __init__(self, host: np.ndarray, on_device: bool) -> None:
            self.host, self.dtype, self.shape = host, torch.float32, host.shape
            self.device_array = ptxattn.asarray(host) if on_device else None
            self.is_cuda = on_device

        def get_device(self):
            return 0 if self.is_cuda else -1

        def data_ptr(self):
            return self.device_array.ptr if self.is_cuda else self.host.ctypes.data

        def stride(self):
            return tuple(s // 4 for s in self.host.strides)

        def __array__(self, dtype=None, copy=None):
            return self.host

    Tensor.__module__ = "torch"
    return Tensor


def torch_tensors_are_classified_where_they_live() -> None:
    """CUDA tensors run on the device (taken as such without asking each); CPU ones take the
    NumPy path, alone or beside NumPy arrays; a CPU one among CUDA ones is named."""
    Tensor = _fake_torch()
    host = np.random.default_rng(0).standard_normal((4, 64)).astype(np.float32)
    on_device = ptxattn.softmax(Tensor(host, True), stream=STREAM)
    assert isinstance(on_device, ptxattn.DeviceArray) and on_device.shape == host.shape
    on_host = ptxattn.softmax(Tensor(host, False))
    assert isinstance(on_host, np.ndarray) and on_host.shape == host.shape
    mixed_host = ptxattn.softmax(Tensor(host, False), out=np.empty_like(host))
    assert isinstance(mixed_host, np.ndarray)
    try:
        ptxattn.softmax(Tensor(host, True), out=Tensor(host, False), stream=STREAM)
    except TypeError as exc:
        assert "x on the device but out on the host" in str(exc), exc
    else:
        raise AssertionError("a CPU tensor beside a CUDA one was accepted")


def cache_stays_bounded() -> None:
    prepared.clear_bindings()
    for n in range(prepared.CACHE_ENTRIES + 40):
        x = ptxattn.empty((1, 16 + n), np.float32)
        ptxattn.softmax(x, out=ptxattn.empty(x.shape, np.float32), stream=STREAM)
    assert len(prepared._cache()) == prepared.CACHE_ENTRIES, len(prepared._cache())


def numpy_calls_round_trip() -> None:
    """NumPy in, NumPy out through the upload / run / copy-back path (the fake's kernels do
    nothing, so the outputs hold what the pool handed out; shapes and in-place updates show)."""
    x = np.random.default_rng(0).standard_normal((3, 50)).astype(np.float32)
    y = ptxattn.softmax(x)
    assert isinstance(y, np.ndarray) and y.shape == x.shape and y.dtype == x.dtype
    out = np.empty_like(x)
    assert ptxattn.softmax(x, out=out) is out
    seq_lens = np.array([1, 2], np.int32)
    cache = np.zeros((2, 2, 8, 16), np.float16)
    ptxattn.kv_append(np.ones((2, 2, 1, 16), np.float16), np.ones((2, 2, 1, 16), np.float16), cache, cache.copy(),
                      seq_lens)
    try:
        ptxattn.kv_append(np.ones((2, 2, 1, 16), np.float16), np.ones((2, 2, 1, 16), np.float16), cache,
                          cache.copy(), np.array([7, 8], np.int32))
    except ValueError as exc:
        assert "kv_append: seq_lens[1] = 8 is outside [0, 7]" in str(exc), exc
    else:
        raise AssertionError("a NumPy length past the capacity was accepted")
    # fp8: a per-tensor K scale (a number, no array to copy back) beside a per-token V one.
    fp8_cache = np.zeros((2, 2, 8, 16), ptxattn.dtypes.float8_e4m3fn)
    v_scale = np.ones((2, 2, 8), np.float32)
    ptxattn.kv_append(np.ones((2, 2, 1, 16), BF16), np.ones((2, 2, 1, 16), BF16), fp8_cache, fp8_cache.copy(),
                      seq_lens, k_scale=0.5, v_scale=v_scale)


def serving_outputs_made_are_filled() -> None:
    """An out / out_lse that ragged_attention or paged_attention makes is filled with 0 / -inf
    first (rows no sequence covers are not written; the fake's kernels write nothing at all),
    eager and prepared; a caller's out is left as it is."""
    for op, make, options in CALLS:
        if op not in (ptxattn.ragged_attention, ptxattn.paged_attention):
            continue
        arrays = make()
        arrays.update(out=None, out_lse=None)
        o, lse = op(**arrays, **options, stream=STREAM)
        step = ptxattn.prepare(op, **arrays, **options, stream=STREAM)
        for out, out_lse in ((o, lse), (step.arrays["out"], step.arrays["out_lse"])):
            assert (out.get(STREAM).astype(np.float32) == 0).all(), f"{op.__name__}: out not zero-filled"
            assert (out_lse.get(STREAM) == -np.inf).all(), f"{op.__name__}: out_lse not -inf-filled"
        given = make()
        given["out"].set(np.full(given["out"].shape, 3, np.float32).astype(BF16), STREAM)
        op(**given, **options, stream=STREAM)
        assert (given["out"].get(STREAM).astype(np.float32) == 3).all(), f"{op.__name__}: a given out was filled"


def fp8_fields_are_bound() -> None:
    """fp8 calls launch the _fp8 tile kernels (wgmma on the fake's sm_90 device) with the fp8
    type, per-token scales' addresses and (batch or page, head, token) strides, or per-tensor
    values; paged_attention's decode rows get decode's fp8 kernel with the same scales."""
    arrays = _ragged_fp8_arrays()
    step = ptxattn.prepare(ptxattn.ragged_attention, **arrays, causal=True, stream=STREAM)
    (tile,) = step.launches
    p = tile.params
    assert tile.name == "flash_fwd_sm90_bf16_d64_general_fp8", tile.name
    assert (p.kv_fp8, p.k_scales, p.v_scales) == (1, arrays["k_scale"].ptr, arrays["v_scale"].ptr)
    assert (p.k_scale_batch_stride, p.k_scale_head_stride, p.k_scale_seq_stride) == (0, 1, 2)
    assert (p.v_scale_batch_stride, p.v_scale_head_stride, p.v_scale_seq_stride) == (0, 1, 2)
    assert (p.k_scale, p.v_scale) == (1.0, 1.0)

    arrays = _paged_attention_fp8_arrays(per_token=False)
    step = ptxattn.prepare(ptxattn.paged_attention, **arrays, decode_queries=4, k_scale=0.5, v_scale=0.25,
                           stream=STREAM)
    tiles = [launch for launch in step.launches if launch.name.startswith("flash_fwd")]
    splits = [launch for launch in step.launches if launch.name.startswith("decode_split")]
    assert [x.name for x in tiles] == ["flash_fwd_sm90_bf16_d64_general_fp8"], [x.name for x in step.launches]
    assert [x.name for x in splits] == ["decode_split_bf16_e5m2_d128"], [x.name for x in step.launches]
    p = tiles[0].params
    assert (p.kv_fp8, p.k_scales, p.v_scales, p.k_scale, p.v_scale) == (2, None, None, 0.5, 0.25)
    d = splits[0].params
    assert (d.k_scales, d.v_scales, d.v_scale) == (None, None, 0.25) and abs(d.scale - 0.5 / 8) < 1e-7

    arrays = _paged_attention_fp8_arrays()
    step = ptxattn.prepare(ptxattn.paged_attention, **arrays, decode_queries=4, stream=STREAM)
    tile = next(launch for launch in step.launches if launch.name.startswith("flash_fwd"))
    split = next(launch for launch in step.launches if launch.name.startswith("decode_split"))
    p, d = tile.params, split.params
    assert (p.k_scales, p.v_scales) == (arrays["k_scale"].ptr, arrays["v_scale"].ptr) == (d.k_scales, d.v_scales)
    # HND scales [pages, Hkv, page_size]: page stride 32, head 16, token 1.
    assert (p.k_scale_batch_stride, p.k_scale_head_stride, p.k_scale_seq_stride) == (32, 16, 1)
    assert (d.k_scale_stride_page, d.k_scale_stride_head, d.k_scale_stride_tok) == (32, 16, 1)


def threads_launch_their_own_pointers() -> None:
    """Eight threads calling ops at once: every launch carries its own thread's addresses
    (the binding a thread writes is its own). Threads are told apart by their Thread objects:
    an ident can be reused by a thread started after another one ended."""
    seen: dict[threading.Thread, list[int]] = {}
    lock = threading.Lock()

    def recording_launch(function, gx, gy, gz, bx, by, bz, shared, stream, args, extra):
        first_pointer = ctypes.c_uint64.from_address(ctypes.c_void_p.from_address(args).value).value
        with lock:
            seen.setdefault(threading.current_thread(), []).append(first_pointer)
        return (fake._OK,)

    from cuda.bindings import driver as cu

    cu.cuLaunchKernel = recording_launch
    mine: dict[threading.Thread, set] = {}
    errors = []

    def worker():
        try:
            arrays = _sdpa_arrays()
            x = ptxattn.empty((9, 100), np.float32)
            mine[threading.current_thread()] = {arrays["q"].ptr, x.ptr}
            for _ in range(300):
                ptxattn.sdpa(**arrays, stream=STREAM)
                ptxattn.softmax(x, out=ptxattn.empty(x.shape, np.float32), stream=STREAM)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for thread, pointers in seen.items():
        assert set(pointers) <= mine[thread], "a thread launched another thread's arrays"
    assert sum(len(p) for p in seen.values()) == 8 * 600


def kernel_loads_run_in_relaxed_capture_mode() -> None:
    """A kernel's first use may come inside a graph capture: its module loads while the thread's
    capture mode is relaxed (else the driver would invalidate the capture), and the thread's own
    mode, whatever it was, is back afterwards. Its second use loads nothing."""
    from cuda.bindings import driver as cu

    modes = cu.CUstreamCaptureMode
    exchange, load = cu.cuThreadExchangeStreamCaptureMode, cu.cuModuleLoadDataEx
    events = []

    def recording_exchange(mode):
        result = exchange(mode)
        events.append(("mode", mode))
        return result

    def recording_load(*args):
        current = exchange(modes.CU_STREAM_CAPTURE_MODE_RELAXED)[1]
        exchange(current)
        events.append(("load", current))
        return load(*args)

    cu.cuThreadExchangeStreamCaptureMode, cu.cuModuleLoadDataEx = recording_exchange, recording_load
    exchange(modes.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)  # as inside ptxattn.capture
    x = ptxattn.empty((9, 100), np.float32)
    ptxattn.softmax(x, out=ptxattn.empty(x.shape, np.float32), stream=STREAM)
    loads = [mode for kind, mode in events if kind == "load"]
    assert loads and all(mode == modes.CU_STREAM_CAPTURE_MODE_RELAXED for mode in loads), events
    assert exchange(modes.CU_STREAM_CAPTURE_MODE_GLOBAL)[1] == modes.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL, events
    events.clear()
    ptxattn.softmax(x, out=ptxattn.empty(x.shape, np.float32), stream=STREAM)
    assert events == [], events



def fault_buffer_is_made_inside_a_capture() -> None:
    """The device's fault buffer may be made by an op inside a graph capture: it is allocated in
    relaxed mode and zeroed on a stream of its own (never by a synchronous memset, which runs on
    the legacy stream), that stream is synchronized before the address is handed out, and the
    thread's own mode is back afterwards."""
    from cuda.bindings import driver as cu

    modes = cu.CUstreamCaptureMode
    exchange = cu.cuThreadExchangeStreamCaptureMode
    events = []

    def recording(name):
        real = getattr(cu, name)

        def record(*args):
            mode = exchange(modes.CU_STREAM_CAPTURE_MODE_RELAXED)[1]
            exchange(mode)
            events.append((name, mode, args))
            return real(*args)
        return record

    for name in ("cuMemAlloc", "cuMemsetD8", "cuMemsetD8Async", "cuStreamSynchronize"):
        setattr(cu, name, recording(name))
    exchange(modes.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)  # as inside a host's capture
    ptr = fault_buffer(ptxattn.get_device(0))
    names = [name for name, _, _ in events]
    assert names == ["cuMemAlloc", "cuMemsetD8Async", "cuStreamSynchronize"], events
    assert all(mode == modes.CU_STREAM_CAPTURE_MODE_RELAXED for _, mode, _ in events), events
    (_, _, memset), (_, _, synced) = events[1], events[2]
    assert int(memset[0]) == ptr and int(memset[3]) != 0 and int(synced[0]) == int(memset[3]), events
    assert exchange(modes.CU_STREAM_CAPTURE_MODE_GLOBAL)[1] == modes.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL, events
    events.clear()
    assert fault_buffer(ptxattn.get_device(0)) == ptr and events == [], events


def tma_maps_follow_their_arrays() -> None:
    """A dense sdpa call on a warp-specialized kernel loads q, k and v by TMA (tma 1): each map
    describes its array (dtype, address, (dim, token, head, batch) and byte strides, a box of
    64 columns by the tile's rows), and every call rewrites the maps with the pointers, eager
    (cached binding, new arrays) or prepared (rebinding q alone). Calls TMA cannot serve (head
    dims under the tile's, a broadcast K head axis) keep tma 0."""
    e = ptxattn.empty

    def arrays(hkv=2, d=128):
        return {"q": e((2, 8, 300, d), BF16), "k": e((2, hkv, 260, d), BF16), "v": e((2, hkv, 260, d), BF16)}

    def maps(launch):
        data = lambda field: bytes(getattr(launch.params, field))
        return [fake.fake_tensor_map(data(f"{name}_map")) for name in "qkv"]

    for first, second in ((arrays(), arrays()),):
        ptxattn.sdpa(**first, causal=True, stream=STREAM)
        ptxattn.sdpa(**second, causal=True, stream=STREAM)
        (launch,) = next(reversed(prepared._cache().values())).launches
        assert launch.name == "flash_fwd_sm90_bf16_d128_ws_pp" and launch.params.tma == 1, launch.name
        q, k, v = maps(launch)
        assert q == {"data_type": 9, "address": second["q"].ptr, "dims": (128, 300, 8, 2),
                     "strides": (256, 300 * 256, 8 * 300 * 256), "box": (64, 128, 1, 1)}, q
        assert k == {"data_type": 9, "address": second["k"].ptr, "dims": (128, 260, 2, 2),
                     "strides": (256, 260 * 256, 2 * 260 * 256), "box": (64, 128, 1, 1)}, k
        assert v["address"] == second["v"].ptr and v["dims"] == k["dims"], v

    given = arrays()
    step = ptxattn.prepare(ptxattn.sdpa, **given, stream=STREAM)
    q2 = e(given["q"].shape, BF16)
    step.run(q=q2)
    q, k, _ = maps(step.launches[0])
    assert (q["address"], k["address"]) == (q2.ptr, given["k"].ptr), (q, k)

    f16 = {name: e(a.shape, np.float16) for name, a in arrays().items()}
    (launch,) = ptxattn.prepare(ptxattn.sdpa, **f16, stream=STREAM).launches
    assert launch.params.tma == 1 and maps(launch)[0]["data_type"] == 6

    padded = ptxattn.prepare(ptxattn.sdpa, **arrays(d=96), stream=STREAM).launches[0]
    assert "_ws" in padded.name and padded.params.tma == 0, padded.name
    one_head = arrays(hkv=1)
    broadcast = {"q": one_head["q"], **{n: ptxattn.DeviceArray.view(one_head[n].ptr, (2, 2, 260, 128), BF16,
                                                                   (260 * 128 * 2, 0, 256, 2), one_head[n].device,
                                                                   one_head[n])
                                          for n in "kv"}}
    launch = ptxattn.prepare(ptxattn.sdpa, **broadcast, stream=STREAM).launches[0]
    assert "_ws" in launch.name and launch.params.tma == 0, launch.name


def masks_stage_by_tma() -> None:
    """A general sdpa call whose mask is f16, bf16 or bool and loadable by TMA runs the
    staged-mask twin of its warp-specialized kernel: launched with the twin's shared memory (the
    mask stages included), its mask map over (key, query, head, batch) with a broadcast axis of
    length 1 (a broadcast query axis: a box of one row), rewritten when a prepared call rebinds
    the mask. Masks TMA cannot load (float32, a broadcast key axis, a query stride off 16 bytes,
    bool where a key tile is not 128 bytes of it) and calls without q / k / v maps (padded head
    dims) keep the general kernel."""
    from ptxattn.ops.attention import staged_mask_twin
    from ptxattn.variants import sm90_ws_pp_tiles

    e = ptxattn.empty
    general = sm90_ws_pp_tiles()[128, True]
    twin = staged_mask_twin(general)
    qkv = {"q": e((2, 8, 300, 128), BF16), "k": e((2, 2, 272, 128), BF16), "v": e((2, 2, 272, 128), BF16)}

    def staged(arrays, mask):
        (launch,) = ptxattn.prepare(ptxattn.sdpa, **arrays, attn_mask=mask, stream=STREAM).launches
        assert launch.name.endswith("_general_ws_pp_staged_mask"), launch.name
        return fake.fake_tensor_map(bytes(launch.params.mask_map))

    mask = e((2, 1, 300, 272), BF16)
    step = ptxattn.prepare(ptxattn.sdpa, **qkv, attn_mask=mask, causal=True, stream=STREAM)
    (launch,) = step.launches
    assert launch.name == "flash_fwd_sm90_bf16_d128_general_ws_pp_staged_mask", launch.name
    assert launch.shared == twin.shared_bytes == general.shared_bytes + 2 * 2 * 128 * 128, launch.shared
    got = fake.fake_tensor_map(bytes(launch.params.mask_map))
    assert got == {"data_type": 9, "address": mask.ptr, "dims": (272, 300, 1, 2),
                   "strides": (544, 300 * 544, 300 * 544), "box": (64, 128, 1, 1)}, got
    mask2 = e(mask.shape, BF16)
    step.run(attn_mask=mask2)
    assert fake.fake_tensor_map(bytes(step.launches[0].params.mask_map))["address"] == mask2.ptr

    f16 = {n: e(a.shape, np.float16) for n, a in qkv.items()}
    got = staged(f16, e((300, 272), np.float16))
    assert got["data_type"] == 6 and got["dims"] == (272, 300, 1, 1), got
    got = staged(qkv, e((2, 1, 300, 272), np.bool_))
    assert (got["data_type"], got["strides"][0], got["box"]) == (0, 272, (128, 128, 1, 1)), got
    keys = e((2, 8, 1, 272), BF16)  # a key mask, one row for every query
    got = staged(qkv, keys)
    assert got == {"data_type": 9, "address": keys.ptr, "dims": (272, 1, 8, 2),
                   "strides": (544, 544, 8 * 544), "box": (64, 1, 1, 1)}, got

    odd = {"q": qkv["q"], "k": e((2, 2, 260, 128), BF16), "v": e((2, 2, 260, 128), BF16)}
    odd2 = {"q": qkv["q"], "k": e((2, 2, 264, 128), BF16), "v": e((2, 2, 264, 128), BF16)}
    d256 = {n: e(a.shape[:3] + (256,), BF16) for n, a in qkv.items()}
    for name, arrays, m in (("float32", qkv, e((2, 1, 300, 272), np.float32)),
                            ("broadcast keys", qkv, e((2, 1, 300, 1), BF16)),
                            ("query stride off 16 bytes", odd, e((2, 1, 300, 260), BF16)),
                            ("bool query stride off 16 bytes", odd2, e((2, 1, 300, 264), np.bool_)),
                            ("bool in 64-key tiles", d256, e((2, 1, 300, 272), np.bool_)),
                            ("padded head dims", {n: e(a.shape[:3] + (96,), BF16) for n, a in qkv.items()},
                             e((2, 1, 300, 272), BF16))):
        (launch,) = ptxattn.prepare(ptxattn.sdpa, **arrays, attn_mask=m, stream=STREAM).launches
        assert "_general_ws" in launch.name and not launch.name.endswith("_staged_mask"), (name, launch.name)
        assert bytes(launch.params.mask_map) == bytes(128), name
    got = staged_mask_twin(sm90_ws_pp_tiles()[64, True])
    assert got is not None and got.kernel("bf16") == "flash_fwd_sm90_bf16_d64_general_ws_pp_staged_mask"


def persistent_twins_share_the_blocks_out() -> None:
    """A dense TMA call of the plain D128 ping-pong kernel with more query blocks than SMs runs its
    persistent twin: one CTA an SM (132 here), the twin's shared memory (a second Q tile), the
    grid the ping-pong kernel would have run in virtual_grid (and its x and y extents and Hq as
    fast_divisor pairs), and an output map (o_map: boxes of 64 rows) of the output it makes or
    is given, rewritten by every eager call and when a prepared call rebinds out; an output TMA
    cannot store to has no map, and no twin. Calls of no more blocks than SMs, without q / k / v
    maps (padded dims), with a mask or softcap (general kernels), at other head dims, and under
    PTXATTN_SM90_PERSISTENT=0 keep the ping-pong kernel on its own grid, as do causal calls of
    MIN_RUN_BLOCKS (16) query blocks a head and more (heavy-first runs) unless =1."""
    from ptxattn.ops import attention
    from ptxattn.variants import sm90_persistent_tiles, sm90_ws_pp_tiles

    e = ptxattn.empty
    twin, pp = sm90_persistent_tiles()[128], sm90_ws_pp_tiles()[128, False]

    def launch(b, h, s, d=128, dtype=BF16, **options):
        q, k, v = (e((b, h, s, d), dtype) for _ in range(3))
        (launch,) = ptxattn.prepare(ptxattn.sdpa, q, k, v, stream=STREAM, **options).launches
        return launch

    def virtual_grid(launch):
        return launch.params.virtual_grid_x, launch.params.virtual_grid_y, launch.params.virtual_grid_z

    short = launch(16, 16, 1024, causal=True)  # 8 query blocks a head
    assert short.name == "flash_fwd_sm90_bf16_d128_ws_pp_persistent" and short.params.tma == 1, short.name
    assert (short.grid, short.shared, short.params.heavy_first) == ((132, 1, 1), twin.shared_bytes, 1), short.grid
    assert virtual_grid(short) == (1, 8, 256) and twin.shared_bytes == pp.shared_bytes + 128 * 128 * 2
    divisors = [(getattr(short.params, f"{name}_mul"), getattr(short.params, f"{name}_shift"))
                for name in ("virtual_div_x", "virtual_div_y", "heads_q_div")]
    assert divisors == [attention.fast_divisor(n) for n in (1, 8, 16)], divisors
    made = fake.fake_tensor_map(bytes(short.params.o_map))
    assert made["address"] != 0 and made["address"] % 256 == 0, made
    assert {k: made[k] for k in ("data_type", "dims", "strides", "box")} == {
        "data_type": 9, "dims": (128, 1024, 16, 16), "strides": (256, 1024 * 256, 16 * 1024 * 256),
        "box": (64, 64, 1, 1)}, made
    q, k, v = (e((16, 16, 1024, 128), BF16) for _ in range(3))
    first = ptxattn.sdpa(q, k, v, causal=True, stream=STREAM)  # eager: outputs from the pool, first kept
    second = ptxattn.sdpa(q, k, v, causal=True, stream=STREAM)
    (eager,) = next(reversed(prepared._cache().values())).launches
    assert eager.name.endswith("_persistent") and first.ptr != second.ptr, (eager.name, first.ptr)
    assert fake.fake_tensor_map(bytes(eager.params.o_map))["address"] == second.ptr
    bshd = e((16, 1024, 16, 128), BF16)
    out = ptxattn.DeviceArray.view(bshd.ptr, (16, 16, 1024, 128), BF16, (1024 * 16 * 256, 256, 16 * 256, 2), q.device,
                                   bshd)  # [B, H, S, D] over [B, S, H, D] memory
    step = ptxattn.prepare(ptxattn.sdpa, q, k, v, out=out, causal=True, stream=STREAM)
    given = fake.fake_tensor_map(bytes(step.launches[0].params.o_map))
    assert given == {"data_type": 9, "address": out.ptr, "dims": (128, 1024, 16, 16),
                     "strides": (16 * 256, 256, 1024 * 16 * 256), "box": (64, 64, 1, 1)}, given
    out2 = e((16, 16, 1024, 128), BF16)
    step2 = ptxattn.prepare(ptxattn.sdpa, q, k, v, out=out2, causal=True, stream=STREAM)
    out3 = e(out2.shape, BF16)
    step2.run(out=out3)
    assert fake.fake_tensor_map(bytes(step2.launches[0].params.o_map))["address"] == out3.ptr
    maps = attention.tma_maps(pp, q, k, v)
    assert attention.persistent_twin(pp, maps, attention.out_map(out2, out2.shape, BF16), (1, 8, 256), True, 132) \
        == twin
    odd = ptxattn.DeviceArray.view(out2.ptr + 8, out2.shape, BF16, out2.strides, q.device, out2)
    assert attention.out_map(odd, odd.shape, BF16) is None
    assert attention.persistent_twin(pp, maps, None, (1, 8, 256), True, 132) is None
    long = launch(4, 32, 4096)
    assert long.name.endswith("_persistent") and virtual_grid(long) == (32, 32, 4) and long.grid == (132, 1, 1)
    assert launch(4, 32, 4096, dtype=np.float16).name == "flash_fwd_sm90_f16_d128_ws_pp_persistent"
    assert launch(4, 32, 1920, causal=True).name.endswith("_persistent")  # 15 query blocks a head
    long_causal = launch(4, 32, 2048, causal=True)  # 16: runs of pairs
    assert long_causal.name == pp.kernel("bf16") and long_causal.grid == (16, 16, 8), long_causal.grid
    assert launch(32, 16, 512, causal=True).name.endswith("_persistent")  # 4
    shortest = launch(64, 16, 100, causal=True)  # 1, cut
    assert shortest.name.endswith("_persistent") and virtual_grid(shortest) == (1, 1, 1024), shortest.name
    for name, kept in (("132 blocks", launch(1, 33, 512)), ("padded dims", launch(32, 16, 512, d=96)),
                       ("softcap", launch(32, 16, 512, softcap=30.0)), ("D64", launch(32, 16, 512, d=64))):
        assert not kept.name.endswith("_persistent") and kept.grid != (132, 1, 1), (name, kept.name, kept.grid)
    assert virtual_grid(launch(1, 33, 512)) == (0, 0, 0)
    attention.sm90_persistent_setting = lambda: True  # as PTXATTN_SM90_PERSISTENT=1 reads
    prepared.clear_bindings()
    forced = launch(4, 32, 2048, causal=True)
    assert forced.name.endswith("_persistent") and virtual_grid(forced) == (16, 16, 8), forced.name
    attention.sm90_persistent_setting = lambda: False  # as PTXATTN_SM90_PERSISTENT=0 reads
    prepared.clear_bindings()
    off = launch(16, 16, 1024, causal=True)
    assert off.name == pp.kernel("bf16") and off.grid == (1, 8, 256) and off.shared == pp.shared_bytes, off.name


def persistent_twins_deal_their_last_blocks() -> None:
    """Where the snake's last rounds leave some CTAs more work than others (a causal twin's
    heads of unequal blocks), the twin's parameters carry the host's deal of the blocks from
    tail_round on (runtime/ops/persistent_deal.py), eager calls' too; where blocks are alike or
    few, none (tail_round 0: the snake deals them all)."""
    from ptxattn.ops import persistent_deal as deal

    e = ptxattn.empty

    def launch(b, h, s, **options):
        q, k, v = (e((b, h, s, 128), BF16) for _ in range(3))
        (launch,) = ptxattn.prepare(ptxattn.sdpa, q, k, v, stream=STREAM, **options).launches
        assert launch.name.endswith("_persistent"), launch.name
        return launch

    short = launch(32, 16, 512, causal=True)  # 2048 blocks of 4, 3, 2, 1 key tiles: 15.5 rounds
    tiles = deal.key_tiles(128, 128, 512, 512, UNBOUNDED_WINDOW, 0, 0)
    want = deal.tail_deal(deal.virtual_block_costs((1, 4, 512), True, tiles), 132)
    assert want is not None and short.params.tail_round == want.tail_round == 14, short.params.tail_round
    assert list(short.params.tail_blocks) == want.table()
    windowed = launch(8, 16, 1024, window=(300, 0))  # 8 query blocks of 1 to 4 key tiles
    assert windowed.params.tail_round == 6 and set(windowed.params.tail_blocks) != {deal.TAIL_NONE}
    for snake in (launch(4, 32, 4096), launch(2, 16, 1024, causal=True)):  # alike blocks; under two rounds
        assert snake.params.tail_round == 0, snake.params.tail_round
    q, k, v = (e((32, 16, 512, 128), BF16) for _ in range(3))
    ptxattn.sdpa(q, k, v, causal=True, stream=STREAM)
    (eager,) = next(reversed(prepared._cache().values())).launches
    assert eager.params.tail_round == 14 and list(eager.params.tail_blocks) == want.table()


if __name__ == "__main__":
    globals()[sys.argv[1]]()
    print(f"{sys.argv[1]}: OK")
