"""decode and paged_decode over fp8 caches (float8_e4m3fn, float8_e5m2) on the GPU: against the
float64 reference over the dequantized cache at bf16 accuracy, both scale granularities
(per tensor, per token and kv head), f16 and bf16 queries, GQA 1/4/8, both layouts, lengths
0 / 1 / capacity / split boundaries +-1, every option; NaN bytes and NaN scales past every
live length, NaN-poisoned outputs framed by canaries; paged pools give the contiguous bits;
graph replay equals eager bitwise; the error fp8 adds against the unquantized cache."""
from __future__ import annotations

import numpy as np
import pytest

import ptxattn
from ptxattn import reference
from ptxattn.context import on_device
from ptxattn.module import loaded_arch
from ptxattn.ops.decode import plan_decode

from decode_util import (FP8, FP8_IDS, FP8_NAN, GuardedAttention, check_attention, device_scale, fp8_cache,
                         fp8_quantized, paginate, rand, to_layout)
from gpu_util import REL_TOL, relative_error

pytestmark = pytest.mark.gpu

Q_DTYPES = [np.dtype(np.float16), ptxattn.bfloat16]
Q_IDS = ["f16", "bf16"]


def split_size(batch, hq, hkv, d, capacity, q_dtype, fp8) -> int:
    dev = ptxattn.get_device(0)
    return plan_decode(batch=batch, hq=hq, hkv=hkv, sq=1, dqk=d, dv=d, capacity=capacity, dtype=q_dtype,
                       cache_dtype=fp8, sm_count=dev.sm_count,
                       max_shared=dev.max_shared_per_block_optin).keys_per_split


def run(rng, q, k, k_scale, v, v_scale, lens, layout="HND", **options):
    """decode over HND fp8 caches (put in `layout`) into guarded outputs: (o, lse) as NumPy."""
    guard = GuardedAttention(rng, q.shape[:3] + (v.shape[3],), q.dtype)
    k_layout, v_layout = (layout, layout) if isinstance(layout, str) else layout
    ptxattn.decode(ptxattn.asarray(q), ptxattn.asarray(to_layout(k, k_layout)),
                   ptxattn.asarray(to_layout(v, v_layout)), ptxattn.asarray(np.asarray(lens, np.int32)),
                   layout=layout, k_scale=device_scale(k_scale, k_layout), v_scale=device_scale(v_scale, v_layout),
                   **options, **guard.kwargs)
    return guard.check()


@pytest.mark.parametrize("per_token", [False, True], ids=["per_tensor", "per_token"])
@pytest.mark.parametrize("layout", ["HND", "NHD", ("NHD", "HND")], ids=["HND", "NHD", "mixed"])
@pytest.mark.parametrize("gqa", [1, 4, 8])
@pytest.mark.parametrize("q_dtype", Q_DTYPES, ids=Q_IDS)
@pytest.mark.parametrize("fp8", FP8, ids=FP8_IDS)
def test_lengths_layouts_gqa_and_scales(rng, fp8, q_dtype, gqa, layout, per_token):
    hkv, d, cap = 2, 128, 700
    kps = split_size(6, hkv * gqa, hkv, d, cap, q_dtype, fp8)
    assert kps + 1 < cap, "the test wants a split boundary inside the capacity"
    lens = [0, 1, kps - 1, kps, kps + 1, cap]
    q = rand(rng, (6, hkv * gqa, 1, d), q_dtype)
    k, k_scale, k_ref = fp8_cache(rng, 6, hkv, cap, d, fp8, lens, per_token)
    v, v_scale, v_ref = fp8_cache(rng, 6, hkv, cap, d, fp8, lens, per_token)
    o, lse = run(rng, q, k, k_scale, v, v_scale, lens, layout)
    check_attention(o, lse, *reference.decode(q, k_ref, v_ref, lens), ptxattn.bfloat16)


@pytest.mark.parametrize("fp8", FP8, ids=FP8_IDS)
def test_per_token_scales_of_either_sign(rng, fp8):
    """A per-token scale may be negative (the value it scales counts with its sign flipped).
    Every row's first 64 tokens have negative K and V scales, so the first blocks' scaled
    probabilities are all negative; the rest take random signs."""
    batch, hq, hkv, d, cap = 3, 8, 2, 128, 900
    lens = [cap, 500, 64]
    q = rand(rng, (batch, hq, 1, d), ptxattn.bfloat16)
    caches = []
    for _ in range(2):
        data, scale, ref = fp8_cache(rng, batch, hkv, cap, d, fp8, lens, per_token=True)
        sign = rng.choice([-1.0, 1.0], scale.shape)
        sign[:, :, :64] = -1.0
        caches.append((data, (scale * sign).astype(np.float32), ref * sign[..., None]))
    (k, k_scale, k_ref), (v, v_scale, v_ref) = caches
    o, lse = run(rng, q, k, k_scale, v, v_scale, lens)
    check_attention(o, lse, *reference.decode(q, k_ref, v_ref, lens), ptxattn.bfloat16)


