"""The contiguous KV cache: kv_append (kernels in cu/kv_cache.cu), and the cache / pool views
that decode, paged_decode and paged_kv_append share.

Every kernel of this family addresses a cache as (page, kv head, token in page, d) through
element strides. A contiguous cache is the paged case with one page per batch row:
"HND" is [B, Hkv, capacity, D] and "NHD" is [B, capacity, Hkv, D]; a pool is
[num_pages, Hkv, page_size, D] ("HND") or [num_pages, page_size, Hkv, D] ("NHD"). The layout
is always said, never guessed from the shape (Hkv == capacity would be ambiguous).
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass

import numpy as np

from ..array import DeviceArray
from ..faults import fault_buffer
from ..module import ParamStruct
from .checks import (check_attention_dtype, check_flag, check_host_values, check_index_array, check_rank,
                     check_row_bytes, check_same_dtype, parse_layout, require)
from .prepared import Op

__all__ = ["kv_append", "CacheShape", "cache_shape", "cache_strides"]

APPEND_THREADS = 256
APPEND_GRID_CAP = 4096  # kv_append loops past it (grid-stride)
ADVANCE_THREADS = 128


class KvAppendParams(ParamStruct):
    """Mirror of KvAppendParams in cu/kv_cache.cu (same fields, same order)."""

    _fields_ = [
        ("k_new", ctypes.c_void_p), ("v_new", ctypes.c_void_p),
        ("k_cache", ctypes.c_void_p), ("v_cache", ctypes.c_void_p),
        ("seq_lens", ctypes.c_void_p), ("slot_mapping", ctypes.c_void_p), ("fault", ctypes.c_void_p),
        ("kn_stride_row", ctypes.c_int64), ("kn_stride_head", ctypes.c_int64), ("kn_stride_tok", ctypes.c_int64),
        ("vn_stride_row", ctypes.c_int64), ("vn_stride_head", ctypes.c_int64), ("vn_stride_tok", ctypes.c_int64),
        ("k_stride_page", ctypes.c_int64), ("k_stride_head", ctypes.c_int64), ("k_stride_tok", ctypes.c_int64),
        ("v_stride_page", ctypes.c_int64), ("v_stride_head", ctypes.c_int64), ("v_stride_tok", ctypes.c_int64),
        ("rows", ctypes.c_int32), ("heads", ctypes.c_int32), ("tokens", ctypes.c_int32),
        ("dk", ctypes.c_int32), ("dv", ctypes.c_int32), ("elem_bytes", ctypes.c_int32),
        ("capacity", ctypes.c_int32), ("num_pages", ctypes.c_int32), ("page_size_log2", ctypes.c_int32),
        ("slot_is_int64", ctypes.c_int32),
    ]


@dataclass(frozen=True)
class CacheShape:
    """A cache or pool seen as pages of tokens: (pages, heads, tokens per page, dim)."""

    pages: int
    heads: int
    tokens: int
    dim: int


def cache_shape(op: str, name: str, arr, layout: str) -> CacheShape:
    require(op, name, arr)
    check_rank(op, name, arr, 4, f"({'[pages, Hkv, tokens, D]' if layout == 'HND' else '[pages, tokens, Hkv, D]'} "
                                 f"for layout {layout})")
    pages, a, b, dim = (int(n) for n in arr.shape)
    return CacheShape(pages, a, b, dim) if layout == "HND" else CacheShape(pages, b, a, dim)


def cache_strides(arr: DeviceArray, layout: str) -> tuple[int, int, int]:
    """Element strides (page, head, token) of a cache on the device."""
    page, a, b, _ = arr.element_strides
    return (page, a, b) if layout == "HND" else (page, b, a)


def new_tokens_strides(arr: DeviceArray) -> tuple[int, int, int]:
    """(row, head, token) element strides of k_new [rows, Hkv, n, D] or [tokens, Hkv, D]."""
    es = arr.element_strides
    return (es[0], es[1], es[2]) if arr.ndim == 4 else (es[0], es[1], 0)


def check_writable(op: str, a: dict, names) -> None:
    """NumPy arrays an op updates in place must be writable (checked before any upload)."""
    for name in names:
        arr = a[name]
        if isinstance(arr, np.ndarray) and not arr.flags.writeable:
            raise ValueError(f"{op}: {name} is updated in place but the NumPy array is read-only")


# ---- binding ----------------------------------------------------------------------------------
def bind_append(binding, a: dict, names: tuple[str, str, str, str, str], params: KvAppendParams, rows: int,
                tokens: int, heads: int, chunks_per_head: int, advance: bool) -> None:
    """The append launch (and with `advance`, kv_advance) over `params`, whose pointer fields
    follow `names`: (k_new, v_new, k cache or pool, v cache or pool, seq_lens or slot_mapping)."""
    params.fault = fault_buffer(binding.device)
    launches = []
    total = rows * tokens * heads * chunks_per_head
    if total:
        grid = min(-(-total // APPEND_THREADS), APPEND_GRID_CAP)
        launches.append(binding.launch("kv_append", (grid, 1, 1), (APPEND_THREADS, 1, 1), params))
    if advance and rows:
        launches.append(binding.launch("kv_advance", (-(-rows // ADVANCE_THREADS), 1, 1), (ADVANCE_THREADS, 1, 1),
                                       params))
    if not launches:
        return
    index_field = "seq_lens" if names[4] == "seq_lens" else "slot_mapping"
    # Both launches share one struct: one set of views rewrites it for both.
    for name, field in zip(names, ("k_new", "v_new", "k_cache", "v_cache", index_field)):
        binding.point(name, launches[0], field)


def _validate(a: dict, layout, advance, on_host: bool = False):
    op = "kv_append"
    k_layout, v_layout = parse_layout(op, layout)
    check_flag(op, "advance", advance)
    for name, what in (("k_new", "[B, Hkv, n, Dk]"), ("v_new", "[B, Hkv, n, Dv]")):
        require(op, name, a[name])
        check_rank(op, name, a[name], 4, what)
    kc, vc = cache_shape(op, "k_cache", a["k_cache"], k_layout), cache_shape(op, "v_cache", a["v_cache"], v_layout)
    batch, heads, n, dk = a["k_new"].shape
    expect_v = (batch, heads, n, vc.dim)
    if tuple(a["v_new"].shape) != expect_v:
        raise ValueError(f"{op}: v_new must have shape {expect_v} (k_new's [B, Hkv, n] and v_cache's D), "
                         f"got {tuple(a['v_new'].shape)}")
    for name, shape in (("k_cache", kc), ("v_cache", vc)):
        if (shape.pages, shape.heads) != (batch, heads):
            raise ValueError(f"{op}: {name} must hold B={batch} rows of Hkv={heads} heads (k_new's), "
                             f"got {shape.pages} rows of {shape.heads} heads")
    if kc.dim != dk:
        raise ValueError(f"{op}: k_cache's D ({kc.dim}) must equal k_new's ({dk})")
    if kc.tokens != vc.tokens:
        raise ValueError(f"{op}: k_cache and v_cache must have one capacity, got {kc.tokens} and {vc.tokens}")
    if n > kc.tokens:
        raise ValueError(f"{op}: cannot append n={n} tokens to a cache of capacity {kc.tokens}")
    for name in ("k_cache", "v_cache", "k_new", "v_new"):
        check_attention_dtype(op, name, a[name])
        check_row_bytes(op, name, a[name])
    check_same_dtype(op, "k_new", a["k_new"], "k_cache", a["k_cache"])
    check_same_dtype(op, "v_new", a["v_new"], "v_cache", a["v_cache"])
    check_same_dtype(op, "v_cache", a["v_cache"], "k_cache", a["k_cache"])
    require(op, "seq_lens", a["seq_lens"])
    check_index_array(op, "seq_lens", a["seq_lens"], (batch,))
    if on_host:
        check_writable(op, a, ("k_cache", "v_cache", "seq_lens"))
        check_host_values(op, "seq_lens", a["seq_lens"], 0, kc.tokens - n,
                          f"the write position; capacity {kc.tokens}, appending {n}")
    return k_layout, v_layout, kc, vc


def _bind(binding, a: dict, checked, layout, advance) -> None:
    k_layout, v_layout, kc, vc = checked
    batch, heads, n, dk = a["k_new"].shape
    itemsize = a["k_cache"].itemsize
    params = KvAppendParams(
        0, 0, 0, 0, 0, None, None,
        *new_tokens_strides(a["k_new"]), *new_tokens_strides(a["v_new"]),
        *cache_strides(a["k_cache"], k_layout), *cache_strides(a["v_cache"], v_layout),
        batch, heads, n, dk, vc.dim, itemsize, kc.tokens, 0, 0, 0,
    )
    bind_append(binding, a, ("k_new", "v_new", "k_cache", "v_cache", "seq_lens"), params, batch, n, heads,
                (dk + vc.dim) * itemsize // 16, bool(advance))


_KV_APPEND = Op("kv_append", ("k_new", "v_new", "k_cache", "v_cache", "seq_lens"), ("layout", "advance"),
                in_place=("k_cache", "v_cache", "seq_lens"), validate=_validate, bind=_bind)


def kv_append(k_new, v_new, k_cache, v_cache, seq_lens, *, layout="HND", advance: bool = True, stream=None) -> None:
    """Write k_new [B, Hkv, n, Dk] / v_new [B, Hkv, n, Dv] into each row's cache slots
    seq_lens[b] .. seq_lens[b] + n - 1, and (advance=True) add n to seq_lens on the device.

    k_cache / v_cache: [B, Hkv, capacity, D] for layout "HND", [B, capacity, Hkv, D] for
    "NHD" (or a (k_layout, v_layout) pair); same dtype as the new keys / values. seq_lens:
    int32 [B], read on the device, so a captured graph appends at the live position on every
    replay. A row that would pass the capacity is not written nor advanced and is reported
    as a DeviceFault after synchronization (device calls at ptxattn.check_faults; NumPy
    calls check the lengths on the host first and raise ValueError). NumPy arrays are
    updated in place.
    """
    return _KV_APPEND((k_new, v_new, k_cache, v_cache, seq_lens), (layout, advance), stream)


kv_append.op = _KV_APPEND
