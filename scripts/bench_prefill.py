"""Prefill attention (ptxattn.sdpa, bf16) in TFLOP/s, counting 4·B·Hq·D per visible
(query, key) pair (Sq·Skv, halved for causal; a window counts its pairs exactly); PyTorch's
flash (FA2) and cuDNN SDPA backends are timed side by side in the same run when torch with
CUDA is installed. With --sm90-plain, a ptxattn_plain column times the plain wgmma kernels
that the warp-specialized ones (cu/flash_fwd_sm90_ws.cuh) replaced (PTXATTN_SM90_WS=0) on the
same inputs, and plain_bit_identical says whether their output equals the default kernels' bit
for bit (rows the warp-specialized kernels do not serve run the same kernel in both columns).
With --sm90-pingpong, a ptxattn_pp column does the same for the warp-specialized kernels'
ping-pong twins at every head dim (the _ws_pp kernels, PTXATTN_SM90_PINGPONG=1), with
pp_bit_identical; with --sm90-ws, a ptxattn_ws column for the warp-specialized kernels without
ping-pong at every head dim (PTXATTN_SM90_PINGPONG=0), with ws_bit_identical; with
--sm90-cp-async, a ptxattn_cp_async column for the warp-specialized producer's cp.async copies
in place of its TMA loads (PTXATTN_SM90_TMA=0), with cp_async_bit_identical; with
--sm90-no-persistent, a ptxattn_no_persistent column for a CTA a block where the default runs
the persistent twins (PTXATTN_SM90_PERSISTENT=0), with no_persistent_bit_identical.

Timings are device time (bench_common.time_ms); the host cost of one sdpa() call is its own
column. Each shape's output is compared with the float64 reference on batch 0, head 0 (its
last query rows), and with PyTorch flash's whole output (‖ours − theirs‖ / ‖theirs‖) when
flash runs the call, so a fast but wrong kernel cannot hide in the table.

Where torch's SDPA cannot express a call, its columns time the nearest call it can, and the
row's `torch_runs` says which: a window as an explicit bool mask, softcap left out.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import numpy as np

import ptxattn
from ptxattn import reference
from ptxattn.variants import sm90_ws_pp_tiles

from bench_common import (finished_row, host_ms, random_host, relative_error, rotation_count, rows_named, stream,
                          torch_cuda, torch_sdpa_backends, try_time, upload)

BF16 = ptxattn.bfloat16


@dataclass(frozen=True)
class Shape:
    b: int
    hq: int
    hkv: int
    s: int
    dqk: int
    dv: int
    causal: bool
    window: int | None = None   # keys left of the diagonal (with causal: a sliding window)
    mask: str | None = None     # MASKS' kind: "bf16" (additive [B, 1, S, S]), "bool", "bool key" ([B, 1, 1, S])
    softcap: float = 0.0

    @property
    def name(self) -> str:
        heads = f"H{self.hq}" if self.hq == self.hkv else f"Hq{self.hq} Hkv{self.hkv}"
        dims = f"D{self.dqk}" if self.dqk == self.dv else f"Dqk{self.dqk} Dv{self.dv}"
        extras = ["causal"] * self.causal + [f"window {self.window}"] * (self.window is not None)
        extras += [f"{self.mask} mask"] * (self.mask is not None) + [f"softcap {self.softcap:g}"] * (self.softcap > 0)
        return " ".join([f"B{self.b} {heads} S{self.s} {dims}", *extras])

    @property
    def visible_pairs(self) -> float:
        if self.window is not None:
            return float(np.minimum(np.arange(self.s), self.window).sum() + self.s)
        return self.s * self.s / (2 if self.causal else 1)

    @property
    def flops(self) -> float:
        """QK^T and PV over the visible (query, key) pairs: what a row's TFLOP/s count."""
        return 2 * self.b * self.hq * (self.dqk + self.dv) * self.visible_pairs

    @property
    def mask_shape(self) -> tuple[int, int, int, int]:
        """The mask's shape: one row for every query where it masks keys only."""
        return (self.b, 1, 1 if self.mask.endswith("key") else self.s, self.s)

    def make_mask(self, rng: np.random.Generator):
        """The row's mask on the device (None without one): bool masks keep 9 keys in 10."""
        if self.mask is None:
            return None
        if self.mask.startswith("bool"):
            return ptxattn.asarray(rng.random(self.mask_shape) < 0.9, stream())
        return upload(random_host(rng, self.mask_shape, BF16))

    @property
    def options(self) -> dict:
        return {"causal": self.causal, "window": None if self.window is None else (self.window, 0 if self.causal else -1),
                "softcap": self.softcap}


