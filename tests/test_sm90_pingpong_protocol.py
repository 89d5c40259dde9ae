"""A model of the warp-specialized kernels' synchronization (cu/flash_fwd_sm90_ws.cuh), run on
the CPU under random schedules: a CTA walks several work tiles, and per work tile the
producer's Q and K/V fills and empty-barrier waits, each consumer's full-barrier waits,
releases and ping-pong turns (bar.sync own / bar.arrive the other's, 256 threads = two
warpgroups), in the order the kernel issues them, at tile granularity. The K/V ring and the Q
buffers carry on from one work tile to the next. For sequences of work tiles with every split
of their key tiles between the consumers (passed tiles before and after their own, no tile of
their own, no tile at all), 2 or 3 stages and 1 or 2 Q buffers it checks that nothing
deadlocks, that no named barrier completes on arrivals alone or is left half-arrived at exit,
and that the turns alternate consumer 1, consumer 2, tile by tile, work tile by work tile. The
model mirrors the kernel's code by hand: change one, change the other.
"""
from __future__ import annotations

import random

import pytest

WARPGROUP = 128


class _Work:
    """One work tile: key tiles [begin, end), each consumer's own [my_begin, my_end), and where
    its tiles sit in the ring (ring0 + t) and which Q use it is (None without key tiles)."""

    def __init__(self, begin, end, own1, own2, ring0, q_use):
        self.begin, self.end, self.own, self.ring0, self.q_use = begin, end, {1: own1, 2: own2}, ring0, q_use


def _works(shapes) -> list[_Work]:
    """Work tiles from (begin, end, own1, own2), the ring and Q counts carried as the kernel's
    next_work carries them."""
    works, ring_used, q_used = [], 0, 0
    for begin, end, own1, own2 in shapes:
        works.append(_Work(begin, end, own1, own2, ring_used - begin, q_used if begin < end else None))
        if begin < end:
            ring_used += end - begin
            q_used += 1
    return works


def _consumer(role: int, works: list[_Work]) -> list[tuple]:
    """Consumer `role`'s (1 or 2) blocking and signalling steps, as flash_fwd_ws issues them."""
    ops: list[tuple] = []
    turned = False

    for k, w in enumerate(works):
        def turn_wait(t):
            nonlocal turned
            if role == 2 or turned:
                ops.append(("sync", role))
            turned = True
            ops.append(("issue", (k, t)))  # the turn's wgmmas (none in an empty turn)

        def turn_arrive():
            ops.append(("arrive", 3 - role))

        def empty_turn(t):
            turn_wait(t)
            turn_arrive()

        def pass_tile(t):
            g = w.ring0 + t
            ops.extend([("wait", "K", g), ("release", "K", g), ("wait", "V", g), ("release", "V", g)])

        my_begin, my_end = w.own[role]
        for t in range(w.begin, my_begin):
            pass_tile(t)
            empty_turn(t)
        if my_begin < my_end:
            ops.append(("wait", "Q", w.q_use))
            ops.append(("wait", "K", w.ring0 + my_begin))
            turn_wait(my_begin)
            turn_arrive()
            ops.append(("release", "K", w.ring0 + my_begin))
            for t in range(my_begin + 1, my_end):
                ops.append(("wait", "K", w.ring0 + t))
                turn_wait(t)
                ops.append(("wait", "V", w.ring0 + t - 1))
                turn_arrive()
                ops.extend([("release", "K", w.ring0 + t), ("release", "V", w.ring0 + t - 1)])
            ops.append(("release", "Q", w.q_use))
            ops.append(("wait", "V", w.ring0 + my_end - 1))
            turn_wait(my_end)
            turn_arrive()
            ops.append(("release", "V", w.ring0 + my_end - 1))
        elif w.begin < w.end:
            ops.extend([("wait", "Q", w.q_use), ("release", "Q", w.q_use)])
            empty_turn(my_end)
        for t in range(my_end, w.end):
            pass_tile(t)
            empty_turn(t + 1)
    if role == 1 and turned:
        ops.append(("sync", 1))  # consumer 2's last arrival
    return ops


def _producer(works: list[_Work], stages: int, q_stages: int) -> list[tuple]:
    ops: list[tuple] = []
    for w in works:
        if w.begin >= w.end:
            continue
        if w.q_use >= q_stages:
            ops.append(("wait_empty", "Q", w.q_use - q_stages))
        ops.append(("fill", "Q", w.q_use))
        for t in range(w.begin, w.end):
            g = w.ring0 + t
            for kind in ("K", "V"):
                if g >= stages:
                    ops.append(("wait_empty", kind, g - stages))
                ops.append(("fill", kind, g))
    return ops


def _run(works: list[_Work], stages: int, q_stages: int, rng) -> None:
    programs = {0: _producer(works, stages, q_stages), 1: _consumer(1, works), 2: _consumer(2, works)}
    pc = dict.fromkeys(programs, 0)
    full, releases = set(), {}
    arrived, waiting = {1: 0, 2: 0}, {1: [], 2: []}  # named barriers: threads arrived, warpgroups in bar.sync
    blocked, issued = set(), []
    while True:
        def ready(who):
            if who in blocked or pc[who] == len(programs[who]):
                return False
            op = programs[who][pc[who]]
            return ((op[0] != "wait" or op[1:] in full) and
                    (op[0] != "wait_empty" or releases.get(op[1:], 0) == 2))
        runnable = [who for who in programs if ready(who)]
        if not runnable:
            assert not blocked and all(pc[w] == len(programs[w]) for w in programs), f"deadlock at {pc}"
            assert arrived == {1: 0, 2: 0}, f"a named barrier left half-arrived: {arrived}"
            turns = [(k, t) for k, w in enumerate(works) if w.begin < w.end for t in range(w.begin, w.end + 1)]
            assert issued == [(role, turn) for turn in turns for role in (1, 2)], issued
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


@pytest.mark.parametrize("stages, q_stages", [(2, 1), (2, 2), (3, 2)])
@pytest.mark.parametrize("tiles", range(6))
def test_one_work_tile_turns_alternate_and_cannot_deadlock(stages, q_stages, tiles):
    rng = random.Random(tiles * 10 + stages)
    tile_begin = 3  # the block's range need not start at 0
    tile_end = tile_begin + tiles
    for own1 in _own_ranges(tile_begin, tile_end):
        for own2 in _own_ranges(tile_begin, tile_end):
            for _ in range(3):
                _run(_works([(tile_begin, tile_end, own1, own2)]), stages, q_stages, rng)


def _random_shape(rng):
    begin = rng.randrange(3)
    end = begin + rng.randrange(5)
    return begin, end, rng.choice(_own_ranges(begin, end)), rng.choice(_own_ranges(begin, end))


@pytest.mark.parametrize("stages, q_stages", [(2, 1), (2, 2), (3, 2)])
def test_work_tiles_in_turn_carry_the_ring_and_cannot_deadlock(stages, q_stages):
    rng = random.Random(100 * stages + q_stages)
    for _ in range(400):
        shapes = [_random_shape(rng) for _ in range(rng.randrange(2, 6))]
        _run(_works(shapes), stages, q_stages, rng)
