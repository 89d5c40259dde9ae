"""Prefill attention (ptxattn.sdpa, bf16) in TFLOP/s, counting 4·B·Hq·Sq·Skv·D, halved for
causal; PyTorch's flash (FA2) and cuDNN SDPA backends are timed side by side in the same run
when torch with CUDA is installed.

Timings are device time (bench_common.time_ms); the host cost of one sdpa() call is its own
column. Each shape's output is compared with the float64 reference on batch 0, head 0 (its
last query rows), and with PyTorch flash's whole output (‖ours − theirs‖ / ‖theirs‖) when
torch is there, so a fast but wrong kernel cannot hide in the table.
"""
from __future__ import annotations

import numpy as np

import ptxattn
from ptxattn import reference

from bench_common import (host_ms, random_host, relative_error, rotation_count, stream, torch_cuda,
                          torch_sdpa_backends, try_time, upload)

BF16 = ptxattn.bfloat16
# (B, Hq, Hkv, S, D, causal): the shapes issue 3 sets its speed goal on.
SHAPES = [
    (4, 32, 32, 4096, 128, False),
    (4, 32, 32, 4096, 128, True),
    (2, 32, 8, 8192, 128, True),
    (8, 16, 16, 2048, 64, False),
    (1, 32, 8, 16384, 128, True),
]
CHECKED_ROWS = 256  # query rows of batch 0, head 0 held against the float64 reference


def _shape_name(b, hq, hkv, s, d, causal) -> str:
    heads = f"H{hq}" if hq == hkv else f"Hq{hq} Hkv{hkv}"
    return f"B{b} {heads} S{s} D{d}{' causal' if causal else ''}"


def _error_vs_reference(q, k, v, out, causal: bool) -> float:
    """Relative error of the last CHECKED_ROWS query rows of batch 0, head 0 (bottom-right
    alignment gives them the keys they have in the whole, square problem)."""
    s = q.shape[2]
    first = s - min(CHECKED_ROWS, s)
    q0 = q[0, 0, first:].get(stream())[None, None]
    k0, v0 = (t[0, 0].get(stream())[None, None] for t in (k, v))
    want, _ = reference.sdpa(q0, k0, v0, causal=causal, causal_align="bottom_right")
    return relative_error(out[0, 0, first:].get(stream()), want[0, 0])


def run(args) -> list[dict]:
    torch = torch_cuda()
    backends = torch_sdpa_backends() if torch is not None else {}
    rng = np.random.default_rng(0)
    repeat = 5 if args.quick else 30
    rows = []
    for b, hq, hkv, s, d, causal in SHAPES:
        bytes_per_set = 2 * (b * hq * s * d * 2 + b * hkv * s * d * 2)
        sets = [tuple(upload(random_host(rng, (b, h, s, d), BF16)) for h in (hq, hkv, hkv))
                for _ in range(rotation_count(bytes_per_set))]
        out = ptxattn.empty((b, hq, s, d), BF16)
        flops = 4 * b * hq * s * s * d / (2 if causal else 1)

        def ours(i):
            q, k, v = sets[i]
            ptxattn.sdpa(q, k, v, causal=causal, out=out, stream=stream())

        row = {"shape": _shape_name(b, hq, hkv, s, d, causal)}
        timings = {"ptxattn": try_time(ours, repeat=repeat, rotate=len(sets))}
        row["ptxattn_host_us"] = 1e3 * host_ms(ours, rotate=len(sets))  # hidden from the timings
        ours(0)
        row["rel_err_vs_reference"] = _error_vs_reference(*sets[0], out, causal)
        if torch is not None:
            _torch_columns(torch, backends, row, timings, sets, out, hq // hkv, causal, repeat)
        tflops = {name: (flops / (ms * 1e-3) / 1e12 if ms else None) for name, ms in timings.items()}
        for name in timings:
            row[f"{name}_ms"] = timings[name]
            row[f"{name}_tflops"] = tflops[name]
        for name in backends:
            if tflops["ptxattn"] and tflops[name]:
                row[f"ratio_vs_{name}"] = tflops["ptxattn"] / tflops[name]
        row["chart"] = {"unit": "TFLOP/s", "series": tflops}
        rows.append(row)
        del sets, out
        if torch is not None:
            torch.cuda.empty_cache()
    return rows


def _torch_columns(torch, backends, row, timings, sets, out, group: int, causal: bool, repeat: int) -> None:
    """Time PyTorch's backends on the same inputs (into `timings`) and compare our output,
    already in `out`, with flash's (into `row`)."""
    tensors = [tuple(torch.from_dlpack(t) for t in qkv) for qkv in sets]
    for name, fn in backends.items():
        def theirs(i, fn=fn):
            q, k, v = tensors[i]
            fn(q, k, v, is_causal=causal, enable_gqa=group > 1)
        timings[name] = try_time(theirs, repeat=repeat, rotate=len(tensors))
        if timings[name] is None and group > 1:
            # A backend without native GQA: time it on K/V expanded to Hq heads.
            expanded = [(q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)) for q, k, v in tensors]
            def theirs(i, fn=fn):
                fn(*expanded[i], is_causal=causal)
            timings[name] = try_time(theirs, repeat=repeat, rotate=len(tensors))
            row[f"{name}_kv"] = "expanded"
            del expanded
    q0, k0, v0 = tensors[0]
    flash = backends["torch_flash"](q0, k0.repeat_interleave(group, 1), v0.repeat_interleave(group, 1),
                                    is_causal=causal).float()
    ours = torch.from_dlpack(out).float()
    row["rel_err_vs_flash"] = float((ours - flash).norm() / flash.norm())
