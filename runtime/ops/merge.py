"""merge_states: combine attention computed over disjoint key sets by their LSE (kernels in
cu/merge.cu), for cascade / shared-prefix / context-parallel attention. The same kernel is
the fixed-order combine of the split-KV decode (runtime/ops/decode.py)."""
from __future__ import annotations

import ctypes
from dataclasses import dataclass

import numpy as np

from .. import kernel_names
from ..array import DeviceArray
from ..module import ParamStruct
from .checks import (ATTENTION_DTYPES, check_attention_dtype, check_output, check_rank, check_sinks,
                     check_unit_last_stride, require)
from .prepared import Op

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


def bind_merge(binding, *, in_dtype, out_dtype, o_in_strides, lse_in_strides, shape, o_out_strides,
               lse_out_strides, num_states: int, programmatic: bool = False):
    """The merge launch of `num_states` states into o_out `shape` [B, H, S, D] (and lse_out
    [B, H, S]); strides in elements, (state, b, h, s) for the inputs, the last axis of o_in and
    o_out contiguous. Pointer fields are left for the caller to `point`; None when no row.
    programmatic: the binding's previous launch writes the states; this one may start while
    it finishes (Launch.programmatic: the kernel waits for it before reading)."""
    batch, heads, seq, dim = shape
    rows = batch * heads * seq
    if rows == 0:
        return None
    params = MergeParams(
        None, None, None, None, None, *o_in_strides, *lse_in_strides, *o_out_strides, *lse_out_strides,
        batch, heads, seq, dim, num_states,
    )
    name = kernel_names.merge(ATTENTION_DTYPES[np.dtype(in_dtype)], ATTENTION_DTYPES[np.dtype(out_dtype)])
    return binding.launch(name, (rows, 1, 1), (THREADS, 1, 1), params, programmatic=programmatic)


def _bind_states(binding, a: dict, c: "_Checked", first: tuple[str, str]) -> None:
    """Both ops: make the outputs, launch, and point o_in / lse_in at the first state (the
    others follow at the state stride) and the outputs."""
    shape = c.shape
    binding.make("out", shape, c.dtype)
    binding.make("out_lse", shape[:3], np.float32)
    binding.result("out", "out_lse", as_tuple=True)
    out, out_lse = a["out"], a["out_lse"]
    o_out_strides = out.element_strides[:3] if out is not None else (shape[1] * shape[2] * shape[3],
                                                                       shape[2] * shape[3], shape[3])
    lse_out_strides = out_lse.element_strides if out_lse is not None else (shape[1] * shape[2], shape[2], 1)
    launch = bind_merge(binding, in_dtype=c.dtype, out_dtype=c.dtype, o_in_strides=c.o_in_strides,
                        lse_in_strides=c.lse_in_strides, shape=shape, o_out_strides=o_out_strides,
                        lse_out_strides=lse_out_strides, num_states=c.num_states)
    if launch is None:
        return
    for name, field in ((first[0], "o_in"), (first[1], "lse_in"), ("out", "o_out"), ("out_lse", "lse_out")):
        binding.point(name, launch, field)
    if a["sinks"] is not None:
        binding.point("sinks", launch, "sinks")


@dataclass(frozen=True)
class _Checked:
    shape: tuple          # [B, H, S, D] of the merged output
    dtype: np.dtype
    num_states: int
    o_in_strides: tuple   # (state, b, h, s) in elements
    lse_in_strides: tuple


def _check_outputs(op: str, a: dict, shape, dtype) -> None:
    check_output(op, "out", a["out"], shape, dtype)
    check_output(op, "out_lse", a["out_lse"], shape[:3], np.float32)
    check_sinks(op, a["sinks"], shape[1])


