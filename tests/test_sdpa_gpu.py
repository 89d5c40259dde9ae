"""ptxattn.sdpa on the GPU against the float64 reference: a seeded sweep over dtypes, head
dims (odd ones too), GQA ratios, lengths (0, 1, tile non-multiples), mask kinds / ranks /
broadcasts, causal alignments, windows, softcap, sinks and LSE; NaN-poisoned outputs framed
by canaries; determinism; strided (BSHD) and misaligned inputs; a K/V past 2^31 elements."""
from __future__ import annotations

import random
from dataclasses import dataclass

import numpy as np
import pytest

import ptxattn
from ptxattn import DeviceArray, reference
from ptxattn.ops import attention
from ptxattn.variants import sm90_ws_pp_tiles, sm90_ws_tiles

from gpu_util import GuardedOutput, relative_error

pytestmark = pytest.mark.gpu

F16, BF16, F32 = np.dtype(np.float16), ptxattn.bfloat16, np.dtype(np.float32)
# |o - ref| <= ABS * max|v| + REL * |ref|: P is rounded to the input dtype before P·V
# (half an ulp of each weight, times |v|) and o to the output dtype.
ABS = {F16: 2e-3, BF16: 1.2e-2, F32: 2e-5}
REL = {F16: 2e-3, BF16: 1e-2, F32: 2e-5}
NORM = {F16: 2e-3, BF16: 1.2e-2, F32: 1e-5}  # ‖o - ref‖ / ‖ref‖
LSE_ABS = 2e-4  # LSE is fp32 math over the exact (quantized) inputs for every dtype


@dataclass(frozen=True)
class Case:
    dtype: np.dtype
    batch: int
    hq: int
    hkv: int
    sq: int
    skv: int
    dqk: int
    dv: int
    causal: bool = False
    align: str = "top_left"
    window: tuple | None = None
    mask: str | None = None        # broadcast pattern, see _mask_shape
    mask_dtype: np.dtype | None = None
    softcap: float = 0.0
    sinks: bool = False
    scale: float | None = None
    lse: bool = True

    def __str__(self) -> str:
        name = {F16: "f16", BF16: "bf16", F32: "f32"}[self.dtype]
        parts = [name, f"b{self.batch}h{self.hq}/{self.hkv}", f"s{self.sq}x{self.skv}", f"d{self.dqk}_{self.dv}"]
        if self.causal:
            parts.append(f"causal_{self.align}")
        elif self.align != "top_left":
            parts.append(self.align)
        if self.window:
            parts.append(f"win{self.window[0]}_{self.window[1]}")
        if self.mask:
            parts.append(f"mask_{self.mask}_{np.dtype(self.mask_dtype).name}")
        if self.softcap:
            parts.append(f"cap{self.softcap:g}")
        if self.sinks:
            parts.append("sinks")
        if self.scale is not None:
            parts.append(f"scale{self.scale:g}")
        return "-".join(parts)


def _mask_shape(case: Case) -> tuple:
    b, h, q, k = case.batch, case.hq, case.sq, case.skv
    return {"b11k": (b, 1, 1, k), "bhqk": (b, h, q, k), "qk": (q, k), "k": (k,),
            "1h1k": (1, h, 1, k), "bhq1": (b, h, q, 1)}[case.mask]


