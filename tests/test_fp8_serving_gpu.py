"""ragged_attention and paged_attention over fp8 K/V (float8_e4m3fn, float8_e5m2) on the GPU:
against the float64 reference over the dequantized values at bf16 accuracy, both scale
granularities (per tensor, per token and kv head), f16 and bf16 queries, d64 and d128, GQA,
HND and NHD pools, prefill chunks mixed with decode rows; NaN bytes and NaN scales in the rows
no sequence owns, past every live length and in unused pages, NaN-poisoned outputs framed by
canaries; the wgmma kernels (sm_90) and the mma.sync ones (unaligned queries, and each older
arch's PTX in a fresh process); paged prefill equals ragged bitwise and decode rows equal
paged_decode; a captured step replayed bitwise equal to eager; bad page ids fault."""
from __future__ import annotations

import functools

import numpy as np
import pytest

import ptxattn
from ptxattn import reference
from ptxattn.ops.attention import runs_wgmma

from decode_util import FP8, FP8_IDS, FP8_MAX, rand
from gpu_util import REL_TOL, relative_error, run_under_arch
from serving_util import (EDGE_LENGTHS, GuardedRows, PagedBatch, StepBudget, captured, check_rows, covered_rows,
                          expect_fault, mixed_step, offsets, on_device, ragged_batch, replay_equals_eager)

pytestmark = pytest.mark.gpu

BF16 = ptxattn.bfloat16
Q_DTYPES = [np.dtype(np.float16), BF16]
Q_IDS = ["f16", "bf16"]
GRANULARITY = [False, True]
GRANULARITY_IDS = ["per_tensor", "per_token"]


def quantize(rng, x, fp8, per_token: bool):
    """x (float32, NaN rows allowed) times a random magnitude a row, as fp8 and its scale: a
    float from the amax, or float32 x.shape[:-1] from each row's. NaN rows give NaN bytes and
    (per token) NaN scales."""
    x = x * np.exp(rng.uniform(-3, 3, x.shape[:-1] + (1,)))
    if per_token:
        scale = (np.abs(x).max(axis=-1) / FP8_MAX[fp8]).astype(np.float32)
        data = x / scale[..., None]
    else:
        scale = float(np.nanmax(np.abs(x)) / FP8_MAX[fp8])
        data = x / scale
    return np.clip(data, -FP8_MAX[fp8], FP8_MAX[fp8]).astype(fp8), scale


def fp8_ragged_batch(rng, lens_q, lens_k, hq, hkv, d, fp8, per_token, q_dtype):
    """ragged_batch with fp8 k / v (NaN bytes and scales in the rows no sequence owns) and
    their scales: (q, k, v, cu_q, cu_k, {"k_scale": ..., "v_scale": ...})."""
    q, k, v, cu_q, cu_k = ragged_batch(rng, lens_q, lens_k, hq, hkv, d, d, np.float32)
    (k, k_scale), (v, v_scale) = (quantize(rng, x, fp8, per_token) for x in (k, v))
    return q.astype(q_dtype), k, v, cu_q, cu_k, {"k_scale": k_scale, "v_scale": v_scale}


def fp8_step(rng, new, lens, hq, hkv, d, page_size, fp8, per_token, q_dtype, layout="HND"):
    """A PagedBatch over fp8 pools (NaN bytes and scales past every live length and in unused
    pages) and their scales."""
    step = PagedBatch(rng, new, lens, hq, hkv, d, page_size, np.float32, layout)
    step.q = step.q.astype(q_dtype)
    (step.k_pool, k_scale), (step.v_pool, v_scale) = (quantize(rng, pool, fp8, per_token)
                                                      for pool in (step.k_pool, step.v_pool))
    return step, {"k_scale": k_scale, "v_scale": v_scale}


def run_ragged(rng, q, k, v, cu_q, cu_k, **options):
    guard = GuardedRows(rng, q.shape[0], q.shape[1], v.shape[2], q.dtype)
    ptxattn.ragged_attention(*(ptxattn.asarray(x) for x in (q, k, v, cu_q, cu_k)), **on_device(options),
                             **guard.kwargs)
    return guard.check(covered_rows(q.shape[0], cu_q))


def kernels(op, *args, **kwargs) -> list[str]:
    """The kernels a call of `op` launches (a prepared call's)."""
    return [launch.name for launch in ptxattn.prepare(op, *args, **kwargs).launches]


def tile_kernel(q_dtype, d: int, wgmma: bool) -> str:
    name = "bf16" if np.dtype(q_dtype) == BF16 else "f16"
    return f"flash_fwd_sm90_{name}_d{d}_general_fp8" if wgmma else f"flash_fwd_{name}_d{d}_general_fp8"


