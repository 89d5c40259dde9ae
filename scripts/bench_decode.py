"""Decode attention (ptxattn.decode / paged_decode, bf16, Hq32 Hkv8 D128, one query token)
next to the device-to-device copy bandwidth and PyTorch's flash and cuDNN SDPA on the same
contiguous shapes, timed side by side in one run.

Effective TB/s counts the bytes a step must move: the live K and V, q and the output. Our
step (split kernel + combine) is captured once in a CUDA graph and replayed, as a decode loop
runs it; PyTorch runs eagerly (its host cost stays below its GPU time at these sizes). Each
shape's output is checked against PyTorch flash on the live keys, so a fast but wrong kernel
cannot hide in the table. A "uniform" row also reports its live_fraction (live tokens over
B x capacity) and time_vs_full (its time over the full row of the same B and capacity, run
just before it): when time scales with live tokens, not capacity, the two are about equal.
"""
from __future__ import annotations

from bench_common import copy_bandwidth_tbs, rotation_count, time_ms, suite_torch, torch_sdpa_backends, try_time

HQ, HKV, D = 32, 8, 128
# (B, capacity, lengths): "full" = every row at capacity, "uniform" = drawn in [1, capacity]
# (after the full row of its B and capacity, which it is compared with).
SHAPES = [(64, 8192, "full"), (128, 2048, "full"), (1, 32768, "full"), (8, 8192, "full"), (8, 8192, "uniform")]
PAGE_SIZES = (16, 64)


def _paged(torch, k, v, page_size: int, gen):
    """The same keys and values in shuffled HND pools sharing one block table:
    (k_pool, v_pool, block_table)."""
    b, hkv, cap, d = k.shape
    per_row = cap // page_size
    pages = torch.randperm(b * per_row, device="cuda", generator=gen)

    def pool_of(cache):
        pool = torch.empty(b * per_row, hkv, page_size, d, device="cuda", dtype=cache.dtype)
        pool[pages] = cache.view(b, hkv, per_row, page_size, d).transpose(1, 2).reshape(b * per_row, hkv, page_size, d)
        return pool

    return pool_of(k), pool_of(v), pages.view(b, per_row).to(torch.int32)


def run(args) -> list[dict]:
    torch = suite_torch("decode suite")
    if torch is None:
        return []
    import ptxattn

    repeat = 10 if args.quick else 50
    backends = torch_sdpa_backends()
    side = torch.cuda.Stream()
    stream = ptxattn.as_stream(side.cuda_stream)
    copy_tbs = copy_bandwidth_tbs()
    rows = []
    full_ms = {}  # (B, capacity) -> our time with every row at capacity
    with torch.cuda.stream(side):
        for b, cap, kind in SHAPES:
            gen = torch.Generator(device="cuda").manual_seed(0)
            if kind == "full":
                lens = torch.full((b,), cap, dtype=torch.int32, device="cuda")
            else:
                lens = torch.randint(1, cap + 1, (b,), dtype=torch.int32, device="cuda", generator=gen)
            live = int(lens.sum())
            kv_bytes_per_set = 2 * b * HKV * cap * D * 2
            sets = []
            for _ in range(rotation_count(kv_bytes_per_set)):
                q = torch.randn(b, HQ, 1, D, device="cuda", dtype=torch.bfloat16, generator=gen)
                k = torch.randn(b, HKV, cap, D, device="cuda", dtype=torch.bfloat16, generator=gen)
                v = torch.randn(b, HKV, cap, D, device="cuda", dtype=torch.bfloat16, generator=gen)
                sets.append((q, k, v))
            out = torch.empty(b, HQ, 1, D, device="cuda", dtype=torch.bfloat16)
            moved = 2 * HKV * D * 2 * live + 2 * b * HQ * D * 2
            row = {"shape": f"B{b} T{cap} {kind}", "copy_tbs": copy_tbs}
            timings = {}

            def graphed(step):
                step(0)  # warm-up outside capture: loads modules, grows the arena
                graphs = []
                for i in range(len(sets)):
                    with ptxattn.capture(stream) as g:
                        step(i)
                    graphs.append(g)
                return lambda i: graphs[i].replay(stream)

            dev_sets = [tuple(ptxattn.from_dlpack(t, stream) for t in s) for s in sets]
            dev_lens, dev_out = ptxattn.from_dlpack(lens, stream), ptxattn.from_dlpack(out, stream)

            def contiguous(i):
                q, k, v = dev_sets[i]
                ptxattn.decode(q, k, v, dev_lens, out=dev_out, stream=stream)

            timings["ptxattn"] = time_ms(graphed(contiguous), repeat=repeat, rotate=len(sets))
            torch.cuda.synchronize()
            q0, k0, v0 = sets[0]
            reference = torch.cat([
                backends["torch_flash"](q0[i:i + 1], k0[i:i + 1, :, :int(lens[i])].repeat_interleave(HQ // HKV, 1),
                                        v0[i:i + 1, :, :int(lens[i])].repeat_interleave(HQ // HKV, 1))
                for i in range(b)])
            contiguous(0)
            torch.cuda.synchronize()
            row["rel_err_vs_flash"] = float((out.float() - reference.float()).norm() / reference.float().norm())

            for page_size in PAGE_SIZES:
                paged = [tuple(ptxattn.from_dlpack(t, stream) for t in (q, *_paged(torch, k, v, page_size, gen)))
                         for q, k, v in sets]

                def paged_step(i, paged=paged):
                    q, k_pool, v_pool, table = paged[i]
                    ptxattn.paged_decode(q, k_pool, v_pool, table, dev_lens, out=dev_out, stream=stream)

                timings[f"paged{page_size}"] = time_ms(graphed(paged_step), repeat=repeat, rotate=len(sets))
                paged_step(0)
                torch.cuda.synchronize()
                row[f"paged{page_size}_rel_err"] = float((out.float() - reference.float()).norm() / reference.float().norm())
                del paged

            if kind == "full":
                for name, fn in backends.items():
                    def theirs(i, fn=fn):
                        q, k, v = sets[i]
                        fn(q, k, v, enable_gqa=True)
                    timings[name] = try_time(theirs, repeat=repeat, rotate=len(sets))

            tbs = {name: (moved / (ms * 1e-3) / 1e12 if ms else None) for name, ms in timings.items()}
            for name, ms in timings.items():
                row[f"{name}_ms"] = ms
                row[f"{name}_tbs"] = tbs[name]
            row["ratio_vs_copy"] = tbs["ptxattn"] / copy_tbs
            if kind == "full":
                full_ms[b, cap] = timings["ptxattn"]
            elif (b, cap) in full_ms:
                row["live_fraction"] = live / (b * cap)
                row["time_vs_full"] = timings["ptxattn"] / full_ms[b, cap]
            for page_size in PAGE_SIZES:
                row[f"paged{page_size}_vs_contiguous"] = tbs[f"paged{page_size}"] / tbs["ptxattn"]
            row["chart"] = {"unit": "TB/s", "series": {**tbs, "copy": copy_tbs}}
            rows.append(row)
            del sets, dev_sets
            torch.cuda.empty_cache()
    return rows
