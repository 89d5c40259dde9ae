"""Every bad argument of decode, paged_decode, kv_append, paged_kv_append and merge_states is
refused with an error naming it, before any device work. The device arrays here point at no
memory and the device is fake: validation must not touch either."""
from __future__ import annotations

import numpy as np
import pytest

import ptxattn
from ptxattn import DeviceArray, Device

FAKE_DEVICE = Device(ordinal=0, name="validation-only", compute_capability=(9, 0), sm_count=132,
                     total_memory=0, max_shared_per_block_optin=232448, l2_bytes=0)
BF16 = ptxattn.bfloat16
B, HQ, HKV, SQ, D, CAP = 2, 8, 2, 1, 64, 128


def dev(shape, dtype=np.float32, strides=None, ptr=0x100000) -> DeviceArray:
    return DeviceArray(ptr, shape, dtype, strides, FAKE_DEVICE, owner=None)


def host(shape, dtype=np.float16):
    return np.ones(shape, np.float32).astype(dtype)


def decode_args(**over):
    args = dict(q=host((B, HQ, SQ, D)), k_cache=host((B, HKV, CAP, D)), v_cache=host((B, HKV, CAP, D)),
                seq_lens=np.zeros(B, np.int32))
    args.update(over)
    return args


def run_decode(options=None, **over):
    a = decode_args(**over)
    return ptxattn.decode(a["q"], a["k_cache"], a["v_cache"], a["seq_lens"], **(options or {}))


# ---- decode ---------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [np.float64, np.int32])
def test_decode_q_dtype(dtype):
    with pytest.raises(TypeError, match=f"decode: q must be float16, bfloat16 or float32, got {np.dtype(dtype)}"):
        run_decode(q=host((B, HQ, SQ, D), dtype))


def test_decode_cache_dtype_mismatch():
    with pytest.raises(TypeError, match="decode: k_cache must have q's dtype float16, got float32"):
        run_decode(k_cache=host((B, HKV, CAP, D), np.float32))


@pytest.mark.parametrize("sq", [0, 17])
def test_decode_sq_range(sq):
    with pytest.raises(ValueError, match=rf"decode: q's Sq \(axis 2\) must be in \[1, 16\].*got {sq}"):
        run_decode(q=host((B, HQ, sq, D)))


def test_decode_batch_past_the_grid_axis():
    big = 65536
    with pytest.raises(ValueError, match=r"decode: q's batch \(axis 0\) must be <= 65535 \(a grid axis\), got 65536"):
        ptxattn.decode(dev((big, HQ, SQ, D), np.float16), dev((big, HKV, CAP, D), np.float16),
                       dev((big, HKV, CAP, D), np.float16), dev((big,), np.int32))


def test_decode_q_rank():
    with pytest.raises(ValueError, match=r"decode: q must be 4-d \[B, Hq, Sq, Dqk\], got shape \(2, 8, 64\)"):
        run_decode(q=host((B, HQ, D)))


def test_decode_gqa_ratio():
    with pytest.raises(ValueError, match=r"decode: q's Hq \(8\) must be a multiple of the caches' Hkv \(3\)"):
        run_decode(k_cache=host((B, 3, CAP, D)), v_cache=host((B, 3, CAP, D)))


def test_decode_head_dim_mismatch():
    with pytest.raises(ValueError, match=r"decode: q's Dqk \(64\) must equal the key cache's D \(32\)"):
        run_decode(k_cache=host((B, HKV, CAP, 32)))


@pytest.mark.parametrize("dtype, d, top", [(np.float16, 320, 256), (np.float32, 192, 128)])
def test_decode_head_dim_too_large(dtype, d, top):
    with pytest.raises(ValueError, match=f"decode: head dims up to {top} are supported"):
        run_decode(q=host((B, HQ, SQ, d), dtype), k_cache=host((B, HKV, CAP, d), dtype),
                   v_cache=host((B, HKV, CAP, d), dtype))


def test_decode_head_dim_not_16_bytes():
    with pytest.raises(ValueError, match=r"decode: q's last axis must be a positive multiple of 8 for float16"):
        run_decode(q=host((B, HQ, SQ, 36)), k_cache=host((B, HKV, CAP, 36)), v_cache=host((B, HKV, CAP, 36)))


