"""runtime/variants.py: its views name exactly the kernels the manifest lists, and their derived
sizes are the kernels' (no GPU)."""
from __future__ import annotations

import dataclasses

import pytest

from ptxattn.module import manifest
from ptxattn.variants import (DecodeTile, Sm90Tile, decode_d_tiles, kv_quant_dtypes, merge_dtypes, sdpa_fp8_variants,
                              sdpa_tiles, sm90_fp8_tiles, sm90_persistent_tiles, sm90_staged_mask_tiles, sm90_tiles,
                              sm90_ws_pp_tiles, sm90_ws_tiles, softmax_dtypes)

DTYPES = ("f16", "bf16", "f32")


def kernels(family: str) -> set[str]:
    return set(manifest()["families"][family]["kernels"])


def test_views_name_every_kernel_of_the_manifest():
    sdpa_dtypes = manifest()["families"]["flash_fwd"]["dtypes"]
    assert {v.kernel(dt, general) for v in sdpa_tiles().values() for dt in sdpa_dtypes
            for general in (False, True)} | {"flash_fwd_f32"} == kernels("flash_fwd")
    sm90_dtypes = manifest()["families"]["flash_fwd_sm90"]["dtypes"]
    assert {t.kernel(dt, paged) for t in sm90_tiles().values() for dt in sm90_dtypes
            for paged in (False, True)} | {t.kernel(dt) for t in sm90_fp8_tiles().values()
                                           for dt in sm90_dtypes} | \
        {t.kernel(dt) for tiles in (sm90_ws_tiles(), sm90_ws_pp_tiles(), sm90_staged_mask_tiles(), sm90_persistent_tiles())
         for t in tiles.values() for dt in sm90_dtypes} == kernels("flash_fwd_sm90")
    fp8_dtypes = manifest()["families"]["flash_fwd_fp8"]["dtypes"]
    assert {v.kernel(dt) for v in sdpa_fp8_variants().values() for dt in fp8_dtypes} == kernels("flash_fwd_fp8")
    assert {t.kernel for dt in DTYPES for kv in (None, "e4m3", "e5m2") for t in decode_d_tiles(dt, kv)} == \
        kernels("decode")
    assert {f"merge_{a}_{b}" for a, b in merge_dtypes()} == kernels("merge")
    assert {f"softmax_{kind}_{dt}" for kind in ("rows_warp", "rows_block", "cols")
            for dt in softmax_dtypes()} == kernels("softmax")
    assert {f"kv_append_quant_{src}_{kv}" for src, kv in kv_quant_dtypes()} | {"kv_append", "kv_advance"} == \
        kernels("kv_cache")


def test_sdpa_tiles_smallest_first_and_their_sizes():
    tiles = sdpa_tiles()
    assert list(tiles) == ["d64", "d128", "d192_128", "d256"]
    d128 = tiles["d128"]
    assert (d128.dim_qk, d128.dim_v, d128.plain.rows, d128.plain.threads) == (128, 128, 128, 128)
    assert d128.plain.shared_bytes == 2 * (2 * 64 * 256 + 128 * 128)  # two stages of 64 keys (K and V) + Q
    assert d128.general.shared_bytes == 2 * 3 * 64 * 256  # three stages; Q borrows the last one
    # sm_86 / sm_89 give a block at most 99 KiB of shared memory; the PTX targets them too.
    assert all(t.shared_bytes <= 99 * 1024 for v in tiles.values() for t in (v.plain, v.general))


# sm_90's 227 KB a block, less the 1 KB of static shared memory ptxas reports for the wgmma kernels.
SM90_DYNAMIC_SHARED_MAX = 227 * 1024 - 1024


