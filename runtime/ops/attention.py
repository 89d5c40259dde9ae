"""`ptxattn.sdpa`: scaled dot-product attention (cu/flash_fwd.cu).

validate (host only) -> plan (variant, grid, shared memory) -> bind the parameter struct
-> launch. Semantics: runtime/reference.py `sdpa` is their definition.
"""
from __future__ import annotations

import ctypes
import functools
import math
import os
import struct
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from .. import tensor_map
from ..array import DeviceArray
from ..dtypes import bfloat16
from ..module import ParamStruct, loaded_arch
from ..tensor_map import MAP_BYTES, MapSpec
from ..variants import (SdpaVariant, Sm90Tile, sdpa_fp8_variants, sdpa_tiles, sm90_fp8_tiles,
                        sm90_persistent_tiles, sm90_staged_mask_tiles, sm90_tiles, sm90_ws_pp_tiles, sm90_ws_tiles)
from .checks import (MAX_GRID_YZ, UNBOUNDED_WINDOW, check_attention_dtype, check_flag, check_nonnegative_strides,
                     check_output, check_sinks, check_unit_last_stride, parse_scale, parse_softcap, parse_window,
                     require)
from .persistent_deal import TAIL_CTAS, TAIL_SLOTS, key_tiles, tail_deal, virtual_block_costs
from .prepared import Op

__all__ = ["sdpa"]

_DTYPE_NAME = {np.dtype(np.float16): "f16", bfloat16: "bf16", np.dtype(np.float32): "f32"}
# MaskKind in cu/attention_common.cuh.
_MASK_KIND = {np.dtype(np.bool_): 1, np.dtype(np.float32): 2, np.dtype(np.float16): 3, bfloat16: 4}
_MAX_HEAD_DIM = 256
_F32_WARPS = 4  # F32_WARPS in cu/flash_fwd.cu


# FlashFwdParams' fields up to its TMA ones, packed by flash_params.
_PACKED_FIELDS = [
    ("q", ctypes.c_void_p), ("k", ctypes.c_void_p), ("v", ctypes.c_void_p),
    ("o", ctypes.c_void_p), ("lse", ctypes.c_void_p), ("mask", ctypes.c_void_p),
    ("sinks", ctypes.c_void_p), ("cu_seqlens_q", ctypes.c_void_p), ("cu_seqlens_k", ctypes.c_void_p),
    ("seq_lens_k", ctypes.c_void_p), ("block_table", ctypes.c_void_p), ("fault", ctypes.c_void_p),
    ("k_scales", ctypes.c_void_p), ("v_scales", ctypes.c_void_p),
    ("q_batch_stride", ctypes.c_int64), ("q_head_stride", ctypes.c_int64), ("q_seq_stride", ctypes.c_int64),
    ("k_batch_stride", ctypes.c_int64), ("k_head_stride", ctypes.c_int64), ("k_seq_stride", ctypes.c_int64),
    ("v_batch_stride", ctypes.c_int64), ("v_head_stride", ctypes.c_int64), ("v_seq_stride", ctypes.c_int64),
    ("o_batch_stride", ctypes.c_int64), ("o_head_stride", ctypes.c_int64), ("o_seq_stride", ctypes.c_int64),
    ("mask_batch_stride", ctypes.c_int64), ("mask_head_stride", ctypes.c_int64),
    ("mask_query_stride", ctypes.c_int64), ("mask_key_stride", ctypes.c_int64),
    ("lse_batch_stride", ctypes.c_int64), ("lse_head_stride", ctypes.c_int64), ("lse_seq_stride", ctypes.c_int64),
    ("block_table_stride", ctypes.c_int64),
    ("k_scale_batch_stride", ctypes.c_int64), ("k_scale_head_stride", ctypes.c_int64),
    ("k_scale_seq_stride", ctypes.c_int64),
    ("v_scale_batch_stride", ctypes.c_int64), ("v_scale_head_stride", ctypes.c_int64),
    ("v_scale_seq_stride", ctypes.c_int64),
    ("heads_q", ctypes.c_int32), ("heads_kv", ctypes.c_int32), ("seq_q", ctypes.c_int32),
    ("seq_kv", ctypes.c_int32), ("dim_qk", ctypes.c_int32), ("dim_v", ctypes.c_int32),
    ("mask_kind", ctypes.c_int32), ("diag_offset", ctypes.c_int32),
    ("window_left", ctypes.c_int32), ("window_right", ctypes.c_int32),
    ("scale", ctypes.c_float), ("softcap", ctypes.c_float),
    ("vector_io", ctypes.c_int32), ("heavy_first", ctypes.c_int32),
    ("num_seqs", ctypes.c_int32), ("tokens_q", ctypes.c_int32), ("tokens_k", ctypes.c_int32),
    ("kv_capacity", ctypes.c_int32), ("num_pages", ctypes.c_int32), ("page_size_log2", ctypes.c_int32),
    ("min_queries", ctypes.c_int32), ("kv_fp8", ctypes.c_int32),
    ("k_scale", ctypes.c_float), ("v_scale", ctypes.c_float),
]


