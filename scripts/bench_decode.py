"""Decode attention (ptxattn.decode / paged_decode, bf16, Hq32 Hkv8 D128, one query token)
next to the device-to-device copy bandwidth, and PyTorch's flash and cuDNN SDPA on the same
contiguous shapes when torch with CUDA is installed, timed side by side in one run.

Effective TB/s counts the bytes a step must move: the live K and V, q and the output. Our
step (split kernel + combine) is captured once in a CUDA graph and replayed, as a decode loop
runs it; PyTorch runs eagerly (its host cost stays below its GPU time at these sizes). Each
shape's output is checked against the float64 reference on its first and last rows, and
against PyTorch flash on the live keys of every row when torch is there, so a fast but wrong
kernel cannot hide in the table. A "uniform" row also reports its live_fraction (live tokens
over B x capacity) and time_vs_full (its time over the full row of the same B and capacity,
run just before it): when time scales with live tokens, not capacity, the two are about equal.

fp8 columns: the same step over float8_e4m3fn caches with per-(token, kv head) scales (random
finite bytes and scales), contiguous and paged; fp8_tbs counts the bytes it moves (fp8 K and V,
their float32 scales, q and o), fp8_speedup is bf16 time over fp8 time (tokens/s), and
fp8_rel_err compares the first and last rows with the float64 reference over the dequantized
cache.
"""
from __future__ import annotations

import numpy as np

import ptxattn
from ptxattn import reference

from bench_common import (copy_bandwidth_tbs, finished_row, random_host, relative_error, rotation_count, rows_named,
                          stream, time_ms, torch_cuda, torch_sdpa_backends, try_time, upload)

BF16 = ptxattn.bfloat16
HQ, HKV, D = 32, 8, 128
# (B, capacity, lengths): "full" = every row at capacity, "uniform" = drawn in [1, capacity]
# (after the full row of its B and capacity, which it is compared with).
SHAPES = [(64, 8192, "full"), (128, 2048, "full"), (1, 32768, "full"), (8, 8192, "full"), (8, 8192, "uniform")]
PAGE_SIZES = (16, 64)
FP8 = ptxattn.dtypes.float8_e4m3fn


def _paged(rng, *caches, page_size: int):
    """The same [B, Hkv, capacity, ...] caches (keys, values, per-token scales) in shuffled
    HND pools sharing one block table (NumPy): (*pools, block_table)."""
    b, hkv, cap = caches[0].shape[:3]
    per_row = cap // page_size
    pages = rng.permutation(b * per_row)

    def pool_of(cache):
        rest = cache.shape[3:]
        pool = np.empty((b * per_row, hkv, page_size, *rest), cache.dtype)
        by_page = cache.reshape(b, hkv, per_row, page_size, *rest).swapaxes(1, 2)
        pool[pages] = by_page.reshape(pool.shape)
        return pool

    return (*(pool_of(c) for c in caches), pages.reshape(b, per_row).astype(np.int32))


def fp8_cache(rng, shape):
    """Random finite e4m3 bytes (no NaN: 0x7f / 0xff) and per-token scales in [0.005, 0.02]."""
    data = rng.integers(0, 0x7F, shape, dtype=np.uint8) | (rng.integers(0, 2, shape, dtype=np.uint8) << 7)
    return data.view(FP8), rng.uniform(0.005, 0.02, shape[:3]).astype(np.float32)


def _graphed(step, count: int):
    """Capture step(i) for each of `count` input sets once (after one eager warm-up call,
    which loads modules and grows the arena); returns replay(i)."""
    step(0)
    graphs = []
    for i in range(count):
        with ptxattn.capture(stream()) as g:
            step(i)
        graphs.append(g)
    return lambda i: graphs[i].replay(stream())


def shape_name(shape: tuple) -> str:
    b, cap, kind = shape
    return f"B{b} T{cap} {kind}"


def chosen_shapes(args) -> list[tuple]:
    """The rows to run: those whose name matches args.rows, else all."""
    if args.rows is None:
        return SHAPES
    return rows_named(args.rows, SHAPES, shape_name, "decode")


