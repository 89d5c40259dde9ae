"""merge_states: combine attention computed over disjoint key sets by their LSE (kernels in
cu/merge.cu), for cascade / shared-prefix / context-parallel attention. The same kernel is
the fixed-order combine of the split-KV decode (runtime/ops/decode.py)."""
from __future__ import annotations

import ctypes

import numpy as np

from ..array import DeviceArray
from ..context import on_device
from ..dtypes import bfloat16
from ..module import ParamStruct, get_kernel
from ..stream import Stream
from ._io import gather
from .kv_cache import ATTENTION_DTYPES, check_attention_dtype, check_rank

__all__ = ["merge_states", "merge_states_n"]

THREADS = 128  # kThreads in cu/merge.cu: one CTA per (b, h, s) row


class MergeParams(ParamStruct):
    """Mirror of MergeParams in cu/merge.cu (same fields, same order)."""

    _fields_ = [
        ("o_in", ctypes.c_void_p), ("lse_in", ctypes.c_void_p), ("sinks", ctypes.c_void_p),
        ("o_out", ctypes.c_void_p), ("lse_out", ctypes.c_void_p),
        ("o_in_stride_state", ctypes.c_int64), ("o_in_stride_b", ctypes.c_int64),
        ("o_in_stride_h", ctypes.c_int64), ("o_in_stride_s", ctypes.c_int64),
        ("lse_in_stride_state", ctypes.c_int64), ("lse_in_stride_b", ctypes.c_int64),
        ("lse_in_stride_h", ctypes.c_int64), ("lse_in_stride_s", ctypes.c_int64),
        ("o_out_stride_b", ctypes.c_int64), ("o_out_stride_h", ctypes.c_int64), ("o_out_stride_s", ctypes.c_int64),
        ("lse_out_stride_b", ctypes.c_int64), ("lse_out_stride_h", ctypes.c_int64),
        ("lse_out_stride_s", ctypes.c_int64),
        ("batch", ctypes.c_int32), ("heads", ctypes.c_int32), ("seq", ctypes.c_int32), ("dim", ctypes.c_int32),
        ("num_states", ctypes.c_int32),
    ]


def launch_merge(device, stream: Stream, *, in_dtype, out_dtype, o_in: int, o_in_strides, lse_in: int,
                 lse_in_strides, sinks: int | None, o_out: DeviceArray, lse_out: DeviceArray | None,
                 num_states: int) -> None:
    """Merge `num_states` states into o_out [B, H, S, D] (and lse_out [B, H, S]). Strides are
    in elements, (state, b, h, s); the last axis of o_in and o_out is contiguous."""
    batch, heads, seq, dim = o_out.shape
    lse_strides = lse_out.element_strides if lse_out is not None else (0, 0, 0)
    params = MergeParams(
        o_in, lse_in, sinks, o_out.ptr, lse_out.ptr if lse_out is not None else None,
        *o_in_strides, *lse_in_strides, *o_out.element_strides[:3], *lse_strides,
        batch, heads, seq, dim, num_states,
    )
    rows = batch * heads * seq
    if rows == 0:
        return
    name = f"merge_{ATTENTION_DTYPES[np.dtype(in_dtype)]}_{ATTENTION_DTYPES[np.dtype(out_dtype)]}"
    with on_device(device):
        get_kernel(name, device).launch((rows, 1, 1), (THREADS, 1, 1), params, stream)


def _check_contiguous_last(op: str, name: str, arr) -> None:
    if isinstance(arr, DeviceArray) and arr.shape[-1] > 1 and arr.strides[-1] != arr.itemsize:
        raise ValueError(f"{op}: {name} must have a contiguous last axis, got strides {arr.strides}")


def check_sinks(op: str, sinks, heads: int) -> None:
    if sinks is None:
        return
    if tuple(sinks.shape) != (heads,):
        raise ValueError(f"{op}: sinks must have shape ({heads},) (one logit per head), got {tuple(sinks.shape)}")
    if isinstance(sinks, DeviceArray):
        if sinks.dtype != np.float32:
            raise TypeError(f"{op}: device sinks must be float32, got {sinks.dtype}")
        if heads > 1 and sinks.strides[0] != 4:
            raise ValueError(f"{op}: sinks must be contiguous, got strides {sinks.strides}")
    elif np.dtype(sinks.dtype).kind != "f" and np.dtype(sinks.dtype) != bfloat16:
        raise TypeError(f"{op}: sinks must be floating point, got {sinks.dtype}")


def sinks_on_device(call, sinks_name: str = "sinks") -> int | None:
    """Device address of the call's float32 sinks (host sinks are converted), or None."""
    sinks = call.arrays.get(sinks_name)
    if sinks is None:
        return None
    if not isinstance(sinks, DeviceArray):
        call.arrays[sinks_name] = np.ascontiguousarray(sinks, dtype=np.float32)
    return call.to_device(sinks_name).ptr


