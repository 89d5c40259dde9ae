"""ptxattn.decode on the GPU against the float64 reference: every dtype, GQA 1/4/8, both cache
layouts, lengths 0 / 1 / capacity / split boundaries +-1, Sq up to 16, every option; NaN in
every cache slot past a row's live length, NaN-poisoned outputs framed by canaries; bitwise
determinism across runs, across other rows' lengths and under graph replay; bad lengths
raise after synchronization and leave the context usable."""
from __future__ import annotations

import numpy as np
import pytest

import ptxattn
from ptxattn import reference
from ptxattn.context import on_device
from ptxattn.ops.decode import plan_decode

from decode_util import DTYPE_IDS, DTYPES, GuardedAttention, check_attention, nan_tail_cache, rand, to_layout
from gpu_util import GuardedOutput

pytestmark = pytest.mark.gpu


def device_plan(batch, hq, hkv, sq, d, capacity, dtype):
    dev = ptxattn.get_device(0)
    return plan_decode(batch=batch, hq=hq, hkv=hkv, sq=sq, dqk=d, dv=d, capacity=capacity, dtype=dtype,
                       sm_count=dev.sm_count, max_shared=dev.max_shared_per_block_optin)


def split_size(batch, hq, hkv, sq, d, capacity, dtype) -> int:
    return device_plan(batch, hq, hkv, sq, d, capacity, dtype).keys_per_split


def run(rng, q, k_hnd, v_hnd, lens, layout="HND", **options):
    """decode on device arrays into guarded outputs; returns (o, lse) as NumPy."""
    guard = GuardedAttention(rng, q.shape[:3] + (v_hnd.shape[3],), q.dtype)
    k_layout, v_layout = (layout, layout) if isinstance(layout, str) else layout
    ptxattn.decode(ptxattn.asarray(q), ptxattn.asarray(to_layout(k_hnd, k_layout)),
                   ptxattn.asarray(to_layout(v_hnd, v_layout)), ptxattn.asarray(np.asarray(lens, np.int32)),
                   layout=layout, **options, **guard.kwargs)
    return guard.check()


@pytest.mark.parametrize("layout", ["HND", "NHD", ("NHD", "HND")], ids=["HND", "NHD", "mixed"])
@pytest.mark.parametrize("gqa", [1, 4, 8])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_lengths_layouts_and_gqa(rng, dtype, gqa, layout):
    hkv, d, cap = 2, 128, 700
    kps = split_size(6, hkv * gqa, hkv, 1, d, cap, dtype)
    assert kps + 1 < cap, "the test wants a split boundary inside the capacity"
    lens = [0, 1, kps - 1, kps, kps + 1, cap]
    q = rand(rng, (6, hkv * gqa, 1, d), dtype)
    k = nan_tail_cache(rng, 6, hkv, cap, d, dtype, lens)
    v = nan_tail_cache(rng, 6, hkv, cap, d, dtype, lens)
    o, lse = run(rng, q, k, v, lens, layout)
    check_attention(o, lse, *reference.decode(q, k, v, lens), dtype)


