"""The ONNX project's own node tests, collected from the installed `onnx` package.

onnx's collect_testcases builds its cases while importing its case modules, once per
process, keeping only the op type asked for first: a second call (from another test module)
returns the first call's list. So the cases are built once, in a child process, for every op
type the suite uses.
"""
from __future__ import annotations

import functools
import pickle
import subprocess
import sys

import pytest

OP_TYPES = ("Softmax", "LogSoftmax", "Attention")

_COLLECT = f"""
import pickle, sys, warnings
warnings.simplefilter("ignore")
from onnx import helper
from onnx.backend.test.case.node import collect_testcases
cases = []
for case in collect_testcases(None):
    nodes = case.model.graph.node
    if len(nodes) != 1 or nodes[0].op_type not in {OP_TYPES!r}:
        continue  # the *_expanded variants are graphs of primitive ops
    node = nodes[0]
    attrs = {{a.name: helper.get_attribute_value(a) for a in node.attribute}}
    opset = max(o.version for o in case.model.opset_import if o.domain in ("", "ai.onnx"))
    for inputs, outputs in case.data_sets:
        named_in = {{}}
        feeds = iter(inputs)
        for n in node.input:
            if n:
                named_in[n] = next(feeds)
        cases.append((case.name, node.op_type, opset, attrs, named_in, list(node.output), list(outputs),
                      case.rtol, case.atol))
sys.stdout.buffer.write(pickle.dumps(cases))
"""


@functools.lru_cache(maxsize=None)
def _all_cases() -> list:
    pytest.importorskip("onnx")
    done = subprocess.run([sys.executable, "-c", _COLLECT], capture_output=True, check=True)
    return pickle.loads(done.stdout)


def node_cases(op_type: str) -> list:
    """(name, op_type, opset, attributes, named inputs, output names, outputs, rtol, atol)."""
    cases = [c for c in _all_cases() if c[1] == op_type]
    assert cases, f"onnx produced no {op_type} node test"
    return cases
