"""Helpers for the serving-batch GPU tests (ragged_attention, paged_attention; f16/bf16/f32 and
fp8 K/V): packed batches with NaN in the K/V rows no sequence owns, paged steps with NaN past
every live length and in unused pages, guarded packed outputs, and checks over the covered rows."""
from __future__ import annotations

import numpy as np
import pytest

import ptxattn
from ptxattn import reference

from decode_util import check_attention, rand, to_layout
from gpu_util import GuardedOutput

# Lengths at the tile kernels' boundaries (16-row warps, 64- and 192-row blocks, 32..128-key tiles).
EDGE_LENGTHS = [0, 1, 15, 16, 17, 63, 64, 65, 127, 128, 129, 191, 192, 193, 300]


def offsets(lengths, start=0) -> np.ndarray:
    return (start + np.concatenate([[0], np.cumsum(lengths)])).astype(np.int32)


class GuardedRows:
    """Packed o [N, Hq, Dv] / lse [N, Hq] outputs poisoned with NaN in canaries; after the
    call, the rows of `covered` must hold numbers and every other row must still be NaN."""

    def __init__(self, rng, n, hq, dv, dtype) -> None:
        self.o = GuardedOutput((n, hq, dv), dtype, rng)
        self.lse = GuardedOutput((n, hq), np.float32, rng)

    @property
    def kwargs(self) -> dict:
        return {"out": self.o.array, "out_lse": self.lse.array, "return_lse": True}

    def check(self, covered: np.ndarray):
        o, lse = self.o.check(nan_allowed=True), self.lse.check(nan_allowed=True)
        o32 = o.astype(np.float32)
        assert not np.isnan(o32[covered]).any(), "a covered row was not written"
        assert not np.isnan(lse[covered]).any(), "a covered lse was not written"
        assert np.isnan(o32[~covered]).all() and np.isnan(lse[~covered]).all(), "a row no sequence covers was written"
        return o, lse


def covered_rows(n: int, cu: np.ndarray) -> np.ndarray:
    rows = np.zeros(n, bool)
    rows[cu[0]:cu[-1]] = True
    return rows


def check_rows(o, lse, ref_o, ref_lse, covered, dtype) -> None:
    """check_attention over the rows a sequence covers."""
    check_attention(o[covered], lse[covered], ref_o[covered], ref_lse[covered], dtype)


def ragged_batch(rng, lens_q, lens_k, hq, hkv, dqk, dv, dtype, lead=3, tail=5):
    """Packed q / k / v with `lead` rows before and `tail` after the sequences (NaN in k / v,
    random in q) and their offsets."""
    cu_q, cu_k = offsets(lens_q, lead), offsets(lens_k, lead)
    nq, nk = int(cu_q[-1]) + tail, int(cu_k[-1]) + tail
    q = rand(rng, (nq, hq, dqk), dtype)
    k, v = rand(rng, (nk, hkv, dqk), dtype), rand(rng, (nk, hkv, dv), dtype)
    for x in (k, v):
        x[:lead] = np.nan
        x[cu_k[-1]:] = np.nan
    return q, k, v, cu_q, cu_k


def on_device(options: dict) -> dict:
    """The options with their NumPy arrays (sinks, per-token fp8 scales) on the device (a call
    takes all its arrays from one side)."""
    return {k: ptxattn.asarray(v) if isinstance(v, np.ndarray) else v for k, v in options.items()}


