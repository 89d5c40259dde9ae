"""Serving batches: `ragged_attention` (q, k, v packed by offsets) and `paged_attention`
(packed q against a paged KV pool: prefill chunks, decode rows, or both in one call).

Both run the sdpa tile kernels (cu/flash_fwd.cu, cu/flash_fwd_sm90.cu) in their serving mode:
grid x is a fixed budget of query tiles, ceil(Nq / rows) + B (a sequence wastes at most one
partial tile), and each block finds its sequence and tile from the device-side offsets. The
launch depends on shapes only (q's rows, B, max_pages), so one captured graph serves every
mix of sequences within that budget, and a sequence's result does not depend on the others.

paged_attention sends the sequences of 1..decode_queries new queries to the split-KV decode
kernel (cu/decode.cu) instead, where a 64-row query tile would carry one live row:
cu/ragged.cu moves their rows into a dense [B, Hq, decode_queries] layout in the workspace,
right-aligned so that decode's bottom-right rule gives each row its keys, and back.

Offsets, lengths and page ids only the device sees are checked there (the bad sequence is
skipped and ptxattn.check_faults raises DeviceFault); NumPy calls check them on the host first.

fp8 K/V (k / v or the pools; their scales as decode takes them, ops/fp8.py) run the _fp8 tile
kernels (general ones: cu/flash_fwd_fp8.cu, and the sm_90a ones of cu/flash_fwd_sm90.cu), which
turn each value into q's dtype as its tile loads; paged_attention's decode rows run decode's fp8
kernel.
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass

import numpy as np

from ..array import DeviceArray
from ..context import default_device
from ..faults import fault_buffer
from ..memory import WorkspaceLayout
from ..module import ParamStruct
from ..variants import sdpa_fp8_variants
from .attention import (KvFp8, Serving, check_gqa_heads, check_head_dims, contiguous, flash_params, plan_kernel,
                        runs_wgmma, vector_io_ok)
from .checks import (MAX_GRID_YZ, UNBOUNDED_WINDOW, check_attention_dtype, check_flag, check_host_values,
                     check_index_array, check_nonnegative_strides, check_output, check_rank, check_row_bytes,
                     check_same_dtype, check_sinks, check_unit_last_stride, check_workspace_size,
                     check_workspace_type, is_real, parse_scale, parse_softcap, parse_window, require)
from .decode import MAX_SQ, DecodeChecked, DecodeIO, bind_decode_kernels, check_cache_dtypes, d_tile_for, plan_decode
from .fp8 import KV_FP8_CODES, KvScale, is_fp8, parse_kv_scales, scale_strides
from .kv_cache import cache_strides
from .paged import check_host_pages, paged_source
from .prepared import Op

__all__ = ["ragged_attention", "paged_attention", "paged_attention_workspace_bytes"]

_NEG_INF_BITS = 0xFF800000  # float32 -inf: the lse of rows no sequence covers
_MOVE_THREADS = 128         # cu/ragged.cu's blocks


class _RaggedDecodeParams(ParamStruct):
    """Mirror of RaggedDecodeParams in cu/ragged.cu (same fields, same order)."""

    _fields_ = [
        ("qo_indptr", ctypes.c_void_p), ("seq_lens", ctypes.c_void_p), ("dense_lens", ctypes.c_void_p),
        ("src", ctypes.c_void_p), ("dst", ctypes.c_void_p), ("lse_src", ctypes.c_void_p),
        ("lse_dst", ctypes.c_void_p),
        ("packed_tok", ctypes.c_int64), ("packed_head", ctypes.c_int64),
        ("dense_batch", ctypes.c_int64), ("dense_head", ctypes.c_int64), ("dense_row", ctypes.c_int64),
        ("lse_packed_tok", ctypes.c_int64), ("lse_packed_head", ctypes.c_int64),
        ("lse_dense_batch", ctypes.c_int64), ("lse_dense_head", ctypes.c_int64), ("lse_dense_row", ctypes.c_int64),
        ("num_seqs", ctypes.c_int32), ("rows", ctypes.c_int32), ("row_bytes", ctypes.c_int32),
        ("tokens_q", ctypes.c_int32),
    ]


# ---- validation (host only, before any device work) ---------------------------------------
def _check_packed(op: str, name: str, arr, what: str) -> None:
    """A packed [N, H, D] array of an attention dtype, or for k / v an fp8 one (_check_fp8
    checks what goes with it)."""
    require(op, name, arr)
    check_rank(op, name, arr, 3, what)
    if name == "q" or not is_fp8(arr.dtype):
        check_attention_dtype(op, name, arr)
    check_unit_last_stride(op, name, arr)
    check_nonnegative_strides(op, name, arr)


@dataclass(frozen=True)
class _Fp8:
    """fp8 K/V, validated: their dtype and scales."""
    dtype: np.dtype
    k_scale: KvScale
    v_scale: KvScale


def _check_fp8(op: str, a: dict, names: tuple[str, str], layouts: tuple[str, str], k_scale, v_scale, dqk: int,
               dv: int) -> _Fp8 | None:
    """K/V named `names` in one fp8 type, as decode takes them (q float16 or bfloat16, 16-byte
    rows, k_scale / v_scale per tensor or per token), at a head dim the fp8 tile kernels have;
    None for K/V in q's dtype (the caller checks that), which take no scales."""
    fp8 = any(is_fp8(a[name].dtype) for name in names)
    dtype = check_cache_dtypes(op, a, *names) if fp8 else None
    scales = parse_kv_scales(op, a, k_scale, v_scale, *zip(names, layouts))
    if not fp8:
        return None
    dims = tuple(sdpa_fp8_variants())
    if dqk != dv or dqk not in dims:
        raise TypeError(f"{op}: {dtype} {' and '.join(names)} are read for head dims Dqk = Dv in {dims}, got "
                        f"Dqk={dqk}, Dv={dv}")
    return _Fp8(dtype, *scales)