def test_decode_batch_mismatch():
    with pytest.raises(ValueError, match=r"decode: v_cache must hold B=2 rows \(q's batch\), got 3"):
        run_decode(v_cache=host((3, HKV, CAP, D)))


def test_decode_capacity_mismatch():
    with pytest.raises(ValueError, match="decode: k_cache and v_cache must have one positive capacity, got 128 and 64"):
        run_decode(v_cache=host((B, HKV, 64, D)))


def test_decode_layout_name():
    with pytest.raises(ValueError, match="decode: layout must be 'HND', 'NHD'"):
        run_decode({"layout": "BSHD"})


def test_decode_nhd_layout_reads_axes_accordingly():
    # [B, cap, Hkv, D] read as HND would have 128 heads: refused by the GQA check.
    with pytest.raises(ValueError, match=r"Hq \(8\) must be a multiple of the caches' Hkv \(128\)"):
        run_decode(k_cache=host((B, CAP, HKV, D)), v_cache=host((B, CAP, HKV, D)))


@pytest.mark.parametrize("lens, match", [
    (np.zeros(B, np.int64), "decode: seq_lens must be int32, got int64"),
    (np.zeros(3, np.int32), r"decode: seq_lens must have shape \(2,\), got \(3,\)"),
])
def test_decode_seq_lens(lens, match):
    with pytest.raises((TypeError, ValueError), match=match):
        run_decode(seq_lens=lens)


@pytest.mark.parametrize("options, match", [
    ({"scale": float("nan")}, "decode: scale must be finite, got nan"),
    ({"scale": "1"}, "decode: scale must be a number or None, got '1'"),
    ({"scale": True}, "decode: scale must be a number or None, got True"),
    ({"softcap": -1.0}, r"decode: softcap must be finite and >= 0"),
    ({"window": 4}, r"decode: window must be None or a pair \(left, right\)"),
    ({"window": (-2, 0)}, r"decode: window entries must be >= 0, or -1 / None for unbounded, got \(-2, 0\)"),
    ({"window": (1.5, 0)}, r"decode: window must be None or a pair \(left, right\)"),
    ({"sinks": np.zeros(3, np.float32)}, r"decode: sinks must be float32 of shape \(8,\).*got float32 \(3,\)"),
    ({"sinks": np.zeros(8, np.float64)}, r"decode: sinks must be float32 of shape \(8,\).*got float64 \(8,\)"),
    ({"out": np.empty((B, HQ, SQ, 32), np.float16)}, r"decode: out must be \(2, 8, 1, 64\) float16"),
    ({"out_lse": np.empty((B, HQ), np.float32)}, r"decode: out_lse must be \(2, 8, 1\) float32"),
])
def test_decode_options(options, match):
    with pytest.raises((TypeError, ValueError), match=match):
        run_decode(options)


def test_decode_mixed_host_and_device():
    with pytest.raises(TypeError, match="decode: arrays must be all NumPy"):
        run_decode(q=dev((B, HQ, SQ, D), np.float16))


def dev_decode_args(**over):
    args = dict(q=dev((B, HQ, SQ, D), np.float16), k_cache=dev((B, HKV, CAP, D), np.float16),
                v_cache=dev((B, HKV, CAP, D), np.float16), seq_lens=dev((B,), np.int32))
    args.update(over)
    return args


def test_decode_device_last_axis_strided():
    q = dev((B, HQ, SQ, D), np.float16, strides=(HQ * D * 4, D * 4, D * 4, 4))
    with pytest.raises(ValueError, match="decode: q must have a contiguous last axis"):
        ptxattn.decode(**dev_decode_args(q=q))


def test_decode_device_misaligned_cache():
    k = dev((B, HKV, CAP, D), np.float16, ptr=0x100002)
    with pytest.raises(ValueError, match="decode: k_cache must start on a 16-byte boundary"):
        ptxattn.decode(**dev_decode_args(k_cache=k))


def test_decode_device_strided_seq_lens():
    with pytest.raises(ValueError, match="decode: seq_lens must be contiguous"):
        ptxattn.decode(**dev_decode_args(seq_lens=dev((B,), np.int32, strides=(8,))))


def test_decode_small_workspace():
    need = ptxattn.decode_workspace_bytes(*[dev_decode_args()[k] for k in ("q", "k_cache", "v_cache")],
                                          device=FAKE_DEVICE)
    with pytest.raises(ValueError, match=f"decode: workspace must be a contiguous device array of at least {need:,}"):
        ptxattn.decode(**dev_decode_args(), workspace=dev((need - 1,), np.uint8))