@pytest.mark.parametrize("fp8", FP8, ids=FP8_IDS)
def test_per_token_v_scales_outside_f16_range(rng, fp8):
    """P V runs on f16 operands, so probabilities times V scales must be brought into f16's
    range: row 0's V scales are 1e-13 to 1e-10 (their products would underflow f16), row 1's
    1e4 to 1e7 (they would overflow it), row 2's alternate token by token between those of
    1e-7 to 1e-4 and 1e4 to 1e7. Each row is checked on its own, as their outputs differ by
    up to 17 orders of magnitude."""
    batch, hq, hkv, d, cap = 3, 8, 2, 128, 700
    lens = [cap, 500, cap]
    q = rand(rng, (batch, hq, 1, d), ptxattn.bfloat16)
    k, k_scale, k_ref = fp8_cache(rng, batch, hkv, cap, d, fp8, lens, per_token=True)
    v, v_scale, v_ref = fp8_cache(rng, batch, hkv, cap, d, fp8, lens, per_token=True)
    factor = np.empty((batch, 1, cap))
    factor[0], factor[1] = 1e-9, 1e8
    factor[2, :, 0::2], factor[2, :, 1::2] = 1e-3, 1e8
    v_scale = (v_scale * factor).astype(np.float32)
    v_ref = v_ref * factor[..., None]
    o, lse = run(rng, q, k, k_scale, v, v_scale, lens)
    ref_o, ref_lse = reference.decode(q, k_ref, v_ref, lens)
    for b in range(batch):
        check_attention(o[b], lse[b], ref_o[b], ref_lse[b], ptxattn.bfloat16)


@pytest.mark.parametrize("fp8", FP8, ids=FP8_IDS)
def test_v_scales_of_keys_with_next_to_no_weight(rng, fp8):
    """P V's f16 operand must be scaled by the size of p * v_scale, not of v_scale alone: one
    key in every 32 has a V scale 1e9 times the others' and a key pointing away from its head's
    query (its score ~40 below the others', p ~ e^-40), so it adds next to nothing; a unit
    taken from the V scales alone would put every other key's p * v_scale / unit below f16's
    smallest subnormal."""
    batch, heads, d, cap = 2, 4, 128, 700
    lens = [cap, 333]
    q = rand(rng, (batch, heads, 1, d), ptxattn.bfloat16)
    heavy = np.arange(5, cap, 32)
    q64 = q[:, :, 0].astype(np.float64)
    x_k = rng.standard_normal((batch, heads, cap, d))
    x_k[:, :, heavy] = (-40 * q64 / np.linalg.norm(q64, axis=-1, keepdims=True))[:, :, None, :]
    k, k_scale, k_ref = fp8_quantized(x_k, fp8, lens, per_token=True)
    v, v_scale, v_ref = fp8_quantized(rng.standard_normal((batch, heads, cap, d)), fp8, lens, per_token=True)
    v_scale[:, :, heavy] *= np.float32(1e9)
    v_ref[:, :, heavy] *= 1e9
    o, lse = run(rng, q, k, k_scale, v, v_scale, lens)
    check_attention(o, lse, *reference.decode(q, k_ref, v_ref, lens), ptxattn.bfloat16)


CASES = {
    # name: (Hq, Hkv, Sq, Dqk, Dv, options)
    "sq16_gqa8_d64": (16, 2, 16, 64, 64, {}),
    "sq5_gqa4_window_softcap_scale": (8, 2, 5, 128, 128, {"window": (37, 0), "softcap": 3.0, "scale": 0.3}),
    "sq3_sinks_d256": (8, 2, 3, 256, 256, {"sinks": "random"}),
    "dqk_ne_dv": (4, 1, 2, 192, 128, {}),
    "mqa_many_rows": (64, 1, 4, 128, 128, {"sinks": "random", "softcap": 5.0}),
}


