"""kv_append and paged_kv_append into fp8 caches on the GPU. float16 / bfloat16 rows quantized
on append (both fp8 types, per-tensor scales that make the largest values saturate and
per-token scales, both layouts, head dims of one 16-element chunk a lane up to two) give the
reference's bytes and scales exactly, with the cache slots and scales outside the written ones
(NaN-poisoned) untouched; infinities, NaN and zero rows; fp8 rows copied with their own
scales; faults leave the caches alone; quantize on append then decode / paged_decode against
the float64 reference over the dequantized cache, with the error against the unquantized
values measured."""
from __future__ import annotations

import numpy as np
import pytest

import ptxattn
from ptxattn import reference

from decode_util import (FP8, FP8_IDS, FP8_MAX, assert_same_fp8, check_attention, device_scale, from_layout,
                         nan_fp8, rand, scale_to_layout, to_layout)
from gpu_util import relative_error

pytestmark = pytest.mark.gpu

SOURCES = [np.dtype(np.float16), ptxattn.bfloat16]
SOURCE_IDS = ["f16", "bf16"]
BF16 = ptxattn.bfloat16


def rows(rng, shape, dtype) -> np.ndarray:
    """Random rows [..., D] whose magnitudes vary from row to row over e^-4 .. e^4."""
    x = rng.standard_normal(shape) * np.exp(rng.uniform(-4, 4, shape[:-1] + (1,)))
    return x.astype(np.float32).astype(dtype)


def tensor_scale(x, fp8, headroom: float = 1.0) -> float:
    """A per-tensor scale that maps x's largest magnitude to FP8_MAX / headroom (headroom < 1:
    the largest values saturate)."""
    return float(np.abs(x.astype(np.float32)).max()) / FP8_MAX[fp8] * headroom


def cache_scale(per_token: bool, shape, x, fp8, headroom: float = 1.0):
    """A per-token scale array of `shape` poisoned with NaN, or a per-tensor scale for x."""
    return np.full(shape, np.nan, np.float32) if per_token else tensor_scale(x, fp8, headroom)


def layouts(layout) -> tuple[str, str]:
    return (layout, layout) if isinstance(layout, str) else tuple(layout)


def append(k_new, v_new, k_cache, v_cache, lens, layout, k_scale, v_scale, **new_scales):
    """kv_append of NumPy HND caches put on the device in `layout`; (k_cache, v_cache, lens,
    k_scale, v_scale) back as HND NumPy arrays (a per-tensor scale as it was)."""
    k_layout, v_layout = layouts(layout)
    caches = [ptxattn.asarray(to_layout(c, lay)) for c, lay in ((k_cache, k_layout), (v_cache, v_layout))]
    scales = [device_scale(s, lay) for s, lay in ((k_scale, k_layout), (v_scale, v_layout))]
    lens_dev = ptxattn.asarray(np.asarray(lens, np.int32))
    ptxattn.kv_append(ptxattn.asarray(k_new), ptxattn.asarray(v_new), *caches, lens_dev, layout=layout,
                      k_scale=scales[0], v_scale=scales[1],
                      **{name: ptxattn.asarray(s) for name, s in new_scales.items()})
    got_caches = [from_layout(c.get(), lay) for c, lay in zip(caches, (k_layout, v_layout))]
    got_scales = [s if isinstance(s, float) else scale_to_layout(s.get(), lay)
                  for s, lay in zip(scales, (k_layout, v_layout))]
    return (*got_caches, lens_dev.get(), *got_scales)


def assert_same_append(got, want) -> None:
    """Caches byte for byte (NaN matching NaN), lengths, and scales bit for bit."""
    for got_cache, want_cache in zip(got[:2], want[:2]):
        assert_same_fp8(got_cache, want_cache)
    assert np.array_equal(got[2], want[2])
    for got_scale, want_scale in zip(got[3:], want[3:]):
        if isinstance(want_scale, float):
            assert got_scale == want_scale
        else:
            assert np.array_equal(got_scale.view(np.uint32), want_scale.view(np.uint32)), \
                f"scales differ at {np.argwhere(got_scale.view(np.uint32) != want_scale.view(np.uint32))[:4].tolist()}"


