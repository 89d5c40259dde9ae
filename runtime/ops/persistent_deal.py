"""How a persistent twin's CTAs share out the blocks of its virtual grid (cu/flash_fwd_sm90_ws.cuh,
persistent_block).

The kernel deals the blocks in a snake: in round i CTA c takes block i * ctas + c, or
i * ctas + ctas - 1 - c when i is odd, so a causal head's heavy blocks (which come first) pair
with light ones over each two rounds. What the snake cannot even out is its end: the last,
partial round gives some CTAs a block more than the others, whatever its weight, and the kernel
ends with its busiest CTA. So from `tail_round` (the last even round that leaves at least one
full round after it) the host deals the rest itself: heaviest first, each block to the CTA with
the least work so far (longest processing time first), by a cost model of a block's work. Where
that does not beat the snake by MIN_GAIN in the same model, the snake deals every block.
cu/flash_fwd_notes.md v70.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass

import numpy as np

# Mirrors cu/flash_fwd_common.cuh: room for TAIL_SLOTS blocks of each of TAIL_CTAS CTAs in
# FlashFwdParams.tail_blocks, TAIL_NONE ending a CTA's list.
TAIL_CTAS = 132
TAIL_SLOTS = 4
TAIL_NONE = 0xFFFF

# A block's work in the model: its set-up, first key tile and epilogue, and each further key
# tile. A consumer warp ran 1,275 instructions once a block and 505 a further tile at B32 H16
# S512 D128 causal (cu/flash_fwd_notes.md v53); the S512 and S1024 causal rows of the bench get
# the same deal for any ratio from 1.5 to 2.5.
BLOCK_COST = 2.0
TILE_COST = 1.0
MIN_GAIN = 0.005  # the modelled busiest CTA's work must drop by this share


@dataclass(frozen=True)
class TailDeal:
    """From round `tail_round` on, CTA c runs blocks tail_round * ctas + offset for each offset
    of blocks[c] in order (FlashFwdParams.tail_round / tail_blocks)."""
    tail_round: int
    blocks: tuple[tuple[int, ...], ...]

    def table(self) -> list[int]:
        """FlashFwdParams.tail_blocks: TAIL_SLOTS entries a CTA, TAIL_NONE past its list."""
        rows = [list(offsets) + [TAIL_NONE] * (TAIL_SLOTS - len(offsets)) for offsets in self.blocks]
        return [entry for row in rows for entry in row] + [TAIL_NONE] * (TAIL_SLOTS * (TAIL_CTAS - len(rows)))


def key_tiles(rows: int, keys: int, seq_q: int, seq_kv: int, left: int, right: int, diag_offset: int) -> list[int]:
    """Key tiles of each query block of `rows` rows (block_key_tile_range in
    cu/flash_fwd_common.cuh): those of keys [row + diag_offset - left, row + diag_offset + right]
    over the block's rows, inside [0, seq_kv)."""
    tiles = []
    for m0 in range(0, seq_q, rows):
        lo = max(m0 + diag_offset - left, 0)
        hi = min(min(m0 + rows, seq_q) - 1 + diag_offset + right, seq_kv - 1)
        tiles.append(hi // keys + 1 - lo // keys if hi >= lo else 0)
    return tiles


def virtual_block_costs(grid: tuple[int, int, int], heavy_first: bool, block_tiles: list[int]) -> np.ndarray:
    """The modelled work of each block of a virtual grid in launch order (virtual_tile's layout:
    query block x of grid (blocks, Hq, B), or with heavy_first the (gy - 1 - y)-th of grid (pairs
    of a run, blocks, runs)), from the key tiles of each query block."""
    gx, gy, gz = grid
    costs = BLOCK_COST + TILE_COST * (np.asarray(block_tiles, np.float64) - 1)
    if heavy_first:
        return np.broadcast_to(costs[::-1][None, :, None], (gz, gy, gx)).ravel()
    return np.broadcast_to(costs[None, None, :], (gz, gy, gx)).ravel()


def snake_block(i: int, c: int, ctas: int) -> int:
    """The block CTA c runs as its i-th in the snake (persistent_block before the tail)."""
    return i * ctas + (ctas - 1 - c if i & 1 else c)


def _snake_loads(costs: np.ndarray, ctas: int, rounds: int) -> np.ndarray:
    """Each CTA's work over the snake's first `rounds` rounds (past the blocks: none)."""
    dealt = np.zeros(rounds * ctas)
    n = min(len(costs), len(dealt))
    dealt[:n] = costs[:n]
    by_round = dealt.reshape(rounds, ctas)
    by_round[1::2] = by_round[1::2, ::-1]  # odd rounds run from the last CTA back
    return by_round.sum(axis=0)


def tail_deal(costs: np.ndarray, ctas: int) -> TailDeal | None:
    """The deal of the blocks from the last even round with a full round after it, or None where
    the snake deals every block: too few rounds (the CTAs' first blocks stay the snake's), more
    CTAs than FlashFwdParams has room for, a CTA given more than TAIL_SLOTS blocks, or no gain
    of MIN_GAIN on the snake in the model."""
    rounds = len(costs) // ctas  # full rounds
    tail_round = rounds - 1 if (rounds - 1) % 2 == 0 else rounds - 2
    if tail_round < 2 or ctas > TAIL_CTAS:
        return None
    first = tail_round * ctas
    heap = [(float(load), c) for c, load in enumerate(_snake_loads(costs, ctas, tail_round))]
    heapq.heapify(heap)
    blocks: list[list[int]] = [[] for _ in range(ctas)]
    for block in sorted(range(first, len(costs)), key=lambda n: (-costs[n], n)):
        load, c = heapq.heappop(heap)
        blocks[c].append(block - first)
        heapq.heappush(heap, (load + float(costs[block]), c))
    if max(map(len, blocks)) > TAIL_SLOTS:
        return None
    busiest = max(load for load, _ in heap)
    if busiest > _snake_loads(costs, ctas, -(-len(costs) // ctas)).max() * (1 - MIN_GAIN):
        return None
    return TailDeal(tail_round, tuple(tuple(offsets) for offsets in blocks))
