"""Prefill attention (ptxattn.sdpa, bf16) next to PyTorch's flash (FA2) and cuDNN SDPA
backends, timed side by side in one run. TFLOP/s counts 4·B·Hq·Sq·Skv·D, halved for causal.

Timings are device time (bench_common.time_ms); the host cost of one sdpa() call is its own
column. Each shape's output is also compared with PyTorch flash's (‖ours − theirs‖ / ‖theirs‖), so a
fast but wrong kernel cannot hide in the table.
"""
from __future__ import annotations

from bench_common import host_ms, rotation_count, suite_torch, torch_sdpa_backends, try_time

# (B, Hq, Hkv, S, D, causal): the shapes issue 3 sets its speed goal on.
SHAPES = [
    (4, 32, 32, 4096, 128, False),
    (4, 32, 32, 4096, 128, True),
    (2, 32, 8, 8192, 128, True),
    (8, 16, 16, 2048, 64, False),
    (1, 32, 8, 16384, 128, True),
]


def _shape_name(b, hq, hkv, s, d, causal) -> str:
    heads = f"H{hq}" if hq == hkv else f"Hq{hq} Hkv{hkv}"
    return f"B{b} {heads} S{s} D{d}{' causal' if causal else ''}"


def run(args) -> list[dict]:
    torch = suite_torch("prefill suite")
    if torch is None:
        return []
    import ptxattn

    repeat = 5 if args.quick else 30
    backends = torch_sdpa_backends()
    stream = ptxattn.as_stream(torch.cuda.current_stream())
    rows = []
    for b, hq, hkv, s, d, causal in SHAPES:
        gen = torch.Generator(device="cuda").manual_seed(0)
        def rand(*shape):
            return torch.randn(*shape, device="cuda", dtype=torch.bfloat16, generator=gen)
        bytes_per_set = 2 * (b * hq * s * d * 2 + b * hkv * s * d * 2)
        sets = [(rand(b, hq, s, d), rand(b, hkv, s, d), rand(b, hkv, s, d))
                for _ in range(rotation_count(bytes_per_set))]
        ours_in = [tuple(ptxattn.from_dlpack(t, stream) for t in qkv) for qkv in sets]
        out = torch.empty(b, hq, s, d, device="cuda", dtype=torch.bfloat16)
        ours_out = ptxattn.from_dlpack(out, stream)
        flops = 4 * b * hq * s * s * d / (2 if causal else 1)

        def ours(i):
            q, k, v = ours_in[i]
            ptxattn.sdpa(q, k, v, causal=causal, out=ours_out, stream=stream)

        ours(0)
        torch.cuda.synchronize()
        row = {"shape": _shape_name(b, hq, hkv, s, d, causal)}
        timings = {"ptxattn": try_time(ours, repeat=repeat, rotate=len(sets))}
        row["ptxattn_host_us"] = 1e3 * host_ms(ours, rotate=len(sets))  # hidden from the timings
        for name, fn in backends.items():
            def theirs(i, fn=fn, gqa=hq != hkv):
                q, k, v = sets[i]
                fn(q, k, v, is_causal=causal, enable_gqa=gqa)
            timings[name] = try_time(theirs, repeat=repeat, rotate=len(sets))
            if timings[name] is None and hq != hkv:
                # A backend without native GQA: time it on K/V expanded to Hq heads.
                expanded = [(q, k.repeat_interleave(hq // hkv, 1), v.repeat_interleave(hq // hkv, 1))
                            for q, k, v in sets]
                def theirs(i, fn=fn):
                    fn(*expanded[i], is_causal=causal)
                timings[name] = try_time(theirs, repeat=repeat, rotate=len(sets))
                row[f"{name}_kv"] = "expanded"
                del expanded

        ours(0)
        q0, k0, v0 = sets[0]
        reference = backends["torch_flash"](q0, k0.repeat_interleave(hq // hkv, 1),
                                            v0.repeat_interleave(hq // hkv, 1), is_causal=causal)
        torch.cuda.synchronize()
        row["rel_err_vs_flash"] = float((out.float() - reference.float()).norm() / reference.float().norm())
        tflops = {name: (flops / (ms * 1e-3) / 1e12 if ms else None) for name, ms in timings.items()}
        for name in timings:
            row[f"{name}_ms"] = timings[name]
            row[f"{name}_tflops"] = tflops[name]
        for name in backends:
            if tflops["ptxattn"] and tflops[name]:
                row[f"ratio_vs_{name}"] = tflops["ptxattn"] / tflops[name]
        row["chart"] = {"unit": "TFLOP/s", "series": tflops}
        rows.append(row)
        del sets, ours_in
        torch.cuda.empty_cache()
    return rows
