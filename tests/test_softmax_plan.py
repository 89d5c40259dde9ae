"""Launch planning for softmax (host arithmetic, CPU only): every shape gets a kernel whose
launch bounds, register tiles and grid-stride loops cover it."""
from __future__ import annotations

import itertools

import pytest

from ptxattn.ops import softmax as sm

LENGTHS = [1, 2, 7, 31, 32, 33, 97, 1000, 1024, 1025, 4096, 16384, 16385, 100000]
COUNTS = [1, 3, 127, 4097, 1 << 20]


@pytest.mark.parametrize("outer, length", list(itertools.product(COUNTS, LENGTHS)))
def test_rows(outer, length):
    plan = sm.plan(outer, length, 1)
    threads = plan.block[0]
    assert plan.block[1:] == (1, 1) and plan.grid[1:] == (1, 1)
    assert 1 <= plan.grid[0] <= sm.GRID_CAP
    if plan.kernel == "rows_warp":
        lanes = plan.lanes_per_row
        assert threads == sm.WARP_CTA_THREADS and lanes in (1, 2, 4, 8, 16, 32)
        assert length <= lanes * sm.TILE, "the row must fit its lanes' registers"
        assert lanes == 1 or length > lanes // 2 * sm.TILE, "no lane left holding only padding"
        assert plan.grid[0] == min(-(-outer // (threads // lanes)), sm.GRID_CAP)
    else:
        assert plan.kernel == "rows_block" and length > 32 * sm.TILE
        assert threads % 32 == 0 and threads <= sm.MAX_ROW_THREADS
        assert length <= threads * sm.TILE or threads == sm.MAX_ROW_THREADS
        assert plan.grid[0] == min(outer, sm.GRID_CAP)


@pytest.mark.parametrize("outer, length, inner", [
    (1, 100000, 2), (3, 4, 5), (3, 5, 4), (64, 4, 64), (1, 7, 1 << 20), (1025, 2, 1024), (2, 1, 3),
])
def test_columns(outer, length, inner):
    plan = sm.plan(outer, length, inner)
    assert plan.kernel == "cols"
    per_cta, splits, one = plan.block
    columns = outer * inner
    assert one == 1 and per_cta * splits <= sm.COL_CTA_THREADS
    assert splits <= max(1, length), "no thread without a single element of its column"
    assert per_cta >= min(32, columns), "a warp's worth of adjacent columns when there are that many"
    assert 1 <= plan.grid[0] <= sm.GRID_CAP
    assert plan.grid[0] == min(-(-columns // per_cta), sm.GRID_CAP)


def test_few_columns_split_the_length():
    assert sm.plan(1, 100000, 2).block[1] > 1
    assert sm.plan(1, 1000, 1 << 20).block == (sm.COL_CTA_THREADS, 1, 1)