# ---- paged_decode ------------------------------------------------------------------------------
PAGES, PAGE = 16, 16


def paged_args(**over):
    args = dict(q=host((B, HQ, SQ, D)), k_pool=host((PAGES, HKV, PAGE, D)), v_pool=host((PAGES, HKV, PAGE, D)),
                block_table=np.zeros((B, 4), np.int32), seq_lens=np.zeros(B, np.int32))
    args.update(over)
    return args


def run_paged(options=None, **over):
    return ptxattn.paged_decode(**paged_args(**over), **(options or {}))


def test_paged_batch_past_the_grid_axis():
    big = 65536
    with pytest.raises(ValueError, match=r"paged_decode: q's batch \(axis 0\) must be <= 65535 \(a grid axis\)"):
        ptxattn.paged_decode(dev((big, HQ, SQ, D), np.float16), dev((PAGES, HKV, PAGE, D), np.float16),
                             dev((PAGES, HKV, PAGE, D), np.float16), dev((big, 4), np.int32), dev((big,), np.int32))


def test_paged_page_size_power_of_two():
    with pytest.raises(ValueError, match="paged_decode: the page size must be a power of two, got 12"):
        run_paged(k_pool=host((PAGES, HKV, 12, D)), v_pool=host((PAGES, HKV, 12, D)))


def test_paged_pools_disagree():
    with pytest.raises(ValueError, match="paged_decode: k_pool and v_pool must have the same number of pages"):
        run_paged(v_pool=host((PAGES + 1, HKV, PAGE, D)))


def test_paged_pool_heads_disagree():
    with pytest.raises(ValueError, match="paged_decode: k_pool and v_pool must have one number of kv heads"):
        run_paged(v_pool=host((PAGES, 4, PAGE, D)))


def test_paged_mixed_layouts_are_read_per_pool():
    # v as NHD [pages, page, Hkv, D]; declaring it HND makes its page size 2: refused.
    with pytest.raises(ValueError, match="same number of pages and page size"):
        run_paged({"layout": "HND"}, v_pool=host((PAGES, PAGE, HKV, D)))


@pytest.mark.parametrize("table, exc, match", [
    (np.zeros((B, 4), np.int64), TypeError, "paged_decode: block_table must be int32, got int64"),
    (np.zeros((3, 4), np.int32), ValueError, r"paged_decode: block_table must have shape \(B=2, max_pages >= 1\)"),
    (np.zeros((B, 0), np.int32), ValueError, r"paged_decode: block_table must have shape \(B=2, max_pages >= 1\)"),
    (np.zeros(B, np.int32), ValueError, r"paged_decode: block_table must be 2-d"),
])
def test_paged_block_table(table, exc, match):
    with pytest.raises(exc, match=match):
        run_paged(block_table=table)


def test_paged_pool_dtype():
    with pytest.raises(TypeError, match="paged_decode: v_pool must have k_pool's dtype float16, got float32"):
        run_paged(v_pool=host((PAGES, HKV, PAGE, D), np.float32))


def test_paged_window():
    with pytest.raises(TypeError, match=r"paged_decode: window must be None or a pair \(left, right\)"):
        run_paged({"window": (1, 2, 3)})


# ---- kv_append / paged_kv_append -----------------------------------------------------------------
def append_args(**over):
    args = dict(k_new=host((B, HKV, 1, D)), v_new=host((B, HKV, 1, D)), k_cache=host((B, HKV, CAP, D)),
                v_cache=host((B, HKV, CAP, D)), seq_lens=np.zeros(B, np.int32))
    args.update(over)
    return args


