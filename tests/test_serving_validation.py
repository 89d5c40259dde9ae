"""Every bad argument of ragged_attention and paged_attention is refused with an error naming
it, before any device work (NumPy calls check offsets, lengths and page ids on the host); and
the planning arithmetic of their serving grids and workspaces. The device arrays here point at
no memory and the device is fake: validation must not touch either."""
from __future__ import annotations

import numpy as np
import pytest

import ptxattn
from ptxattn import DeviceArray, Device

E4M3, E5M2 = ptxattn.dtypes.float8_e4m3fn, ptxattn.dtypes.float8_e5m2
FAKE_DEVICE = Device(ordinal=0, name="validation-only", compute_capability=(9, 0), sm_count=132,
                     total_memory=0, max_shared_per_block_optin=232448, l2_bytes=0)
BF16 = ptxattn.bfloat16
NQ, NK, HQ, HKV, D = 40, 60, 8, 2, 64
PAGES, PAGE, MAX_PAGES = 12, 16, 4


def dev(shape, dtype=np.float16, strides=None, ptr=0x100000) -> DeviceArray:
    return DeviceArray(ptr, shape, dtype, strides, FAKE_DEVICE, owner=None)


def host(shape, dtype=np.float16):
    return np.ones(shape, np.float32).astype(dtype)


def ragged(options=None, **over):
    a = dict(q=host((NQ, HQ, D)), k=host((NK, HKV, D)), v=host((NK, HKV, D)),
             cu_seqlens_q=np.array([0, 10, 40], np.int32), cu_seqlens_k=np.array([0, 30, 60], np.int32))
    a.update(over)
    return ptxattn.ragged_attention(a.pop("q"), a.pop("k"), a.pop("v"), a.pop("cu_seqlens_q"), a.pop("cu_seqlens_k"),
                                    **a, **(options or {}))


def paged(options=None, **over):
    a = dict(q=host((NQ, HQ, D)), k_pool=host((PAGES, HKV, PAGE, D)), v_pool=host((PAGES, HKV, PAGE, D)),
             qo_indptr=np.array([0, 1, 40], np.int32), block_table=np.array([[0, 1, 2, 3], [4, 5, 6, 7]], np.int32),
             seq_lens=np.array([20, 50], np.int32))
    a.update(over)
    return ptxattn.paged_attention(a.pop("q"), a.pop("k_pool"), a.pop("v_pool"), a.pop("qo_indptr"),
                                   a.pop("block_table"), a.pop("seq_lens"), **a, **(options or {}))


# ---- ragged_attention ------------------------------------------------------------------------
@pytest.mark.parametrize("over, error, message", [
    (dict(q=host((NQ, HQ, 1, D))), ValueError, r"ragged_attention: q must be 3-d \[Nq, Hq, Dqk\], got shape"),
    (dict(q=host((NQ, HQ, D), np.float64)), TypeError, "ragged_attention: q must be float16, bfloat16 or float32"),
    (dict(k=host((NK, HKV, D), np.float32)), TypeError, "q, k and v must share a dtype"),
    (dict(k=host((NK, HKV, 32))), ValueError, r"k must be \[Nk, Hkv, Dqk=64\], got \(60, 2, 32\)"),
    (dict(v=host((NK - 1, HKV, D))), ValueError, r"v must be \[Nk, Hkv, Dv\] = \[60, 2, Dv\], got \(59, 2, 64\)"),
    (dict(k=host((NK, 3, D)), v=host((NK, 3, D))), ValueError, "Hq must be a multiple of Hkv, got Hq=8 .* Hkv=3"),
    (dict(q=host((NQ, HQ, 300)), k=host((NK, HKV, 300)), v=host((NK, HKV, 300))), ValueError,
     "head dim Dqk must be in 1..256, got 300"),
    (dict(cu_seqlens_q=np.array([0, 10, 40], np.int64)), TypeError, "cu_seqlens_q must be int32, got int64"),
    (dict(cu_seqlens_q=np.zeros((2, 2), np.int32)), ValueError, r"cu_seqlens_q must be int32 \[B \+ 1\]"),
    (dict(cu_seqlens_k=np.array([0, 60], np.int32)), ValueError, r"cu_seqlens_k must have shape \(3,\), got \(2,\)"),
    (dict(cu_seqlens_q=np.array([0, 10, 41], np.int32)), ValueError,
     r"cu_seqlens_q\[2\] = 41 is outside \[0, 40\]"),
    (dict(cu_seqlens_k=np.array([0, 30, 29], np.int32)), ValueError,
     r"cu_seqlens_k must be non-decreasing, got cu_seqlens_k\[1\] = 30 > cu_seqlens_k\[2\] = 29"),
    (dict(causal=1), TypeError, "ragged_attention: causal must be True or False, got 1"),
    (dict(window=(3,)), TypeError, "ragged_attention: window must be None or a pair"),
    (dict(softcap=-1.0), ValueError, "softcap must be finite and >= 0"),
    (dict(sinks=np.zeros(3, np.float32)), TypeError, r"sinks must be float32 of shape \(8,\)"),
    (dict(out=np.zeros((NQ, HQ, D), np.float32)), ValueError, r"out must be \(40, 8, 64\) float16, got"),
    (dict(out_lse=np.zeros((HQ, NQ), np.float32)), ValueError, r"out_lse must be \(40, 8\) float32"),
])
def test_ragged_refuses(over, error, message):
    with pytest.raises(error, match=message):
        ragged(**over)


