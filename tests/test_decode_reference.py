"""The float64 oracle of the KV-cache ops (runtime/reference.py) against independent
brute-force definitions: one softmax per query written out by hand, paged caches built by
scattering, and merges against attention over the union of the key sets."""
from __future__ import annotations

import numpy as np
import pytest

from ptxattn import reference as ref


def brute_decode_row(q_row, keys, values, *, length, sq, t, scale, softcap=0.0, left=None, sink=None):
    """One query of decode, by hand: keys < length - sq + 1 + t, and >= that - 1 - left."""
    hi = length - sq + 1 + t
    lo = 0 if left is None else max(0, hi - 1 - left)
    if hi <= lo:
        return np.zeros(values.shape[1]), -np.inf
    s = keys[lo:hi] @ q_row * scale
    if softcap:
        s = softcap * np.tanh(s / softcap)
    e = np.exp(s - s.max())
    denom = e.sum() + (np.exp(sink - s.max()) if sink is not None else 0.0)
    return e @ values[lo:hi] / denom, float(np.log(e.sum()) + s.max())


@pytest.mark.parametrize("window", [None, (3, 0), (0, 5)])
def test_decode_matches_brute_force(rng, window):
    b, hq, hkv, sq, dqk, dv, cap = 3, 4, 2, 3, 8, 6, 12
    q = rng.standard_normal((b, hq, sq, dqk))
    k = rng.standard_normal((b, hkv, cap, dqk))
    v = rng.standard_normal((b, hkv, cap, dv))
    lens = np.array([0, 2, 12])
    sinks = rng.standard_normal(hq)
    o, lse = ref.decode(q, k, v, lens, scale=0.7, softcap=2.0, window=window, sinks=sinks)
    left = None if window is None else window[0]
    for bi in range(b):
        for h in range(hq):
            for t in range(sq):
                want_o, want_lse = brute_decode_row(q[bi, h, t], k[bi, h // 2], v[bi, h // 2], length=lens[bi], sq=sq,
                                                    t=t, scale=0.7, softcap=2.0, left=left, sink=sinks[h])
                np.testing.assert_allclose(o[bi, h, t], want_o, atol=1e-12)
                assert lse[bi, h, t] == pytest.approx(want_lse) if np.isfinite(want_lse) else lse[bi, h, t] == -np.inf


def test_zero_length_row_gives_zeros_and_minus_inf(rng):
    q = rng.standard_normal((1, 2, 1, 4))
    k = np.full((1, 1, 5, 4), np.nan)
    o, lse = ref.decode(q, k, k, [0], sinks=np.ones(2))
    assert np.array_equal(o, np.zeros_like(o)) and np.all(lse == -np.inf)


@pytest.mark.parametrize("layout", ["HND", "NHD"])
def test_paged_decode_equals_contiguous(rng, layout):
    b, hkv, page, pages_per_row, d = 3, 2, 4, 3, 8
    cap = page * pages_per_row
    cache = rng.standard_normal((b, hkv, cap, d))
    perm = rng.permutation(b * pages_per_row + 2)[: b * pages_per_row]  # two spare pages
    table = perm.reshape(b, pages_per_row)
    pool = np.full((b * pages_per_row + 2, hkv, page, d), np.nan)
    for bi in range(b):
        for j in range(pages_per_row):
            pool[table[bi, j]] = cache[bi, :, j * page:(j + 1) * page]
    if layout == "NHD":
        pool = pool.transpose(0, 2, 1, 3).copy()
    q = rng.standard_normal((b, 4, 2, d))
    lens = np.array([1, 7, 12])
    got = ref.paged_decode(q, pool, pool, table, lens, layout=layout)
    want = ref.decode(q, cache, cache, lens)
    for x, y in zip(got, want):
        np.testing.assert_array_equal(x, y)


def test_kv_append_writes_at_lengths_and_skips_overflow(rng):
    cache = rng.standard_normal((3, 2, 6, 4))
    new = rng.standard_normal((3, 2, 2, 4))
    k, v, lens = ref.kv_append(new, -new, cache, cache, np.array([0, 3, 5]))
    assert lens.tolist() == [2, 5, 5]
    np.testing.assert_array_equal(k[0, :, :2], new[0])
    np.testing.assert_array_equal(v[1, :, 3:5], -new[1])
    np.testing.assert_array_equal(k[2], cache[2])  # 5 + 2 > 6: untouched


@pytest.mark.parametrize("layout", ["HND", "NHD", ("HND", "NHD")])
def test_paged_kv_append_then_gather(rng, layout):
    pages, page, hkv, d = 4, 4, 2, 8
    shapes = {"HND": (pages, hkv, page, d), "NHD": (pages, page, hkv, d)}
    k_layout, v_layout = (layout, layout) if isinstance(layout, str) else layout
    k_pool, v_pool = np.zeros(shapes[k_layout]), np.zeros(shapes[v_layout])
    slots = np.array([5, -1, 14, 99])
    new = rng.standard_normal((4, hkv, d))
    k_pool, v_pool = ref.paged_kv_append(new, 2 * new, k_pool, v_pool, slots, layout=layout)
    k = ref.gather_pages(k_pool, [[1, 3]], 8, k_layout)
    v = ref.gather_pages(v_pool, [[1, 3]], 8, v_layout)
    np.testing.assert_array_equal(k[0, :, 1], new[0])   # slot 5 = page 1, offset 1
    np.testing.assert_array_equal(v[0, :, 6], 2 * new[2])  # slot 14 = page 3, offset 2
    assert np.count_nonzero(k) == 2 * hkv * d  # the -1 and the out-of-pool slot wrote nothing


@pytest.mark.parametrize("with_sinks", [False, True])
def test_merge_of_disjoint_key_sets_is_attention_over_their_union(rng, with_sinks):
    q = rng.standard_normal((2, 4, 3, 8))
    k = rng.standard_normal((2, 4, 20, 8))
    v = rng.standard_normal((2, 4, 20, 5))
    cuts = [0, 6, 6, 13, 20]  # includes an empty key set
    sinks = rng.standard_normal(4) if with_sinks else None
    parts = [ref.sdpa(q, k[:, :, a:b], v[:, :, a:b]) for a, b in zip(cuts, cuts[1:])]
    o, lse = ref.merge_states([p[0] for p in parts], [p[1] for p in parts], sinks=sinks)
    want_o, want_lse = ref.sdpa(q, k, v, sinks=sinks)
    np.testing.assert_allclose(o, want_o, atol=1e-12)
    np.testing.assert_allclose(lse, want_lse, atol=1e-12)


def test_merge_ignores_states_without_keys_even_if_their_o_is_nan():
    o, lse = ref.merge_states([np.full((1, 1, 1, 2), np.nan), np.ones((1, 1, 1, 2))],
                              [np.full((1, 1, 1), -np.inf), np.zeros((1, 1, 1))])
    np.testing.assert_array_equal(o, np.ones((1, 1, 1, 2)))
    o, lse = ref.merge_states([np.full((1, 1, 1, 2), np.nan)], [np.full((1, 1, 1), -np.inf)], sinks=[3.0])
    assert np.array_equal(o, np.zeros((1, 1, 1, 2))) and lse[0, 0, 0] == -np.inf
