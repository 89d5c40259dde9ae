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

from ..array import DeviceArray, from_dlpack
from ..context import default_device, on_device
from ..driver import call, cu
from ..faults import check_faults, fault_buffer
from ..memory import ALIGNMENT, WorkspaceLayout, arena_for
from ..module import ParamStruct, get_kernel
from ._io import OpCall, gather
from .kv_cache import (ATTENTION_DTYPES, CacheShape, cache_shape, cache_strides, check_attention_dtype,
                       check_index_array, check_rank, check_row_bytes, check_same_dtype, parse_layout)
from .merge import check_sinks, launch_merge, sinks_on_device

__all__ = ["decode", "decode_workspace_bytes", "plan_decode", "DecodePlan"]

KEYS_PER_BLOCK = 16      # kBlockKeys in cu/decode.cu: keys a warp group takes per step
THREADS = 128            # kThreads
WARPS = THREADS // 32
SPLIT_ALIGN = KEYS_PER_BLOCK * WARPS  # keys_per_split is a multiple: full splits give every group as many blocks
D_TILES = (64, 128, 256)  # the decode_split_<dt>_d<D> variants (float32 stops at 128)
MAX_SQ = 16
MAX_GRID_Y = 65535        # the batch rows are the grid's y axis
MIN_KEYS_PER_SPLIT = 256  # below this a split's fixed costs outweigh its keys
MAX_STAGES = 4            # cu/decode.cu waits on at most 3 groups in flight
MERGE_ROW_PAD = 8         # kPartStride - D_TILE: floats of padding per row of the end-of-CTA merge
SHARED_RESERVED_PER_CTA = 1024  # the driver's per-block reservation (sm_80+): an SM holds opt-in max + this
# Measured on the H200 (bf16, Hq32 Hkv8 D128, Sq 1, graph-replayed step, bench.py --suite decode):
#   v1  CTAS_PER_SM 16, warp-per-row combine          B64 T8192 1.97 TB/s, B1 T32768 0.58 TB/s
#   v2  CTAS_PER_SM 4, CTA-per-row combine, carveout  2.35 / 1.45
#   v3  lean K/V loader, O rescaled only when a max moves, two QK chains: 3.03 / 1.85
# ncu on v2: 2 CTAs/SM (shared memory bound), DRAM 51 %, 4.4 cycles per issued instruction:
# issue bound rather than bandwidth bound. Static SASS of v3's bf16 d128 loop: ~1700 instructions per
# warp per 64-key tile (~860 in the loader: per-row page and 64-bit address math, an integer
# modulo per tile), every warp waiting at a CTA barrier per tile.
#   v4  per-group rings of 16-key blocks (no CTA barrier while streaming), one page lookup per
#       lane per block, pointer-increment loader, lane-constant ldmatrix addresses, padding
#       zeroed once instead of per-d guards, mask only on edge blocks, early exit of empty
#       splits (static SASS: ~275 instructions per warp per 16-key block; 3 stages, 2 CTAs/SM):
#       B64 T8192 4.15 TB/s (0.98 x copy), B128 T2048 3.35 (paged 3.75), B1 T32768 2.01,
#       B8 T8192 lengths U[1, 8192] 2.42. Open: B128's contiguous cache is slower than the same
#       keys in shuffled pages (address pattern of 264 streams 512 KB apart?), and B1 spends
#       about half its time outside streaming (CTA start-up, two waves, the 64-state combine).
#   v5  one split writes o and lse itself (no combine); the grid is one wave (as many splits as
#       keep every CTA resident, instead of ~two waves): B64 T8192 4.36 TB/s (1.02 x copy),
#       B128 T2048 4.08 (0.95), B1 T32768 2.85, B8 T8192 3.52, B8 lengths U[1, 8192] 2.88
#       (time 0.83 x B8 full's at 0.67 of its keys). scripts/decode_sweep.py (CTAs an SM x ring depth;
#       split / combine kernel us from CUPTI): B1 one CTA an SM 3.01 TB/s (16 splits, split
#       39.2 + combine 3.1), two (default) 2.90 (32 splits, 40.2 + 3.7), four 2.40 (64, 47.3 +
#       6.2); but B8 lengths U[1, 8192] the other way round: 1.50 / 2.00 / 2.29 TB/s, since a long
#       row's few long splits then set the time. A programmatic dependent launch of the combine
#       (sm_90) measured no gain (B1: 44.7 vs 44.4 us split start to combine end) and was dropped.
#       Nor did combining inside thread-block clusters (the splits of a row block as one cluster,
#       results exchanged through distributed shared memory, no combine kernel): B1 with 16
#       splits 50.0 us a step against 44.6 with the combine kernel, B8 4 splits 102 vs 76 us
#       (a cluster holds its SMs until its slowest CTA ends, and clusters place less freely).
#   v6  per-CTA %globaltimer stamps (a scratch build) showed the end-of-CTA merge taking 4-6 us
#       after the last warp's keys had landed: one element per thread per step, each recomputing
#       its row's weights and index divisions. One warp a row, 4 elements a lane, weights once a
#       row: B64 T8192 4.54 TB/s (1.07 x copy), B128 T2048 4.35, B1 T32768 3.22, B8 T8192 3.80,
#       B8 lengths U[1, 8192] 3.19 (time 0.80 x B8 full's at 0.67 of its keys).
#   v7  grids of more than one wave (finer splits; the CTAs start split by split, so a later
#       wave holds only long rows' splits) did not help rows of unequal length consistently.
#       decode_sweep --waves 1 2 3 4, step us (B8 T8192; lengths U[1, 8192], three seeds):
#         full 72.0 / 74.3 / 76.8 / 78.5     0.674 live 57.9 / 61.8 / 56.3 / 58.0
#         0.503 live 46.5 / 47.1 / 47.1 / 47.7     0.472 live 46.3 / 42.2 / 46.2 / 45.0
#       (B16 at 0.640 live: 100.0 / 102.6 / 93.6 / 96.8; B1 T32768: 41.9 / 46.5 / 50.3 / 53.8).
#       One wave stays. Time tracks live keys with an offset: about 0.27 + 0.79 x live of the
#       full step at B8, the offset being the step's fixed cost plus the long rows' last CTAs.
#       Per-CTA stamps at B8 lengths U[1, 8192] (0.674 live): the step ends with the SMs that
#       host two full 2048-key splits (52 us; a full split alone on its SM ends at 41 us, every
#       SM in the full step at ~64 us): an SM's two CTAs keep only 128 KB in flight.
#   v8  L2 prefetch (prefetch.global.L2, one warp a block, 1 to 8 of a group's blocks past the
#       ring) to deepen the reads in flight without shared memory: slower everywhere, e.g. one
#       block ahead B1 41.6 -> 45.8 us, B8 71.3 -> 82.1, B8 0.674 live 57.3 -> 65.3, B64 T8192
#       476 -> 550. Not kept.
class DecodeParams(ParamStruct):
    """Mirror of DecodeParams in cu/decode.cu (same fields, same order)."""

    _fields_ = [
        ("q", ctypes.c_void_p), ("k", ctypes.c_void_p), ("v", ctypes.c_void_p),
        ("seq_lens", ctypes.c_void_p), ("block_table", ctypes.c_void_p),
        ("o_part", ctypes.c_void_p), ("lse_part", ctypes.c_void_p),
        ("o_out", ctypes.c_void_p), ("lse_out", ctypes.c_void_p), ("sinks", ctypes.c_void_p),
        ("fault", ctypes.c_void_p),
        ("q_stride_b", ctypes.c_int64), ("q_stride_h", ctypes.c_int64), ("q_stride_s", ctypes.c_int64),
        ("k_stride_page", ctypes.c_int64), ("k_stride_head", ctypes.c_int64), ("k_stride_tok", ctypes.c_int64),
        ("v_stride_page", ctypes.c_int64), ("v_stride_head", ctypes.c_int64), ("v_stride_tok", ctypes.c_int64),
        ("block_table_stride", ctypes.c_int64),
        ("o_out_stride_b", ctypes.c_int64), ("o_out_stride_h", ctypes.c_int64), ("o_out_stride_s", ctypes.c_int64),
        ("lse_out_stride_b", ctypes.c_int64), ("lse_out_stride_h", ctypes.c_int64),
        ("lse_out_stride_s", ctypes.c_int64),
        ("hq", ctypes.c_int32), ("hkv", ctypes.c_int32), ("sq", ctypes.c_int32),
        ("dqk", ctypes.c_int32), ("dv", ctypes.c_int32), ("capacity", ctypes.c_int32),
        ("num_pages", ctypes.c_int32), ("page_size_log2", ctypes.c_int32),
        ("num_splits", ctypes.c_int32), ("keys_per_split", ctypes.c_int32),
        ("warps_m", ctypes.c_int32), ("stages", ctypes.c_int32), ("window_left", ctypes.c_int32),
        ("scale", ctypes.c_float), ("softcap", ctypes.c_float),
    ]


