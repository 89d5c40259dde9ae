#!/usr/bin/env python3
"""sdpa tile tuning (developer tool). Two steps, since the GPU machine may lack NVRTC:

    python scripts/sdpa_tune.py build tune.ptx   # here: flash_fwd.cu plus one plain-score
                                                 # bf16 entry point per candidate tile (and
                                                 # tune.sm90.ptx: the wgmma candidates)
    python scripts/sdpa_tune.py run tune.ptx     # GPU machine, with torch: time every
                                                 # candidate on the bench_prefill shapes

Each candidate's output is compared with PyTorch flash's, so a fast wrong tile shows; "*"
marks the tile the table ships. The flash_fwd and flash_fwd_sm90 tables of cu/variants.json
take the winners. Loading the module JIT-compiles every candidate first (seconds each): allow
for it in a device call's time limit.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

# (Dqk, Dv, warps, m16 tiles a warp, keys a tile, stages, Q in registers): TcTile's order.
CANDIDATES = [
    (64, 64, 4, 2, 64, 3, True), (64, 64, 4, 2, 64, 2, False), (64, 64, 4, 2, 128, 2, True),
    (64, 64, 4, 2, 128, 2, False), (64, 64, 8, 1, 128, 2, True),
    (128, 128, 4, 2, 32, 3, False), (128, 128, 4, 2, 32, 2, False), (128, 128, 4, 2, 32, 3, True),
    (128, 128, 4, 2, 64, 2, False), (128, 128, 8, 1, 64, 3, True),
]


# (D, warpgroups): Sm90Tile's order, cu/flash_fwd_sm90.cu (sm_90a).
SM90_CANDIDATES = [(64, 2), (64, 3), (128, 2), (128, 3)]


def sm90_kernel_name(tile) -> str:
    return f"tune_sm90_d{tile[0]}_g{tile[1]}"


def kernel_name(tile) -> str:
    dqk, dv, warps, m_tiles, keys, stages, q_in_regs = tile
    return f"tune_d{dqk}_w{warps}_m{m_tiles}_k{keys}_s{stages}_{'qr' if q_in_regs else 'qs'}"


def build(out: Path) -> None:
    from build_ptx import CU, COMMON_OPTIONS, Nvrtc, _package_dir, c_literal

    include = _package_dir("nvidia.cuda_runtime") / "include"
    options = COMMON_OPTIONS + [f"-I{include}", f"-I{CU}"]

    def compile_with(source: str, arch: str, lines: list[str]) -> str:
        # The candidates take the place of the shipped variants (build_ptx's variants.inc).
        return Nvrtc().compile((CU / source).read_text(), source, options + [f"--gpu-architecture={arch}"],
                               {"variants.inc": "\n".join(lines) + "\n"})

    out.write_text(compile_with("flash_fwd.cu", "compute_90", [
        f"FLASH_FWD_TC({kernel_name(t)}, __nv_bfloat16, false, {', '.join(map(c_literal, t))})" for t in CANDIDATES]))
    _sm90_path(out).write_text(compile_with("flash_fwd_sm90.cu", "compute_90a", [
        f"FLASH_FWD_SM90({sm90_kernel_name(t)}, __nv_bfloat16, {t[0]}, {t[0]}, {t[1]}, 128, false)" for t in SM90_CANDIDATES]))
    print(f"sdpa_tune: {len(CANDIDATES)} + {len(SM90_CANDIDATES)} candidates -> {out}, {_sm90_path(out)}")


def _sm90_path(ptx: Path) -> Path:
    return ptx.with_suffix(".sm90.ptx")


def run(ptx_path: Path) -> None:
    import ptxattn
    from bench_common import stream as bench_stream, time_ms, torch_cuda, torch_sdpa_backends
    from bench_prefill import SHAPES
    from ptxattn.context import on_device
    from ptxattn.driver import call, cu
    from ptxattn.module import Kernel, load_ptx
    from ptxattn.variants import Sm90Tile, TcTile, sdpa_tiles, sm90_tiles

    torch = torch_cuda()
    if torch is None:
        raise SystemExit("sdpa_tune run: needs torch with CUDA (the flash reference and its timing)")
    device = ptxattn.get_device(0)
    stream = bench_stream()  # torch's current stream too: time_ms times the work queued there
    flash = torch_sdpa_backends()["torch_flash"]
    shipped = {variant.plain for variant in sdpa_tiles().values()}
    def load(path, names):
        with on_device(device):
            module = load_ptx(path.read_bytes(), str(path), device)
            return [Kernel(n, call(cu.cuModuleGetFunction, module, n.encode()), "sm_90") for n in names]

    # (kernel, rows a CTA, threads, shared bytes, Dqk, shipped) per candidate.
    candidates = []
    for tile, kernel in zip(CANDIDATES, load(ptx_path, [kernel_name(t) for t in CANDIDATES])):
        shape = TcTile(*tile)
        candidates.append((kernel, shape.rows, shape.threads, shape.shared_bytes, tile[0], shape in shipped))
    sm90 = load(_sm90_path(ptx_path), [sm90_kernel_name(t) for t in SM90_CANDIDATES])
    for (dim, groups), kernel in zip(SM90_CANDIDATES, sm90):
        shape = Sm90Tile(dim, dim, groups)
        shipped_sm90 = sm90_tiles().get((dim, dim, False)) == shape
        candidates.append((kernel, shape.rows, shape.threads, shape.shared_bytes, dim, shipped_sm90))
    print(f"{'shape':<34} {'kernel':<28} {'smem':>6} {'ms':>8} {'TFLOP/s':>8} {'rel_err':>8}")
    for shape in SHAPES:
        if shape.mask or shape.softcap or shape.window is not None or shape.dqk != shape.dv:
            continue  # the candidates are plain-score kernels
        b, hq, hkv, s, d, causal = shape.b, shape.hq, shape.hkv, shape.s, shape.dqk, shape.causal
        gen = torch.Generator(device="cuda").manual_seed(0)
        q, k, v = (torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16, generator=gen)
                   for h in (hq, hkv, hkv))
        group = hq // hkv
        reference = flash(q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1), is_causal=causal).float()
        out = torch.empty_like(q)
        qd, kd, vd, od = (ptxattn.from_dlpack(t, stream) for t in (q, k, v, out))
        flops = 4 * b * hq * s * s * d / (2 if causal else 1)

        def report(label, smem, fn, writes_out=True):
            err = float("nan")
            try:
                if writes_out:
                    out.fill_(float("nan"))
                    fn()
                    torch.cuda.synchronize()
                    err = float((out.float() - reference).norm() / reference.norm())
                ms = time_ms(lambda i: fn(), warmup=3, repeat=10)
            except RuntimeError as exc:
                print(f"  {label}: {str(exc).splitlines()[0][:100]}")
                return
            print(f"{shape.name:<34} {label:<28} {smem:>6} {ms:>8.3f} "
                  f"{flops / (ms * 1e-3) / 1e12:>8.1f} {err:>8.1e}")

        report("torch flash (FA2)", "-", lambda: flash(q, k, v, is_causal=causal, enable_gqa=group > 1),
               writes_out=False)
        # The shipped call's bound parameters serve every candidate kernel of this shape.
        params = ptxattn.prepare(ptxattn.sdpa, qd, kd, vd, causal=causal, out=od, stream=stream).launches[0].params
        for kernel, rows, threads, smem, dim, is_shipped in candidates:
            if dim != d:
                continue
            grid = (-(-s // rows), hq, b)
            with on_device(device):
                report(kernel.name + (" *" if is_shipped else ""), smem,
                       lambda: kernel.launch(grid, (threads, 1, 1), params, stream, smem))
        del q, k, v, out, reference
        torch.cuda.empty_cache()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("step", choices=["build", "run"])
    parser.add_argument("ptx", type=Path)
    args = parser.parse_args()
    build(args.ptx) if args.step == "build" else run(args.ptx)
    return 0


if __name__ == "__main__":
    sys.exit(main())
