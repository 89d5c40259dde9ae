"""The warp-specialized sm_90a kernels (cu/flash_fwd_sm90_ws.cuh, the default at every head dim:
the _ws_pp ping-pong twins at D64 / D128, the _ws kernels at the others, plain and _general) against
the float64 reference and, bit for bit (same summation order), against the wgmma kernels they
replaced (PTXATTN_SM90_WS=0), the _ws kernels at every dim (PTXATTN_SM90_PINGPONG=0), the _ws_pp
kernels at every dim (PTXATTN_SM90_PINGPONG=1) and the default kernels loading by cp.async where this
process loads by TMA (PTXATTN_SM90_TMA=0): D64, D128, Dqk 192 / Dv 128, D256 and dims
zero-padded into them, f16 / bf16, causal both alignments, windows, masks (those TMA can load
run the staged-mask twins here and the general kernels in every child), softcap, scale <= 0,
GQA, sinks, LSE, odd lengths, rows with no key, ragged batches. Both settings are read once a
process, so a child process a setting (CHILDREN) runs every case (same seeded inputs) and this
one, on the default kernels, compares. Only the children run the kernels under test: one that
hangs (a barrier bug) ends in the child's timeout, not in this process.

    python tests/test_sdpa_sm90_ws_gpu.py SEED OUT.npz NAME   # a child, CHILDREN[NAME]'s setting made
"""
from __future__ import annotations

import os
import secrets
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import ptxattn
from ptxattn import reference
from ptxattn.ops import attention
from ptxattn.variants import sm90_tiles, sm90_ws_pp_tiles, sm90_ws_tiles

from serving_util import check_rows, covered_rows, ragged_batch
from test_sdpa_gpu import BF16, F16, Case, _check, _inputs, _mask_shape, _run_device
from test_serving_gpu import run_ragged

pytestmark = pytest.mark.gpu

# A child process a setting: (environment variable, value); child_kernel says what it runs.
CHILDREN = {
    "plain": ("PTXATTN_SM90_WS", "0"),
    "ws": ("PTXATTN_SM90_PINGPONG", "0"),
    "pingpong": ("PTXATTN_SM90_PINGPONG", "1"),
    "cp_async": ("PTXATTN_SM90_TMA", "0"),
}
CHILD_TIMEOUT_S = 180  # a cold driver JIT cache costs a child ~35 s of the sm_90a PTX


def child_kernel(child: str, ws_tile, dtype: str) -> str:
    """The kernel calls of a ws tile's dims run in `child`: the plain wgmma kernel of those dims,
    the ws kernel, or its ping-pong twin (the ws kernel where the dims have none; cp_async: the
    default kernel, which is that twin at every dim)."""
    if child == "plain":
        return sm90_tiles()[ws_tile.dim, ws_tile.dim_v, ws_tile.general].kernel(dtype)
    twin = sm90_ws_pp_tiles().get((ws_tile.dim, ws_tile.general)) if child in ("pingpong", "cp_async") else None
    return (twin or ws_tile).kernel(dtype)


