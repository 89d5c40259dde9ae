"""ptxattn.sdpa refuses bad input on the host, before any device work, naming the argument,
what it expected and what it got; plus the planning arithmetic (no GPU needed)."""
from __future__ import annotations

import numpy as np
import pytest

import ptxattn
from ptxattn.ops import attention
from ptxattn.variants import sdpa_tiles, sm90_tiles


def _qkv(b=1, hq=4, hkv=2, sq=3, skv=5, dqk=8, dv=8, dtype=np.float16):
    return (np.ones((b, hq, sq, dqk), dtype), np.ones((b, hkv, skv, dqk), dtype),
            np.ones((b, hkv, skv, dv), dtype))


def _raises(exc, match, *args, **kwargs):
    with pytest.raises(exc, match=match):
        ptxattn.sdpa(*args, **kwargs)


def test_rank_and_dtype_errors():
    q, k, v = _qkv()
    _raises(ValueError, r"q must be 4-d \[B, Hq, Sq, Dqk\], got shape \(4, 3, 8\)", q[0], k, v)
    _raises(ValueError, r"v must be 4-d", q, k, v[0])
    _raises(TypeError, r"q must be float16, bfloat16 or float32, got float64", q.astype(np.float64), k, v)
    _raises(TypeError, r"q, k and v must share a dtype, got q float16, k float32", q, k.astype(np.float32), v)


def test_shape_mismatches():
    q, k, v = _qkv()
    _raises(ValueError, r"Hq must be a multiple of Hkv, got Hq=4 \(q\) and Hkv=3", q, *_qkv(hkv=3)[1:])
    _raises(ValueError, r"k must be \[B=1, Hkv, Skv, Dqk=8\], got \(1, 2, 5, 6\)", q, k[..., :6], v)
    _raises(ValueError, r"k must be \[B=2", *_qkv(b=2)[:1], k, v)
    _raises(ValueError, r"v must be \[B, Hkv, Skv, Dv\] = \[1, 2, 5, Dv\], got \(1, 2, 4, 8\)", q, k, v[:, :, :4])
    _raises(ValueError, r"head dim Dqk must be in 1..256, got 300", *_qkv(dqk=300))
    _raises(ValueError, r"head dim Dv must be in 1..256, got 0", *_qkv(dv=0))


def test_option_errors():
    q, k, v = _qkv()
    _raises(ValueError, r"causal_align must be 'top_left' or 'bottom_right', got 'diagonal'",
            q, k, v, causal=True, causal_align="diagonal")
    _raises(TypeError, r"causal must be True or False, got 'yes'", q, k, v, causal="yes")
    _raises(TypeError, r"window must be None or a pair \(left, right\) of ints or None, got \(1, 2, 3\)", q, k, v,
            window=(1, 2, 3))
    _raises(TypeError, r"window must be None or a pair", q, k, v, window=(1.5, 2))
    _raises(ValueError, r"window entries must be >= 0, or -1 / None for unbounded, got \(-2, 0\)", q, k, v,
            window=(-2, 0))
    _raises(ValueError, r"scale must be finite, got nan", q, k, v, scale=float("nan"))
    _raises(TypeError, r"scale must be a number or None, got True", q, k, v, scale=True)
    _raises(ValueError, r"softcap must be finite and >= 0 \(0 = off\), got -1.0", q, k, v, softcap=-1.0)
    _raises(TypeError, r"return_lse must be True or False, got 1", q, k, v, return_lse=1)


def test_mask_errors():
    q, k, v = _qkv()
    _raises(TypeError, r"attn_mask must be bool, float32, float16 or bfloat16, got int32",
            q, k, v, attn_mask=np.ones((3, 5), np.int32))
    _raises(ValueError, r"attn_mask must have rank <= 4, got shape \(1, 1, 1, 3, 5\)",
            q, k, v, attn_mask=np.ones((1, 1, 1, 3, 5), bool))
    _raises(ValueError, r"attn_mask of shape \(2, 5\) does not broadcast to \[B, Hq, Sq, Skv\] = \(1, 4, 3, 5\)",
            q, k, v, attn_mask=np.ones((2, 5), bool))
    _raises(ValueError, r"attn_mask of shape \(3, 3, 5\)", q, k, v, attn_mask=np.ones((3, 3, 5), np.float32))