# Issue 3's speed-goal shapes, then issue 10's: other head dims, masks, softcap, short sequences.
SHAPES = [
    Shape(4, 32, 32, 4096, 128, 128, False),
    Shape(4, 32, 32, 4096, 128, 128, True),
    Shape(2, 32, 8, 8192, 128, 128, True),
    Shape(8, 16, 16, 2048, 64, 64, False),
    Shape(1, 32, 8, 16384, 128, 128, True),
    Shape(2, 16, 16, 8192, 256, 256, False),
    Shape(2, 16, 16, 8192, 256, 256, True),
    Shape(2, 16, 16, 8192, 192, 128, True),
    Shape(4, 32, 32, 8192, 64, 64, True, window=1024),
    Shape(2, 16, 16, 4096, 128, 128, False, mask="bf16"),
    Shape(2, 16, 16, 4096, 128, 128, False, mask="bool"),
    Shape(2, 16, 16, 4096, 128, 128, False, mask="bool key"),
    Shape(2, 16, 16, 4096, 128, 128, True, softcap=50.0),
    Shape(32, 16, 16, 512, 128, 128, True),
    Shape(16, 16, 16, 1024, 128, 128, True),
    Shape(32, 16, 16, 256, 128, 128, True),
]
QUICK = SHAPES[:5] + SHAPES[8:]  # --quick leaves out the D256 and D192 rows, the slowest to time
CHECKED_ROWS = 256  # query rows of batch 0, head 0 held against the float64 reference


def _error_vs_reference(shape: Shape, q, k, v, mask, out) -> float:
    """Relative error of the last CHECKED_ROWS query rows of batch 0, head 0 (bottom-right
    alignment gives them the keys they have in the whole, square problem)."""
    first = shape.s - min(CHECKED_ROWS, shape.s)
    q0 = q[0, 0, first:].get(stream())[None, None]
    k0, v0 = (t[0, 0].get(stream())[None, None] for t in (k, v))
    m0 = None if mask is None else mask[0, 0, first if mask.shape[2] > 1 else 0:].get(stream())[None, None]
    want, _ = reference.sdpa(q0, k0, v0, attn_mask=m0, causal_align="bottom_right", **shape.options)
    return relative_error(out[0, 0, first:].get(stream()), want[0, 0])


# The optional columns of other sm_90a kernels: (column, its flag in args, the setting of
# ptxattn.ops.attention it swaps, the value it takes). A column's kernels serve the rows the
# default ones do; rows they do not serve run the same kernel as the ptxattn column.
SM90_COLUMNS = (
    ("plain", "sm90_plain", "sm90_ws_enabled", False),                             # PTXATTN_SM90_WS=0
    ("pp", "sm90_pingpong", "sm90_pingpong_dims", frozenset(d for d, _ in sm90_ws_pp_tiles())),  # PTXATTN_SM90_PINGPONG=1
    ("ws", "sm90_ws", "sm90_pingpong_dims", frozenset()),                          # PTXATTN_SM90_PINGPONG=0
    ("cp_async", "sm90_cp_async", "sm90_tma_enabled", False),                      # PTXATTN_SM90_TMA=0
    ("no_persistent", "sm90_no_persistent", "sm90_persistent_setting", False),     # PTXATTN_SM90_PERSISTENT=0
)


@contextlib.contextmanager
def _sm90_setting(setting: str, value):
    """Plain sm_90a calls plan as if ptxattn.ops.attention's `setting` (a function of the
    environment, read once a process) said `value` while inside; the function is swapped and
    the cached bindings forgotten both ways."""
    from ptxattn.ops import attention, prepared
    saved = getattr(attention, setting)
    setattr(attention, setting, lambda: value)
    prepared.clear_bindings()
    try:
        yield
    finally:
        setattr(attention, setting, saved)
        prepared.clear_bindings()


def chosen_shapes(args) -> list[Shape]:
    """The rows to run: those whose name matches args.rows (among all of them), else QUICK's
    under --quick, else all."""
    if args.rows is None:
        return QUICK if args.quick else SHAPES
    return rows_named(args.rows, SHAPES, lambda shape: shape.name, "prefill")


