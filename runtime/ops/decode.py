"""decode: attention of a few new queries (Sq 1..16) against a fixed-capacity KV cache whose
live lengths live on the device (split-KV; kernels in cu/decode.cu, combine in cu/merge.cu).
paged_decode (ops/paged.py) runs the same kernel through a block table.

The split geometry comes from the capacity, batch, heads and the SM count only, never from
live lengths: eager and graph-replayed steps launch the same grid and give the same bits.
`plan_decode` is the one planning function; `decode_workspace_bytes` reports its workspace so
it can be reserved before capture. With one split (a batch and heads that fill the SMs
by themselves) the split kernel writes o and lse directly: no combine, no workspace.
"""
from __future__ import annotations

import ctypes
import math
from dataclasses import dataclass

import numpy as np

from ..array import DeviceArray
from ..context import default_device
from ..faults import fault_buffer
from ..memory import WorkspaceLayout
from ..module import ParamStruct
from ..variants import DECODE_THREADS, DECODE_WARP_ROWS, DECODE_WARPS, DecodeTile, decode_d_tiles
from ..dtypes import bfloat16
from .checks import (ATTENTION_DTYPES, MAX_GRID_YZ, check_attention_dtype, check_flag, check_host_values,
                     check_index_array, check_output, check_rank, check_row_bytes, check_same_dtype, check_sinks,
                     parse_layout, parse_scale, parse_softcap, parse_window, require, check_workspace_size,
                     check_workspace_type)
from .fp8 import KERNEL_NAMES, KvScale, is_fp8, parse_kv_scales, scale_strides
from .kv_cache import CacheShape, cache_shape, cache_strides
from .merge import bind_merge
from .prepared import Op

__all__ = ["decode", "decode_workspace_bytes", "plan_decode", "DecodePlan"]

THREADS = DECODE_THREADS
MAX_SQ = 16
MIN_KEYS_PER_SPLIT = 256  # below this a split's fixed costs outweigh its keys
# Splits are sized for two CTAs an SM even where three fit (fp8): fewer, longer splits spend
# less on start-up and on the combine. A one-split grid whose waves are less full than
# MIN_WAVE_FILL takes a deeper ring at one CTA fewer an SM if that fills them better (fp8 B64
# T8192: 512 CTAs are 1.29 waves of three an SM, 1.94 of two). cu/decode_tuning.md v10.
SPLIT_CTAS_PER_SM = 2
MIN_WAVE_FILL = 0.75
SHARED_RESERVED_PER_CTA = 1024  # the driver's per-block reservation (sm_80+): an SM holds opt-in max + this
# Why one wave of splits, rings deep enough for two CTAs an SM, a direct write with one split,
# and the largest shared-memory carveout: each was measured against its alternatives on the
# H200 (v1-v8, with the numbers, in cu/decode_tuning.md).
class DecodeParams(ParamStruct):
    """Mirror of DecodeParams in cu/decode.cu (same fields, same order)."""

    _fields_ = [
        ("q", ctypes.c_void_p), ("k", ctypes.c_void_p), ("v", ctypes.c_void_p),
        ("seq_lens", ctypes.c_void_p), ("block_table", ctypes.c_void_p),
        ("o_part", ctypes.c_void_p), ("lse_part", ctypes.c_void_p),
        ("o_out", ctypes.c_void_p), ("lse_out", ctypes.c_void_p), ("sinks", ctypes.c_void_p),
        ("fault", ctypes.c_void_p), ("k_scales", ctypes.c_void_p), ("v_scales", ctypes.c_void_p),
        ("q_stride_b", ctypes.c_int64), ("q_stride_h", ctypes.c_int64), ("q_stride_s", ctypes.c_int64),
        ("k_stride_page", ctypes.c_int64), ("k_stride_head", ctypes.c_int64), ("k_stride_tok", ctypes.c_int64),
        ("v_stride_page", ctypes.c_int64), ("v_stride_head", ctypes.c_int64), ("v_stride_tok", ctypes.c_int64),
        ("block_table_stride", ctypes.c_int64),
        ("o_out_stride_b", ctypes.c_int64), ("o_out_stride_h", ctypes.c_int64), ("o_out_stride_s", ctypes.c_int64),
        ("lse_out_stride_b", ctypes.c_int64), ("lse_out_stride_h", ctypes.c_int64),
        ("lse_out_stride_s", ctypes.c_int64),
        ("k_scale_stride_page", ctypes.c_int64), ("k_scale_stride_head", ctypes.c_int64),
        ("k_scale_stride_tok", ctypes.c_int64),
        ("v_scale_stride_page", ctypes.c_int64), ("v_scale_stride_head", ctypes.c_int64),
        ("v_scale_stride_tok", ctypes.c_int64),
        ("hq", ctypes.c_int32), ("hkv", ctypes.c_int32), ("sq", ctypes.c_int32),
        ("dqk", ctypes.c_int32), ("dv", ctypes.c_int32), ("capacity", ctypes.c_int32),
        ("num_pages", ctypes.c_int32), ("page_size_log2", ctypes.c_int32),
        ("num_splits", ctypes.c_int32), ("keys_per_split", ctypes.c_int32),
        ("warps_m", ctypes.c_int32), ("stages", ctypes.c_int32), ("window_left", ctypes.c_int32),
        ("scale", ctypes.c_float), ("softcap", ctypes.c_float), ("v_scale", ctypes.c_float),
    ]


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class DecodePlan:
    kernel: str
    grid: tuple[int, int, int]
    shared_bytes: int
    stages: int
    warps_m: int
    num_splits: int
    keys_per_split: int
    workspace: WorkspaceLayout

    @property
    def workspace_bytes(self) -> int:
        return self.workspace.nbytes


