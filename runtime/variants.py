"""The kernels' compile-time variants, read from ptx/manifest.json.

cu/variants.json is the one table of variants: scripts/build_ptx.py generates the kernels'
instantiations from it and copies it into the manifest, so what is here is what the PTX holds.
Every view is typed, read-only and built once. Dtypes are named as in kernel names: "f16",
"bf16", "f32".

What it replaces in runtime/ops (the hand-kept copies of the table):
- attention.py: `_VARIANTS` -> `sdpa_tiles().values()` (`_Variant` -> `SdpaVariant`, `_Tile` ->
  `TcTile`), `_SM90_TILES` -> `sm90_tiles()` (`_Sm90Tile` -> `Sm90Tile`); kernel names from
  `SdpaVariant.kernel(dtype, general)` and `Sm90Tile.kernel(dtype, paged)`.
- decode.py: `D_TILES` and `d_tile_for` -> `decode_d_tiles(dtype)`, `shared_bytes(d_tile,
  itemsize, warps_m, stages)` -> `DecodeTile.shared_bytes(warps_m, stages)`, the kernel name ->
  `DecodeTile.kernel`; THREADS, WARPS, KEYS_PER_BLOCK, MERGE_ROW_PAD -> the DECODE_* constants.
- merge.py, softmax.py: which kernels exist -> `merge_dtypes()`, `softmax_dtypes()`.
"""
from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

from . import kernel_names
from .module import manifest

__all__ = ["TcTile", "SdpaVariant", "Fp8Variant", "Sm90Tile", "DecodeTile", "sdpa_tiles", "sdpa_fp8_variants",
           "sm90_tiles", "sm90_ws_tiles", "sm90_ws_pp_tiles", "sm90_fp8_tiles", "decode_d_tiles", "merge_dtypes",
           "softmax_dtypes", "kv_quant_dtypes",
           "DECODE_THREADS", "DECODE_WARPS", "DECODE_TILE_KEYS", "DECODE_WARP_ROWS", "DECODE_MERGE_ROW_PAD"]

# Constants of cu/decode.cu that its shared-memory size depends on.
DECODE_THREADS = 128        # kThreads
DECODE_WARPS = DECODE_THREADS // 32
DECODE_TILE_KEYS = 16       # kTileKeys: keys of one mma m-tile (kBlockKeys: one, or two for fp8 caches)
DECODE_WARP_ROWS = 8        # kWarpRows: query rows a warp holds
DECODE_MERGE_ROW_PAD = 4    # kPartStride - D_TILE: floats of padding per row of the end-of-CTA merge
_ITEMSIZE = {"f16": 2, "bf16": 2, "f32": 4, "e4m3": 1, "e5m2": 1}


def _variants(family: str) -> list[dict]:
    return manifest()["families"][family]["variants"]


def _from_record(cls, record: dict):
    return cls(**{field.name: record[field.name] for field in dataclasses.fields(cls)})


@dataclass(frozen=True)
class TcTile:
    """TcTile<dim_qk, dim_v, warps, m_tiles, keys, stages, q_in_regs> of cu/flash_fwd.cu."""
    dim_qk: int
    dim_v: int
    warps: int
    m_tiles: int  # m16 tiles (16 query rows each) per warp
    keys: int  # keys per K/V tile
    stages: int
    q_in_regs: bool

    @property
    def rows(self) -> int:
        return 16 * self.m_tiles * self.warps

    @property
    def threads(self) -> int:
        return 32 * self.warps

    @property
    def shared_bytes(self) -> int:
        stage = self.keys * (self.dim_qk + self.dim_v)
        # Q_IN_STAGE in the kernel: Q held in registers borrows the last stage.
        q_in_stage = self.q_in_regs and self.rows * self.dim_qk <= stage
        return 2 * (self.stages * stage + (0 if q_in_stage else self.rows * self.dim_qk))