class PagedBatch:
    """A serving step over a shuffled pool: sequence b holds lens[b] keys (its cached prefix and
    its n_b new tokens), pages NaN past every live length and in unused pages."""

    def __init__(self, rng, new, lens, hq, hkv, d, page_size, dtype, layout="HND", tail=4, spare_pages=5):
        batch = len(new)
        self.max_pages = max(1, max(-(-n // page_size) for n in lens) + 1)
        pages = batch * self.max_pages + spare_pages
        order = rng.permutation(pages)
        self.table = order[: batch * self.max_pages].reshape(batch, self.max_pages).astype(np.int32)
        pool_hnd = [np.full((pages, hkv, page_size, d), np.nan, np.float32) for _ in range(2)]
        for b, n in enumerate(lens):
            for j in range(-(-n // page_size)):
                live = min(page_size, n - j * page_size)
                for pool in pool_hnd:
                    pool[self.table[b, j], :, :live] = rng.standard_normal((hkv, live, d))
        self.k_pool, self.v_pool = (to_layout(p.astype(dtype), layout) for p in pool_hnd)
        self.qo = offsets(new)
        self.q = rand(rng, (int(self.qo[-1]) + tail, hq, d), dtype)
        self.lens = np.asarray(lens, np.int32)
        self.layout = layout

    def args(self):
        return (self.q, self.k_pool, self.v_pool, self.qo, self.table, self.lens)

    def device_args(self):
        return tuple(ptxattn.asarray(x) for x in self.args())

    def reference(self, **options):
        return reference.paged_attention(*self.args(), layout=self.layout, **options)

    def run(self, rng, **options):
        guard = GuardedRows(rng, self.q.shape[0], self.q.shape[1], self.v_pool.shape[3], self.q.dtype)
        ptxattn.paged_attention(*self.device_args(), layout=self.layout, **on_device(options), **guard.kwargs)
        return guard.check(covered_rows(self.q.shape[0], self.qo))


def mixed_step(rng, page_size):
    """New queries and lengths of a step mixing prefill chunks (some with long cached prefixes),
    decode rows of 1..16 queries, empty sequences and page / tile edges."""
    new = [300, 1, 2, 0, 65, 16, 4, 129, 1, 7, 192]
    lens = [300, 1 + page_size * 9, 2 + page_size - 1, 37, 65 + page_size * 3 + 1, 16, 40, 129 + 700, page_size,
            page_size + 1, 192 + 2 * page_size]
    return new, lens


def expect_fault(dev, stream, code):
    with pytest.raises(ptxattn.DeviceFault) as info:
        ptxattn.check_faults(dev, stream)
    assert info.value.code == code, info.value


class StepBudget:
    """Device arrays of a paged_attention step over fixed budgets: q [budget, Hq, D] bf16, and
    qo_indptr, block_table and seq_lens for max_seqs sequences of max_pages pages of a pool of
    `pages` pages of page_size tokens. `mix` writes a random batch within them."""

    def __init__(self, rng, stream, *, max_seqs, max_pages, page_size, pages, budget, hq, d) -> None:
        self.max_seqs, self.max_pages, self.page_size, self.pages, self.budget = (max_seqs, max_pages, page_size,
                                                                                  pages, budget)
        self.stream = stream
        self.q = ptxattn.asarray(rand(rng, (budget, hq, d), ptxattn.bfloat16), stream)
        self.qo = ptxattn.zeros((max_seqs + 1,), np.int32, stream=stream)
        self.table = ptxattn.zeros((max_seqs, max_pages), np.int32, stream=stream)
        self.lens = ptxattn.zeros((max_seqs,), np.int32, stream=stream)

    def args(self, k_pool, v_pool) -> tuple:
        return self.q, k_pool, v_pool, self.qo, self.table, self.lens

    def mix(self, rng) -> int:
        """Writes new offsets, lengths, a new table and new queries: a random batch of 1..max_seqs
        live sequences (decode rows and prefill chunks) within the budgets. Returns its query
        rows."""
        live = int(rng.integers(1, self.max_seqs + 1))
        new = np.zeros(self.max_seqs, np.int64)
        new[:live] = rng.choice([1, 1, 2, 4, 5, 30, 200], live)
        while new.sum() > self.budget:
            new[int(np.argmax(new))] //= 2
        capacity = self.max_pages * self.page_size
        length = np.minimum(new + rng.integers(0, capacity, self.max_seqs), capacity)
        length[live:] = 0
        table = rng.permutation(self.pages)[: self.max_seqs * self.max_pages].reshape(self.max_seqs, self.max_pages)
        for arr, host in ((self.qo, offsets(new)), (self.lens, length.astype(np.int32)),
                          (self.table, table.astype(np.int32)), (self.q, rand(rng, self.q.shape, ptxattn.bfloat16))):
            arr.set(host, self.stream)
        return int(new.sum())

    def host(self) -> tuple:
        """q, qo_indptr, block_table and seq_lens as they are on the device."""
        return tuple(x.get(self.stream) for x in (self.q, self.qo, self.table, self.lens))


def captured(step, stream, device):
    """A prepared call run once (its modules loaded) and captured into a graph."""
    step.run()
    with ptxattn.capture(stream, device) as graph:
        step.run()
    return graph


def replay_equals_eager(graph, step, eager, rows: int, stream, what: str) -> np.ndarray:
    """Replays `graph` (captured from the prepared `step`) into its outputs, poisoned first, and
    asserts their first `rows` rows equal eager()'s (o, lse) bit for bit; returns the replayed o."""
    out, out_lse = step.arrays["out"], step.arrays["out_lse"]
    out.set(np.full(out.shape, np.nan, np.float32).astype(out.dtype), stream)
    graph.replay(stream)
    replayed, replayed_lse = out.get(stream), out_lse.get(stream)
    eager_o, eager_lse = eager()
    assert replayed[:rows].tobytes() == eager_o.get(stream)[:rows].tobytes(), what
    assert replayed_lse[:rows].tobytes() == eager_lse.get(stream)[:rows].tobytes(), what
    return replayed
