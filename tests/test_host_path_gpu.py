"""The host path on a real device: prepared calls equal eager ones bit for bit; outputs and
workspace an op makes come from the stream-ordered pool and go back to it; a decode step
with the host's own CuPy arrays or torch tensors captures (ptxattn.capture, torch.cuda.graph,
CuPy stream capture) and replays bitwise equal to eager; eight threads at once give the bits
of serial calls and leave device memory as they found it."""
from __future__ import annotations

import gc
import threading

import numpy as np
import pytest

import ptxattn
from ptxattn import reference
from ptxattn.context import on_device
from ptxattn.memory import live_device_bytes, pool_bytes_in_use

from decode_util import GuardedAttention, check_attention, nan_tail_cache, rand

pytestmark = pytest.mark.gpu

BF16 = ptxattn.bfloat16


@pytest.fixture
def dev():
    return ptxattn.get_device(0)


@pytest.fixture
def stream(dev):
    with on_device(dev):
        return ptxattn.Stream.create()


def _decode_inputs(rng, dtype, batch=3, hq=8, hkv=2, cap=1500, d=128, sq=1):
    lens = np.array([cap, 1, min(777, cap)][:batch], np.int32)
    return (rand(rng, (batch, hq, sq, d), dtype), nan_tail_cache(rng, batch, hkv, cap, d, dtype, lens),
            nan_tail_cache(rng, batch, hkv, cap, d, dtype, lens), lens)


def _bits(host: np.ndarray) -> bytes:
    return np.ascontiguousarray(host).tobytes()


def test_prepared_decode_equals_eager_and_rebinds(rng, dev, stream):
    q, k, v, lens = _decode_inputs(rng, BF16)
    qd, kd, vd, ld = (ptxattn.asarray(x, stream) for x in (q, k, v, lens))
    guard = GuardedAttention(rng, q.shape, BF16)
    step = ptxattn.prepare(ptxattn.decode, qd, kd, vd, ld, stream=stream, **guard.kwargs)
    assert step.arrays["workspace"].nbytes >= ptxattn.decode_workspace_bytes(qd, kd, vd)  # made at prepare
    o, lse = step.run()
    assert o is guard.o.array and lse is guard.lse.array
    prepared_o, prepared_lse = guard.check()
    check_attention(prepared_o, prepared_lse, *reference.decode(q, k, v, lens), BF16)
    eager_o, eager_lse = ptxattn.decode(qd, kd, vd, ld, return_lse=True, stream=stream)
    assert _bits(eager_o.get(stream)) == _bits(prepared_o)
    assert _bits(eager_lse.get(stream)) == _bits(prepared_lse)

    q2 = rand(rng, q.shape, BF16)
    step.run(q=ptxattn.asarray(q2, stream))  # rebinds q only; stays bound
    check_attention(*guard.check(), *reference.decode(q2, k, v, lens), BF16)
    with pytest.raises(ValueError, match=r"decode\.run: q must match the prepared one"):
        step.run(q=ptxattn.asarray(rand(rng, (3, 8, 2, 128), BF16), stream))


def test_prepared_call_captures_without_preallocating(rng, dev, stream):
    q, k, v, lens = _decode_inputs(rng, np.float16)
    qd, kd, vd, ld = (ptxattn.asarray(x, stream) for x in (q, k, v, lens))
    step = ptxattn.prepare(ptxattn.decode, qd, kd, vd, ld, stream=stream)  # owns out and workspace
    with ptxattn.capture(stream, dev) as graph:
        out = step.run()
    out.set(np.full(out.shape, np.nan, np.float16), stream)
    graph.replay()
    replayed = out.get(stream)
    check_attention(replayed, None, reference.decode(q, k, v, lens)[0], None, np.float16)
    assert _bits(replayed) == _bits(ptxattn.decode(qd, kd, vd, ld, stream=stream).get(stream))


def test_eager_outputs_return_to_the_pool_and_the_workspace_is_reused(rng, dev, stream):
    q, k, v, lens = _decode_inputs(rng, BF16)
    args = [ptxattn.asarray(x, stream) for x in (q, k, v, lens)]
    o = ptxattn.decode(*args, stream=stream)  # warm: modules, fault buffer, binding, the stream's workspace
    del o
    stream.synchronize()
    gc.collect()
    before = live_device_bytes(), pool_bytes_in_use(dev)
    outputs = [ptxattn.decode(*args, stream=stream) for _ in range(5)]
    check_attention(outputs[-1].get(stream), None, reference.decode(q, k, v, lens)[0], None, BF16)
    assert live_device_bytes()[0] == before[0][0] + len(outputs)  # the outputs; the workspace was reused
    del outputs
    gc.collect()
    stream.synchronize()
    assert (live_device_bytes(), pool_bytes_in_use(dev)) == before


