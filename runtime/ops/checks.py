"""The checks every op shares: one rule per argument kind, one message style.

Each check reads only shapes, dtypes, strides and (for device arrays) addresses, never device
memory, and raises before any device work with the op, the argument, what was expected and
what came. NumPy arrays are checked as they would be uploaded: contiguous and aligned.
"""
from __future__ import annotations

import math

import numpy as np

from ..array import DeviceArray
from ..dtypes import bfloat16
from ..memory import ALIGNMENT

__all__ = [
    "ATTENTION_DTYPES", "UNBOUNDED_WINDOW", "MAX_GRID_YZ", "LAYOUTS", "require", "check_flag", "parse_scale",
    "is_real", "parse_softcap", "parse_window", "parse_layout", "check_rank", "check_attention_dtype", "check_same_dtype",
    "check_index_array", "check_row_bytes", "check_unit_last_stride", "check_nonnegative_strides", "check_sinks",
    "check_output", "check_host_values", "check_workspace_type", "check_workspace_size",
]

ATTENTION_DTYPES = {np.dtype(np.float16): "f16", bfloat16: "bf16", np.dtype(np.float32): "f32"}
UNBOUNDED_WINDOW = 1 << 30  # kUnboundedWindow in cu/attention_common.cuh
MAX_GRID_YZ = 65535         # the largest y or z extent of a launch grid
LAYOUTS = ("HND", "NHD")
_NUMBER = (int, float, np.integer, np.floating)


def require(op: str, name: str, arr) -> None:
    if arr is None:
        raise TypeError(f"{op}: {name} is required, got None")


def check_flag(op: str, name: str, value) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{op}: {name} must be True or False, got {value!r}")
    return bool(value)


def is_real(value) -> bool:
    return isinstance(value, _NUMBER) and not isinstance(value, (bool, np.bool_))


def parse_scale(op: str, scale, dim_qk: int) -> float:
    """The softmax scale: None -> 1/sqrt(Dqk); 0 is a real zero."""
    if scale is None:
        return 1.0 / math.sqrt(dim_qk)
    if not is_real(scale):
        raise TypeError(f"{op}: scale must be a number or None, got {scale!r}")
    if not math.isfinite(scale):
        raise ValueError(f"{op}: scale must be finite, got {scale!r}")
    return float(scale)


def parse_softcap(op: str, softcap) -> float:
    if not is_real(softcap):
        raise TypeError(f"{op}: softcap must be a number (0 = off), got {softcap!r}")
    if not math.isfinite(softcap) or softcap < 0:
        raise ValueError(f"{op}: softcap must be finite and >= 0 (0 = off), got {softcap!r}")
    return float(softcap)


def parse_window(op: str, window, causal: bool = False) -> tuple[int, int]:
    """(left, right) keys around the aligned diagonal for the kernels, UNBOUNDED_WINDOW for no
    limit. `window` is None or a pair whose entries are ints >= 0, or -1 / None (unbounded);
    causal bounds the right side at 0."""
    left = right = UNBOUNDED_WINDOW
    if window is not None:
        if not isinstance(window, (tuple, list)) or len(window) != 2 or not all(
                w is None or (isinstance(w, (int, np.integer)) and not isinstance(w, (bool, np.bool_)))
                for w in window):
            raise TypeError(f"{op}: window must be None or a pair (left, right) of ints or None, got {window!r}")
        if any(w is not None and w < -1 for w in window):
            raise ValueError(f"{op}: window entries must be >= 0, or -1 / None for unbounded, got {tuple(window)}")
        left, right = (UNBOUNDED_WINDOW if w is None or w < 0 else min(int(w), UNBOUNDED_WINDOW) for w in window)
    if causal:
        right = 0
    return left, right


def parse_layout(op: str, layout) -> tuple[str, str]:
    """(k_layout, v_layout) from "HND" / "NHD" or a pair of them; never guessed from shapes."""
    pair = (layout, layout) if isinstance(layout, str) else tuple(layout) if isinstance(layout, (tuple, list)) else None
    if pair is None or len(pair) != 2 or any(x not in LAYOUTS for x in pair):
        raise ValueError(f"{op}: layout must be 'HND', 'NHD' or a (k_layout, v_layout) pair of them, got {layout!r}")
    return pair


def check_rank(op: str, name: str, arr, rank: int, what: str) -> None:
    if arr.ndim != rank:
        raise ValueError(f"{op}: {name} must be {rank}-d {what}, got shape {tuple(arr.shape)}")


def check_attention_dtype(op: str, name: str, arr) -> None:
    if np.dtype(arr.dtype) not in ATTENTION_DTYPES:
        raise TypeError(f"{op}: {name} must be float16, bfloat16 or float32, got {arr.dtype}")


def check_same_dtype(op: str, name: str, arr, ref_name: str, ref) -> None:
    if np.dtype(arr.dtype) != np.dtype(ref.dtype):
        raise TypeError(f"{op}: {name} must have {ref_name}'s dtype {ref.dtype}, got {arr.dtype}")


