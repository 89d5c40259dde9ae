"""ptxattn.paged_decode and paged_kv_append on the GPU: shuffled page tables, both pool
layouts (and K / V in different ones), page sizes 8..256, NaN in unused pages and past each
row's length; the same bits as the contiguous decode of the same keys; append through
int32 / int64 slot mappings with skipped tokens; out-of-pool pages and slots raise after
synchronization and leave the context usable."""
from __future__ import annotations

import numpy as np
import pytest

import ptxattn
from ptxattn import reference

from decode_util import (DTYPE_IDS, DTYPES, GuardedAttention, check_attention, nan_tail_cache, paginate, rand,
                         to_layout)

pytestmark = pytest.mark.gpu


def paged_run(rng, q, k_pool, v_pool, table, lens, layout, **options):
    guard = GuardedAttention(rng, q.shape[:3] + (v_pool.shape[3],), q.dtype)
    k_layout, v_layout = (layout, layout) if isinstance(layout, str) else layout
    ptxattn.paged_decode(ptxattn.asarray(q), ptxattn.asarray(to_layout(k_pool, k_layout)),
                         ptxattn.asarray(to_layout(v_pool, v_layout)), ptxattn.asarray(table),
                         ptxattn.asarray(np.asarray(lens, np.int32)), layout=layout, **options, **guard.kwargs)
    return guard.check()