CASES = [
    Case(BF16, 2, 4, 4, 128, 128, 128, 128),
    Case(F16, 2, 4, 4, 256, 384, 64, 64),
    Case(BF16, 1, 4, 1, 97, 1025, 128, 128, causal=True, align="bottom_right"),
    Case(F16, 1, 4, 1, 97, 1025, 64, 64, causal=True, align="bottom_right", sinks=True),
    Case(BF16, 2, 8, 2, 1025, 1025, 128, 128, causal=True),
    Case(F16, 2, 8, 2, 1025, 1025, 128, 128, causal=True, sinks=True),
    Case(BF16, 1, 4, 4, 1025, 97, 64, 64, causal=True),                          # rows with no key
    Case(F16, 1, 2, 2, 300, 130, 128, 128, causal=True, align="bottom_right"),   # rows with no key
    Case(BF16, 1, 4, 2, 700, 900, 64, 64, window=(100, 20)),
    Case(F16, 1, 4, 2, 333, 901, 128, 128, causal=True, align="bottom_right", window=(200, 0), sinks=True),
    Case(BF16, 2, 2, 1, 1000, 1000, 128, 128, window=(-1, 0), sinks=True),
    Case(F16, 1, 8, 8, 2048, 2048, 128, 128, causal=True),                       # many tiles: the ring wraps
    Case(BF16, 1, 8, 8, 2048, 2048, 64, 64, causal=True, sinks=True),
    Case(BF16, 1, 2, 2, 1, 1, 64, 64),
    # Plain D64 blocks are 192 rows, three consumers: the third with no row, a block of one row.
    Case(F16, 1, 2, 2, 130, 500, 64, 64, causal=True),
    Case(BF16, 2, 4, 2, 193, 193, 64, 64, causal=True, align="bottom_right"),
    Case(F16, 1, 2, 1, 5, 0, 128, 128, sinks=True),                              # no keys at all
    Case(BF16, 3, 6, 2, 129, 4000, 128, 128, lse=False),
    # Smaller head dims, zero-padded into the D64 / D128 kernels.
    Case(BF16, 1, 4, 2, 500, 700, 96, 96, causal=True),
    Case(F16, 2, 4, 4, 190, 333, 40, 24, window=(60, 5)),
    # General calls (masks, softcap, scale <= 0): the _general_ws kernels.
    Case(BF16, 2, 4, 2, 300, 700, 128, 128, causal=True, mask="bhqk", mask_dtype=BF16),
    Case(F16, 1, 4, 4, 257, 1025, 64, 64, softcap=5.0, window=(40, 7)),
    Case(BF16, 2, 4, 4, 200, 333, 64, 64, mask="qk", mask_dtype=np.dtype(bool), sinks=True),
    Case(F16, 1, 4, 2, 130, 900, 128, 128, scale=-0.05, mask="bhq1", mask_dtype=np.dtype(np.float32)),
    Case(BF16, 1, 8, 8, 2048, 2048, 128, 128, causal=True, softcap=30.0),   # many tiles: the ring wraps
    Case(F16, 1, 4, 4, 200, 500, 128, 128, softcap=5.0, scale=0.5),          # logits where tanh saturates
    Case(F16, 1, 8, 2, 1500, 1500, 64, 64, causal=True, align="bottom_right", mask="bhqk", mask_dtype=F16),
    Case(BF16, 1, 2, 2, 300, 130, 128, 128, causal=True, scale=0.0),        # rows with no key, scale 0
    Case(F16, 1, 4, 4, 333, 444, 40, 40, mask="k", mask_dtype=BF16, sinks=True),
    # The larger head dims: Dqk 192 / Dv 128 (128-key tiles) and 256 (80-key tiles, general 64), plain and
    # general, and dims zero-padded into them.
    Case(BF16, 2, 4, 2, 1025, 1025, 256, 256, causal=True),
    Case(F16, 1, 4, 4, 300, 777, 256, 256, sinks=True),
    Case(BF16, 1, 4, 1, 97, 1025, 192, 128, causal=True, align="bottom_right"),
    Case(F16, 1, 8, 8, 1500, 1500, 192, 128, causal=True),                      # many tiles: the ring wraps
    Case(BF16, 1, 4, 2, 300, 500, 200, 136, window=(60, 5)),
    Case(F16, 1, 4, 2, 257, 900, 160, 128, mask="bhqk", mask_dtype=np.dtype(bool)),
    Case(BF16, 1, 4, 4, 1000, 1000, 256, 256, causal=True, softcap=30.0),
    Case(F16, 1, 2, 2, 300, 130, 256, 256, causal=True, scale=-0.05, mask="qk", mask_dtype=F16),
    # Masks TMA can load (16-bit or bool, rows on 16 bytes, unpadded dims): the staged-mask twins,
    # whose children (cp_async, plain, and ws at D64 / D128) read the mask from global memory.
    Case(BF16, 2, 4, 2, 300, 704, 128, 128, causal=True, mask="bhqk", mask_dtype=BF16),
    Case(F16, 1, 4, 4, 257, 1024, 64, 64, mask="qk", mask_dtype=F16, softcap=5.0, sinks=True),
    Case(BF16, 1, 4, 2, 300, 512, 256, 256, causal=True, align="bottom_right", mask="bhqk", mask_dtype=BF16),
    Case(F16, 1, 8, 8, 2048, 2048, 128, 128, causal=True, mask="qk", mask_dtype=F16),  # the ring wraps
    Case(BF16, 1, 4, 2, 700, 896, 64, 64, window=(100, 20), mask="bhqk", mask_dtype=BF16, scale=0.3),
    Case(BF16, 2, 4, 2, 300, 704, 128, 128, causal=True, mask="bhqk", mask_dtype=np.dtype(bool), sinks=True),
    Case(F16, 1, 4, 4, 257, 1024, 64, 64, mask="qk", mask_dtype=np.dtype(bool), softcap=5.0),
    Case(BF16, 2, 4, 2, 300, 704, 128, 128, mask="b11k", mask_dtype=BF16),        # one row for every query
    Case(F16, 1, 4, 4, 130, 512, 256, 256, causal=True, mask="1h1k", mask_dtype=F16),
    Case(BF16, 2, 4, 4, 200, 1024, 64, 64, mask="b11k", mask_dtype=np.dtype(bool), sinks=True),
]
# (dtype, D, lengths of the queries, options): ragged batches (bottom-right per sequence).
RAGGED = [
    (BF16, 128, {"causal": True}),
    (F16, 64, {"causal": True, "sinks": True}),
    (BF16, 64, {"window": (33, 17)}),
    (F16, 128, {}),
]