def _check_offsets(op: str, name: str, arr, batch: int | None = None) -> int:
    """An int32 [B + 1] offsets array; returns B."""
    require(op, name, arr)
    if arr.ndim != 1 or arr.shape[0] == 0:
        raise ValueError(f"{op}: {name} must be int32 [B + 1] (offsets of B sequences), got shape "
                         f"{tuple(arr.shape)}")
    check_index_array(op, name, arr, (arr.shape[0] if batch is None else batch + 1,))
    return arr.shape[0] - 1


def _check_host_offsets(op: str, name: str, offsets, tokens: int) -> None:
    """NumPy calls: offsets in [0, tokens] and non-decreasing."""
    values = np.asarray(offsets)
    check_host_values(op, name, values, 0, tokens, f"an offset into the {tokens} packed rows")
    drops = np.flatnonzero(np.diff(values.astype(np.int64)) < 0)
    if drops.size:
        i = int(drops[0])
        raise ValueError(f"{op}: {name} must be non-decreasing, got {name}[{i}] = {int(values[i])} > "
                         f"{name}[{i + 1}] = {int(values[i + 1])}")


def _check_heads(op: str, hq: int, hkv: int, what: str) -> None:
    check_gqa_heads(op, hq, hkv, what)
    if hq > MAX_GRID_YZ:
        raise ValueError(f"{op}: Hq must be <= {MAX_GRID_YZ} (a grid axis), got {hq}")


@dataclass(frozen=True)
class _Checked:
    batch: int
    left: int
    right: int
    scale: float
    softcap: float
    with_lse: bool  # lse is written (return_lse, or out_lse given)
    return_lse: bool
    fp8: _Fp8 | None = None


def _common(op: str, a: dict, batch: int, window, causal: bool, scale, softcap, return_lse, dqk: int,
            out_shape, dtype, fp8: _Fp8 | None) -> _Checked:
    """The options and outputs both ops check alike."""
    return_lse = check_flag(op, "return_lse", return_lse)
    left, right = parse_window(op, window, causal)
    nq, hq, dv = out_shape
    check_sinks(op, a["sinks"], hq)
    check_output(op, "out", a["out"], out_shape, dtype)
    check_output(op, "out_lse", a["out_lse"], (nq, hq), np.float32)
    return _Checked(batch, left, right, parse_scale(op, scale, dqk), parse_softcap(op, softcap),
                    return_lse or a["out_lse"] is not None, return_lse, fp8)