@pytest.mark.parametrize("over, exc, match", [
    ({"k_new": host((B, HKV, D))}, ValueError, r"kv_append: k_new must be 4-d \[B, Hkv, n, Dk\]"),
    ({"v_new": host((B, HKV, 2, D))}, ValueError, r"kv_append: v_new must have shape \(2, 2, 1, 64\)"),
    ({"k_cache": host((3, HKV, CAP, D)), "v_cache": host((3, HKV, CAP, D))}, ValueError,
     "kv_append: k_cache must hold B=2 rows of Hkv=2 heads"),
    ({"k_cache": host((B, HKV, CAP, 32))}, ValueError, r"kv_append: k_cache's D \(32\) must equal k_new's \(64\)"),
    ({"v_cache": host((B, HKV, 64, D))}, ValueError, "kv_append: k_cache and v_cache must have one capacity"),
    ({"k_new": host((B, HKV, 200, D)), "v_new": host((B, HKV, 200, D))}, ValueError,
     "kv_append: cannot append n=200 tokens to a cache of capacity 128"),
    ({"k_new": host((B, HKV, 1, D), np.float32)}, TypeError, "kv_append: k_new must have k_cache's dtype float16"),
    ({"seq_lens": np.zeros(B, np.int64)}, TypeError, "kv_append: seq_lens must be int32"),
    ({"k_cache": host((B, HKV, CAP, D), np.int16)}, TypeError, "kv_append: k_cache must be float16, bfloat16 or float32"),
])
def test_kv_append(over, exc, match):
    with pytest.raises(exc, match=match):
        ptxattn.kv_append(**append_args(**over))


def test_kv_append_layout():
    with pytest.raises(ValueError, match="kv_append: layout must be"):
        ptxattn.kv_append(**append_args(), layout=("HND",))


def paged_append_args(**over):
    args = dict(k_new=host((5, HKV, D)), v_new=host((5, HKV, D)), k_pool=host((PAGES, HKV, PAGE, D)),
                v_pool=host((PAGES, HKV, PAGE, D)), slot_mapping=np.zeros(5, np.int32))
    args.update(over)
    return args


@pytest.mark.parametrize("over, exc, match", [
    ({"slot_mapping": np.zeros(5, np.uint32)}, TypeError, "paged_kv_append: slot_mapping must be int32 or int64"),
    ({"slot_mapping": np.zeros(4, np.int32)}, ValueError, r"paged_kv_append: slot_mapping must have shape \(5,\)"),
    ({"v_new": host((4, HKV, D))}, ValueError, r"paged_kv_append: v_new must have shape \(5, 2, 64\)"),
    ({"k_new": host((5, HKV, 1, D))}, ValueError, r"paged_kv_append: k_new must be 3-d \[T, Hkv, Dk\]"),
    ({"k_new": host((5, HKV, D), BF16)}, TypeError, "paged_kv_append: k_new must have k_pool's dtype float16"),
])
def test_paged_kv_append(over, exc, match):
    with pytest.raises(exc, match=match):
        ptxattn.paged_kv_append(**paged_append_args(**over))


# ---- merge_states ---------------------------------------------------------------------------------
def test_merge_shapes_disagree():
    o, lse = host((B, HQ, SQ, D)), np.zeros((B, HQ, SQ), np.float32)
    with pytest.raises(ValueError, match=r"merge_states: o_b must match o_a"):
        ptxattn.merge_states(o, lse, host((B, HQ, SQ, 32)), lse)


def test_merge_lse_dtype():
    o, lse = host((B, HQ, SQ, D)), np.zeros((B, HQ, SQ), np.float32)
    with pytest.raises(ValueError, match=r"merge_states: lse_b must be float32 of shape \(2, 8, 1\)"):
        ptxattn.merge_states(o, lse, o, lse.astype(np.float64))


def test_merge_n_needs_states():
    with pytest.raises(ValueError, match="merge_states_n: need at least one state"):
        ptxattn.merge_states_n(host((0, B, HQ, SQ, D)), np.zeros((0, B, HQ, SQ), np.float32))


def test_merge_n_rank():
    with pytest.raises(ValueError, match=r"merge_states_n: o must be 5-d \[N, B, H, S, D\]"):
        ptxattn.merge_states_n(host((B, HQ, SQ, D)), np.zeros((B, HQ, SQ), np.float32))


def test_merge_sinks_shape():
    o, lse = host((2, B, HQ, SQ, D)), np.zeros((2, B, HQ, SQ), np.float32)
    with pytest.raises(TypeError, match=r"merge_states_n: sinks must be float32 of shape \(8,\)"):
        ptxattn.merge_states_n(o, lse, sinks=np.zeros(2, np.float32))


def test_merge_device_strides_disagree():
    o_a = dev((B, HQ, SQ, D), np.float16)
    o_b = dev((B, HQ, SQ, D), np.float16, strides=(HQ * SQ * D * 4, SQ * D * 4, D * 4, 2), ptr=0x200000)
    lse = dev((B, HQ, SQ), np.float32, ptr=0x300000)
    with pytest.raises(ValueError, match="merge_states: o_a and o_b must have the same strides"):
        ptxattn.merge_states(o_a, lse, o_b, dev((B, HQ, SQ), np.float32, ptr=0x400000))


