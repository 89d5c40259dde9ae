"""Ops captured into CUDA graphs: a softmax replays with new input contents, bitwise equal to
the eager call; a process's first decode made inside a capture; what capture must refuse; the
README's decode loop."""
from __future__ import annotations

import gc
import subprocess
import sys

import numpy as np
import pytest

import ptxattn
from ptxattn import reference
from ptxattn.memory import live_device_bytes

pytestmark = pytest.mark.gpu


@pytest.fixture
def dev():
    return ptxattn.get_device(0)


@pytest.fixture
def stream(dev):
    return ptxattn.Stream.create(device=dev)


def test_softmax_graph_capture_and_replay(rng, dev, stream):
    x = ptxattn.asarray(rng.standard_normal((37, 3000)).astype(np.float32), stream)
    y = ptxattn.empty(x.shape, np.float32, dev)
    ptxattn.softmax(x, out=y, stream=stream)  # load the module before capturing
    with ptxattn.capture(stream, dev) as graph:
        ptxattn.softmax(x, out=y, stream=stream)
    for _ in range(3):
        host = (rng.standard_normal(x.shape) * 5).astype(np.float32)
        x.set(host, stream)
        y.set(np.full(x.shape, np.nan, np.float32), stream)
        graph.replay(stream)
        replayed = y.get(stream)
        np.testing.assert_allclose(replayed, reference.softmax(host), rtol=1e-5, atol=1e-7)
        eager = ptxattn.softmax(x, stream=stream).get(stream)
        assert np.array_equal(replayed.view(np.uint32), eager.view(np.uint32))


_FIRST_USE_IN_CAPTURE = """
import sys
import numpy as np
import ptxattn
from ptxattn.context import on_device
from ptxattn.driver import call, cu
mode = getattr(cu.CUstreamCaptureMode, sys.argv[1])
rng = np.random.default_rng(0)
bf16 = ptxattn.bfloat16
s = ptxattn.Stream.create(non_blocking=False)  # as a CuPy stream: it waits for the legacy stream
q = ptxattn.asarray(rng.standard_normal((2, 8, 1, 128)).astype(bf16), s)
k, v = (ptxattn.asarray(rng.standard_normal((2, 2, 4096, 128)).astype(bf16), s) for _ in range(2))
lens = ptxattn.asarray(np.array([4000, 4096], np.int32), s)
out = ptxattn.empty((2, 8, 1, 128), bf16)
ws = ptxattn.empty((max(ptxattn.decode_workspace_bytes(q, k, v), 1),), np.uint8)
s.synchronize()
with on_device(ptxattn.get_device(0)):  # the raw driver calls below need the context current
    # No decode kernel is loaded yet in this process, nor the device's fault buffer made.
    call(cu.cuStreamBeginCapture, s.handle, mode)
    ptxattn.decode(q, k, v, lens, out=out, workspace=ws, stream=s)
    graph = call(cu.cuStreamEndCapture, s.handle)
    out.set(np.full(out.shape, np.nan, np.float32).astype(bf16), s)
    call(cu.cuGraphLaunch, call(cu.cuGraphInstantiate, graph, 0), s.handle)
replayed = out.get(s)
eager = ptxattn.decode(q, k, v, lens, stream=s).get(s)
assert replayed.tobytes() == eager.tobytes() and not np.isnan(replayed.astype(np.float32)).any()
print("ok")
"""


@pytest.mark.parametrize("mode", ["CU_STREAM_CAPTURE_MODE_GLOBAL", "CU_STREAM_CAPTURE_MODE_THREAD_LOCAL"])
def test_first_use_of_a_kernel_inside_a_capture(mode):
    """A fresh process's first decode is made inside a capture (a host's own, global or thread-
    local mode, on a blocking stream): its kernels' modules load and the device's fault buffer is
    made then (both in relaxed mode; the buffer zeroed on a stream of its own, not the legacy
    stream that the capturing stream waits for), and the graph replays bitwise equal to eager."""
    done = subprocess.run([sys.executable, "-c", _FIRST_USE_IN_CAPTURE, mode], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]


