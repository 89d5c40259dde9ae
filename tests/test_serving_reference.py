"""The float64 oracle of the serving-batch ops (reference.ragged_attention / paged_attention)
against independent definitions: dense per-sequence sdpa, a softmax per query written out by
hand, paged_decode row by row, and pools built by scattering each row's tokens into pages."""
from __future__ import annotations

import numpy as np
import pytest

from ptxattn import reference as ref
from ptxattn.dtypes import float8_e4m3fn, float8_e5m2

HKV, DQK, DV = 2, 8, 6


def assert_same(got, want, atol=1e-12):
    """allclose for o, and for lse with -inf required in the same places."""
    for x, y in zip(got, want):
        assert np.shape(x) == np.shape(y)
        np.testing.assert_allclose(x, y, rtol=1e-12, atol=atol)


def brute_row(q_row, keys, values, lo, hi, *, scale, softcap=0.0, sink=None):
    """One query by hand: softmax over keys[lo:hi] (clipped to the keys there are)."""
    lo, hi = max(lo, 0), min(hi, len(keys))
    if hi <= lo:
        return np.zeros(values.shape[-1]), -np.inf
    s = keys[lo:hi] @ q_row * scale
    if softcap:
        s = softcap * np.tanh(s / softcap)
    top = s.max()
    e = np.exp(s - top)
    denom = e.sum() + (np.exp(sink - top) if sink is not None else 0.0)
    return e @ values[lo:hi] / denom, float(np.log(e.sum()) + top)


def key_range(i, lq, lk, *, causal, window):
    """[lo, hi) of the keys query i of a (lq, lk) sequence sees, bottom-right aligned."""
    left, right = (None, None) if window is None else window
    left = None if left is None or left < 0 else left
    right = None if right is None or right < 0 else right
    if causal:
        right = 0 if right is None else min(right, 0)
    d = i + lk - lq
    return (0 if left is None else d - left), (lk if right is None else d + right + 1)


def lengths(rng, b, hi=7):
    """b random lengths in [0, hi) that include 0 and 1, shuffled."""
    return rng.permutation(np.concatenate([[0, 1], rng.integers(0, hi, b - 2)]))


def pack(rng, seqs, front=0, back=0):
    """Token-major concatenation of [L, H, D] arrays, with `front` / `back` random rows
    around them; returns (packed, cu [B+1])."""
    tail = seqs[0].shape[1:]
    parts = [rng.standard_normal((front, *tail)), *seqs, rng.standard_normal((back, *tail))]
    cu = front + np.concatenate([[0], np.cumsum([len(s) for s in seqs])])
    return np.concatenate(parts), cu.astype(np.int32)


def token_major(dense):
    """[1, H, L, D] -> [L, H, D]."""
    return dense[0].transpose(1, 0, 2)


