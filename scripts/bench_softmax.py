"""softmax suite: ptxattn.softmax next to torch.softmax, one row per kernel path, in TB/s of
the fewest bytes the op must move (the input read once, the output written once), with the
device copy bandwidth measured in the same run as the ceiling."""
from __future__ import annotations

import ptxattn
from ptxattn.ops.softmax import plan

from bench_common import copy_bandwidth_tbs, rotation_count, time_ms, suite_torch

# (shape, axis, dtype name): the row kernel with rows in a warp, rows in a CTA, the looped
# rows, and the column kernel.
SHAPES = [
    ((65536, 1024), -1, "bfloat16"),
    ((8192, 8192), -1, "bfloat16"),
    ((64, 262144), -1, "float32"),
    ((32, 2048, 512), 1, "float16"),
]


def run(args) -> list[dict]:
    torch = suite_torch("softmax suite")
    if torch is None:
        return []
    stream = torch.cuda.current_stream().cuda_stream
    copy_tbs = copy_bandwidth_tbs()
    repeat = 5 if args.quick else 30
    rows = []
    for shape, axis, dtype_name in SHAPES:
        dtype = getattr(torch, dtype_name)
        numel = _prod(shape)
        nbytes = 2 * numel * dtype.itemsize
        sets = rotation_count(nbytes)
        xs = [torch.randn(shape, device="cuda", dtype=dtype) * 3 for _ in range(sets)]
        ys = [torch.empty_like(x) for x in xs]
        xa = [ptxattn.from_dlpack(x, stream) for x in xs]
        ya = [ptxattn.from_dlpack(y, stream) for y in ys]

        ours = time_ms(lambda i: ptxattn.softmax(xa[i], axis, out=ya[i], stream=stream), repeat=repeat, rotate=sets)
        theirs = time_ms(lambda i: torch.softmax(xs[i], axis), repeat=repeat, rotate=sets)
        ptxattn.softmax(xa[0], axis, out=ya[0], stream=stream)
        err = (ys[0].float() - torch.softmax(xs[0].double(), axis)).abs().max().item()

        ax = axis % len(shape)
        kernel = plan(_prod(shape[:ax]), shape[ax], _prod(shape[ax + 1:])).kernel
        ours_tbs, torch_tbs = nbytes / (ours * 1e-3) / 1e12, nbytes / (theirs * 1e-3) / 1e12
        rows.append({
            "shape": f"{dtype_name} {shape} axis {axis}", "kernel": kernel,
            "ptxattn_ms": ours, "ptxattn_TB/s": ours_tbs, "torch_ms": theirs, "torch_TB/s": torch_tbs,
            "copy_TB/s": copy_tbs, "max_abs_err": err,
            "chart": {"unit": "TB/s", "series": {"ptxattn": ours_tbs, "torch.softmax": torch_tbs, "copy": copy_tbs}},
        })
    return rows


def _prod(dims) -> int:
    result = 1
    for n in dims:
        result *= n
    return result