def _validate_n(a: dict, on_host: bool = False) -> _Checked:
    op = "merge_states_n"
    o, lse = a["o"], a["lse"]
    require(op, "o", o)
    require(op, "lse", lse)
    check_rank(op, "o", o, 5, "[N, B, H, S, D]")
    check_attention_dtype(op, "o", o)
    if tuple(lse.shape) != tuple(o.shape[:4]) or lse.dtype != np.float32:
        raise ValueError(f"{op}: lse must be float32 of shape {tuple(o.shape[:4])} (o's [N, B, H, S]), "
                         f"got {lse.dtype} {tuple(lse.shape)}")
    if o.shape[0] == 0:
        raise ValueError(f"{op}: need at least one state, got N=0")
    check_unit_last_stride(op, "o", o)
    _check_outputs(op, a, o.shape[1:], o.dtype)
    o_strides = o.element_strides[:4] if isinstance(o, DeviceArray) else tuple(s // o.itemsize for s in o.strides[:4])
    lse_strides = lse.element_strides if isinstance(lse, DeviceArray) else tuple(s // 4 for s in lse.strides)
    return _Checked(tuple(o.shape[1:]), np.dtype(o.dtype), o.shape[0], o_strides, lse_strides)


def _state_gaps(arrays: list) -> tuple:
    """merge_states reads state b at a fixed distance from state a: the distances are part of
    the plan (and of the cache key)."""
    o_a, lse_a, o_b, lse_b = arrays[:4]
    if None in (o_a, lse_a, o_b, lse_b):
        return None
    return o_b.ptr - o_a.ptr, lse_b.ptr - lse_a.ptr


def _validate_two(a: dict, on_host: bool = False) -> _Checked:
    op = "merge_states"
    for name in ("o_a", "lse_a", "o_b", "lse_b"):
        require(op, name, a[name])
    o_a = a["o_a"]
    check_rank(op, "o_a", o_a, 4, "[B, H, S, D]")
    check_attention_dtype(op, "o_a", o_a)
    if tuple(a["o_b"].shape) != tuple(o_a.shape) or a["o_b"].dtype != o_a.dtype:
        raise ValueError(f"{op}: o_b must match o_a ({o_a.dtype} {tuple(o_a.shape)}), "
                         f"got {a['o_b'].dtype} {tuple(a['o_b'].shape)}")
    for name in ("lse_a", "lse_b"):
        if tuple(a[name].shape) != tuple(o_a.shape[:3]) or a[name].dtype != np.float32:
            raise ValueError(f"{op}: {name} must be float32 of shape {tuple(o_a.shape[:3])}, "
                             f"got {a[name].dtype} {tuple(a[name].shape)}")
    for name in ("o_a", "o_b"):
        check_unit_last_stride(op, name, a[name])
    _check_outputs(op, a, o_a.shape, o_a.dtype)
    if on_host:
        return _Checked(tuple(o_a.shape), np.dtype(o_a.dtype), 2, (), ())
    strides = {}
    for first, second in (("o_a", "o_b"), ("lse_a", "lse_b")):
        x, y = a[first], a[second]
        gap = y.ptr - x.ptr
        if x.strides != y.strides or gap % x.itemsize:
            raise ValueError(f"{op}: {first} and {second} must have the same strides (got {x.strides} and "
                             f"{y.strides}) and element-aligned addresses")
        strides[first] = (gap // x.itemsize, *x.element_strides[:3])
    return _Checked(tuple(o_a.shape), np.dtype(o_a.dtype), 2, strides["o_a"], strides["lse_a"])


_MERGE_N = Op("merge_states_n", ("o", "lse", "sinks", "out", "out_lse"), (), outputs=("out", "out_lse"),
              validate=_validate_n, bind=lambda binding, a, c: _bind_states(binding, a, c, ("o", "lse")))
_MERGE_TWO = Op("merge_states", ("o_a", "lse_a", "o_b", "lse_b", "sinks", "out", "out_lse"), (),
                outputs=("out", "out_lse"), validate=_validate_two, extra_key=_state_gaps,
                bind=lambda binding, a, c: _bind_states(binding, a, c, ("o_a", "lse_a")))


def merge_states_n(o, lse, *, sinks=None, out=None, out_lse=None, stream=None):
    """Merge N attention states stacked on the first axis: o [N, B, H, S, D] (float16,
    bfloat16 or float32, each normalised by its own softmax sum), lse [N, B, H, S] float32
    (natural log, -inf for a state with no key). Returns (o [B, H, S, D] in o's dtype,
    lse [B, H, S] float32): lse = log sum exp(lse_i), o = sum exp(lse_i - lse) o_i, summed in
    a fixed order; sinks float32 [H] join the denominator only. A state of zero weight is
    skipped, never multiplied (NaN in it cannot leak)."""
    return _MERGE_N((o, lse, sinks, out, out_lse), (), stream)


def merge_states(o_a, lse_a, o_b, lse_b, *, sinks=None, out=None, out_lse=None, stream=None):
    """Merge two attention states over disjoint key sets: o_* [B, H, S, D], lse_* [B, H, S]
    float32; see merge_states_n. Returns (o, lse). Device states are read as one state and
    another at a fixed distance: o_b and lse_b must have o_a's and lse_a's strides."""
    return _MERGE_TWO((o_a, lse_a, o_b, lse_b, sinks, out, out_lse), (), stream)


merge_states_n.op, merge_states.op = _MERGE_N, _MERGE_TWO