def test_sinks_and_out_errors():
    q, k, v = _qkv()
    _raises(TypeError, r"sinks must be float32 of shape \(4,\) .*got float32 \(2,\)", q, k, v,
            sinks=np.zeros(2, np.float32))
    _raises(TypeError, r"sinks must be float32 of shape \(4,\) .*got float64 \(4,\)", q, k, v, sinks=np.zeros(4))
    _raises(ValueError, r"out must be \(1, 4, 3, 8\) float16, got \(1, 4, 3, 7\) float16",
            q, k, v, out=np.empty((1, 4, 3, 7), np.float16))
    _raises(ValueError, r"out must be \(1, 4, 3, 8\) float16, got .* float32", q, k, v,
            out=np.empty((1, 4, 3, 8), np.float32))
    _raises(ValueError, r"out_lse must be \(1, 4, 3\) float32, got \(1, 4\) float32", q, k, v,
            out_lse=np.empty((1, 4), np.float32))


def test_mixed_host_and_device_arrays_are_refused():
    class FakeDevice:  # anything exposing the CUDA Array Interface counts as device memory
        __cuda_array_interface__ = {}
    q, k, v = _qkv()
    _raises(TypeError, r"all NumPy \(host\) or all device arrays; k on the device but q, v on the host",
            q, FakeDevice(), v)


# ---- planning -------------------------------------------------------------------------
def test_vector_io_needs_aligned_rows():
    class Fake:  # what _vector_io_ok reads from a DeviceArray
        def __init__(self, ptr, shape, strides):
            self.ptr, self.shape, self.element_strides = ptr, shape, strides
    q = Fake(1024, (2, 8, 5, 64), (2560, 320, 64, 1))
    o = Fake(8192, (2, 8, 5, 32), (1280, 160, 32, 1))
    assert attention.vector_io_ok((q, o, None))
    assert not attention.vector_io_ok((q, Fake(8200, o.shape, o.element_strides)))
    assert not attention.vector_io_ok((q, Fake(8192, o.shape, (1280, 160, 36, 1))))


@pytest.mark.parametrize("dqk,dv,suffix", [
    (64, 64, "d64"), (59, 64, "d64"), (1, 1, "d64"), (65, 64, "d128"), (128, 128, "d128"),
    (111, 111, "d128"), (64, 128, "d128"), (192, 128, "d192_128"), (150, 100, "d192_128"),
    (192, 192, "d256"), (256, 256, "d256"), (129, 200, "d256"),
])
def test_tile_choice(dqk, dv, suffix):
    assert attention._pick_variant(dqk, dv).suffix == suffix


def test_every_tile_fits_sm86_shared_memory():
    # sm_86 / sm_89 give a block at most 99 KiB of shared memory; the PTX targets them too.
    for variant in sdpa_tiles().values():
        for tile in (variant.plain, variant.general):
            assert tile.shared_bytes <= 99 * 1024, tile
    plan = attention.plan_kernel(np.dtype(np.float32), 256, 256, False, True)
    assert plan.kernel == "flash_fwd_f32" and plan.rows == 4 and plan.threads == 128 and plan.shared <= 99 * 1024


def test_plan_kernel():
    plan = attention.plan_kernel(ptxattn.bfloat16, 128, 128, False, False)
    assert plan.kernel == "flash_fwd_bf16_d128" and plan.rows == 128 and plan.threads == 128
    # Two m16 tiles a warp, four warps: 128 query rows; Q in its own region beside three
    # stages of 32 keys.
    assert plan.shared == 2 * (2 * 64 * 256 + 128 * 128)  # two stages of 64 keys (K and V) + Q


def test_plan_general_variant_for_masks_and_softcap():
    plan = attention.plan_kernel(np.dtype(np.float16), 100, 100, True, False)
    assert plan.kernel == "flash_fwd_f16_d128_general" and plan.rows == 128 and plan.threads == 256
    assert plan.shared == 2 * 3 * 64 * 256  # three stages of 64 keys; Q borrows the last one


