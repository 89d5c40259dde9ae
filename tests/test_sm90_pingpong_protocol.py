"""A model of the _ws_pp kernels' synchronization (cu/flash_fwd_sm90_ws.cuh, PINGPONG), run
on the CPU under random schedules: the producer's fills and empty-barrier waits, each
consumer's full-barrier waits, releases and ping-pong turns (bar.sync own / bar.arrive the
next consumer's, 256 threads = two warpgroups), in the order the kernel issues them, at tile
granularity. For two and three consumers, every split of a block's tiles between them
(passed tiles before and after their own, no tile of their own, no tile at all) and 2 or 3
stages it checks that nothing deadlocks, that no named barrier completes on arrivals alone or
is left half-arrived at exit, and that the turns go consumer 1, 2 (, 3), tile by tile. The
model mirrors the kernel's consumer code by hand: change one, change the other.
"""
from __future__ import annotations

import itertools
import random

import pytest

WARPGROUP = 128


def _consumer(role: int, consumers: int, tile_begin: int, tile_end: int, my_begin: int, my_end: int) -> list[tuple]:
    """Consumer `role`'s (1 .. consumers) blocking and signalling steps, as flash_fwd_ws issues
    them."""
    ops: list[tuple] = []

    def turn_wait(t):
        if role != 1 or t > tile_begin:
            ops.append(("sync", role))
        ops.append(("issue", t))  # the turn's wgmmas (none in an empty turn)

    def turn_arrive(t):
        if role != consumers or t < tile_end:
            ops.append(("arrive", role % consumers + 1))

    def empty_turn(t):
        turn_wait(t)
        turn_arrive(t)

    def pass_tile(t):
        ops.extend([("wait", "K", t), ("release", "K", t), ("wait", "V", t), ("release", "V", t)])

    for t in range(tile_begin, my_begin):
        pass_tile(t)
        empty_turn(t)
    if my_begin < my_end:
        ops.append(("wait", "K", my_begin))
        turn_wait(my_begin)
        turn_arrive(my_begin)
        ops.append(("release", "K", my_begin))
        for t in range(my_begin + 1, my_end):
            ops.append(("wait", "K", t))
            turn_wait(t)
            ops.append(("wait", "V", t - 1))
            turn_arrive(t)
            ops.extend([("release", "K", t), ("release", "V", t - 1)])
        ops.append(("wait", "V", my_end - 1))
        turn_wait(my_end)
        turn_arrive(my_end)
        ops.append(("release", "V", my_end - 1))
    elif tile_begin < tile_end:
        empty_turn(my_end)
    for t in range(my_end, tile_end):
        pass_tile(t)
        empty_turn(t + 1)
    return ops


def _producer(tile_begin: int, tile_end: int, stages: int) -> list[tuple]:
    ops: list[tuple] = []
    for t in range(tile_begin, tile_end):
        for kind in ("K", "V"):
            if t - tile_begin >= stages:
                ops.append(("wait_empty", kind, t - stages))
            ops.append(("fill", kind, t))
    return ops


def _run(tile_begin, tile_end, owns, stages, rng) -> None:
    """One random schedule of a block whose consumers own the tile ranges `owns` (one each)."""
    consumers = len(owns)
    programs = {0: _producer(tile_begin, tile_end, stages)}
    programs.update({role: _consumer(role, consumers, tile_begin, tile_end, *own) for role, own in enumerate(owns, 1)})
    pc = dict.fromkeys(programs, 0)
    full, releases = set(), {}
    roles = range(1, consumers + 1)
    arrived, waiting = dict.fromkeys(roles, 0), {r: [] for r in roles}  # named barriers: threads arrived, warpgroups in bar.sync
    blocked, issued = set(), []
    while True:
        def ready(who):
            if who in blocked or pc[who] == len(programs[who]):
                return False
            op = programs[who][pc[who]]
            return ((op[0] != "wait" or op[1:] in full) and
                    (op[0] != "wait_empty" or releases.get(op[1:], 0) == consumers))
        runnable = [who for who in programs if ready(who)]
        if not runnable:
            assert not blocked and all(pc[w] == len(programs[w]) for w in programs), f"deadlock at {pc}"
            assert not any(arrived.values()), f"a named barrier left half-arrived: {arrived}"
            turns = range(tile_begin, tile_end + 1) if tile_begin < tile_end else []
            assert issued == [(role, t) for t in turns for role in roles], issued
            return
        who = rng.choice(runnable)
        op = programs[who][pc[who]]
        pc[who] += 1
        if op[0] == "fill":
            full.add(op[1:])
        elif op[0] == "release":
            releases[op[1:]] = releases.get(op[1:], 0) + 1
        elif op[0] == "issue":
            issued.append((who, op[1]))
        elif op[0] in ("sync", "arrive"):
            bar = op[1]
            arrived[bar] += WARPGROUP
            if op[0] == "sync":
                waiting[bar].append(who)
                blocked.add(who)
            if arrived[bar] == 2 * WARPGROUP:
                assert len(waiting[bar]) == 1, f"barrier {bar} completed with {waiting[bar]} waiting"
                blocked.discard(waiting[bar][0])
                arrived[bar], waiting[bar] = 0, []


def _own_ranges(tile_begin: int, tile_end: int):
    """A consumer's own tiles [my_begin, my_end): any contiguous range, an empty one as the
    kernel leaves it (my_begin = my_end = tile_end)."""
    ranges = {(b, e) for b in range(tile_begin, tile_end + 1) for e in range(b + 1, tile_end + 1)}
    return sorted(ranges | {(tile_end, tile_end)})


@pytest.mark.parametrize("consumers", [2, 3])
@pytest.mark.parametrize("stages", [2, 3])
@pytest.mark.parametrize("tiles", range(6))
def test_pingpong_turns_go_round_and_cannot_deadlock(consumers, stages, tiles):
    rng = random.Random(tiles * 100 + stages * 10 + consumers)
    tile_begin = 3  # the block's range need not start at 0
    tile_end = tile_begin + tiles
    for owns in itertools.product(_own_ranges(tile_begin, tile_end), repeat=consumers):
        for _ in range(3):
            _run(tile_begin, tile_end, owns, stages, rng)