# The fields between the packed ones and the tensor maps (each run or plan sets them).
_MAP_PREFIX_FIELDS = [("tma", ctypes.c_int32), ("virtual_grid_x", ctypes.c_int32),
                      ("virtual_grid_y", ctypes.c_int32), ("virtual_grid_z", ctypes.c_int32)] + [
    (f"{name}_{part}", kind) for part, kind in (("mul", ctypes.c_uint32), ("shift", ctypes.c_int32))
    for name in ("virtual_div_x", "virtual_div_y", "heads_q_div")]  # fast_divisor's pairs


class _PackedPrefix(ctypes.Structure):
    _fields_ = _PACKED_FIELDS + _MAP_PREFIX_FIELDS


_TENSOR_MAP = ctypes.c_uint8 * MAP_BYTES
# C aligns each TensorMap to 64 bytes; a padding field here stands for the gap before the first,
# and one at the end for C's rounding of the struct's size to 64 (the driver copies that much).
_MAP_PADDING = -ctypes.sizeof(_PackedPrefix) % 64
_TAIL_FIELDS = [("tail_round", ctypes.c_int32), ("tail_blocks", ctypes.c_uint16 * (TAIL_CTAS * TAIL_SLOTS))]
_END_PADDING = -(ctypes.sizeof(_PackedPrefix) + _MAP_PADDING + 5 * MAP_BYTES +
                 sum(ctypes.sizeof(ctype) for _, ctype in _TAIL_FIELDS)) % 64


class _FlashFwdParams(ParamStruct):
    """Mirror of FlashFwdParams in cu/flash_fwd_common.cuh: same fields, same order (and a
    padding field where C's alignment leaves a gap)."""
    _fields_ = _PACKED_FIELDS + _MAP_PREFIX_FIELDS + [
        ("_padding", ctypes.c_uint8 * _MAP_PADDING),
        ("q_map", _TENSOR_MAP), ("k_map", _TENSOR_MAP), ("v_map", _TENSOR_MAP), ("mask_map", _TENSOR_MAP),
        ("o_map", _TENSOR_MAP)] + _TAIL_FIELDS + [("_end_padding", ctypes.c_uint8 * _END_PADDING)]


# ---- validation (host only, before any device work) ---------------------------------
def _check_tensor(name: str, arr, dims: str) -> None:
    require("sdpa", name, arr)
    if arr.ndim != 4:
        raise ValueError(f"sdpa: {name} must be 4-d {dims}, got shape {tuple(arr.shape)}")
    check_attention_dtype("sdpa", name, arr)
    check_unit_last_stride("sdpa", name, arr)
    check_nonnegative_strides("sdpa", name, arr)


def _check_mask(mask, full: tuple[int, int, int, int]) -> None:
    if np.dtype(mask.dtype) not in _MASK_KIND:
        raise TypeError(f"sdpa: attn_mask must be bool, float32, float16 or bfloat16, got {mask.dtype}")
    if mask.ndim > 4:
        raise ValueError(f"sdpa: attn_mask must have rank <= 4, got shape {tuple(mask.shape)}")
    for got, want in zip(reversed(mask.shape), reversed(full)):
        if got not in (1, want):
            raise ValueError(
                f"sdpa: attn_mask of shape {tuple(mask.shape)} does not broadcast to [B, Hq, Sq, Skv] = {full}"
            )
    check_nonnegative_strides("sdpa", "attn_mask", mask)


@dataclass(frozen=True)
class _Checked:
    left: int
    right: int
    scale: float
    softcap: float
    diag_offset: int
    with_lse: bool  # LSE is written (return_lse, or out_lse given)
    return_lse: bool


def check_gqa_heads(op: str, hq: int, hkv: int, kv_names: str) -> None:
    if hkv == 0 or hq % hkv:
        raise ValueError(f"{op}: Hq must be a multiple of Hkv, got Hq={hq} (q) and Hkv={hkv} ({kv_names})")


def check_head_dims(op: str, dqk: int, dv: int) -> None:
    """The tile kernels' head dims: 1.._MAX_HEAD_DIM (zero-padded to a variant's)."""
    for name, dim in (("Dqk", dqk), ("Dv", dv)):
        if not 1 <= dim <= _MAX_HEAD_DIM:
            raise ValueError(f"{op}: head dim {name} must be in 1..{_MAX_HEAD_DIM}, got {dim}")