def test_plan_wgmma_kernel_on_sm90():
    # Dqk = Dv = 64 or 128 with plain scores and aligned tensors on a device that loads sm_90a PTX.
    # (Plain calls take the warp-specialized kernels unless ws=False: test_plan_sm90_ws_kernel_unless_opted_out.)
    plan = attention.plan_kernel(ptxattn.bfloat16, 128, 128, False, True, ws=False)
    # Three warpgroups of 64 query rows; Q + two stages of 128-key K and V tiles, aligned base.
    assert plan.kernel == "flash_fwd_sm90_bf16_d128" and plan.rows == 192 and plan.threads == 384
    assert plan.shared == 2 * 128 * (192 + 4 * 128) + 1024 <= 227 * 1024
    for tile in sm90_tiles().values():
        assert tile.shared_bytes <= 227 * 1024, tile
    # Masks, softcap and scale <= 0 take the general wgmma kernels: two warpgroups.
    plan = attention.plan_kernel(np.dtype(np.float16), 128, 128, True, True, ws=False)
    assert plan.kernel == "flash_fwd_sm90_f16_d128_general" and plan.rows == 128 and plan.threads == 256
    assert attention.plan_kernel(np.dtype(np.float16), 64, 64, True, True, paged=True).kernel == \
        "flash_fwd_sm90_f16_d64_general_paged"
    # A device without sm_90a PTX keeps the mma.sync kernels.
    assert attention.plan_kernel(np.dtype(np.float16), 128, 128, True, False).kernel == "flash_fwd_f16_d128_general"
    assert attention.plan_kernel(ptxattn.bfloat16, 64, 64, False, True, ws=False).kernel == "flash_fwd_sm90_bf16_d64"
    assert attention.plan_kernel(ptxattn.bfloat16, 64, 64, False, False).kernel == "flash_fwd_bf16_d64"
    assert attention.plan_kernel(ptxattn.bfloat16, 96, 96, False, False).kernel == "flash_fwd_bf16_d128"


@pytest.mark.parametrize("dqk, dv, general, vector_io, kernel", [
    (128, 128, False, False, "flash_fwd_sm90_bf16_d128"),          # unaligned tensors
    (128, 128, True, False, "flash_fwd_sm90_bf16_d128_general"),
    (100, 100, False, True, "flash_fwd_sm90_bf16_d128"),           # dims not multiples of 8
    (64, 60, True, True, "flash_fwd_sm90_bf16_d64_general"),
    (200, 130, False, True, "flash_fwd_sm90_bf16_d256"),
])
def test_plan_element_copies_on_the_plain_wgmma_kernels(dqk, dv, general, vector_io, kernel):
    # Calls the wgmma kernels cannot copy or zero-pad in 16-byte chunks run the plain (not
    # warp-specialized) strided ones, told to copy element by element (vector_io False); paged
    # calls keep mma.sync then.
    plan = attention.plan_kernel(ptxattn.bfloat16, dqk, dv, general, True, vector_io=vector_io)
    assert (plan.kernel, plan.vector_io) == (kernel, False)
    paged = attention.plan_kernel(ptxattn.bfloat16, dqk, dv, general, True, paged=True, vector_io=vector_io)
    assert paged.kernel == attention.plan_kernel(ptxattn.bfloat16, dqk, dv, general, False).kernel
    assert paged.vector_io == vector_io
    # Aligned calls with dims that are multiples of 8 copy 16 bytes at a time.
    assert attention.plan_kernel(ptxattn.bfloat16, 128, 128, general, True, ws=False).vector_io


@pytest.mark.parametrize("dqk, dv, general, kernel", [
    # Every head dim runs a wgmma tile: the smallest that holds it, zero-padded.
    (96, 96, False, "flash_fwd_sm90_bf16_d128"),
    (128, 64, False, "flash_fwd_sm90_bf16_d128"),
    (8, 8, True, "flash_fwd_sm90_bf16_d64_general"),
    (80, 80, True, "flash_fwd_sm90_bf16_d128_general"),
    (192, 128, False, "flash_fwd_sm90_bf16_d192_128"),
    (160, 128, True, "flash_fwd_sm90_bf16_d192_128_general"),
    (192, 192, False, "flash_fwd_sm90_bf16_d256"),
    (200, 136, True, "flash_fwd_sm90_bf16_d256_general"),
    (256, 256, False, "flash_fwd_sm90_bf16_d256"),
    (64, 256, False, "flash_fwd_sm90_bf16_d256"),
])
def test_plan_wgmma_tile_for_every_head_dim(dqk, dv, general, kernel):
    plan = attention.plan_kernel(ptxattn.bfloat16, dqk, dv, general, True, ws=False)
    assert plan.kernel == kernel
    assert attention.plan_kernel(ptxattn.bfloat16, dqk, dv, general, True, paged=True).kernel == kernel + "_paged"


def test_plan_wgmma_tiles_of_the_larger_head_dims():
    # Two warpgroups; Dqk 192 / Dv 128: two stages of 128 keys; D256: two stages of 64 keys.
    plan = attention.plan_kernel(ptxattn.bfloat16, 192, 128, False, True, ws=False)
    assert (plan.rows, plan.threads, plan.shared) == (128, 256, 2 * (192 * 128 + 2 * 128 * (192 + 128)) + 1024)
    plan = attention.plan_kernel(ptxattn.bfloat16, 256, 256, True, True, ws=False)
    assert (plan.rows, plan.threads, plan.shared) == (128, 256, 2 * (256 * 128 + 2 * 64 * 512) + 1024)