CASES = {
    # name: (Hq, Hkv, Sq, Dqk, Dv, options)
    "sq16_gqa8": (16, 2, 16, 64, 64, {}),
    "sq5_gqa4_window_softcap_scale": (8, 2, 5, 128, 128, {"window": (37, 0), "softcap": 3.0, "scale": 0.3}),
    "sq3_sinks": (8, 2, 3, 64, 64, {"sinks": "random"}),
    "window0_diagonal_only": (4, 4, 2, 64, 64, {"window": (0, -1)}),
    "scale_zero": (4, 2, 1, 64, 64, {"scale": 0.0}),
    "dqk_ne_dv": (4, 1, 2, 192, 128, {}),
    "mqa_many_rows": (64, 1, 4, 64, 64, {"sinks": "random", "softcap": 5.0}),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_options(rng, dtype, case):
    hq, hkv, sq, dqk, dv, options = CASES[case]
    if dtype == np.float32 and max(dqk, dv) > 128:
        dqk, dv = dqk // 2, dv // 2
    options = dict(options)
    if options.get("sinks") == "random":
        options["sinks"] = rng.standard_normal(hq).astype(np.float32)
    batch, cap = 5, 333
    lens = [0, 1, sq - 1, int(rng.integers(sq, cap)), cap]
    q = rand(rng, (batch, hq, sq, dqk), dtype)
    k = nan_tail_cache(rng, batch, hkv, cap, dqk, dtype, lens)
    v = nan_tail_cache(rng, batch, hkv, cap, dv, dtype, lens)
    ref = reference.decode(q, k, v, lens, **options)
    if "sinks" in options:
        options["sinks"] = ptxattn.asarray(options["sinks"])
    o, lse = run(rng, q, k, v, lens, **options)
    check_attention(o, lse, *ref, dtype)


@pytest.mark.parametrize("capacity", [200, 1000], ids=["one_split", "several_splits"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_sinks_lse_and_empty_rows_with_one_split_and_with_several(rng, dtype, capacity):
    # One split: the split kernel writes o and lse itself (no combine); several: the combine.
    batch, hq, hkv, sq, d = 4, 8, 2, 2, 64
    assert (device_plan(batch, hq, hkv, sq, d, capacity, dtype).num_splits == 1) == (capacity == 200)
    lens = [0, 1, capacity // 2 + 1, capacity]
    q = rand(rng, (batch, hq, sq, d), dtype)
    k = nan_tail_cache(rng, batch, hkv, capacity, d, dtype, lens)
    v = nan_tail_cache(rng, batch, hkv, capacity, d, dtype, lens)
    sinks = rng.standard_normal(hq).astype(np.float32)
    options = {"window": (70, 0), "softcap": 4.0}
    o, lse = run(rng, q, k, v, lens, sinks=ptxattn.asarray(sinks), **options)
    ref_o, ref_lse = reference.decode(q, k, v, lens, sinks=sinks, **options)
    check_attention(o, lse, ref_o, ref_lse, dtype)
    # Row 0 has no key, and row 1's first query (t = 0 of Sq 2) none either.
    assert not np.asarray(o[0], np.float32).any() and (lse[0] == -np.inf).all() and (lse[1, :, 0] == -np.inf).all()
    # Without an lse output: the same o, bit for bit.
    alone = GuardedOutput(o.shape, dtype, rng)
    ptxattn.decode(*(ptxattn.asarray(x) for x in (q, k, v, np.asarray(lens, np.int32))), sinks=ptxattn.asarray(sinks),
                   out=alone.array, **options)
    assert alone.check().tobytes() == o.tobytes()


@pytest.mark.parametrize("capacity", [200, 1000], ids=["one_split", "several_splits"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_out_rows_off_vector_alignment(rng, dtype, capacity):
    # out's rows start one element past a 16-byte boundary and lie Dv + 1 apart: the kernel's
    # vector stores must fall back to element stores, and the gaps must stay untouched.
    batch, hq, hkv, sq, d = 3, 8, 2, 2, 64
    lens = np.array([0, capacity // 3, capacity], np.int32)
    q = rand(rng, (batch, hq, sq, d), dtype)
    k = nan_tail_cache(rng, batch, hkv, capacity, d, dtype, lens)
    v = nan_tail_cache(rng, batch, hkv, capacity, d, dtype, lens)
    rows = batch * hq * sq
    whole = ptxattn.asarray(np.full(1 + rows * (d + 1), np.nan, np.float32).astype(dtype))
    item = np.dtype(dtype).itemsize
    out = ptxattn.DeviceArray(whole.ptr + item, (batch, hq, sq, d), dtype,
                              (hq * sq * (d + 1) * item, sq * (d + 1) * item, (d + 1) * item, item),
                              whole.device, whole)
    ptxattn.decode(*(ptxattn.asarray(x) for x in (q, k, v, lens)), out=out)
    host = whole.get()
    o = host[1:].reshape(rows, d + 1)
    check_attention(o[:, :d].reshape(batch, hq, sq, d), None, reference.decode(q, k, v, lens)[0], None, dtype)
    assert np.isnan(host[0]) and np.isnan(o[:, d].astype(np.float32)).all(), "a write outside out's rows"


def test_numpy_in_numpy_out(rng):
    dtype, lens = ptxattn.bfloat16, np.array([5, 0, 40], np.int32)
    q = rand(rng, (3, 8, 2, 64), dtype)
    k = nan_tail_cache(rng, 3, 2, 40, 64, dtype, lens)
    v = nan_tail_cache(rng, 3, 2, 40, 64, dtype, lens)
    o, lse = ptxattn.decode(q, k, v, lens, return_lse=True)
    assert isinstance(o, np.ndarray) and o.dtype == dtype and lse.dtype == np.float32
    check_attention(o, lse, *reference.decode(q, k, v, lens), dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_bitwise_deterministic_across_runs_and_other_rows_lengths(rng, dtype):
    batch, hq, hkv, d, cap = 4, 16, 4, 128, 2048
    lens = np.array([1500, 7, 2048, 600], np.int32)
    q = rand(rng, (batch, hq, 1, d), dtype)
    k = nan_tail_cache(rng, batch, hkv, cap, d, dtype, lens)
    v = nan_tail_cache(rng, batch, hkv, cap, d, dtype, lens)
    first, lse_first = run(rng, q, k, v, lens)
    again, lse_again = run(rng, q, k, v, lens)
    assert first.tobytes() == again.tobytes() and lse_first.tobytes() == lse_again.tobytes()
    # Other rows shorter / longer (same capacity, their new slots filled): row 0 keeps its bits.
    other = np.array([1500, 2048, 3, 0], np.int32)
    k2, v2 = k.copy(), v.copy()
    for b in (1, 2, 3):
        k2[b], v2[b] = rand(rng, k[b].shape, dtype), rand(rng, v[b].shape, dtype)
    changed, _ = run(rng, q, k2, v2, other)
    assert changed[0].tobytes() == first[0].tobytes()


def test_graph_replay_follows_device_lengths_bitwise(rng):
    dtype, batch, hq, hkv, d, cap = ptxattn.bfloat16, 3, 8, 2, 64, 1000
    dev = ptxattn.get_device(0)
    with on_device(dev):
        stream = ptxattn.Stream.create()
    q = ptxattn.asarray(rand(rng, (batch, hq, 1, d), dtype), stream)
    k_host, v_host = rand(rng, (batch, hkv, cap, d), dtype), rand(rng, (batch, hkv, cap, d), dtype)
    k, v = ptxattn.asarray(k_host, stream), ptxattn.asarray(v_host, stream)
    lens = ptxattn.asarray(np.array([10, 20, 30], np.int32), stream)
    out = ptxattn.empty((batch, hq, 1, d), dtype, dev)
    need = ptxattn.decode_workspace_bytes(q, k, v, device=dev)
    workspace = ptxattn.empty((need,), np.uint8, dev)
    ptxattn.decode(q, k, v, lens, out=out, workspace=workspace, stream=stream)  # load modules first
    with ptxattn.capture(stream, dev) as graph:
        ptxattn.decode(q, k, v, lens, out=out, workspace=workspace, stream=stream)
    for new_lens in ([0, 999, 1000], [1, 512, 513], [300, 0, 7]):
        host_lens = np.array(new_lens, np.int32)
        lens.set(host_lens, stream)
        out.set(np.full(out.shape, np.nan, np.float32).astype(dtype), stream)
        graph.replay(stream)
        replayed = out.get(stream)
        eager = ptxattn.decode(q, k, v, lens, stream=stream).get(stream)
        assert replayed.tobytes() == eager.tobytes()
        check_attention(replayed, None, reference.decode(q.get(stream), k_host, v_host, host_lens)[0], None,
                        dtype)


def test_one_split_captures_without_a_workspace(rng):
    # One split needs no workspace, so capture on a stream whose arena holds nothing works.
    dtype, batch, hq, hkv, d, cap = np.float16, 2, 8, 2, 64, 128
    assert device_plan(batch, hq, hkv, 1, d, cap, dtype).workspace_bytes == 0
    dev = ptxattn.get_device(0)
    with on_device(dev):
        stream = ptxattn.Stream.create()
    q_host, lens_host = rand(rng, (batch, hq, 1, d), dtype), np.array([cap, 77], np.int32)
    k_host, v_host = rand(rng, (batch, hkv, cap, d), dtype), rand(rng, (batch, hkv, cap, d), dtype)
    q, k, v, lens = (ptxattn.asarray(x, stream) for x in (q_host, k_host, v_host, lens_host))
    out = ptxattn.empty((batch, hq, 1, d), dtype, dev)
    ptxattn.decode(q, k, v, lens, out=out, stream=stream)  # load modules first
    with ptxattn.capture(stream, dev) as graph:
        ptxattn.decode(q, k, v, lens, out=out, stream=stream)
    out.set(np.full(out.shape, np.nan, dtype), stream)
    graph.replay(stream)
    check_attention(out.get(stream), None, reference.decode(q_host, k_host, v_host, lens_host)[0], None, dtype)


@pytest.mark.parametrize("bad_len, code", [(1001, 2), (-3, 4)])
def test_bad_length_raises_after_sync_and_context_stays_usable(rng, bad_len, code):
    dtype, cap = np.float16, 1000
    lens = np.array([bad_len, 17], np.int32)
    q = rand(rng, (2, 4, 1, 64), dtype)
    k, v = rand(rng, (2, 2, cap, 64), dtype), rand(rng, (2, 2, cap, 64), dtype)
    # Every key and value of the bad row is NaN, and row 1's past its length: a read shows.
    k_bad, v_bad = (nan_tail_cache(rng, 2, 2, cap, 64, dtype, [0, 17]) for _ in range(2))
    dev = ptxattn.get_device(0)
    o = ptxattn.decode(*(ptxattn.asarray(x) for x in (q, k_bad, v_bad, lens)))
    with pytest.raises(ptxattn.DeviceFault, match="row 0") as info:
        ptxattn.check_faults(dev, o.stream or ptxattn.as_stream(None))
    assert info.value.code == code
    got = o.get()
    assert not np.asarray(got[0], np.float32).any(), "the bad row must be skipped (zeros), not read"
    check_attention(got[1:], None, reference.decode(q[1:], k_bad[1:], v_bad[1:], lens[1:])[0], None, dtype)
    with pytest.raises(ValueError, match=r"decode: seq_lens\[0\] = "):  # NumPy lengths are checked on the host
        ptxattn.decode(q, k, v, lens)
    good = np.array([cap, 17], np.int32)
    o, lse = ptxattn.decode(q, k, v, good, return_lse=True)
    check_attention(o, lse, *reference.decode(q, k, v, good), dtype)
