"""The ONNX project's own node tests for Softmax and LogSoftmax (built in memory by the
installed `onnx`), run against the float64 reference (CPU) and the GPU kernels."""
from __future__ import annotations

import functools
import pickle
import subprocess
import sys

import numpy as np
import pytest

import ptxattn
from ptxattn import reference

OPS = {"Softmax": (reference.softmax, ptxattn.softmax),
       "LogSoftmax": (reference.log_softmax, ptxattn.log_softmax)}

# onnx's collect_testcases builds its cases while importing its case modules, once per
# process, keeping only the op type asked for first: a second call (ours, or another test
# module's) returns the first call's list. A child process gives a clean collection.
_COLLECT = """
import pickle, sys, warnings
warnings.simplefilter("ignore")
from onnx.backend.test.case.node import collect_testcases
cases = []
for case in collect_testcases(None):
    nodes = case.model.graph.node
    if len(nodes) != 1 or nodes[0].op_type not in ("Softmax", "LogSoftmax"):
        continue  # the *_expanded variants are graphs of primitive ops
    node = nodes[0]
    attrs = {a.name: a.i for a in node.attribute}
    opset = max(o.version for o in case.model.opset_import if o.domain in ("", "ai.onnx"))
    for inputs, outputs in case.data_sets:
        cases.append((case.name, node.op_type, opset, attrs.get("axis", -1),
                      inputs[0], outputs[0], case.rtol, case.atol))
sys.stdout.buffer.write(pickle.dumps(cases))
"""


@functools.lru_cache(maxsize=None)
def _node_cases() -> list:
    pytest.importorskip("onnx")
    done = subprocess.run([sys.executable, "-c", _COLLECT], capture_output=True, check=True)
    return pickle.loads(done.stdout)


def _cases(op_type: str) -> list:
    cases = [c for c in _node_cases() if c[1] == op_type]
    assert cases, f"onnx produced no {op_type} node test"
    # Opset 13 made the axis a plain axis; older opsets flatten to 2-D first (not our semantics).
    assert all(c[2] >= 13 for c in cases), "an ONNX node test of opset < 13 needs other semantics"
    return cases


@pytest.mark.parametrize("op_type", OPS)
def test_reference_passes_onnx_node_tests(op_type):
    ref_op = OPS[op_type][0]
    for name, _, _, axis, x, expected, rtol, atol in _cases(op_type):
        got = ref_op(x, axis).astype(expected.dtype)
        np.testing.assert_allclose(got, expected, rtol=rtol, atol=atol, err_msg=f"{op_type} {name}")


@pytest.mark.gpu
@pytest.mark.parametrize("op_type", OPS)
@pytest.mark.parametrize("on_device", [False, True], ids=["numpy", "device"])
def test_kernel_passes_onnx_node_tests(op_type, on_device):
    gpu_op = OPS[op_type][1]
    for name, _, _, axis, x, expected, rtol, atol in _cases(op_type):
        if on_device:
            got = gpu_op(ptxattn.asarray(x), axis).get()
        else:
            got = gpu_op(x, axis)
        assert got.dtype == expected.dtype and got.shape == expected.shape, name
        np.testing.assert_allclose(got, expected, rtol=rtol, atol=atol, err_msg=f"{op_type} {name}")
