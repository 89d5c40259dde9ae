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

from .. import kernel_names
from ..array import DeviceArray
from ..faults import fault_buffer
from ..module import ParamStruct
from ..variants import kv_quant_dtypes
from .checks import (ATTENTION_DTYPES, check_attention_dtype, check_flag, check_host_values, check_index_array,
                     check_nonnegative_strides, check_rank, check_row_bytes, check_same_dtype, parse_layout, require)
from .fp8 import KERNEL_NAMES, KvScale, is_fp8, parse_kv_scale, scale_strides
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
        ("k_scales", ctypes.c_void_p), ("v_scales", ctypes.c_void_p),
        ("kn_scales", ctypes.c_void_p), ("vn_scales", ctypes.c_void_p),
        ("kn_stride_row", ctypes.c_int64), ("kn_stride_head", ctypes.c_int64), ("kn_stride_tok", ctypes.c_int64),
        ("vn_stride_row", ctypes.c_int64), ("vn_stride_head", ctypes.c_int64), ("vn_stride_tok", ctypes.c_int64),
        ("k_stride_page", ctypes.c_int64), ("k_stride_head", ctypes.c_int64), ("k_stride_tok", ctypes.c_int64),
        ("v_stride_page", ctypes.c_int64), ("v_stride_head", ctypes.c_int64), ("v_stride_tok", ctypes.c_int64),
        ("ks_stride_page", ctypes.c_int64), ("ks_stride_head", ctypes.c_int64), ("ks_stride_tok", ctypes.c_int64),
        ("vs_stride_page", ctypes.c_int64), ("vs_stride_head", ctypes.c_int64), ("vs_stride_tok", ctypes.c_int64),
        ("kns_stride_row", ctypes.c_int64), ("kns_stride_head", ctypes.c_int64), ("kns_stride_tok", ctypes.c_int64),
        ("vns_stride_row", ctypes.c_int64), ("vns_stride_head", ctypes.c_int64), ("vns_stride_tok", ctypes.c_int64),
        ("rows", ctypes.c_int32), ("heads", ctypes.c_int32), ("tokens", ctypes.c_int32),
        ("dk", ctypes.c_int32), ("dv", ctypes.c_int32), ("elem_bytes", ctypes.c_int32),
        ("capacity", ctypes.c_int32), ("num_pages", ctypes.c_int32), ("page_size_log2", ctypes.c_int32),
        ("slot_is_int64", ctypes.c_int32), ("group_lanes", ctypes.c_int32),
        ("k_scale", ctypes.c_float), ("v_scale", ctypes.c_float),
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


def new_tokens_strides(arr: DeviceArray, paged: bool) -> tuple[int, int, int]:
    """(row, head, token) element strides of k_new [rows, Hkv, n, D] or, paged, [tokens, Hkv, D]
    (and of their scales, the same less the last axis)."""
    es = arr.element_strides
    return (es[0], es[1], 0) if paged else (es[0], es[1], es[2])


def check_writable(op: str, a: dict, names) -> None:
    """NumPy arrays an op updates in place must be writable (checked before any upload)."""
    for name in names:
        arr = a[name]
        if isinstance(arr, np.ndarray) and not arr.flags.writeable:
            raise ValueError(f"{op}: {name} is updated in place but the NumPy array is read-only")


# ---- dtypes and fp8 scales ----------------------------------------------------------------------
@dataclass(frozen=True)
class AppendScales:
    """How an append writes its caches: `kernel` (kv_append moves bytes; kv_append_quant_*
    quantizes 16-bit rows into fp8 caches) and the caches' scales (None unless fp8)."""

    kernel: str
    k: KvScale | None
    v: KvScale | None

    def copies_scales(self, scale: KvScale | None) -> bool:
        """Whether the new rows bring their own per-token scales (fp8 rows into a cache with
        per-token scales), which the append copies beside them."""
        return scale is not None and scale.per_token and self.kernel == "kv_append"


def _check_new_scale(op: str, name: str, arr, new: str, a: dict, reason: str | None) -> None:
    """k_new_scale / v_new_scale: a float32 array shaped like `new` less its last axis where
    the new rows are fp8 with per-token scales (reason None), else absent (`reason` says why)."""
    if reason is not None:
        if arr is not None:
            raise TypeError(f"{op}: {name} goes only with float8 {new} appended to a cache with per-token scales; "
                            f"here {reason}, so pass None (got {type(arr).__name__})")
        return
    expect = tuple(a[new].shape[:-1])
    if arr is None:
        raise TypeError(f"{op}: {name} is required with float8 {new} and per-token cache scales: the new rows' "
                        f"scales, float32 of shape {expect}, got None")
    if np.dtype(arr.dtype) != np.float32 or tuple(arr.shape) != expect:
        raise TypeError(f"{op}: {name} must be float32 of shape {expect} ({new}'s shape less its last axis), "
                        f"got {arr.dtype} {tuple(arr.shape)}")
    check_nonnegative_strides(op, name, arr)