# ---- fp8 caches ---------------------------------------------------------------------------------
E4M3, E5M2 = ptxattn.dtypes.float8_e4m3fn, ptxattn.dtypes.float8_e5m2
FP8_CACHE = host((B, HKV, CAP, D), E4M3)
TOKEN_SCALES = np.ones((B, HKV, CAP), np.float32)


@pytest.mark.parametrize("over, options, error, message", [
    ({"k_cache": FP8_CACHE, "v_cache": FP8_CACHE}, {"v_scale": 1.0}, TypeError,
     r"decode: k_scale is required with a float8_e4m3fn k_cache: a positive number .* or a float32 array of shape "
     r"\(2, 2, 128\) \(one per token and kv head\), got None"),
    ({"k_cache": FP8_CACHE, "v_cache": FP8_CACHE}, {"k_scale": 1.0}, TypeError, r"decode: v_scale is required"),
    ({}, {"k_scale": 1.0}, TypeError, r"decode: k_scale applies to float8 caches only, and k_cache is float16"),
    ({"k_cache": FP8_CACHE, "v_cache": FP8_CACHE}, {"k_scale": True, "v_scale": 1.0}, TypeError,
     r"decode: k_scale must be a positive number or a float32 array, got bool"),
    ({"k_cache": FP8_CACHE, "v_cache": FP8_CACHE}, {"k_scale": 1.0, "v_scale": 0.0}, ValueError,
     r"decode: v_scale must be finite and > 0, got 0.0"),
    ({"k_cache": FP8_CACHE, "v_cache": FP8_CACHE}, {"k_scale": float("nan"), "v_scale": 1.0}, ValueError,
     r"decode: k_scale must be finite and > 0, got nan"),
    ({"k_cache": FP8_CACHE, "v_cache": FP8_CACHE}, {"k_scale": TOKEN_SCALES[:, :, :5], "v_scale": 1.0}, TypeError,
     r"decode: k_scale must be float32 of shape \(2, 2, 128\) \(k_cache's shape less its last axis, layout HND\), "
     r"got float32 \(2, 2, 5\)"),
    ({"k_cache": FP8_CACHE, "v_cache": FP8_CACHE}, {"k_scale": 1.0, "v_scale": TOKEN_SCALES.astype(np.float16)},
     TypeError, r"decode: v_scale must be float32 of shape \(2, 2, 128\)"),
    ({"k_cache": FP8_CACHE, "v_cache": FP8_CACHE.astype(E5M2)}, {"k_scale": 1.0, "v_scale": 1.0}, TypeError,
     r"decode: v_cache must have k_cache's dtype float8_e4m3fn, got float8_e5m2"),
    ({"q": host((B, HQ, SQ, D), np.float32), "k_cache": FP8_CACHE, "v_cache": FP8_CACHE},
     {"k_scale": 1.0, "v_scale": 1.0}, TypeError, r"decode: q must be float16 or bfloat16 with float8_e4m3fn caches, "
                                                  r"got float32"),
    ({"q": host((B, HQ, SQ, 8)), "k_cache": host((B, HKV, CAP, 8), E4M3), "v_cache": host((B, HKV, CAP, 8), E4M3)},
     {"k_scale": 1.0, "v_scale": 1.0}, ValueError,
     r"decode: k_cache's last axis must be a positive multiple of 16 for float8_e4m3fn \(16-byte rows\), got 8"),
    ({"q": host((B, HQ, SQ, 512)), "k_cache": host((B, HKV, CAP, 512), E4M3),
      "v_cache": host((B, HKV, CAP, 512), E4M3)}, {"k_scale": 1.0, "v_scale": 1.0}, ValueError,
     r"decode: head dims up to 256 are supported for float16 with float8_e4m3fn caches, got Dqk=512, Dv=512"),
], ids=["k_scale_missing", "v_scale_missing", "scale_on_f16_cache", "bool_scale", "zero_scale", "nan_scale",
        "scale_shape", "scale_dtype", "mixed_fp8", "f32_query", "row_bytes", "head_dim"])
