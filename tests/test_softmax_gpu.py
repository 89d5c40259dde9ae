"""softmax / log_softmax kernels on the GPU against the float64 reference: every kernel path
(short rows in registers, long rows in registers, looped long rows, columns; 16-byte vectors
and scalar accesses; grid-stride loops), NaN-poisoned outputs framed by canaries."""
from __future__ import annotations

import numpy as np
import pytest

import ptxattn
from ptxattn import DeviceArray, reference
from ptxattn.ops import softmax as sm

from gpu_util import REL_TOL, GuardedOutput, relative_error

pytestmark = pytest.mark.gpu

DTYPES = [np.dtype(np.float16), ptxattn.bfloat16, np.dtype(np.float32)]
OPS = {"softmax": (ptxattn.softmax, reference.softmax),
       "log_softmax": (ptxattn.log_softmax, reference.log_softmax)}

# Elementwise |out - ref| <= RTOL * |ref| + ATOL: the output dtype's rounding plus fp32
# arithmetic; ATOL covers float16's subnormal spacing (softmax) and log values near 0.
RTOL = {np.dtype(np.float32): 1e-5, np.dtype(np.float16): 1e-3, ptxattn.bfloat16: 8e-3}
ATOL = {"softmax": {np.dtype(np.float32): 1e-9, np.dtype(np.float16): 6e-8, ptxattn.bfloat16: 1e-9},
        "log_softmax": {np.dtype(np.float32): 1e-6, np.dtype(np.float16): 1e-5, ptxattn.bfloat16: 1e-4}}

# (shape, axis): which kernel each one exercises is in the comment.
CASES = [
    ((5, 1), -1),            # rows_warp, L = 1
    ((3, 7), 1),             # rows_warp, odd length: scalar accesses
    ((64, 64), -1),          # rows_warp, 2 lanes a row, vectors
    ((9, 97), -1),           # rows_warp, 4 lanes a row, rows of every alignment
    ((4, 3, 1000), 2),       # rows_warp, a warp a row
    ((2, 1024), -1),         # rows_warp, the longest register row
    ((3, 1025), -1),         # rows_block in registers, scalar
    ((2, 4096), -1),         # rows_block in registers, vectors
    ((2, 16384), -1),        # rows_block, the longest register row
    ((2, 16385), -1),        # rows_block, looped, scalar
    ((3, 100000), -1),       # rows_block, looped, vectors
    ((100003,), 0),          # rows_block, looped, one row, scalar
    ((3, 4, 5), 0),          # cols
    ((3, 4, 5), 1),          # cols
    ((2, 50000, 3), 1),      # cols, a long length split over threadIdx.y
    ((8, 33, 300), 1),       # cols, many columns
    ((2, 3, 1, 2), 2),       # cols, L = 1
]


def _input(rng, shape, dtype) -> np.ndarray:
    return (rng.standard_normal(shape) * 3).astype(np.float32).astype(dtype)


def _check(op_name, x, got, axis):
    """Compare against the reference computed from the exact (quantized) input."""
    dtype = np.dtype(x.dtype)
    ref = OPS[op_name][1](x, axis)
    got64 = np.asarray(got).astype(np.float64)
    assert got.dtype == dtype and got.shape == x.shape
    assert relative_error(got64, ref) <= REL_TOL[dtype]
    bound = RTOL[dtype] * np.abs(ref) + ATOL[op_name][dtype]
    worst = np.argmax(np.abs(got64 - ref) - bound)
    assert np.abs(got64 - ref).flat[worst] <= bound.flat[worst], (
        f"{op_name} {dtype}: element {np.unravel_index(worst, x.shape)} is {got64.flat[worst]!r}, "
        f"reference {ref.flat[worst]!r}")


@pytest.mark.parametrize("op_name", OPS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape, axis", CASES, ids=lambda c: str(c).replace(" ", ""))
def test_matches_reference(rng, op_name, dtype, shape, axis):
    x = _input(rng, shape, dtype)
    out = GuardedOutput(shape, dtype, rng)
    result = OPS[op_name][0](ptxattn.asarray(x), axis, out=out.array)
    assert result is out.array
    _check(op_name, x, out.check(), axis)


@pytest.mark.parametrize("op_name", OPS)
def test_numpy_in_numpy_out(rng, op_name):
    x = _input(rng, (6, 300), np.float32)
    _check(op_name, x, OPS[op_name][0](x, 0), 0)
    out = np.full(x.shape, np.nan, np.float32)
    assert OPS[op_name][0](x, out=out) is out
    _check(op_name, x, out, -1)


@pytest.mark.parametrize("op_name", OPS)
@pytest.mark.parametrize("shape, axis, kernel", [
    ((sm.GRID_CAP * sm.WARP_CTA_THREADS + 5, 3), -1, "rows_warp"),
    ((sm.GRID_CAP + 3, 1100), -1, "rows_block"),
    ((1025, 2, 1024), 1, "cols"),
])
def test_grid_stride_loops(rng, op_name, shape, axis, kernel):
    axis_n = axis % len(shape)
    outer, inner = int(np.prod(shape[:axis_n])), int(np.prod(shape[axis_n + 1:]))
    plan = sm.plan(outer, shape[axis_n], inner)
    assert plan.kernel == kernel and plan.grid[0] == sm.GRID_CAP, "the shape must need more CTAs than a launch has"
    x = _input(rng, shape, np.float16)
    out = GuardedOutput(shape, np.float16, rng)
    OPS[op_name][0](ptxattn.asarray(x), axis, out=out.array)
    _check(op_name, x, out.check(), axis)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(4, 64), (3, 4096), (2, 20000)])
