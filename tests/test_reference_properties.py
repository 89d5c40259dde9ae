"""Properties the float64 reference must have whatever the inputs (hypothesis draws shapes,
options and values): the oracle every kernel is checked against is checked here itself."""
from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from ptxattn import reference

shapes = st.tuples(
    st.integers(1, 2),          # B
    st.sampled_from([1, 2, 4]), # Hkv
    st.sampled_from([1, 2, 3]), # Hq / Hkv
    st.integers(1, 6),          # Sq
    st.integers(2, 9),          # Skv
    st.integers(1, 5),          # D
)


def _inputs(seed: int, b, hkv, group, sq, skv, d):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((b, hkv * group, sq, d))
    k = rng.standard_normal((b, hkv, skv, d))
    v = rng.standard_normal((b, hkv, skv, d))
    return q, k, v


@settings(max_examples=60, deadline=None)
@given(shapes, st.integers(0, 2**32 - 1), st.integers(1, 8), st.booleans(), st.booleans())
def test_merging_two_key_halves_equals_attending_to_all(shape, seed, cut, use_sinks, softcap):
    """sdpa over keys [0, c) and [c, Skv), merged by LSE, is sdpa over all keys."""
    q, k, v = _inputs(seed, *shape)
    cut = min(cut, k.shape[2] - 1)
    options = {"softcap": 2.5 if softcap else 0.0}
    sinks = np.linspace(-1, 1, q.shape[1]) if use_sinks else None
    whole, whole_lse = reference.sdpa(q, k, v, sinks=sinks, **options)
    first = reference.sdpa(q, k[:, :, :cut], v[:, :, :cut], **options)
    second = reference.sdpa(q, k[:, :, cut:], v[:, :, cut:], **options)
    merged, merged_lse = reference.merge_states([first[0], second[0]], [first[1], second[1]], sinks=sinks)
    np.testing.assert_allclose(merged, whole, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(merged_lse, whole_lse, rtol=1e-10, atol=1e-12)


def _attention_head_by_head(q, k, v):
    """Attention written out one query row at a time, query head h reading kv head
    h // (Hq // Hkv): an independent formulation to hold the reference against."""
    batch, hq, sq, d = q.shape
    group = hq // k.shape[1]
    o, lse = np.zeros(q.shape[:3] + (v.shape[3],)), np.zeros(q.shape[:3])
    for b in range(batch):
        for h in range(hq):
            keys, values = k[b, h // group], v[b, h // group]
            for i in range(sq):
                scores = [float(q[b, h, i] @ key) / np.sqrt(d) for key in keys]
                top = max(scores)
                weights = [np.exp(s - top) for s in scores]
                o[b, h, i] = sum(w * value for w, value in zip(weights, values)) / sum(weights)
                lse[b, h, i] = top + np.log(sum(weights))
    return o, lse


@settings(max_examples=60, deadline=None)
@given(shapes, st.integers(0, 2**32 - 1))
def test_gqa_query_heads_read_their_group_kv_head(shape, seed):
    q, k, v = _inputs(seed, *shape)
    o, lse = reference.sdpa(q, k, v)
    want_o, want_lse = _attention_head_by_head(q, k, v)
    np.testing.assert_allclose(o, want_o, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(lse, want_lse, rtol=1e-10, atol=1e-12)


def _causal_window_mask(sq, skv, align, left, right):
    """[Sq][Skv]: key j is visible to query i iff it is at or left of the aligned diagonal
    (causal), at most `left` keys left of it and at most `right` right of it (-1: no bound)."""
    offset = skv - sq if align == "bottom_right" else 0
    mask = np.zeros((sq, skv), dtype=bool)
    for i in range(sq):
        diagonal = i + offset
        for j in range(skv):
            mask[i, j] = j <= diagonal and (left < 0 or diagonal - j <= left) and (right < 0 or j - diagonal <= right)
    return mask


@settings(max_examples=60, deadline=None)
@given(shapes, st.integers(0, 2**32 - 1), st.sampled_from(["top_left", "bottom_right"]),
       st.integers(-1, 3), st.integers(-1, 3))
def test_causal_and_window_equal_the_same_bool_mask(shape, seed, align, left, right):
    q, k, v = _inputs(seed, *shape)
    sq, skv = q.shape[2], k.shape[2]
    visible = _causal_window_mask(sq, skv, align, left, right)
    o, lse = reference.sdpa(q, k, v, causal=True, causal_align=align, window=(left, right))
    o_mask, lse_mask = reference.sdpa(q, k, v, attn_mask=visible)
    np.testing.assert_array_equal(o, o_mask)
    np.testing.assert_array_equal(lse, lse_mask)
    dead = ~visible.any(axis=1)  # fully masked rows: zeros and -inf, never NaN
    assert np.all(o[:, :, dead] == 0) and np.all(lse[:, :, dead] == -np.inf)
    assert not np.isnan(o).any()


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 7), min_size=1, max_size=3), st.integers(0, 2**32 - 1), st.floats(-50, 50))
def test_softmax_rows_sum_to_one_and_ignore_shifts(shape, seed, shift):
    x = np.random.default_rng(seed).standard_normal(shape) * 10
    for axis in range(len(shape)):
        y = reference.softmax(x, axis)
        np.testing.assert_allclose(y.sum(axis=axis), 1.0, rtol=1e-12)
        np.testing.assert_allclose(reference.softmax(x + shift, axis), y, rtol=1e-9, atol=1e-15)
        np.testing.assert_allclose(np.exp(reference.log_softmax(x, axis)), y, rtol=1e-9, atol=1e-15)