def run(args) -> list[dict]:
    torch = torch_cuda()
    backends = torch_sdpa_backends() if torch is not None else {}
    rng = np.random.default_rng(0)
    repeat = 5 if args.quick else 30
    rows = []
    for shape in chosen_shapes(args):
        b, hq, hkv, s = shape.b, shape.hq, shape.hkv, shape.s
        bytes_per_set = 2 * (b * hq * s * shape.dqk + b * hkv * s * (shape.dqk + shape.dv))
        dims = (shape.dqk, shape.dqk, shape.dv)
        sets = [tuple(upload(random_host(rng, (b, h, s, d), BF16)) for h, d in zip((hq, hkv, hkv), dims))
                for _ in range(rotation_count(bytes_per_set))]
        mask = shape.make_mask(rng)
        out = ptxattn.empty((b, hq, s, shape.dv), BF16)
        flops = shape.flops

        def ours(i):
            q, k, v = sets[i]
            ptxattn.sdpa(q, k, v, attn_mask=mask, out=out, stream=stream(), **shape.options)

        row = {"shape": shape.name}
        timings = {"ptxattn": try_time(ours, repeat=repeat, rotate=len(sets))}
        row["ptxattn_host_us"] = 1e3 * host_ms(ours, rotate=len(sets))  # hidden from the timings
        ours(0)
        row["rel_err_vs_reference"] = _error_vs_reference(shape, *sets[0], mask, out)
        default_bits = None
        for column, flag, setting, value in SM90_COLUMNS:
            if not getattr(args, flag, False):
                continue
            if default_bits is None:
                default_bits = out.get(stream()).view(np.uint16)
            with _sm90_setting(setting, value):
                timings[f"ptxattn_{column}"] = try_time(ours, repeat=repeat, rotate=len(sets))
                ours(0)
                row[f"{column}_bit_identical"] = bool(np.array_equal(out.get(stream()).view(np.uint16), default_bits))
        if torch is not None:
            _torch_columns(torch, backends, shape, row, timings, sets, mask, out, repeat)
        tflops = {name: (flops / (ms * 1e-3) / 1e12 if ms else None) for name, ms in timings.items()}
        for name in timings:
            row[f"{name}_ms"] = timings[name]
            row[f"{name}_tflops"] = tflops[name]
        for name in backends:
            for ours_name in ("ptxattn", *(f"ptxattn_{column}" for column, *_ in SM90_COLUMNS)):
                if tflops.get(ours_name) and tflops[name]:
                    row[f"ratio{ours_name[7:]}_vs_{name}"] = tflops[ours_name] / tflops[name]
        row["chart"] = {"unit": "TFLOP/s", "series": tflops}
        finished_row(rows, row)
        del sets, out, mask
        if torch is not None:
            torch.cuda.empty_cache()
    return rows


def _torch_columns(torch, backends, shape: Shape, row, timings, sets, mask, out, repeat: int) -> None:
    """Time PyTorch's backends on the same inputs (into `timings`) and compare our output,
    already in `out`, with flash's (into `row`) where flash runs the call itself."""
    group = shape.hq // shape.hkv
    tensors = [tuple(torch.from_dlpack(t) for t in qkv) for qkv in sets]
    kwargs, runs = {"is_causal": shape.causal}, []
    if shape.window is not None:  # torch has no window: the same keys as a bool mask
        i = torch.arange(shape.s, device="cuda")
        keep = (i[None, :] >= i[:, None] - shape.window) & ((i[None, :] <= i[:, None]) if shape.causal else True)
        kwargs = {"attn_mask": keep}
        runs.append("window as a bool mask")
    elif mask is not None:
        kwargs["attn_mask"] = torch.from_dlpack(mask)
    if shape.softcap > 0:
        runs.append("no softcap")
    if runs:
        row["torch_runs"] = ", ".join(runs)
    for name, fn in backends.items():
        def theirs(i, fn=fn):
            q, k, v = tensors[i]
            fn(q, k, v, enable_gqa=group > 1, **kwargs)
        timings[name] = try_time(theirs, repeat=repeat, rotate=len(tensors))
        if timings[name] is None and group > 1:
            # A backend without native GQA: time it on K/V expanded to Hq heads.
            expanded = [(q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)) for q, k, v in tensors]
            def theirs(i, fn=fn):
                fn(*expanded[i], **kwargs)
            timings[name] = try_time(theirs, repeat=repeat, rotate=len(tensors))
            row[f"{name}_kv"] = "expanded"
            del expanded
    if runs or "attn_mask" in kwargs or timings.get("torch_flash") is None:
        return  # flash does not run this call as it is
    q0, k0, v0 = tensors[0]
    flash = backends["torch_flash"](q0, k0.repeat_interleave(group, 1), v0.repeat_interleave(group, 1),
                                    is_causal=shape.causal).float()
    ours = torch.from_dlpack(out).float()
    row["rel_err_vs_flash"] = float((ours - flash).norm() / flash.norm())