@dataclass(frozen=True)
class SdpaVariant:
    """A head-dim variant of cu/flash_fwd.cu: flash_fwd_<dtype>_<suffix> runs calls with plain
    scores (no mask, no softcap, scale > 0) on the `plain` tile, flash_fwd_<dtype>_<suffix>_general
    the rest on the `general` one."""
    suffix: str
    plain: TcTile
    general: TcTile

    @property
    def dim_qk(self) -> int:
        return self.plain.dim_qk

    @property
    def dim_v(self) -> int:
        return self.plain.dim_v

    def kernel(self, dtype: str, general: bool) -> str:
        return kernel_names.flash_fwd(dtype, self.suffix, general)


@dataclass(frozen=True)
class Fp8Variant:
    """A head-dim variant of cu/flash_fwd_fp8.cu (flash_fwd's tensor-core kernel over fp8 K/V,
    Dqk = Dv = dim): flash_fwd_<dtype>_<suffix>_general_fp8 runs every call on the general `tile`."""
    suffix: str
    tile: TcTile

    @property
    def dim(self) -> int:
        return self.tile.dim_qk

    def kernel(self, dtype: str) -> str:
        return kernel_names.flash_fwd(dtype, self.suffix, general=True, fp8=True)


@dataclass(frozen=True)
class Sm90Tile:
    """Sm90Tile<dim, dim_v, groups, keys> of cu/flash_fwd_sm90.cu (wgmma, sm_90a PTX): `groups`
    warpgroups of 64 query rows, `keys`-key K/V tiles, head dims Dqk = dim and Dv = dim_v (calls
    with smaller ones run zero-padded); `general` kernels take the calls with a mask, softcap or
    scale <= 0; `fp8` ones read fp8 K/V (strided or paged, one entry point)."""
    dim: int
    dim_v: int
    groups: int
    keys: int = 128
    general: bool = False
    fp8: bool = False
    ws: bool = False  # warp-specialized (cu/flash_fwd_sm90_ws.cuh): `groups` consumers and a producer
    stages: int = 2   # K/V stages in shared memory
    pingpong: bool = False  # ws kernels only: the consumers take turns on the tensor cores (named barriers)
    staged_mask: bool = False  # a general ws kernel's twin that stages masks in shared memory by TMA
    persistent: bool = False  # a plain ws ping-pong kernel's twin whose CTAs run block after block

    @property
    def rows(self) -> int:
        return 64 * self.groups

    @property
    def threads(self) -> int:
        return 128 * (self.groups + self.ws)

    @property
    def shared_bytes(self) -> int:
        # Q (two Q tiles in a persistent twin: the next block's beside this one's), the stages of
        # K and V, and 1024 bytes to align the base for the swizzle; fp8 kernels add the staging
        # area of the next tile's K and V bytes, staged-mask twins a stage's tile of a 16-bit mask
        # (rows by keys) beside each K/V stage.
        q_tiles = 2 if self.persistent else 1
        shared = 2 * (q_tiles * self.dim * self.rows + self.stages * self.keys * (self.dim + self.dim_v)) + 1024
        if self.fp8:
            shared += 2 * self.keys * self.dim
        if self.staged_mask:
            shared += 2 * self.stages * self.rows * self.keys
        return shared

    def holds(self, dqk: int, dv: int) -> bool:
        """A call of head dims (dqk, dv) can run this tile (zero-padded where smaller)."""
        return dqk <= self.dim and dv <= self.dim_v

    def kernel(self, dtype: str, paged: bool = False) -> str:
        """The entry point for `dtype`; `paged` K/V (a block table) have one of their own, but
        for fp8 K/V (and none for warp-specialized kernels: strided K/V only)."""
        return kernel_names.flash_fwd_sm90(dtype, self.dim, self.dim_v, self.general, ws=self.ws, groups=self.groups,
                                           pingpong=self.pingpong, staged_mask=self.staged_mask,
                                           persistent=self.persistent, fp8=self.fp8,
                                           paged=paged)