def test_sm90_tiles_and_their_sizes():
    tiles = {}
    for general in (False, True):
        tiles |= {(64, 64, general): Sm90Tile(64, 64, 2 if general else 3, general=general),
                  (128, 128, general): Sm90Tile(128, 128, 2 if general else 3, general=general),
                  (192, 128, general): Sm90Tile(192, 128, 2, general=general),
                  (256, 256, general): Sm90Tile(256, 256, 2, keys=64 if general else 80, general=general)}
    assert sm90_tiles() == tiles
    assert list(sm90_tiles()) == sorted(sm90_tiles(), key=lambda key: key[:2])  # smallest first
    tile = sm90_tiles()[128, 128, False]
    assert (tile.rows, tile.threads, tile.shared_bytes) == (192, 384, 2 * 128 * (192 + 4 * 128) + 1024)
    general = sm90_tiles()[128, 128, True]
    assert general.kernel("bf16", True) == "flash_fwd_sm90_bf16_d128_general_paged"
    assert (general.rows, general.threads, general.shared_bytes) == (128, 256, 2 * 128 * (128 + 4 * 128) + 1024)
    assert sm90_tiles()[192, 128, True].kernel("f16") == "flash_fwd_sm90_f16_d192_128_general"
    for tile in sm90_tiles().values():
        assert tile.shared_bytes <= SM90_DYNAMIC_SHARED_MAX, tile


def test_fp8_sdpa_tiles():
    """fp8 K/V: general kernels only, at Dqk = Dv = 64 and 128, on flash_fwd's general tiles;
    the mma.sync ones ship for sm_80 and sm_89 only."""
    assert list(sdpa_fp8_variants()) == [64, 128] == list(sm90_fp8_tiles())
    for dim, variant in sdpa_fp8_variants().items():
        assert variant.tile == sdpa_tiles()[f"d{dim}"].general
    assert sdpa_fp8_variants()[128].kernel("bf16") == "flash_fwd_bf16_d128_general_fp8"
    assert sm90_fp8_tiles()[64] == Sm90Tile(64, 64, 2, general=True, fp8=True) and sm90_fp8_tiles()[64].kernel("f16", True) == \
        "flash_fwd_sm90_f16_d64_general_fp8"
    assert manifest()["families"]["flash_fwd_fp8"]["archs"] == ["sm_80", "sm_89"]


def test_decode_tiles_and_their_shared_bytes():
    assert decode_d_tiles("bf16") == (DecodeTile("bf16", 64), DecodeTile("bf16", 128), DecodeTile("bf16", 256))
    assert [t.d for t in decode_d_tiles("f32")] == [64, 128] and decode_d_tiles("f64") == ()
    bf16_d128 = decode_d_tiles("bf16")[1]
    assert bf16_d128.kernel == "decode_split_bf16_d128"
    # One warp group a warp, three stages: Q's 8 rows + 4 rings of 3 x (16 K + 16 V) rows.
    assert bf16_d128.shared_bytes(warps_m=1, stages=3) == (8 + 4 * 3 * 32) * 128 * 2
    # One group of four warps, two stages: Q's 32 rows and one ring of 2 x 32 rows, which
    # also holds the end-of-CTA merge (8 rows a warp of 2 + 256 + 4 floats).
    d256 = DecodeTile("bf16", 256).shared_bytes(warps_m=4, stages=2)
    assert d256 == (32 + 2 * 32) * 256 * 2 >= (2 + 256 + 4) * 8 * 4 * 4


def test_fp8_decode_tiles_and_their_shared_bytes():
    assert [t.d for t in decode_d_tiles("f16", "e4m3")] == [128, 256] == [t.d for t in decode_d_tiles("bf16", "e5m2")]
    assert decode_d_tiles("f32", "e4m3") == ()
    tile = decode_d_tiles("bf16", "e4m3")[0]
    assert (tile.kernel, tile.max_stages) == ("decode_split_bf16_e4m3_d128", 8)
    # bf16 queries (8 rows) and their magnitudes, then 4 rings of 3 stages: 32 K + 32 V rows of
    # 128 bytes and 64 scales.
    assert tile.block_keys == 32
    assert tile.shared_bytes(warps_m=1, stages=3) == 8 * 128 * 2 + 8 * 4 + 4 * 3 * (64 * 128 + 64 * 4)


def test_views_are_read_only():
    with pytest.raises(TypeError):
        sdpa_tiles()["d32"] = sdpa_tiles()["d64"]
    with pytest.raises(dataclasses.FrozenInstanceError):
        sm90_tiles()[64, 64, False].groups = 2