EXPLICIT = [
    Case(BF16, 1, 1, 1, 1, 1, 64, 64),
    Case(BF16, 2, 4, 4, 128, 128, 128, 128),
    Case(BF16, 1, 4, 1, 97, 1025, 128, 128, causal=True, align="bottom_right"),
    Case(F16, 2, 8, 2, 257, 200, 64, 64, causal=True),
    Case(BF16, 1, 2, 2, 300, 130, 256, 256, causal=True, align="bottom_right"),  # rows with no key
    Case(F16, 1, 4, 2, 65, 77, 192, 128, causal=True, sinks=True),
    Case(BF16, 1, 2, 1, 33, 45, 59, 59, window=(7, 3)),
    Case(F16, 1, 2, 2, 40, 51, 111, 111, softcap=5.0),
    Case(F32, 2, 4, 2, 37, 70, 64, 64, causal=True, align="bottom_right", sinks=True),
    Case(F32, 1, 2, 1, 20, 33, 59, 111, mask="bhqk", mask_dtype=np.dtype(bool)),
    Case(BF16, 2, 4, 2, 64, 100, 128, 128, mask="b11k", mask_dtype=np.dtype(bool), sinks=True),
    Case(BF16, 1, 2, 2, 50, 60, 64, 64, mask="bhq1", mask_dtype=np.dtype(bool), sinks=True, softcap=3.0),
    Case(F16, 1, 3, 3, 31, 64, 96, 64, mask="qk", mask_dtype=F16),
    Case(BF16, 1, 2, 1, 16, 48, 128, 128, scale=0.0, lse=True),
    Case(F16, 1, 1, 1, 0, 5, 64, 64),
    Case(BF16, 1, 2, 1, 5, 0, 64, 64, sinks=True),
    Case(F32, 1, 1, 1, 3, 0, 8, 8),
    Case(BF16, 1, 2, 2, 1, 1000, 1, 1),
    Case(F16, 1, 2, 1, 130, 129, 200, 130, causal=True, window=(20, -1), mask="k", mask_dtype=F32),
    # Plain-score kernels over many key tiles, query blocks not a multiple of their 128 rows.
    Case(BF16, 2, 2, 2, 260, 520, 64, 64),
    Case(F16, 1, 4, 2, 300, 700, 128, 128, window=(-1, 100), lse=True),
    Case(BF16, 1, 2, 1, 200, 333, 192, 128, causal=True, align="bottom_right"),
    Case(BF16, 1, 2, 1, 40, 70, 64, 64, scale=-0.5),  # scale < 0 takes the general kernel
    # Dqk = Dv = 64 or 128 with plain scores: the wgmma kernels on sm_90 devices (128-row
    # query blocks, 128-key tiles), else the mma.sync ones.
    Case(BF16, 1, 8, 2, 300, 1000, 128, 128, causal=True, align="bottom_right", sinks=True),
    Case(F16, 2, 4, 4, 257, 129, 128, 128, causal=True),
    Case(BF16, 1, 2, 1, 200, 700, 128, 128, window=(50, 20)),
    Case(BF16, 1, 2, 2, 130, 90, 128, 128, causal=True, align="bottom_right"),  # rows with no key
    Case(F16, 1, 4, 1, 1, 2049, 128, 128, scale=0.05),
    Case(BF16, 2, 2, 1, 128, 128, 128, 128, window=(-1, 0), sinks=True),
    Case(F16, 1, 4, 2, 333, 901, 64, 64, causal=True, align="bottom_right", window=(200, 0), sinks=True),
    # Masks, softcap, scale <= 0 at Dqk = Dv = 64 or 128: the general wgmma kernels on sm_90
    # devices (128-row query blocks, 128-key tiles).
    Case(BF16, 2, 4, 2, 300, 700, 128, 128, causal=True, align="bottom_right", mask="bhqk", mask_dtype=BF16,
         softcap=30.0),
    Case(F16, 1, 2, 2, 257, 520, 64, 64, window=(100, 20), mask="b11k", mask_dtype=np.dtype(bool), sinks=True),
    Case(BF16, 1, 4, 1, 129, 1025, 128, 128, mask="1h1k", mask_dtype=F16, scale=0.0),
    Case(F16, 1, 2, 1, 200, 130, 128, 128, causal=True, align="bottom_right", mask="qk", mask_dtype=F32,
         softcap=5.0),  # rows with no key
]