@dataclass(frozen=True)
class DecodeTile:
    """decode_split<T, KV, d> of cu/decode.cu: query, K and V rows padded to d elements; `kv`
    names an fp8 cache type ("e4m3", "e5m2"), None when the cache holds q's dtype."""
    dtype: str
    d: int
    kv: str | None = None

    @property
    def kernel(self) -> str:
        return kernel_names.decode_split(self.dtype, self.kv, self.d)

    @property
    def ctas_per_sm(self) -> int:
        """CTAs an SM should hold (plan_decode's ring depth): an fp8 block costs more
        instructions per byte, so fp8 kernels want more warps to hide their latency (see
        cu/decode_tuning.md, v9)."""
        return 3 if self.kv else 2

    @property
    def block_keys(self) -> int:
        """Keys a warp group takes per step (kBlockKeys<KV>): one m-tile, two for fp8."""
        return 2 * DECODE_TILE_KEYS if self.kv else DECODE_TILE_KEYS

    @property
    def max_stages(self) -> int:
        """Ring depth the kernel can wait on (cp_async_wait_pending, up to 8)."""
        return 8 if self.kv else 4

    def shared_bytes(self, warps_m: int, stages: int) -> int:
        """The query tile, each warp group's K/V ring (an fp8 stage also holds its keys' K and V
        scales), or (reusing it) the end-of-CTA merge."""
        groups = DECODE_WARPS // warps_m
        stage = 2 * self.block_keys * self.d * _ITEMSIZE[self.kv or self.dtype]
        if self.kv:
            stage += 2 * self.block_keys * 4
        rows = DECODE_WARP_ROWS * warps_m
        queries = rows * self.d * _ITEMSIZE[self.dtype]
        if self.kv:
            queries += rows * 4  # each row's largest magnitude (q_tile_for_fp8)
        ring = queries + groups * stages * stage
        merge = (2 + self.d + DECODE_MERGE_ROW_PAD) * DECODE_WARP_ROWS * DECODE_WARPS * 4
        return max(ring, merge)


@functools.cache
def sdpa_tiles() -> Mapping[str, SdpaVariant]:
    """flash_fwd's head-dim variants by suffix ("d64", "d128", ...), smallest first: a call
    runs on the first that holds its Dqk and Dv."""
    tiles = {(v["suffix"], v["general"]): _from_record(TcTile, v) for v in _variants("flash_fwd")}
    variants = [SdpaVariant(suffix, tiles[suffix, False], tiles[suffix, True])
                for suffix in dict.fromkeys(suffix for suffix, _ in tiles)]
    variants.sort(key=lambda v: (v.dim_qk, v.dim_v))
    return MappingProxyType({v.suffix: v for v in variants})


@functools.cache
def sdpa_fp8_variants() -> Mapping[int, Fp8Variant]:
    """flash_fwd_fp8's variants by head dim (Dqk = Dv)."""
    return MappingProxyType({v["dim_qk"]: Fp8Variant(v["suffix"], _from_record(TcTile, v))
                             for v in _variants("flash_fwd_fp8")})


def _sm90_tiles(fp8: bool, ws: bool = False, pingpong: bool = False, staged_mask: bool = False,
                persistent: bool = False) -> list[Sm90Tile]:
    """flash_fwd_sm90's tiles over fp8 K/V, or over K/V in q's dtype; warp-specialized ones
    (ws) apart, and among them the ping-pong ones, the staged-mask twins and the persistent ones."""
    return [_from_record(Sm90Tile, {"dim_v": v["dim"], "keys": 128, "fp8": False, "ws": False, "stages": 2,
                                    "pingpong": False, "staged_mask": False, "persistent": False, **v})
            for v in _variants("flash_fwd_sm90")
            if v.get("fp8", False) == fp8 and v.get("ws", False) == ws and v.get("pingpong", False) == pingpong
            and v.get("staged_mask", False) == staged_mask and v.get("persistent", False) == persistent]