def d_tile_for(dtype, dqk: int, dv: int, cache_dtype=None) -> DecodeTile | None:
    """The smallest head-dim tile of decode's kernels for queries in `dtype` and a cache of
    `cache_dtype` (default: the same) that holds Dqk and Dv."""
    kv = KERNEL_NAMES.get(np.dtype(cache_dtype)) if cache_dtype is not None else None
    tiles = decode_d_tiles(ATTENTION_DTYPES[np.dtype(dtype)], kv)
    return next((t for t in tiles if t.d >= max(dqk, dv)), None)


def split_align(tile: DecodeTile) -> int:
    """keys_per_split is a multiple of this: full splits give every warp group as many blocks."""
    return tile.block_keys * DECODE_WARPS


def ring_depth(tile: DecodeTile, warps_m: int, max_shared: int, ctas_per_sm: int) -> int:
    """The deepest ring that still lets `ctas_per_sm` CTAs share an SM; failing that fewer
    CTAs, down to the deepest ring one CTA can hold; 2 when none fits (plan_decode reports it)."""
    per_sm = max_shared + SHARED_RESERVED_PER_CTA
    need = {s: tile.shared_bytes(warps_m, s) for s in range(tile.max_stages, 1, -1)}
    fits = [s for s, n in need.items() if n <= max_shared]
    for ctas in range(ctas_per_sm, 1, -1):
        shared = [s for s in fits if ctas * (need[s] + SHARED_RESERVED_PER_CTA) <= per_sm]
        if shared:
            return shared[0]
    return (fits or [2])[0]


def wave_fill(ctas: int, resident: int, sm_count: int) -> float:
    """How full a grid of `ctas` keeps the SMs over its waves (1: every wave full)."""
    waves = ctas / (resident * sm_count)
    return waves / math.ceil(waves)