def _validate(a: dict, causal, causal_align, window, scale, softcap, return_lse, on_host: bool = False) -> _Checked:
    op = "sdpa"
    q, k, v = a["q"], a["k"], a["v"]
    _check_tensor("q", q, "[B, Hq, Sq, Dqk]")
    _check_tensor("k", k, "[B, Hkv, Skv, Dqk]")
    _check_tensor("v", v, "[B, Hkv, Skv, Dv]")
    batch, hq, sq, dqk = q.shape
    _, hkv, skv, _ = k.shape
    dv = v.shape[3]
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(f"sdpa: q, k and v must share a dtype, got q {q.dtype}, k {k.dtype}, v {v.dtype}")
    if k.shape[0] != batch or k.shape[3] != dqk:
        raise ValueError(f"sdpa: k must be [B={batch}, Hkv, Skv, Dqk={dqk}], got {tuple(k.shape)}")
    if tuple(v.shape[:3]) != tuple(k.shape[:3]):
        raise ValueError(f"sdpa: v must be [B, Hkv, Skv, Dv] = [{batch}, {hkv}, {skv}, Dv], got {tuple(v.shape)}")
    check_gqa_heads(op, hq, hkv, "k, v")
    check_head_dims(op, dqk, dv)
    if batch > MAX_GRID_YZ or hq > MAX_GRID_YZ:
        raise ValueError(f"sdpa: B and Hq must each be <= {MAX_GRID_YZ}, got B={batch}, Hq={hq}")
    if max(sq, skv) >= 2**31 - UNBOUNDED_WINDOW:
        raise ValueError(f"sdpa: Sq and Skv must be < {2**31 - UNBOUNDED_WINDOW}, got Sq={sq}, Skv={skv}")
    causal = check_flag(op, "causal", causal)
    if causal_align not in ("top_left", "bottom_right"):
        raise ValueError(f"sdpa: causal_align must be 'top_left' or 'bottom_right', got {causal_align!r}")
    return_lse = check_flag(op, "return_lse", return_lse)
    left, right = parse_window(op, window, causal)
    if a["attn_mask"] is not None:
        _check_mask(a["attn_mask"], (batch, hq, sq, skv))
    check_sinks(op, a["sinks"], hq)
    check_output(op, "out", a["out"], (batch, hq, sq, dv), q.dtype)
    check_output(op, "out_lse", a["out_lse"], (batch, hq, sq), np.float32)
    return _Checked(left, right, parse_scale(op, scale, dqk), parse_softcap(op, softcap),
                    skv - sq if causal_align == "bottom_right" else 0, return_lse or a["out_lse"] is not None,
                    return_lse)


# ---- planning ----------------------------------------------------------------------
def _pick_variant(dqk: int, dv: int) -> SdpaVariant:
    """The smallest head-dim variant that holds Dqk and Dv (zero-padded)."""
    return next(v for v in sdpa_tiles().values() if dqk <= v.dim_qk and dv <= v.dim_v)


def _pick_sm90_tile(dqk: int, dv: int, general: bool):
    """The smallest sm_90a wgmma tile of `general`'s kind that holds Dqk and Dv (zero-padded),
    or None."""
    return next((t for (_, _, g), t in sm90_tiles().items() if g == general and t.holds(dqk, dv)), None)


def _pick_sm90_ws_tile(dqk: int, dv: int, general: bool):
    """The smallest warp-specialized sm_90a tile of `general`'s kind that holds Dqk and Dv
    (zero-padded), or None."""
    return next((t for (_, g), t in sm90_ws_tiles().items() if g == general and t.holds(dqk, dv)), None)


@dataclass(frozen=True)
class KernelPlan:
    """The sdpa kernel for one call shape: its name, query rows a block, threads, shared bytes,
    and the parameters' vector_io (16-byte copies safe for it)."""
    kernel: str
    rows: int
    threads: int
    shared: int
    vector_io: bool
    ws_tile: Sm90Tile | None = None  # the warp-specialized kernel's tile (its TMA boxes), else None


SM90_WS_ENV = "PTXATTN_SM90_WS"
SM90_PINGPONG_ENV = "PTXATTN_SM90_PINGPONG"
SM90_TMA_ENV = "PTXATTN_SM90_TMA"
SM90_PERSISTENT_ENV = "PTXATTN_SM90_PERSISTENT"
# Head dims whose warp-specialized calls take the ping-pong twins unless PTXATTN_SM90_PINGPONG
# says otherwise: D64 gained 18 % on the H200 (cu/flash_fwd_notes.md v5, v6), D128 16-21 % once
# the producer's full-tile copies stopped taking the consumers' issue slots (v13), Dqk 192 / Dv 128
# causal 7 % and D256 causal 3 % (v16; D256 non-causal even).
SM90_PINGPONG_DEFAULT_DIMS = frozenset({64, 128, 192, 256})


