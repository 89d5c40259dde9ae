"""Helpers for the KV-cache GPU tests (decode, paged, kv_cache, merge): random caches whose
slots past each row's live length hold NaN, layout conversions, and checks against the
float64 reference."""
from __future__ import annotations

import numpy as np

import ptxattn
from gpu_util import GuardedOutput, REL_TOL, relative_error

DTYPES = [np.dtype(np.float16), ptxattn.bfloat16, np.dtype(np.float32)]
DTYPE_IDS = ["f16", "bf16", "f32"]


def rand(rng, shape, dtype) -> np.ndarray:
    return rng.standard_normal(shape).astype(np.float32).astype(dtype)


def nan_tail_cache(rng, batch, hkv, capacity, dim, dtype, lens) -> np.ndarray:
    """[B, Hkv, capacity, D] random values, NaN in every slot at or past lens[b]."""
    cache = rng.standard_normal((batch, hkv, capacity, dim)).astype(np.float32)
    for b, length in enumerate(lens):
        cache[b, :, max(int(length), 0):] = np.nan
    return cache.astype(dtype)


def to_layout(cache_hnd: np.ndarray, layout: str) -> np.ndarray:
    """An HND cache or pool ([pages, Hkv, tokens, D]) in `layout`, contiguous."""
    return np.ascontiguousarray(cache_hnd if layout == "HND" else cache_hnd.transpose(0, 2, 1, 3))


def from_layout(cache: np.ndarray, layout: str) -> np.ndarray:
    """The HND view of a cache or pool in `layout` (to_layout's inverse)."""
    return cache if layout == "HND" else cache.transpose(0, 2, 1, 3)


def paginate(rng, cache_hnd: np.ndarray, page_size: int, spare_pages: int = 3):
    """A shuffled HND pool holding the cache (unused pages NaN) and its block table."""
    batch, hkv, capacity, dim = cache_hnd.shape
    per_row = capacity // page_size
    pages = batch * per_row + spare_pages
    order = rng.permutation(pages)[: batch * per_row]
    pool = np.full((pages, hkv, page_size, dim), np.nan, np.float32).astype(cache_hnd.dtype)
    table = order.reshape(batch, per_row).astype(np.int32)
    for b in range(batch):
        for j in range(per_row):
            pool[table[b, j]] = cache_hnd[b, :, j * page_size:(j + 1) * page_size]
    return pool, table


def check_attention(o, lse, ref_o, ref_lse, dtype) -> None:
    """o within the dtype's bound of the reference; lse -inf exactly where the reference's
    is, close elsewhere."""
    dtype = np.dtype(dtype)
    assert relative_error(o, ref_o) <= REL_TOL[dtype], f"relative error {relative_error(o, ref_o):.3g}"
    scale = max(float(np.abs(ref_o).max()), 1e-30)
    assert float(np.abs(np.asarray(o, np.float64) - ref_o).max()) <= 20 * REL_TOL[dtype] * scale
    if lse is None:
        return
    lse = np.asarray(lse, np.float64)
    assert not np.isnan(lse).any(), "NaN in the LSE"
    dead = ref_lse == -np.inf
    assert np.array_equal(lse == -np.inf, dead), "LSE -inf rows differ from the reference's"
    np.testing.assert_allclose(lse[~dead], ref_lse[~dead], atol=2e-5 if dtype == np.float32 else 2e-3, rtol=0)


class GuardedAttention:
    """NaN-poisoned, canary-framed o [B, Hq, Sq, Dv] and lse [B, Hq, Sq] outputs."""

    def __init__(self, rng, shape, dtype) -> None:
        self.o = GuardedOutput(shape, dtype, rng)
        self.lse = GuardedOutput(shape[:3], np.float32, rng)

    @property
    def kwargs(self) -> dict:
        return {"out": self.o.array, "out_lse": self.lse.array, "return_lse": True}

    def check(self):
        return self.o.check(), self.lse.check()


# ---- fp8 caches ------------------------------------------------------------------------------
FP8 = [ptxattn.dtypes.float8_e4m3fn, ptxattn.dtypes.float8_e5m2]
FP8_IDS = ["e4m3", "e5m2"]
FP8_MAX = {ptxattn.dtypes.float8_e4m3fn: 448.0, ptxattn.dtypes.float8_e5m2: 57344.0}
FP8_NAN = 0x7F  # a NaN byte in both types


def fp8_cache(rng, batch, hkv, capacity, dim, fp8, lens, per_token: bool):
    """A random [B, Hkv, capacity, D] fp8 cache quantized from values whose size varies from
    token to token (fp8_quantized)."""
    magnitude = np.exp(rng.uniform(-3, 3, (batch, hkv, capacity, 1)))
    return fp8_quantized(rng.standard_normal((batch, hkv, capacity, dim)) * magnitude, fp8, lens, per_token)


def fp8_quantized(x, fp8, lens, per_token: bool):
    """x [B, Hkv, capacity, D] quantized to fp8 with its scale (a float, or float32
    [B, Hkv, capacity]: each token's largest magnitude to the type's largest value), and the
    float64 cache it stands for. Slots at or past lens[b] hold NaN bytes (and NaN scales)."""
    if per_token:
        scale = (np.abs(x).max(axis=3) / FP8_MAX[fp8]).astype(np.float32)
        data = np.clip(x / scale[..., None], -FP8_MAX[fp8], FP8_MAX[fp8]).astype(fp8)
        dequant = data.astype(np.float64) * scale[..., None]
    else:
        scale = float(np.abs(x).max() / FP8_MAX[fp8])
        data = np.clip(x / scale, -FP8_MAX[fp8], FP8_MAX[fp8]).astype(fp8)
        dequant = data.astype(np.float64) * scale
    for b, length in enumerate(lens):
        data.view(np.uint8)[b, :, max(int(length), 0):] = FP8_NAN
        dequant[b, :, max(int(length), 0):] = np.nan
        if per_token:
            scale[b, :, max(int(length), 0):] = np.nan
    return data, scale, dequant


def scale_to_layout(scale, layout: str):
    """A per-token scale array [pages, Hkv, tokens] in `layout` (a float passes through)."""
    if isinstance(scale, float):
        return scale
    return np.ascontiguousarray(scale if layout == "HND" else scale.transpose(0, 2, 1))


def device_scale(scale, layout: str):
    """An fp8 scale for a device call over a cache in `layout`: a float as it is, a per-token
    array [pages, Hkv, tokens] in the layout, on the device."""
    scale = scale_to_layout(scale, layout)
    return scale if isinstance(scale, float) else ptxattn.asarray(scale)


def nan_fp8(shape, fp8) -> np.ndarray:
    """An fp8 array of NaN bytes (a poisoned cache)."""
    return np.full(shape, FP8_NAN, np.uint8).view(fp8)


def assert_same_fp8(got, want) -> None:
    """fp8 arrays byte for byte, except that NaN matches NaN (a conversion's NaN byte may
    carry either sign)."""
    got_nan, want_nan = np.isnan(got.astype(np.float32)), np.isnan(want.astype(np.float32))
    assert np.array_equal(got_nan, want_nan), f"NaN at {np.argwhere(got_nan != want_nan)[:4].tolist()} differs"
    differ = (got.view(np.uint8) != want.view(np.uint8)) & ~got_nan
    assert not differ.any(), (f"{int(differ.sum())} of {got.size} bytes differ, the first at "
                              f"{np.argwhere(differ)[0].tolist()}: {got[differ][:4].view(np.uint8)} for "
                              f"{want[differ][:4].view(np.uint8)}")