def check_append_dtypes(op: str, a: dict, caches: tuple[str, str], layouts: tuple[str, str], k_scale,
                        v_scale) -> AppendScales:
    """The dtypes of an append into the caches (or pools) named `caches`, and their scales:
    the new rows hold the caches' dtype, or, into fp8 caches, a dtype quantized on append.
    k_scale / v_scale: the number options (per-tensor scales), or None when the array of
    that name carries them."""
    for name in caches:
        if not is_fp8(a[name].dtype):
            check_attention_dtype(op, name, a[name])
        check_row_bytes(op, name, a[name])
    check_same_dtype(op, caches[1], a[caches[1]], caches[0], a[caches[0]])
    for name in ("k_new", "v_new"):
        check_row_bytes(op, name, a[name])
    cache_dtype, new_dtype = np.dtype(a[caches[0]].dtype), np.dtype(a["k_new"].dtype)
    kernel = "kv_append"
    if is_fp8(cache_dtype) and new_dtype != cache_dtype:
        fp8 = KERNEL_NAMES[cache_dtype]
        sources = [dtype for dtype, name in ATTENTION_DTYPES.items() if (name, fp8) in kv_quant_dtypes()]
        if new_dtype not in sources:
            raise TypeError(f"{op}: k_new must be {' or '.join(map(str, sources))} (quantized on append) or "
                            f"{caches[0]}'s {cache_dtype}, got {new_dtype}")
        check_same_dtype(op, "v_new", a["v_new"], "k_new", a["k_new"])
        kernel = kernel_names.kv_append_quant(ATTENTION_DTYPES[new_dtype], fp8)
    else:
        check_same_dtype(op, "k_new", a["k_new"], caches[0], a[caches[0]])
        check_same_dtype(op, "v_new", a["v_new"], caches[1], a[caches[1]])
    scales = AppendScales(kernel, *(
        parse_kv_scale(op, name, a[name] if a[name] is not None else value, a[cache], cache, layout)
        for name, value, cache, layout in zip(("k_scale", "v_scale"), (k_scale, v_scale), caches, layouts)))
    for scale, x, cache in ((scales.k, "k", caches[0]), (scales.v, "v", caches[1])):
        reason = (None if scales.copies_scales(scale)
                  else f"{cache} is {cache_dtype}" if scale is None
                  else f"{x}_new is {new_dtype}, quantized with scales computed on append" if kernel != "kv_append"
                  else f"{x}_scale is per tensor (the new bytes are in its units)")
        _check_new_scale(op, f"{x}_new_scale", a[f"{x}_new_scale"], f"{x}_new", a, reason)
    return scales


