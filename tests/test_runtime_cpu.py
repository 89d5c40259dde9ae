"""Runtime logic that needs no GPU: arch selection, workspace planning, dtypes, streams,
the DLPack capsule layout, and the clean 'no GPU' message."""
from __future__ import annotations

import ctypes
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import ptxattn
from ptxattn import dlpack
from ptxattn.array import DeviceArray
from ptxattn.device import Device
from ptxattn.dtypes import normalize
from ptxattn.memory import ALIGNMENT, WorkspaceLayout, align_up
from ptxattn.module import arch_for, manifest

from conftest import gpu_unavailable_reason

ARCHS = ["sm_80", "sm_86", "sm_89", "sm_90", "sm_90a"]


@pytest.mark.parametrize("cc, expected", [
    ((8, 0), "sm_80"), ((8, 6), "sm_86"), ((8, 7), "sm_86"), ((8, 9), "sm_89"),
    ((9, 0), "sm_90a"), ((10, 0), "sm_90"), ((12, 0), "sm_90"), ((7, 5), None),
])
def test_arch_for_picks_highest_not_above(cc, expected):
    assert arch_for(cc, ARCHS) == expected


def test_arch_for_without_arch_specific_build():
    assert arch_for((9, 0), ["sm_80", "sm_90"]) == "sm_90"


def test_manifest_lists_every_ptx_and_kernel():
    m = manifest()
    assert m["families"], "manifest lists no family"
    from importlib import resources
    root = resources.files("ptxattn.ptx")
    for family, info in m["families"].items():
        for arch in info["archs"]:
            text = (root / arch / f"{family}.ptx").read_text()
            for kernel in info["kernels"]:
                assert f".entry {kernel}(" in text, (family, arch, kernel)


def test_no_shipped_ptx_repeats_the_arch_below():
    """Each family ships an arch's PTX only where its code differs from the arch below's (a
    device loads the highest arch not above its own, so a copy that differs only in its
    .target line adds bytes and nothing else)."""
    import re
    from importlib import resources
    root = resources.files("ptxattn.ptx")
    for family, info in manifest()["families"].items():
        bodies = [re.sub(r"^\.target [^\n]*\n", "", (root / arch / f"{family}.ptx").read_text(), count=1,
                         flags=re.M) for arch in info["archs"]]
        for (lower, higher), (a, b) in zip(zip(info["archs"], info["archs"][1:]), zip(bodies, bodies[1:])):
            assert a != b, f"{family}: the {higher} PTX is the {lower} PTX but for its .target line"


def test_workspace_layout_aligns_every_region():
    layout = WorkspaceLayout(partials=1000, lse=4, flags=0, more=256)
    assert layout.offsets == {"partials": 0, "lse": 1024, "flags": 1280, "more": 1280}
    assert all(off % ALIGNMENT == 0 for off in layout.offsets.values())
    assert layout.nbytes == 1536
    assert layout.address(1 << 20, "lse") == (1 << 20) + 1024
    assert align_up(0) == 0 and align_up(1) == 256 and align_up(256) == 256


def test_workspace_layout_rejects_negative_region():
    with pytest.raises(ValueError, match="region 'x'"):
        WorkspaceLayout(x=-1)


@pytest.mark.parametrize("name", ["float16", "bfloat16", "float32", "int32", "int64", "bool", "uint8"])
def test_supported_dtypes(name):
    assert normalize(name).itemsize in (1, 2, 4, 8)


@pytest.mark.parametrize("bad", ["float64", "int8", "complex64"])
def test_unsupported_dtype_is_named(bad):
    with pytest.raises(TypeError, match=f"got {bad}"):
        normalize(bad)


def test_as_stream_accepts_protocol_and_ints():
    class Foreign:
        def __cuda_stream__(self):
            return (0, 0xABC)

    assert ptxattn.as_stream(Foreign()).ptr == 0xABC
    assert ptxattn.as_stream(0x1234).ptr == 0x1234
    assert not ptxattn.as_stream(0x1234).owned
    assert ptxattn.as_stream(None).ptr == 0


def test_as_stream_rejects_other_objects():
    with pytest.raises(TypeError, match="stream: expected None"):
        ptxattn.as_stream("stream")


FAKE_DEVICE = Device(0, "fake", (9, 0), 132, 1 << 30, 227 << 10, 50 << 20)