def _ragged_inputs(rng, dtype, d):
    lens_q = [1, 97, 0, 128, 129, 300, 1025, 64]
    lens_k = [n + int(rng.integers(0, 200)) for n in lens_q]
    lens_k[2] = 0
    return ragged_batch(rng, lens_q, lens_k, 8, 2, d, d, dtype)


def _ragged_options(rng, options):
    options = dict(options)
    if options.pop("sinks", False):
        options["sinks"] = rng.standard_normal(8).astype(np.float32)
    return options


def case_outputs(cases, seed: int) -> dict[str, np.ndarray]:
    """Each case's outputs (o as raw bits, lse) under this process's kernel choice, case i's
    inputs seeded by (seed, i)."""
    results = {}
    for i, case in enumerate(cases):
        o, lse, _ = _run_device(case, np.random.default_rng([seed, i]))
        results[f"o{i}"] = o.view(np.uint16)
        if lse is not None:
            results[f"lse{i}"] = lse
    return results


def _run_all(seed: int) -> dict[str, np.ndarray]:
    """Every case's and ragged batch's outputs under this process's kernel choice."""
    results = case_outputs(CASES, seed)
    for i, (dtype, d, options) in enumerate(RAGGED):
        rng = np.random.default_rng([seed, 1000 + i])
        q, k, v, cu_q, cu_k = _ragged_inputs(rng, dtype, d)
        o, lse = run_ragged(rng, q, k, v, cu_q, cu_k, **_ragged_options(rng, options))
        results[f"ragged_o{i}"] = np.asarray(o).view(np.uint16)
        results[f"ragged_lse{i}"] = np.asarray(lse)
    return results


@pytest.fixture(scope="module")
def seed():
    """The inputs' seed, once this process is known to run the default warp-specialized kernels."""
    if not attention.runs_wgmma(ptxattn.get_device(0)):
        pytest.skip("the device does not load the sm_90a PTX")
    if (not attention.sm90_ws_enabled() or os.environ.get(attention.SM90_PINGPONG_ENV)
            or os.environ.get(attention.SM90_TMA_ENV)):
        pytest.skip("PTXATTN_SM90_WS=0, PTXATTN_SM90_PINGPONG or PTXATTN_SM90_TMA is set: this process must run "
                    "the default warp-specialized kernels")
    return int(os.environ.get("PTXATTN_SEED", secrets.randbits(32)))