UNBOUNDED_WINDOW = 1 << 30  # kUnboundedWindow in cu/attention_common.cuh


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


def d_tile_for(dtype, dqk: int, dv: int) -> int | None:
    tiles = D_TILES if np.dtype(dtype).itemsize == 2 else D_TILES[:2]
    return next((d for d in tiles if d >= max(dqk, dv)), None)


def shared_bytes(d_tile: int, itemsize: int, warps_m: int, stages: int) -> int:
    """The query tile, each warp group's K/V ring, or (reusing it) the end-of-CTA merge."""
    groups = WARPS // warps_m
    ring = (16 * warps_m + groups * stages * 2 * KEYS_PER_BLOCK) * d_tile * itemsize
    merge = (2 + d_tile + MERGE_ROW_PAD) * 16 * WARPS * 4
    return max(ring, merge)


def ring_depth(d_tile: int, itemsize: int, warps_m: int, max_shared: int) -> int:
    """The deepest ring that still lets two CTAs share an SM (eight warps streaming); failing
    that the deepest one CTA can hold; 2 when none fits (plan_decode reports it)."""
    per_sm = max_shared + SHARED_RESERVED_PER_CTA
    need = {s: shared_bytes(d_tile, itemsize, warps_m, s) for s in range(MAX_STAGES, 1, -1)}
    fits = [s for s, n in need.items() if n <= max_shared]
    two_per_sm = [s for s in fits if 2 * (need[s] + SHARED_RESERVED_PER_CTA) <= per_sm]
    return (two_per_sm or fits or [2])[0]


