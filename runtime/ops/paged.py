"""Paged KV cache: paged_kv_append (cu/kv_cache.cu) and paged_decode (the split-KV kernel of
cu/decode.cu read through a block table; see ops/decode.py).

Pools are [num_pages, Hkv, page_size, D] ("HND") or [num_pages, page_size, Hkv, D] ("NHD");
K and V pools may differ in layout but share page ids and page size. A page id or slot
outside the pool is skipped on the device and reported as a DeviceFault after
synchronization, never an illegal address.
"""
from __future__ import annotations

import numpy as np

from ..array import DeviceArray
from ..context import default_device
from .checks import (check_attention_dtype, check_host_values, check_index_array, check_rank, check_row_bytes,
                     check_same_dtype, parse_layout, require)
from .decode import KvSource, bind_decode, validate_decode
from .fp8 import is_fp8
from .kv_cache import CacheShape, bind_append, cache_shape, check_append_dtypes, check_writable
from .prepared import Op

__all__ = ["paged_kv_append", "paged_decode", "paged_decode_workspace_bytes"]

MAX_CAPACITY = 2**31 - 1  # keys per row are int32 on the device


def _pools(op: str, a: dict, layout) -> tuple[str, str, CacheShape, CacheShape]:
    """Validated (k_layout, v_layout, k CacheShape, v CacheShape) of two pools."""
    k_layout, v_layout = parse_layout(op, layout)
    k = cache_shape(op, "k_pool", a["k_pool"], k_layout)
    v = cache_shape(op, "v_pool", a["v_pool"], v_layout)
    if (k.pages, k.tokens) != (v.pages, v.tokens):
        raise ValueError(f"{op}: k_pool and v_pool must have the same number of pages and page size, got "
                         f"{k.pages} x {k.tokens} and {v.pages} x {v.tokens}")
    if k.heads != v.heads:
        raise ValueError(f"{op}: k_pool and v_pool must have one number of kv heads, got {k.heads} and {v.heads}")
    page_size = k.tokens
    if page_size < 1 or page_size & (page_size - 1):
        raise ValueError(f"{op}: the page size must be a power of two, got {page_size}")
    if k.pages >= 2**31:
        raise ValueError(f"{op}: at most 2**31 - 1 pages, got {k.pages}")
    for name in ("k_pool", "v_pool"):
        if not is_fp8(a[name].dtype):  # which dtypes go with which is the op's to check
            check_attention_dtype(op, name, a[name])
        check_row_bytes(op, name, a[name])
    check_same_dtype(op, "v_pool", a["v_pool"], "k_pool", a["k_pool"])
    return k_layout, v_layout, k, v


# ---- paged_kv_append ----------------------------------------------------------------------------
def _validate_append(a: dict, layout, k_scale, v_scale, on_host: bool = False):
    op = "paged_kv_append"
    k_layout, v_layout, k, v = _pools(op, a, layout)
    require(op, "k_new", a["k_new"])
    check_rank(op, "k_new", a["k_new"], 3, "[T, Hkv, Dk]")
    tokens = a["k_new"].shape[0]
    for name, shape in (("k_new", (tokens, k.heads, k.dim)), ("v_new", (tokens, v.heads, v.dim))):
        require(op, name, a[name])
        if tuple(a[name].shape) != shape:
            raise ValueError(f"{op}: {name} must have shape {shape} (T tokens, the pool's Hkv and D), "
                             f"got {tuple(a[name].shape)}")
    scales = check_append_dtypes(op, a, ("k_pool", "v_pool"), (k_layout, v_layout), k_scale, v_scale)
    require(op, "slot_mapping", a["slot_mapping"])
    check_index_array(op, "slot_mapping", a["slot_mapping"], (tokens,), dtypes=("int32", "int64"))
    if on_host:
        check_writable(op, a, ("k_pool", "v_pool", "k_scale", "v_scale"))
        check_host_values(op, "slot_mapping", a["slot_mapping"], -1, k.pages * k.tokens - 1,
                          f"a slot of the pool of {k.pages} pages x {k.tokens}, or -1 to skip")
    return k_layout, v_layout, k, v, scales


def _bind_append(binding, a: dict, checked, layout, *scale_options) -> None:
    k_layout, v_layout, k, v, scales = checked
    bind_append(binding, a, ("k_new", "v_new", "k_pool", "v_pool", "slot_mapping"), (k_layout, v_layout), scales,
                advance=False, rows=a["k_new"].shape[0], heads=k.heads, tokens=1, dk=k.dim, dv=v.dim,
                num_pages=k.pages, page_size_log2=k.tokens.bit_length() - 1,
                slot_is_int64=int(a["slot_mapping"].itemsize == 8))


_PAGED_KV_APPEND = Op("paged_kv_append", ("k_new", "v_new", "k_pool", "v_pool", "slot_mapping", "k_scale", "v_scale",
                                          "k_new_scale", "v_new_scale"), ("layout", "k_scale", "v_scale"),
                      in_place=("k_pool", "v_pool", "k_scale", "v_scale"), validate=_validate_append,
                      bind=_bind_append, number_or_array=("k_scale", "v_scale"))


