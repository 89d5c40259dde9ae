"""The float64 sdpa oracle (ptxattn.reference.sdpa) against a plain loop written straight
from the definition, and against cases whose answer is known in closed form."""
from __future__ import annotations

import math

import numpy as np
import pytest

from ptxattn import reference


def _loop_sdpa(q, k, v, mask_full, visible, scale, softcap, sinks):
    """One query row at a time, one key at a time: the definition with no vectorization.
    mask_full: None or [B, Hq, Sq, Skv] (bool or float), already broadcast."""
    batch, hq, sq, _ = q.shape
    hkv, skv, dv = k.shape[1], k.shape[2], v.shape[3]
    o = np.zeros((batch, hq, sq, dv))
    lse = np.full((batch, hq, sq), -np.inf)
    for b in range(batch):
        for h in range(hq):
            kh = h // (hq // hkv)
            for i in range(sq):
                logits = []
                for j in range(skv):
                    s = scale * float(np.dot(q[b, h, i], k[b, kh, j]))
                    if softcap:
                        s = softcap * math.tanh(s / softcap)
                    if not visible[i, j]:
                        s = -math.inf
                    if mask_full is not None:
                        m = mask_full[b, h, i, j]
                        s = (s if m else -math.inf) if mask_full.dtype == bool else s + float(m)
                    logits.append(s)
                finite = [s for s in logits if s != -math.inf]
                if not finite:
                    continue
                top = max(finite)
                weights = [math.exp(s - top) if s != -math.inf else 0.0 for s in logits]
                total = sum(weights)
                denom = total + (math.exp(float(sinks[h]) - top) if sinks is not None else 0.0)
                o[b, h, i] = sum(w * v[b, kh, j] for j, w in enumerate(weights)) / denom
                lse[b, h, i] = top + math.log(total)
    return o, lse


def _visible_loop(sq, skv, causal, align, window):
    diag_offset = skv - sq if align == "bottom_right" else 0
    left, right = window if window is not None else (-1, -1)
    if causal:
        right = 0 if right < 0 else min(right, 0)
    vis = np.zeros((sq, skv), dtype=bool)
    for i in range(sq):
        for j in range(skv):
            d = i + diag_offset
            vis[i, j] = (left < 0 or j >= d - left) and (right < 0 or j <= d + right)
    return vis


CASES = [
    # (B, Hq, Hkv, Sq, Skv, Dqk, Dv, causal, align, window, mask_shape, mask_kind, softcap, sinks, scale)
    (1, 1, 1, 1, 1, 4, 4, False, "top_left", None, None, None, 0.0, False, None),
    (2, 4, 2, 5, 7, 8, 3, True, "top_left", None, None, None, 0.0, False, None),
    (1, 4, 1, 6, 4, 5, 6, True, "bottom_right", None, None, None, 0.0, True, None),
    (1, 2, 2, 7, 9, 4, 4, False, "bottom_right", (2, 1), None, None, 0.0, False, None),
    (2, 2, 1, 4, 6, 3, 5, True, "top_left", (1, -1), (2, 1, 1, 6), "bool", 0.0, True, 0.7),
    (1, 3, 3, 5, 5, 4, 2, False, "top_left", None, (5, 5), "float", 2.5, False, None),
    (2, 2, 2, 3, 8, 6, 6, False, "top_left", None, (2, 2, 3, 8), "bool", 1.0, True, 0.0),
    (1, 2, 1, 4, 3, 4, 4, False, "top_left", (-1, 0), (1, 3), "float", 0.0, False, -0.5),
]


