"""ptxattn.merge_states / merge_states_n on the GPU against the float64 reference: states with
no key (lse -inf) whose o holds NaN never leak, sinks join the denominator once, outputs are
NaN-poisoned and framed by canaries; merging two decodes over disjoint halves of a cache gives
the decode over the whole cache (cascade attention)."""
from __future__ import annotations

import numpy as np
import pytest

import ptxattn
from ptxattn import reference

from decode_util import DTYPE_IDS, DTYPES, GuardedAttention, check_attention, nan_tail_cache, rand

pytestmark = pytest.mark.gpu


def random_states(rng, n, shape, dtype):
    o = rand(rng, (n, *shape), dtype)
    lse = (rng.standard_normal((n, *shape[:3])) * 3).astype(np.float32)
    dead = rng.random((n, *shape[:3])) < 0.3
    dead[:, 0, 0, 0] = True  # one row with no key in any state
    lse[dead] = -np.inf
    o[dead] = np.nan
    return o, lse


@pytest.mark.parametrize("sinks", [False, True])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_two_way(rng, dtype, sinks):
    shape = (3, 4, 5, 72 if dtype != np.float32 else 36)
    o, lse = random_states(rng, 2, shape, dtype)
    sink = rng.standard_normal(4).astype(np.float32) if sinks else None
    guard = GuardedAttention(rng, shape, dtype)
    ptxattn.merge_states(ptxattn.asarray(o[0]), ptxattn.asarray(lse[0]), ptxattn.asarray(o[1]),
                         ptxattn.asarray(lse[1]), sinks=ptxattn.asarray(sink) if sinks else None,
                         out=guard.o.array, out_lse=guard.lse.array)
    got_o, got_lse = guard.check()
    check_attention(got_o, got_lse, *reference.merge_states(o, lse, sinks=sink), dtype)


@pytest.mark.parametrize("n", [1, 5, 40])
def test_n_way_numpy(rng, n):
    o, lse = random_states(rng, n, (2, 3, 4, 64), ptxattn.bfloat16)
    got_o, got_lse = ptxattn.merge_states_n(o, lse)
    check_attention(got_o, got_lse, *reference.merge_states(o, lse), ptxattn.bfloat16)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_cascade_of_two_decodes_is_one_decode(rng, dtype):
    batch, hq, hkv, d, half = 3, 8, 2, 64, 256
    lens = np.array([half * 2, half + 9, 3], np.int32)
    k = nan_tail_cache(rng, batch, hkv, 2 * half, d, dtype, lens)
    v = nan_tail_cache(rng, batch, hkv, 2 * half, d, dtype, lens)
    q = rand(rng, (batch, hq, 1, d), dtype)
    first = np.minimum(lens, half).astype(np.int32)
    second = (lens - first).astype(np.int32)
    o1, l1 = ptxattn.decode(q, np.ascontiguousarray(k[:, :, :half]), np.ascontiguousarray(v[:, :, :half]), first,
                            return_lse=True)
    o2, l2 = ptxattn.decode(q, np.ascontiguousarray(k[:, :, half:]), np.ascontiguousarray(v[:, :, half:]), second,
                            return_lse=True)
    o, lse = ptxattn.merge_states(o1, l1, o2, l2)
    check_attention(o, lse, *reference.decode(q, k, v, lens), dtype)