def check_index_array(op: str, name: str, arr, shape, dtypes=(np.int32,)) -> None:
    allowed = [np.dtype(d) for d in dtypes]
    if np.dtype(arr.dtype) not in allowed:
        raise TypeError(f"{op}: {name} must be {' or '.join(str(d) for d in allowed)}, got {arr.dtype}")
    if tuple(arr.shape) != tuple(shape):
        raise ValueError(f"{op}: {name} must have shape {tuple(shape)}, got {tuple(arr.shape)}")
    if isinstance(arr, DeviceArray) and not arr.is_contiguous:
        raise ValueError(f"{op}: {name} must be contiguous, got strides {arr.strides}")


def check_row_bytes(op: str, name: str, arr) -> None:
    """The cache kernels move 16 bytes at a time: rows of a multiple of 16 bytes, and for
    device arrays a contiguous last axis with 16-byte aligned rows."""
    dim = arr.shape[-1]
    if dim == 0 or dim * arr.dtype.itemsize % 16:
        per = 16 // arr.dtype.itemsize
        raise ValueError(f"{op}: {name}'s last axis must be a positive multiple of {per} for {arr.dtype} "
                         f"(16-byte rows), got {dim}")
    if not isinstance(arr, DeviceArray):
        return
    if arr.strides[-1] != arr.itemsize:
        raise ValueError(f"{op}: {name} must have a contiguous last axis (stride {arr.itemsize} bytes), "
                         f"got strides {arr.strides}")
    misaligned = [s for n, s in zip(arr.shape[:-1], arr.strides[:-1]) if n > 1 and s % 16]
    if arr.ptr % 16 or misaligned:
        raise ValueError(f"{op}: {name} must start on a 16-byte boundary and have strides that are "
                         f"multiples of 16 bytes, got address 0x{arr.ptr:x}, strides {arr.strides}")


def check_unit_last_stride(op: str, name: str, arr) -> None:
    if isinstance(arr, DeviceArray) and arr.shape and arr.shape[-1] > 1 and arr.strides[-1] != arr.itemsize:
        raise ValueError(f"{op}: {name} must have a contiguous last axis, got element strides {arr.element_strides}")


def check_nonnegative_strides(op: str, name: str, arr) -> None:
    if isinstance(arr, DeviceArray) and any(s < 0 for s in arr.strides):
        raise ValueError(f"{op}: {name} must have non-negative strides, got element strides {arr.element_strides}")


def check_sinks(op: str, sinks, heads: int) -> None:
    """sinks: float32 [heads], contiguous (host or device alike)."""
    if sinks is None:
        return
    if np.dtype(sinks.dtype) != np.float32 or tuple(sinks.shape) != (heads,):
        raise TypeError(f"{op}: sinks must be float32 of shape ({heads},) (one logit per query head), "
                        f"got {sinks.dtype} {tuple(sinks.shape)}")
    if isinstance(sinks, DeviceArray) and not sinks.is_contiguous:
        raise ValueError(f"{op}: sinks must be contiguous, got strides {sinks.strides}")


def check_output(op: str, name: str, arr, shape, dtype) -> None:
    """A caller's output: exactly `shape` and `dtype`, a contiguous last axis, strides >= 0."""
    if arr is None:
        return
    if tuple(arr.shape) != tuple(shape) or np.dtype(arr.dtype) != np.dtype(dtype):
        raise ValueError(f"{op}: {name} must be {tuple(shape)} {np.dtype(dtype)}, got {tuple(arr.shape)} {arr.dtype}")
    check_unit_last_stride(op, name, arr)
    check_nonnegative_strides(op, name, arr)


def check_host_values(op: str, name: str, values: np.ndarray, low: int, high: int, what: str) -> None:
    """NumPy index arrays are read on the host before any upload: every entry in [low, high]."""
    bad = np.flatnonzero((values < low) | (values > high))
    if bad.size:
        row = int(bad[0])
        raise ValueError(f"{op}: {name}[{row}] = {int(values.flat[row])} is outside [{low}, {high}] ({what})")


def check_workspace_type(op: str, workspace) -> None:
    """A caller's workspace is a device array (its size is checked against the plan)."""
    if workspace is not None and not isinstance(workspace, DeviceArray):
        raise TypeError(f"{op}: workspace must be a device array (ptxattn.empty(({op}_workspace_bytes(...),), "
                        f"np.uint8)), got {type(workspace).__name__}")


def check_workspace_size(op: str, workspace, nbytes: int) -> None:
    """A caller's workspace holds `nbytes`, contiguous, from an ALIGNMENT-byte boundary."""
    if workspace is not None and (workspace.nbytes < nbytes or not workspace.is_contiguous
                                  or workspace.ptr % ALIGNMENT):
        raise ValueError(f"{op}: workspace must be a contiguous device array of at least {nbytes:,} bytes "
                         f"starting on a {ALIGNMENT}-byte boundary (see {op}_workspace_bytes), got "
                         f"{workspace.nbytes:,} bytes at 0x{workspace.ptr:x}")
