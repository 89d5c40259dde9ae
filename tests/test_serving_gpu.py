"""ragged_attention and paged_attention on the GPU: random serving batches (lengths 0, 1 and
tile / page boundaries +-1, prefix-cache hits, prefill chunks mixed with decode rows) against
the float64 reference, with NaN-poisoned, canary-framed outputs, NaN in K/V rows no sequence
owns and past every live length; a sequence's bits independent of its batch and equal to the
dense kernels' (sdpa, paged_decode) on the same keys; one captured step replayed over ten
batch mixes, bitwise equal to eager; bad offsets, lengths and page ids raise DeviceFault and
leave the context usable."""
from __future__ import annotations

import functools

import numpy as np
import pytest

import ptxattn
from ptxattn import reference

from decode_util import DTYPE_IDS, DTYPES, rand
from gpu_util import REL_TOL, relative_error
from serving_util import (EDGE_LENGTHS, GuardedRows, PagedBatch, StepBudget, captured, check_rows, covered_rows,
                          expect_fault, mixed_step, offsets, on_device, ragged_batch, replay_equals_eager)

pytestmark = pytest.mark.gpu

BF16 = ptxattn.bfloat16


def run_ragged(rng, q, k, v, cu_q, cu_k, **options):
    guard = GuardedRows(rng, q.shape[0], q.shape[1], v.shape[2], q.dtype)
    ptxattn.ragged_attention(ptxattn.asarray(q), ptxattn.asarray(k), ptxattn.asarray(v), ptxattn.asarray(cu_q),
                             ptxattn.asarray(cu_k), **on_device(options), **guard.kwargs)
    return guard.check(covered_rows(q.shape[0], cu_q))


