"""The ONNX project's own node tests for `Attention` (opsets 23-25), through the float64
reference (CPU) and through `ptxattn.sdpa` (GPU).

ONNX packs more into one node than sdpa takes: 3-D [B, S, H*D] inputs, a past KV cache to
concatenate, per-batch valid lengths (nonpad_kv_seqlen), and a causal diagonal aligned at the
past length. The adapter below maps each onto sdpa's terms. Where ONNX's diagonal is neither
top-left nor bottom-right (a past cache with a different new-key count, or per-batch
lengths), it is expressed as an explicit bool mask, the way such a caller would use sdpa.
Only Y is compared (present_key/value and qk_matmul_output are not sdpa outputs).
"""
from __future__ import annotations

import numpy as np
import pytest

import ptxattn
from ptxattn import reference
from ptxattn.dtypes import bfloat16

from onnx_cases import node_cases


def _heads_first(x, heads: int):
    b, s, hd = x.shape
    return x.reshape(b, s, heads, hd // heads).transpose(0, 2, 1, 3)


def _visible(sq: int, skv: int, offset: int, causal: bool, window) -> np.ndarray:
    """[Sq, Skv] visibility with the diagonal of query i at key i + offset."""
    aligned = reference.sdpa_visible_keys(sq, sq + offset, causal=causal, causal_align="bottom_right", window=window)
    if sq + offset >= skv:
        return aligned[:, :skv]
    return np.pad(aligned, ((0, 0), (0, skv - sq - offset)))


def sdpa_arguments(attrs: dict, inputs: dict):
    """(q, k, v, sdpa keyword arguments, three_d) for one ONNX Attention case."""
    q, k, v = inputs["Q"], inputs["K"], inputs["V"]
    three_d = q.ndim == 3
    if three_d:
        q = _heads_first(q, attrs["q_num_heads"])
        k, v = (_heads_first(x, attrs["kv_num_heads"]) for x in (k, v))
    past = 0
    if "past_key" in inputs:
        past = inputs["past_key"].shape[2]
        k = np.concatenate([inputs["past_key"], k], axis=2)
        v = np.concatenate([inputs["past_value"], v], axis=2)
    batch, sq, skv = q.shape[0], q.shape[2], k.shape[2]

    mask = inputs.get("attn_mask")
    if mask is not None and mask.shape[-1] < skv:  # ONNX masks may stop at the valid keys
        pad = [(0, 0)] * (mask.ndim - 1) + [(0, skv - mask.shape[-1])]
        mask = np.pad(mask, pad, constant_values=False if mask.dtype == np.bool_ else -np.inf)
    causal = bool(attrs.get("is_causal", 0))
    left, right = attrs.get("left_window_size", -1), attrs.get("right_window_size", -1)
    window = None if (left, right) == (-1, -1) else (left, right)

    offsets = np.full(batch, past)
    keep = np.ones((batch, 1, 1, skv), bool)
    if "nonpad_kv_seqlen" in inputs:
        lengths = inputs["nonpad_kv_seqlen"].astype(np.int64)
        offsets = lengths - sq
        keep = (np.arange(skv)[None, :] < lengths[:, None])[:, None, None, :]
    align = "top_left"
    if causal or window:
        if np.all(offsets == skv - sq):
            align = "bottom_right"
        elif not np.all(offsets == 0):
            keep = keep & np.stack([_visible(sq, skv, int(o), causal, window) for o in offsets])[:, None]
            causal, window = False, None
    if not keep.all():
        if mask is None:
            mask = keep
        elif mask.dtype == np.bool_:
            mask = mask & keep
        else:
            mask = np.where(keep, mask.astype(np.float32), -np.inf).astype(mask.dtype)
    options = dict(attn_mask=mask, causal=causal, causal_align=align, window=window,
                   scale=attrs.get("scale"), softcap=attrs.get("softcap", 0.0))
    return q, k, v, options, three_d


def _as_onnx_output(o, three_d: bool):
    if not three_d:
        return o
    b, h, s, d = o.shape
    return o.transpose(0, 2, 1, 3).reshape(b, s, h * d)


def _tolerances(expected, rtol: float, atol: float, kernel: bool) -> tuple[float, float]:
    """The case's own tolerances, widened to one rounding of the output dtype (ONNX's
    expected bf16/f16 values went through rounded intermediates) and, for the kernel, to
    its fp32-accumulation error bound on 16-bit inputs."""
    ulp = {np.dtype(np.float16): 2.0**-10, bfloat16: 2.0**-7}.get(np.dtype(expected.dtype), 0.0)
    if kernel:
        ulp = max(2 * ulp, 1e-5)
    return max(rtol, ulp), max(atol, ulp)


CASES = node_cases("Attention")


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_reference_passes_onnx_attention(case):
    name, _, _, attrs, inputs, _, outputs, rtol, atol = case
    q, k, v, options, three_d = sdpa_arguments(attrs, inputs)
    o, _ = reference.sdpa(q, k, v, **options)
    expected = outputs[0]
    got = _as_onnx_output(o, three_d).astype(expected.dtype)
    rtol, atol = _tolerances(expected, rtol, atol, kernel=False)
    np.testing.assert_allclose(got.astype(np.float64), expected.astype(np.float64), rtol=rtol, atol=atol)


@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_kernel_passes_onnx_attention(case):
    name, _, _, attrs, inputs, _, outputs, rtol, atol = case
    q, k, v, options, three_d = sdpa_arguments(attrs, inputs)
    o = ptxattn.sdpa(np.ascontiguousarray(q), np.ascontiguousarray(k), np.ascontiguousarray(v), **options)
    expected = outputs[0]
    got = _as_onnx_output(o, three_d)
    assert got.dtype == expected.dtype and got.shape == expected.shape
    rtol, atol = _tolerances(expected, rtol, atol, kernel=True)
    np.testing.assert_allclose(got.astype(np.float64), expected.astype(np.float64), rtol=rtol, atol=atol)