def make_pools(rng, lens, *, page, max_pages, layout, unread):
    """Row b's first lens[b] keys / values (token-major [L, Hkv, D]) scattered into random pages
    of NaN-filled pools. Table entries a row does not read point outside the pool
    (unread="outside") or at random pages of the pool (unread="spare")."""
    k_layout, v_layout = (layout, layout) if isinstance(layout, str) else layout
    keys = [rng.standard_normal((n, HKV, DQK)) for n in lens]
    values = [rng.standard_normal((n, HKV, DV)) for n in lens]
    needed = [-(-n // page) for n in lens]
    num_pages = sum(needed) + 3
    ids = iter(rng.permutation(num_pages))
    table = np.empty((len(lens), max_pages), dtype=np.int32)
    pool_k = np.full((num_pages, page, HKV, DQK), np.nan)  # NHD while filling
    pool_v = np.full((num_pages, page, HKV, DV), np.nan)
    for b, n in enumerate(lens):
        for j in range(max_pages):
            if j < needed[b]:
                table[b, j] = p = next(ids)
                pool_k[p, :len(keys[b][j * page:(j + 1) * page])] = keys[b][j * page:(j + 1) * page]
                pool_v[p, :len(values[b][j * page:(j + 1) * page])] = values[b][j * page:(j + 1) * page]
            else:
                table[b, j] = num_pages + 5 if unread == "outside" else rng.integers(num_pages)
    if k_layout == "HND":
        pool_k = pool_k.transpose(0, 2, 1, 3).copy()
    if v_layout == "HND":
        pool_v = pool_v.transpose(0, 2, 1, 3).copy()
    return pool_k, pool_v, table, keys, values


# ---- ragged_attention ----------------------------------------------------------------------

@pytest.mark.parametrize("group", [1, 4])
@pytest.mark.parametrize("softcap, use_sinks", [(0.0, False), (1.5, True)])
@pytest.mark.parametrize("window", [None, (2, 1), (3, -1), (-1, 0)])
@pytest.mark.parametrize("causal", [False, True])
def test_ragged_matches_dense_per_sequence_sdpa(rng, causal, window, softcap, use_sinks, group):
    hq, batch = HKV * group, 5
    lq, lk = lengths(rng, batch), lengths(rng, batch)
    qd = [rng.standard_normal((1, hq, n, DQK)) for n in lq]
    kd = [rng.standard_normal((1, HKV, n, DQK)) for n in lk]
    vd = [rng.standard_normal((1, HKV, n, DV)) for n in lk]
    q, cu_q = pack(rng, [token_major(x) for x in qd], front=2, back=3)
    k, cu_k = pack(rng, [token_major(x) for x in kd], front=1, back=2)
    v, _ = pack(rng, [token_major(x) for x in vd], front=1, back=2)
    sinks = rng.standard_normal(hq) if use_sinks else None
    opts = dict(causal=causal, window=window, scale=0.6, softcap=softcap, sinks=sinks)
    o, lse = ref.ragged_attention(q, k, v, cu_q, cu_k, **opts)
    assert o.shape == (len(q), hq, DV) and lse.shape == (len(q), hq)
    for b in range(batch):
        want_o, want_lse = ref.sdpa(qd[b], kd[b], vd[b], causal_align="bottom_right", **opts)
        rows = slice(cu_q[b], cu_q[b + 1])
        assert_same((o[rows], lse[rows]), (token_major(want_o), want_lse[0].T))
    uncovered = np.r_[0:cu_q[0], cu_q[-1]:len(q)]
    assert np.array_equal(o[uncovered], np.zeros_like(o[uncovered])) and np.all(lse[uncovered] == -np.inf)


@pytest.mark.parametrize("causal, window", [(False, None), (True, None), (False, (1, 2)), (True, (2, 0))])
def test_ragged_matches_brute_force(rng, causal, window):
    hq, group, batch = 8, 4, 4
    lq, lk = lengths(rng, batch), lengths(rng, batch)
    q, cu_q = pack(rng, [rng.standard_normal((n, hq, DQK)) for n in lq], front=1)
    k, cu_k = pack(rng, [rng.standard_normal((n, HKV, DQK)) for n in lk])
    v, _ = pack(rng, [rng.standard_normal((n, HKV, DV)) for n in lk])
    sinks = rng.standard_normal(hq)
    o, lse = ref.ragged_attention(q, k, v, cu_q, cu_k, causal=causal, window=window, scale=0.5,
                                  softcap=2.0, sinks=sinks)
    for b in range(batch):
        keys, vals = k[cu_k[b]:cu_k[b + 1]], v[cu_k[b]:cu_k[b + 1]]
        for i in range(lq[b]):
            lo, hi = key_range(i, lq[b], lk[b], causal=causal, window=window)
            for h in range(hq):
                want = brute_row(q[cu_q[b] + i, h], keys[:, h // group], vals[:, h // group], lo, hi,
                                 scale=0.5, softcap=2.0, sink=sinks[h])
                assert_same((o[cu_q[b] + i, h], lse[cu_q[b] + i, h]), want)


def test_ragged_sequence_ignores_the_rest_of_the_batch(rng):
    hq = 4
    mine = (rng.standard_normal((3, hq, DQK)), rng.standard_normal((5, HKV, DQK)),
            rng.standard_normal((5, HKV, DV)))

    def run(position, batch):
        others = [(rng.standard_normal((m, hq, DQK)), rng.standard_normal((n, HKV, DQK)),
                   rng.standard_normal((n, HKV, DV))) for m, n in zip(lengths(rng, batch), lengths(rng, batch))]
        seqs = others[:position] + [mine] + others[position:]
        q, cu_q = pack(rng, [s[0] for s in seqs], front=int(rng.integers(0, 3)))
        k, cu_k = pack(rng, [s[1] for s in seqs], front=int(rng.integers(0, 3)))
        v, _ = pack(rng, [s[2] for s in seqs], front=int(cu_k[0]))
        o, lse = ref.ragged_attention(q, k, v, cu_q, cu_k, causal=True, window=(3, 0), softcap=1.0,
                                      sinks=np.arange(hq) - 1.0)
        rows = slice(cu_q[position], cu_q[position + 1])
        return o[rows], lse[rows]

    first = run(0, 3)
    for position, batch in [(2, 4), (5, 6), (3, 3)]:
        for x, y in zip(run(position, batch), first):
            np.testing.assert_array_equal(x, y)
    assert np.all(np.isfinite(first[1]))


@pytest.mark.parametrize("cu_q, cu_k", [([0, 3, 2], [0, 1, 2]), ([0, 2, 7], [0, 1, 2]),
                                        ([0, 1, 2], [0, 5, 4]), ([-1, 1, 2], [0, 1, 2]),
                                        ([0, 1], [0, 1, 2])])
def test_ragged_rejects_bad_offsets(rng, cu_q, cu_k):
    q, k = rng.standard_normal((6, 2, 4)), rng.standard_normal((5, 2, 4))
    with pytest.raises(AssertionError):
        ref.ragged_attention(q, k, k, np.array(cu_q), np.array(cu_k))


# ---- paged_attention -----------------------------------------------------------------------

@pytest.mark.parametrize("layout", ["HND", "NHD", ("NHD", "HND")])
@pytest.mark.parametrize("window", [None, (2, 0), (5, -1)])
def test_paged_matches_paged_decode_row_by_row(rng, layout, window):
    hq, batch, page, max_pages = 8, 9, 4, 3
    n = rng.permutation(np.r_[1:5, rng.integers(1, 5, batch - 4)])   # every Sq in 1..4
    lens = rng.integers(0, page * max_pages + 1, batch)
    lens[rng.integers(batch)] = page * max_pages                      # a full row
    pool_k, pool_v, table, _, _ = make_pools(rng, lens, page=page, max_pages=max_pages, layout=layout,
                                             unread="spare")
    q, qo = pack(rng, [rng.standard_normal((m, hq, DQK)) for m in n], front=1, back=1)
    opts = dict(window=window, scale=0.4, softcap=1.5, sinks=rng.standard_normal(hq))
    o, lse = ref.paged_attention(q, pool_k, pool_v, qo, table, lens, layout=layout, **opts)
    for sq in range(1, 5):
        sel = np.flatnonzero(n == sq)
        q_dec = np.stack([q[qo[b]:qo[b + 1]].transpose(1, 0, 2) for b in sel])  # [rows, Hq, Sq, D]
        want_o, want_lse = ref.paged_decode(q_dec, pool_k, pool_v, table[sel], lens[sel], layout=layout, **opts)
        for r, b in enumerate(sel):
            rows = slice(qo[b], qo[b + 1])
            assert_same((o[rows], lse[rows]), (want_o[r].transpose(1, 0, 2), want_lse[r].T))


@pytest.mark.parametrize("layout", ["HND", "NHD", ("HND", "NHD")])
@pytest.mark.parametrize("window", [None, (3, 0)])
def test_paged_equals_causal_ragged_over_the_rows_tokens(rng, layout, window):
    hq, batch, page, max_pages = 4, 6, 3, 4
    lens = lengths(rng, batch, hi=page * max_pages + 1)
    n = rng.integers(0, 6, batch)
    n[:2] = [0, 4]                                                    # an empty chunk, a chunk
    pool_k, pool_v, table, keys, values = make_pools(rng, lens, page=page, max_pages=max_pages,
                                                     layout=layout, unread="outside")
    q, qo = pack(rng, [rng.standard_normal((m, hq, DQK)) for m in n], front=2, back=1)
    opts = dict(window=window, scale=None, softcap=3.0, sinks=rng.standard_normal(hq))
    got = ref.paged_attention(q, pool_k, pool_v, qo, table, lens, layout=layout, **opts)
    k, cu_k = pack(rng, keys, front=2)
    v, _ = pack(rng, values, front=2)
    want = ref.ragged_attention(q, k, v, qo, cu_k, causal=True, **opts)
    assert_same(got, want)
    assert np.all(np.isfinite(got[0])) and not np.all(got[1] == -np.inf)


@pytest.mark.parametrize("window", [None, (1, 0)])
def test_paged_matches_brute_force(rng, window):
    hq, group, batch, page, max_pages = 8, 4, 5, 2, 5
    lens = lengths(rng, batch, hi=page * max_pages + 1)
    n = rng.integers(0, 5, batch)
    pool_k, pool_v, table, keys, values = make_pools(rng, lens, page=page, max_pages=max_pages,
                                                     layout="NHD", unread="outside")
    q, qo = pack(rng, [rng.standard_normal((m, hq, DQK)) for m in n])
    sinks = rng.standard_normal(hq)
    o, lse = ref.paged_attention(q, pool_k, pool_v, qo, table, lens, layout="NHD", window=window,
                                 scale=0.8, sinks=sinks)
    for b in range(batch):
        for i in range(n[b]):
            lo, hi = key_range(i, n[b], lens[b], causal=True, window=window)
            assert hi == lens[b] - n[b] + 1 + i
            for h in range(hq):
                want = brute_row(q[qo[b] + i, h], keys[b][:, h // group], values[b][:, h // group], lo, hi,
                                 scale=0.8, sink=sinks[h])
                assert_same((o[qo[b] + i, h], lse[qo[b] + i, h]), want)


def test_paged_query_without_a_visible_key_gives_zero_and_minus_inf(rng):
    hq, batch, page, max_pages = 4, 6, 4, 2
    n = rng.integers(1, 7, batch)
    lens = np.array([rng.integers(0, m) for m in n])                  # seq_lens[b] < n_b
    lens[0] = 0
    pool_k, pool_v, table, _, _ = make_pools(rng, lens, page=page, max_pages=max_pages, layout="HND",
                                             unread="outside")
    q, qo = pack(rng, [rng.standard_normal((m, hq, DQK)) for m in n], front=3, back=2)
    o, lse = ref.paged_attention(q, pool_k, pool_v, qo, table, lens, window=(2, 0),
                                 sinks=rng.standard_normal(hq))
    for b in range(batch):
        dead = slice(qo[b], qo[b] + n[b] - lens[b])                   # queries i < n_b - seq_lens[b]
        live = slice(qo[b] + n[b] - lens[b], qo[b + 1])
        assert np.array_equal(o[dead], np.zeros_like(o[dead])) and np.all(lse[dead] == -np.inf)
        assert np.all(np.isfinite(lse[live])) and np.all(o[live] != 0)
    uncovered = np.r_[0:qo[0], qo[-1]:len(q)]
    assert np.array_equal(o[uncovered], np.zeros_like(o[uncovered])) and np.all(lse[uncovered] == -np.inf)


@pytest.mark.parametrize("qo, lens, bad_page", [([0, 2, 1], [1, 1], False), ([0, 1, 9], [1, 1], False),
                                                ([0, 1, 2], [1, 9], False), ([0, 1, 2], [-1, 1], False),
                                                ([0, 1, 2], [1, 1], True)])
def test_paged_rejects_bad_arguments(rng, qo, lens, bad_page):
    pool = rng.standard_normal((3, HKV, 4, DQK))                       # capacity 2 pages * 4 = 8
    table = np.array([[0, 1], [-1 if bad_page else 2, 0]], dtype=np.int32)
    with pytest.raises(AssertionError):
        ref.paged_attention(rng.standard_normal((3, 4, DQK)), pool, pool, np.array(qo), table, np.array(lens))


# ---- fp8 K/V: attention over the dequantized values --------------------------------------------
FP8 = [float8_e4m3fn, float8_e5m2]


def quantize(rng, x, fp8, per_token: bool):
    """x [..., D] as fp8 and its scale (a float, or one per row of x less its last axis), and
    the float64 values the pair stands for, worked out here independently of dequantize_fp8."""
    scale = rng.uniform(0.01, 0.1, x.shape[:-1]).astype(np.float32) if per_token else 0.05
    data = (x / (scale[..., None] if per_token else scale)).astype(fp8)
    values = data.astype(np.float64) * (scale.astype(np.float64)[..., None] if per_token else scale)
    return data, scale, values


@pytest.mark.parametrize("per_token", [False, True], ids=["per_tensor", "per_token"])
@pytest.mark.parametrize("fp8", FP8, ids=["e4m3", "e5m2"])
def test_dequantize(rng, fp8, per_token):
    data, scale, values = quantize(rng, rng.standard_normal((5, HKV, DQK)), fp8, per_token)
    got = ref.dequantize_fp8(data, scale)
    assert got.dtype == np.float64
    np.testing.assert_array_equal(got, values)
    x = rng.standard_normal((3, DQK))
    np.testing.assert_array_equal(ref.dequantize_fp8(x), x)  # no scale: the values as they are


@pytest.mark.parametrize("per_token", [False, True], ids=["per_tensor", "per_token"])
@pytest.mark.parametrize("fp8", FP8, ids=["e4m3", "e5m2"])
def test_ragged_fp8_is_attention_over_the_dequantized_values(rng, fp8, per_token):
    hq, batch = 4, 5
    lq, lk = lengths(rng, batch), lengths(rng, batch)
    q, cu_q = pack(rng, [rng.standard_normal((n, hq, DQK)) for n in lq], front=1, back=2)
    k, cu_k = pack(rng, [rng.standard_normal((n, HKV, DQK)) for n in lk], front=2, back=1)
    v, _ = pack(rng, [rng.standard_normal((n, HKV, DQK)) for n in lk], front=2, back=1)
    (k8, k_scale, k_values), (v8, v_scale, v_values) = (quantize(rng, x, fp8, per_token) for x in (k, v))
    if per_token:  # scales of rows no sequence owns are never read
        k_scale[:cu_k[0]] = v_scale[cu_k[-1]:] = np.nan
    opts = dict(causal=True, window=(3, 0), softcap=2.0, sinks=rng.standard_normal(hq))
    got = ref.ragged_attention(q, k8, v8, cu_q, cu_k, k_scale=k_scale, v_scale=v_scale, **opts)
    covered = slice(cu_q[0], cu_q[-1])
    want = ref.ragged_attention(q, k_values, v_values, cu_q, cu_k, **opts)
    assert_same([x[covered] for x in got], [x[covered] for x in want])
    assert np.all(np.isfinite(got[0])) and not np.isnan(got[1]).any()


@pytest.mark.parametrize("layout", ["HND", "NHD", ("NHD", "HND")])
@pytest.mark.parametrize("per_token", [False, True], ids=["per_tensor", "per_token"])
@pytest.mark.parametrize("fp8", FP8, ids=["e4m3", "e5m2"])
def test_paged_fp8_is_attention_over_the_dequantized_pools(rng, fp8, per_token, layout):
    """fp8 pools whose unused pages hold NaN bytes (and NaN scales) against the float64 pools
    they stand for; their result equals ragged attention over the rows' dequantized tokens."""
    hq, batch, page, max_pages = 4, 5, 4, 3
    lens = lengths(rng, batch, hi=page * max_pages + 1)
    n = rng.integers(0, 5, batch)
    pool_k, pool_v, table, keys, values = make_pools(rng, lens, page=page, max_pages=max_pages, layout=layout,
                                                     unread="outside")
    (k8, k_scale, k_values), (v8, v_scale, v_values) = (quantize(rng, np.nan_to_num(pool), fp8, per_token)
                                                        for pool in (pool_k, pool_v))
    for pool, fp8_pool, scale in ((pool_k, k8, k_scale), (pool_v, v8, v_scale)):
        unused = np.isnan(pool).any(axis=-1)
        fp8_pool[unused] = np.nan
        if per_token:
            scale[unused] = np.nan
    k_values[np.isnan(pool_k)] = v_values[np.isnan(pool_v)] = np.nan
    q, qo = pack(rng, [rng.standard_normal((m, hq, DQK)) for m in n], front=1)
    opts = dict(window=(5, 0), scale=0.5, sinks=rng.standard_normal(hq))
    got = ref.paged_attention(q, k8, v8, qo, table, lens, layout=layout, k_scale=k_scale, v_scale=v_scale, **opts)
    assert_same(got, ref.paged_attention(q, k_values, v_values, qo, table, lens, layout=layout, **opts))
    assert np.all(np.isfinite(got[0]))