def check_paged_against_contiguous(rng, dtype, dims, page_size, lens, layout):
    """Random K / V of capacity max(lens) (NaN past each length) in shuffled pages (unused
    pages NaN), q of dims (batch, Hq, Hkv, Sq, D): paged_decode matches the reference and the
    contiguous decode of the same keys bit for bit."""
    batch, hq, hkv, sq, d = dims
    cap = max(lens)
    k = nan_tail_cache(rng, batch, hkv, cap, d, dtype, lens)
    v = nan_tail_cache(rng, batch, hkv, cap, d, dtype, lens)
    k_pool, table = paginate(rng, k, page_size)
    v_pool = np.full_like(k_pool, np.nan)
    for b in range(batch):
        for j in range(cap // page_size):
            v_pool[table[b, j]] = v[b, :, j * page_size:(j + 1) * page_size]
    q = rand(rng, (batch, hq, sq, d), dtype)
    o, lse = paged_run(rng, q, k_pool, v_pool, table, lens, layout)
    check_attention(o, lse, *reference.decode(q, k, v, lens), dtype)
    contiguous = ptxattn.decode(q, k, v, np.asarray(lens, np.int32))
    assert o.tobytes() == contiguous.tobytes()


@pytest.mark.parametrize("layout", ["HND", "NHD", ("HND", "NHD")], ids=["HND", "NHD", "mixed"])
@pytest.mark.parametrize("page_size", [8, 16, 64, 256])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_paged_matches_reference_and_contiguous_bits(rng, dtype, page_size, layout):
    cap = page_size * max(2, 1024 // page_size)
    check_paged_against_contiguous(rng, dtype, (5, 8, 2, 2, 128), page_size, [0, 1, page_size, cap // 2 + 3, cap],
                                   layout)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_one_split_paged_matches_reference_and_contiguous_bits(rng, dtype):
    # A capacity of one split: the split kernel writes o and lse itself, pages or not.
    batch, hq, hkv, d, page_size, cap = 3, 8, 2, 64, 16, 192
    lens = [0, 17, cap]
    k = nan_tail_cache(rng, batch, hkv, cap, d, dtype, lens)
    k_pool, table = paginate(rng, k, page_size)
    q = rand(rng, (batch, hq, 1, d), dtype)
    sinks = rng.standard_normal(hq).astype(np.float32)
    o, lse = paged_run(rng, q, k_pool, k_pool, table, lens, "NHD", sinks=ptxattn.asarray(sinks))
    check_attention(o, lse, *reference.decode(q, k, k, lens, sinks=sinks), dtype)
    contiguous, contiguous_lse = ptxattn.decode(q, k, k, np.asarray(lens, np.int32), sinks=sinks, return_lse=True)
    assert o.tobytes() == contiguous.tobytes() and lse.tobytes() == contiguous_lse.tobytes()


@pytest.mark.parametrize("hq, sq", [(16, 1), (32, 2)], ids=["rows16", "rows64"])
@pytest.mark.parametrize("page_size", [8, 64])
def test_groups_of_several_warps_paged(rng, hq, sq, page_size):
    # 16 and 64 query rows a kv head: row tiles of two and four warps, whose warps take turns
    # copying a group's blocks (each reads the page ids of its own next block ahead).
    cap = page_size * max(2, 2048 // page_size)
    check_paged_against_contiguous(rng, np.float16, (3, hq, 2, sq, 128), page_size, [cap, cap // 2 + 5, 37], "HND")


@pytest.mark.parametrize("slot_dtype", [np.int32, np.int64])
@pytest.mark.parametrize("layout", ["HND", "NHD"])
def test_paged_append_then_decode(rng, slot_dtype, layout):
    dtype, batch, hq, hkv, d, page_size, per_row = ptxattn.bfloat16, 3, 8, 2, 64, 16, 4
    pages = batch * per_row + 2
    k_pool = to_layout(np.full((pages, hkv, page_size, d), np.nan, np.float32).astype(dtype), layout)
    v_pool = k_pool.copy()
    table = rng.permutation(pages)[: batch * per_row].reshape(batch, per_row).astype(np.int32)
    lens = np.array([5, 64, 33], np.int32)
    # Write every live token of every row through the slot mapping, plus padding tokens (-1).
    slots = []
    for b in range(batch):
        for j in range(lens[b]):
            slots.append(table[b, j // page_size] * page_size + j % page_size)
    slots = np.array(slots + [-1, -1], slot_dtype)
    rng.shuffle(slots)
    k_new, v_new = rand(rng, (len(slots), hkv, d), dtype), rand(rng, (len(slots), hkv, d), dtype)
    k_dev, v_dev = ptxattn.asarray(k_pool), ptxattn.asarray(v_pool)
    ptxattn.paged_kv_append(ptxattn.asarray(k_new), ptxattn.asarray(v_new), k_dev, v_dev, ptxattn.asarray(slots),
                            layout=layout)
    want_k, want_v = reference.paged_kv_append(k_new, v_new, k_pool, v_pool, slots, layout=layout)
    assert np.array_equal(k_dev.get().view(np.uint8), want_k.view(np.uint8))
    assert np.array_equal(v_dev.get().view(np.uint8), want_v.view(np.uint8))
    q = rand(rng, (batch, hq, 1, d), dtype)
    o, lse = ptxattn.paged_decode(ptxattn.asarray(q), k_dev, v_dev, ptxattn.asarray(table), ptxattn.asarray(lens),
                                  layout=layout, return_lse=True)
    ref = reference.paged_decode(q, want_k, want_v, table, lens, layout=layout)
    check_attention(o.get(), lse.get(), *ref, dtype)


def test_page_outside_pool_raises_after_sync_and_context_stays_usable(rng):
    dtype, batch, hkv, d, page_size = np.float16, 2, 2, 64, 16
    k = rand(rng, (batch, hkv, 64, d), dtype)
    k_pool, table = paginate(rng, k, page_size, spare_pages=0)
    bad = table.copy()
    bad[1, 2] = len(k_pool) + 5
    q = rand(rng, (batch, 4, 1, d), dtype)
    lens = np.array([64, 64], np.int32)
    # The pool is the head of a larger buffer whose pages past it are NaN: reading the bad
    # page id (inside that buffer, so no illegal address) would show in the output.
    past = np.full((8,) + k_pool.shape[1:], np.nan, np.float32).astype(dtype)
    pool = ptxattn.asarray(np.concatenate([k_pool, past]))[:len(k_pool)]
    o = ptxattn.paged_decode(ptxattn.asarray(q), pool, pool, ptxattn.asarray(bad), ptxattn.asarray(lens))
    with pytest.raises(ptxattn.DeviceFault, match="outside the page pool") as info:
        ptxattn.check_faults(ptxattn.get_device(0), ptxattn.as_stream(None))
    assert (info.value.code, info.value.row, info.value.value) == (1, 1, len(k_pool) + 5)
    assert not np.isnan(o.get()).any(), "the bad page was read, not skipped"
    o, lse = ptxattn.paged_decode(q, k_pool, k_pool, table, lens, return_lse=True)
    check_attention(o, lse, *reference.decode(q, k, k, lens), dtype)


def test_slot_outside_pool_raises_and_skips_only_that_token(rng):
    dtype, pages, page_size = np.float32, 4, 8
    k_pool = np.zeros((pages, 1, page_size, 4), dtype)
    v_pool = np.zeros((pages, 1, page_size, 4), dtype)
    slots = np.array([3, pages * page_size, 9], np.int64)
    k_new, v_new = rand(rng, (3, 1, 4), dtype), rand(rng, (3, 1, 4), dtype)
    k_dev, v_dev = ptxattn.asarray(k_pool), ptxattn.asarray(v_pool)
    ptxattn.paged_kv_append(ptxattn.asarray(k_new), ptxattn.asarray(v_new), k_dev, v_dev, ptxattn.asarray(slots))
    with pytest.raises(ptxattn.DeviceFault, match="slot_mapping entry is outside the page pool") as info:
        ptxattn.check_faults(ptxattn.get_device(0), ptxattn.as_stream(None))
    assert (info.value.code, info.value.row) == (3, 1)
    k_pool, v_pool = k_dev.get(), v_dev.get()
    assert np.array_equal(k_pool[0, 0, 3], k_new[0, 0]) and np.array_equal(v_pool[1, 0, 1], v_new[2, 0])
    assert np.count_nonzero(k_pool) == 8
    # NumPy slots are checked on the host, before anything is written.
    with pytest.raises(ValueError, match=r"paged_kv_append: slot_mapping\[1\] = 32 is outside \[-1, 31\]"):
        ptxattn.paged_kv_append(k_new, v_new, k_pool, v_pool, slots)
    assert np.count_nonzero(k_pool) == 8