def run(args) -> list[dict]:
    torch = torch_cuda()
    backends = torch_sdpa_backends() if torch is not None else {}
    rng = np.random.default_rng(0)
    repeat = 10 if args.quick else 50
    copy_tbs = copy_bandwidth_tbs()
    rows = []
    full_ms = {}  # (B, capacity) -> our time with every row at capacity
    for b, cap, kind in chosen_shapes(args):
        lens = np.full(b, cap, np.int32) if kind == "full" else rng.integers(1, cap + 1, b).astype(np.int32)
        live = int(lens.sum())
        host_sets = [(random_host(rng, (b, HQ, 1, D), BF16), random_host(rng, (b, HKV, cap, D), BF16),
                      random_host(rng, (b, HKV, cap, D), BF16))
                     for _ in range(rotation_count(2 * b * HKV * cap * D * 2))]
        sets = [tuple(upload(t) for t in s) for s in host_sets]
        dev_lens, out = upload(lens), ptxattn.empty((b, HQ, 1, D), BF16)
        # Made before the captures (paged pools of the same capacity plan the same workspace);
        # big enough for the fp8 plan too, which splits rows into more pieces.
        fp8_like = [np.broadcast_to(np.zeros((), FP8), t.shape) for t in host_sets[0][1:]]  # shapes only
        workspace_bytes = max(ptxattn.decode_workspace_bytes(*sets[0]), ptxattn.decode_workspace_bytes(sets[0][0], *fp8_like))
        workspace = ptxattn.empty((max(workspace_bytes, 1),), np.uint8)
        moved = 2 * HKV * D * 2 * live + 2 * b * HQ * D * 2
        # The first and last rows against the float64 reference.
        checked = sorted({0, b - 1})
        q0, k0, v0 = (t[checked] for t in host_sets[0])
        want = reference.decode(q0, k0, v0, lens[checked])[0]

        def error_vs_reference() -> float:
            return relative_error(out.get(stream())[checked], want)

        def contiguous(i):
            q, k, v = sets[i]
            ptxattn.decode(q, k, v, dev_lens, out=out, workspace=workspace, stream=stream())

        row = {"shape": shape_name((b, cap, kind)), "copy_tbs": copy_tbs}
        timings = {"ptxattn": time_ms(_graphed(contiguous, len(sets)), repeat=repeat, rotate=len(sets))}
        contiguous(0)
        row["rel_err_vs_reference"] = error_vs_reference()
        if torch is not None:
            _torch_columns(torch, backends, row, timings, sets, lens, out, kind, repeat)

        for page_size in PAGE_SIZES:
            paged = [(q, *(upload(t) for t in _paged(rng, k, v, page_size=page_size)))
                     for (q, _, _), (_, k, v) in zip(sets, host_sets)]

            def paged_step(i, paged=paged):
                q, k_pool, v_pool, table = paged[i]
                ptxattn.paged_decode(q, k_pool, v_pool, table, dev_lens, out=out, workspace=workspace,
                                     stream=stream())

            timings[f"paged{page_size}"] = time_ms(_graphed(paged_step, len(sets)), repeat=repeat, rotate=len(sets))
            paged_step(0)
            row[f"paged{page_size}_rel_err"] = error_vs_reference()
            del paged

        _fp8_columns(rng, row, timings, host_sets, dev_lens, lens, out, workspace, checked, repeat)

        tbs = {name: (moved / (ms * 1e-3) / 1e12 if ms else None) for name, ms in timings.items()}
        for name, ms in timings.items():
            row[f"{name}_ms"] = ms
            row[f"{name}_tbs"] = tbs[name]
        fp8_moved = HKV * (D + 4) * 2 * live + 2 * b * HQ * D * 2  # 1-byte K and V, a 4-byte scale each
        for name in [n for n in timings if n.startswith("fp8")]:
            tbs[name] = fp8_moved / (timings[name] * 1e-3) / 1e12
            row[f"{name}_tbs"] = tbs[name]
        row["fp8_speedup"] = timings["ptxattn"] / timings["fp8"]
        for page_size in PAGE_SIZES:
            row[f"fp8_paged{page_size}_vs_contiguous"] = timings["fp8"] / timings[f"fp8_paged{page_size}"]
        row["ratio_vs_copy"] = tbs["ptxattn"] / copy_tbs
        if kind == "full":
            full_ms[b, cap] = timings["ptxattn"]
        elif (b, cap) in full_ms:
            row["live_fraction"] = live / (b * cap)
            row["time_vs_full"] = timings["ptxattn"] / full_ms[b, cap]
        for page_size in PAGE_SIZES:
            row[f"paged{page_size}_vs_contiguous"] = tbs[f"paged{page_size}"] / tbs["ptxattn"]
        row["chart"] = {"unit": "TB/s", "series": {**tbs, "copy": copy_tbs}}
        finished_row(rows, row)
        del host_sets, sets
        if torch is not None:
            torch.cuda.empty_cache()
    return rows


