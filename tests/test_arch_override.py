"""PTXATTN_ARCH without a GPU: the check of its value, and (through arch_override_probe.py, one
fake-driver process each) which PTX the driver is asked to load and which kernels launch."""
from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import ptxattn
from ptxattn import module
from ptxattn.module import manifest
from ptxattn.ptx_text import kernel_module
from ptxattn.ops import attention
from ptxattn.arch import ARCH_ENV, ArchSettingError, arch_for, capability, target_arch
from ptxattn.device import Device

SHIPPED = ("sm_80", "sm_89", "sm_90", "sm_90a")  # as ptx/ has them (sm_86 devices load sm_80)
H200 = Device(0, "H200", (9, 0), 132, 141 << 30, 232448, 60 << 20)
RTX_3090 = Device(0, "RTX 3090", (8, 6), 82, 24 << 30, 101376, 6 << 20)
OVERRIDES = ["sm_80", "sm_89"]  # the non-Hopper PTX an H200 can JIT


@functools.cache  # each probe is a fresh process (~1 s); the answer does not change
def _probe(arch: str | None, cc: str = "9.0") -> dict:
    env = {key: value for key, value in os.environ.items() if key != ARCH_ENV}
    if arch is not None:
        env[ARCH_ENV] = arch
    script = Path(__file__).with_name("arch_override_probe.py")
    done = subprocess.run([sys.executable, str(script), cc], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout)


# ---- the value's check -----------------------------------------------------------------
@pytest.mark.parametrize("requested", [None, ""])
def test_unset_is_the_devices_own_arch(requested):
    assert target_arch(requested, H200, SHIPPED) == "sm_90"
    assert target_arch(requested, RTX_3090, SHIPPED) == "sm_86"


@pytest.mark.parametrize("requested", SHIPPED)
def test_every_shipped_arch_up_to_the_device_is_accepted(requested):
    assert target_arch(requested, H200, SHIPPED) == requested


@pytest.mark.parametrize("requested, why", [
    ("ampere", "not an arch name like sm_86"),
    ("80", "not an arch name like sm_86"),
    ("SM_80", "not an arch name like sm_86"),
    ("sm_86", "ptxattn ships no ptx/sm_86 folder"),
    ("sm_87", "ptxattn ships no ptx/sm_87 folder"),
    ("sm_100", "ptxattn ships no ptx/sm_100 folder"),
])
def test_unknown_arch_names_the_setting_what_it_expects_and_what_came(requested, why):
    with pytest.raises(ArchSettingError) as info:
        target_arch(requested, H200, SHIPPED)
    assert str(info.value) == (f"PTXATTN_ARCH: expected one of the shipped PTX archs H200 can run "
                               f"(sm_80, sm_89, sm_90, sm_90a); got {requested!r}: {why}")


@pytest.mark.parametrize("requested", ["sm_89", "sm_90", "sm_90a"])
def test_arch_newer_than_the_device_is_refused(requested):
    with pytest.raises(ArchSettingError, match=rf"^PTXATTN_ARCH: expected one of the shipped PTX archs RTX 3090 "
                                               rf"can run \(sm_80\); got '{requested}': RTX 3090 \(compute "
                                               rf"capability 8\.6\) cannot run it: the driver JIT-compiles PTX "
                                               rf"forward only"):
        target_arch(requested, RTX_3090, SHIPPED)


def test_a_listed_arch_whose_folder_is_missing_is_not_shipped(tmp_path, monkeypatch):
    """An install that lost ptx/sm_89 (the manifest still lists it) refuses PTXATTN_ARCH=sm_89."""
    for arch in SHIPPED:
        if arch != "sm_89":
            (tmp_path / arch).mkdir()
    module.manifest()  # read (and cached) from the real package first
    monkeypatch.setattr(module.resources, "files", lambda package: tmp_path)
    module._shipped_archs.cache_clear()
    try:
        assert module._shipped_archs() == ("sm_80", "sm_90", "sm_90a")
        with pytest.raises(ArchSettingError, match="got 'sm_89': ptxattn ships no ptx/sm_89 folder"):
            target_arch("sm_89", H200, module._shipped_archs())
    finally:
        module._shipped_archs.cache_clear()


