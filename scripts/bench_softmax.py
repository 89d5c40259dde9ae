"""softmax suite: ptxattn.softmax, one row per kernel path, in TB/s of the fewest bytes the op
must move (the input read once, the output written once), with the device copy bandwidth
measured in the same run as the ceiling and the largest error against the float64 reference;
torch.softmax's columns when torch with CUDA is installed."""
from __future__ import annotations

import numpy as np

import ptxattn
from ptxattn import reference
from ptxattn.dtypes import normalize
from ptxattn.ops.softmax import plan

from bench_common import copy_bandwidth_tbs, random_host, rotation_count, stream, time_ms, torch_cuda, upload

# (shape, axis, dtype name): the row kernel with rows in a warp, rows in a CTA, the looped
# rows, and the column kernel.
SHAPES = [
    ((65536, 1024), -1, "bfloat16"),
    ((8192, 8192), -1, "bfloat16"),
    ((64, 262144), -1, "float32"),
    ((32, 2048, 512), 1, "float16"),
]


def run(args) -> list[dict]:
    torch = torch_cuda()
    rng = np.random.default_rng(0)
    copy_tbs = copy_bandwidth_tbs()
    repeat = 5 if args.quick else 30
    rows = []
    for shape, axis, dtype_name in SHAPES:
        dtype = normalize(dtype_name)
        numel = _prod(shape)
        nbytes = 2 * numel * dtype.itemsize
        hosts = [random_host(rng, shape, dtype, scale=3) for _ in range(rotation_count(nbytes))]
        xa = [upload(x) for x in hosts]
        ya = [ptxattn.empty(shape, dtype) for _ in xa]

        ours = time_ms(lambda i: ptxattn.softmax(xa[i], axis, out=ya[i], stream=stream()), repeat=repeat, rotate=len(xa))
        ptxattn.softmax(xa[0], axis, out=ya[0], stream=stream())
        err = float(np.max(np.abs(ya[0].get(stream()).astype(np.float64) - reference.softmax(hosts[0], axis))))

        ax = axis % len(shape)
        kernel = plan(_prod(shape[:ax]), shape[ax], _prod(shape[ax + 1:])).kernel
        ours_tbs = nbytes / (ours * 1e-3) / 1e12
        row = {"shape": f"{dtype_name} {shape} axis {axis}", "kernel": kernel,
               "ptxattn_ms": ours, "ptxattn_TB/s": ours_tbs, "copy_TB/s": copy_tbs, "max_abs_err": err}
        series = {"ptxattn": ours_tbs, "copy": copy_tbs}
        if torch is not None:
            xs = [torch.from_dlpack(x) for x in xa]
            theirs = time_ms(lambda i: torch.softmax(xs[i], axis), repeat=repeat, rotate=len(xs))
            row["torch_ms"] = theirs
            row["torch_TB/s"] = series["torch.softmax"] = nbytes / (theirs * 1e-3) / 1e12
        row["chart"] = {"unit": "TB/s", "series": series}
        rows.append(row)
    return rows


def _prod(dims) -> int:
    result = 1
    for n in dims:
        result *= n
    return result
