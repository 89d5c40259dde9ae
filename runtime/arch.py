"""Which PTX arch a device loads: its own compute capability's, or the one PTXATTN_ARCH names.

`PTXATTN_ARCH=sm_80` on an H200 (sm_90) loads the sm_80 PTX, which the driver JIT-compiles
forward to the device, so the PTX shipped for Ampere and Ada is run, not only built. Kernel
choice follows the named arch as a device of that compute capability would (no sm_90a wgmma
kernels under sm_80, software fp8 conversion below sm_89); device limits (SM count, shared
memory) stay the real device's.
"""
from __future__ import annotations

import re

from .device import Device

__all__ = ["ARCH_ENV", "ArchSettingError", "arch_for", "arch_key", "capability", "runs_on", "target_arch"]

ARCH_ENV = "PTXATTN_ARCH"
_ARCH_NAME = re.compile(r"sm_(\d+)(\d)a?")


class ArchSettingError(ValueError):
    """PTXATTN_ARCH names an arch this package or this device cannot load."""


def arch_key(arch: str) -> tuple[int, bool]:
    """(sm number, arch-specific) of "sm_XY" / "sm_XYa": the order archs are ranked in."""
    digits = arch[3:].rstrip("a")
    return int(digits), arch.endswith("a")


def capability(arch: str) -> tuple[int, int]:
    """The compute capability an arch is for: "sm_86" -> (8, 6)."""
    major, minor = _ARCH_NAME.fullmatch(arch).groups()
    return int(major), int(minor)


def runs_on(arch: str, compute_capability: tuple[int, int]) -> bool:
    """Whether a device of this compute capability loads PTX of `arch`: the driver JIT-compiles
    PTX forward only (to the same or a newer arch), and sm_XYa PTX only on exactly X.Y."""
    cc = compute_capability[0] * 10 + compute_capability[1]
    number, arch_specific = arch_key(arch)
    return number == cc if arch_specific else number <= cc


def arch_for(compute_capability: tuple[int, int], archs) -> str | None:
    """Highest PTX arch loadable on a device of this compute capability (None if none is)."""
    usable = [arch for arch in archs if runs_on(arch, compute_capability)]
    return max(usable, key=arch_key, default=None)


def target_arch(requested: str | None, device: Device, shipped) -> str:
    """The arch whose PTX `device` loads: `requested` (PTXATTN_ARCH's value) once checked
    against the `shipped` PTX folders, or the device's own when it is unset or empty."""
    if not requested:
        return device.arch
    cc = device.compute_capability
    if not _ARCH_NAME.fullmatch(requested):
        why = "not an arch name like sm_86"
    elif requested not in shipped:
        why = f"ptxattn ships no ptx/{requested} folder"
    elif not runs_on(requested, cc):
        why = (f"{device.name} (compute capability {cc[0]}.{cc[1]}) cannot run it: the driver JIT-compiles "
               f"PTX forward only, to the same or a newer arch")
    else:
        return requested
    runnable = ", ".join(arch for arch in shipped if runs_on(arch, cc)) or "none"
    raise ArchSettingError(f"{ARCH_ENV}: expected one of the shipped PTX archs {device.name} can run "
                           f"({runnable}); got {requested!r}: {why}")