def fp8_ragged(dtype=E4M3, **over):
    """ragged() over fp8 k / v of `dtype` with per-tensor scales, unless `over` says otherwise."""
    return ragged(**{"k": host((NK, HKV, D), dtype), "v": host((NK, HKV, D), dtype), "k_scale": 0.5,
                     "v_scale": 0.25, **over})


@pytest.mark.parametrize("over, error, message", [
    (dict(v=host((NK, HKV, D))), TypeError, "ragged_attention: v must have k's dtype float8_e4m3fn, got float16"),
    (dict(v=host((NK, HKV, D), E5M2)), TypeError, "v must have k's dtype float8_e4m3fn, got float8_e5m2"),
    (dict(q=host((NQ, HQ, D), np.float32)), TypeError,
     "ragged_attention: q must be float16 or bfloat16 with float8_e4m3fn caches, got float32"),
    (dict(q=host((NQ, HQ, D), E4M3)), TypeError, "ragged_attention: q must be float16, bfloat16 or float32, got "
                                                 "float8_e4m3fn"),
    (dict(k_scale=None), TypeError, "ragged_attention: k_scale is required with a float8_e4m3fn k: a positive "
                                    r"number .* or a float32 array of shape \(60, 2\)"),
    (dict(v_scale=None), TypeError, "v_scale is required with a float8_e4m3fn v"),
    (dict(k_scale=0.0), ValueError, "ragged_attention: k_scale must be finite and > 0, got 0.0"),
    (dict(v_scale=float("nan")), ValueError, "v_scale must be finite and > 0, got nan"),
    (dict(k_scale=True), TypeError, "k_scale must be a positive number or a float32 array, got bool"),
    (dict(k_scale=np.ones((NK, HKV + 1), np.float32)), TypeError,
     r"k_scale must be float32 of shape \(60, 2\) \(k's shape less its last axis, layout token-major\), got "
     r"float32 \(60, 3\)"),
    (dict(v_scale=np.ones((NK, HKV), np.float64)), TypeError, r"v_scale must be float32 of shape \(60, 2\)"),
    (dict(q=host((NQ, HQ, 96)), k=host((NK, HKV, 96), E4M3), v=host((NK, HKV, 96), E4M3)), TypeError,
     r"ragged_attention: float8_e4m3fn k and v are read for head dims Dqk = Dv in \(64, 128\), got Dqk=96, Dv=96"),
    (dict(v=host((NK, HKV, 128), E4M3)), TypeError, r"head dims Dqk = Dv in \(64, 128\), got Dqk=64, Dv=128"),
    (dict(k=host((NK, HKV, 24), E4M3), q=host((NQ, HQ, 24))), ValueError,
     "k's last axis must be a positive multiple of 16 for float8_e4m3fn"),
])
def test_ragged_refuses_bad_fp8(over, error, message):
    with pytest.raises(error, match=message):
        fp8_ragged(**over)


