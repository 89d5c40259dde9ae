"""`python arch_override_probe.py [MAJOR.MINOR]`: on ptxattn.fake_driver (its device of that
compute capability, 9.0 by default), run sdpa, decode and paged_decode under whatever
PTXATTN_ARCH the environment holds, and print as JSON what the driver was asked to do: the
arch ptxattn chose and, for each kernel launched, the `.target` of the PTX its module was
loaded from, and which kernels were launched programmatically (to start while the launch before
them finishes); or the error the first op call raised. tests/test_arch_override.py runs it."""
from __future__ import annotations

import json
import re
import sys

import ptxattn.fake_driver as fake

fake.install(tuple(int(n) for n in (sys.argv[1] if len(sys.argv) > 1 else "9.0").split(".")))

import numpy as np  # noqa: E402  (after the fake, before anything touches the driver)

import ptxattn  # noqa: E402
from ptxattn.driver import cu  # noqa: E402

_module_target: dict[int, str] = {}  # module handle -> .target of the PTX it was loaded from
_module_entries: dict[int, list[str]] = {}  # module handle -> the .entry names in that PTX
_function: dict[int, tuple[str, str]] = {}  # function handle -> (kernel name, .target)
_launched: dict[str, str] = {}  # kernel name -> .target, for each kernel launched
_launched_entries: dict[str, list[str]] = {}  # kernel name -> the entries of its module
_programmatic: set[str] = set()  # kernels launched with programmatic stream serialization


def _record(name: str, after) -> None:
    """Wrap the fake's `name` so `after(args, result)` sees each call."""
    original = getattr(cu, name)

    def recording(*args):
        result = original(*args)
        after(args, result)
        return result

    setattr(cu, name, recording)


def _loaded(args, result) -> None:
    target = re.search(rb"^\.target\s+(\w+)", args[0], re.MULTILINE).group(1).decode()
    _module_target[int(result[1])] = target
    _module_entries[int(result[1])] = [name.decode() for name in re.findall(rb"\.entry\s+(\w+)", args[0])]


def _got_function(args, result) -> None:
    module, name = args
    _function[int(result[1])] = (name.decode(), _module_target[int(module)])
    _launched_entries[name.decode()] = _module_entries[int(module)]


def _launch(args, result) -> None:
    name, target = _function[int(args[0])]
    _launched[name] = target


def _launch_ex(args, result) -> None:
    config, function = args[:2]
    name, target = _function[int(function)]
    _launched[name] = target
    attributes = {int(a.id): a for a in config.attrs[:config.numAttrs]}
    pdl = attributes.get(int(cu.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION))
    if pdl is not None and pdl.value.programmaticStreamSerializationAllowed:
        _programmatic.add(name)


_record("cuModuleLoadDataEx", _loaded)
_record("cuModuleGetFunction", _got_function)
_record("cuLaunchKernel", _launch)
_record("cuLaunchKernelEx", _launch_ex)


def main() -> dict:
    bf16, e = ptxattn.bfloat16, ptxattn.empty
    device = ptxattn.get_device(0)
    # 16-byte aligned bf16, d128, no mask: the call an sm_90 device runs on the sm_90a wgmma kernel.
    q, k, v = e((1, 2, 300, 128), bf16), e((1, 2, 300, 128), bf16), e((1, 2, 300, 128), bf16)
    cache = e((2, 2, 512, 128), bf16)
    pool, table = e((40, 2, 16, 64), bf16), e((2, 16), np.int32)
    calls = [("sdpa", lambda: ptxattn.sdpa(q, k, v)),
             ("decode", lambda: ptxattn.decode(e((2, 8, 1, 128), bf16), cache, cache, e((2,), np.int32))),
             ("paged_decode", lambda: ptxattn.paged_decode(e((2, 8, 1, 64), bf16), pool, pool, table,
                                                           e((2,), np.int32)))]
    for op, call in calls:
        try:
            call()
        except Exception as exc:  # the probe reports any error; the test says which it expects
            return {"error": type(exc).__name__, "message": str(exc), "raised_by": op}
    return {"ptx_arch": ptxattn.ptx_arch(device), "launched": _launched, "programmatic": sorted(_programmatic),
            "module_entries": {name: _launched_entries[name] for name in _launched}}


if __name__ == "__main__":
    print(json.dumps(main()))