@pytest.mark.parametrize("mixed", [False, True], ids=["same_scales", "k_tensor_v_token"])
@pytest.mark.parametrize("case", list(CASES))
def test_options(rng, case, mixed):
    hq, hkv, sq, dqk, dv, options = CASES[case]
    fp8, q_dtype = FP8[0], ptxattn.bfloat16
    options = dict(options)
    if options.get("sinks") == "random":
        options["sinks"] = rng.standard_normal(hq).astype(np.float32)
    batch, cap = 5, 333
    lens = [0, 1, sq - 1, int(rng.integers(sq, cap)), cap]
    q = rand(rng, (batch, hq, sq, dqk), q_dtype)
    k, k_scale, k_ref = fp8_cache(rng, batch, hkv, cap, dqk, fp8, lens, per_token=not mixed)
    v, v_scale, v_ref = fp8_cache(rng, batch, hkv, cap, dv, fp8, lens, per_token=True)
    ref = reference.decode(q, k_ref, v_ref, lens, **options)
    if "sinks" in options:
        options["sinks"] = ptxattn.asarray(options["sinks"])
    o, lse = run(rng, q, k, k_scale, v, v_scale, lens, **options)
    check_attention(o, lse, *ref, ptxattn.bfloat16)


@pytest.mark.parametrize("layout", ["HND", "NHD"])
@pytest.mark.parametrize("page_size", [4, 16, 64])  # 4: a lane's 8 rows of a block span two pages
@pytest.mark.parametrize("hq", [8, 32])  # 32: 16 rows a kv head, row tiles of two warps
@pytest.mark.parametrize("fp8", FP8, ids=FP8_IDS)
def test_paged_matches_reference_and_contiguous_bits(rng, fp8, hq, page_size, layout):
    batch, hkv, d = 5, 2, 128
    cap = page_size * max(2, 1024 // page_size)
    lens = [0, 1, page_size, cap // 2 + 3, cap]
    q = rand(rng, (batch, hq, 1, d), ptxattn.bfloat16)
    k, k_scale, k_ref = fp8_cache(rng, batch, hkv, cap, d, fp8, lens, per_token=True)
    v, v_scale, v_ref = fp8_cache(rng, batch, hkv, cap, d, fp8, lens, per_token=True)
    k_pool, table = paginate(rng, k, page_size)
    # The same pages for V and for both scale pools (unused pages: NaN).
    v_pool = np.full(k_pool.shape, FP8_NAN, np.uint8).view(fp8)
    k_scale_pool = np.full(k_pool.shape[:3], np.nan, np.float32)
    v_scale_pool = k_scale_pool.copy()
    for b in range(batch):
        for j in range(cap // page_size):
            page, tokens = table[b, j], slice(j * page_size, (j + 1) * page_size)
            v_pool[page] = v[b, :, tokens]
            k_scale_pool[page], v_scale_pool[page] = k_scale[b, :, tokens], v_scale[b, :, tokens]
    guard = GuardedAttention(rng, (batch, hq, 1, d), q.dtype)
    ptxattn.paged_decode(ptxattn.asarray(q), ptxattn.asarray(to_layout(k_pool, layout)),
                         ptxattn.asarray(to_layout(v_pool, layout)), ptxattn.asarray(table),
                         ptxattn.asarray(np.asarray(lens, np.int32)), layout=layout,
                         k_scale=device_scale(k_scale_pool, layout), v_scale=device_scale(v_scale_pool, layout),
                         **guard.kwargs)
    o, lse = guard.check()
    check_attention(o, lse, *reference.decode(q, k_ref, v_ref, lens), ptxattn.bfloat16)
    contiguous, contiguous_lse = run(rng, q, k, k_scale, v, v_scale, lens, layout)
    assert o.tobytes() == contiguous.tobytes() and lse.tobytes() == contiguous_lse.tobytes()


def test_numpy_in_numpy_out_with_per_tensor_scales(rng):
    fp8, batch, hq, hkv, d, cap = FP8[1], 3, 8, 2, 128, 300
    lens = [0, 150, cap]
    q = rand(rng, (batch, hq, 2, d), np.float16)
    k, k_scale, k_ref = fp8_cache(rng, batch, hkv, cap, d, fp8, lens, per_token=False)
    v, v_scale, v_ref = fp8_cache(rng, batch, hkv, cap, d, fp8, lens, per_token=False)
    o, lse = ptxattn.decode(q, k, v, np.asarray(lens, np.int32), k_scale=k_scale, v_scale=v_scale, return_lse=True)
    assert isinstance(o, np.ndarray) and o.dtype == np.float16
    check_attention(o, lse, *reference.decode(q, k_ref, v_ref, lens), ptxattn.bfloat16)


def test_graph_replay_follows_device_lengths_bitwise(rng):
    fp8, batch, hq, hkv, d, cap = FP8[0], 4, 32, 8, 128, 4096
    dev = ptxattn.get_device(0)
    with on_device(dev):
        stream = ptxattn.Stream.create()
    q_host = rand(rng, (batch, hq, 1, d), ptxattn.bfloat16)
    full = [cap] * batch
    k_host, k_scale, k_ref = fp8_cache(rng, batch, hkv, cap, d, fp8, full, per_token=True)
    v_host, v_scale, v_ref = fp8_cache(rng, batch, hkv, cap, d, fp8, full, per_token=True)
    q, k, v, ks, vs = (ptxattn.asarray(x, stream) for x in (q_host, k_host, v_host, k_scale, v_scale))
    lens = ptxattn.asarray(np.array(full, np.int32), stream)
    out = ptxattn.empty((batch, hq, 1, d), ptxattn.bfloat16, dev)
    workspace = ptxattn.empty((ptxattn.decode_workspace_bytes(q, k, v, device=dev),), np.uint8, dev)
    call = dict(k_scale=ks, v_scale=vs, out=out, workspace=workspace, stream=stream)
    ptxattn.decode(q, k, v, lens, **call)  # load modules first
    with ptxattn.capture(stream, dev) as graph:
        ptxattn.decode(q, k, v, lens, **call)
    for new_lens in ([1, 1000, 2049, cap], [0, 4095, 16, 17], [cap, cap, 0, 300]):
        host_lens = np.array(new_lens, np.int32)
        lens.set(host_lens, stream)
        out.set(np.full(out.shape, np.nan, np.float32).astype(ptxattn.bfloat16), stream)
        graph.replay(stream)
        replayed = out.get(stream)
        eager = ptxattn.decode(q, k, v, lens, k_scale=ks, v_scale=vs, stream=stream).get(stream)
        assert replayed.tobytes() == eager.tobytes()
        check_attention(replayed, None, reference.decode(q_host, k_ref, v_ref, host_lens)[0], None, ptxattn.bfloat16)


@pytest.mark.parametrize("per_token", [False, True], ids=["per_tensor", "per_token"])
@pytest.mark.parametrize("fp8", FP8, ids=FP8_IDS)
def test_quantization_error(rng, fp8, per_token):
    """What fp8 costs against the unquantized cache: the relative error (as in gpu_util) of
    decode over the quantized cache against the float64 attention over the original values,
    printed (pytest -s) and bounded. decode's docstring quotes the measured figures."""
    batch, hq, hkv, d, cap = 4, 32, 8, 128, 2048
    lens = [cap] * batch
    q = rand(rng, (batch, hq, 1, d), ptxattn.bfloat16)
    x_k = rng.standard_normal((batch, hkv, cap, d))
    x_v = rng.standard_normal((batch, hkv, cap, d))
    k, k_scale, _ = fp8_quantized(x_k, fp8, lens, per_token)
    v, v_scale, _ = fp8_quantized(x_v, fp8, lens, per_token)
    o = run(rng, q, k, k_scale, v, v_scale, lens)[0]
    error = relative_error(o, reference.decode(q, x_k, x_v, lens)[0])
    print(f"\nfp8 {fp8} {'per-token' if per_token else 'per-tensor'} scales: relative error {error:.4f} "
          f"against the unquantized cache")
    assert error < {FP8[0]: 0.08, FP8[1]: 0.15}[fp8]


def test_e4m3_nan_in_live_values(rng):
    """An e4m3fn NaN byte (0x7f) among the live values: NaN in its column of every head's
    output where the arch converts in hardware (sm_89+), 480 times the scale before it (the
    bit-trick conversion), as decode's docstring says; every other column as the reference."""
    fp8, hq, hkv, d, cap = FP8[0], 4, 1, 128, 64
    q = rand(rng, (1, hq, 1, d), ptxattn.bfloat16)
    k, k_scale, k_ref = fp8_cache(rng, 1, hkv, cap, d, fp8, [cap], per_token=False)
    v, v_scale, v_ref = fp8_cache(rng, 1, hkv, cap, d, fp8, [cap], per_token=False)
    v.view(np.uint8)[0, 0, 10, 5] = FP8_NAN
    hardware_cvt = int(loaded_arch(ptxattn.get_device(0), "decode")[3:5]) >= 89
    v_ref[0, 0, 10, 5] = np.nan if hardware_cvt else 480.0 * v_scale
    guard = GuardedAttention(rng, (1, hq, 1, d), ptxattn.bfloat16)
    lens = ptxattn.asarray(np.array([cap], np.int32))
    ptxattn.decode(ptxattn.asarray(q), ptxattn.asarray(k), ptxattn.asarray(v), lens, k_scale=k_scale, v_scale=v_scale,
                   out=guard.o.array)
    o = guard.o.check(nan_allowed=True).astype(np.float64)
    want = reference.decode(q, k_ref, v_ref, [cap])[0]
    assert np.array_equal(np.isnan(o), np.isnan(want)), f"NaN at {np.argwhere(np.isnan(o))[:4].tolist()}"
    live = ~np.isnan(want)
    assert relative_error(o[live], want[live]) <= REL_TOL[ptxattn.bfloat16]