# ---- ragged_attention --------------------------------------------------------------------------
@pytest.mark.parametrize("dims", [(64, 64), (128, 128), (96, 96), (192, 128), (256, 256)],
                         ids=["d64", "d128", "d96", "d192_128", "d256"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_ragged_matches_reference(rng, dtype, dims):
    dqk, dv = dims
    if np.dtype(dtype) == np.float32 and dv > 128:
        dqk, dv = 128, 128
    lens_q = list(rng.permutation(EDGE_LENGTHS)[:8])
    lens_k = [n + int(rng.integers(0, 80)) for n in lens_q]  # a prefix, as a chunk has
    lens_k[0] = 0  # a sequence with queries but no keys
    q, k, v, cu_q, cu_k = ragged_batch(rng, lens_q, lens_k, 8, 2, dqk, dv, dtype)
    for options in ({"causal": True}, {}, {"causal": True, "window": (40, 0), "softcap": 20.0},
                    {"window": (33, 17), "sinks": rng.standard_normal(8).astype(np.float32)}):
        o, lse = run_ragged(rng, q, k, v, cu_q, cu_k, **options)
        ref_o, ref_lse = reference.ragged_attention(q, k, v, cu_q, cu_k, **options)
        check_rows(o, lse, ref_o, ref_lse, covered_rows(q.shape[0], cu_q), dtype)


@pytest.mark.parametrize("group", [1, 4, 8])
def test_ragged_gqa_random_lengths(rng, group):
    hkv = 2
    lens_q = [int(x) for x in rng.integers(0, 700, 12)]
    lens_k = [n + int(rng.integers(0, 300)) for n in lens_q]
    q, k, v, cu_q, cu_k = ragged_batch(rng, lens_q, lens_k, hkv * group, hkv, 128, 128, BF16)
    o, lse = run_ragged(rng, q, k, v, cu_q, cu_k, causal=True)
    check_rows(o, lse, *reference.ragged_attention(q, k, v, cu_q, cu_k, causal=True),
               covered_rows(q.shape[0], cu_q), BF16)


@pytest.mark.parametrize("dims", [(64, 64), (128, 128), (192, 128)], ids=["d64", "d128", "d192_128"])
def test_ragged_bits_equal_dense_sdpa_and_ignore_the_batch(rng, dims):
    """Each sequence gets the bits sdpa gives it alone (bottom-right causal), whatever shares
    its batch and wherever it sits."""
    dqk, dv = dims
    lens_q, lens_k = [200, 1, 77, 0, 513], [260, 40, 77, 9, 513]
    q, k, v, cu_q, cu_k = ragged_batch(rng, lens_q, lens_k, 8, 2, dqk, dv, BF16)
    o, lse = ptxattn.ragged_attention(q, k, v, cu_q, cu_k, causal=True, return_lse=True)
    for b in range(len(lens_q)):
        qs, ks = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        dense = [np.ascontiguousarray(x[s].transpose(1, 0, 2)[None]) for x, s in ((q, qs), (k, ks), (v, ks))]
        if lens_q[b] == 0:
            continue
        do, dlse = ptxattn.sdpa(*dense, causal=True, causal_align="bottom_right", return_lse=True)
        assert o[qs].tobytes() == np.ascontiguousarray(do[0].transpose(1, 0, 2)).tobytes(), f"sequence {b}"
        assert lse[qs].tobytes() == np.ascontiguousarray(dlse[0].T).tobytes(), f"sequence {b}"
    # Sequence 2 again, now first in another batch at another offset.
    others_q, others_k = [77, 300, 5], [77, 310, 500]
    q2, k2, v2, cu_q2, cu_k2 = ragged_batch(rng, others_q, others_k, 8, 2, dqk, dv, BF16, lead=11)
    q2[cu_q2[0]:cu_q2[1]], k2[cu_k2[0]:cu_k2[1]], v2[cu_k2[0]:cu_k2[1]] = (
        q[cu_q[2]:cu_q[3]], k[cu_k[2]:cu_k[3]], v[cu_k[2]:cu_k[3]])
    o2 = ptxattn.ragged_attention(q2, k2, v2, cu_q2, cu_k2, causal=True)
    assert o2[cu_q2[0]:cu_q2[1]].tobytes() == o[cu_q[2]:cu_q[3]].tobytes()


def test_ragged_run_to_run_bitwise(rng):
    lens = [int(x) for x in rng.integers(1, 2000, 6)]
    q, k, v, cu_q, cu_k = ragged_batch(rng, lens, lens, 16, 4, 128, 128, BF16)
    args = [ptxattn.asarray(x) for x in (q, k, v, cu_q, cu_k)]
    first = ptxattn.ragged_attention(*args, causal=True).get()
    for _ in range(3):
        assert ptxattn.ragged_attention(*args, causal=True).get().tobytes() == first.tobytes()


def test_ragged_made_output_is_zero_outside_the_sequences(rng):
    q, k, v, cu_q, cu_k = ragged_batch(rng, [5, 9], [5, 20], 4, 4, 64, 64, BF16, lead=2, tail=3)
    o, lse = ptxattn.ragged_attention(q, k, v, cu_q, cu_k, return_lse=True)
    outside = ~covered_rows(q.shape[0], cu_q)
    assert (o[outside].astype(np.float32) == 0).all() and (lse[outside] == -np.inf).all()


# ---- paged_attention ---------------------------------------------------------------------------
@pytest.mark.parametrize("decode_queries", [0, 1, 4, 16])
@pytest.mark.parametrize("layout", ["HND", "NHD"])
@pytest.mark.parametrize("page_size", [8, 16, 64, 256])
def test_paged_mixed_batch_matches_reference(rng, page_size, layout, decode_queries):
    new, lens = mixed_step(rng, page_size)
    step = PagedBatch(rng, new, lens, 8, 2, 128, page_size, BF16, layout)
    o, lse = step.run(rng, decode_queries=decode_queries)
    check_rows(o, lse, *step.reference(), covered_rows(step.q.shape[0], step.qo), BF16)


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_paged_dtypes_options_and_gqa(rng, dtype, d):
    if np.dtype(dtype) == np.float32 and d > 128:
        d = 128
    new, lens = mixed_step(rng, 16)
    for group, options in ((1, {}), (4, {"window": (50, 0), "softcap": 30.0}),
                           (8, {"sinks": rng.standard_normal(16).astype(np.float32), "scale": 0.05})):
        step = PagedBatch(rng, new, lens, 2 * group, 2, d, 16, dtype)
        if "sinks" in options:
            options["sinks"] = options["sinks"][: 2 * group]
        o, lse = step.run(rng, decode_queries=4, **options)
        check_rows(o, lse, *step.reference(**options), covered_rows(step.q.shape[0], step.qo), dtype)


def test_paged_prefill_bits_equal_ragged_over_the_same_keys(rng):
    new, lens = [300, 65, 129, 1], [300, 400, 829, 33]
    step = PagedBatch(rng, new, lens, 8, 2, 128, 16, BF16, "NHD")
    o = ptxattn.paged_attention(*step.device_args(), layout="NHD", decode_queries=0).get()
    keys = [reference.gather_pages(p, step.table, step.max_pages * 16, "NHD") for p in (step.k_pool, step.v_pool)]
    packed = [np.concatenate([c[b, :, :n].transpose(1, 0, 2) for b, n in enumerate(lens)]) for c in keys]
    ragged = ptxattn.ragged_attention(step.q, *packed, step.qo, offsets(lens), causal=True)
    assert o.tobytes() == ragged.tobytes()


def test_paged_decode_rows_bits_equal_paged_decode(rng):
    """Sequences of exactly decode_queries new queries get paged_decode's bits."""
    rows, batch = 3, 6
    lens = [int(x) for x in rng.integers(rows, 3000, batch)]
    step = PagedBatch(rng, [rows] * batch, lens, 32, 8, 128, 16, BF16)
    o, lse = ptxattn.paged_attention(*step.device_args(), decode_queries=rows, return_lse=True)
    q_dense = step.q[: batch * rows].reshape(batch, rows, 32, 128).transpose(0, 2, 1, 3)
    do, dlse = ptxattn.paged_decode(np.ascontiguousarray(q_dense), step.k_pool, step.v_pool, step.table, step.lens,
                                    return_lse=True)
    assert o.get()[: batch * rows].tobytes() == np.ascontiguousarray(do.transpose(0, 2, 1, 3)).reshape(
        batch * rows, 32, 128).tobytes()
    assert lse.get()[: batch * rows].tobytes() == np.ascontiguousarray(dlse.transpose(0, 2, 1)).reshape(
        batch * rows, 32).tobytes()


def test_paged_sequence_bits_ignore_the_batch(rng):
    new, lens = mixed_step(rng, 16)
    step = PagedBatch(rng, new, lens, 8, 2, 128, 16, BF16)
    o = ptxattn.paged_attention(*step.args(), decode_queries=4)
    # The same pool, the sequences in reverse order, padded with two empty ones.
    order = list(range(len(new)))[::-1]
    q = np.concatenate([step.q[step.qo[b]:step.qo[b + 1]] for b in order] + [step.q[-4:]])
    table = np.concatenate([step.table[order], step.table[:2]])
    qo = offsets([new[b] for b in order] + [0, 0])
    lens2 = np.concatenate([step.lens[order], [0, 0]]).astype(np.int32)
    o2 = ptxattn.paged_attention(q, step.k_pool, step.v_pool, qo, table, lens2, decode_queries=4)
    for i, b in enumerate(order):
        assert o2[qo[i]:qo[i + 1]].tobytes() == o[step.qo[b]:step.qo[b + 1]].tobytes(), f"sequence {b}"


def test_one_captured_step_serves_ten_batch_mixes(rng):
    """Fixed budgets (64 sequences of 8 pages, 600 query rows): one prepared call captured once,
    replayed with new offsets, lengths, tables and queries written on the device in between,
    equals the eager call bit for bit each time."""
    dev = ptxattn.get_device(0)
    stream = ptxattn.Stream.create(device=dev)
    budget = StepBudget(rng, stream, max_seqs=64, max_pages=8, page_size=64, pages=64 * 8, budget=600, hq=16, d=128)
    k_pool, v_pool = (ptxattn.asarray(rand(rng, (budget.pages, 4, 64, 128), BF16), stream) for _ in range(2))
    call = dict(decode_queries=4, return_lse=True, stream=stream)
    step = ptxattn.prepare(ptxattn.paged_attention, *budget.args(k_pool, v_pool), **call)
    graph = captured(step, stream, dev)
    eager = functools.partial(ptxattn.paged_attention, *budget.args(k_pool, v_pool), **call)
    for mix in range(10):
        rows = budget.mix(rng)
        replayed = replay_equals_eager(graph, step, eager, rows, stream, f"mix {mix}")
        q, qo, table, lens = budget.host()
        ref_o, _ = reference.paged_attention(q, k_pool.get(stream), v_pool.get(stream), qo, table, lens)
        assert relative_error(replayed[:rows], ref_o[:rows]) <= REL_TOL[BF16]
    ptxattn.check_faults(dev, stream)


# ---- faults -------------------------------------------------------------------------------------
def test_bad_offsets_lengths_and_pages_fault_and_leave_the_context_usable(rng):
    dev = ptxattn.get_device(0)
    stream = ptxattn.Stream.create(device=dev)
    q, k, v, cu_q, cu_k = ragged_batch(rng, [40, 70, 9], [40, 80, 9], 8, 2, 64, 64, BF16)
    device = [ptxattn.asarray(x, stream) for x in (q, k, v)]
    bad_q = cu_q.copy()
    bad_q[2] = bad_q[1] - 1  # decreasing
    ptxattn.ragged_attention(*device, ptxattn.asarray(bad_q, stream), ptxattn.asarray(cu_k, stream), stream=stream)
    expect_fault(dev, stream, 5)
    bad_k = cu_k.copy()
    bad_k[-1] = k.shape[0] + 1  # past the packed keys
    ptxattn.ragged_attention(*device, ptxattn.asarray(cu_q, stream), ptxattn.asarray(bad_k, stream), stream=stream)
    expect_fault(dev, stream, 5)

    new, lens = mixed_step(rng, 16)
    step = PagedBatch(rng, new, lens, 8, 2, 64, 16, BF16)
    for decode_queries in (0, 4):
        table = step.table.copy()
        table[0, 3] = step.k_pool.shape[0]  # sequence 0 (300 keys) reads page 3
        ptxattn.paged_attention(*[ptxattn.asarray(x, stream) for x in (step.q, step.k_pool, step.v_pool, step.qo)],
                                ptxattn.asarray(table, stream), ptxattn.asarray(step.lens, stream),
                                decode_queries=decode_queries, stream=stream)
        expect_fault(dev, stream, 1)
        for b, code in ((0, 2), (1, 2), (2, 4)):  # a prefill row past capacity, a decode row, a negative one
            bad = step.lens.copy()
            bad[b] = step.max_pages * 16 + 1 if code == 2 else -1
            ptxattn.paged_attention(*[ptxattn.asarray(x, stream) for x in (step.q, step.k_pool, step.v_pool, step.qo,
                                                                            step.table, bad)],
                                    decode_queries=decode_queries, stream=stream)
            expect_fault(dev, stream, code)
    # The context still works and computes the right thing.
    o, lse = step.run(rng, decode_queries=4)
    check_rows(o, lse, *step.reference(), covered_rows(step.q.shape[0], step.qo), BF16)
    ptxattn.check_faults(dev, stream)
