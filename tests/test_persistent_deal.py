"""The persistent twins' deal of their blocks (runtime/ops/persistent_deal.py), checked through a
model of the kernel's persistent_block (cu/flash_fwd_sm90_ws.cuh): every block of the virtual
grid runs once, the CTAs' first blocks stay the snake's, each CTA's dealt blocks come heaviest
first, and a deal is only made where it lightens the busiest CTA in the cost model. No GPU."""
from __future__ import annotations

import itertools
import re
from pathlib import Path

import numpy as np
import pytest

from ptxattn.ops.checks import UNBOUNDED_WINDOW
from ptxattn.ops.persistent_deal import (MIN_GAIN, TAIL_CTAS, TAIL_NONE, TAIL_SLOTS, TailDeal, key_tiles, snake_block,
                                         tail_deal, virtual_block_costs)


def blocks_run(deal: TailDeal | None, n: int, ctas: int) -> list[list[int]]:
    """Each CTA's blocks in order, as persistent_block gives them (a model of the kernel's)."""
    table = deal.table() if deal is not None else None
    runs = []
    for c in range(ctas):
        run, i = [], 0
        while True:
            if deal is not None and i >= deal.tail_round:
                k = i - deal.tail_round
                offset = table[c * TAIL_SLOTS + k] if k < TAIL_SLOTS else TAIL_NONE
                block = n if offset == TAIL_NONE else deal.tail_round * ctas + offset
            else:
                block = snake_block(i, c, ctas)
            if block >= n:
                break
            run.append(block)
            i += 1
        runs.append(run)
    return runs


def causal_costs(batch: int, heads: int, seq: int, *, window=(UNBOUNDED_WINDOW, 0), diag_offset=0, seq_kv=None):
    """A heavy-first dense grid of runs of one (batch, head) pair, as a causal call's twin has."""
    tiles = key_tiles(128, 128, seq, seq if seq_kv is None else seq_kv, *window, diag_offset)
    return virtual_block_costs((1, len(tiles), batch * heads), True, tiles)


SHAPES = [  # (batch, heads, seq): the bench's short causal rows, and heads of 3 to 15 query blocks
    (32, 16, 512), (16, 16, 1024), (64, 16, 512), (8, 16, 1024), (16, 16, 768), (16, 16, 1280), (8, 16, 1920),
    (8, 32, 640), (16, 16, 896), (24, 16, 1152), (12, 16, 1024), (32, 16, 384), (5, 7, 1000),
]


@pytest.mark.parametrize("ctas", [132, 114, 78])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_every_block_runs_once_and_the_busiest_cta_gets_lighter(shape, ctas):
    costs = causal_costs(*shape)
    deal = tail_deal(costs, ctas)
    runs = blocks_run(deal, len(costs), ctas)
    assert sorted(itertools.chain(*runs)) == list(range(len(costs)))
    assert [run[0] for run in runs] == list(range(ctas))  # the kernel starts each CTA on blockIdx.x
    snake = max(sum(costs[b] for b in run) for run in blocks_run(None, len(costs), ctas))
    busiest = max(sum(costs[b] for b in run) for run in runs)
    if deal is not None:
        assert busiest <= snake * (1 - MIN_GAIN), (busiest, snake)
        assert deal.tail_round >= 2 and deal.tail_round % 2 == 0 and len(deal.blocks) == ctas
        for run in runs:
            dealt = [costs[b] for b in run[deal.tail_round:]]
            assert dealt == sorted(dealt, reverse=True), "a CTA's dealt blocks go heaviest first"
    else:
        assert busiest == snake


