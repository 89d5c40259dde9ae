"""softmax and log_softmax along one axis (kernels in cu/softmax.cu).

Around the reduced axis a contiguous tensor is a [outer, length, inner] block. Rows along the
last axis (inner == 1) go to a row kernel: a few lanes per row for short rows, one CTA per
row for long ones. Other axes go to a column kernel whose adjacent threads read adjacent
addresses. `plan` makes that choice from the shape alone, so a shape always runs the same
launch and gives the same bits.
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass

import numpy as np

from .. import kernel_names
from ..array import DeviceArray
from ..dtypes import bfloat16
from ..module import ParamStruct
from .checks import check_output, require
from .prepared import Op

__all__ = ["softmax", "log_softmax", "plan", "SoftmaxPlan"]

_KERNEL_SUFFIX = {np.dtype(np.float16): "f16", bfloat16: "bf16", np.dtype(np.float32): "f32"}

TILE = 32                 # values a thread keeps in registers: kTile in cu/softmax.cu
WARP_CTA_THREADS = 128    # softmax_rows_warp's CTA size
MAX_ROW_THREADS = 512     # softmax_rows_block's largest CTA (its __launch_bounds__)
COL_CTA_THREADS = 256     # softmax_cols' largest CTA (its __launch_bounds__)
FILL_THREADS = 1 << 18    # about what an H100/H200 holds resident (132 SMs x 2048 threads)
GRID_CAP = 4096           # CTAs per launch; the kernels loop past it (grid-stride)


class SoftmaxParams(ParamStruct):
    """Mirror of SoftmaxParams in cu/softmax.cu (same fields, same order)."""

    _fields_ = [
        ("x", ctypes.c_void_p),
        ("y", ctypes.c_void_p),
        ("outer", ctypes.c_int64),
        ("length", ctypes.c_int64),
        ("inner", ctypes.c_int64),
        ("log_softmax", ctypes.c_int32),
        ("lanes_per_row", ctypes.c_int32),
    ]


@dataclass(frozen=True)
class SoftmaxPlan:
    kernel: str            # "rows_warp", "rows_block" or "cols"
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    lanes_per_row: int = 0


def _pow2_ceil(n: int) -> int:
    return 1 << max(int(n) - 1, 0).bit_length()


def _pow2_floor(n: int) -> int:
    return 1 << (int(n).bit_length() - 1)


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def plan(outer: int, length: int, inner: int) -> SoftmaxPlan:
    """Kernel, grid and block for a non-empty [outer, length, inner] softmax."""
    if inner == 1 and length <= 32 * TILE:
        # The fewest lanes whose registers hold the row, so no lane idles on padding.
        lanes = min(32, _pow2_ceil(_ceil_div(length, TILE)))
        rows_per_cta = WARP_CTA_THREADS // lanes
        grid = min(_ceil_div(outer, rows_per_cta), GRID_CAP)
        return SoftmaxPlan("rows_warp", (grid, 1, 1), (WARP_CTA_THREADS, 1, 1), lanes)
    if inner == 1:
        # Rows that fit MAX_ROW_THREADS * TILE stay in registers; longer ones loop.
        threads = min(MAX_ROW_THREADS, max(32, _pow2_ceil(_ceil_div(length, TILE))))
        return SoftmaxPlan("rows_block", (min(outer, GRID_CAP), 1, 1), (threads, 1, 1))
    columns = outer * inner
    # Split each column's length over threadIdx.y only as far as it takes to fill the GPU,
    # keeping at least a warp's worth of adjacent columns per CTA row when there are that many.
    splits = _pow2_floor(max(1, FILL_THREADS // columns))
    splits = min(splits, COL_CTA_THREADS // min(32, _pow2_ceil(columns)), _pow2_floor(length))
    per_cta = min(COL_CTA_THREADS // splits, _pow2_ceil(columns))
    grid = min(_ceil_div(columns, per_cta), GRID_CAP)
    return SoftmaxPlan("cols", (grid, 1, 1), (per_cta, splits, 1))


def _normalize_axis(op: str, axis, ndim: int) -> int:
    if isinstance(axis, (bool, np.bool_)) or not isinstance(axis, (int, np.integer)):
        raise TypeError(f"{op}: axis must be an int, got {type(axis).__name__}")
    if ndim == 0:
        raise ValueError(f"{op}: x must have at least 1 dimension, got a 0-d array")
    if not -ndim <= axis < ndim:
        raise ValueError(f"{op}: axis must be in [{-ndim}, {ndim}) for a {ndim}-d x, got {axis}")
    return int(axis) % ndim


def _validate(op: str, a: dict, axis, on_host: bool = False) -> int:
    require(op, "x", a["x"])
    x = a["x"]
    if np.dtype(x.dtype) not in _KERNEL_SUFFIX:
        raise TypeError(f"{op}: x must be float16, bfloat16 or float32, got {x.dtype}")
    axis = _normalize_axis(op, axis, x.ndim)
    check_output(op, "out", a["out"], x.shape, x.dtype)
    for name in ("x", "out"):
        arr = a[name]
        if isinstance(arr, DeviceArray) and not arr.is_contiguous:
            raise ValueError(f"{op}: {name} must be a contiguous (C-order) device array, got strides "
                             f"{arr.strides} for shape {arr.shape}: pass a contiguous copy")
    return axis


def _bind(log: bool, binding, a: dict, axis: int, _axis_option) -> None:
    x = a["x"]
    binding.make("out", x.shape, x.dtype)
    binding.result("out")
    if x.size == 0:
        return
    shape = x.shape
    outer = int(np.prod(shape[:axis], dtype=np.int64))
    inner = int(np.prod(shape[axis + 1:], dtype=np.int64))
    p = plan(outer, shape[axis], inner)
    params = SoftmaxParams(x.ptr, 0, outer, shape[axis], inner, int(log), p.lanes_per_row)
    launch = binding.launch(kernel_names.softmax(p.kernel, _KERNEL_SUFFIX[x.dtype]), p.grid, p.block, params)
    binding.point("x", launch, "x")
    binding.point("out", launch, "y")


def _op(name: str, log: bool) -> Op:
    return Op(name, ("x", "out"), ("axis",), outputs=("out",),
              validate=lambda a, axis, on_host=False: _validate(name, a, axis, on_host),
              bind=lambda binding, a, checked, axis: _bind(log, binding, a, checked, axis))


_SOFTMAX, _LOG_SOFTMAX = _op("softmax", False), _op("log_softmax", True)


def softmax(x, axis: int = -1, *, out=None, stream=None):
    """exp(x - max) / sum(exp(x - max)) along `axis` (runtime/reference.py has the exact
    semantics). x: float16, bfloat16 or float32, any shape of at least 1 dimension; fp32
    arithmetic, result in x's dtype. NumPy in, NumPy out (synchronous); device arrays in,
    a DeviceArray out, queued on `stream`. `out` may be x itself."""
    return _SOFTMAX((x, out), (axis,), stream)


def log_softmax(x, axis: int = -1, *, out=None, stream=None):
    """x - max - log(sum(exp(x - max))) along `axis`; otherwise as `softmax`."""
    return _LOG_SOFTMAX((x, out), (axis,), stream)


softmax.op, log_softmax.op = _SOFTMAX, _LOG_SOFTMAX