def test_stream_workspace_grows_in_stream_order(rng, dev, stream):
    """A call needing more workspace than its stream holds replaces it without waiting for the
    work queued before (which may still read the old one), and both calls are right."""
    from ptxattn.memory import stream_workspace

    small = [ptxattn.asarray(x, stream) for x in _decode_inputs(rng, np.float16, cap=600)]
    large_host = _decode_inputs(rng, np.float16, cap=6000)
    large = [ptxattn.asarray(x, stream) for x in large_host]
    first = ptxattn.decode(*small, stream=stream)
    held = stream_workspace(dev, stream, 1)
    need = ptxattn.decode_workspace_bytes(*large[:3])
    assert need > ptxattn.decode_workspace_bytes(*small[:3])
    second = ptxattn.decode(*large, stream=stream)  # grows: the old buffer is freed after `first`
    assert stream_workspace(dev, stream, need) != held  # replaced, not waited for
    check_attention(first.get(stream), None, reference.decode(*(x.get(stream) for x in small))[0], None, np.float16)
    check_attention(second.get(stream), None, reference.decode(*large_host)[0], None, np.float16)


def test_sdpa_out_lse_preallocated_and_captured(rng, dev, stream):
    q, k, v = (rand(rng, (2, 4, 96, 64), BF16) for _ in range(3))
    qd, kd, vd = (ptxattn.asarray(x, stream) for x in (q, k, v))
    guard = GuardedAttention(rng, q.shape, BF16)
    ptxattn.sdpa(qd, kd, vd, causal=True, stream=stream, **guard.kwargs)
    eager = guard.check()
    check_attention(*eager, *reference.sdpa(q, k, v, causal=True), BF16)
    with ptxattn.capture(stream, dev) as graph:
        ptxattn.sdpa(qd, kd, vd, causal=True, stream=stream, **guard.kwargs)
    guard.o.array.set(np.full(q.shape, np.nan, np.float32).astype(BF16), stream)
    guard.lse.array.set(np.full(q.shape[:3], np.nan, np.float32), stream)
    graph.replay()
    replayed = guard.check()
    assert _bits(replayed[0]) == _bits(eager[0]) and _bits(replayed[1]) == _bits(eager[1])


# ---- the host's own arrays, captured ---------------------------------------------------------
def _step(ops_stream, q, k_new, v_new, k_cache, v_cache, lens, out, workspace):
    """One decode step as a host runs it: append the token's K/V, attend (everything it
    writes preallocated, by the host, so that the step can be captured as it is)."""
    ptxattn.kv_append(k_new, v_new, k_cache, v_cache, lens, stream=ops_stream)
    ptxattn.decode(q, k_cache, v_cache, lens, out=out, workspace=workspace, stream=ops_stream)


def _step_inputs(rng, dtype, batch=2, hq=8, hkv=2, cap=600, d=64):
    host = {"q": rand(rng, (batch, hq, 1, d), dtype), "k_new": rand(rng, (batch, hkv, 1, d), dtype),
            "v_new": rand(rng, (batch, hkv, 1, d), dtype), "k_cache": rand(rng, (batch, hkv, cap, d), dtype),
            "v_cache": rand(rng, (batch, hkv, cap, d), dtype), "lens": np.array([5, 300], np.int32),
            "out": np.full((batch, hq, 1, d), np.nan, dtype)}
    nbytes = ptxattn.decode_workspace_bytes(host["q"], host["k_cache"], host["v_cache"])
    host["workspace"] = np.zeros(max(nbytes, 1), np.uint8)
    return host


def _expected(host: dict, steps: int) -> np.ndarray:
    """The reference after `steps` steps of appending the same token and attending."""
    k, v, lens = host["k_cache"].copy(), host["v_cache"].copy(), host["lens"].copy()
    for _ in range(steps):
        k, v, lens = reference.kv_append(host["k_new"], host["v_new"], k, v, lens)
    return reference.decode(host["q"], k, v, lens)[0]


def test_capture_with_cupy_arrays(rng, dev):
    cp = pytest.importorskip("cupy")
    host = _step_inputs(rng, np.float16)
    with cp.cuda.Device(dev.ordinal):
        arrays = {name: cp.asarray(value) for name, value in host.items()}
        s = cp.cuda.Stream(non_blocking=True)
        eager_arrays = {name: a.copy() for name, a in arrays.items()}
        cp.cuda.Device().synchronize()
        _step(s.ptr, **eager_arrays)  # eager: loads modules, makes the bindings
        s.synchronize()
        eager = cp.asnumpy(eager_arrays["out"])
        check_attention(eager, None, _expected(host, 1), None, np.float16)

        with ptxattn.capture(s.ptr, dev) as ours:  # ptxattn's capture, CuPy arrays passed straight in
            _step(s.ptr, **arrays)
        ours.replay()
        s.synchronize()
        assert _bits(cp.asnumpy(arrays["out"])) == _bits(eager)

        s.begin_capture()  # CuPy's own capture
        _step(s.ptr, **arrays)
        theirs = s.end_capture()
        theirs.launch(s)
        s.synchronize()
        check_attention(cp.asnumpy(arrays["out"]), None, _expected(host, 2), None, np.float16)
        assert cp.asnumpy(arrays["lens"]).tolist() == (host["lens"] + 2).tolist()


