"""PTXATTN_ARCH on the GPU: the kernels sdpa, decode and the quantizing kv_append (bf16, and
fp8 caches: software conversion below sm_89, hardware from sm_89) launch are the ones the
driver JIT-compiled from the chosen arch's PTX, and their results match the float64
reference. The first test checks
whatever arch this process loads; the others run it in a fresh process per shipped non-Hopper
arch (the choice holds for a process), so the default GPU suite covers sm_80 and sm_89 (an sm_86 device loads
the sm_80 PTX).
`PTXATTN_ARCH=sm_80 python -m pytest -m gpu tests/...` runs any GPU test file that way."""
from __future__ import annotations

import numpy as np
import pytest

import ptxattn
from ptxattn import reference
from ptxattn.arch import arch_key
from ptxattn.context import on_device
from ptxattn.driver import call, cu
from ptxattn.module import get_kernel, loaded_arch
from ptxattn.ops import attention

from decode_util import FP8, assert_same_fp8, check_attention, fp8_cache, nan_fp8, nan_tail_cache, rand
from gpu_util import run_under_arch

pytestmark = pytest.mark.gpu

BF16 = ptxattn.bfloat16
OVERRIDES = ["sm_80", "sm_89"]
_FA = cu.CUfunction_attribute


def _version(function, attribute) -> int:
    return call(cu.cuFuncGetAttribute, attribute, function)


def _run_kernels(rng) -> None:
    """An sdpa call the wgmma kernel takes on sm_90 (bf16, d128, aligned, no mask), decode
    over a bf16 and an e4m3 cache, and bf16 rows quantized on append into e4m3 and e5m2
    caches, each checked against the reference."""
    q, k, v = (rand(rng, (1, 2, 300, 128), BF16) for _ in range(3))
    check_attention(*ptxattn.sdpa(q, k, v, return_lse=True), *reference.sdpa(q, k, v), BF16)
    lens = [1, 517, 700]
    q = rand(rng, (3, 8, 1, 128), BF16)
    k, v = (nan_tail_cache(rng, 3, 2, 700, 128, BF16, lens) for _ in range(2))
    check_attention(*ptxattn.decode(q, k, v, np.asarray(lens, np.int32), return_lse=True),
                    *reference.decode(q, k, v, lens), BF16)
    (k8, k_scale, k_ref), (v8, v_scale, v_ref) = (fp8_cache(rng, 3, 2, 700, 128, FP8[0], lens, False)
                                                  for _ in range(2))
    check_attention(*ptxattn.decode(q, k8, v8, np.asarray(lens, np.int32), k_scale=k_scale, v_scale=v_scale,
                                    return_lse=True), *reference.decode(q, k_ref, v_ref, lens), BF16)
    # Quantize on append (e4m3 with per-token scales, e5m2 per tensor, values saturating): the
    # reference's bytes, whichever conversion the arch has.
    x = (rng.standard_normal((2, 2, 3, 128)) * np.exp(rng.uniform(-4, 4, (2, 2, 3, 1)))).astype(BF16)
    for fp8, scale in ((FP8[0], np.full((2, 2, 16), np.nan, np.float32)), (FP8[1], 1e-3)):
        k8, v8, lens = nan_fp8((2, 2, 16, 128), fp8), nan_fp8((2, 2, 16, 128), fp8), np.array([0, 9], np.int32)
        want = reference.kv_append_fp8(x, x, k8, v8, lens, k_scale=scale, v_scale=scale)
        ptxattn.kv_append(x, x, k8, v8, lens, k_scale=scale, v_scale=scale if isinstance(scale, float) else scale.copy())
        assert_same_fp8(k8, want[0])
        assert_same_fp8(v8, want[1])
        assert isinstance(scale, float) or np.array_equal(scale, want[3], equal_nan=True)


def test_kernels_are_jit_compiled_from_the_chosen_arch(rng, monkeypatch):
    device = ptxattn.get_device(0)
    launched = []  # the functions the driver was asked to launch
    launch = cu.cuLaunchKernel

    def recording_launch(function, *args):
        launched.append(function)
        return launch(function, *args)

    monkeypatch.setattr(cu, "cuLaunchKernel", recording_launch)
    _run_kernels(rng)

    wgmma = loaded_arch(device, "flash_fwd_sm90") is not None
    if ptxattn.ptx_arch(device) != device.arch:
        assert not wgmma, "the sm_90a wgmma kernels must not load under an older PTXATTN_ARCH"
    sm90 = attention.plan_kernel(ptxattn.bfloat16, 128, 128, False, True).kernel
    sdpa_kernel = (sm90, "flash_fwd_sm90") if wgmma else ("flash_fwd_bf16_d128", "flash_fwd")
    expected = dict([sdpa_kernel, ("decode_split_bf16_d128", "decode"), ("decode_split_bf16_e4m3_d128", "decode"),
                     ("kv_append_quant_bf16_e4m3", "kv_cache"), ("kv_append_quant_bf16_e5m2", "kv_cache")])
    handles = {int(function) for function in launched}
    major, minor = device.compute_capability
    with on_device(device):
        for name, family in expected.items():
            kernel = get_kernel(name, device)
            assert int(kernel.function) in handles, f"{name} did not run"
            assert kernel.arch == loaded_arch(device, family)
        ptx = {arch_key(loaded_arch(device, family))[0] for family in {*expected.values(), "merge"}}
        for function in launched:  # the split merges too: every kernel launched was JIT-compiled from that PTX
            versions = _version(function, _FA.CU_FUNC_ATTRIBUTE_PTX_VERSION), \
                _version(function, _FA.CU_FUNC_ATTRIBUTE_BINARY_VERSION)
            assert versions[0] in ptx and versions[1] == 10 * major + minor, \
                f"PTX / binary versions {versions}, expected PTX one of {sorted(ptx)} JIT-compiled to {major}{minor}"


@pytest.mark.parametrize("arch", OVERRIDES)
def test_each_shipped_arch_in_a_fresh_process(arch):
    run_under_arch(f"{__file__}::test_kernels_are_jit_compiled_from_the_chosen_arch", arch)