@pytest.mark.parametrize("per_token", [False, True], ids=["per_tensor", "per_token"])
@pytest.mark.parametrize("layout", ["HND", "NHD", ("NHD", "HND")], ids=["HND", "NHD", "mixed"])
@pytest.mark.parametrize("dims", [(128, 128), (80, 32), (576, 64)], ids=["d128", "d80_32", "d576_64"])
@pytest.mark.parametrize("src", SOURCES, ids=SOURCE_IDS)
@pytest.mark.parametrize("fp8", FP8, ids=FP8_IDS)
def test_kv_append_quantizes_as_the_reference(rng, fp8, src, dims, layout, per_token):
    batch, hkv, cap, n = 4, 3, 40, 3
    dk, dv = dims
    lens = [0, 7, 21, cap - n]
    k_new, v_new = rows(rng, (batch, hkv, n, dk), src), rows(rng, (batch, hkv, n, dv), src)
    k_cache, v_cache = nan_fp8((batch, hkv, cap, dk), fp8), nan_fp8((batch, hkv, cap, dv), fp8)
    k_scale = cache_scale(per_token, (batch, hkv, cap), k_new, fp8, headroom=0.5)
    v_scale = cache_scale(per_token, (batch, hkv, cap), v_new, fp8, headroom=0.5)
    want = reference.kv_append_fp8(k_new, v_new, k_cache, v_cache, lens, k_scale=k_scale, v_scale=v_scale)
    assert_same_append(append(k_new, v_new, k_cache, v_cache, lens, layout, k_scale, v_scale), want)
    if not per_token:  # the headroom made some values saturate
        assert (np.abs(want[0].astype(np.float32)) == FP8_MAX[fp8]).any()


@pytest.mark.parametrize("slot_dtype", [np.int32, np.int64])
@pytest.mark.parametrize("per_token", [False, True], ids=["per_tensor", "per_token"])
@pytest.mark.parametrize("layout", ["HND", "NHD"])
@pytest.mark.parametrize("fp8", FP8, ids=FP8_IDS)
def test_paged_kv_append_quantizes_as_the_reference(rng, fp8, layout, per_token, slot_dtype):
    pages, page_size, hkv, d, tokens = 9, 16, 2, 128, 40
    shape = (pages, hkv, page_size, d) if layout == "HND" else (pages, page_size, hkv, d)
    slots = rng.permutation(pages * page_size)[:tokens].astype(slot_dtype)
    slots[[3, 17]] = -1
    k_new, v_new = rows(rng, (tokens, hkv, d), BF16), rows(rng, (tokens, hkv, d), BF16)
    k_pool, v_pool = nan_fp8(shape, fp8), nan_fp8(shape, fp8)
    k_scale = cache_scale(per_token, shape[:3], k_new, fp8, headroom=0.5)
    v_scale = cache_scale(per_token, shape[:3], v_new, fp8, headroom=0.5)
    want = reference.paged_kv_append_fp8(k_new, v_new, k_pool, v_pool, slots, layout=layout, k_scale=k_scale,
                                         v_scale=v_scale)
    pools = [ptxattn.asarray(p) for p in (k_pool, v_pool)]
    scales = [s if isinstance(s, float) else ptxattn.asarray(s) for s in (k_scale, v_scale)]
    ptxattn.paged_kv_append(ptxattn.asarray(k_new), ptxattn.asarray(v_new), *pools, ptxattn.asarray(slots),
                            layout=layout, k_scale=scales[0], v_scale=scales[1])
    got_scales = [s if isinstance(s, float) else s.get() for s in scales]
    assert_same_append((pools[0].get(), pools[1].get(), None, *got_scales), (*want[:2], None, *want[2:]))


