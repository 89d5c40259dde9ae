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
from ..context import on_device
from ..dtypes import bfloat16
from ..faults import check_faults, fault_buffer
from ..module import ParamStruct, get_kernel
from ._io import OpCall, gather

__all__ = ["kv_append", "CacheShape", "cache_shape", "cache_strides", "parse_layout"]

LAYOUTS = ("HND", "NHD")
ATTENTION_DTYPES = {np.dtype(np.float16): "f16", bfloat16: "bf16", np.dtype(np.float32): "f32"}
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


# ---- validation shared by every KV-cache op -------------------------------------------------
def parse_layout(op: str, layout) -> tuple[str, str]:
    """(k_layout, v_layout) from "HND" / "NHD" or a pair of them."""
    pair = (layout, layout) if isinstance(layout, str) else tuple(layout) if isinstance(layout, (tuple, list)) else None
    if pair is None or len(pair) != 2 or any(x not in LAYOUTS for x in pair):
        raise ValueError(f"{op}: layout must be 'HND', 'NHD' or a (k_layout, v_layout) pair of them, got {layout!r}")
    return pair


def check_rank(op: str, name: str, arr, rank: int, what: str) -> None:
    if arr.ndim != rank:
        raise ValueError(f"{op}: {name} must be {rank}-d {what}, got shape {tuple(arr.shape)}")


def check_attention_dtype(op: str, name: str, arr) -> None:
    if np.dtype(arr.dtype) not in ATTENTION_DTYPES:
        raise TypeError(f"{op}: {name} must be float16, bfloat16 or float32, got {arr.dtype}")


def check_same_dtype(op: str, name: str, arr, ref_name: str, ref) -> None:
    if np.dtype(arr.dtype) != np.dtype(ref.dtype):
        raise TypeError(f"{op}: {name} must have {ref_name}'s dtype {ref.dtype}, got {arr.dtype}")


def check_index_array(op: str, name: str, arr, shape, dtypes=(np.int32,)) -> None:
    allowed = [np.dtype(d) for d in dtypes]
    if np.dtype(arr.dtype) not in allowed:
        raise TypeError(f"{op}: {name} must be {' or '.join(str(d) for d in allowed)}, got {arr.dtype}")
    if tuple(arr.shape) != tuple(shape):
        raise ValueError(f"{op}: {name} must have shape {tuple(shape)}, got {tuple(arr.shape)}")
    if isinstance(arr, DeviceArray) and arr.ndim == 1 and arr.shape[0] > 1 and arr.strides[0] != arr.itemsize:
        raise ValueError(f"{op}: {name} must be contiguous, got strides {arr.strides}")


def check_row_bytes(op: str, name: str, arr) -> None:
    """The kernels move 16 bytes at a time: rows of a multiple of 16 bytes, and for device
    arrays a contiguous last axis with 16-byte aligned rows."""
    dim = arr.shape[-1]
    if dim == 0 or dim * arr.dtype.itemsize % 16:
        per = 16 // arr.dtype.itemsize
        raise ValueError(f"{op}: {name}'s last axis must be a positive multiple of {per} for {arr.dtype} "
                         f"(16-byte rows), got {dim}")
    if not isinstance(arr, DeviceArray):
        return
    if arr.strides[-1] != arr.itemsize:
        raise ValueError(f"{op}: {name} must have a contiguous last axis (stride {arr.itemsize} bytes), "
                         f"got strides {arr.strides}")
    misaligned = [s for n, s in zip(arr.shape[:-1], arr.strides[:-1]) if n > 1 and s % 16]
    if arr.ptr % 16 or misaligned:
        raise ValueError(f"{op}: {name} must start on a 16-byte boundary and have strides that are "
                         f"multiples of 16 bytes, got address 0x{arr.ptr:x}, strides {arr.strides}")


@dataclass(frozen=True)
class CacheShape:
    """A cache or pool seen as pages of tokens: (pages, heads, tokens per page, dim)."""

    pages: int
    heads: int
    tokens: int
    dim: int


def cache_shape(op: str, name: str, arr, layout: str) -> CacheShape:
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


# ---- launching --------------------------------------------------------------------------------
def launch_append(call: OpCall, params: KvAppendParams, rows: int, tokens: int, heads: int,
                  chunks_per_head: int, advance: bool) -> None:
    total = rows * tokens * heads * chunks_per_head
    with on_device(call.device):
        params.fault = fault_buffer(call.device)
        if total:
            grid = min(-(-total // APPEND_THREADS), APPEND_GRID_CAP)
            get_kernel("kv_append", call.device).launch((grid, 1, 1), (APPEND_THREADS, 1, 1), params, call.stream)
        if advance and rows:
            grid = -(-rows // ADVANCE_THREADS)
            get_kernel("kv_advance", call.device).launch((grid, 1, 1), (ADVANCE_THREADS, 1, 1), params, call.stream)


def finish_in_place(call: OpCall, written: dict[str, DeviceArray]) -> None:
    """Host calls: copy what the kernels wrote back into the caller's NumPy arrays, then raise
    any device fault. Device calls run asynchronously: faults surface at check_faults()."""
    if not call.on_host:
        return
    for name, dev in written.items():
        call.arrays[name][...] = dev.get(call.stream)
    check_faults(call.device, call.stream)


def kv_append(k_new, v_new, k_cache, v_cache, seq_lens, *, layout="HND", advance: bool = True, stream=None) -> None:
    """Write k_new [B, Hkv, n, Dk] / v_new [B, Hkv, n, Dv] into each row's cache slots
    seq_lens[b] .. seq_lens[b] + n - 1, and (advance=True) add n to seq_lens on the device.

    k_cache / v_cache: [B, Hkv, capacity, D] for layout "HND", [B, capacity, Hkv, D] for
    "NHD" (or a (k_layout, v_layout) pair); same dtype as the new keys / values. seq_lens:
    int32 [B], read on the device, so a captured graph appends at the live position on every
    replay. A row that would pass the capacity is not written nor advanced and is reported
    as a DeviceFault after synchronization (NumPy calls raise it; device calls at
    ptxattn.check_faults). NumPy arrays are updated in place.
    """
    op = "kv_append"
    call = gather(op, stream, k_new=k_new, v_new=v_new, k_cache=k_cache, v_cache=v_cache, seq_lens=seq_lens)
    a = call.arrays
    k_layout, v_layout = parse_layout(op, layout)
    check_rank(op, "k_new", a["k_new"], 4, "[B, Hkv, n, Dk]")
    check_rank(op, "v_new", a["v_new"], 4, "[B, Hkv, n, Dv]")
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
    check_index_array(op, "seq_lens", a["seq_lens"], (batch,))

    dev = {name: call.to_device(name) for name in a}
    itemsize = dev["k_cache"].itemsize
    params = KvAppendParams(
        dev["k_new"].ptr, dev["v_new"].ptr, dev["k_cache"].ptr, dev["v_cache"].ptr, dev["seq_lens"].ptr, None, None,
        *new_tokens_strides(dev["k_new"]), *new_tokens_strides(dev["v_new"]),
        *cache_strides(dev["k_cache"], k_layout), *cache_strides(dev["v_cache"], v_layout),
        batch, heads, n, dk, vc.dim, itemsize, kc.tokens, 0, 0, 0,
    )
    launch_append(call, params, batch, n, heads, (dk + vc.dim) * itemsize // 16, advance)
    finish_in_place(call, {name: dev[name] for name in ("k_cache", "v_cache", "seq_lens")})