def test_ragged_refuses_scales_without_fp8():
    with pytest.raises(TypeError, match="ragged_attention: k_scale applies to float8 caches only, and k is float16"):
        ragged(k_scale=1.0)
    with pytest.raises(TypeError, match="v_scale applies to float8 caches only, and v is float16"):
        ragged(v_scale=np.ones((NK, HKV), np.float32))
    with pytest.raises(TypeError, match=r"q, k and v must share a dtype \(or k and v one fp8 type\)"):
        ragged(v=host((NK, HKV, D), BF16))


def test_ragged_fp8_device_arrays_refused_before_device_work():
    k = dev((NK, HKV, D), E4M3, strides=(HKV * D + 8, D, 1))  # 136-byte token stride: rows off 16-byte alignment
    with pytest.raises(ValueError, match="ragged_attention: k must start on a 16-byte boundary and have strides"):
        ptxattn.ragged_attention(dev((NQ, HQ, D)), k, dev((NK, HKV, D), E4M3), dev((3,), np.int32),
                                 dev((3,), np.int32), k_scale=1.0, v_scale=1.0)
    with pytest.raises(TypeError, match=r"k_scale must be float32 of shape \(60, 2\)"):
        ptxattn.ragged_attention(dev((NQ, HQ, D)), dev((NK, HKV, D), E4M3), dev((NK, HKV, D), E4M3),
                                 dev((3,), np.int32), dev((3,), np.int32), k_scale=dev((NK,), np.float32),
                                 v_scale=1.0)
    with pytest.raises(ValueError, match="k_scale must have non-negative strides"):
        ptxattn.ragged_attention(dev((NQ, HQ, D)), dev((NK, HKV, D), E4M3), dev((NK, HKV, D), E4M3),
                                 dev((3,), np.int32), dev((3,), np.int32),
                                 k_scale=dev((NK, HKV), np.float32, strides=(-8, 4)), v_scale=1.0)


def test_ragged_missing_offsets_are_named():
    with pytest.raises(TypeError, match="ragged_attention: cu_seqlens_k is required, got None"):
        ragged(cu_seqlens_k=None)


def test_ragged_device_arrays_refused_before_device_work():
    # A strided last axis on a device array; no memory exists behind these addresses.
    with pytest.raises(ValueError, match="ragged_attention: q must have a contiguous last axis"):
        ptxattn.ragged_attention(dev((NQ, HQ, D), strides=(HQ * D * 4, D * 4, 4)), dev((NK, HKV, D)),
                                 dev((NK, HKV, D)), dev((3,), np.int32), dev((3,), np.int32))


# ---- paged_attention --------------------------------------------------------------------------
@pytest.mark.parametrize("over, error, message", [
    (dict(q=host((NQ, HQ, 1, D))), ValueError, r"paged_attention: q must be 3-d \[Nq, Hq, Dqk\]"),
    (dict(q=host((NQ, HQ, D), np.float32)), TypeError, "q must have k_pool's dtype float16, got float32"),
    (dict(q=host((NQ, HQ, 32))), ValueError, r"q's Dqk \(32\) must equal k_pool's D \(64\)"),
    (dict(q=host((NQ, 3, D))), ValueError, "Hq must be a multiple of Hkv, got Hq=3"),
    (dict(v_pool=host((PAGES, HKV, 8, D))), ValueError, "same number of pages and page size"),
    (dict(qo_indptr=np.array([0, 40], np.int32)), ValueError, r"block_table must have shape \(B=1"),
    (dict(block_table=np.zeros((2, 4), np.int64)), TypeError, "block_table must be int32, got int64"),
    (dict(seq_lens=np.zeros(3, np.int32)), ValueError, r"seq_lens must have shape \(2,\), got \(3,\)"),
    (dict(seq_lens=np.array([20, 65], np.int32)), ValueError, r"seq_lens\[1\] = 65 is outside \[0, 64\]"),
    (dict(qo_indptr=np.array([0, 41, 40], np.int32)), ValueError, r"qo_indptr\[1\] = 41 is outside \[0, 40\]"),
    (dict(qo_indptr=np.array([0, 30, 20], np.int32)), ValueError, "qo_indptr must be non-decreasing"),
    (dict(block_table=np.array([[0, 1, 2, 3], [4, 5, 6, 12]], np.int32)), ValueError,
     r"block_table\[1\]\[3\] = 12 is outside \[0, 11\]"),
    (dict(decode_queries=17), ValueError, r"decode_queries must be an int in \[0, 16\].*got 17"),
    (dict(decode_queries=1.0), ValueError, r"decode_queries must be an int in \[0, 16\].*got 1.0"),
    (dict(decode_queries=True), ValueError, r"decode_queries must be an int in \[0, 16\].*got True"),
    (dict(layout="HDN"), ValueError, "layout must be 'HND', 'NHD'"),
    (dict(out=np.zeros((NQ, HQ, D), np.float16)[:, :, ::2]), ValueError, r"out must be \(40, 8, 64\) float16"),
    (dict(workspace="abc"), TypeError, "paged_attention: workspace must be an array"),
])
def test_paged_refuses(over, error, message):
    with pytest.raises(error, match=message):
        paged(**over)