def paged_kv_append(k_new, v_new, k_pool, v_pool, slot_mapping, *, layout="HND", k_scale=None, v_scale=None,
                    k_new_scale=None, v_new_scale=None, stream=None) -> None:
    """Write token r of k_new [T, Hkv, Dk] / v_new [T, Hkv, Dv] to slot slot_mapping[r] =
    page * page_size + offset of the pools (int32 or int64 [T]; -1 skips the token). A slot
    past the pool is skipped and reported as a DeviceFault after synchronization (device
    calls at ptxattn.check_faults; NumPy calls check the slots on the host first and raise
    ValueError). NumPy pools are updated in place.

    fp8 pools: as kv_append(): k_scale / v_scale a positive number or a float32 array shaped
    like the pool less its last axis ([pages, Hkv, page_size] for "HND"); float16 / bfloat16
    tokens are quantized on append (per-token scales computed and stored at their slots),
    fp8 tokens copied, with k_new_scale / v_new_scale float32 [T, Hkv] where the scales are
    per token. reference.paged_kv_append_fp8 defines it."""
    return _PAGED_KV_APPEND((k_new, v_new, k_pool, v_pool, slot_mapping, k_scale, v_scale, k_new_scale, v_new_scale),
                            (layout, k_scale, v_scale), stream)


# ---- paged_decode ------------------------------------------------------------------------------
def paged_source(op: str, a: dict, layout, batch: int | None = None) -> KvSource:
    """The pools and block table of a paged call; the table has a row for each of `batch`
    sequences (default: q's batch axis)."""
    k_layout, v_layout, k, v = _pools(op, a, layout)
    require(op, "q", a["q"])
    require(op, "block_table", a["block_table"])
    table = a["block_table"]
    check_rank(op, "block_table", table, 2, "[B, max_pages]")
    if np.dtype(table.dtype) != np.int32:
        raise TypeError(f"{op}: block_table must be int32, got {table.dtype}")
    if batch is None:
        batch = a["q"].shape[0] if a["q"].ndim else 0
    if table.shape[0] != batch or table.shape[1] == 0:
        raise ValueError(f"{op}: block_table must have shape (B={batch}, max_pages >= 1), got {tuple(table.shape)}")
    if isinstance(table, DeviceArray) and table.shape[1] > 1 and table.strides[1] != 4:
        raise ValueError(f"{op}: block_table must have a contiguous last axis, got strides {table.strides}")
    capacity = table.shape[1] * k.tokens
    if capacity > MAX_CAPACITY:
        raise ValueError(f"{op}: max_pages * page_size must stay below 2**31, got {capacity}")
    return KvSource(("k_pool", "v_pool", "block_table"), k_layout, v_layout, k, v, capacity, k.pages, k.tokens)


def check_host_pages(op: str, a: dict, src: KvSource) -> None:
    """NumPy calls: the page ids a row will read (those under its live length) are in the pool."""
    table, lengths = a["block_table"], a["seq_lens"]
    for row in range(table.shape[0]):
        used = -(-int(lengths[row]) // src.page_size)
        check_host_values(op, f"block_table[{row}]", table[row, :used], 0, src.num_pages - 1,
                          f"a page id of the pool of {src.num_pages} pages")


def _validate_decode(a: dict, layout, scale, softcap, window, return_lse, k_scale, v_scale, on_host: bool = False):
    op = "paged_decode"
    src = paged_source(op, a, layout)
    checked = validate_decode(op, a, src, scale, softcap, window, return_lse, k_scale, v_scale, on_host)
    if on_host:
        check_host_pages(op, a, src)
    return checked


_ARRAYS = ("q", "k_pool", "v_pool", "block_table", "seq_lens", "sinks", "k_scale", "v_scale", "out", "out_lse",
           "workspace")
_PAGED_DECODE = Op("paged_decode", _ARRAYS,
                   ("layout", "scale", "softcap", "window", "return_lse", "k_scale", "v_scale"),
                   outputs=("out", "out_lse"), validate=_validate_decode,
                   bind=lambda binding, a, checked, *options: bind_decode(binding, a, checked),
                   number_or_array=("k_scale", "v_scale"))


def paged_decode_workspace_bytes(q, k_pool, v_pool, block_table, *, layout="HND", device=None) -> int:
    """Workspace bytes paged_decode() needs for these shapes on `device` (default: current)."""
    a = dict.fromkeys(_ARRAYS)
    a.update(q=q, k_pool=k_pool, v_pool=v_pool, block_table=block_table, seq_lens=np.zeros(q.shape[0], np.int32))
    src = paged_source("paged_decode", a, layout)
    scales = [1.0 if is_fp8(p.dtype) else None for p in (k_pool, v_pool)]  # the plan ignores their values
    checked = validate_decode("paged_decode", a, src, None, 0.0, None, False, *scales, False,
                              device or default_device())
    return checked.plan.workspace_bytes


def paged_decode(q, k_pool, v_pool, block_table, seq_lens, *, layout="HND", scale=None, softcap=0.0, window=None,
                 sinks=None, k_scale=None, v_scale=None, return_lse: bool = False, out=None, out_lse=None,
                 workspace=None, stream=None):
    """decode() over paged pools: row b's key j lives in page block_table[b, j // page_size]
    at offset j % page_size. block_table: int32 [B, max_pages]; a row holds at most
    max_pages * page_size keys (its capacity). Every other argument and the result are as
    in decode(). A page id outside the pool is skipped and reported as a DeviceFault after
    synchronization (NumPy calls check the ids a row reads on the host first: ValueError).
    fp8 pools take k_scale / v_scale as decode() does; per-token scales are shaped like the
    pools less their last axis ([pages, Hkv, page_size] for "HND")."""
    return _PAGED_DECODE((q, k_pool, v_pool, block_table, seq_lens, sinks, k_scale, v_scale, out, out_lse,
                          workspace), (layout, scale, softcap, window, return_lse, k_scale, v_scale), stream)


paged_kv_append.op, paged_decode.op = _PAGED_KV_APPEND, _PAGED_DECODE
