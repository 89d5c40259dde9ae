"""The float64 softmax / log_softmax oracle (runtime/reference.py) against identities and
hand-worked values. CPU only."""
from __future__ import annotations

import numpy as np
import pytest

from ptxattn import bfloat16, reference

NEG_INF = -np.inf


def test_hand_worked_rows():
    x = np.array([[0.0, np.log(3.0)], [5.0, 5.0]])
    np.testing.assert_allclose(reference.softmax(x), [[0.25, 0.75], [0.5, 0.5]], rtol=1e-15)
    np.testing.assert_allclose(reference.log_softmax(x), np.log([[0.25, 0.75], [0.5, 0.5]]), rtol=1e-15)


@pytest.mark.parametrize("shape, axis", [((7,), 0), ((3, 5), -1), ((3, 5), 0), ((2, 3, 4, 5), 2), ((4, 1, 6), 1)])
def test_identities(rng, shape, axis):
    x = rng.standard_normal(shape) * 5
    p = reference.softmax(x, axis)
    assert p.dtype == np.float64 and p.shape == x.shape
    assert (p >= 0).all()
    np.testing.assert_allclose(p.sum(axis=axis), 1.0, rtol=1e-13)
    # Shift invariance, and the two ops agree with each other.
    shift = rng.standard_normal(np.sum(p, axis=axis, keepdims=True).shape) * 100
    np.testing.assert_allclose(reference.softmax(x + shift, axis), p, rtol=1e-12)
    np.testing.assert_allclose(np.exp(reference.log_softmax(x, axis)), p, rtol=1e-13)
    # Any axis is the last axis of a transposed tensor.
    moved = reference.log_softmax(np.moveaxis(x, axis, -1))
    np.testing.assert_allclose(np.moveaxis(moved, -1, axis), reference.log_softmax(x, axis), rtol=1e-15)


def test_large_logits_do_not_overflow():
    x = np.array([1000.0, 1001.0, 1002.0])
    np.testing.assert_allclose(reference.softmax(x), reference.softmax(x - 1000), rtol=1e-15)
    np.testing.assert_allclose(reference.log_softmax(x), reference.log_softmax(x - 1000), rtol=1e-15)


def test_special_rows():
    x = np.array([
        [0.0, NEG_INF, 1.0],          # -inf entries of an ordinary row: probability 0
        [NEG_INF, NEG_INF, NEG_INF],  # nothing to normalize: NaN (ONNX, PyTorch)
        [np.nan, 1.0, 2.0],           # NaN anywhere: the whole row is NaN
        [np.inf, 1.0, 2.0],           # +inf anywhere: the whole row is NaN
    ])
    p, lp = reference.softmax(x), reference.log_softmax(x)
    e = np.exp(1.0)
    np.testing.assert_allclose(p[0], [1 / (1 + e), 0.0, e / (1 + e)], rtol=1e-15)
    assert lp[0, 1] == NEG_INF and np.isfinite(lp[0, [0, 2]]).all()
    assert np.isnan(p[1:]).all() and np.isnan(lp[1:]).all()


@pytest.mark.parametrize("dtype", [np.float16, bfloat16, np.float32])
def test_low_precision_inputs_are_read_exactly(rng, dtype):
    x = rng.standard_normal((4, 9)).astype(dtype)
    np.testing.assert_array_equal(reference.softmax(x), reference.softmax(x.astype(np.float64)))
    assert reference.log_softmax(x).dtype == np.float64
