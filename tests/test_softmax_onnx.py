"""The ONNX project's own node tests for Softmax and LogSoftmax (built in memory by the
installed `onnx`), run against the float64 reference (CPU) and the GPU kernels."""
from __future__ import annotations

import numpy as np
import pytest

import ptxattn
from ptxattn import reference

from onnx_cases import node_cases

OPS = {"Softmax": (reference.softmax, ptxattn.softmax),
       "LogSoftmax": (reference.log_softmax, ptxattn.log_softmax)}


def _cases(op_type: str) -> list:
    """(name, axis, x, expected, rtol, atol) for each node test of `op_type`."""
    cases = node_cases(op_type)
    # Opset 13 made the axis a plain axis; older opsets flatten to 2-D first (not our semantics).
    assert all(c[2] >= 13 for c in cases), "an ONNX node test of opset < 13 needs other semantics"
    return [(name, attrs.get("axis", -1), inputs[next(iter(inputs))], outputs[0], rtol, atol)
            for name, _, _, attrs, inputs, _, outputs, rtol, atol in cases]


@pytest.mark.parametrize("op_type", OPS)
def test_reference_passes_onnx_node_tests(op_type):
    ref_op = OPS[op_type][0]
    for name, axis, x, expected, rtol, atol in _cases(op_type):
        got = ref_op(x, axis).astype(expected.dtype)
        np.testing.assert_allclose(got, expected, rtol=rtol, atol=atol, err_msg=f"{op_type} {name}")


@pytest.mark.gpu
@pytest.mark.parametrize("op_type", OPS)
@pytest.mark.parametrize("on_device", [False, True], ids=["numpy", "device"])
def test_kernel_passes_onnx_node_tests(op_type, on_device):
    gpu_op = OPS[op_type][1]
    for name, axis, x, expected, rtol, atol in _cases(op_type):
        if on_device:
            got = gpu_op(ptxattn.asarray(x), axis).get()
        else:
            got = gpu_op(x, axis)
        assert got.dtype == expected.dtype and got.shape == expected.shape, name
        np.testing.assert_allclose(got, expected, rtol=rtol, atol=atol, err_msg=f"{op_type} {name}")