def _validate_ragged(a: dict, causal, window, scale, softcap, return_lse, k_scale, v_scale,
                     on_host: bool = False) -> _Checked:
    op = "ragged_attention"
    q, k, v = a["q"], a["k"], a["v"]
    _check_packed(op, "q", q, "[Nq, Hq, Dqk]")
    _check_packed(op, "k", k, "[Nk, Hkv, Dqk]")
    _check_packed(op, "v", v, "[Nk, Hkv, Dv]")
    nq, hq, dqk = q.shape
    nk, hkv, _ = k.shape
    dv = v.shape[2]
    if not (is_fp8(k.dtype) or is_fp8(v.dtype)) and (k.dtype != q.dtype or v.dtype != q.dtype):
        raise TypeError(f"{op}: q, k and v must share a dtype (or k and v one fp8 type), got q {q.dtype}, "
                        f"k {k.dtype}, v {v.dtype}")
    if k.shape[2] != dqk:
        raise ValueError(f"{op}: k must be [Nk, Hkv, Dqk={dqk}], got {tuple(k.shape)}")
    if tuple(v.shape[:2]) != (nk, hkv):
        raise ValueError(f"{op}: v must be [Nk, Hkv, Dv] = [{nk}, {hkv}, Dv], got {tuple(v.shape)}")
    _check_heads(op, hq, hkv, "k, v")
    check_head_dims(op, dqk, dv)
    fp8 = _check_fp8(op, a, ("k", "v"), ("token-major", "token-major"), k_scale, v_scale, dqk, dv)
    if max(nq, nk) >= 2**31 - UNBOUNDED_WINDOW:
        raise ValueError(f"{op}: Nq and Nk must be < {2**31 - UNBOUNDED_WINDOW}, got Nq={nq}, Nk={nk}")
    batch = _check_offsets(op, "cu_seqlens_q", a["cu_seqlens_q"])
    _check_offsets(op, "cu_seqlens_k", a["cu_seqlens_k"], batch)
    causal = check_flag(op, "causal", causal)
    checked = _common(op, a, batch, window, causal, scale, softcap, return_lse, dqk, (nq, hq, dv), q.dtype, fp8)
    if on_host:
        _check_host_offsets(op, "cu_seqlens_q", a["cu_seqlens_q"], nq)
        _check_host_offsets(op, "cu_seqlens_k", a["cu_seqlens_k"], nk)
    return checked


@dataclass(frozen=True)
class _PagedChecked(_Checked):
    source: object = None            # the pools and block table (decode.KvSource)
    decode_queries: int = 0
    decode: DecodeChecked | None = None  # the decode rows' plan (device calls with decode_queries > 0)
    workspace: WorkspaceLayout = WorkspaceLayout()


def _validate_paged(a: dict, layout, window, scale, softcap, return_lse, decode_queries, k_scale, v_scale,
                    on_host: bool = False, device=None) -> _PagedChecked:
    op = "paged_attention"
    q = a["q"]
    _check_packed(op, "q", q, "[Nq, Hq, Dqk]")
    batch = _check_offsets(op, "qo_indptr", a["qo_indptr"])
    src = paged_source(op, a, layout, batch)
    nq, hq, dqk = q.shape
    if not is_fp8(a["k_pool"].dtype):
        check_same_dtype(op, "q", q, "k_pool", a["k_pool"])
    if dqk != src.k.dim:
        raise ValueError(f"{op}: q's Dqk ({dqk}) must equal k_pool's D ({src.k.dim})")
    fp8 = _check_fp8(op, a, src.names[:2], (src.k_layout, src.v_layout), k_scale, v_scale, dqk, src.v.dim)
    _check_heads(op, hq, src.k.heads, "the pools")
    check_row_bytes(op, "q", q)
    require(op, "seq_lens", a["seq_lens"])
    check_index_array(op, "seq_lens", a["seq_lens"], (batch,))
    if not is_real(decode_queries) or isinstance(decode_queries, float) or not 0 <= decode_queries <= MAX_SQ:
        raise ValueError(f"{op}: decode_queries must be an int in [0, {MAX_SQ}] (sequences with that many new "
                         f"queries or fewer run the decode kernel; 0 = none), got {decode_queries!r}")
    decode_queries = int(decode_queries)
    dv = src.v.dim
    checked = _common(op, a, batch, window, True, scale, softcap, return_lse, dqk, (nq, hq, dv), q.dtype, fp8)
    if a["out"] is not None:
        check_row_bytes(op, "out", a["out"])
    cache_dtype = fp8.dtype if fp8 else None
    if decode_queries and d_tile_for(q.dtype, dqk, dv, cache_dtype) is None:
        raise ValueError(f"{op}: the decode kernel has no tile for {q.dtype} with Dqk={dqk}, Dv={dv}: pass "
                         f"decode_queries=0")
    check_workspace_type(op, a["workspace"])
    fields = dict(vars(checked), source=src, decode_queries=decode_queries)
    if on_host:
        _check_host_offsets(op, "qo_indptr", a["qo_indptr"], nq)
        check_host_values(op, "seq_lens", a["seq_lens"], 0, src.capacity, "a live length")
        check_host_pages(op, a, src)
        return _PagedChecked(**fields)
    if not decode_queries or batch == 0:
        return _PagedChecked(**fields)
    if device is None:
        device = q.device if isinstance(q, DeviceArray) else default_device()
    plan = plan_decode(batch=batch, hq=hq, hkv=src.k.heads, sq=decode_queries, dqk=dqk, dv=dv,
                       capacity=src.capacity, dtype=q.dtype, cache_dtype=cache_dtype, sm_count=device.sm_count,
                       max_shared=device.max_shared_per_block_optin)
    rows = batch * hq * decode_queries
    layout = WorkspaceLayout(q_dense=rows * dqk * q.itemsize, o_dense=rows * dv * q.itemsize,
                             lse_dense=rows * 4 if checked.with_lse else 0, dense_lens=batch * 4,
                             decode=plan.workspace_bytes)
    check_workspace_size(op, a["workspace"], layout.nbytes)
    decode = DecodeChecked(src, plan, checked.scale, checked.softcap, checked.left, checked.with_lse, False,
                           *((fp8.k_scale, fp8.v_scale) if fp8 else (None, None)))
    return _PagedChecked(**dict(fields, decode=decode, workspace=layout))


