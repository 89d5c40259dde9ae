"""Running in the right context and leaving the caller's one exactly as it was.

Embedding hosts (CuPy, JAX, PyTorch, their own driver code) may have a context current. If
it belongs to the target device we run in it, so their allocations, streams and our work
share one context. Otherwise we push the device's primary context and pop it afterwards,
on success and on error.
"""
from __future__ import annotations

from .device import Device, get_device
from .driver import call, cu, hot, init

__all__ = ["on_device", "current_device", "default_device"]


_context_devices: dict[int, int] = {}  # context handle -> device ordinal (never changes)


def _current_context_device() -> int | None:
    ctx = hot().current_context()
    if ctx == 0:
        return None
    ordinal = _context_devices.get(ctx)
    if ordinal is None:
        ordinal = _context_devices[ctx] = int(call(cu.cuCtxGetDevice))
    return ordinal


class on_device:
    """Make a context of `device` current for the block, restoring the caller's context.
    (A class rather than a generator: it runs on every op call.)"""

    __slots__ = ("device", "pushed")

    def __init__(self, device: Device) -> None:
        self.device = device
        self.pushed = False

    def __enter__(self) -> None:
        init()
        if _current_context_device() != self.device.ordinal:
            call(cu.cuCtxPushCurrent, self.device.primary_context)
            self.pushed = True

    def __exit__(self, *exc) -> None:
        if self.pushed:
            self.pushed = False
            call(cu.cuCtxPopCurrent)


def current_device() -> Device | None:
    """The device of the caller's current context, if one is current."""
    init()
    ordinal = _current_context_device()
    return None if ordinal is None else get_device(ordinal)


def default_device() -> Device:
    """Where work with no device-resident input runs: the current context's device, else 0."""
    return current_device() or get_device(0)