def test_capture_with_torch_tensors(rng, dev):
    torch = pytest.importorskip("torch")
    host = _step_inputs(rng, BF16)
    tensors = {name: torch.from_dlpack(ptxattn.asarray(value)).clone() for name, value in host.items()}
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        eager = {name: t.clone() for name, t in tensors.items()}
        _step(side.cuda_stream, **eager)  # warm-up outside the capture
        torch.cuda.synchronize()
        eager_out = ptxattn.asarray(eager["out"]).get()
        check_attention(eager_out, None, _expected(host, 1), None, BF16)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        _step(torch.cuda.current_stream().cuda_stream, **tensors)
    graph.replay()
    torch.cuda.synchronize()
    assert _bits(ptxattn.asarray(tensors["out"]).get()) == _bits(eager_out)
    graph.replay()
    torch.cuda.synchronize()
    check_attention(ptxattn.asarray(tensors["out"]).get(), None, _expected(host, 2), None, BF16)


def test_torch_tensors_made_on_another_stream_are_ordered(rng, dev):
    """DLPack's contract without DLPack's cost: work torch queued on its current stream comes
    before the op on ours."""
    torch = pytest.importorskip("torch")
    with on_device(dev):
        ours = ptxattn.Stream.create()
    q, k, v = (torch.randn(1, 4, 4096, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    for _ in range(3):
        torch.cuda._sleep(20_000_000)  # the producer stream is busy for a while...
        q.mul_(2.0)                   # ...before it writes q
        out = torch.from_dlpack(ptxattn.sdpa(q, k, v, stream=ours))
        ours.synchronize()
        expected = torch.nn.functional.scaled_dot_product_attention(q, k, v).float()
        assert float((out.float() - expected).norm() / expected.norm()) < 2e-2


# ---- threads -----------------------------------------------------------------------------------
def _thread_work(rng_seed: int):
    """A thread's mix of ops and shapes (host data, made once so serial and threaded runs see
    the same inputs)."""
    rng = np.random.default_rng(rng_seed)
    d = [64, 128][rng_seed % 2]
    return {
        "sdpa": [rand(rng, (1, 4, 70 + 13 * rng_seed, d), BF16) for _ in range(3)],
        "decode": _decode_inputs(rng, np.float16, d=d, cap=900 + 100 * rng_seed),
        "append": _step_inputs(rng, np.float32, cap=400 + rng_seed),
        "softmax": rand(rng, (33, 500 + rng_seed), np.float32),
    }


def _run_work(work: dict, stream) -> list[bytes]:
    sq, sk, sv = (ptxattn.asarray(x, stream) for x in work["sdpa"])
    dq, dk, dv, dl = (ptxattn.asarray(x, stream) for x in work["decode"])
    app = {name: ptxattn.asarray(x, stream) for name, x in work["append"].items()}
    x = ptxattn.asarray(work["softmax"], stream)
    results = []
    for _ in range(4):
        results.append(ptxattn.sdpa(sq, sk, sv, causal=True, stream=stream))
        results.append(ptxattn.decode(dq, dk, dv, dl, stream=stream))
        _step(stream, **app)
        results.append(ptxattn.softmax(x, stream=stream))
    results.append(app["lens"])
    return [_bits(r.get(stream)) for r in results]


def test_eight_threads_give_serial_bits_and_leave_memory_as_found(dev):
    works = [_thread_work(seed) for seed in range(8)]
    with on_device(dev):
        streams = [ptxattn.Stream.create() for _ in works]
    serial = [_run_work(w, s) for w, s in zip(works, streams)]  # also warms modules and the pool
    gc.collect()
    for s in streams:
        s.synchronize()
    before = live_device_bytes(), pool_bytes_in_use(dev)
    threaded: list = [None] * len(works)
    errors = []

    def worker(i):
        try:
            threaded[i] = _run_work(works[i], streams[i])
        except BaseException as exc:  # reported below, with the thread's index
            errors.append((i, exc))

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(works))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for i, (got, want) in enumerate(zip(threaded, serial)):
        assert got == want, f"thread {i} differs from its serial run"
    ptxattn.check_faults(dev, streams[0])  # no row ran past its capacity
    gc.collect()
    for s in streams:  # pool memory goes back in each stream's order
        s.synchronize()
    assert (live_device_bytes(), pool_bytes_in_use(dev)) == before
