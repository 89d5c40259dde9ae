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
from ._io import gather
from .decode import (KvSource, check_options, check_out, check_query, plan_for, resolve_workspace,
                     run_decode)
from .kv_cache import (KvAppendParams, cache_shape, cache_strides, check_attention_dtype, check_index_array,
                       check_rank, check_row_bytes, check_same_dtype, finish_in_place, launch_append,
                       new_tokens_strides, parse_layout)
from .merge import check_sinks

__all__ = ["paged_kv_append", "paged_decode", "paged_decode_workspace_bytes"]

MAX_CAPACITY = 2**31 - 1  # keys per row are int32 on the device


def _pools(op: str, k_pool, v_pool, layout):
    """Validated (k_layout, v_layout, k CacheShape, v CacheShape) of two pools."""
    k_layout, v_layout = parse_layout(op, layout)
    k = cache_shape(op, "k_pool", k_pool, k_layout)
    v = cache_shape(op, "v_pool", v_pool, v_layout)
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
    for name, pool in (("k_pool", k_pool), ("v_pool", v_pool)):
        check_attention_dtype(op, name, pool)
        check_row_bytes(op, name, pool)
    check_same_dtype(op, "v_pool", v_pool, "k_pool", k_pool)
    return k_layout, v_layout, k, v


def paged_kv_append(k_new, v_new, k_pool, v_pool, slot_mapping, *, layout="HND", stream=None) -> None:
    """Write token r of k_new [T, Hkv, Dk] / v_new [T, Hkv, Dv] to slot slot_mapping[r] =
    page * page_size + offset of the pools (int32 or int64 [T]; -1 skips the token). A slot
    past the pool is skipped and reported as a DeviceFault after synchronization (NumPy calls
    raise it; device calls at ptxattn.check_faults). NumPy pools are updated in place."""
    op = "paged_kv_append"
    call = gather(op, stream, k_new=k_new, v_new=v_new, k_pool=k_pool, v_pool=v_pool, slot_mapping=slot_mapping)
    a = call.arrays
    k_layout, v_layout, k, v = _pools(op, a["k_pool"], a["v_pool"], layout)
    check_rank(op, "k_new", a["k_new"], 3, "[T, Hkv, Dk]")
    tokens = a["k_new"].shape[0]
    for name, shape in (("k_new", (tokens, k.heads, k.dim)), ("v_new", (tokens, v.heads, v.dim))):
        if tuple(a[name].shape) != shape:
            raise ValueError(f"{op}: {name} must have shape {shape} (T tokens, the pool's Hkv and D), "
                             f"got {tuple(a[name].shape)}")
        check_same_dtype(op, name, a[name], "k_pool", a["k_pool"])
        check_row_bytes(op, name, a[name])
    check_index_array(op, "slot_mapping", a["slot_mapping"], (tokens,), dtypes=("int32", "int64"))

    dev = {name: call.to_device(name) for name in a}
    itemsize = dev["k_pool"].itemsize
    params = KvAppendParams(
        dev["k_new"].ptr, dev["v_new"].ptr, dev["k_pool"].ptr, dev["v_pool"].ptr, None, dev["slot_mapping"].ptr,
        None, *new_tokens_strides(dev["k_new"]), *new_tokens_strides(dev["v_new"]),
        *cache_strides(dev["k_pool"], k_layout), *cache_strides(dev["v_pool"], v_layout),
        tokens, k.heads, 1, k.dim, v.dim, itemsize, 0, k.pages, k.tokens.bit_length() - 1,
        int(dev["slot_mapping"].itemsize == 8),
    )
    launch_append(call, params, tokens, 1, k.heads, (k.dim + v.dim) * itemsize // 16, advance=False)
    finish_in_place(call, {"k_pool": dev["k_pool"], "v_pool": dev["v_pool"]})


def _validate(op: str, arrays: dict, layout, *, scale, softcap, window):
    k_layout, v_layout, k, v = _pools(op, arrays["k_pool"], arrays["v_pool"], layout)
    q = arrays["q"]
    check_query(op, q, k, v)
    check_same_dtype(op, "k_pool", arrays["k_pool"], "q", q)
    table = arrays["block_table"]
    check_rank(op, "block_table", table, 2, "[B, max_pages]")
    if np.dtype(table.dtype) != np.int32:
        raise TypeError(f"{op}: block_table must be int32, got {table.dtype}")
    if table.shape[0] != q.shape[0] or table.shape[1] == 0:
        raise ValueError(f"{op}: block_table must have shape (B={q.shape[0]}, max_pages >= 1), got {tuple(table.shape)}")
    if isinstance(table, DeviceArray) and table.shape[1] > 1 and table.strides[1] != 4:
        raise ValueError(f"{op}: block_table must have a contiguous last axis, got strides {table.strides}")
    capacity = table.shape[1] * k.tokens
    if capacity > MAX_CAPACITY:
        raise ValueError(f"{op}: max_pages * page_size must stay below 2**31, got {capacity}")
    options = check_options(op, q, scale=scale, softcap=softcap, window=window)
    return k_layout, v_layout, k, v, capacity, options


def paged_decode_workspace_bytes(q, k_pool, v_pool, block_table, *, layout="HND", device=None) -> int:
    """Workspace bytes paged_decode() needs for these shapes on `device` (default: current)."""
    arrays = {"q": q, "k_pool": k_pool, "v_pool": v_pool, "block_table": block_table}
    _, _, k, v, capacity, _ = _validate("paged_decode", arrays, layout, scale=None, softcap=0.0, window=None)
    return plan_for(device or default_device(), q, k, v, capacity).workspace_bytes


def paged_decode(q, k_pool, v_pool, block_table, seq_lens, *, layout="HND", scale=None, softcap=0.0, window=None,
                 sinks=None, return_lse: bool = False, out=None, out_lse=None, workspace=None, stream=None):
    """decode() over paged pools: row b's key j lives in page block_table[b, j // page_size]
    at offset j % page_size. block_table: int32 [B, max_pages]; a row holds at most
    max_pages * page_size keys (its capacity). Every other argument and the result are as
    in decode(). A page id outside the pool is skipped and reported as a DeviceFault after
    synchronization."""
    op = "paged_decode"
    call = gather(op, stream, q=q, k_pool=k_pool, v_pool=v_pool, block_table=block_table, seq_lens=seq_lens,
                  sinks=sinks, out=out, out_lse=out_lse)
    a = call.arrays
    k_layout, v_layout, k, v, capacity, options = _validate(op, a, layout, scale=scale, softcap=softcap,
                                                            window=window)
    batch, hq, sq, _ = a["q"].shape
    check_index_array(op, "seq_lens", a["seq_lens"], (batch,))
    check_sinks(op, a.get("sinks"), hq)
    check_out(op, a.get("out"), a.get("out_lse"), (batch, hq, sq, v.dim), a["q"].dtype)
    plan = plan_for(call.device, a["q"], k, v, capacity)
    ws = resolve_workspace(op, workspace, plan.workspace_bytes)
    src = KvSource(call.to_device("k_pool"), call.to_device("v_pool"), k_layout, v_layout, call.to_device("seq_lens"),
                   call.to_device("block_table"), k.heads, capacity, k.pages, k.tokens)
    return run_decode(op, call, plan, src, options, out=out, out_lse=out_lse, return_lse=return_lse, workspace=ws)