def _sweep(count: int = 40, seed: int = 20261129) -> list[Case]:
    r = random.Random(seed)
    cases = []
    for _ in range(count):
        dtype = r.choice([F16, BF16, BF16, F32])
        dqk, dv = r.choice([(64, 64), (128, 128), (256, 256), (192, 128), (59, 59), (111, 111),
                            (1, 1), (8, 16), (96, 64), (200, 130), (32, 32), (80, 80)])
        hkv = r.choice([1, 2])
        mask = r.choice([None, None, "b11k", "bhqk", "qk", "k", "1h1k", "bhq1"])
        cases.append(Case(
            dtype=dtype, batch=r.choice([1, 2]), hq=hkv * r.choice([1, 2, 4]), hkv=hkv,
            sq=r.choice([1, 2, 17, 64, 97, 128, 129, 200, 257]),
            skv=r.choice([1, 5, 63, 64, 65, 130, 256, 300, 1025]),
            dqk=dqk, dv=dv, causal=r.random() < 0.4, align=r.choice(["top_left", "bottom_right"]),
            window=r.choice([None, None, (16, 0), (5, 40), (-1, 3), (100, -1)]),
            mask=mask, mask_dtype=r.choice([np.dtype(bool), F32, F16, BF16]) if mask else None,
            softcap=r.choice([0.0, 0.0, 0.0, 5.0, 30.0]), sinks=r.random() < 0.3,
            scale=r.choice([None, None, None, 0.0, 0.3]), lse=r.random() < 0.7,
        ))
    return cases


def _rand(rng, shape, dtype) -> np.ndarray:
    return rng.standard_normal(shape).astype(np.float32).astype(dtype)


def _inputs(case: Case, rng):
    q = _rand(rng, (case.batch, case.hq, case.sq, case.dqk), case.dtype)
    k = _rand(rng, (case.batch, case.hkv, case.skv, case.dqk), case.dtype)
    v = _rand(rng, (case.batch, case.hkv, case.skv, case.dv), case.dtype)
    mask = None
    if case.mask:
        shape = _mask_shape(case)
        mask = rng.random(shape) < 0.75 if case.mask_dtype == bool else _rand(rng, shape, case.mask_dtype)
    sinks = rng.standard_normal(case.hq).astype(np.float32) if case.sinks else None
    return q, k, v, mask, sinks


def _options(case: Case) -> dict:
    return dict(causal=case.causal, causal_align=case.align, window=case.window,
                scale=case.scale, softcap=case.softcap)


def _check(case: Case, got_o, got_lse, q, k, v, mask, sinks) -> None:
    ref_o, ref_lse = reference.sdpa(q, k, v, attn_mask=mask, sinks=sinks, **_options(case))
    got_o = np.asarray(got_o).astype(np.float64)
    assert got_o.shape == ref_o.shape
    # Relative to the norm, unless the output cancels (an average of many values of both signs,
    # e.g. d 1 over 1000 keys): then to a tenth of the average of their magnitudes, which
    # carries the rounding of 16-bit P (the element-wise bound below still holds it).
    ref_magnitude = reference.sdpa(q, k, np.abs(v.astype(np.float64)), attn_mask=mask, sinks=sinks, **_options(case))[0]
    size = max(np.linalg.norm(ref_o), 0.1 * np.linalg.norm(ref_magnitude)) or 1.0
    assert np.linalg.norm(got_o - ref_o) <= NORM[case.dtype] * size, f"relative error {relative_error(got_o, ref_o):.3g}"
    vmax = float(np.abs(v.astype(np.float64)).max()) if v.size else 0.0
    bound = ABS[case.dtype] * vmax + REL[case.dtype] * np.abs(ref_o)
    worst = np.abs(got_o - ref_o) - bound
    assert worst.max(initial=-1.0) <= 0, f"max excess {worst.max():.3g} at {np.unravel_index(worst.argmax(), worst.shape)}"
    empty_rows = ref_lse == -np.inf
    assert np.all(got_o[empty_rows] == 0), "a row with no visible key must give exactly 0"
    if got_lse is not None:
        got_lse = np.asarray(got_lse)
        assert got_lse.dtype == np.float32 and got_lse.shape == ref_lse.shape
        assert np.array_equal(got_lse == -np.inf, empty_rows), "LSE -inf exactly on rows with no key"
        live = ~empty_rows
        np.testing.assert_allclose(got_lse[live], ref_lse[live], rtol=1e-5, atol=LSE_ABS)