def test_sm90_ws_tiles():
    """The warp-specialized kernels, plain and general: a producer warpgroup beside `groups`
    consumers of 64 rows (three for plain D64 calls, flash_fwd_notes v15; else two), Q and
    `stages` K/V stages within sm_90's 227 KB, at every head dim the plain wgmma kernels have."""
    ws = sm90_ws_tiles()
    dims = {64: 64, 128: 128, 192: 128, 256: 256}  # Dqk: Dv
    assert set(ws) == {(dim, general) for dim in dims for general in (False, True)}
    for (dim, general), tile in ws.items():
        assert tile.ws and tile.general == general and not tile.fp8 and tile.dim_v == dims[dim]
        groups = 3 if (dim, general) == (64, False) else 2
        assert (tile.groups, tile.rows, tile.threads) == (groups, 64 * groups, 128 * (groups + 1))
        assert tile.keys == ((64 if general else 80) if dim == 256 else 128)  # 80 spills in general D256
        assert tile.stages == (3 if dim == 64 else 2)
        assert tile.shared_bytes == 2 * (dim * tile.rows + tile.stages * tile.keys * (dim + tile.dim_v)) + 1024
        assert tile.shared_bytes <= SM90_DYNAMIC_SHARED_MAX
        dims_name = f"d{dim}" + (f"_{tile.dim_v}" if tile.dim_v != dim else "")
        rows = "_m192" * (groups == 3)
        assert tile.kernel("bf16") == f"flash_fwd_sm90_bf16_{dims_name}{'_general' * general}_ws{rows}"
        plain = sm90_tiles()[dim, tile.dim_v, general]  # the kernel a ws tile replaces: same tile shape
        assert (plain.keys, plain.dim_v) == (tile.keys, tile.dim_v)
    assert list(ws)[:2] in ([(64, False), (64, True)], [(64, True), (64, False)])  # smallest first
    assert all(not t.ws for t in sm90_tiles().values())
    assert all(not t.pingpong for t in ws.values())
    # The ping-pong twins (every plain tile; general ones at D64 and D128 only, where the mask
    # path fits the consumers' registers): the same tiles but for the flag, a kernel of their own.
    pp = sm90_ws_pp_tiles()
    assert set(pp) == {(dim, general) for dim in (64, 128) for general in (False, True)} | {(192, False), (256, False)}
    for (dim, general), tile in pp.items():
        assert tile.pingpong and dataclasses.replace(tile, pingpong=False) == ws[dim, general]
        assert tile.kernel("f16") == ws[dim, general].kernel("f16") + "_pp"
    # The staged-mask twins of the default general kernels (the ping-pong ones at D64 / D128, the
    # ws one at D256; 192 / 128 has no room): the same tiles but for the flag, a mask tile of rows
    # by keys 16-bit elements a stage beside the ring, a kernel of their own.
    staged = sm90_staged_mask_tiles()
    assert set(staged) == {(64, True), (128, True), (256, False)}
    for (dim, pingpong), tile in staged.items():
        general = (pp if pingpong else ws)[dim, True]
        assert tile.staged_mask and dataclasses.replace(tile, staged_mask=False) == general
        assert tile.shared_bytes == general.shared_bytes + 2 * tile.stages * tile.rows * tile.keys
        assert tile.shared_bytes <= SM90_DYNAMIC_SHARED_MAX
        assert tile.kernel("bf16") == general.kernel("bf16") + "_staged_mask"
    # The persistent twin of the plain D128 ping-pong kernel: the same tile but for the flag, a
    # second Q tile, a kernel of its own.
    persistent = sm90_persistent_tiles()
    assert set(persistent) == {128}
    tile = persistent[128]
    assert tile.persistent and dataclasses.replace(tile, persistent=False) == pp[128, False]
    assert tile.shared_bytes == pp[128, False].shared_bytes + 2 * tile.rows * tile.dim <= SM90_DYNAMIC_SHARED_MAX
    assert tile.kernel("bf16") == pp[128, False].kernel("bf16") + "_persistent"
