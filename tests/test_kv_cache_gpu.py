"""ptxattn.kv_append on the GPU: appending then decoding matches the reference append then the
reference attention, in both layouts; seq_lens advance on the device; a row that would pass
the capacity is left alone and raises after synchronization, and the context stays usable."""
from __future__ import annotations

import numpy as np
import pytest

import ptxattn
from ptxattn import reference

from decode_util import DTYPE_IDS, DTYPES, check_attention, from_layout, nan_tail_cache, rand, to_layout

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("layout", ["HND", "NHD"])
@pytest.mark.parametrize("n", [1, 3])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_append_then_decode(rng, dtype, n, layout):
    batch, hq, hkv, d, cap = 4, 8, 2, 64, 300
    lens = np.array([0, 5, 200, cap - n], np.int32)
    k = nan_tail_cache(rng, batch, hkv, cap, d, dtype, lens)
    v = nan_tail_cache(rng, batch, hkv, cap, d, dtype, lens)
    k_new, v_new = rand(rng, (batch, hkv, n, d), dtype), rand(rng, (batch, hkv, n, d), dtype)
    k_dev, v_dev = ptxattn.asarray(to_layout(k, layout)), ptxattn.asarray(to_layout(v, layout))
    lens_dev = ptxattn.asarray(lens)
    ptxattn.kv_append(ptxattn.asarray(k_new), ptxattn.asarray(v_new), k_dev, v_dev, lens_dev, layout=layout)

    want_k, want_v, want_lens = reference.kv_append(k_new, v_new, k, v, lens)
    assert np.array_equal(lens_dev.get(), want_lens)
    got_k, got_v = from_layout(k_dev.get(), layout), from_layout(v_dev.get(), layout)
    for got, want in ((got_k, want_k), (got_v, want_v)):  # written slots exact, the NaN tail untouched
        assert np.array_equal(got.view(np.uint8), want.astype(dtype).view(np.uint8))

    q = rand(rng, (batch, hq, n, d), dtype)
    o, lse = ptxattn.decode(ptxattn.asarray(q), k_dev, v_dev, lens_dev, layout=layout, return_lse=True)
    check_attention(o.get(), lse.get(), *reference.decode(q, want_k, want_v, want_lens), dtype)


def test_numpy_caches_update_in_place_without_advance(rng):
    dtype, cap = np.float16, 16
    k, v = np.zeros((2, 1, cap, 8), dtype), np.zeros((2, 1, cap, 8), dtype)
    lens = np.array([3, 0], np.int32)
    k_new, v_new = rand(rng, (2, 1, 2, 8), dtype), rand(rng, (2, 1, 2, 8), dtype)
    ptxattn.kv_append(k_new, v_new, k, v, lens, advance=False)
    assert lens.tolist() == [3, 0]
    assert np.array_equal(k[0, 0, 3:5], k_new[0, 0]) and np.array_equal(v[1, 0, 0:2], v_new[1, 0])


def test_capacity_overflow_raises_and_skips_only_that_row(rng):
    dtype, cap = ptxattn.bfloat16, 32
    k, v = rand(rng, (2, 2, cap, 16), dtype), rand(rng, (2, 2, cap, 16), dtype)
    lens = np.array([31, 4], np.int32)
    k_new, v_new = rand(rng, (2, 2, 2, 16), dtype), rand(rng, (2, 2, 2, 16), dtype)
    k_dev, v_dev, lens_dev = ptxattn.asarray(k), ptxattn.asarray(v), ptxattn.asarray(lens)
    ptxattn.kv_append(ptxattn.asarray(k_new), ptxattn.asarray(v_new), k_dev, v_dev, lens_dev)
    with pytest.raises(ptxattn.DeviceFault, match="would pass the cache capacity") as info:
        ptxattn.check_faults(ptxattn.get_device(0), ptxattn.as_stream(None))
    assert (info.value.code, info.value.row, info.value.value) == (2, 0, 33)
    assert lens_dev.get().tolist() == [31, 6]
    got_k = k_dev.get()
    assert np.array_equal(got_k[0].view(np.uint8), k[0].view(np.uint8))
    assert np.array_equal(got_k[1, :, 4:6], k_new[1])
    # The context is still usable: a fitting append goes through.
    ptxattn.kv_append(k_new[:, :, :1], v_new[:, :, :1], k, v, np.array([30, 0], np.int32))
    assert np.array_equal(k[0, :, 30], k_new[0, :, 0])