@pytest.fixture(scope="module", params=sorted(CHILDREN))
def child_results(request, seed, tmp_path_factory):
    """The seed, the child's name and its outputs of every case under CHILDREN[name]'s setting."""
    name = request.param
    variable, value = CHILDREN[name]
    out = tmp_path_factory.mktemp(name) / f"{name}.npz"
    try:
        child = subprocess.run([sys.executable, str(Path(__file__)), str(seed), str(out), name],
                               env=dict(os.environ, **{variable: value}), timeout=CHILD_TIMEOUT_S,
                               capture_output=True, text=True)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"child {name} ({variable}={value}, seed {seed}) ran past {CHILD_TIMEOUT_S} s (a hang?):\n"
                    f"{exc.stdout}\n{exc.stderr}")
    assert child.returncode == 0, f"child {name} (seed {seed}) failed:\n{child.stdout}\n{child.stderr}"
    with np.load(out) as data:
        return seed, name, dict(data)


# This process's outputs by (seed, kind, index), held against the reference when first run: every
# child's comparison reuses them.
_OWN: dict[tuple, tuple] = {}


def _own_case(seed: int, i: int):
    if (seed, "case", i) not in _OWN:
        case = CASES[i]
        o, lse, inputs = _run_device(case, np.random.default_rng([seed, i]))
        _check(case, o, lse, *inputs)
        _OWN[seed, "case", i] = o, lse
    return _OWN[seed, "case", i]


def _own_ragged(seed: int, i: int):
    if (seed, "ragged", i) not in _OWN:
        dtype, d, options = RAGGED[i]
        rng = np.random.default_rng([seed, 1000 + i])
        q, k, v, cu_q, cu_k = _ragged_inputs(rng, dtype, d)
        options = _ragged_options(rng, options)
        o, lse = run_ragged(rng, q, k, v, cu_q, cu_k, **options)
        rows = covered_rows(q.shape[0], cu_q)
        ref_o, ref_lse = reference.ragged_attention(q, k, v, cu_q, cu_k, **options)
        check_rows(np.asarray(o), np.asarray(lse), ref_o, ref_lse, rows, dtype)
        _OWN[seed, "ragged", i] = np.asarray(o), np.asarray(lse), rows
    return _OWN[seed, "ragged", i]


def _same_bits(got: np.ndarray, want: np.ndarray, what: str) -> None:
    got_bits, want_bits = got.view(np.uint8), want.view(np.uint8)
    assert got.shape == want.shape and np.array_equal(got_bits, want_bits), (
        f"{what}: {int((got.reshape(-1).view(np.uint8) != want.reshape(-1).view(np.uint8)).sum())} bytes differ")


@pytest.mark.parametrize("dtype, dqk, dv, loads_by_tma", [(BF16, 128, 128, True), (F16, 64, 64, True),
                                                          (BF16, 192, 128, True), (F16, 256, 256, True),
                                                          (BF16, 96, 96, False)])
def test_dense_calls_whose_dims_fill_the_tile_load_by_tma(seed, dtype, dqk, dv, loads_by_tma):
    """What the cp_async child is compared against: this process's unpadded dense calls do load
    by TMA (zero-padded dims keep cp.async), so the comparison is not of one path with itself."""
    q, k = ptxattn.empty((1, 4, 300, dqk), dtype), ptxattn.empty((1, 2, 500, dqk), dtype)
    v = ptxattn.empty((1, 2, 500, dv), dtype)
    (launch,) = ptxattn.prepare(ptxattn.sdpa, q, k, v, causal=True).launches
    assert "_ws" in launch.name and launch.params.tma == int(loads_by_tma), (launch.name, launch.params.tma)