@functools.cache
def sm90_tiles() -> Mapping[tuple[int, int, bool], Sm90Tile]:
    """flash_fwd_sm90's tiles over f16 / bf16 K/V by (Dqk, Dv, general), smallest first."""
    tiles = sorted(_sm90_tiles(fp8=False), key=lambda t: (t.dim, t.dim_v))
    return MappingProxyType({(t.dim, t.dim_v, t.general): t for t in tiles})


@functools.cache
def sm90_ws_tiles() -> Mapping[tuple[int, bool], Sm90Tile]:
    """flash_fwd_sm90's warp-specialized tiles (f16 / bf16, strided K/V, Dqk = dim, Dv = dim_v) by
    (dim, general), smallest first; ops/attention.py runs them unless PTXATTN_SM90_WS=0."""
    tiles = sorted(_sm90_tiles(fp8=False, ws=True), key=lambda t: t.dim)
    return MappingProxyType({(t.dim, t.general): t for t in tiles})


@functools.cache
def sm90_ws_pp_tiles() -> Mapping[tuple[int, bool], Sm90Tile]:
    """The warp-specialized tiles whose consumers ping-pong (the _ws_pp kernels) by (dim,
    general); ops/attention.py runs them in place of sm90_ws_tiles' for the dims of
    sm90_pingpong_dims()."""
    return MappingProxyType({(t.dim, t.general): t for t in _sm90_tiles(fp8=False, ws=True, pingpong=True)})


@functools.cache
def sm90_staged_mask_tiles() -> Mapping[tuple[int, bool], Sm90Tile]:
    """The staged-mask twins of general warp-specialized tiles by (dim, pingpong): ops/attention.py
    runs one in place of its general tile for calls whose mask TMA can load (staged_mask_map)."""
    tiles = _sm90_tiles(fp8=False, ws=True, staged_mask=True) + _sm90_tiles(fp8=False, ws=True, pingpong=True,
                                                                           staged_mask=True)
    return MappingProxyType({(t.dim, t.pingpong): t for t in tiles})


@functools.cache
def sm90_persistent_tiles() -> Mapping[int, Sm90Tile]:
    """The persistent twins of plain warp-specialized ping-pong tiles by dim: ops/attention.py
    runs one in place of its ping-pong tile for dense TMA calls of more blocks than SMs
    (persistent_twin)."""
    return MappingProxyType({t.dim: t for t in _sm90_tiles(fp8=False, ws=True, pingpong=True, persistent=True)})


@functools.cache
def sm90_fp8_tiles() -> Mapping[int, Sm90Tile]:
    """flash_fwd_sm90's tiles over fp8 K/V (general ones) by head dim (Dqk = Dv)."""
    return MappingProxyType({t.dim: t for t in _sm90_tiles(fp8=True)})


@functools.cache
def decode_d_tiles(dtype: str, kv: str | None = None) -> tuple[DecodeTile, ...]:
    """decode's head-dim tiles for queries in `dtype` and a cache of `kv` (an fp8 type; None:
    q's dtype), smallest first (none for a pair it lacks)."""
    return tuple(sorted((DecodeTile(dtype, v["d"], kv) for v in _variants("decode")
                         if v["dtype"] == dtype and v.get("kv") == kv), key=lambda tile: tile.d))


@functools.cache
def merge_dtypes() -> frozenset[tuple[str, str]]:
    """(input, output) dtypes of each merge_<in>_<out> kernel."""
    return frozenset((v["in"], v["out"]) for v in _variants("merge"))


@functools.cache
def kv_quant_dtypes() -> frozenset[tuple[str, str]]:
    """(new rows' dtype, fp8 cache type) of each kv_append_quant_<src>_<kv> kernel: the pairs
    kv_append and paged_kv_append quantize on append."""
    return frozenset((v["src"], v["kv"]) for v in _variants("kv_cache"))


@functools.cache
def softmax_dtypes() -> tuple[str, ...]:
    """The dtypes of the softmax_{rows_warp,rows_block,cols}_<dtype> kernels."""
    return tuple(v["dtype"] for v in _variants("softmax"))