# ---- binding -------------------------------------------------------------------------------
def _token_strides(arr, shape) -> tuple[int, int, int]:
    """(batch, head, token) element strides of a packed [N, H, D] array (batch 0: tokens are
    addressed through the offsets), contiguous when the call makes it (arr None)."""
    strides = arr.element_strides if arr is not None else contiguous(shape)
    return 0, strides[1], strides[0]


def _bind_outputs(binding, a: dict, c: _Checked, shape) -> None:
    """o [Nq, Hq, Dv] and lse [Nq, Hq]: made zero / -inf filled when not given, since rows no
    sequence covers are not written."""
    binding.make("out", shape, a["q"].dtype, fill=0)
    if c.with_lse:
        binding.make("out_lse", shape[:2], np.float32, fill=_NEG_INF_BITS)
    binding.result(*(("out", "out_lse") if c.return_lse else ("out",)), as_tuple=c.return_lse)


def _kv_fp8(a: dict, c: _Checked, layouts=None) -> KvFp8:
    """The tile kernels' fp8 fields for c.fp8 (none without): per-token scales are packed
    [Nk, Hkv] arrays (layouts None) or shaped like pools of (k_layout, v_layout)."""
    if c.fp8 is None:
        return KvFp8()

    def fields(name: str, scale: KvScale, layout):
        """(a per-token scale array's element strides, or zeros; the per-tensor value, or 1)."""
        if not scale.per_token:
            return (0, 0, 0), scale.value
        return (_token_strides(a[name], a[name].shape) if layout is None else scale_strides(a[name], layout)), 1.0

    (k_strides, k_value), (v_strides, v_value) = (
        fields(name, scale, layout) for name, scale, layout in
        zip(("k_scale", "v_scale"), (c.fp8.k_scale, c.fp8.v_scale), layouts or (None, None)))
    return KvFp8(KV_FP8_CODES[c.fp8.dtype], k_strides, v_strides, k_value, v_value)