# ---- binding ----------------------------------------------------------------------------------
def _group_lanes(dim: int) -> int:
    """Lanes the quantizing kernels give a row: one per 16 elements, a power of two, at most 32."""
    return min(32, 1 << (max(dim // 16, 1) - 1).bit_length())


def _set_strides(params: KvAppendParams, prefix: str, axes: tuple[str, str, str], strides) -> None:
    for axis, stride in zip(axes, strides):
        setattr(params, f"{prefix}_stride_{axis}", stride)


def bind_append(binding, a: dict, names: tuple[str, str, str, str, str], layouts: tuple[str, str],
                scales: AppendScales, advance: bool, **geometry) -> None:
    """The append launch (and with `advance`, kv_advance) of arrays named `names`: (k_new,
    v_new, k cache or pool, v cache or pool, seq_lens or slot_mapping), the scales' arrays
    by their own names. `geometry`: KvAppendParams' rows, heads, tokens, dk, dv and, by
    mode, capacity or num_pages, page_size_log2 and slot_is_int64."""
    index = names[4]
    paged = index == "slot_mapping"
    params = KvAppendParams(fault=fault_buffer(binding.device), elem_bytes=a[names[2]].itemsize,
                            group_lanes=_group_lanes(max(geometry["dk"], geometry["dv"])), **geometry)
    fields = dict(zip(names, ("k_new", "v_new", "k_cache", "v_cache", index)))  # argument -> pointer field
    new_axes, cache_axes = ("row", "head", "tok"), ("page", "head", "tok")
    for x, new, cache, layout, scale in (("k", names[0], names[2], layouts[0], scales.k),
                                         ("v", names[1], names[3], layouts[1], scales.v)):
        _set_strides(params, f"{x}n", new_axes, new_tokens_strides(a[new], paged))
        _set_strides(params, x, cache_axes, cache_strides(a[cache], layout))
        if scale is not None and scale.per_token:
            _set_strides(params, f"{x}s", cache_axes, scale_strides(a[f"{x}_scale"], layout))
            fields[f"{x}_scale"] = f"{x}_scales"
        else:
            setattr(params, f"{x}_scale", scale.value if scale is not None else 1.0)
        if scales.copies_scales(scale):
            _set_strides(params, f"{x}ns", new_axes, new_tokens_strides(a[f"{x}_new_scale"], paged))
            fields[f"{x}_new_scale"] = f"{x}n_scales"
    rows, tokens, heads = geometry["rows"], geometry["tokens"], geometry["heads"]
    if scales.kernel == "kv_append":  # a thread per 16-byte chunk
        threads = rows * tokens * heads * (geometry["dk"] + geometry["dv"]) * params.elem_bytes // 16
    else:  # group_lanes lanes per (row, token, head) of K and of V
        threads = 2 * rows * tokens * heads * params.group_lanes
    launches = []
    if threads:
        grid = min(-(-threads // APPEND_THREADS), APPEND_GRID_CAP)
        launches.append(binding.launch(scales.kernel, (grid, 1, 1), (APPEND_THREADS, 1, 1), params))
    if advance and rows:
        launches.append(binding.launch("kv_advance", (-(-rows // ADVANCE_THREADS), 1, 1), (ADVANCE_THREADS, 1, 1),
                                       params))
    if not launches:
        return
    # Both launches share one struct: one set of views rewrites it for both.
    for name, field in fields.items():
        binding.point(name, launches[0], field)


def _validate(a: dict, layout, advance, k_scale, v_scale, on_host: bool = False):
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
    scales = check_append_dtypes(op, a, ("k_cache", "v_cache"), (k_layout, v_layout), k_scale, v_scale)
    require(op, "seq_lens", a["seq_lens"])
    check_index_array(op, "seq_lens", a["seq_lens"], (batch,))
    if on_host:
        check_writable(op, a, ("k_cache", "v_cache", "seq_lens", "k_scale", "v_scale"))
        check_host_values(op, "seq_lens", a["seq_lens"], 0, kc.tokens - n,
                          f"the write position; capacity {kc.tokens}, appending {n}")
    return k_layout, v_layout, kc, vc, scales


def _bind(binding, a: dict, checked, layout, advance, *scale_options) -> None:
    k_layout, v_layout, kc, vc, scales = checked
    batch, heads, n, dk = a["k_new"].shape
    bind_append(binding, a, ("k_new", "v_new", "k_cache", "v_cache", "seq_lens"), (k_layout, v_layout), scales,
                bool(advance), rows=batch, heads=heads, tokens=n, dk=dk, dv=vc.dim, capacity=kc.tokens)


_KV_APPEND = Op("kv_append", ("k_new", "v_new", "k_cache", "v_cache", "seq_lens", "k_scale", "v_scale", "k_new_scale",
                              "v_new_scale"), ("layout", "advance", "k_scale", "v_scale"),
                in_place=("k_cache", "v_cache", "seq_lens", "k_scale", "v_scale"), validate=_validate, bind=_bind,
                number_or_array=("k_scale", "v_scale"))


def kv_append(k_new, v_new, k_cache, v_cache, seq_lens, *, layout="HND", advance: bool = True, k_scale=None,
              v_scale=None, k_new_scale=None, v_new_scale=None, stream=None) -> None:
    """Write k_new [B, Hkv, n, Dk] / v_new [B, Hkv, n, Dv] into each row's cache slots
    seq_lens[b] .. seq_lens[b] + n - 1, and (advance=True) add n to seq_lens on the device.

    k_cache / v_cache: [B, Hkv, capacity, D] for layout "HND", [B, capacity, Hkv, D] for
    "NHD" (or a (k_layout, v_layout) pair); same dtype as the new keys / values. seq_lens:
    int32 [B], read on the device, so a captured graph appends at the live position on every
    replay. A row that would pass the capacity is not written nor advanced and is reported
    as a DeviceFault after synchronization (device calls at ptxattn.check_faults; NumPy
    calls check the lengths on the host first and raise ValueError). NumPy arrays are
    updated in place.

    fp8 caches (float8_e4m3fn / float8_e5m2) take k_scale and v_scale as decode() does: a
    positive number (per tensor) or a float32 array shaped like the cache less its last axis
    (per token and kv head). float16 / bfloat16 new rows are quantized on append: each
    element x is written as x / scale (a float32 division) rounded to nearest even and
    saturated to the fp8 type's finite range (+-448 / +-57344, infinities included; NaN
    stays NaN). With per-token scales each written (token, kv head) row gets scale = amax /
    448 (e4m3) or / 57344 (e5m2), amax its largest finite |x| (1.0 for a row with none, e.g.
    all zeros), stored at its slot of the scale array. New rows already in the cache's fp8
    type are copied as they are; with per-token scales, k_new_scale / v_new_scale (float32,
    shaped like k_new / v_new less their last axis) are their scales, copied beside them.
    reference.kv_append_fp8 defines it all, bit for bit.
    """
    return _KV_APPEND((k_new, v_new, k_cache, v_cache, seq_lens, k_scale, v_scale, k_new_scale, v_new_scale),
                      (layout, advance, k_scale, v_scale), stream)


kv_append.op = _KV_APPEND