@pytest.mark.parametrize("dqk, dv, general, aligned, options, kernel", [
    (64, 64, True, True, dict(ws=True, pingpong=True), "flash_fwd_sm90_bf16_d64_general_ws_pp"),
    # Smaller head dims (multiples of 8) run zero-padded in the smallest tile that holds them.
    (96, 96, False, True, dict(ws=True, pingpong=False), "flash_fwd_sm90_bf16_d128_ws"),
    (40, 24, True, True, dict(ws=True, pingpong=False), "flash_fwd_sm90_bf16_d64_general_ws"),
    (128, 64, True, True, dict(ws=True, pingpong=False), "flash_fwd_sm90_bf16_d128_general_ws"),
    (128, 256, False, True, dict(ws=True, pingpong=False), "flash_fwd_sm90_bf16_d256_ws"),
    # Paged, unaligned or not-multiple-of-8 head dims take no ws kernel; ws=False the default one.
    (128, 128, False, True, dict(paged=True, ws=True), "flash_fwd_sm90_bf16_d128_paged"),
    (256, 256, False, True, dict(paged=True, ws=True), "flash_fwd_sm90_bf16_d256_paged"),
    (128, 128, False, False, dict(ws=True), "flash_fwd_bf16_d128"),
    (128, 128, False, True, dict(ws=True, vector_io=False), "flash_fwd_sm90_bf16_d128"),
    (100, 100, True, True, dict(ws=True), "flash_fwd_sm90_bf16_d128_general"),
    (128, 128, False, True, dict(ws=False), "flash_fwd_sm90_bf16_d128"),
    (128, 128, True, True, dict(ws=False), "flash_fwd_sm90_bf16_d128_general"),
])
def test_plan_ws_kernel_where_it_applies(dqk, dv, general, aligned, options, kernel):
    assert attention.plan_kernel(ptxattn.bfloat16, dqk, dv, general, aligned, **options).kernel == kernel


def test_plan_sm90_ws_kernel_unless_opted_out():
    # By default (or ws=True) plain strided wgmma calls get the warp-specialized kernels:
    # a producer and two consumer warpgroups, 128 rows; Q + the K/V ring, aligned base. Plain
    # D64 calls have three consumers (192 rows).
    plan = attention.plan_kernel(ptxattn.bfloat16, 128, 128, False, True, ws=True, pingpong=False)
    assert (plan.kernel, plan.rows, plan.threads) == ("flash_fwd_sm90_bf16_d128_ws", 128, 384)
    assert plan.shared == 2 * 128 * (128 + 2 * 2 * 128) + 1024
    plan = attention.plan_kernel(np.dtype(np.float16), 64, 64, False, True, ws=True, pingpong=False)
    assert (plan.kernel, plan.rows, plan.threads, plan.shared) == \
        ("flash_fwd_sm90_f16_d64_ws_m192", 192, 512, 2 * 64 * (192 + 2 * 3 * 128) + 1024)
    plan = attention.plan_kernel(np.dtype(np.float16), 64, 64, False, True, ws=True, pingpong=True)
    assert (plan.kernel, plan.rows, plan.threads) == ("flash_fwd_sm90_f16_d64_ws_m192_pp", 192, 512)
    # General calls (masks, softcap, scale <= 0) have warp-specialized kernels of their own.
    plan = attention.plan_kernel(ptxattn.bfloat16, 128, 128, True, True, ws=True, pingpong=False)
    assert (plan.kernel, plan.rows, plan.threads) == ("flash_fwd_sm90_bf16_d128_general_ws", 128, 384)
    # Larger head dims: the 192 / 128 and 256 tiles (64-key tiles at 256, as their wgmma kernels).
    plan = attention.plan_kernel(ptxattn.bfloat16, 192, 128, False, True, ws=True, pingpong=False)
    assert (plan.kernel, plan.threads, plan.shared) == ("flash_fwd_sm90_bf16_d192_128_ws", 384,
                                                        2 * (192 * 128 + 2 * 128 * (192 + 128)) + 1024)
    plan = attention.plan_kernel(np.dtype(np.float16), 256, 256, True, True, ws=True, pingpong=False)
    assert (plan.kernel, plan.shared) == ("flash_fwd_sm90_f16_d256_general_ws", 2 * (256 * 128 + 2 * 64 * 512) + 1024)
    # PTXATTN_SM90_WS=0 (ws=None follows it) gives back the plain wgmma kernel; the dims of
    # sm90_pingpong_dims() (pingpong=None follows it) run the ws kernels' ping-pong twins.
    # General 192 / 128 and 256 calls have no twin: they keep the ws kernel.
    for d, dv in ((64, 64), (128, 128), (192, 128), (256, 256)):
        for general in (False, True):
            kind = "_general" * general
            rows = "_m192" * (d == 64 and not general)  # plain D64: three consumers
            dims = f"d{d}" + f"_{dv}" * (dv != d)
            twin = d in attention.sm90_pingpong_dims() and (d <= 128 or not general)
            default = (f"flash_fwd_sm90_bf16_{dims}{kind}_ws{rows}" + "_pp" * twin
                       if attention.sm90_ws_enabled() else f"flash_fwd_sm90_bf16_{dims}{kind}")
            assert attention.plan_kernel(ptxattn.bfloat16, d, dv, general, True).kernel == default