def _run_device(case: Case, rng, inputs=None):
    q, k, v, mask, sinks = inputs if inputs is not None else _inputs(case, rng)
    dev = {name: ptxattn.asarray(x) for name, x in (("q", q), ("k", k), ("v", v)) }
    out = GuardedOutput((case.batch, case.hq, case.sq, case.dv), case.dtype, rng)
    result = ptxattn.sdpa(
        dev["q"], dev["k"], dev["v"], out=out.array, return_lse=case.lse,
        attn_mask=None if mask is None else ptxattn.asarray(mask),
        sinks=None if sinks is None else ptxattn.asarray(sinks), **_options(case))
    o_dev, lse_dev = result if case.lse else (result, None)
    assert o_dev is out.array
    return out.check(), (lse_dev.get() if case.lse else None), (q, k, v, mask, sinks)


CASES = EXPLICIT + _sweep()


@pytest.mark.parametrize("case", CASES, ids=[str(c) for c in CASES])
def test_sdpa_matches_reference(case, rng):
    o, lse, inputs = _run_device(case, rng)
    _check(case, o, lse, *inputs)


@pytest.mark.parametrize("dtype", [BF16, F16])
@pytest.mark.parametrize("d,causal", [(256, True), (256, False), (128, True), (64, False)])
def test_scores_that_climb_across_key_tiles(dtype, d, causal, rng):
    """Every row's running max moves again and again, by less and by more than 8 log2 units a
    step (the lag D256's lazy rescale allows before it moves the max): the keys' scores climb
    by 3.5 and 7.6 (5 and 11 log2 units) in turn every 40 keys, up to ~140; scale 1."""
    case = Case(dtype, 1, 4, 2, 300, 1025, d, d, causal=causal, align="bottom_right", scale=1.0)
    q, k, v, mask, sinks = _inputs(case, rng)
    steps = np.arange(case.skv) // 40
    climb = (steps // 2) * (3.5 + 7.6) + (steps % 2) * 3.5
    q = 0.1 * q.astype(np.float32)
    q[..., 0] = 1.0
    k = 0.1 * k.astype(np.float32)
    k[..., 0] = climb
    q, k = q.astype(dtype), k.astype(dtype)
    o, lse, inputs = _run_device(case, rng, (q, k, v, mask, sinks))
    _check(case, o, lse, *inputs)


def test_numpy_in_numpy_out(rng):
    case = Case(BF16, 2, 4, 2, 70, 90, 128, 128, causal=True, sinks=True)
    q, k, v, mask, sinks = _inputs(case, rng)
    o, lse = ptxattn.sdpa(q, k, v, sinks=sinks, return_lse=True, causal=True)
    assert isinstance(o, np.ndarray) and o.dtype == BF16 and isinstance(lse, np.ndarray)
    _check(case, o, lse, q, k, v, mask, sinks)
    out = np.full(o.shape, np.nan, dtype=BF16)
    assert ptxattn.sdpa(q, k, v, sinks=sinks, causal=True, out=out) is out
    assert np.array_equal(out.view(np.uint16), o.view(np.uint16))


@pytest.mark.parametrize("dtype,masked", [(BF16, True), (F32, True), (BF16, False)])
def test_bitwise_deterministic(dtype, masked, rng):
    case = Case(dtype, 2, 8, 2, 300, 700, 128, 128, causal=True, align="bottom_right",
                mask="b11k" if masked else None, mask_dtype=F32 if masked else None, sinks=True)
    q, k, v, mask, sinks = _inputs(case, rng)
    args = [ptxattn.asarray(x) for x in (q, k, v)]
    runs = []
    for _ in range(3):
        o, lse = ptxattn.sdpa(*args, attn_mask=None if mask is None else ptxattn.asarray(mask),
                              sinks=ptxattn.asarray(sinks), return_lse=True, causal=True,
                              causal_align="bottom_right")
        runs.append((o.get().tobytes(), lse.get().tobytes()))
    assert runs[0] == runs[1] == runs[2]


def _bshd_view(host_bshd: np.ndarray, element_offset: int = 0) -> DeviceArray:
    """A [B, H, S, D] view of a [B, S, H, D] buffer, optionally starting `element_offset`
    elements into it (which breaks 16-byte alignment)."""
    flat = np.concatenate([np.zeros(element_offset, host_bshd.dtype), host_bshd.ravel()])
    whole = ptxattn.asarray(flat)
    b, s, h, d = host_bshd.shape
    item = host_bshd.itemsize
    return DeviceArray(whole.ptr + element_offset * whole.itemsize, (b, h, s, d), host_bshd.dtype,
                       (s * h * d * item, d * item, h * d * item, item), whole.device, whole)


@pytest.mark.parametrize("dtype,offset", [(BF16, 0), (F16, 1), (F32, 0)])
def test_strided_bshd_inputs_and_output(dtype, offset, rng):
    b, hq, hkv, sq, skv, d = 2, 8, 2, 130, 200, 128
    q = _rand(rng, (b, sq, hq, d), dtype)
    k = _rand(rng, (b, skv, hkv, d), dtype)
    v = _rand(rng, (b, skv, hkv, d), dtype)
    out_host = np.full((b, sq, hq, d), np.nan, dtype=np.float32).astype(dtype)
    out = _bshd_view(out_host, offset)
    ptxattn.sdpa(_bshd_view(q, offset), _bshd_view(k, offset), _bshd_view(v), causal=True, out=out)
    got = out.get()
    case = Case(dtype, b, hq, hkv, sq, skv, d, d, causal=True, lse=False)
    _check(case, got, None, *(x.transpose(0, 2, 1, 3) for x in (q, k, v)), None, None)


def _sm90_device():
    """Device 0 where it loads the wgmma kernels' sm_90a PTX, else the test is skipped."""
    from ptxattn.module import loaded_arch

    device = ptxattn.get_device(0)
    if loaded_arch(device, "flash_fwd_sm90") is None:
        pytest.skip(f"the wgmma kernels are sm_90a PTX, loaded only as sm_90; this run loads "
                    f"{ptxattn.ptx_arch(device)} PTX (the device's, or PTXATTN_ARCH's)")
    return device


def _record_launches(monkeypatch) -> list[int]:
    """The function handles the driver is asked to launch from now on (cuLaunchKernel)."""
    from ptxattn.driver import cu

    launched = []
    launch = cu.cuLaunchKernel

    def recording_launch(function, *args):
        launched.append(int(function))
        return launch(function, *args)

    monkeypatch.setattr(cu, "cuLaunchKernel", recording_launch)
    return launched


def _assert_launched_once(launched: list[int], kernel: str, device) -> None:
    from ptxattn.module import get_kernel

    with ptxattn.on_device(device):
        wanted = int(get_kernel(kernel, device).function)
    assert launched.count(wanted) == 1, f"sdpa launched {launched}, not {kernel} ({wanted})"


@pytest.mark.parametrize("dtype, options", [
    (BF16, {}),                   # the ws kernels on sm_90a (TMA, early issue), mma.sync elsewhere
    (BF16, {"softcap": 30.0}),    # the general kernels
    (F16, {"window": (40, 0)}),
    (F32, {}),                    # the SIMT kernel
])
def test_heavy_first_runs_cover_every_block(dtype, options, rng, monkeypatch):
    """A causal dense grid is laid out in runs of (batch, head) pairs (heavy_first_grid): with
    every run length that divides B x Hq, each block finds its own rows (NaN-poisoned output,
    the float64 reference) and the bits do not change."""
    from ptxattn.driver import cu
    from ptxattn.ops import prepared

    case = Case(dtype, 2, 6, 2, 300, 300, 128, 128, causal=True, **options)
    inputs = _inputs(case, rng)
    grids = []
    launch = cu.cuLaunchKernel
    monkeypatch.setattr(cu, "cuLaunchKernel", lambda f, gx, gy, gz, *rest: grids.append((gx, gy, gz)) or
                        launch(f, gx, gy, gz, *rest))
    results = []
    for run in (1, 2, 3, 4, 6, 12):
        monkeypatch.setattr(attention, "heavy_run_pairs", lambda *args, run=run: run)
        prepared.clear_bindings()
        grids.clear()
        o, lse, _ = _run_device(case, rng, inputs)
        assert [g for g in grids if g[0] == run and g[2] == 12 // run], f"no launch on runs of {run}: {grids}"
        _check(case, o, lse, *inputs)
        results.append((o, lse))
    for o, lse in results[1:]:
        assert np.array_equal(o, results[0][0], equal_nan=True) and np.array_equal(lse, results[0][1])
    prepared.clear_bindings()


@pytest.mark.parametrize("dtype, d, options, kernel", [
    # The warp-specialized kernels (the wgmma ones they replaced, named here, run under
    # PTXATTN_SM90_WS=0).
    (BF16, 128, {}, "flash_fwd_sm90_bf16_d128"),
    (F16, 64, {}, "flash_fwd_sm90_f16_d64"),
    # Masks, softcap and scale <= 0: the general kernels.
    (BF16, 128, {"mask": "bhqk", "mask_dtype": BF16, "causal": True}, "flash_fwd_sm90_bf16_d128_general"),
    (F16, 64, {"softcap": 5.0, "window": (40, 7)}, "flash_fwd_sm90_f16_d64_general"),
    (BF16, 64, {"mask": "qk", "mask_dtype": np.dtype(bool), "sinks": True}, "flash_fwd_sm90_bf16_d64_general"),
    (F16, 128, {"scale": -0.05, "mask": "bhq1", "mask_dtype": F32}, "flash_fwd_sm90_f16_d128_general"),
    # Other head dims: the smallest wgmma tile that holds them, zero-padded.
    (BF16, (256, 256), {"causal": True}, "flash_fwd_sm90_bf16_d256"),
    (F16, (192, 128), {"causal": True, "align": "bottom_right", "sinks": True}, "flash_fwd_sm90_f16_d192_128"),
    (BF16, (96, 96), {"window": (100, 3)}, "flash_fwd_sm90_bf16_d128"),
    (F16, (80, 48), {}, "flash_fwd_sm90_f16_d128"),
    (BF16, (256, 256), {"softcap": 30.0, "causal": True}, "flash_fwd_sm90_bf16_d256_general"),
    (F16, (160, 128), {"mask": "bhqk", "mask_dtype": np.dtype(bool)}, "flash_fwd_sm90_f16_d192_128_general"),
    (BF16, (40, 40), {"mask": "k", "mask_dtype": BF16, "sinks": True}, "flash_fwd_sm90_bf16_d64_general"),
])
def test_sm90_devices_take_the_wgmma_kernel(rng, monkeypatch, dtype, d, options, kernel):
    device = _sm90_device()
    launched = _record_launches(monkeypatch)
    dqk, dv = d if isinstance(d, tuple) else (d, d)
    ws_tile = next((tile for (_, general), tile in sm90_ws_tiles().items() if general == ("_general" in kernel)
                    and tile.holds(dqk, dv)), None)
    if attention.sm90_ws_enabled() and ws_tile is not None:
        # General 192 / 128 and 256 tiles have no ping-pong twin: they keep the ws kernel.
        pp = ws_tile.dim in attention.sm90_pingpong_dims()
        tile = sm90_ws_pp_tiles().get((ws_tile.dim, ws_tile.general), ws_tile) if pp else ws_tile
        kernel = tile.kernel(kernel.split("_")[3])
    case = Case(dtype, 1, 2, 2, 300, 333, dqk, dv, **options)
    o, lse, inputs = _run_device(case, rng)
    _assert_launched_once(launched, kernel, device)
    _check(case, o, lse, *inputs)


def _unaligned_view(host: np.ndarray, layout: str, rng) -> DeviceArray:
    """`host` on the device where 16-byte copies cannot serve it: "offset" starts it one
    element past an aligned base; "slice" keeps aligned rows but makes it the first columns of
    rows 8 to 15 elements wider, whose extra columns hold random numbers (a copy that reads
    past the head dim picks them up)."""
    item = host.itemsize
    if layout == "offset":
        flat = np.concatenate([_rand(rng, (1,), host.dtype), host.ravel()])
        whole = ptxattn.asarray(flat)
        strides = tuple(s * item for s in attention.contiguous(host.shape))
        return DeviceArray(whole.ptr + item, host.shape, host.dtype, strides, whole.device, whole)
    wide = _rand(rng, host.shape[:-1] + (host.shape[-1] // 8 * 8 + 16,), host.dtype)
    wide[..., :host.shape[-1]] = host
    whole = ptxattn.asarray(wide)
    return DeviceArray(whole.ptr, host.shape, host.dtype, whole.strides, whole.device, whole)


@pytest.mark.parametrize("dtype, dqk, dv, layout, options, kernel", [
    # q, k and v one element past 16-byte alignment: copied element by element.
    (F16, 128, 128, "offset", {"causal": True}, "flash_fwd_sm90_f16_d128"),
    (BF16, 64, 64, "offset", {"mask": "bhqk", "mask_dtype": BF16, "window": (30, 5)},
     "flash_fwd_sm90_bf16_d64_general"),
    (BF16, 192, 128, "offset", {"causal": True, "sinks": True}, "flash_fwd_sm90_bf16_d192_128"),
    # Aligned rows, head dims not multiples of 8: zero-padded element by element.
    (BF16, 100, 100, "slice", {"causal": True, "align": "bottom_right"}, "flash_fwd_sm90_bf16_d128"),
    (F16, 60, 36, "slice", {"softcap": 5.0}, "flash_fwd_sm90_f16_d64_general"),
    (BF16, 250, 130, "slice", {"window": (-1, 40)}, "flash_fwd_sm90_bf16_d256"),
])
def test_unaligned_calls_run_the_plain_wgmma_kernels(rng, monkeypatch, dtype, dqk, dv, layout, options, kernel):
    device = _sm90_device()
    case = Case(dtype, 2, 4, 2, 150, 333, dqk, dv, **options)
    q, k, v, mask, sinks = _inputs(case, rng)
    out = GuardedOutput((case.batch, case.hq, case.sq, case.dv), case.dtype, rng)
    launched = _record_launches(monkeypatch)
    _, lse = ptxattn.sdpa(*(_unaligned_view(x, layout, rng) for x in (q, k, v)), out=out.array, return_lse=True,
                          attn_mask=None if mask is None else ptxattn.asarray(mask),
                          sinks=None if sinks is None else ptxattn.asarray(sinks), **_options(case))
    _assert_launched_once(launched, kernel, device)
    _check(case, out.check(), lse.get(), q, k, v, mask, sinks)


def test_broadcast_mask_is_read_through_zero_strides(rng):
    case = Case(F16, 2, 4, 2, 40, 70, 64, 64, mask="bhqk", mask_dtype=F32)
    q, k, v, _, _ = _inputs(case, rng)
    per_batch = _rand(rng, (2, 1, 40, 70), np.float32)
    base = ptxattn.asarray(per_batch)
    item = 4
    mask = DeviceArray(base.ptr, (2, 4, 40, 70), np.float32, (40 * 70 * item, 0, 70 * item, item),
                       base.device, base)  # Hq axis broadcast with stride 0, never materialized
    o = ptxattn.sdpa(*(ptxattn.asarray(x) for x in (q, k, v)), attn_mask=mask).get()
    _check(case, o, None, q, k, v, per_batch, None)


@pytest.mark.slow
@pytest.mark.parametrize("d", [256, 128])  # 128: the wgmma kernel on sm_90
def test_kv_past_two_to_the_31_elements(d):
    """K and V of 2^31 + 64 * d elements each (B1 H1 Skv 2^31 / d + 64, bf16): a bottom-right
    window makes the queries read only the last keys, all past element 2^31."""
    rng = np.random.default_rng(7)
    skv, sq, period = (1 << 31) // d + 64, 64, 65537  # period does not divide 2^31 / d
    block_k = _rand(rng, (period, d), BF16)
    block_v = _rand(rng, (period, d), BF16)
    reps = -(-skv // period)
    k = np.tile(block_k, (reps, 1))[:skv].reshape(1, 1, skv, d)
    v = np.tile(block_v, (reps, 1))[:skv].reshape(1, 1, skv, d)
    assert k.size > 2**31
    q = _rand(rng, (1, 1, sq, d), BF16)
    window = (300, 0)
    o, lse = ptxattn.sdpa(ptxattn.asarray(q), ptxattn.asarray(k), ptxattn.asarray(v), causal=True,
                          causal_align="bottom_right", window=window, return_lse=True)
    tail = sq + window[0] + 64
    case = Case(BF16, 1, 1, 1, sq, tail, d, d, causal=True, align="bottom_right", window=window)
    _check(case, o.get(), lse.get(), q, k[:, :, -tail:], v[:, :, -tail:], None, None)