# ---- ragged_attention --------------------------------------------------------------------------
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("per_token", GRANULARITY, ids=GRANULARITY_IDS)
@pytest.mark.parametrize("q_dtype", Q_DTYPES, ids=Q_IDS)
@pytest.mark.parametrize("fp8", FP8, ids=FP8_IDS)
def test_ragged_matches_reference(rng, fp8, q_dtype, per_token, d):
    lens_q = list(rng.permutation(EDGE_LENGTHS)[:8])
    lens_k = [n + int(rng.integers(0, 80)) for n in lens_q]  # a prefix, as a chunk has
    lens_k[0] = 0  # a sequence with queries but no keys: o = 0, lse = -inf
    q, k, v, cu_q, cu_k, scales = fp8_ragged_batch(rng, lens_q, lens_k, 8, 2, d, fp8, per_token, q_dtype)
    for options in ({"causal": True}, {}, {"causal": True, "window": (40, 0), "softcap": 20.0},
                    {"window": (33, 17), "sinks": rng.standard_normal(8).astype(np.float32), "scale": 0.05}):
        o, lse = run_ragged(rng, q, k, v, cu_q, cu_k, **options, **scales)
        ref_o, ref_lse = reference.ragged_attention(q, k, v, cu_q, cu_k, **options, **scales)
        check_rows(o, lse, ref_o, ref_lse, covered_rows(q.shape[0], cu_q), BF16)


@pytest.mark.parametrize("per_token", GRANULARITY, ids=GRANULARITY_IDS)
@pytest.mark.parametrize("fp8", FP8, ids=FP8_IDS)
def test_ragged_unaligned_queries_run_the_mma_sync_kernel(rng, fp8, per_token):
    """q's heads 132 elements apart (not a multiple of 8): no 16-byte vector I/O, so the mma.sync
    fp8 kernel runs, on sm_90 too."""
    lens = [int(x) for x in rng.integers(1, 400, 6)]
    q, k, v, cu_q, cu_k, scales = fp8_ragged_batch(rng, lens, lens, 4, 2, 128, fp8, per_token, BF16)
    padded = ptxattn.asarray(np.concatenate([q, rand(rng, q.shape[:2] + (4,), BF16)], axis=2))
    q_view = ptxattn.DeviceArray(padded.ptr, q.shape, BF16, padded.strides, padded.device, padded)
    args = (q_view, *(ptxattn.asarray(x) for x in (k, v, cu_q, cu_k)))
    device_scales = on_device(scales)
    assert tile_kernel(BF16, 128, wgmma=False) in kernels(ptxattn.ragged_attention, *args, causal=True,
                                                         **device_scales)
    guard = GuardedRows(rng, q.shape[0], q.shape[1], 128, BF16)
    ptxattn.ragged_attention(*args, causal=True, **device_scales, **guard.kwargs)
    o, lse = guard.check(covered_rows(q.shape[0], cu_q))
    check_rows(o, lse, *reference.ragged_attention(q, k, v, cu_q, cu_k, causal=True, **scales),
               covered_rows(q.shape[0], cu_q), BF16)


def test_aligned_calls_run_the_wgmma_kernels_on_sm90(rng):
    device = ptxattn.get_device(0)
    lens = [70, 200]
    q, k, v, cu_q, cu_k, scales = fp8_ragged_batch(rng, lens, lens, 4, 2, 64, FP8[0], True, np.float16)
    names = kernels(ptxattn.ragged_attention, *(ptxattn.asarray(x) for x in (q, k, v, cu_q, cu_k)),
                    **on_device(scales))
    assert names == [tile_kernel(np.float16, 64, runs_wgmma(device))]
    step, scales = fp8_step(rng, [1, 90], [40, 300], 8, 2, 128, 16, FP8[1], False, BF16)
    names = kernels(ptxattn.paged_attention, *step.device_args(), decode_queries=1, **scales)
    assert tile_kernel(BF16, 128, runs_wgmma(device)) in names and "decode_split_bf16_e5m2_d128" in names


def test_numpy_in_numpy_out(rng):
    lens_q, lens_k = [5, 0, 130], [40, 7, 130]
    q, k, v, cu_q, cu_k, scales = fp8_ragged_batch(rng, lens_q, lens_k, 4, 4, 64, FP8[1], False, np.float16)
    o, lse = ptxattn.ragged_attention(q, k, v, cu_q, cu_k, causal=True, return_lse=True, **scales)
    assert isinstance(o, np.ndarray) and o.dtype == np.float16
    check_rows(o, lse, *reference.ragged_attention(q, k, v, cu_q, cu_k, causal=True, **scales),
               covered_rows(q.shape[0], cu_q), BF16)
    outside = ~covered_rows(q.shape[0], cu_q)
    assert (o[outside].astype(np.float32) == 0).all() and (lse[outside] == -np.inf).all()