def test_numpy_inputs_refused_while_capturing(rng, dev, stream):
    ptxattn.softmax(np.ones((2, 2), np.float32))
    gc.collect()
    before = live_device_bytes()
    with pytest.raises(RuntimeError, match="NumPy inputs but the stream is capturing"):
        with ptxattn.capture(stream, dev):
            try:
                ptxattn.softmax(rng.standard_normal((4, 8)).astype(np.float32), stream=stream)
            finally:
                # Frees wait for the capture's end: an upload or output made before the
                # refusal would still be counted here.
                during = live_device_bytes()
    assert during == before, "device memory was allocated before the refusal"


def test_allocating_output_refused_while_capturing(rng, dev, stream):
    x = ptxattn.asarray(rng.standard_normal((4, 8)).astype(np.float32), stream)
    with pytest.raises(ptxattn.CaptureAllocationError, match=r"would allocate its out \(128 bytes\)"):
        with ptxattn.capture(stream, dev):
            ptxattn.softmax(x, stream=stream)


def test_objects_collected_during_capture_are_released_after_it(rng, dev, stream):
    x = ptxattn.asarray(rng.standard_normal((8, 64)).astype(np.float32), stream)
    y = ptxattn.empty(x.shape, np.float32, dev)
    ptxattn.softmax(x, out=y, stream=stream)
    temporary = ptxattn.empty((1024,), np.float32, dev)
    with ptxattn.capture(stream, dev) as graph:
        ptxattn.softmax(x, out=y, stream=stream)
    gc.collect()
    held = live_device_bytes()
    with ptxattn.capture(stream, dev) as graph:  # rebinding drops the first graph mid-capture
        del temporary  # and a buffer is freed mid-capture
        ptxattn.softmax(x, out=y, stream=stream)
        during = live_device_bytes()
    assert during == held, "a buffer was freed during the capture (that breaks the capture)"
    assert live_device_bytes() == (held[0] - 1, held[1] - 4096), "the buffer was not freed after the capture"
    graph.replay()
    np.testing.assert_allclose(y.get(stream), reference.softmax(x.get()), rtol=1e-5, atol=1e-7)


def test_readme_decode_step_captured_once_replayed_per_token(rng):
    """The README's decode loop: prepared append + decode, captured once, replayed per token."""
    batch, hq, hkv, capacity, d = 2, 8, 2, 64, 64
    bf16 = ptxattn.bfloat16
    stream = ptxattn.Stream.create()
    k_cache = ptxattn.zeros((batch, hkv, capacity, d), bf16, stream=stream)
    v_cache = ptxattn.zeros((batch, hkv, capacity, d), bf16, stream=stream)
    seq_lens = ptxattn.zeros((batch,), np.int32, stream=stream)
    q = ptxattn.empty((batch, hq, 1, d), bf16)
    k_new, v_new = ptxattn.empty((batch, hkv, 1, d), bf16), ptxattn.empty((batch, hkv, 1, d), bf16)

    append = ptxattn.prepare(ptxattn.kv_append, k_new, v_new, k_cache, v_cache, seq_lens, stream=stream)
    attend = ptxattn.prepare(ptxattn.decode, q, k_cache, v_cache, seq_lens, stream=stream)
    out = attend.arrays["out"]

    def step():
        append.run()
        attend.run()

    keys, values = [], []

    def next_token():
        host = [rng.standard_normal(a.shape).astype(bf16) for a in (q, k_new, v_new)]
        for arr, data in zip((q, k_new, v_new), host):
            arr.set(data, stream)
        keys.append(host[1])
        values.append(host[2])
        return host[0]

    next_token()
    step()
    with ptxattn.capture(stream) as graph:
        step()
    for _ in range(5):
        q_host = next_token()
        graph.replay()
    ptxattn.check_faults(ptxattn.get_device(0), stream)
    assert list(seq_lens.get(stream)) == [6, 6]
    k_host, v_host = np.concatenate(keys, axis=2), np.concatenate(values, axis=2)
    expected, _ = reference.decode(q_host, k_host, v_host, np.array([6, 6]))
    got = out.get(stream).astype(np.float64)
    assert np.linalg.norm(got - expected) / np.linalg.norm(expected) < 1.6e-2