def _bind_tiles(binding, a: dict, c: _Checked, kv, kv_strides, hkv: int, dv: int, serving: Serving, names,
                fp8: KvFp8, block_table_stride: int = 0) -> None:
    """The tile kernel over a serving batch: K / V are the arrays `kv` (packed, or paged when
    block_table_stride is set), `names` maps its pointer fields to arguments."""
    q, out = a["q"], a["out"]
    nq, hq, dqk = q.shape
    dtype = np.dtype(q.dtype)
    vector_io = dtype != np.float32 and vector_io_ok((q, *kv, out))
    general = c.softcap > 0 or c.scale <= 0
    paged = block_table_stride > 0
    plan = plan_kernel(dtype, dqk, dv, general, runs_wgmma(binding.device), paged, c.fp8 is not None,
                       vector_io=vector_io)
    params = flash_params(_token_strides(q, q.shape), *kv_strides, _token_strides(out, (nq, hq, dv)),
                          _token_strides(a["out_lse"], (nq, hq)), c.left, c.right, c.scale, c.softcap, plan.vector_io,
                          heads=(hq, hkv), dims=(dqk, dv), block_table_stride=block_table_stride, serving=serving,
                          fp8=fp8)
    params.fault = fault_buffer(binding.device)
    launch = binding.launch(plan.kernel, (-(-nq // plan.rows) + c.batch, hq, 1), (plan.threads, 1, 1), params,
                            plan.shared)
    for name, field in (*names, ("k_scale", "k_scales"), ("v_scale", "v_scales")):
        if a[name] is not None or name == "out" or (name == "out_lse" and c.with_lse):
            binding.point(name, launch, field)


def _bind_ragged(binding, a: dict, c: _Checked, *_options) -> None:
    q, k, v = a["q"], a["k"], a["v"]
    nq, hq, _ = q.shape
    nk, hkv, _ = k.shape
    dv = v.shape[2]
    _bind_outputs(binding, a, c, (nq, hq, dv))
    if nq * hq * dv == 0 or c.batch == 0:
        return
    _bind_tiles(binding, a, c, (k, v), (_token_strides(k, k.shape), _token_strides(v, v.shape)), hkv, dv,
                Serving(num_seqs=c.batch, tokens_q=nq, tokens_k=nk, min_queries=1),
                (("q", "q"), ("k", "k"), ("v", "v"), ("out", "o"), ("out_lse", "lse"), ("sinks", "sinks"),
                 ("cu_seqlens_q", "cu_seqlens_q"), ("cu_seqlens_k", "cu_seqlens_k")), _kv_fp8(a, c))


def _bind_paged(binding, a: dict, c: _PagedChecked, *_options) -> None:
    q, src = a["q"], c.source
    nq, hq, dqk = q.shape
    dv = src.v.dim
    _bind_outputs(binding, a, c, (nq, hq, dv))
    binding.workspace_bytes = c.workspace.nbytes
    if nq * hq * dv == 0 or c.batch == 0:
        return
    # The pools pass check_row_bytes: 16-byte rows, so vector_io depends on q and out alone.
    serving = Serving(num_seqs=c.batch, tokens_q=nq, kv_capacity=src.capacity, num_pages=src.num_pages,
                      page_size_log2=src.page_size.bit_length() - 1, min_queries=c.decode_queries + 1)
    kv_strides = (cache_strides(a["k_pool"], src.k_layout), cache_strides(a["v_pool"], src.v_layout))
    _bind_tiles(binding, a, c, (), kv_strides, src.k.heads, dv, serving,
                (("q", "q"), ("k_pool", "k"), ("v_pool", "v"), ("out", "o"), ("out_lse", "lse"), ("sinks", "sinks"),
                 ("qo_indptr", "cu_seqlens_q"), ("seq_lens", "seq_lens_k"), ("block_table", "block_table")),
                _kv_fp8(a, c, (src.k_layout, src.v_layout)), block_table_stride=a["block_table"].element_strides[0])
    if c.decode is not None:
        _bind_decode_rows(binding, a, c)


def _bind_decode_rows(binding, a: dict, c: _PagedChecked) -> None:
    """Gather the decode rows' queries into the workspace, decode them there, scatter o / lse."""
    q, out, lse = a["q"], a["out"], a["out_lse"]
    nq, hq, dqk = q.shape
    dv, rows, ws = c.source.v.dim, c.decode_queries, c.workspace.offsets
    item = q.itemsize
    q_dense = (hq * rows * dqk, rows * dqk, dqk)
    o_dense = (hq * rows * dv, rows * dv, dv)
    lse_dense = (hq * rows, rows, 1) if c.with_lse else (0, 0, 0)
    _, q_head, q_tok = _token_strides(q, q.shape)
    gather = binding.launch("ragged_gather_decode", (c.batch, hq, 1), (_MOVE_THREADS, 1, 1), _RaggedDecodeParams(
        None, None, None, None, None, None, None, q_tok * item, q_head * item, *(s * item for s in q_dense),
        0, 0, 0, 0, 0, c.batch, rows, dqk * item, nq))
    for name, offset, field in (("qo_indptr", 0, "qo_indptr"), ("seq_lens", 0, "seq_lens"),
                                ("workspace", ws["dense_lens"], "dense_lens"), ("q", 0, "src"),
                                ("workspace", ws["q_dense"], "dst")):
        binding.point(name, gather, field, offset)
    places = {"q": ("workspace", ws["q_dense"]), "seq_lens": ("workspace", ws["dense_lens"]),
              "out": ("workspace", ws["o_dense"]), "out_lse": ("workspace", ws["lse_dense"]),
              "workspace": ("workspace", ws["decode"])}
    bind_decode_kernels(binding, a, c.decode, (c.batch, hq, rows, dqk), DecodeIO(q_dense, o_dense, lse_dense, places))
    _, o_head, o_tok = _token_strides(out, (nq, hq, dv))
    _, lse_head, lse_tok = _token_strides(lse, (nq, hq))
    scatter = binding.launch("ragged_scatter_decode", (c.batch, hq, 1), (_MOVE_THREADS, 1, 1), _RaggedDecodeParams(
        None, None, None, None, None, None, None, o_tok * item, o_head * item, *(s * item for s in o_dense),
        lse_tok, lse_head, *lse_dense, c.batch, rows, dv * item, nq))
    for name, offset, field in (("qo_indptr", 0, "qo_indptr"), ("workspace", ws["o_dense"], "src"),
                                ("out", 0, "dst")):
        binding.point(name, scatter, field, offset)
    if c.with_lse:
        binding.point("workspace", scatter, "lse_src", ws["lse_dense"])
        binding.point("out_lse", scatter, "lse_dst")


# ---- the ops -------------------------------------------------------------------------------
_RAGGED = Op("ragged_attention",
             ("q", "k", "v", "cu_seqlens_q", "cu_seqlens_k", "sinks", "k_scale", "v_scale", "out", "out_lse"),
             ("causal", "window", "scale", "softcap", "return_lse", "k_scale", "v_scale"), outputs=("out", "out_lse"),
             validate=_validate_ragged, bind=_bind_ragged, number_or_array=("k_scale", "v_scale"))

_PAGED_ARRAYS = ("q", "k_pool", "v_pool", "qo_indptr", "block_table", "seq_lens", "sinks", "k_scale", "v_scale", "out",
                 "out_lse", "workspace")
_PAGED = Op("paged_attention", _PAGED_ARRAYS,
            ("layout", "window", "scale", "softcap", "return_lse", "decode_queries", "k_scale", "v_scale"),
            outputs=("out", "out_lse"), validate=_validate_paged, bind=_bind_paged,
            number_or_array=("k_scale", "v_scale"))


def ragged_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, *, causal=False, window=None, scale=None, softcap=0.0,
                     sinks=None, k_scale=None, v_scale=None, return_lse=False, out=None, out_lse=None, stream=None):
    """Attention over a batch of sequences of different lengths, packed token-major.

    q [Nq, Hq, Dqk], k [Nk, Hkv, Dqk], v [Nk, Hkv, Dv] (f16, bf16 or f32, unit last stride);
    cu_seqlens_q / cu_seqlens_k: int32 [B + 1] offsets (non-decreasing, within Nq / Nk): sequence
    b's queries are q[cu_seqlens_q[b]:cu_seqlens_q[b + 1]] and its keys the same range of k / v.
    causal and window align bottom-right in each sequence (query i of Lq sees keys up to
    i + Lk - Lq, FlashAttention's varlen rule); scale, softcap and sinks [Hq] as in sdpa.
    Returns o [Nq, Hq, Dv] in q's dtype, and with return_lse also lse [Nq, Hq] float32 (natural
    log, -inf for a query that sees no key). Rows no sequence covers are not written (an out
    the call makes holds 0 there, its lse -inf). Nq and B are the launch's budget: the live
    offsets may cover fewer rows, and one prepared or captured call serves any such batch.
    Bad offsets skip their sequence and raise DeviceFault at ptxattn.check_faults (NumPy
    calls: ValueError before any device work).

    fp8 k and v (one of float8_e4m3fn, float8_e5m2; q float16 or bfloat16; Dqk = Dv = 64 or
    128; 16-byte rows) hold x standing for x * scale: k_scale and v_scale are required, each a
    positive number (one scale for the tensor) or float32 [Nk, Hkv] (one per token and kv
    head). Each value becomes q's dtype exactly as its tile loads; the scales multiply the
    scores (k) and the probabilities (v) in fp32, so the result matches the float64 attention
    over the dequantized k / v to the accuracy of q's dtype. Against the unquantized k / v,
    e4m3 with per-token scales from the amax adds a relative error of 0.037 (measured on the
    H200: bench.py --suite serving, 16 causal sequences, H32 D128, bf16 values N(0, 1));
    decode's docstring gives the other fp8 types and scales. An e4m3fn NaN byte (0x7f) reads
    as NaN on sm_89 and newer, as 480 before.
    """
    return _RAGGED((q, k, v, cu_seqlens_q, cu_seqlens_k, sinks, k_scale, v_scale, out, out_lse),
                   (causal, window, scale, softcap, return_lse, k_scale, v_scale), stream)


def paged_attention(q, k_pool, v_pool, qo_indptr, block_table, seq_lens, *, layout="HND", window=None, scale=None,
                    softcap=0.0, sinks=None, k_scale=None, v_scale=None, return_lse=False, decode_queries=1, out=None,
                    out_lse=None, workspace=None, stream=None):
    """New queries of a batch of sequences (prefill chunks, decode rows or both) against a
    paged KV pool that already holds them (paged_kv_append).

    q [Nq, Hq, Dqk] packed: sequence b's n_b new queries are q[qo_indptr[b]:qo_indptr[b + 1]]
    (qo_indptr int32 [B + 1], non-decreasing, within Nq; n_b may be 0). Pools, block_table
    int32 [B, max_pages] and layout as in paged_decode; seq_lens int32 [B] counts each
    sequence's keys including its new ones. Bottom-right causal: query i of sequence b sees
    keys < seq_lens[b] - n_b + 1 + i, so a chunk sees its cached prefix and its own earlier
    tokens; window=(left, right) limits it to `left` keys before that (right is capped at 0).
    Sequences with 1..decode_queries new queries (0..16, a fixed budget) run the split-KV decode
    kernel, the others the prefill tile kernel: the same function either way. Returns o
    [Nq, Hq, Dv], with return_lse also lse [Nq, Hq] float32; rows no sequence covers as in
    ragged_attention. workspace: a device array of paged_attention_workspace_bytes(...) bytes
    (else the call takes it from its stream's). Offsets, lengths past the capacity and page
    ids outside the pool skip their sequence and raise DeviceFault at ptxattn.check_faults
    (NumPy calls: ValueError first).

    fp8 pools take k_scale / v_scale as paged_decode does (a positive number, or float32 shaped
    like the pool less its last axis: [pages, Hkv, page_size] for "HND"), with q float16 or
    bfloat16 and Dqk = Dv = 64 or 128. Decode rows run decode's fp8 kernel; prefill tiles read
    fp8 as ragged_attention does.
    """
    return _PAGED((q, k_pool, v_pool, qo_indptr, block_table, seq_lens, sinks, k_scale, v_scale, out, out_lse,
                   workspace), (layout, window, scale, softcap, return_lse, decode_queries, k_scale, v_scale), stream)


def paged_attention_workspace_bytes(q, k_pool, v_pool, qo_indptr, block_table, *, layout="HND",
                                    decode_queries=1, return_lse=False, device=None) -> int:
    """Workspace bytes paged_attention() needs for these shapes (anything with .shape and
    .dtype) on `device` (default: the current one): reserve it before capture."""
    a = dict.fromkeys(_PAGED_ARRAYS)
    batch = qo_indptr.shape[0] - 1
    a.update(q=q, k_pool=k_pool, v_pool=v_pool, qo_indptr=qo_indptr, block_table=block_table,
             seq_lens=np.zeros(batch, np.int32))
    scales = [1.0 if is_fp8(pool.dtype) else None for pool in (k_pool, v_pool)]  # the plan ignores their values
    checked = _validate_paged(a, layout, None, None, 0.0, return_lse, decode_queries, *scales,
                              device=device or default_device())
    return checked.workspace.nbytes


ragged_attention.op, paged_attention.op = _RAGGED, _PAGED