# ---- paged_attention ---------------------------------------------------------------------------
@pytest.mark.parametrize("decode_queries", [0, 4])
@pytest.mark.parametrize("layout", ["HND", "NHD"])
@pytest.mark.parametrize("page_size", [16, 64])
@pytest.mark.parametrize("per_token", GRANULARITY, ids=GRANULARITY_IDS)
@pytest.mark.parametrize("fp8", FP8, ids=FP8_IDS)
def test_paged_mixed_batch_matches_reference(rng, fp8, per_token, page_size, layout, decode_queries):
    new, lens = mixed_step(rng, page_size)
    step, scales = fp8_step(rng, new, lens, 8, 2, 128, page_size, fp8, per_token, BF16, layout)
    o, lse = step.run(rng, decode_queries=decode_queries, **scales)
    check_rows(o, lse, *step.reference(**scales), covered_rows(step.q.shape[0], step.qo), BF16)


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("q_dtype", Q_DTYPES, ids=Q_IDS)
@pytest.mark.parametrize("fp8", FP8, ids=FP8_IDS)
def test_paged_query_dtypes_options_and_gqa(rng, fp8, q_dtype, d):
    new, lens = mixed_step(rng, 16)
    for group, per_token, options in ((1, True, {}), (4, False, {"window": (50, 0), "softcap": 30.0}),
                                      (8, True, {"sinks": rng.standard_normal(16).astype(np.float32),
                                                 "scale": 0.05})):
        step, scales = fp8_step(rng, new, lens, 2 * group, 2, d, 16, fp8, per_token, q_dtype, "NHD")
        if "sinks" in options:
            options["sinks"] = options["sinks"][: 2 * group]
        o, lse = step.run(rng, decode_queries=4, **options, **scales)
        check_rows(o, lse, *step.reference(**options, **scales), covered_rows(step.q.shape[0], step.qo), BF16)


@pytest.mark.parametrize("per_token", GRANULARITY, ids=GRANULARITY_IDS)
def test_paged_prefill_bits_equal_ragged_over_the_same_keys(rng, per_token):
    new, lens = [300, 65, 129, 1], [300, 400, 829, 33]
    step, scales = fp8_step(rng, new, lens, 8, 2, 128, 16, FP8[0], per_token, BF16, "NHD")
    o = ptxattn.paged_attention(*step.device_args(), layout="NHD", decode_queries=0, **on_device(scales)).get()
    capacity = step.max_pages * 16

    def packed(pool):  # the rows' live tokens, token-major, in sequence order
        cache = reference.gather_pages(pool, step.table, capacity, "NHD")
        return np.concatenate([cache[b, :, :n].swapaxes(0, 1) for b, n in enumerate(lens)])

    k, v = packed(step.k_pool), packed(step.v_pool)
    if per_token:  # scales shaped like the pools less their last axis: gathered as the values are
        k_scale, v_scale = (packed(scales[name][..., None])[..., 0] for name in ("k_scale", "v_scale"))
    else:
        k_scale, v_scale = scales["k_scale"], scales["v_scale"]
    ragged = ptxattn.ragged_attention(step.q, k, v, step.qo, offsets(lens), causal=True, k_scale=k_scale,
                                      v_scale=v_scale)
    assert o.tobytes() == ragged.tobytes()


@pytest.mark.parametrize("per_token", GRANULARITY, ids=GRANULARITY_IDS)
def test_paged_decode_rows_bits_equal_paged_decode(rng, per_token):
    """Sequences of exactly decode_queries new queries get paged_decode's bits."""
    rows, batch = 3, 6
    lens = [int(x) for x in rng.integers(rows, 3000, batch)]
    step, scales = fp8_step(rng, [rows] * batch, lens, 32, 8, 128, 16, FP8[1], per_token, np.float16)
    scales = on_device(scales)
    o, lse = ptxattn.paged_attention(*step.device_args(), decode_queries=rows, return_lse=True, **scales)
    q_dense = step.q[: batch * rows].reshape(batch, rows, 32, 128).transpose(0, 2, 1, 3)
    do, dlse = ptxattn.paged_decode(ptxattn.asarray(np.ascontiguousarray(q_dense)),
                                    *(ptxattn.asarray(x) for x in (step.k_pool, step.v_pool, step.table, step.lens)),
                                    return_lse=True, **scales)
    assert o.get()[: batch * rows].tobytes() == np.ascontiguousarray(do.get().transpose(0, 2, 1, 3)).reshape(
        batch * rows, 32, 128).tobytes()
    assert lse.get()[: batch * rows].tobytes() == np.ascontiguousarray(dlse.get().transpose(0, 2, 1)).reshape(
        batch * rows, 32).tobytes()


