"""The float64 oracle of the quantizing append (reference.quantize_fp8, fp8_token_scales,
kv_append_fp8, paged_kv_append_fp8) against hand-worked values and its own promises:
saturation, ties to even, NaN kept, zero rows, the error bound quantization allows, slots and
scales outside the written ones untouched. No GPU."""
from __future__ import annotations

import numpy as np
import pytest

from ptxattn import bfloat16, reference as ref
from ptxattn.dtypes import FP8

E4M3, E5M2 = FP8
FP8_MAX = {E4M3: 448.0, E5M2: 57344.0}
HALF_TOP_STEP = {E4M3: 16.0, E5M2: 4096.0}  # half the spacing of the top binade: the largest rounding error
FP8_NAN = 0x7F


def test_quantize_saturates_rounds_to_even_and_keeps_nan():
    x = np.array([896, 1000, -1e9, np.inf, -np.inf, np.nan, 2.125, 2.375, 0.0, -0.0], np.float32)
    got = ref.quantize_fp8(x, 2.0, E4M3).astype(np.float32)
    # 2.125 / 2 = 1.0625 lies halfway between 1.0 and 1.125: even mantissa 1.0; 1.1875 -> 1.25.
    np.testing.assert_array_equal(got, [448, 448, -448, 448, -448, np.nan, 1.0, 1.25, 0.0, -0.0])
    assert np.signbit(got[-1])
    e5m2 = ref.quantize_fp8(np.array([1e6, -np.inf, 3.0], np.float32), 1.0, E5M2).astype(np.float32)
    np.testing.assert_array_equal(e5m2, [57344, -57344, 3.0])


def test_quantize_rounds_the_float32_quotient():
    # x / scale is just above 1.0625 (halfway between 1.0 and 1.125) but rounds to it in float32,
    # as the kernels' division does: the tie then goes to even, 1.0 (float64 would give 1.125).
    x, scale = np.float32(1.606310486793518), np.float32(1.5118216276168823)
    assert np.float64(x) / np.float64(scale) > 1.0625 and x / scale == np.float32(1.0625)
    assert ref.quantize_fp8(x, scale, E4M3) == 1.0


def test_token_scales_from_the_largest_finite_magnitude():
    rows = np.array([[0.0, 0.0, -0.0, 0.0], [1.0, -4.0, np.nan, np.inf], [np.nan, np.inf, -np.inf, 0.0],
                     [3.0, 2.0, 1.0, 0.5]], np.float32)
    scales = ref.fp8_token_scales(rows, E4M3)
    assert scales.dtype == np.float32
    np.testing.assert_array_equal(scales, [1.0, np.float32(4.0) / np.float32(448.0), 1.0,
                                           np.float32(3.0) / np.float32(448.0)])


def nan_fp8(shape, fp8):
    return np.full(shape, FP8_NAN, np.uint8).view(fp8)


@pytest.mark.parametrize("fp8", FP8, ids=["e4m3", "e5m2"])
def test_kv_append_per_token_writes_rows_and_scales_only_where_it_appends(rng, fp8):
    batch, hkv, cap, n, d = 3, 2, 8, 3, 32
    lens = np.array([0, 5, 6])  # row 2: 6 + 3 > 8, not written
    k_new = (rng.standard_normal((batch, hkv, n, d)) * np.exp(rng.uniform(-8, 8, (batch, hkv, n, 1))))
    k_new = k_new.astype(bfloat16)
    k_new[0, 1, 2] = 0  # a zero row: scale 1, zeros
    cache, scales = nan_fp8((batch, hkv, cap, d), fp8), np.full((batch, hkv, cap), np.nan, np.float32)
    k, v, new_lens, k_scale, v_scale = ref.kv_append_fp8(k_new, k_new, cache, cache, lens, k_scale=scales,
                                                          v_scale=0.5)
    assert new_lens.tolist() == [3, 8, 6] and v_scale == 0.5
    x = k_new.astype(np.float64)
    for b, start in ((0, 0), (1, 5)):
        written = slice(start, start + n)
        s = k_scale[b, :, written]
        np.testing.assert_array_equal(s, ref.fp8_token_scales(k_new[b], fp8))
        np.testing.assert_array_equal(k[b, :, written].view(np.uint8),
                                      ref.quantize_fp8(k_new[b], s[..., None], fp8).view(np.uint8))
        np.testing.assert_array_equal(v[b, :, written].view(np.uint8), ref.quantize_fp8(k_new[b], 0.5, fp8).view(np.uint8))
        error = np.abs(ref.dequantize_fp8(k[b, :, written], s) - x[b])
        amax = np.abs(x[b]).max(axis=-1, keepdims=True)
        assert (error <= amax * HALF_TOP_STEP[fp8] / FP8_MAX[fp8] * (1 + 1e-6)).all()
        untouched = np.ones(cap, bool)
        untouched[written] = False
        assert (k[b, :, untouched].view(np.uint8) == FP8_NAN).all() and np.isnan(k_scale[b, :, untouched]).all()
    assert k_scale[0, 1, 2] == 1.0 and not k[0, 1, 2].astype(np.float32).any()
    assert (k[2].view(np.uint8) == FP8_NAN).all() and np.isnan(k_scale[2]).all()