def test_decode_fp8_arguments(over, options, error, message):
    with pytest.raises(error, match=message):
        run_decode(options, **over)


def test_paged_decode_fp8_scale_shape_follows_the_pool_layout():
    pool = host((6, 16, HKV, D), E4M3)  # NHD: [pages, page_size, Hkv, D]
    q, table, lens = host((B, HQ, SQ, D)), np.zeros((B, 3), np.int32), np.zeros(B, np.int32)
    with pytest.raises(TypeError, match=r"paged_decode: k_scale must be float32 of shape \(6, 16, 2\) "
                                        r"\(k_pool's shape less its last axis, layout NHD\), got float32 \(6, 2, 16\)"):
        ptxattn.paged_decode(q, pool, pool, table, lens, layout="NHD", k_scale=np.ones((6, HKV, 16), np.float32),
                             v_scale=1.0)


# ---- fp8 appends ----------------------------------------------------------------------------------
F8_NEW = host((B, HKV, 1, D), E4M3)
NEW_SCALES = np.ones((B, HKV, 1), np.float32)


def fp8_append_args(**over):
    args = append_args(k_cache=FP8_CACHE, v_cache=FP8_CACHE, k_scale=1.0, v_scale=TOKEN_SCALES)
    args.update(over)
    return args


@pytest.mark.parametrize("over, error, message", [
    ({"k_scale": None}, TypeError,
     r"kv_append: k_scale is required with a float8_e4m3fn k_cache: a positive number .* got None"),
    ({"k_scale": 0.0}, ValueError, r"kv_append: k_scale must be finite and > 0, got 0.0"),
    ({"v_scale": TOKEN_SCALES[:, :, :5]}, TypeError,
     r"kv_append: v_scale must be float32 of shape \(2, 2, 128\) \(v_cache's shape less its last axis, layout HND\), "
     r"got float32 \(2, 2, 5\)"),
    ({"v_scale": TOKEN_SCALES.astype(np.float64)}, TypeError, r"kv_append: v_scale must be float32 of shape"),
    ({"k_new": host((B, HKV, 1, D), np.float32), "v_new": host((B, HKV, 1, D), np.float32)}, TypeError,
     r"kv_append: k_new must be float16 or bfloat16 \(quantized on append\) or k_cache's float8_e4m3fn, got float32"),
    ({"k_new": host((B, HKV, 1, D), E5M2), "v_new": host((B, HKV, 1, D), E5M2)}, TypeError,
     r"kv_append: k_new must be float16 or bfloat16 \(quantized on append\) or k_cache's float8_e4m3fn, "
     r"got float8_e5m2"),
    ({"v_new": host((B, HKV, 1, D), BF16)}, TypeError, r"kv_append: v_new must have k_new's dtype float16, got bfloat16"),
    ({"v_cache": FP8_CACHE.astype(E5M2)}, TypeError,
     r"kv_append: v_cache must have k_cache's dtype float8_e4m3fn, got float8_e5m2"),
    ({"k_new": host((B, HKV, 1, 8)), "v_new": host((B, HKV, 1, 8)), "k_cache": host((B, HKV, CAP, 8), E4M3),
      "v_cache": host((B, HKV, CAP, 8), E4M3)}, ValueError,
     r"kv_append: k_cache's last axis must be a positive multiple of 16 for float8_e4m3fn \(16-byte rows\), got 8"),
    ({"v_new_scale": NEW_SCALES}, TypeError,
     r"kv_append: v_new_scale goes only with float8 v_new appended to a cache with per-token scales; here v_new is "
     r"float16, quantized with scales computed on append, so pass None \(got ndarray\)"),
    ({"k_new": F8_NEW, "v_new": F8_NEW}, TypeError,
     r"kv_append: v_new_scale is required with float8 v_new and per-token cache scales: the new rows' scales, "
     r"float32 of shape \(2, 2, 1\), got None"),
    ({"k_new": F8_NEW, "v_new": F8_NEW, "v_new_scale": NEW_SCALES[:, :1]}, TypeError,
     r"kv_append: v_new_scale must be float32 of shape \(2, 2, 1\) \(v_new's shape less its last axis\), "
     r"got float32 \(2, 1, 1\)"),
    ({"k_new": F8_NEW, "v_new": F8_NEW, "v_new_scale": NEW_SCALES.astype(np.float16)}, TypeError,
     r"kv_append: v_new_scale must be float32 of shape \(2, 2, 1\)"),
    ({"k_new": F8_NEW, "v_new": F8_NEW, "k_new_scale": NEW_SCALES, "v_new_scale": NEW_SCALES}, TypeError,
     r"kv_append: k_new_scale goes only with .*; here k_scale is per tensor \(the new bytes are in its units\)"),
], ids=["k_scale_missing", "zero_scale", "scale_shape", "scale_dtype", "f32_into_fp8", "other_fp8", "mixed_new",
        "mixed_caches", "row_bytes", "new_scale_when_quantizing", "new_scale_missing", "new_scale_shape",
        "new_scale_dtype", "new_scale_with_tensor_scale"])