@pytest.mark.parametrize("fp8", FP8, ids=FP8_IDS)
def test_one_captured_step_replays_bitwise_equal_to_eager(rng, fp8):
    """A prepared fp8 step (per-token scales) captured once and replayed over five batch mixes,
    offsets, lengths, tables, queries and K scales rewritten on the device in between."""
    dev = ptxattn.get_device(0)
    stream = ptxattn.Stream.create(device=dev)
    budget = StepBudget(rng, stream, max_seqs=32, max_pages=8, page_size=64, pages=32 * 8, budget=400, hq=16, d=128)
    (k_host, k_scale_host), (v_host, v_scale_host) = (
        quantize(rng, rng.standard_normal((budget.pages, 4, 64, 128)).astype(np.float32), fp8, True) for _ in range(2))
    k_pool, v_pool, k_scale, v_scale = (ptxattn.asarray(x, stream) for x in (k_host, v_host, k_scale_host,
                                                                              v_scale_host))
    call = dict(decode_queries=4, k_scale=k_scale, v_scale=v_scale, return_lse=True, stream=stream)
    step = ptxattn.prepare(ptxattn.paged_attention, *budget.args(k_pool, v_pool), **call)
    graph = captured(step, stream, dev)
    eager = functools.partial(ptxattn.paged_attention, *budget.args(k_pool, v_pool), **call)
    for mix in range(5):
        rows = budget.mix(rng)
        k_scale_host = (k_scale_host * rng.uniform(0.5, 2.0, k_scale_host.shape)).astype(np.float32)
        k_scale.set(k_scale_host, stream)
        replayed = replay_equals_eager(graph, step, eager, rows, stream, f"mix {mix}")
        q, qo, table, lens = budget.host()
        ref_o, _ = reference.paged_attention(q, k_host, v_host, qo, table, lens, k_scale=k_scale_host,
                                             v_scale=v_scale_host)
        assert relative_error(replayed[:rows], ref_o[:rows]) <= REL_TOL[BF16]
    ptxattn.check_faults(dev, stream)


def test_bad_page_ids_fault_and_leave_the_context_usable(rng):
    dev = ptxattn.get_device(0)
    stream = ptxattn.Stream.create(device=dev)
    new, lens = mixed_step(rng, 16)
    step, scales = fp8_step(rng, new, lens, 8, 2, 64, 16, FP8[0], True, BF16)
    table = step.table.copy()
    table[0, 3] = step.k_pool.shape[0]  # sequence 0 (300 keys, a prefill chunk) reads page 3
    for decode_queries in (0, 4):
        ptxattn.paged_attention(*(ptxattn.asarray(x, stream) for x in (step.q, step.k_pool, step.v_pool, step.qo,
                                                                         table, step.lens)),
                                decode_queries=decode_queries, stream=stream,
                                **{name: ptxattn.asarray(s, stream) for name, s in scales.items()})
        expect_fault(dev, stream, 1)
    o, lse = step.run(rng, decode_queries=4, **scales)
    check_rows(o, lse, *step.reference(**scales), covered_rows(step.q.shape[0], step.qo), BF16)
    ptxattn.check_faults(dev, stream)


# ---- each arch's PTX -----------------------------------------------------------------------------
def test_kernels_of_the_loaded_arch(rng):
    """One ragged and one paged call per fp8 type against the reference, on the tile kernel
    the loaded arch gives: wgmma on sm_90a, else flash_fwd_fp8's mma.sync (software e4m3
    conversion in its sm_80 PTX, hardware in its sm_89 one). The next test runs it under each
    older arch."""
    wgmma = runs_wgmma(ptxattn.get_device(0))
    for fp8 in FP8:
        lens_q, lens_k = [100, 1, 0, 257], [300, 40, 9, 257]
        q, k, v, cu_q, cu_k, scales = fp8_ragged_batch(rng, lens_q, lens_k, 8, 2, 128, fp8, True, BF16)
        args = tuple(ptxattn.asarray(x) for x in (q, k, v, cu_q, cu_k))
        assert kernels(ptxattn.ragged_attention, *args, causal=True, **on_device(scales)) == \
            [tile_kernel(BF16, 128, wgmma)]
        o, lse = run_ragged(rng, q, k, v, cu_q, cu_k, causal=True, **scales)
        check_rows(o, lse, *reference.ragged_attention(q, k, v, cu_q, cu_k, causal=True, **scales),
                   covered_rows(q.shape[0], cu_q), BF16)
        new, lens = mixed_step(rng, 16)
        step, scales = fp8_step(rng, new, lens, 8, 2, 64, 16, fp8, False, np.float16, "NHD")
        o, lse = step.run(rng, decode_queries=4, **scales)
        check_rows(o, lse, *step.reference(**scales), covered_rows(step.q.shape[0], step.qo), BF16)


@pytest.mark.parametrize("arch", ["sm_80", "sm_89"])
def test_kernels_of_each_older_arch_in_a_fresh_process(arch):
    run_under_arch(f"{__file__}::test_kernels_of_the_loaded_arch", arch)