def test_misaligned_rows_use_scalar_accesses(rng, dtype, shape):
    """Lengths that allow 16-byte vectors, but the arrays start one element off."""
    x = _input(rng, shape, dtype)
    padded = ptxattn.asarray(np.concatenate([x.ravel()[:1], x.ravel()]))
    x_view = DeviceArray(padded.ptr + dtype.itemsize, shape, dtype, None, padded.device, padded)
    out = GuardedOutput((x.size + 1,), dtype, rng)
    y_view = DeviceArray(out.array.ptr + dtype.itemsize, shape, dtype, None, out.array.device, out.array)
    ptxattn.softmax(x_view, out=y_view)
    whole = out.check(nan_allowed=True)  # element 0, before the view, must keep its NaN
    assert np.isnan(whole[0].astype(np.float32)), "the element before the view was written"
    _check("softmax", x, whole[1:].reshape(shape), -1)


@pytest.mark.parametrize("op_name", OPS)
@pytest.mark.parametrize("shape, axis", [((6, 40), -1), ((6, 3000), -1), ((6, 20000), -1), ((40, 6), 0)])
def test_special_rows_follow_the_reference(rng, op_name, shape, axis):
    """-inf entries, all -inf rows, NaN and +inf: same NaN pattern as the reference."""
    x = np.moveaxis(_input(rng, shape, np.float32), axis, -1).copy()
    x[0, ::3] = -np.inf     # an ordinary row with masked entries
    x[1, :] = -np.inf       # nothing left: NaN
    x[2, 5] = np.nan
    x[3, 7] = np.inf
    x[4, :-1] = -np.inf     # a single live entry, the last
    x = np.moveaxis(x, -1, axis).copy()
    # NaN is a right answer here, so poison with a value neither op can produce.
    out = ptxattn.asarray(np.full(shape, 12345.0, np.float32))
    got = OPS[op_name][0](ptxattn.asarray(x), axis, out=out).get()
    assert not (got == 12345.0).any(), "an output element was not written"
    ref = OPS[op_name][1](x, axis)
    np.testing.assert_array_equal(np.isnan(got), np.isnan(ref))
    f32 = np.dtype(np.float32)
    np.testing.assert_allclose(got[~np.isnan(ref)], ref[~np.isnan(ref)], rtol=RTOL[f32], atol=ATOL[op_name][f32])


@pytest.mark.parametrize("shape, axis", [((7, 500), -1), ((3, 30000), -1), ((5, 600, 9), 1)])
def test_bitwise_deterministic(rng, shape, axis):
    x = ptxattn.asarray(_input(rng, shape, np.float32))
    first = ptxattn.log_softmax(x, axis).get()
    again = ptxattn.log_softmax(x, axis).get()
    assert first.tobytes() == again.tobytes()


@pytest.mark.parametrize("shape, axis", [((4, 700), -1), ((2, 20000), -1), ((4, 70, 3), 1)])
def test_in_place(rng, shape, axis):
    x = _input(rng, shape, ptxattn.bfloat16)
    buf = ptxattn.asarray(x)
    assert ptxattn.softmax(buf, axis, out=buf) is buf
    _check("softmax", x, buf.get(), axis)


def test_on_a_stream_we_are_handed(rng, dev_stream):
    x = _input(rng, (16, 2048), np.float16)
    y = ptxattn.softmax(ptxattn.asarray(x, stream=dev_stream), stream=dev_stream)
    assert y.stream == dev_stream
    dev_stream.synchronize()
    _check("softmax", x, y.get(dev_stream), -1)


@pytest.fixture
def dev_stream():
    dev = ptxattn.get_device(0)
    with ptxattn.on_device(dev):
        stream = ptxattn.Stream.create()
    yield stream
    stream.close()


@pytest.mark.parametrize("shape, axis", [((0, 5), -1), ((3, 0), -1), ((3, 0, 2), 0), ((0,), 0)])
def test_empty(shape, axis):
    x = np.ones(shape, np.float32)
    got = ptxattn.log_softmax(x, axis)
    assert isinstance(got, np.ndarray) and got.shape == shape and got.dtype == np.float32
    dev = ptxattn.softmax(ptxattn.asarray(x), axis)
    assert isinstance(dev, DeviceArray) and dev.shape == shape
