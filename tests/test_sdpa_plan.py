"""The grid of causal dense sdpa calls (runtime/ops/attention.py heavy_first_grid): runs of
(batch, head) pairs that divide B x Hq, fit the L2 share, stay within the grid's limits, and
are one pair where a head has few query blocks; and the divisors a persistent twin takes its
virtual grid apart with (fast_divisor)."""
from __future__ import annotations

import random
from types import SimpleNamespace

import pytest

from ptxattn.ops.attention import MAX_GRID_YZ, MIN_RUN_BLOCKS, fast_divisor, heavy_first_grid, heavy_run_pairs

L2 = 50 << 20


def test_runs_are_the_largest_divisor_whose_kv_fits():
    # B4 Hq32 S4096 D128 bf16: 2 MiB of K / V a pair, half of 50 MiB holds 12; 8 divides 128.
    assert heavy_run_pairs(L2, 32, 128, 4096 * 256 * 2) == 8
    # Everything fits: one run of all pairs.
    assert heavy_run_pairs(L2, 32, 96, 1024) == 96


def test_a_head_with_few_blocks_keeps_them_together():
    assert heavy_run_pairs(L2, MIN_RUN_BLOCKS - 1, 512, 1024) == 1
    assert heavy_run_pairs(L2, MIN_RUN_BLOCKS, 512, 1024) == 512


def test_pairs_whose_kv_fits_nowhere_run_one_at_a_time():
    assert heavy_run_pairs(L2, 64, 7, 10 * L2) == 1


@pytest.mark.parametrize("pairs", [3 * 65536, MAX_GRID_YZ + 1, 2 * MAX_GRID_YZ])
def test_runs_fit_grid_z(pairs):
    run = heavy_run_pairs(L2, 1, pairs, 1024)
    assert pairs % run == 0 and pairs // run <= MAX_GRID_YZ
    assert all(pairs % n or pairs // n > MAX_GRID_YZ for n in range(1, run)), "the smallest run that fits"


def test_grid_is_pairs_of_a_run_blocks_runs():
    device = SimpleNamespace(l2_bytes=L2)
    assert heavy_first_grid(device, 32, 4, (32, 32), 4096, (128, 128), 2) == (8, 32, 16)
    assert heavy_first_grid(device, 4, 32, (16, 16), 512, (128, 128), 2) == (1, 4, 512)
    # GQA: a kv head's 4 MiB of K / V is shared by its four query heads: 1 MiB a pair, 25 fit.
    assert heavy_first_grid(device, 64, 2, (32, 8), 8192, (128, 128), 2) == (16, 64, 4)


def test_too_many_blocks_for_grid_y_take_the_plain_grid():
    device = SimpleNamespace(l2_bytes=L2)
    assert heavy_first_grid(device, MAX_GRID_YZ + 1, 1, (1, 1), 1, (64, 64), 2) is None


def test_fast_divisors_divide_every_nonnegative_int32_exactly():
    """(n * mul) >> shift, as fast_div computes it in 64-bit unsigned arithmetic, is n // d at the
    edges (0, around each multiple of d, 2**31 - 1) and at random n, for small d, powers of two
    and their neighbours, and random d up to 2**31 - 1; mul fits 32 bits."""
    rng = random.Random(1234)
    divisors = list(range(1, 2049)) + [2 ** k + e for k in range(11, 31) for e in (-1, 0, 1)] + [2 ** 31 - 1]
    divisors += [rng.randrange(1, 2 ** 31) for _ in range(2000)]
    for d in divisors:
        mul, shift = fast_divisor(d)
        assert 0 < mul < 2 ** 32 and shift < 64, (d, mul, shift)
        multiples = [d * rng.randrange(0, (2 ** 31 - 1) // d + 1) for _ in range(20)] + [d, d * ((2 ** 31 - 1) // d)]
        ns = [0, 2 ** 31 - 1] + [m + e for m in multiples for e in (-1, 0, 1) if 0 <= m + e < 2 ** 31]
        ns += [rng.randrange(0, 2 ** 31) for _ in range(20)]
        for n in ns:
            assert (n * mul) % 2 ** 64 >> shift == n // d, (n, d, mul, shift)