@pytest.mark.parametrize("value, dims", [(None, {64, 128, 192, 256}), ("", {64, 128, 192, 256}),
                                         ("1", {64, 128, 192, 256}), ("0", set())])
def test_sm90_pingpong_dims_follow_the_setting(monkeypatch, value, dims):
    if value is None:
        monkeypatch.delenv(attention.SM90_PINGPONG_ENV, raising=False)
    else:
        monkeypatch.setenv(attention.SM90_PINGPONG_ENV, value)
    attention.sm90_pingpong_dims.cache_clear()
    try:
        assert attention.sm90_pingpong_dims() == dims
    finally:
        attention.sm90_pingpong_dims.cache_clear()


@pytest.mark.parametrize("variable, function", [(attention.SM90_PINGPONG_ENV, "sm90_pingpong_dims"),
                                                (attention.SM90_WS_ENV, "sm90_ws_enabled")])
def test_sm90_switch_settings_reject_other_values(monkeypatch, variable, function):
    monkeypatch.setenv(variable, "yes")
    getattr(attention, function).cache_clear()
    try:
        with pytest.raises(ValueError, match=f"{variable}: expected 0, 1 or unset, got 'yes'"):
            getattr(attention, function)()
    finally:
        getattr(attention, function).cache_clear()


def test_plan_sm90_pingpong_kernel_on_request():
    plan = attention.plan_kernel(ptxattn.bfloat16, 128, 128, False, True, ws=True, pingpong=True)
    ws = attention.plan_kernel(ptxattn.bfloat16, 128, 128, False, True, ws=True, pingpong=False)
    assert (plan.kernel, ws.kernel) == ("flash_fwd_sm90_bf16_d128_ws_pp", "flash_fwd_sm90_bf16_d128_ws")
    assert (plan.rows, plan.threads, plan.shared) == (ws.rows, ws.threads, ws.shared)
    assert attention.plan_kernel(np.dtype(np.float16), 64, 64, False, True, ws=True, pingpong=True).kernel == \
        "flash_fwd_sm90_f16_d64_ws_m192_pp"
    # Only where a ws kernel runs (general ones too): not with ws=False, nor paged or mma.sync calls.
    assert attention.plan_kernel(ptxattn.bfloat16, 128, 128, False, True, ws=False, pingpong=True).kernel == \
        "flash_fwd_sm90_bf16_d128"
    assert attention.plan_kernel(ptxattn.bfloat16, 128, 128, True, True, ws=True, pingpong=True).kernel == \
        "flash_fwd_sm90_bf16_d128_general_ws_pp"
    assert attention.plan_kernel(ptxattn.bfloat16, 128, 128, False, True, paged=True, ws=True,
                                 pingpong=True).kernel == "flash_fwd_sm90_bf16_d128_paged"
    assert attention.plan_kernel(ptxattn.bfloat16, 128, 128, False, False, pingpong=True).kernel == \
        "flash_fwd_bf16_d128"


def test_window_bounds():
    from ptxattn.ops.checks import UNBOUNDED_WINDOW as unbounded, parse_window

    assert parse_window("sdpa", None) == (unbounded, unbounded)
    assert parse_window("sdpa", None, causal=True) == (unbounded, 0)
    assert parse_window("sdpa", (5, 3), causal=True) == (5, 0)
    assert parse_window("sdpa", (-1, 7)) == (unbounded, 7)
    assert parse_window("sdpa", (None, 0)) == (unbounded, 0)
    assert parse_window("sdpa", (2**40, 0)) == (unbounded, 0)