def fp8_paged(dtype=E4M3, layout="HND", **over):
    """paged() over fp8 pools of `dtype` with per-token scales, unless `over` says otherwise."""
    shape = (PAGES, HKV, PAGE, D) if layout == "HND" else (PAGES, PAGE, HKV, D)
    scales = np.ones(shape[:3], np.float32)
    return paged(**{"k_pool": host(shape, dtype), "v_pool": host(shape, dtype), "k_scale": scales,
                    "v_scale": scales, "layout": layout, **over})


@pytest.mark.parametrize("over, error, message", [
    (dict(v_pool=host((PAGES, HKV, PAGE, D))), TypeError,
     "paged_attention: v_pool must have k_pool's dtype float8_e4m3fn, got float16"),
    (dict(v_pool=host((PAGES, HKV, PAGE, D), E5M2)), TypeError,
     "v_pool must have k_pool's dtype float8_e4m3fn, got float8_e5m2"),
    (dict(q=host((NQ, HQ, D), BF16), k_pool=host((PAGES, HKV, PAGE, D), BF16)), TypeError,
     "v_pool must have k_pool's dtype bfloat16, got float8_e4m3fn"),
    (dict(q=host((NQ, HQ, D), np.float32)), TypeError,
     "paged_attention: q must be float16 or bfloat16 with float8_e4m3fn caches, got float32"),
    (dict(q=host((NQ, HQ, D), E5M2)), TypeError, "paged_attention: q must be float16, bfloat16 or float32"),
    (dict(k_scale=None), TypeError, r"paged_attention: k_scale is required with a float8_e4m3fn k_pool: .* "
                                    r"shape \(12, 2, 16\) \(one per token and kv head\), got None"),
    (dict(v_scale=-1.0), ValueError, "paged_attention: v_scale must be finite and > 0, got -1.0"),
    (dict(k_scale=np.ones((PAGES, PAGE, HKV), np.float32)), TypeError,
     r"k_scale must be float32 of shape \(12, 2, 16\) \(k_pool's shape less its last axis, layout HND\), got "
     r"float32 \(12, 16, 2\)"),
    (dict(layout="NHD", v_scale=np.ones((PAGES, HKV, PAGE), np.float32)), TypeError,
     r"v_scale must be float32 of shape \(12, 16, 2\) \(v_pool's shape less its last axis, layout NHD\)"),
    (dict(k_scale=np.ones((PAGES, HKV, PAGE), np.float16)), TypeError, r"k_scale must be float32 of shape"),
    (dict(q=host((NQ, HQ, 32)), k_pool=host((PAGES, HKV, PAGE, 32), E4M3), v_pool=host((PAGES, HKV, PAGE, 32), E4M3)),
     TypeError, r"paged_attention: float8_e4m3fn k_pool and v_pool are read for head dims Dqk = Dv in \(64, 128\), "
                r"got Dqk=32, Dv=32"),
    (dict(v_pool=host((PAGES, HKV, PAGE, 128), E4M3)), TypeError, r"got Dqk=64, Dv=128"),
    (dict(decode_queries=4, v_scale=0.0), ValueError, "v_scale must be finite and > 0"),
])
def test_paged_refuses_bad_fp8(over, error, message):
    with pytest.raises(error, match=message):
        fp8_paged(**over)


def test_paged_refuses_scales_without_fp8():
    with pytest.raises(TypeError, match="paged_attention: k_scale applies to float8 caches only, and k_pool is "
                                        "float16; got k_scale=1.0"):
        paged(k_scale=1.0)
    with pytest.raises(TypeError, match="v_scale applies to float8 caches only, and v_pool is float16"):
        paged(v_scale=np.ones((PAGES, HKV, PAGE), np.float32))