def test_the_short_causal_rows_get_a_deal_that_evens_out_the_snakes_last_rounds():
    """B32 H16 S512 causal on 132 SMs: 2,048 blocks of 4, 3, 2, 1 key tiles are 15.5 rounds; the
    snake leaves 68 CTAs a 16th block (7 units of work in their last two rounds against 5 or
    less elsewhere), the deal none more than 6."""
    costs = causal_costs(32, 16, 512)
    deal = tail_deal(costs, 132)
    assert deal is not None and deal.tail_round == 14
    snake = [sum(costs[b] for b in run) for run in blocks_run(None, len(costs), 132)]
    dealt = [sum(costs[b] for b in run) for run in blocks_run(deal, len(costs), 132)]
    assert max(snake) == 56 and max(dealt) == 55 and sum(snake) == sum(dealt)


def test_no_deal_where_blocks_are_alike_or_rounds_are_few():
    """Equal blocks (not causal) leave the snake nothing to even out; under three rounds, or more
    CTAs than FlashFwdParams has room for, the snake deals every block."""
    tiles = key_tiles(128, 128, 4096, 4096, UNBOUNDED_WINDOW, UNBOUNDED_WINDOW, 0)
    assert tail_deal(virtual_block_costs((32, 32, 4), False, tiles), 132) is None
    assert tail_deal(causal_costs(2, 16, 1024), 132) is None  # 256 blocks: under two rounds
    assert tail_deal(causal_costs(32, 16, 512)[:132 * 3 - 5], 132) is None  # 2.96 rounds
    assert tail_deal(causal_costs(64, 16, 512), TAIL_CTAS + 1) is None


def test_table_fills_every_slot_of_every_cta():
    deal = TailDeal(2, ((0, 3), (), (1, 2, 4, 5)))
    table = deal.table()
    assert len(table) == TAIL_CTAS * TAIL_SLOTS
    assert table[:12] == [0, 3, TAIL_NONE, TAIL_NONE, TAIL_NONE, TAIL_NONE, TAIL_NONE, TAIL_NONE, 1, 2, 4, 5]
    assert set(table[12:]) == {TAIL_NONE}


@pytest.mark.parametrize("seed", range(6))
def test_key_tiles_are_the_tiles_whose_keys_some_row_of_the_block_sees(seed):
    """Against a brute-force count over every (row, key): causal or windowed, either alignment,
    rows with no key at all."""
    rng = np.random.default_rng(seed)
    seq_q, seq_kv = (int(n) for n in rng.integers(1, 700, 2))
    left = int(rng.choice([UNBOUNDED_WINDOW, rng.integers(0, 300)]))
    right = int(rng.choice([UNBOUNDED_WINDOW, 0, rng.integers(0, 300)]))
    diag = int(rng.choice([0, seq_kv - seq_q]))
    got = key_tiles(128, 64, seq_q, seq_kv, left, right, diag)
    rows, keys = np.arange(seq_q)[:, None], np.arange(seq_kv)[None, :]
    sees = (keys >= rows + diag - left) & (keys <= rows + diag + right)
    want = []
    for m0 in range(0, seq_q, 128):
        seen = np.flatnonzero(sees[m0:m0 + 128].any(axis=0))
        want.append(int(seen[-1] // 64 - seen[0] // 64 + 1) if len(seen) else 0)
    assert got == want, (seq_q, seq_kv, left, right, diag)


def test_heavy_first_grids_cost_their_query_blocks_last_first():
    tiles = [1, 2, 3]
    assert list(virtual_block_costs((2, 3, 1), True, tiles)) == [4, 4, 3, 3, 2, 2]
    assert list(virtual_block_costs((3, 1, 2), False, tiles)) == [2, 3, 4, 2, 3, 4]


def test_table_layout_mirrors_the_kernels():
    """TAIL_CTAS, TAIL_SLOTS and TAIL_NONE as cu/flash_fwd_common.cuh defines them."""
    text = (Path(__file__).resolve().parent.parent / "cu" / "flash_fwd_common.cuh").read_text()
    defined = {name: int(value, 0) for name, value in
               re.findall(r"^constexpr (?:int|unsigned) (TAIL_\w+) = (\w+);", text, flags=re.M)}
    assert defined == {"TAIL_CTAS": TAIL_CTAS, "TAIL_SLOTS": TAIL_SLOTS, "TAIL_NONE": TAIL_NONE}