@pytest.mark.parametrize("fp8", FP8, ids=FP8_IDS)
def test_infinities_nan_and_zero_rows(rng, fp8):
    """K per token, V per tensor at a scale every value saturates past. Rows: +-inf, NaN and
    +-1e30 among random values (the scale from the finite ones; inf -> +-max, NaN stays);
    all zeros (scale 1, zeros); zeros and a NaN; nothing finite but zeros."""
    batch, hkv, cap, n, d = 1, 4, 8, 2, 64
    x = rows(rng, (batch, hkv, n, d), BF16)
    x[0, 0, 0, :5] = [np.inf, -np.inf, np.nan, 1e30, -1e30]
    x[0, 1, 0] = 0
    x[0, 2, 0] = 0
    x[0, 2, 0, 7] = np.nan
    x[0, 3, 1] = [np.inf, np.nan, 0.0, -np.inf] * (d // 4)
    k_cache, v_cache = nan_fp8((batch, hkv, cap, d), fp8), nan_fp8((batch, hkv, cap, d), fp8)
    k_scale = np.full((batch, hkv, cap), np.nan, np.float32)
    want = reference.kv_append_fp8(x, x, k_cache, v_cache, [2], k_scale=k_scale, v_scale=1e-6)
    got = append(x, x, k_cache, v_cache, [2], "HND", k_scale, 1e-6)
    assert_same_append(got, want)
    assert got[3][0, 1, 2] == got[3][0, 2, 2] == got[3][0, 3, 3] == 1.0
    assert not got[0][0, 1, 2].astype(np.float32).any()
    assert got[1][0, 0, 2, 0] == FP8_MAX[fp8] and got[1][0, 0, 2, 1] == -FP8_MAX[fp8]
    assert np.isnan(got[0][0, 0, 2, 2].astype(np.float32)) and np.isnan(got[1][0, 2, 2, 7].astype(np.float32))


@pytest.mark.parametrize("per_token", [False, True], ids=["per_tensor", "per_token"])
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_fp8_rows_are_copied_with_their_scales(rng, paged, per_token):
    fp8, hkv, d = FP8[1], 2, 64
    tokens = 12 if paged else 3
    new_shape = (tokens, hkv, d) if paged else (2, hkv, tokens, d)
    k_new, v_new = (rows(rng, new_shape, np.float32).astype(fp8) for _ in range(2))
    k_new.view(np.uint8).reshape(-1)[[0, d + 1]] = [0x7F, 0x80]  # bytes move as they are: NaN, negative zero
    new_scales = {}
    if per_token:
        new_scales = {name: rng.uniform(0.01, 2, new_shape[:-1]).astype(np.float32)
                      for name in ("k_new_scale", "v_new_scale")}
    if paged:
        pool_shape = (4, 8, hkv, d)  # NHD pages of 8
        slots = rng.permutation(32)[:tokens]
        k_scale = np.full(pool_shape[:3], np.nan, np.float32) if per_token else 0.25
        want = reference.paged_kv_append_fp8(k_new, v_new, nan_fp8(pool_shape, fp8), nan_fp8(pool_shape, fp8),
                                             slots, layout="NHD", k_scale=k_scale, v_scale=k_scale, **new_scales)
        pools = [ptxattn.asarray(nan_fp8(pool_shape, fp8)) for _ in range(2)]
        scales = [k_scale if not per_token else ptxattn.asarray(k_scale) for _ in range(2)]
        ptxattn.paged_kv_append(ptxattn.asarray(k_new), ptxattn.asarray(v_new), *pools, ptxattn.asarray(slots),
                                layout="NHD", k_scale=scales[0], v_scale=scales[1],
                                **{name: ptxattn.asarray(s) for name, s in new_scales.items()})
        got = (pools[0].get(), pools[1].get(), None, *(s if not per_token else s.get() for s in scales))
        assert_same_append(got, (*want[:2], None, *want[2:]))
        return
    cap = 16
    caches = [nan_fp8((2, hkv, cap, d), fp8) for _ in range(2)]
    k_scale = np.full((2, hkv, cap), np.nan, np.float32) if per_token else 0.25
    want = reference.kv_append_fp8(k_new, v_new, *caches, [4, 13], k_scale=k_scale, v_scale=k_scale, **new_scales)
    assert_same_append(append(k_new, v_new, *caches, [4, 13], "NHD", k_scale, k_scale, **new_scales), want)


def test_faults_leave_the_caches_untouched(rng):
    fp8, hkv, cap, n, d = FP8[0], 2, 16, 2, 64
    k_new, v_new = rows(rng, (2, hkv, n, d), BF16), rows(rng, (2, hkv, n, d), BF16)
    scale = np.full((2, hkv, cap), np.nan, np.float32)
    caches = [nan_fp8((2, hkv, cap, d), fp8) for _ in range(2)]
    lens = [cap - 1, 2]  # row 0 would pass the capacity
    got = append(k_new, v_new, *caches, lens, "HND", scale, 0.01)
    with pytest.raises(ptxattn.DeviceFault, match="would pass the cache capacity") as info:
        ptxattn.check_faults(ptxattn.get_device(0), ptxattn.as_stream(None))
    assert (info.value.code, info.value.row, info.value.value) == (2, 0, cap + 1)
    assert_same_append(got, reference.kv_append_fp8(k_new, v_new, *caches, lens, k_scale=scale, v_scale=0.01))
    assert got[2].tolist() == [cap - 1, 4] and np.isnan(got[3][0]).all()

    pages, page_size = 3, 8
    pool_shape = (pages, hkv, page_size, d)
    slots = np.array([3, pages * page_size + 5, 9], np.int64)
    tokens = rows(rng, (3, hkv, d), np.float16)
    pools = [ptxattn.asarray(nan_fp8(pool_shape, fp8)) for _ in range(2)]
    scales = [ptxattn.asarray(np.full(pool_shape[:3], np.nan, np.float32)) for _ in range(2)]
    ptxattn.paged_kv_append(ptxattn.asarray(tokens), ptxattn.asarray(tokens), *pools, ptxattn.asarray(slots),
                            k_scale=scales[0], v_scale=scales[1])
    with pytest.raises(ptxattn.DeviceFault, match="slot_mapping entry is outside the page pool") as info:
        ptxattn.check_faults(ptxattn.get_device(0), ptxattn.as_stream(None))
    assert (info.value.code, info.value.row) == (3, 1)
    want = reference.paged_kv_append_fp8(tokens, tokens, nan_fp8(pool_shape, fp8), nan_fp8(pool_shape, fp8), slots,
                                         k_scale=np.full(pool_shape[:3], np.nan, np.float32),
                                         v_scale=np.full(pool_shape[:3], np.nan, np.float32))
    assert_same_append((pools[0].get(), pools[1].get(), None, scales[0].get(), scales[1].get()),
                       (*want[:2], None, *want[2:]))
    assert np.count_nonzero(~np.isnan(scales[0].get())) == 2 * hkv


def test_numpy_caches_and_scales_update_in_place(rng):
    fp8, hkv, cap, d = FP8[0], 2, 8, 32
    k_new, v_new = rows(rng, (2, hkv, 1, d), np.float16), rows(rng, (2, hkv, 1, d), np.float16)
    k_cache, v_cache = nan_fp8((2, hkv, cap, d), fp8), nan_fp8((2, hkv, cap, d), fp8)
    k_scale, lens = np.full((2, hkv, cap), np.nan, np.float32), np.array([0, 5], np.int32)
    want = reference.kv_append_fp8(k_new, v_new, k_cache, v_cache, lens, k_scale=k_scale, v_scale=0.03)
    ptxattn.kv_append(k_new, v_new, k_cache, v_cache, lens, k_scale=k_scale, v_scale=0.03)
    assert_same_append((k_cache, v_cache, lens, k_scale, 0.03), want)


# ---- quantize on append, then attend ------------------------------------------------------------
def check_decode(o, lse, reference_call, quantized, unquantized, fp8, what: str) -> None:
    """o / lse against the reference over the dequantized cache (bf16 accuracy); the error
    against the unquantized values printed (pytest -s) and bounded as decode's own test does."""
    check_attention(o, lse, *reference_call(*quantized), BF16)
    error = relative_error(o, reference_call(*unquantized)[0])
    print(f"\nquantize on append, {what}, {fp8}: relative error {error:.4f} against the unquantized cache")
    assert error < {FP8[0]: 0.08, FP8[1]: 0.15}[fp8]


@pytest.mark.parametrize("per_token", [False, True], ids=["per_tensor", "per_token"])
@pytest.mark.parametrize("fp8", FP8, ids=FP8_IDS)
def test_append_then_decode(rng, fp8, per_token):
    """A 300-token prompt then two single-token steps appended (quantized) into NaN-poisoned
    caches, then decode over each row's first `lens` keys."""
    batch, hq, hkv, d, cap, prompt = 3, 16, 4, 128, 512, 300
    chunks = [rand(rng, (batch, hkv, n, d), BF16) for n in (prompt, 1, 1)]
    v_chunks = [rand(rng, (batch, hkv, n, d), BF16) for n in (prompt, 1, 1)]
    x_k, x_v = np.concatenate(chunks, axis=2), np.concatenate(v_chunks, axis=2)
    k_cache, v_cache = nan_fp8((batch, hkv, cap, d), fp8), nan_fp8((batch, hkv, cap, d), fp8)
    k_scale = cache_scale(per_token, (batch, hkv, cap), x_k, fp8)
    v_scale = cache_scale(per_token, (batch, hkv, cap), x_v, fp8)
    caches = [ptxattn.asarray(k_cache), ptxattn.asarray(v_cache)]
    scales = [device_scale(s, "HND") for s in (k_scale, v_scale)]
    lens_dev = ptxattn.asarray(np.zeros(batch, np.int32))
    want = (k_cache, v_cache, np.zeros(batch, np.int32), k_scale, v_scale)
    for k_new, v_new in zip(chunks, v_chunks):
        ptxattn.kv_append(ptxattn.asarray(k_new), ptxattn.asarray(v_new), *caches, lens_dev, k_scale=scales[0],
                          v_scale=scales[1])
        want = reference.kv_append_fp8(k_new, v_new, *want[:3], k_scale=want[3], v_scale=want[4])
    got = (caches[0].get(), caches[1].get(), lens_dev.get(),
           *(s if isinstance(s, float) else s.get() for s in scales))
    assert_same_append(got, want)
    lens = np.array([1, 150, prompt + 2], np.int32)
    q = rand(rng, (batch, hq, 2, d), BF16)
    o, lse = ptxattn.decode(ptxattn.asarray(q), *caches, ptxattn.asarray(lens), k_scale=scales[0],
                            v_scale=scales[1], return_lse=True)
    nan_tail = np.full((batch, hkv, cap - prompt - 2, d), np.nan)
    check_decode(o.get(), lse.get(), lambda k, v: reference.decode(q, k, v, lens),
                 (reference.dequantize_fp8(want[0], want[3]), reference.dequantize_fp8(want[1], want[4])),
                 (np.concatenate([x_k, nan_tail], axis=2), np.concatenate([x_v, nan_tail], axis=2)), fp8,
                 "decode")


@pytest.mark.parametrize("per_token", [False, True], ids=["per_tensor", "per_token"])
@pytest.mark.parametrize("layout", ["HND", "NHD"])
@pytest.mark.parametrize("fp8", FP8, ids=FP8_IDS)
def test_paged_append_then_paged_decode(rng, fp8, layout, per_token):
    """Each row's tokens scattered (quantized) to the pages of its block table, then
    paged_decode over them."""
    batch, hq, hkv, d, page_size, per_row = 3, 8, 2, 128, 16, 12
    pages = batch * per_row + 2
    table = rng.permutation(pages)[:batch * per_row].reshape(batch, per_row).astype(np.int32)
    lens = np.array([1, 97, per_row * page_size], np.int32)
    slots = np.concatenate([table[b, np.arange(n) // page_size] * page_size + np.arange(n) % page_size
                            for b, n in enumerate(lens)])
    x_k, x_v = rand(rng, (len(slots), hkv, d), BF16), rand(rng, (len(slots), hkv, d), BF16)
    shape = (pages, hkv, page_size, d) if layout == "HND" else (pages, page_size, hkv, d)
    k_scale = cache_scale(per_token, shape[:3], x_k, fp8)
    v_scale = cache_scale(per_token, shape[:3], x_v, fp8)
    want = reference.paged_kv_append_fp8(x_k, x_v, nan_fp8(shape, fp8), nan_fp8(shape, fp8), slots, layout=layout,
                                         k_scale=k_scale, v_scale=v_scale)
    pools = [ptxattn.asarray(nan_fp8(shape, fp8)) for _ in range(2)]
    scales = [s if isinstance(s, float) else ptxattn.asarray(s) for s in (k_scale, v_scale)]
    ptxattn.paged_kv_append(ptxattn.asarray(x_k), ptxattn.asarray(x_v), *pools, ptxattn.asarray(slots), layout=layout,
                            k_scale=scales[0], v_scale=scales[1])
    q = rand(rng, (batch, hq, 1, d), BF16)
    o, lse = ptxattn.paged_decode(ptxattn.asarray(q), *pools, ptxattn.asarray(table), ptxattn.asarray(lens),
                                  layout=layout, k_scale=scales[0], v_scale=scales[1], return_lse=True)
    unquantized = reference.paged_kv_append(x_k, x_v, np.full(shape, np.nan), np.full(shape, np.nan), slots,
                                            layout=layout)
    check_decode(o.get(), lse.get(), lambda k, v: reference.paged_decode(q, k, v, table, lens, layout=layout),
                 (reference.dequantize_fp8(want[0], want[2]), reference.dequantize_fp8(want[1], want[3])),
                 unquantized, fp8, "paged_decode")


def test_quantizing_decode_step_captured_once_replayed_per_token(rng):
    """The README's decode loop over an e4m3 cache with per-token scales: a prepared
    quantizing append and a prepared decode, captured once, replayed per token; the cache and
    scales stay the reference's bit for bit, the output its attention over them."""
    fp8, batch, hq, hkv, capacity, d = FP8[0], 2, 8, 2, 64, 128
    stream = ptxattn.Stream.create()
    host = {"k_cache": nan_fp8((batch, hkv, capacity, d), fp8), "v_cache": nan_fp8((batch, hkv, capacity, d), fp8),
            "k_scale": np.full((batch, hkv, capacity), np.nan, np.float32), "seq_lens": np.zeros(batch, np.int32)}
    dev = {name: ptxattn.asarray(x, stream) for name, x in host.items()}
    q = ptxattn.empty((batch, hq, 1, d), BF16)
    k_new, v_new = ptxattn.empty((batch, hkv, 1, d), BF16), ptxattn.empty((batch, hkv, 1, d), BF16)
    append = ptxattn.prepare(ptxattn.kv_append, k_new, v_new, dev["k_cache"], dev["v_cache"], dev["seq_lens"],
                             k_scale=dev["k_scale"], v_scale=0.05, stream=stream)
    attend = ptxattn.prepare(ptxattn.decode, q, dev["k_cache"], dev["v_cache"], dev["seq_lens"],
                             k_scale=dev["k_scale"], v_scale=0.05, stream=stream)
    want = (host["k_cache"], host["v_cache"], host["seq_lens"], host["k_scale"], 0.05)

    def next_token():
        data = [rand(rng, a.shape, BF16) for a in (q, k_new, v_new)]
        for arr, x in zip((q, k_new, v_new), data):
            arr.set(x, stream)
        return data[0], reference.kv_append_fp8(data[1], data[2], *want[:3], k_scale=want[3], v_scale=want[4])

    q_host, want = next_token()
    append.run()
    attend.run()
    with ptxattn.capture(stream) as graph:
        append.run()
        attend.run()
    for _ in range(5):
        q_host, want = next_token()
        graph.replay()
    ptxattn.check_faults(ptxattn.get_device(0), stream)
    got = (dev["k_cache"].get(stream), dev["v_cache"].get(stream), dev["seq_lens"].get(stream),
           dev["k_scale"].get(stream), 0.05)
    assert_same_append(got, want)
    assert got[2].tolist() == [6, 6]
    o = attend.arrays["out"].get(stream)
    check_attention(o, None, reference.decode(q_host, reference.dequantize_fp8(want[0], want[3]),
                                              reference.dequantize_fp8(want[1], want[4]), got[2])[0], None, BF16)