def _switch_setting(variable: str) -> bool | None:
    """An on/off environment variable: True for "1", False for "0", None when unset or empty;
    any other value is an error naming the variable."""
    value = os.environ.get(variable, "")
    if value not in ("", "0", "1"):
        raise ValueError(f"{variable}: expected 0, 1 or unset, got {value!r}")
    return None if value == "" else value == "1"


@functools.cache
def sm90_ws_enabled() -> bool:
    """Plain sm_90a calls run the warp-specialized kernels (cu/flash_fwd_sm90_ws.cuh) unless
    PTXATTN_SM90_WS=0 (read once a process) picks the plain wgmma kernels they replaced, which
    give the same bits (for comparison: scripts/bench.py --suite prefill --sm90-plain)."""
    return _switch_setting(SM90_WS_ENV) is not False


@functools.cache
def sm90_tma_enabled() -> bool:
    """Warp-specialized calls load q, k and v by TMA where tma_maps allows unless
    PTXATTN_SM90_TMA=0 (read once a process) keeps the producer's cp.async copies, which give
    the same bits (for comparison: scripts/bench.py --suite prefill --sm90-cp-async)."""
    return _switch_setting(SM90_TMA_ENV) is not False


@functools.cache
def sm90_persistent_setting() -> bool | None:
    """Which dense calls run the persistent twin of their ping-pong kernel (persistent_twin): None
    (PTXATTN_SM90_PERSISTENT unset) where it pays, True (=1) every call it can serve, False (=0)
    none, a CTA a block, which gives the same bits (read once a process; for comparison:
    scripts/bench.py --suite prefill --sm90-no-persistent)."""
    return _switch_setting(SM90_PERSISTENT_ENV)


@functools.cache
def sm90_pingpong_dims() -> frozenset[int]:
    """The head dims whose warp-specialized calls run the ping-pong twins (the _ws_pp kernels:
    the two consumer warpgroups take turns on the tensor cores, same bits):
    SM90_PINGPONG_DEFAULT_DIMS, or every dim that has them under PTXATTN_SM90_PINGPONG=1, or none
    under =0 (read once a process; for comparison: scripts/bench.py --suite prefill
    --sm90-pingpong / --sm90-ws). PTXATTN_SM90_WS=0 turns both off."""
    setting = _switch_setting(SM90_PINGPONG_ENV)
    if setting is None:
        return SM90_PINGPONG_DEFAULT_DIMS
    return frozenset(dim for dim, _ in sm90_ws_pp_tiles()) if setting else frozenset()


def plan_kernel(dtype, dqk, dv, general, wgmma, paged: bool = False, fp8: bool = False,
                ws: bool | None = None, pingpong: bool | None = None, vector_io: bool = True) -> KernelPlan:
    """The kernel for q's dtype and head dims; `general` picks the per-element score path
    (mask, softcap or scale <= 0); `wgmma` says the device runs the sm_90a kernels; `paged`:
    K and V come through a block table; `fp8`: K and V are fp8 (validated: Dqk = Dv, a dim of
    sdpa_fp8_variants; the general kernels run it); `ws`: a plain strided call on the wgmma path
    takes the warp-specialized kernel where one exists (None: unless PTXATTN_SM90_WS=0);
    `pingpong`: that kernel's ping-pong twin (None: for the dims of sm90_pingpong_dims());
    `vector_io`: the tensors allow 16-byte copies (vector_io_ok).
    The wgmma kernels copy and zero-pad in 16-byte chunks where the tensors are aligned and
    both dims are multiples of 8; otherwise the plain strided ones copy element by element
    (the plan's vector_io is then False), and paged and fp8 calls keep mma.sync."""
    if fp8:
        name = _DTYPE_NAME[dtype]
        if wgmma and vector_io and dqk in sm90_fp8_tiles():
            sm90 = sm90_fp8_tiles()[dqk]
            return KernelPlan(sm90.kernel(name), sm90.rows, sm90.threads, sm90.shared_bytes, vector_io)
        variant = sdpa_fp8_variants()[dqk]
        tile = variant.tile
        return KernelPlan(variant.kernel(name), tile.rows, tile.threads, tile.shared_bytes, vector_io)
    if dtype == np.float32:
        k_pitch = dqk | 1
        return KernelPlan("flash_fwd_f32", _F32_WARPS, 32 * _F32_WARPS, 4 * (32 * k_pitch + 32 * dv + _F32_WARPS * dqk),
                          False)
    chunked = vector_io and dqk % 8 == 0 and dv % 8 == 0
    ws_tile = _pick_sm90_ws_tile(dqk, dv, general) if wgmma and chunked and not paged else None
    if ws_tile is not None and (sm90_ws_enabled() if ws is None else ws):
        pp = ws_tile.dim in sm90_pingpong_dims() if pingpong is None else pingpong
        return ws_plan(sm90_ws_pp_tiles().get((ws_tile.dim, general), ws_tile) if pp else ws_tile, dtype)
    tile = _pick_sm90_tile(dqk, dv, general) if wgmma and (chunked or not paged) else None
    if tile is not None:
        return KernelPlan(tile.kernel(_DTYPE_NAME[dtype], paged), tile.rows, tile.threads, tile.shared_bytes, chunked)
    variant = _pick_variant(dqk, dv)
    tile = variant.general if general else variant.plain
    return KernelPlan(variant.kernel(_DTYPE_NAME[dtype], general), tile.rows, tile.threads, tile.shared_bytes,
                      vector_io)


