"""The probe kernel: stores one int on the device. Proves a module loads and runs
(`python -m ptxattn info`) and measures launch overhead (scripts/bench_launch.py)."""
from __future__ import annotations

import ctypes

from ..device import Device
from ..module import Kernel, ParamStruct, get_kernel


class ProbeParams(ParamStruct):
    # Mirrors ProbeParams in cu/probe.cu.
    _fields_ = [("out", ctypes.c_void_p), ("value", ctypes.c_int32)]


def probe_kernel(device: Device) -> Kernel:
    """The `probe_store` kernel in the current context (call inside on_device)."""
    return get_kernel("probe_store", device)