def test_fp8_plans():
    """fp8 K/V run the general fp8 kernels whatever the options: wgmma on sm_90a devices with
    aligned tensors, else flash_fwd_fp8's mma.sync ones; their shapes are the general tiles' (the
    wgmma ones with a staging area of a K and a V tile's bytes beside)."""
    from ptxattn.ops import attention

    sm90 = attention.plan_kernel(BF16, 128, 128, False, True, fp8=True)
    assert (sm90.kernel, sm90.rows, sm90.threads) == ("flash_fwd_sm90_bf16_d128_general_fp8", 128, 256)
    assert sm90.shared == attention.plan_kernel(BF16, 128, 128, True, True).shared + 2 * 128 * 128
    assert attention.plan_kernel(np.dtype(np.float16), 64, 64, True, True, paged=True, fp8=True).kernel == \
        "flash_fwd_sm90_f16_d64_general_fp8"
    mma = attention.plan_kernel(np.dtype(np.float16), 64, 64, False, False, paged=True, fp8=True)
    general = attention.plan_kernel(np.dtype(np.float16), 64, 64, True, False)
    assert mma.kernel == "flash_fwd_f16_d64_general_fp8" and (mma.rows, mma.threads, mma.shared) == \
        (general.rows, general.threads, general.shared)


def test_paged_fp8_workspace_plans_decode_over_fp8():
    """fp8 pools: the decode rows' part of the workspace is decode's fp8 plan."""
    from ptxattn.ops.decode import plan_decode

    q, pool = dev((NQ, HQ, D)), dev((PAGES, HKV, PAGE, D), E5M2)
    qo, table = dev((3,), np.int32), dev((2, MAX_PAGES), np.int32)
    plan = plan_decode(batch=2, hq=HQ, hkv=HKV, sq=4, dqk=D, dv=D, capacity=MAX_PAGES * PAGE, dtype=np.float16,
                       cache_dtype=E5M2, sm_count=132, max_shared=232448)
    rows = 2 * HQ * 4

    def up(n):
        return -(-n // 256) * 256

    assert ptxattn.paged_attention_workspace_bytes(q, pool, pool, qo, table, decode_queries=4, device=FAKE_DEVICE) == \
        up(rows * D * 2) * 2 + up(2 * 4) + up(plan.workspace_bytes)


def test_paged_pages_past_a_length_are_not_checked():
    """Only the pages a sequence reads must be in the pool (the NumPy host check): row 0's
    length 20 reads two of its four pages, so its -1 and 99 past them pass and the refusal
    names row 1's page; a bad page row 0 does read is named."""
    with pytest.raises(ValueError, match=r"block_table\[1\]\[3\] = 99"):
        paged(block_table=np.array([[0, 1, -1, 99], [4, 5, 6, 99]], np.int32))
    with pytest.raises(ValueError, match=r"block_table\[0\]\[1\] = -1"):
        paged(block_table=np.array([[0, -1, 2, 3], [4, 5, 6, 7]], np.int32))


def test_paged_workspace_holds_the_decode_rows():
    """The workspace: dense q and o for B x Hq x decode_queries rows, their lse, B lengths, and
    decode's own split partials; none without decode rows."""
    from ptxattn.ops.decode import plan_decode

    q, pool = dev((NQ, HQ, D)), dev((PAGES, HKV, PAGE, D))
    qo, table = dev((3,), np.int32), dev((2, MAX_PAGES), np.int32)
    size = ptxattn.paged_attention_workspace_bytes
    assert size(q, pool, pool, qo, table, decode_queries=0, device=FAKE_DEVICE) == 0
    plan = plan_decode(batch=2, hq=HQ, hkv=HKV, sq=4, dqk=D, dv=D, capacity=MAX_PAGES * PAGE, dtype=np.float16,
                       sm_count=132, max_shared=232448)
    rows = 2 * HQ * 4

    def up(n):
        return -(-n // 256) * 256

    want = up(rows * D * 2) * 2 + up(rows * 4) + up(2 * 4) + up(plan.workspace_bytes)
    assert size(q, pool, pool, qo, table, decode_queries=4, return_lse=True, device=FAKE_DEVICE) == want
    assert size(q, pool, pool, qo, table, decode_queries=4, device=FAKE_DEVICE) == want - up(rows * 4)