def test_kv_append_fp8_arguments(over, error, message):
    with pytest.raises(error, match=message):
        ptxattn.kv_append(**fp8_append_args(**over))


@pytest.mark.parametrize("over, error, message", [
    ({"k_scale": 1.0}, TypeError, r"kv_append: k_scale applies to float8 caches only, and k_cache is float16; "
                                  r"got k_scale=1.0"),
    ({"v_scale": TOKEN_SCALES}, TypeError, r"kv_append: v_scale applies to float8 caches only"),
    ({"k_new_scale": NEW_SCALES}, TypeError, r"kv_append: k_new_scale goes only with .*; here k_cache is float16"),
    ({"k_new": host((B, HKV, 1, D), E4M3), "v_new": host((B, HKV, 1, D), E4M3)}, TypeError,
     r"kv_append: k_new must have k_cache's dtype float16, got float8_e4m3fn"),
], ids=["k_scale", "v_scale", "new_scale", "fp8_rows"])
def test_kv_append_fp8_arguments_refused_by_16_bit_caches(over, error, message):
    with pytest.raises(error, match=message):
        ptxattn.kv_append(**append_args(**over))


def test_kv_append_fp8_scales_follow_the_cache_layout():
    cache = host((B, CAP, HKV, D), E4M3)  # NHD
    with pytest.raises(TypeError, match=r"kv_append: k_scale must be float32 of shape \(2, 128, 2\) \(k_cache's shape "
                                        r"less its last axis, layout NHD\), got float32 \(2, 2, 128\)"):
        ptxattn.kv_append(**append_args(k_cache=cache, v_cache=cache), layout="NHD", k_scale=TOKEN_SCALES,
                          v_scale=1.0)


def test_kv_append_fp8_written_scales_must_be_writable():
    scales = TOKEN_SCALES.copy()
    scales.flags.writeable = False
    with pytest.raises(ValueError, match="kv_append: k_scale is updated in place but the NumPy array is read-only"):
        ptxattn.kv_append(**fp8_append_args(k_scale=scales))


@pytest.mark.parametrize("over, error, message", [
    ({}, TypeError, r"paged_kv_append: k_scale is required with a float8_e4m3fn k_pool"),
    ({"k_scale": np.ones((PAGES, HKV, PAGE), np.float32), "v_scale": 1.0, "k_new": host((5, HKV, D), E4M3),
      "v_new": host((5, HKV, D), E4M3), "k_new_scale": np.ones((5, HKV, 1), np.float32)}, TypeError,
     r"paged_kv_append: k_new_scale must be float32 of shape \(5, 2\) \(k_new's shape less its last axis\), "
     r"got float32 \(5, 2, 1\)"),
    ({"k_scale": np.ones((PAGES, PAGE, HKV), np.float32), "v_scale": 1.0}, TypeError,
     r"paged_kv_append: k_scale must be float32 of shape \(16, 2, 16\) \(k_pool's shape less its last axis, "
     r"layout HND\)"),
    ({"k_scale": 1.0, "v_scale": 1.0, "k_new": host((5, HKV, D), np.float32), "v_new": host((5, HKV, D), np.float32)},
     TypeError, r"paged_kv_append: k_new must be float16 or bfloat16 \(quantized on append\) or k_pool's "
                r"float8_e4m3fn, got float32"),
], ids=["k_scale_missing", "new_scale_shape", "scale_shape", "f32_into_fp8"])
def test_paged_kv_append_fp8_arguments(over, error, message):
    pool = host((PAGES, HKV, PAGE, D), E4M3)
    with pytest.raises(error, match=message):
        ptxattn.paged_kv_append(**paged_append_args(k_pool=pool, v_pool=pool, **over))