@pytest.mark.parametrize("dqk, dv, mask, mask_dtype, skv, staged", [
    (128, 128, "bhqk", BF16, 704, True), (64, 64, "qk", F16, 1024, True), (256, 256, "bhqk", BF16, 512, True),
    (128, 128, "qk", np.dtype(bool), 704, True), (128, 128, "1h1k", BF16, 704, True),
    (128, 128, "bhqk", BF16, 700, False),                 # a query stride off 16 bytes
    (128, 128, "qk", np.dtype(bool), 696, False),         # the same for bytes
    (128, 128, "qk", np.dtype(np.float32), 704, False),
    (128, 128, "bhq1", BF16, 704, False),                 # the key axis broadcast
    (256, 256, "qk", np.dtype(bool), 512, False),         # 64-key tiles
    (192, 128, "bhqk", BF16, 704, False),                 # no twin
])
def test_masks_tma_can_load_run_the_staged_mask_twins(seed, dqk, dv, mask, mask_dtype, skv, staged):
    """What the children are compared against on the staged cases: this process runs the
    staged-mask twin (tensor map over the mask) exactly where the mask is f16 / bf16 / bool and
    TMA can load it, and the general kernel otherwise."""
    case = Case(BF16, 2, 4, 2, 300, skv, dqk, dv, mask=mask, mask_dtype=mask_dtype)
    q, k = ptxattn.empty((2, 4, 300, dqk), BF16), ptxattn.empty((2, 2, skv, dqk), BF16)
    v, m = ptxattn.empty((2, 2, skv, dv), BF16), ptxattn.empty(_mask_shape(case), mask_dtype)
    (launch,) = ptxattn.prepare(ptxattn.sdpa, q, k, v, attn_mask=m).launches
    assert "_general_ws" in launch.name and launch.name.endswith("_staged_mask") == staged, launch.name


def test_staged_masks_with_rows_and_keys_masked_out(seed):
    """A staged bf16 mask with -inf on whole rows (no visible key: o 0, lse -inf), on whole key
    tiles and scattered, against the float64 reference."""
    case = Case(BF16, 1, 4, 2, 300, 1024, 128, 128, causal=True, align="bottom_right", mask="bhqk", mask_dtype=BF16)
    rng = np.random.default_rng([seed, 77])
    q, k, v, mask, sinks = _inputs(case, rng)
    mask[rng.random(mask.shape) < 0.2] = -np.inf
    mask[:, :, 3:40, :] = -np.inf
    mask[:, :, :, 128:384] = -np.inf
    (launch,) = ptxattn.prepare(ptxattn.sdpa, *(ptxattn.asarray(x) for x in (q, k, v)),
                                attn_mask=ptxattn.asarray(mask), causal=True, causal_align="bottom_right").launches
    assert launch.name.endswith("_staged_mask"), launch.name
    o, lse, inputs = _run_device(case, rng, (q, k, v, mask, sinks))
    _check(case, o, lse, *inputs)
    assert np.all(lse[:, :, 3:40] == -np.inf) and np.all(o[:, :, 3:40].astype(np.float32) == 0)


@pytest.mark.parametrize("i", range(len(CASES)), ids=[str(c) for c in CASES])
def test_ws_matches_reference_and_child_bit_for_bit(child_results, i):
    seed, name, child = child_results
    o, lse = _own_case(seed, i)
    _same_bits(o.view(np.uint16), child[f"o{i}"], f"o vs {name} (seed {seed})")
    if lse is not None:
        _same_bits(lse, child[f"lse{i}"], f"lse vs {name} (seed {seed})")


@pytest.mark.parametrize("i", range(len(RAGGED)), ids=[f"{np.dtype(t).name}-d{d}-{sorted(o)}" for t, d, o in RAGGED])
def test_ws_ragged_matches_reference_and_child_bit_for_bit(child_results, i):
    seed, name, child = child_results
    o, lse, rows = _own_ragged(seed, i)
    _same_bits(o.view(np.uint16)[rows], child[f"ragged_o{i}"][rows], f"ragged o vs {name} (seed {seed})")
    _same_bits(lse[rows], child[f"ragged_lse{i}"][rows], f"ragged lse vs {name} (seed {seed})")


if __name__ == "__main__":
    variable, value = CHILDREN[sys.argv[3]]
    assert os.environ.get(variable) == value, f"the child {sys.argv[3]} wants {variable}={value}"
    for dtype, name in ((BF16, "bf16"), (F16, "f16")):
        for (dim, general), tile in sm90_ws_tiles().items():
            kernel = attention.plan_kernel(np.dtype(dtype), dim, tile.dim_v, general, True).kernel
            want = child_kernel(sys.argv[3], tile, name)
            assert kernel == want, f"{sys.argv[3]}: calls run {kernel}, not {want}"
    np.savez(sys.argv[2], **_run_all(int(sys.argv[1])))