def plan_decode(*, batch: int, hq: int, hkv: int, sq: int, dqk: int, dv: int, capacity: int, dtype,
                sm_count: int, max_shared: int, cache_dtype=None, stages: int | None = None,
                ctas_per_sm: int | None = None, waves: int = 1) -> DecodePlan:
    """Grid, split geometry, shared memory and workspace of one decode launch (validated
    shapes; `dtype` is q's, `cache_dtype` the cache's when it differs: fp8). Depends on no live
    length. The grid is one wave: as many splits as let every (batch row, kv head, row block)
    have its CTAs resident at once, SPLIT_CTAS_PER_SM an SM, each split at least
    MIN_KEYS_PER_SPLIT keys. The ring is as deep as tile.ctas_per_sm CTAs an SM allow, or, for
    a grid of one split whose last wave would leave most SMs idle, as deep as one CTA fewer
    allow when that fills the waves better. `stages` overrides the ring depth, `ctas_per_sm`
    the CTAs an SM is taken to hold and `waves` the grid target (benchmarks)."""
    dtype = np.dtype(dtype)
    tile = d_tile_for(dtype, dqk, dv, cache_dtype)
    rows = hq // hkv * sq  # query rows sharing one kv head
    warps_m = 1 if rows <= DECODE_WARP_ROWS else 2 if rows <= 2 * DECODE_WARP_ROWS else 4
    row_blocks = _ceil_div(rows, DECODE_WARP_ROWS * warps_m)
    ctas_per_split = batch * hkv * row_blocks

    def resident(ring: int) -> int:
        return (max_shared + SHARED_RESERVED_PER_CTA) // (tile.shared_bytes(warps_m, ring) + SHARED_RESERVED_PER_CTA)

    ring = stages or ring_depth(tile, warps_m, max_shared, tile.ctas_per_sm)
    split_ctas = ctas_per_sm or min(resident(ring), SPLIT_CTAS_PER_SM)
    splits = max(1, min(waves * split_ctas * sm_count // ctas_per_split, _ceil_div(capacity, MIN_KEYS_PER_SPLIT)))
    if stages is None and splits == 1 and tile.ctas_per_sm > SPLIT_CTAS_PER_SM:  # fp8 only: where it was measured
        deeper = ring_depth(tile, warps_m, max_shared, tile.ctas_per_sm - 1)
        fill, deeper_fill = (wave_fill(ctas_per_split, resident(r), sm_count) for r in (ring, deeper))
        if fill < MIN_WAVE_FILL and deeper_fill > fill:
            ring = deeper
    stages = ring
    smem = tile.shared_bytes(warps_m, stages)
    if smem > max_shared:
        raise ValueError(f"decode: head dim {max(dqk, dv)} in {dtype} needs {smem} bytes of shared memory per "
                         f"block, the device allows {max_shared}")
    align = split_align(tile)
    keys_per_split = _ceil_div(_ceil_div(capacity, splits), align) * align
    splits = _ceil_div(capacity, keys_per_split)
    partials = batch * hq * sq * splits
    # One split writes the final o and lse itself: no partials to hold.
    workspace = WorkspaceLayout(o_part=partials * dv * 4, lse_part=partials * 4) if splits > 1 else WorkspaceLayout()
    return DecodePlan(
        kernel=tile.kernel,
        grid=(hkv * row_blocks, batch, splits),
        shared_bytes=smem,
        stages=stages,
        warps_m=warps_m,
        num_splits=splits,
        keys_per_split=keys_per_split,
        workspace=workspace,
    )


# ---- validation shared by decode and paged_decode ----------------------------------------------
@dataclass(frozen=True)
class KvSource:
    """The K/V one decode reads, validated: a contiguous cache (one page per batch row) or a
    paged pool read through a block table. `names` are the call's argument names for
    (k, v, block table or None)."""

    names: tuple[str, str, str | None]
    k_layout: str
    v_layout: str
    k: CacheShape
    v: CacheShape
    capacity: int   # keys a row can hold
    num_pages: int
    page_size: int


def contiguous_source(op: str, a: dict, layout) -> KvSource:
    k_layout, v_layout = parse_layout(op, layout)
    k = cache_shape(op, "k_cache", a["k_cache"], k_layout)
    v = cache_shape(op, "v_cache", a["v_cache"], v_layout)
    require(op, "q", a["q"])
    batch = a["q"].shape[0] if a["q"].ndim else 0
    for name, shape in (("k_cache", k), ("v_cache", v)):
        if shape.pages != batch:
            raise ValueError(f"{op}: {name} must hold B={batch} rows (q's batch), got {shape.pages}")
    if k.tokens != v.tokens or k.tokens == 0:
        raise ValueError(f"{op}: k_cache and v_cache must have one positive capacity, got {k.tokens} and {v.tokens}")
    return KvSource(("k_cache", "v_cache", None), k_layout, v_layout, k, v, k.tokens, batch, 1)


def check_query(op: str, q, k: CacheShape, v: CacheShape) -> None:
    """q [B, Hq, Sq, Dqk] against K / V of Hkv heads (validated shapes)."""
    check_rank(op, "q", q, 4, "[B, Hq, Sq, Dqk]")
    check_attention_dtype(op, "q", q)
    batch, hq, sq, dqk = (int(n) for n in q.shape)
    if batch > MAX_GRID_YZ:
        raise ValueError(f"{op}: q's batch (axis 0) must be <= {MAX_GRID_YZ} (a grid axis), got {batch}")
    if not 1 <= sq <= MAX_SQ:
        raise ValueError(f"{op}: q's Sq (axis 2) must be in [1, {MAX_SQ}] (decode steps), got {sq}")
    if k.heads != v.heads:
        raise ValueError(f"{op}: K and V must have one number of kv heads, got {k.heads} and {v.heads}")
    if k.heads == 0 or hq % k.heads:
        raise ValueError(f"{op}: q's Hq ({hq}) must be a multiple of the caches' Hkv ({k.heads})")
    if dqk != k.dim:
        raise ValueError(f"{op}: q's Dqk ({dqk}) must equal the key cache's D ({k.dim})")
    check_row_bytes(op, "q", q)


def check_head_dims(op: str, q, v: CacheShape, cache_dtype=None) -> None:
    """A kernel for q's dtype (and the caches', when fp8) holds Dqk and Dv."""
    dqk = int(q.shape[3])
    if d_tile_for(q.dtype, dqk, v.dim, cache_dtype) is None:
        kv = KERNEL_NAMES.get(np.dtype(cache_dtype)) if cache_dtype is not None else None
        top = decode_d_tiles(ATTENTION_DTYPES[np.dtype(q.dtype)], kv)[-1].d
        raise ValueError(f"{op}: head dims up to {top} are supported for {q.dtype}"
                         f"{f' with {np.dtype(cache_dtype)} caches' if kv else ''}, got Dqk={dqk}, Dv={v.dim}")


def check_cache_dtypes(op: str, a: dict, k_name: str, v_name: str) -> np.dtype | None:
    """K and V (the arguments of those names) hold q's dtype, or one fp8 type (then q is float16
    or bfloat16): that fp8 dtype, else None."""
    q = a["q"]
    fp8 = is_fp8(a[k_name].dtype) or is_fp8(a[v_name].dtype)
    if fp8:
        check_same_dtype(op, v_name, a[v_name], k_name, a[k_name])
    for name in (k_name, v_name):
        if not fp8:
            check_attention_dtype(op, name, a[name])
            check_same_dtype(op, name, a[name], "q", q)
        check_row_bytes(op, name, a[name])
    if not fp8:
        return None
    if np.dtype(q.dtype) not in (np.dtype(np.float16), bfloat16):
        raise TypeError(f"{op}: q must be float16 or bfloat16 with {a[k_name].dtype} caches, got {q.dtype}")
    return np.dtype(a[k_name].dtype)


@dataclass(frozen=True)
class DecodeChecked:
    source: KvSource
    plan: DecodePlan
    scale: float
    softcap: float
    window_left: int
    with_lse: bool
    return_lse: bool
    k_scale: KvScale | None  # fp8 caches only
    v_scale: KvScale | None


def validate_decode(op: str, a: dict, src: KvSource, scale, softcap, window, return_lse, k_scale, v_scale,
                    on_host: bool, device=None) -> DecodeChecked | None:
    """Everything decode and paged_decode check alike, and the plan (on `device`, default:
    the arrays' device, else the current one); NumPy calls (on_host) get no plan, None.
    k_scale / v_scale: the number options (a per-tensor scale), or None when the array of
    that name carries the scales."""
    q = a["q"]
    require(op, src.names[0], a[src.names[0]])
    require(op, src.names[1], a[src.names[1]])
    check_query(op, q, src.k, src.v)
    cache_dtype = check_cache_dtypes(op, a, *src.names[:2])
    check_head_dims(op, q, src.v, cache_dtype)
    k_scale, v_scale = parse_kv_scales(op, a, k_scale, v_scale, (src.names[0], src.k_layout),
                                       (src.names[1], src.v_layout))
    batch, hq, sq, dqk = q.shape
    require(op, "seq_lens", a["seq_lens"])
    check_index_array(op, "seq_lens", a["seq_lens"], (batch,))
    check_sinks(op, a["sinks"], hq)
    check_output(op, "out", a["out"], (batch, hq, sq, src.v.dim), q.dtype)
    check_output(op, "out_lse", a["out_lse"], (batch, hq, sq), np.float32)
    return_lse = check_flag(op, "return_lse", return_lse)
    left, _ = parse_window(op, window)
    checked_scale, checked_softcap = parse_scale(op, scale, dqk), parse_softcap(op, softcap)
    workspace = a.get("workspace")
    check_workspace_type(op, workspace)
    if on_host:  # NumPy values are read here; the plan is made when the uploaded arrays run
        check_host_values(op, "seq_lens", a["seq_lens"], 0, src.capacity, "a live length")
        return None
    if device is None:
        device = q.device if isinstance(q, DeviceArray) else default_device()
    plan = plan_decode(batch=batch, hq=hq, hkv=src.k.heads, sq=sq, dqk=dqk, dv=src.v.dim, capacity=src.capacity,
                       dtype=q.dtype, cache_dtype=cache_dtype, sm_count=device.sm_count,
                       max_shared=device.max_shared_per_block_optin)
    check_workspace_size(op, workspace, plan.workspace_bytes)
    return DecodeChecked(src, plan, checked_scale, checked_softcap, left, return_lse or a["out_lse"] is not None,
                         return_lse, k_scale, v_scale)


# ---- binding ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class DecodeIO:
    """Where the decode kernels find q [B, Hq, Sq, Dqk] and seq_lens and put o and lse:
    element strides (batch, head, token), and per role ("q", "seq_lens", "out", "out_lse",
    "workspace") the binding's argument and byte offset that hold it. decode() names its own
    arguments; paged_attention's decode rows live in its workspace."""

    q_strides: tuple[int, int, int]
    o_strides: tuple[int, int, int]
    lse_strides: tuple[int, int, int]
    at: dict


_OWN_ARGUMENTS = {role: (role, 0) for role in ("q", "seq_lens", "out", "out_lse", "workspace")}


def bind_decode(binding, a: dict, c: DecodeChecked) -> None:
    """decode() / paged_decode(): their outputs and workspace, then the kernels."""
    q = a["q"]
    batch, hq, sq, _ = q.shape
    dv = c.source.v.dim
    binding.make("out", (batch, hq, sq, dv), q.dtype)
    if c.with_lse:
        binding.make("out_lse", (batch, hq, sq), np.float32)
    binding.workspace_bytes = c.plan.workspace_bytes
    binding.result(*(("out", "out_lse") if c.return_lse else ("out",)), as_tuple=c.return_lse)
    out, lse = a["out"], a["out_lse"]
    o_strides = out.element_strides[:3] if out is not None else (hq * sq * dv, sq * dv, dv)
    lse_strides = lse.element_strides if lse is not None else (hq * sq, sq, 1) if c.with_lse else (0, 0, 0)
    bind_decode_kernels(binding, a, c, q.shape, DecodeIO(q.element_strides[:3], o_strides, lse_strides,
                                                         _OWN_ARGUMENTS))


def bind_decode_kernels(binding, a: dict, c: DecodeChecked, q_shape, io: DecodeIO) -> None:
    """The split kernel and, with more than one split, the combine, for q of `q_shape`."""
    src, plan = c.source, c.plan
    batch, hq, sq, dqk = q_shape
    dv = src.v.dim
    k, v = a[src.names[0]], a[src.names[1]]
    table = a[src.names[2]] if src.names[2] else None
    o_strides, lse_strides = io.o_strides, io.lse_strides
    ws, ws_offset = io.at["workspace"]
    direct = plan.num_splits == 1  # the split kernel writes o and lse itself
    # fp8: a per-tensor K scale joins the softmax scale, a per-tensor V scale the output's.
    k_per_token, v_per_token = (s is not None and s.per_token for s in (c.k_scale, c.v_scale))
    k_value = c.k_scale.value if c.k_scale is not None and not k_per_token else 1.0
    v_value = c.v_scale.value if c.v_scale is not None and not v_per_token else 1.0
    k_scale_strides = scale_strides(a["k_scale"], src.k_layout) if k_per_token else (0, 0, 0)
    v_scale_strides = scale_strides(a["v_scale"], src.v_layout) if v_per_token else (0, 0, 0)
    params = DecodeParams(
        None, None, None, None, None, None, None, None, None, None, fault_buffer(binding.device), None, None,
        *io.q_strides, *cache_strides(k, src.k_layout), *cache_strides(v, src.v_layout),
        table.element_strides[0] if table is not None else 0, *o_strides, *lse_strides,
        *k_scale_strides, *v_scale_strides,
        hq, src.k.heads, sq, dqk, dv, src.capacity, src.num_pages, src.page_size.bit_length() - 1,
        plan.num_splits, plan.keys_per_split, plan.warps_m, plan.stages, c.window_left, c.scale * k_value, c.softcap,
        v_value,
    )
    split = binding.launch(plan.kernel, plan.grid, (THREADS, 1, 1), params, plan.shared_bytes)
    for (name, offset), field in (
            (io.at["q"], "q"), (io.at["seq_lens"], "seq_lens"), ((src.names[0], 0), "k"), ((src.names[1], 0), "v"),
            ((src.names[2], 0), "block_table"), (("k_scale" if k_per_token else None, 0), "k_scales"),
            (("v_scale" if v_per_token else None, 0), "v_scales")):
        if name is not None:
            binding.point(name, split, field, offset)
    out, out_offset = io.at["out"]
    lse, lse_offset = io.at["out_lse"]
    if direct:
        binding.point(out, split, "o_out", out_offset)
        if c.with_lse:
            binding.point(lse, split, "lse_out", lse_offset)
        if a["sinks"] is not None:
            binding.point("sinks", split, "sinks")
        return
    binding.point(ws, split, "o_part", ws_offset + plan.workspace.offsets["o_part"])
    binding.point(ws, split, "lse_part", ws_offset + plan.workspace.offsets["lse_part"])
    splits = plan.num_splits
    combine = bind_merge(binding, in_dtype=np.float32, out_dtype=a["q"].dtype,
                         o_in_strides=(dv, hq * sq * splits * dv, sq * splits * dv, splits * dv),
                         lse_in_strides=(1, hq * sq * splits, sq * splits, splits), shape=(batch, hq, sq, dv),
                         o_out_strides=o_strides, lse_out_strides=lse_strides, num_states=splits,
                         programmatic=True)
    if combine is None:
        return
    binding.point(ws, combine, "o_in", ws_offset + plan.workspace.offsets["o_part"])
    binding.point(ws, combine, "lse_in", ws_offset + plan.workspace.offsets["lse_part"])
    binding.point(out, combine, "o_out", out_offset)
    if c.with_lse:
        binding.point(lse, combine, "lse_out", lse_offset)
    if a["sinks"] is not None:
        binding.point("sinks", combine, "sinks")


_ARRAYS = ("q", "k_cache", "v_cache", "seq_lens", "sinks", "k_scale", "v_scale", "out", "out_lse", "workspace")
_OPTIONS = ("layout", "scale", "softcap", "window", "return_lse", "k_scale", "v_scale")


def _validate(a: dict, layout, scale, softcap, window, return_lse, k_scale, v_scale,
              on_host: bool = False) -> DecodeChecked:
    src = contiguous_source("decode", a, layout)
    return validate_decode("decode", a, src, scale, softcap, window, return_lse, k_scale, v_scale, on_host)


_DECODE = Op("decode", _ARRAYS, _OPTIONS, outputs=("out", "out_lse"), validate=_validate,
             bind=lambda binding, a, checked, *options: bind_decode(binding, a, checked),
             number_or_array=("k_scale", "v_scale"))


def decode_workspace_bytes(q, k_cache, v_cache, *, layout="HND", device=None) -> int:
    """Workspace bytes decode() needs for these shapes (anything with .shape and .dtype) on
    `device` (default: the current one). Pass it as workspace= to capture an eager call."""
    a = dict.fromkeys(_ARRAYS)
    a.update(q=q, k_cache=k_cache, v_cache=v_cache, seq_lens=np.zeros(q.shape[0], np.int32))
    src = contiguous_source("decode", a, layout)
    # The plan depends on the caches' dtype, never on the scales' values.
    scales = [1.0 if is_fp8(c.dtype) else None for c in (k_cache, v_cache)]
    checked = validate_decode("decode", a, src, None, 0.0, None, False, *scales, False, device or default_device())
    return checked.plan.workspace_bytes


def decode(q, k_cache, v_cache, seq_lens, *, layout="HND", scale=None, softcap=0.0, window=None, sinks=None,
           k_scale=None, v_scale=None, return_lse: bool = False, out=None, out_lse=None, workspace=None,
           stream=None):
    """Attention of q [B, Hq, Sq, Dqk] (Sq 1..16) against each row's first seq_lens[b] cached
    keys, bottom-right causal: query t sees keys < seq_lens[b] - Sq + 1 + t.

    k_cache [B, Hkv, capacity, Dqk] / v_cache [B, Hkv, capacity, Dv] for layout "HND",
    [B, capacity, Hkv, D] for "NHD" (or a (k_layout, v_layout) pair); float16, bfloat16 or
    float32 like q; Hq a multiple of Hkv (GQA), head dims multiples of 16 bytes up to 256
    (128 for float32). seq_lens: int32 [B] on the device; slots past them are never read.
    scale (default 1/sqrt(Dqk)), softcap (0 = off), window (left, right) and sinks float32
    [Hq] as in sdpa. Returns o [B, Hq, Sq, Dv] in q's dtype, and with return_lse also lse
    [B, Hq, Sq] float32 (natural log, -inf for a row with no key). A row with seq_lens[b] == 0
    gives zeros. out / out_lse: preallocated outputs (out_lse is written whenever given);
    workspace: a device array of at least decode_workspace_bytes(...) bytes (else the call
    takes it from the stream-ordered pool). A length outside [0, capacity] is reported as a
    DeviceFault after synchronization (NumPy calls check it on the host first: ValueError).

    fp8 caches (float8_e4m3fn or float8_e5m2, both alike; q float16 or bfloat16; head dims
    multiples of 16) hold x standing for x * scale, and need k_scale and v_scale: a positive
    number (one scale per tensor), or float32 arrays shaped like the caches less their last
    axis ([B, Hkv, capacity] for "HND", one scale per token and kv head; kv_append writes
    them). K and V become f16 in registers (exactly), q is scaled per row by a power of two
    into f16, and both products run in f16 with fp32 accumulation: the result matches the
    float64 attention over the dequantized cache to bf16 accuracy. Against the unquantized
    cache, quantization adds (measured on the H200, Hq32 Hkv8 D128, values N(0, 1), scales
    from the amax, tests/test_fp8_decode_gpu.py::test_quantization_error) a relative error of
    0.038 (e4m3, per-tensor scale) / 0.036 (e4m3, per-token) / 0.077 (e5m2, per-tensor) /
    0.074 (e5m2, per-token). An e4m3fn NaN (0x7f) in the live keys stays NaN on sm_89 and
    newer but reads as 480 on sm_80 / sm_86; e5m2's inf and NaN stay what they are.
    """
    return _DECODE((q, k_cache, v_cache, seq_lens, sinks, k_scale, v_scale, out, out_lse, workspace),
                   (layout, scale, softcap, window, return_lse, k_scale, v_scale), stream)


decode.op = _DECODE