def ws_plan(tile: Sm90Tile, dtype) -> KernelPlan:
    """The plan of a warp-specialized tile's kernel for q's dtype."""
    return KernelPlan(tile.kernel(_DTYPE_NAME[np.dtype(dtype)]), tile.rows, tile.threads, tile.shared_bytes, True, tile)


@functools.lru_cache(maxsize=None)
def runs_wgmma(device) -> bool:
    """The device loads the sm_90a (wgmma) PTX of cu/flash_fwd_sm90.cu."""
    return loaded_arch(device, "flash_fwd_sm90") is not None


def vector_io_ok(arrays) -> bool:
    """16-byte cp.async/stores are safe: bases aligned and every row start on 8 elements
    (an output the call makes itself is contiguous and 256-byte aligned: None here)."""
    for arr in arrays:
        if arr is None:
            continue
        if arr.ptr % 16:
            return False
        for n, stride in zip(arr.shape[:-1], arr.element_strides[:-1]):
            if n > 1 and stride % 8:
                return False
    return True


def _mask_strides(mask: DeviceArray) -> tuple[int, int, int, int]:
    """Element strides of the mask broadcast to [B, Hq, Sq, Skv] (0 on broadcast axes)."""
    pad = 4 - mask.ndim
    strides = [0] * pad + [s if n != 1 else 0 for n, s in zip(mask.shape, mask.element_strides)]
    return tuple(strides)


def contiguous(shape) -> tuple[int, ...]:
    strides, step = [], 1
    for n in reversed(shape):
        strides.append(step)
        step *= max(int(n), 1)
    return tuple(reversed(strides))