def plan_decode(*, batch: int, hq: int, hkv: int, sq: int, dqk: int, dv: int, capacity: int, dtype,
                sm_count: int, max_shared: int, stages: int | None = None,
                ctas_per_sm: int | None = None, waves: int = 1) -> DecodePlan:
    """Grid, split geometry, shared memory and workspace of one decode launch (validated
    shapes). Depends on no live length. The grid is one wave: as many splits as let every
    (batch row, kv head, row block) have its CTAs resident at once, each split at least
    MIN_KEYS_PER_SPLIT keys. `stages` overrides the ring depth, `ctas_per_sm` the CTAs an SM is
    taken to hold and `waves` the grid target (benchmarks)."""
    dtype = np.dtype(dtype)
    d_tile = d_tile_for(dtype, dqk, dv)
    rows = hq // hkv * sq  # query rows sharing one kv head
    warps_m = 1 if rows <= 16 else 2 if rows <= 32 else 4
    row_blocks = _ceil_div(rows, 16 * warps_m)
    if stages is None:
        stages = ring_depth(d_tile, dtype.itemsize, warps_m, max_shared)
    smem = shared_bytes(d_tile, dtype.itemsize, warps_m, stages)
    if smem > max_shared:
        raise ValueError(f"decode: head dim {max(dqk, dv)} in {dtype} needs {smem} bytes of shared memory per "
                         f"block, the device allows {max_shared}")
    if ctas_per_sm is None:
        ctas_per_sm = (max_shared + SHARED_RESERVED_PER_CTA) // (smem + SHARED_RESERVED_PER_CTA)
    ctas_per_split = batch * hkv * row_blocks
    splits = max(1, min(waves * ctas_per_sm * sm_count // ctas_per_split, _ceil_div(capacity, MIN_KEYS_PER_SPLIT)))
    keys_per_split = _ceil_div(_ceil_div(capacity, splits), SPLIT_ALIGN) * SPLIT_ALIGN
    splits = _ceil_div(capacity, keys_per_split)
    partials = batch * hq * sq * splits
    # One split writes the final o and lse itself: no partials to hold.
    workspace = WorkspaceLayout(o_part=partials * dv * 4, lse_part=partials * 4) if splits > 1 else WorkspaceLayout()
    return DecodePlan(
        kernel=f"decode_split_{ATTENTION_DTYPES[dtype]}_d{d_tile}",
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
class DecodeOptions:
    scale: float
    softcap: float
    window_left: int


def check_options(op: str, q, *, scale, softcap, window) -> DecodeOptions:
    dqk = q.shape[3]
    if scale is None:
        scale = 1.0 / math.sqrt(dqk)
    if isinstance(scale, bool) or not isinstance(scale, (int, float, np.floating, np.integer)) or not math.isfinite(scale):
        raise ValueError(f"{op}: scale must be a finite number or None, got {scale!r}")
    if isinstance(softcap, bool) or not isinstance(softcap, (int, float, np.floating, np.integer)) \
            or not math.isfinite(softcap) or softcap < 0:
        raise ValueError(f"{op}: softcap must be a finite number >= 0 (0 = off), got {softcap!r}")
    left = UNBOUNDED_WINDOW
    if window is not None:
        ok = isinstance(window, (tuple, list)) and len(window) == 2 and all(
            w is None or (isinstance(w, (int, np.integer)) and not isinstance(w, bool) and w >= -1) for w in window)
        if not ok:
            raise ValueError(f"{op}: window must be None or (left, right) with ints >= -1 (-1 or None = "
                             f"unbounded), got {window!r}")
        if window[0] is not None and 0 <= window[0] < UNBOUNDED_WINDOW:
            left = int(window[0])
    return DecodeOptions(float(scale), float(softcap), left)


def check_query(op: str, q, k: CacheShape, v: CacheShape) -> None:
    """q [B, Hq, Sq, Dqk] against K / V caches of Hkv heads (validated shapes)."""
    check_rank(op, "q", q, 4, "[B, Hq, Sq, Dqk]")
    check_attention_dtype(op, "q", q)
    batch, hq, sq, dqk = (int(n) for n in q.shape)
    if batch > MAX_GRID_Y:
        raise ValueError(f"{op}: q's batch (axis 0) must be <= {MAX_GRID_Y} (a grid axis), got {batch}")
    if not 1 <= sq <= MAX_SQ:
        raise ValueError(f"{op}: q's Sq (axis 2) must be in [1, {MAX_SQ}] (decode steps), got {sq}")
    if k.heads != v.heads:
        raise ValueError(f"{op}: K and V must have one number of kv heads, got {k.heads} and {v.heads}")
    if k.heads == 0 or hq % k.heads:
        raise ValueError(f"{op}: q's Hq ({hq}) must be a multiple of the caches' Hkv ({k.heads})")
    if dqk != k.dim:
        raise ValueError(f"{op}: q's Dqk ({dqk}) must equal the key cache's D ({k.dim})")
    if d_tile_for(q.dtype, dqk, v.dim) is None:
        top = D_TILES[-1] if np.dtype(q.dtype).itemsize == 2 else D_TILES[-2]
        raise ValueError(f"{op}: head dims up to {top} are supported for {q.dtype}, got Dqk={dqk}, Dv={v.dim}")
    check_row_bytes(op, "q", q)


def check_out(op: str, out, out_lse, shape, dtype) -> None:
    """The caller's outputs: out [B, Hq, Sq, Dv] in q's dtype, out_lse [B, Hq, Sq] float32."""
    for name, arr, want_shape, want_dtype in (("out", out, shape, dtype), ("out_lse", out_lse, shape[:3], np.float32)):
        if arr is None:
            continue
        if tuple(arr.shape) != tuple(want_shape) or np.dtype(arr.dtype) != np.dtype(want_dtype):
            raise ValueError(f"{op}: {name} must be {tuple(want_shape)} {np.dtype(want_dtype)}, "
                             f"got {tuple(arr.shape)} {arr.dtype}")
    if isinstance(out, DeviceArray) and out.shape[-1] > 1 and out.strides[-1] != out.itemsize:
        raise ValueError(f"{op}: out must have a contiguous last axis, got strides {out.strides}")


def resolve_workspace(op: str, workspace, need: int):
    """The caller's workspace as a DeviceArray after checking it, or None (use the arena)."""
    if workspace is None:
        return None
    ws = workspace if isinstance(workspace, DeviceArray) else from_dlpack(workspace)
    if ws.nbytes < need or not ws.is_contiguous or ws.ptr % ALIGNMENT:
        raise ValueError(f"{op}: workspace must be a contiguous device array of at least {need:,} bytes starting "
                         f"on a {ALIGNMENT}-byte boundary (see {op}_workspace_bytes), got {ws.nbytes:,} bytes "
                         f"at 0x{ws.ptr:x}")
    return ws


# ---- running ---------------------------------------------------------------------------------
_max_carveout: set[int] = set()  # id() of kernels (cached for the process) already configured


def _prefer_shared_memory(kernel) -> None:
    """Ask for the largest shared-memory carveout, so that as many CTAs as the shared memory
    allows stay resident (the K/V ring is what keeps bytes in flight)."""
    if id(kernel) not in _max_carveout:
        call(cu.cuFuncSetAttribute, kernel.function,
             cu.CUfunction_attribute.CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT, 100)
        _max_carveout.add(id(kernel))


@dataclass(frozen=True)
class KvSource:
    """The caches one decode reads, on the device."""

    k: DeviceArray
    v: DeviceArray
    k_layout: str
    v_layout: str
    seq_lens: DeviceArray
    block_table: DeviceArray | None  # None: contiguous cache, one page per batch row
    heads: int
    capacity: int
    num_pages: int
    page_size: int


def plan_for(call_device, q, k: CacheShape, v: CacheShape, capacity: int, stages: int | None = None) -> DecodePlan:
    batch, hq, sq, dqk = (int(n) for n in q.shape)
    return plan_decode(batch=batch, hq=hq, hkv=k.heads, sq=sq, dqk=dqk, dv=v.dim, capacity=capacity,
                       dtype=q.dtype, sm_count=call_device.sm_count,
                       max_shared=call_device.max_shared_per_block_optin, stages=stages)


def run_decode(op: str, call: OpCall, plan: DecodePlan, src: KvSource, options: DecodeOptions, *, out, out_lse,
               return_lse: bool, workspace: DeviceArray | None):
    """Launch the split kernel and, with more than one split, the combine; return what decode
    returns."""
    q = call.to_device("q")
    batch, hq, sq, dqk = q.shape
    dv = src.v.shape[3]
    o = call.output((batch, hq, sq, dv), q.dtype, out, name="out")
    lse = call.output((batch, hq, sq), np.float32, out_lse, name="out_lse") if (return_lse or out_lse is not None) else None
    sinks = sinks_on_device(call)
    splits = plan.num_splits
    direct = splits == 1  # the split kernel writes o and lse itself
    with on_device(call.device):
        o_part = lse_part = None
        if not direct:
            base = workspace.ptr if workspace is not None else \
                arena_for(call.device, call.stream).reserve(plan.workspace_bytes)
            o_part, lse_part = plan.workspace.address(base, "o_part"), plan.workspace.address(base, "lse_part")
        bt = src.block_table
        params = DecodeParams(
            q.ptr, src.k.ptr, src.v.ptr, src.seq_lens.ptr, bt.ptr if bt is not None else None,
            o_part, lse_part, o.ptr if direct else None, lse.ptr if direct and lse is not None else None,
            sinks if direct else None, fault_buffer(call.device),
            *q.element_strides[:3], *cache_strides(src.k, src.k_layout), *cache_strides(src.v, src.v_layout),
            bt.element_strides[0] if bt is not None else 0,
            *o.element_strides[:3], *(lse.element_strides if lse is not None else (0, 0, 0)),
            hq, src.heads, sq, dqk, dv, src.capacity,
            src.num_pages, src.page_size.bit_length() - 1, plan.num_splits, plan.keys_per_split,
            plan.warps_m, plan.stages, options.window_left, options.scale, options.softcap,
        )
        kernel = get_kernel(plan.kernel, call.device)
        _prefer_shared_memory(kernel)
        kernel.launch(plan.grid, (THREADS, 1, 1), params, call.stream, shared_bytes=plan.shared_bytes)
        if not direct:
            launch_merge(call.device, call.stream, in_dtype=np.float32, out_dtype=q.dtype, o_in=o_part,
                         o_in_strides=(dv, hq * sq * splits * dv, sq * splits * dv, splits * dv), lse_in=lse_part,
                         lse_in_strides=(1, hq * sq * splits, sq * splits, splits), sinks=sinks, o_out=o,
                         lse_out=lse, num_states=splits)
    result = call.finish(o, out)
    lse_result = call.finish(lse, out_lse) if lse is not None else None
    if call.on_host:
        check_faults(call.device, call.stream)
    return (result, lse_result) if return_lse else result


def _validate(op: str, arrays: dict, layout, *, scale, softcap, window):
    k_layout, v_layout = parse_layout(op, layout)
    k = cache_shape(op, "k_cache", arrays["k_cache"], k_layout)
    v = cache_shape(op, "v_cache", arrays["v_cache"], v_layout)
    q = arrays["q"]
    check_query(op, q, k, v)
    batch = q.shape[0]
    for name, shape in (("k_cache", k), ("v_cache", v)):
        if shape.pages != batch:
            raise ValueError(f"{op}: {name} must hold B={batch} rows (q's batch), got {shape.pages}")
        check_same_dtype(op, name, arrays[name], "q", q)
        check_row_bytes(op, name, arrays[name])
    if k.tokens != v.tokens or k.tokens == 0:
        raise ValueError(f"{op}: k_cache and v_cache must have one positive capacity, got {k.tokens} and {v.tokens}")
    options = check_options(op, q, scale=scale, softcap=softcap, window=window)
    return k_layout, v_layout, k, v, options


def decode_workspace_bytes(q, k_cache, v_cache, *, layout="HND", device=None) -> int:
    """Workspace bytes decode() needs for these shapes (anything with .shape and .dtype) on
    `device` (default: the current one). Reserve it before capturing a graph."""
    arrays = {"q": q, "k_cache": k_cache, "v_cache": v_cache}
    _, _, k, v, _ = _validate("decode", arrays, layout, scale=None, softcap=0.0, window=None)
    return plan_for(device or default_device(), q, k, v, k.tokens).workspace_bytes


def decode(q, k_cache, v_cache, seq_lens, *, layout="HND", scale=None, softcap=0.0, window=None, sinks=None,
           return_lse: bool = False, out=None, out_lse=None, workspace=None, stream=None):
    """Attention of q [B, Hq, Sq, Dqk] (Sq 1..16) against each row's first seq_lens[b] cached
    keys, bottom-right causal: query t sees keys < seq_lens[b] - Sq + 1 + t.

    k_cache [B, Hkv, capacity, Dqk] / v_cache [B, Hkv, capacity, Dv] for layout "HND",
    [B, capacity, Hkv, D] for "NHD" (or a (k_layout, v_layout) pair); float16, bfloat16 or
    float32 like q; Hq a multiple of Hkv (GQA), head dims multiples of 16 bytes up to 256
    (128 for float32). seq_lens: int32 [B] on the device; slots past them are never read.
    scale (default 1/sqrt(Dqk)), softcap (0 = off), window (left, right) and sinks [Hq] as in
    sdpa. Returns o [B, Hq, Sq, Dv] in q's dtype, and with return_lse also lse [B, Hq, Sq]
    float32 (natural log, -inf for a row with no key). A row with seq_lens[b] == 0 gives zeros.
    out / out_lse: preallocated outputs; workspace: a device array of at least
    decode_workspace_bytes(...) bytes (else the stream's arena is used). A length outside
    [0, capacity] is reported as a DeviceFault after synchronization.
    """
    op = "decode"
    call = gather(op, stream, q=q, k_cache=k_cache, v_cache=v_cache, seq_lens=seq_lens, sinks=sinks,
                  out=out, out_lse=out_lse)
    a = call.arrays
    k_layout, v_layout, k, v, options = _validate(op, a, layout, scale=scale, softcap=softcap, window=window)
    batch, hq, sq, _ = a["q"].shape
    check_index_array(op, "seq_lens", a["seq_lens"], (batch,))
    check_sinks(op, a.get("sinks"), hq)
    check_out(op, a.get("out"), a.get("out_lse"), (batch, hq, sq, v.dim), a["q"].dtype)
    plan = plan_for(call.device, a["q"], k, v, k.tokens)
    ws = resolve_workspace(op, workspace, plan.workspace_bytes)
    src = KvSource(call.to_device("k_cache"), call.to_device("v_cache"), k_layout, v_layout,
                   call.to_device("seq_lens"), None, k.heads, k.tokens, batch, 1)
    return run_decode(op, call, plan, src, options, out=out, out_lse=out_lse, return_lse=return_lse, workspace=ws)