def _run(op: str, call, num_states: int, shape, o_dtype, o_in_strides, lse_in_strides, o_in: int, lse_in: int,
         out, out_lse):
    o_out = call.output(shape, o_dtype, out, name="out")
    lse_out = call.output(shape[:3], np.float32, out_lse, name="out_lse")
    _check_contiguous_last(op, "out", o_out)
    launch_merge(call.device, call.stream, in_dtype=o_dtype, out_dtype=o_dtype, o_in=o_in,
                 o_in_strides=o_in_strides, lse_in=lse_in, lse_in_strides=lse_in_strides,
                 sinks=sinks_on_device(call), o_out=o_out, lse_out=lse_out, num_states=num_states)
    return call.finish(o_out, out), call.finish(lse_out, out_lse)


def merge_states_n(o, lse, *, sinks=None, out=None, out_lse=None, stream=None):
    """Merge N attention states stacked on the first axis: o [N, B, H, S, D] (float16,
    bfloat16 or float32, each normalised by its own softmax sum), lse [N, B, H, S] float32
    (natural log, -inf for a state with no key). Returns (o [B, H, S, D] in o's dtype,
    lse [B, H, S] float32): lse = log sum exp(lse_i), o = sum exp(lse_i - lse) o_i, summed in
    a fixed order; sinks [H] join the denominator only. A state of zero weight is skipped,
    never multiplied (NaN in it cannot leak)."""
    op = "merge_states_n"
    call = gather(op, stream, o=o, lse=lse, sinks=sinks, out=out, out_lse=out_lse)
    o_arr, lse_arr = call.arrays["o"], call.arrays["lse"]
    check_rank(op, "o", o_arr, 5, "[N, B, H, S, D]")
    check_attention_dtype(op, "o", o_arr)
    if tuple(lse_arr.shape) != tuple(o_arr.shape[:4]) or lse_arr.dtype != np.float32:
        raise ValueError(f"{op}: lse must be float32 of shape {tuple(o_arr.shape[:4])} (o's [N, B, H, S]), "
                         f"got {lse_arr.dtype} {tuple(lse_arr.shape)}")
    if o_arr.shape[0] == 0:
        raise ValueError(f"{op}: need at least one state, got N=0")
    _check_contiguous_last(op, "o", o_arr)
    check_sinks(op, call.arrays.get("sinks"), o_arr.shape[2])
    o_dev, lse_dev = call.to_device("o"), call.to_device("lse")
    return _run(op, call, o_arr.shape[0], o_arr.shape[1:], o_arr.dtype, o_dev.element_strides[:4],
                lse_dev.element_strides, o_dev.ptr, lse_dev.ptr, out, out_lse)


def merge_states(o_a, lse_a, o_b, lse_b, *, sinks=None, out=None, out_lse=None, stream=None):
    """Merge two attention states over disjoint key sets: o_* [B, H, S, D], lse_* [B, H, S]
    float32; see merge_states_n. Returns (o, lse)."""
    op = "merge_states"
    call = gather(op, stream, o_a=o_a, lse_a=lse_a, o_b=o_b, lse_b=lse_b, sinks=sinks, out=out, out_lse=out_lse)
    a = call.arrays
    check_rank(op, "o_a", a["o_a"], 4, "[B, H, S, D]")
    check_attention_dtype(op, "o_a", a["o_a"])
    if tuple(a["o_b"].shape) != tuple(a["o_a"].shape) or a["o_b"].dtype != a["o_a"].dtype:
        raise ValueError(f"{op}: o_b must match o_a ({a['o_a'].dtype} {tuple(a['o_a'].shape)}), "
                         f"got {a['o_b'].dtype} {tuple(a['o_b'].shape)}")
    for name in ("lse_a", "lse_b"):
        if tuple(a[name].shape) != tuple(a["o_a"].shape[:3]) or a[name].dtype != np.float32:
            raise ValueError(f"{op}: {name} must be float32 of shape {tuple(a['o_a'].shape[:3])}, "
                             f"got {a[name].dtype} {tuple(a[name].shape)}")
    for name in ("o_a", "o_b"):
        _check_contiguous_last(op, name, a[name])
    check_sinks(op, a.get("sinks"), a["o_a"].shape[1])
    # The kernel walks states with one stride: state b sits (b.ptr - a.ptr) elements after a.
    dev = {name: call.to_device(name) for name in ("o_a", "lse_a", "o_b", "lse_b")}
    strides = {}
    for first, second in (("o_a", "o_b"), ("lse_a", "lse_b")):
        x, y = dev[first], dev[second]
        gap = y.ptr - x.ptr
        if x.strides != y.strides or gap % x.itemsize:
            raise ValueError(f"{op}: {first} and {second} must have the same strides (got {x.strides} and "
                             f"{y.strides}) and element-aligned addresses")
        strides[first] = (gap // x.itemsize, *x.element_strides[:3])
    return _run(op, call, 2, a["o_a"].shape, a["o_a"].dtype, strides["o_a"], strides["lse_a"],
                dev["o_a"].ptr, dev["lse_a"].ptr, out, out_lse)