def _fp8_columns(rng, row, timings, host_sets, dev_lens, lens, out, workspace, checked, repeat: int) -> None:
    """The step over e4m3 caches with per-token scales, contiguous and paged (into `timings`),
    and its error on the checked rows against the reference over the dequantized cache."""
    b, hkv, cap, _ = host_sets[0][1].shape
    count = rotation_count(2 * b * hkv * cap * (D + 4))
    fp8_host = [(host_sets[i % len(host_sets)][0], *fp8_cache(rng, (b, hkv, cap, D)), *fp8_cache(rng, (b, hkv, cap, D)))
                for i in range(count)]
    fp8_sets = [tuple(upload(t) for t in s) for s in fp8_host]

    def contiguous(i):
        q, k, ks, v, vs = fp8_sets[i]
        ptxattn.decode(q, k, v, dev_lens, k_scale=ks, v_scale=vs, out=out, workspace=workspace, stream=stream())

    timings["fp8"] = time_ms(_graphed(contiguous, len(fp8_sets)), repeat=repeat, rotate=len(fp8_sets))
    contiguous(0)
    q, k, ks, v, vs = (t[checked] for t in fp8_host[0])
    want = reference.decode(q, k.astype(np.float64) * ks[..., None], v.astype(np.float64) * vs[..., None],
                            lens[checked])[0]
    row["fp8_rel_err"] = relative_error(out.get(stream())[checked], want)
    for page_size in PAGE_SIZES:
        paged = [(q, *(upload(t) for t in _paged(rng, k, ks, v, vs, page_size=page_size)))
                 for (q, _, _, _, _), (_, k, ks, v, vs) in zip(fp8_sets, fp8_host)]

        def paged_step(i, paged=paged):
            q, k_pool, ks_pool, v_pool, vs_pool, table = paged[i]
            ptxattn.paged_decode(q, k_pool, v_pool, table, dev_lens, k_scale=ks_pool, v_scale=vs_pool, out=out,
                                 workspace=workspace, stream=stream())

        timings[f"fp8_paged{page_size}"] = time_ms(_graphed(paged_step, len(paged)), repeat=repeat,
                                                   rotate=len(paged))
        del paged


def _torch_columns(torch, backends, row, timings, sets, lens, out, kind: str, repeat: int) -> None:
    """Time PyTorch's backends on full rows (into `timings`) and compare our contiguous
    decode's output, already in `out`, with flash on every row's live keys (into `row`)."""
    tensors = [tuple(torch.from_dlpack(t) for t in s) for s in sets]
    if kind == "full":
        for name, fn in backends.items():
            def theirs(i, fn=fn):
                q, k, v = tensors[i]
                fn(q, k, v, enable_gqa=True)
            timings[name] = try_time(theirs, repeat=repeat, rotate=len(tensors))
    q0, k0, v0 = tensors[0]
    group = HQ // HKV
    flash = torch.cat([
        backends["torch_flash"](q0[i:i + 1], k0[i:i + 1, :, :int(n)].repeat_interleave(group, 1),
                                v0[i:i + 1, :, :int(n)].repeat_interleave(group, 1))
        for i, n in enumerate(lens)]).float()
    ours = torch.from_dlpack(out).float()
    row["rel_err_vs_flash"] = float((ours - flash).norm() / flash.norm())