def _bind(binding, a: dict, c: _Checked, *_options) -> None:
    q, k, v, out, mask = a["q"], a["k"], a["v"], a["out"], a["attn_mask"]
    batch, hq, sq, dqk = q.shape
    _, hkv, skv, _ = k.shape
    dv = v.shape[3]
    dtype = np.dtype(q.dtype)
    binding.make("out", (batch, hq, sq, dv), dtype)
    if c.with_lse:
        binding.make("out_lse", (batch, hq, sq), np.float32)
    binding.result(*(("out", "out_lse") if c.return_lse else ("out",)), as_tuple=c.return_lse)
    if batch * hq * sq * dv == 0:
        return
    vector_io = dtype != np.float32 and vector_io_ok((q, k, v, out))
    general = mask is not None or c.softcap > 0 or c.scale <= 0
    plan = plan_kernel(dtype, dqk, dv, general, runs_wgmma(binding.device), vector_io=vector_io)
    o_strides = out.element_strides if out is not None else contiguous((batch, hq, sq, dv))
    lse_strides = a["out_lse"].element_strides if a["out_lse"] is not None else contiguous((batch, hq, sq))
    mask_kind, mask_strides = (0, (0, 0, 0, 0)) if mask is None else (_MASK_KIND[np.dtype(mask.dtype)],
                                                                      _mask_strides(mask))
    params = flash_params(q.element_strides[:3], k.element_strides[:3], v.element_strides[:3], o_strides[:3],
                          lse_strides, c.left, c.right, c.scale, c.softcap, plan.vector_io, heads=(hq, hkv),
                          dims=(dqk, dv), seq_q=sq, seq_kv=skv, mask_kind=mask_kind, mask_strides=mask_strides,
                          diag_offset=c.diag_offset)
    maps = tma_maps(plan.ws_tile, q, k, v)
    twin = staged_mask_twin(plan.ws_tile) if maps is not None and mask is not None else None
    mask_map = staged_mask_map(twin, mask, mask_strides, (batch, hq, sq, skv))
    if mask_map is not None:
        plan = ws_plan(twin, dtype)
    blocks = -(-sq // plan.rows)
    heavy = (heavy_first_grid(binding.device, blocks, batch, (hq, hkv), skv, (dqk, dv), dtype.itemsize)
             if params.heavy_first else None)
    params.heavy_first = int(heavy is not None)  # else light blocks first, same bits
    grid = heavy or (blocks, hq, batch)
    # No heavy-first grid: no bounded right edge, so the blocks are alike in work and the twin pays
    # at any count of them (or past MAX_GRID_YZ blocks a head); else only on heads of fewer than
    # MIN_RUN_BLOCKS (cu/flash_fwd_notes.md v50, v52: 1 to 8 blocks gained 10-15 % over a CTA a
    # block; from MIN_RUN_BLOCKS up blocks differ 16-fold and more in work and the twin's fixed
    # deal lost 1-28 % to the hardware's dealing of a block a CTA, v41-v43).
    alike = heavy is None
    pays = alike or blocks < MIN_RUN_BLOCKS
    o_map = out_map(out, (batch, hq, sq, dv), dtype) if maps is not None else None
    persistent = persistent_twin(plan.ws_tile, maps, o_map, grid, pays, binding.device.sm_count)
    if persistent is not None:
        plan = ws_plan(persistent, dtype)
        params.virtual_grid_x, params.virtual_grid_y, params.virtual_grid_z = grid
        for name, divisor in (("virtual_div_x", grid[0]), ("virtual_div_y", grid[1]), ("heads_q_div", hq)):
            mul, shift = fast_divisor(divisor)
            setattr(params, f"{name}_mul", mul)
            setattr(params, f"{name}_shift", shift)
        tiles = key_tiles(plan.rows, persistent.keys, sq, skv, c.left, c.right, c.diag_offset)
        deal = tail_deal(virtual_block_costs(grid, heavy is not None, tiles), binding.device.sm_count)
        if deal is not None:
            params.tail_round = deal.tail_round
            params.tail_blocks[:] = deal.table()
        grid = (binding.device.sm_count, 1, 1)  # a CTA an SM: its shared memory leaves room for no other
    launch = binding.launch(plan.kernel, grid, (plan.threads, 1, 1), params, plan.shared)
    for name, field in (("q", "q"), ("k", "k"), ("v", "v"), ("out", "o"), ("out_lse", "lse"),
                        ("attn_mask", "mask"), ("sinks", "sinks")):
        if a[name] is not None or name == "out" or (name == "out_lse" and c.with_lse):
            binding.point(name, launch, field)
    if maps is not None:
        params.tma = 1
        for name, map_spec in zip(("q", "k", "v"), maps):
            binding.point_map(name, launch, f"{name}_map", map_spec)
    if mask_map is not None:
        binding.point_map("attn_mask", launch, "mask_map", mask_map)
    if persistent is not None:
        binding.point_map("out", launch, "o_map", o_map)


# A heavy-first dense grid's runs hold as many (batch, head) pairs as keep their K / V within
# HEAVY_RUN_L2_SHARE of the L2, where a head has at least MIN_RUN_BLOCKS query blocks; with
# fewer, a head's blocks run side by side on the same K / V tiles, which short sequences need
# (runs of one pair), and which the persistent twin serves by default (_bind).
# cu/flash_fwd_notes.md v38.
HEAVY_RUN_L2_SHARE = 0.5
MIN_RUN_BLOCKS = 16


def heavy_run_pairs(l2_bytes: int, blocks: int, pairs: int, kv_bytes_per_pair: float) -> int:
    """How many of a heavy-first dense grid's `pairs` (batch, head) pairs a run holds: a divisor
    of `pairs`, the largest whose K / V fit HEAVY_RUN_L2_SHARE of `l2_bytes` where a head has
    MIN_RUN_BLOCKS query blocks or more, else 1; or, where that leaves more runs than grid z
    takes, the smallest divisor that does not."""
    small = [n for n in range(1, math.isqrt(pairs) + 1) if pairs % n == 0]
    divisors = sorted(set(small + [pairs // n for n in small]))
    fitting = int(l2_bytes * HEAVY_RUN_L2_SHARE / max(kv_bytes_per_pair, 1)) if blocks >= MIN_RUN_BLOCKS else 1
    run = max(n for n in divisors if n <= max(fitting, 1))
    return run if pairs // run <= MAX_GRID_YZ else min(n for n in divisors if pairs // n <= MAX_GRID_YZ)


def heavy_first_grid(device, blocks: int, batch: int, heads: tuple[int, int], seq_kv: int,
                     dims: tuple[int, int], itemsize: int) -> tuple[int, int, int] | None:
    """The grid of a dense call of `blocks` query blocks a head whose later blocks are heavier
    (causal): (pairs of a run, blocks, runs) over the B x Hq (batch, head) pairs (dense_tile in
    cu/flash_fwd_common.cuh), runs of heavy_run_pairs. Blocks start in launch order, so each
    run's go heaviest first across its pairs and light ones fill the SMs at its end. None past
    grid y's limit (more than MAX_GRID_YZ query blocks a head)."""
    hq, hkv = heads
    if blocks > MAX_GRID_YZ:
        return None
    pairs = batch * hq
    run = heavy_run_pairs(device.l2_bytes, blocks, pairs, seq_kv * sum(dims) * itemsize * hkv / hq)
    return run, blocks, pairs // run


def persistent_twin(tile: Sm90Tile | None, maps, o_map: MapSpec | None, grid: tuple[int, int, int], pays: bool,
                    sm_count: int) -> Sm90Tile | None:
    """The persistent twin (cu/flash_fwd_sm90_ws.cuh, PERSISTENT) to run in place of `tile` on a
    dense call's `grid`, its CTAs one an SM dealing the blocks out among them, each loading its
    next block's Q and first K / V tiles while it finishes the one before (a short block's start
    and end are otherwise its SM's idle time); or None: no twin for the tile, no TMA maps (the
    twin loads q, k and v and stores its output by TMA alone: `maps` and `o_map`), no more
    blocks than SMs, PTXATTN_SM90_PERSISTENT=0, or (unset) a call where the twin does not pay
    (`pays` false: causal heads of MIN_RUN_BLOCKS or more)."""
    setting = sm90_persistent_setting()
    if (tile is None or maps is None or o_map is None or not tile.pingpong or tile.general
            or math.prod(grid) <= sm_count or setting is False or (not pays and setting is None)):
        return None
    return sm90_persistent_tiles().get(tile.dim)


def fast_divisor(d: int) -> tuple[int, int]:
    """(mul, shift) for fast_div (cu/flash_fwd_common.cuh) to divide by d > 0: (n * mul) >> shift ==
    n // d for every 0 <= n < 2**31, with shift = 31 + ceil(log2 d) and mul = ceil(2**shift / d)
    < 2**32 (the rounding up adds less than n / 2**shift < 1 / d to n / d)."""
    shift = 31 + (d - 1).bit_length()
    return -(-(1 << shift) // d), shift


def tma_maps(tile: Sm90Tile | None, q, k, v) -> tuple[MapSpec, MapSpec, MapSpec] | None:
    """The tensor maps a warp-specialized kernel loads q, k and v through (FlashFwdParams.tma),
    or None where it copies them by cp.async: another kernel, head dims smaller than the
    tile's (zero-padded columns), an array TMA cannot address (tensor_map.spec), or
    PTXATTN_SM90_TMA=0."""
    if tile is None or q.shape[3] != tile.dim or v.shape[3] != tile.dim_v or not sm90_tma_enabled():
        return None
    maps = (tensor_map.spec(q, tile.rows), tensor_map.spec(k, tile.keys), tensor_map.spec(v, tile.keys))
    return None if None in maps else maps


# Rows of a persistent twin's output box: a consumer warpgroup's (cu/flash_fwd_sm90_ws.cuh).
OUT_BOX_ROWS = 64


def out_map(out, shape: tuple[int, int, int, int], dtype) -> MapSpec | None:
    """The map a persistent twin stores its output through (FlashFwdParams.o_map), in boxes of a
    consumer warpgroup's 64 rows: of `out`, or of the contiguous [B, H, S, Dv] output the call
    makes (256-byte aligned), or None where TMA cannot store to `out` (tensor_map.layout_spec)."""
    if out is not None:
        return tensor_map.spec(out, OUT_BOX_ROWS)
    return tensor_map.layout_spec(dtype, 256, shape, contiguous(shape), OUT_BOX_ROWS)


def staged_mask_twin(tile: Sm90Tile | None) -> Sm90Tile | None:
    """The twin of a general warp-specialized tile that stages masks in shared memory by TMA
    (cu/flash_fwd_sm90_ws.cuh, STAGED_MASK), or None where it has none."""
    if tile is None or not tile.general:
        return None
    return sm90_staged_mask_tiles().get((tile.dim, tile.pingpong))


def staged_mask_map(twin: Sm90Tile | None, mask, strides: tuple[int, int, int, int],
                    full: tuple[int, int, int, int]) -> MapSpec | None:
    """The tensor map through which the staged-mask twin `twin` would load `mask` (FlashFwdParams
    .mask_map), or None where the general kernel reads the mask from global memory instead: no
    twin (no mask, or no q / k / v maps, on whose K copies the mask's ride: the caller passes
    None), a float32 mask, a bool one where a key tile is not 128 bytes of it, one that
    broadcasts its key axis, or one TMA cannot address (tensor_map.layout_spec). `strides` are
    the mask's element strides over `full`, [B, Hq, Sq, Skv] (_mask_strides: 0 on a broadcast
    axis); a broadcast batch, head or query axis has length 1 in the map (the kernel reads its
    index 0; a query-broadcast mask's box is its one row)."""
    if twin is None:
        return None
    if strides[3] != 1 or (np.dtype(mask.dtype) == np.bool_ and twin.keys % 128):
        return None
    shape = tuple(n if stride else 1 for n, stride in zip(full, strides))
    return tensor_map.layout_spec(mask.dtype, mask.ptr, shape, strides, twin.rows if strides[2] else 1)


# The parameter struct's bytes up to its TMA fields, native alignment (as ctypes lays it out).
_PARAMS_LAYOUT = struct.Struct("@" + "".join(ctype._type_ for _, ctype in _PACKED_FIELDS))
_POINTERS = sum(ctype is ctypes.c_void_p for _, ctype in _PACKED_FIELDS)


class Serving(NamedTuple):
    """The serving-batch fields of FlashFwdParams (ops/ragged.py), in the struct's order; all 0
    for a dense call."""
    num_seqs: int = 0
    tokens_q: int = 0
    tokens_k: int = 0
    kv_capacity: int = 0
    num_pages: int = 0
    page_size_log2: int = 0
    min_queries: int = 0


class KvFp8(NamedTuple):
    """The fp8 K/V fields of FlashFwdParams (the _fp8 kernels): the type (Fp8Kind in cu/fp8.cuh),
    each per-token scale array's element strides (batch or page, head, token), zeros for a
    per-tensor scale, and the per-tensor scales."""
    kind: int = 0
    k_scale_strides: tuple[int, int, int] = (0, 0, 0)
    v_scale_strides: tuple[int, int, int] = (0, 0, 0)
    k_scale: float = 1.0
    v_scale: float = 1.0


def flash_params(q_strides, k_strides, v_strides, o_strides, lse_strides, left: int, right: int, scale: float,
                 softcap: float, vector_io: bool, *, heads, dims, seq_q=0, seq_kv=0, mask_kind=0,
                 mask_strides=(0, 0, 0, 0), diag_offset=0, block_table_stride=0,
                 serving: Serving = Serving(), fp8: KvFp8 = KvFp8()) -> _FlashFwdParams:
    """The bound parameter struct (every pointer 0: each run writes them). Element strides are
    (batch, head, token) triples."""
    params = _FlashFwdParams()
    _PARAMS_LAYOUT.pack_into(
        params, 0, *(0,) * _POINTERS,
        *q_strides, *k_strides, *v_strides, *o_strides, *mask_strides, *lse_strides, block_table_stride,
        *fp8.k_scale_strides, *fp8.v_scale_strides,
        *heads, seq_q, seq_kv, *dims, mask_kind, diag_offset, left, right, scale, softcap, int(vector_io),
        # A bounded right edge means later query blocks see more keys: start them first.
        int(right < UNBOUNDED_WINDOW), *serving, fp8.kind, fp8.k_scale, fp8.v_scale,
    )
    return params

_SDPA = Op("sdpa", ("q", "k", "v", "attn_mask", "sinks", "out", "out_lse"),
           ("causal", "causal_align", "window", "scale", "softcap", "return_lse"),
           outputs=("out", "out_lse"), validate=_validate, bind=_bind)


def sdpa(q, k, v, *, attn_mask=None, causal=False, causal_align="top_left", window=None,
         scale=None, softcap=0.0, sinks=None, return_lse=False, out=None, out_lse=None, stream=None):
    """Scaled dot-product attention.

    q [B, Hq, Sq, Dqk], k [B, Hkv, Skv, Dqk], v [B, Hkv, Skv, Dv] (f16, bf16 or f32; any
    strides with a unit last axis) -> o [B, Hq, Sq, Dv] in q's dtype, and with
    return_lse=True also lse [B, Hq, Sq] float32 (natural log; -inf for a row that sees no
    key). NumPy in -> NumPy out (synchronous); device arrays in -> DeviceArrays out,
    asynchronous on `stream`.

    attn_mask: bool (True = attend) or additive float32/float16/bfloat16, any rank <= 4
    broadcastable to [B, Hq, Sq, Skv]. causal with causal_align "top_left" (PyTorch) or
    "bottom_right" (FlashAttention); window=(left, right) keys around the aligned diagonal
    (-1 or None = unbounded). scale defaults to 1/sqrt(Dqk); softcap applies cap*tanh(s/cap)
    to scaled scores (0 = off; with f16/bf16 inputs tanh is the GPU's tanh.approx, relative
    error about 2^-11, float32 inputs take an accurate form); sinks float32 [Hq] join the
    softmax denominator only.
    out / out_lse: preallocated outputs (out_lse is written whenever given).
    """
    return _SDPA((q, k, v, attn_mask, sinks, out, out_lse), (causal, causal_align, window, scale, softcap,
                                                              return_lse), stream)


sdpa.op = _SDPA