@pytest.mark.parametrize("case", CASES, ids=[f"case{i}" for i in range(len(CASES))])
def test_reference_matches_loop(case, rng):
    (batch, hq, hkv, sq, skv, dqk, dv, causal, align, window, mask_shape, mask_kind,
     softcap, with_sinks, scale) = case
    q = rng.standard_normal((batch, hq, sq, dqk))
    k = rng.standard_normal((batch, hkv, skv, dqk))
    v = rng.standard_normal((batch, hkv, skv, dv))
    mask = None
    if mask_shape is not None:
        mask = rng.random(mask_shape) < 0.7 if mask_kind == "bool" else rng.standard_normal(mask_shape)
    sinks = rng.standard_normal(hq) if with_sinks else None
    o, lse = reference.sdpa(q, k, v, attn_mask=mask, causal=causal, causal_align=align,
                            window=window, scale=scale, softcap=softcap, sinks=sinks)
    mask_full = None if mask is None else np.broadcast_to(mask, (batch, hq, sq, skv))
    visible = _visible_loop(sq, skv, causal, align, window)
    assert np.array_equal(visible, reference.sdpa_visible_keys(sq, skv, causal=causal,
                                                                 causal_align=align, window=window))
    want_o, want_lse = _loop_sdpa(q, k, v, mask_full, visible,
                                  1 / math.sqrt(dqk) if scale is None else scale, softcap, sinks)
    np.testing.assert_allclose(o, want_o, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(lse, want_lse, rtol=1e-12, atol=1e-12)


def test_causal_alignments_known_pattern():
    top = reference.sdpa_visible_keys(2, 4, causal=True, causal_align="top_left")
    bottom = reference.sdpa_visible_keys(2, 4, causal=True, causal_align="bottom_right")
    assert top.tolist() == [[True, False, False, False], [True, True, False, False]]
    assert bottom.tolist() == [[True, True, True, False], [True, True, True, True]]
    window = reference.sdpa_visible_keys(3, 3, window=(1, 0))
    assert window.tolist() == [[True, False, False], [True, True, False], [False, True, True]]


def test_fully_masked_rows_give_zero_and_minus_inf(rng):
    q, k, v = rng.standard_normal((1, 2, 3, 4)), rng.standard_normal((1, 1, 2, 4)), rng.standard_normal((1, 1, 2, 4))
    # bottom-right causal with Sq > Skv: query 0 sees no key.
    for sinks in (None, np.array([0.5, 3.0])):
        o, lse = reference.sdpa(q, k, v, causal=True, causal_align="bottom_right", softcap=1.5, sinks=sinks)
        assert np.all(o[:, :, 0] == 0) and np.all(lse[:, :, 0] == -np.inf)
        assert np.all(np.isfinite(o)) and np.all(np.isfinite(lse[:, :, 1:]))
    mask = np.zeros((3, 2), dtype=bool)
    o, lse = reference.sdpa(q, k, v, attn_mask=mask)
    assert np.all(o == 0) and np.all(lse == -np.inf)
    o, lse = reference.sdpa(q, k, v, attn_mask=np.full((3, 2), -np.inf))
    assert np.all(o == 0) and np.all(lse == -np.inf)


def test_scale_zero_is_uniform_average(rng):
    q, k, v = rng.standard_normal((1, 1, 2, 4)), rng.standard_normal((1, 1, 5, 4)), rng.standard_normal((1, 1, 5, 3))
    o, lse = reference.sdpa(q, k, v, scale=0.0)
    np.testing.assert_allclose(o[0, 0], np.broadcast_to(v[0, 0].mean(axis=0), (2, 3)), rtol=1e-12)
    np.testing.assert_allclose(lse, np.log(5.0))


def test_sink_joins_denominator_only(rng):
    q, k, v = rng.standard_normal((1, 1, 1, 4)), rng.standard_normal((1, 1, 3, 4)), rng.standard_normal((1, 1, 3, 2))
    plain_o, plain_lse = reference.sdpa(q, k, v)
    sink = np.array([0.3])
    o, lse = reference.sdpa(q, k, v, sinks=sink)
    total = np.exp(plain_lse[0, 0, 0])
    np.testing.assert_allclose(o, plain_o * total / (total + np.exp(0.3)), rtol=1e-12)
    np.testing.assert_allclose(lse, plain_lse, rtol=1e-12)


def test_empty_lengths():
    q = np.ones((1, 2, 3, 4))
    o, lse = reference.sdpa(q, np.ones((1, 1, 0, 4)), np.ones((1, 1, 0, 5)))
    assert o.shape == (1, 2, 3, 5) and np.all(o == 0) and np.all(lse == -np.inf)
    o, lse = reference.sdpa(np.ones((1, 2, 0, 4)), np.ones((1, 1, 3, 4)), np.ones((1, 1, 3, 5)))
    assert o.shape == (1, 2, 0, 5) and lse.shape == (1, 2, 0)