# ---- what the driver is asked to load (fake driver) -------------------------------------
def test_unset_loads_the_best_match_and_the_wgmma_kernel():
    got = _probe(None)
    launched = dict(got["launched"])
    assert got["ptx_arch"] == "sm_90"
    # Plain calls: the warp-specialized kernel or its ping-pong twin (the plain wgmma one under
    # PTXATTN_SM90_WS=0), as the plan names it.
    sm90 = attention.plan_kernel(ptxattn.bfloat16, 128, 128, False, True).kernel
    assert launched.pop(sm90) == "sm_90a"
    assert set(launched.values()) == {"sm_90"}, got


@pytest.mark.parametrize("arch, cc", [(None, "9.0"), ("sm_80", "9.0"), ("sm_89", "9.0"), (None, "8.0")])
def test_each_kernel_loads_as_a_module_of_its_own(arch, cc):
    """The driver JIT-compiles a module whole: each kernel's PTX holds that kernel alone
    (ptx_text.py), cut from the family file of the arch chosen."""
    got = _probe(arch, cc)
    assert len(got["launched"]) >= 3, got  # sdpa's, decode's and paged_decode's at least
    assert got["module_entries"] == {name: [name] for name in got["launched"]}, got


@pytest.mark.parametrize("arch", ["sm_90", "sm_90a"])
def test_naming_the_devices_own_arch_changes_nothing(arch):
    assert _probe(arch)["launched"] == _probe(None)["launched"]


@pytest.mark.parametrize("arch", OVERRIDES)
def test_override_loads_only_that_archs_ptx(arch):
    """Every kernel sdpa, decode and paged_decode launch comes from the PTX a device of that
    arch loads (its family's highest arch not above it: flash_fwd's sm_80 under sm_89); sdpa
    runs the mma.sync kernel, as a device of that arch would, not the sm_90a wgmma one."""
    got = _probe(arch)
    assert got["ptx_arch"] == arch
    families = {"flash_fwd": "flash_fwd_bf16_d128", "decode": "decode_split_bf16_d128", "merge": "merge_f32_bf16"}
    expected = {name: arch_for(capability(arch), manifest()["families"][family]["archs"])
                for family, name in families.items()}
    assert set(expected.values()) >= {arch}
    assert {name: got["launched"].get(name) for name in expected} == expected, got
    assert set(got["launched"].values()) <= set(expected.values()), got
    assert "flash_fwd_bf16_d128" in got["launched"]
    assert {"decode_split_bf16_d128", "decode_split_bf16_d64"} <= got["launched"].keys()


# ---- programmatic dependent launch: only where the loaded PTX waits (cu/common.cuh) ------
def _entry_body(arch: str, family: str, kernel: str) -> str:
    ptx = (Path(__file__).resolve().parent.parent / "ptx" / arch / f"{family}.ptx").read_bytes()
    own = kernel_module(ptx, kernel).decode()
    return own[own.index(f".entry {kernel}("):]


def test_sm90_ptx_launches_the_decode_combine_programmatically():
    """On sm_90 PTX the split-KV combine (merge_f32_bf16, right after decode's and
    paged_decode's split kernels) may start while the split finishes, and its PTX waits for
    the split before reading; every other launch (sdpa, the splits) is ordinary."""
    got = _probe(None)
    assert got["launched"]["merge_f32_bf16"] == "sm_90"
    assert got["programmatic"] == ["merge_f32_bf16"], got
    assert "griddepcontrol.wait" in _entry_body("sm_90", "merge", "merge_f32_bf16")
    assert "griddepcontrol.launch_dependents" in _entry_body("sm_90", "decode", "decode_split_bf16_d128")


@pytest.mark.parametrize("arch, cc", [("sm_80", "9.0"), ("sm_89", "9.0"), (None, "8.0"), (None, "8.9")])
def test_ptx_below_sm90_launches_nothing_programmatically(arch, cc):
    """Below sm_90 the combine's PTX has no griddepcontrol.wait: launched programmatically it
    could read the partials before the split wrote them."""
    got = _probe(arch, cc)
    assert "merge_f32_bf16" in got["launched"] and got["launched"]["merge_f32_bf16"] != "sm_90", got
    assert got["programmatic"] == [], got


@pytest.mark.parametrize("arch, cc, why", [
    ("sm_75", "9.0", "ptxattn ships no ptx/sm_75 folder"),
    ("hopper", "9.0", "not an arch name"),
    ("sm_89", "8.6", "cannot run it"),
])
def test_bad_setting_raises_at_the_first_op_call(arch, cc, why):
    got = _probe(arch, cc)
    assert got["error"] == "ArchSettingError" and got["raised_by"] == "sdpa", got
    assert got["message"].startswith("PTXATTN_ARCH: expected one of") and why in got["message"], got