def test_device_array_slicing_and_strides():
    a = DeviceArray(0x10000, (4, 3, 5), np.float32, None, FAKE_DEVICE, owner=None)
    assert a.strides == (60, 20, 4) and a.is_contiguous
    b = a[1:4:2, 2]
    assert b.shape == (2, 5) and b.strides == (120, 4) and b.ptr == 0x10000 + 60 + 40
    assert not b.is_contiguous
    with pytest.raises(IndexError, match="out of bounds"):
        a[4]
    with pytest.raises(IndexError, match="positive step"):
        a[::-1]


def test_cuda_array_interface_export():
    a = DeviceArray(0x20000, (2, 3), np.float16, None, FAKE_DEVICE, owner=None)
    cai = a.__cuda_array_interface__
    assert cai["data"] == (0x20000, False) and cai["typestr"] == "<f2" and cai["version"] == 3
    assert cai["strides"] is None and cai["stream"] == 1
    bf = DeviceArray(0x20000, (2, 3), ptxattn.bfloat16, None, FAKE_DEVICE, owner=None)
    with pytest.raises(TypeError, match="DLPack"):
        bf.__cuda_array_interface__


@pytest.mark.parametrize("versioned", [False, True])
def test_dlpack_capsule_layout(versioned):
    a = DeviceArray(0x30000, (2, 3, 4), ptxattn.bfloat16, None, FAKE_DEVICE, owner=None)[:, 1]
    capsule = dlpack.to_capsule(a, versioned=versioned)
    name = b"dltensor_versioned" if versioned else b"dltensor"
    get_pointer = ctypes.pythonapi.PyCapsule_GetPointer
    get_pointer.restype, get_pointer.argtypes = ctypes.c_void_p, [ctypes.py_object, ctypes.c_char_p]
    address = get_pointer(capsule, name)
    managed = (dlpack._ManagedVersioned if versioned else dlpack._Managed).from_address(address)
    t = managed.dl_tensor
    assert t.data == a.ptr and t.ndim == 2 and (t.device.device_type, t.device.device_id) == (2, 0)
    assert (t.dtype.code, t.dtype.bits, t.dtype.lanes) == (4, 16, 1)
    assert [t.shape[i] for i in range(2)] == [2, 4] and [t.strides[i] for i in range(2)] == [12, 1]
    assert address in dlpack._alive
    del capsule  # never consumed: the capsule's destructor calls the deleter
    assert address not in dlpack._alive


def _cli(*args, env=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ptxattn", *args], capture_output=True, text=True,
                          env={**os.environ, **(env or {})})


@pytest.mark.skipif(gpu_unavailable_reason() is None, reason="this machine has a GPU")
@pytest.mark.parametrize("command", ["info", "demo"])
def test_cli_without_gpu_says_one_clear_sentence(command):
    proc = _cli(command, env={"CUDA_VISIBLE_DEVICES": ""})
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"ptxattn {command}:"), proc.stderr


def test_cli_info_without_gpu_first_shows_what_the_package_carries():
    proc = _cli("info", env={"CUDA_VISIBLE_DEVICES": ""})
    m = manifest()
    need = m["min_driver_cuda_version"]
    assert f"ptxattn {ptxattn.__version__}" in proc.stdout
    assert f"PTX ISA {m['ptx_isa_version']}, needs a driver for CUDA {need[0]}.{need[1]}+" in proc.stdout
    for family, entry in m["families"].items():
        assert any(line.split() == [family, *entry["archs"]] for line in proc.stdout.splitlines()), family


def test_cli_help_describes_each_command_and_version_prints():
    help_text = _cli("--help").stdout
    assert "info      What the package carries" in help_text
    assert "demo      The decode loop ptxattn is for" in help_text
    version = _cli("--version")
    assert version.returncode == 0 and version.stdout.strip() == f"ptxattn {ptxattn.__version__}"


def test_readme_states_the_driver_and_isa_the_ptx_needs():
    m = manifest()
    need = m["min_driver_cuda_version"]
    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    assert f"supports CUDA {need[0]}.{need[1]} or newer" in readme
    assert f"ISA {m['ptx_isa_version']} from NVRTC {m['nvrtc_version']}" in readme


def test_old_driver_is_refused_with_versions(monkeypatch):
    from ptxattn import module

    monkeypatch.setattr(module, "driver_version", lambda: (12, 0))
    need = module.manifest()["min_driver_cuda_version"]
    with pytest.raises(module.PtxLoadError, match=rf"supports CUDA 12\.0, but .* needs CUDA {need[0]}\.{need[1]}"):
        module._check_driver_version()