def test_kv_append_fp8_rows_are_copied_with_their_scales(rng):
    batch, hkv, cap, n, d = 2, 2, 6, 2, 16
    k_new = rng.standard_normal((batch, hkv, n, d)).astype(E5M2)
    new_scales = rng.uniform(0.1, 2, (batch, hkv, n)).astype(np.float32)
    cache, scales = nan_fp8((batch, hkv, cap, d), E5M2), np.full((batch, hkv, cap), np.nan, np.float32)
    k, v, _, k_scale, v_scale = ref.kv_append_fp8(k_new, k_new, cache, cache, np.array([1, 4]), k_scale=scales,
                                                  v_scale=3.0, k_new_scale=new_scales)
    np.testing.assert_array_equal(k[0, :, 1:3].view(np.uint8), k_new[0].view(np.uint8))
    np.testing.assert_array_equal(v[1, :, 4:6].view(np.uint8), k_new[1].view(np.uint8))
    np.testing.assert_array_equal(k_scale[1, :, 4:6], new_scales[1])
    assert np.isnan(k_scale[0, :, 3:]).all() and v_scale == 3.0


@pytest.mark.parametrize("layout", ["HND", "NHD", ("NHD", "HND")], ids=["HND", "NHD", "mixed"])
def test_paged_kv_append_fp8_puts_scales_beside_their_rows(rng, layout):
    pages, page, hkv, d = 4, 4, 2, 16
    k_layout, v_layout = (layout, layout) if isinstance(layout, str) else layout
    shape = {"HND": (pages, hkv, page, d), "NHD": (pages, page, hkv, d)}
    slots = np.array([5, -1, 14, 99])
    new = (rng.standard_normal((4, hkv, d)) * 100).astype(np.float16)
    k_pool, v_pool = nan_fp8(shape[k_layout], E4M3), nan_fp8(shape[v_layout], E4M3)
    k_scales = np.full(shape[k_layout][:3], np.nan, np.float32)
    v_scales = np.full(shape[v_layout][:3], np.nan, np.float32)
    k_pool, v_pool, k_scales, v_scales = ref.paged_kv_append_fp8(new, new, k_pool, v_pool, slots, layout=layout,
                                                                 k_scale=k_scales, v_scale=v_scales)
    for pool, scales, lay in ((k_pool, k_scales, k_layout), (v_pool, v_scales, v_layout)):
        cache = ref.dequantize_fp8(ref.gather_pages(pool, [[1, 3]], 8, lay),
                                   ref.gather_pages(scales[..., None], [[1, 3]], 8, lay)[..., 0])
        for token, position in ((0, 1), (2, 6)):  # slot 5 = page 1 offset 1, slot 14 = page 3 offset 2
            x = new[token].astype(np.float64)
            # Half e4m3's top step (16 of 448) of the row's amax, and float32's rounding of the scale.
            bound = np.abs(x).max(axis=-1, keepdims=True) / 28 * (1 + 1e-6)
            assert (np.abs(cache[0, :, position] - x) <= bound).all()
        assert np.count_nonzero(~np.isnan(scales)) == 2 * hkv  # the -1 and the out-of-pool slot wrote nothing
