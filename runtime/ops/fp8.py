"""fp8 KV caches: which dtypes they hold and the scales that come with them.

A scale is per tensor (a positive number) or per (token, kv head): a float32 array shaped
like its cache without the last axis ([B, Hkv, capacity] for an "HND" cache, [B, capacity,
Hkv] for "NHD"; a pool's [pages, Hkv, page_size] or [pages, page_size, Hkv]), addressed
through its own strides. The cached value x stands for x * scale (a per-token scale may be
of either sign; kv_append writes positive ones).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ..dtypes import float8_e4m3fn, float8_e5m2
from .checks import check_nonnegative_strides, is_real

__all__ = ["FP8_MAX", "KERNEL_NAMES", "KV_FP8_CODES", "KvScale", "is_fp8", "parse_kv_scale", "parse_kv_scales",
           "scale_strides"]

FP8_MAX = {float8_e4m3fn: 448.0, float8_e5m2: 57344.0}  # the largest finite values
KERNEL_NAMES = {float8_e4m3fn: "e4m3", float8_e5m2: "e5m2"}  # as in cu/variants.json
KV_FP8_CODES = {float8_e4m3fn: 1, float8_e5m2: 2}  # Fp8Kind in cu/fp8.cuh (the sdpa tile kernels)


def is_fp8(dtype) -> bool:
    return np.dtype(dtype) in FP8_MAX


@dataclass(frozen=True)
class KvScale:
    """One validated scale argument: `value` for a per-tensor scale, else `per_token` (the
    array is the op's argument of that name)."""

    value: float = 1.0
    per_token: bool = False


def parse_kv_scale(op: str, name: str, value, cache, cache_name: str, layout: str) -> KvScale | None:
    """`name` (k_scale / v_scale) for `cache`: None for a cache that is not fp8 (a scale is
    refused there), else required, a positive finite number or a float32 array of the
    cache's shape less its last axis."""
    if not is_fp8(cache.dtype):
        if value is not None:
            raise TypeError(f"{op}: {name} applies to float8 caches only, and {cache_name} is {cache.dtype}; "
                            f"got {name}={value!r:.60}")
        return None
    if value is None:
        raise TypeError(f"{op}: {name} is required with a {cache.dtype} {cache_name}: a positive number (one "
                        f"scale for the tensor) or a float32 array of shape {tuple(cache.shape[:-1])} (one per "
                        f"token and kv head), got None")
    if is_real(value):
        if not math.isfinite(value) or value <= 0:
            raise ValueError(f"{op}: {name} must be finite and > 0, got {value!r}")
        return KvScale(value=float(value))
    if not hasattr(value, "shape") or not hasattr(value, "dtype"):
        raise TypeError(f"{op}: {name} must be a positive number or a float32 array, got {type(value).__name__}")
    expect = tuple(cache.shape[:-1])
    if np.dtype(value.dtype) != np.float32 or tuple(value.shape) != expect:
        raise TypeError(f"{op}: {name} must be float32 of shape {expect} ({cache_name}'s shape less its last axis, "
                        f"layout {layout}), got {value.dtype} {tuple(value.shape)}")
    check_nonnegative_strides(op, name, value)
    return KvScale(per_token=True)


def parse_kv_scales(op: str, a: dict, k_scale, v_scale, k: tuple[str, str],
                    v: tuple[str, str]) -> tuple[KvScale | None, KvScale | None]:
    """parse_kv_scale of k_scale and v_scale for the K and V arguments named k[0] / v[0] (of
    layouts k[1] / v[1]): k_scale / v_scale are the number options, None where the array
    argument of that name carries the scales."""
    return tuple(parse_kv_scale(op, name, a[name] if a[name] is not None else value, a[cache], cache, layout)
                 for name, value, (cache, layout) in (("k_scale", k_scale, k), ("v_scale", v_scale, v)))


def scale_strides(arr, layout: str) -> tuple[int, int, int]:
    """Element strides (page, head, token) of a per-token scale array on the device."""
    page, a, b = arr.element_strides
    return (page, a, b) if layout == "HND" else (page, b, a)
