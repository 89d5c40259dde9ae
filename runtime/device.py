"""Devices, their properties, and their primary contexts (retained once, kept for the process)."""
from __future__ import annotations

import functools
import threading
from dataclasses import dataclass

from .driver import call, cu, init

__all__ = ["Device", "device_count", "get_device"]

_A = cu.CUdevice_attribute


@dataclass(frozen=True)
class Device:
    ordinal: int
    name: str
    compute_capability: tuple[int, int]
    sm_count: int
    total_memory: int
    max_shared_per_block_optin: int
    l2_bytes: int

    @property
    def arch(self) -> str:
        major, minor = self.compute_capability
        return f"sm_{major}{minor}"

    @property
    def primary_context(self):
        return _primary_context(self.ordinal)

    def memory_info(self) -> tuple[int, int]:
        """(free, total) bytes, read in this device's context."""
        from .context import on_device

        with on_device(self):
            return call(cu.cuMemGetInfo)


def device_count() -> int:
    init()
    return call(cu.cuDeviceGetCount)


@functools.lru_cache(maxsize=None)
def get_device(ordinal: int = 0) -> Device:
    count = device_count()
    if not 0 <= ordinal < count:
        raise ValueError(f"device: expected an ordinal in [0, {count}), got {ordinal}")
    handle = call(cu.cuDeviceGet, ordinal)

    def attr(a):
        return call(cu.cuDeviceGetAttribute, a, handle)

    raw_name = call(cu.cuDeviceGetName, 256, handle)
    name = raw_name.split(b"\0", 1)[0].decode()
    return Device(
        ordinal=ordinal,
        name=name,
        compute_capability=(
            attr(_A.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR),
            attr(_A.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR),
        ),
        sm_count=attr(_A.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT),
        total_memory=call(cu.cuDeviceTotalMem, handle),
        max_shared_per_block_optin=attr(_A.CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN),
        l2_bytes=attr(_A.CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE),
    )


_primary_lock = threading.Lock()
_primary: dict[int, object] = {}


def _primary_context(ordinal: int):
    """Retain the device's primary context once; it stays retained for the process."""
    ctx = _primary.get(ordinal)
    if ctx is None:
        with _primary_lock:
            ctx = _primary.get(ordinal)
            if ctx is None:
                ctx = call(cu.cuDevicePrimaryCtxRetain, call(cu.cuDeviceGet, ordinal))
                _primary[ordinal] = ctx
    return ctx
