"""Device buffers, pinned host buffers, and the workspace arena.

Buffers are freed deterministically by `close()`, or when collected, or at interpreter
exit (weakref.finalize), always inside their device's context.
"""
from __future__ import annotations

import ctypes
import threading
import weakref

import numpy as np

from .context import on_device
from .device import Device
from .driver import CudaError, call, cu
from .lifetime import release
from .stream import Stream

__all__ = [
    "DeviceBuffer", "PinnedBuffer", "OutOfMemoryError", "CaptureAllocationError",
    "WorkspaceLayout", "WorkspaceArena", "arena_for", "live_device_bytes", "ALIGNMENT",
]

ALIGNMENT = 256


class OutOfMemoryError(MemoryError):
    def __init__(self, device: Device, asked: int, free: int, total: int) -> None:
        self.asked, self.free, self.total = asked, free, total
        super().__init__(
            f"out of device memory on {device.name} (device {device.ordinal}): asked for "
            f"{asked:,} bytes, {free:,} free of {total:,}"
        )


class CaptureAllocationError(RuntimeError):
    """Raised instead of allocating while the stream is being captured into a graph."""


_live = {"buffers": 0, "bytes": 0}


def live_device_bytes() -> tuple[int, int]:
    """(buffers, bytes) of device memory ptxattn holds right now: a leak shows here."""
    return _live["buffers"], _live["bytes"]


class DeviceBuffer:
    """`nbytes` of device memory on `device`. `ptr` is the device address (an int)."""

    __slots__ = ("ptr", "nbytes", "device", "_finalizer", "__weakref__")

    def __init__(self, nbytes: int, device: Device) -> None:
        self.nbytes = int(nbytes)
        self.device = device
        with on_device(device):
            try:
                # cuMemAlloc refuses 0 bytes; an empty buffer still gets a valid address.
                dptr = call(cu.cuMemAlloc, max(self.nbytes, 1))
            except CudaError as exc:
                if exc.result != "CUDA_ERROR_OUT_OF_MEMORY":
                    raise
                free, total = call(cu.cuMemGetInfo)
                raise OutOfMemoryError(device, self.nbytes, free, total) from None
        self.ptr = int(dptr)
        self._finalizer = weakref.finalize(self, release, _free_device, dptr, device, self.nbytes)
        _live["buffers"] += 1
        _live["bytes"] += self.nbytes

    def close(self) -> None:
        self._finalizer()

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive


def _free_device(dptr, device: Device, nbytes: int) -> None:
    _live["buffers"] -= 1
    _live["bytes"] -= nbytes
    with on_device(device):
        call(cu.cuMemFree, dptr)


class PinnedBuffer:
    """Page-locked host memory for asynchronous copies; `array(dtype, shape)` views it."""

    __slots__ = ("ptr", "nbytes", "_finalizer", "__weakref__")

    def __init__(self, nbytes: int, device: Device) -> None:
        self.nbytes = int(nbytes)
        with on_device(device):
            self.ptr = int(call(cu.cuMemHostAlloc, max(self.nbytes, 1), 0))
        self._finalizer = weakref.finalize(self, release, _free_host, self.ptr, device)

    def array(self, dtype, shape) -> np.ndarray:
        dtype = np.dtype(dtype)
        count = int(np.prod(shape, dtype=np.int64))
        if count * dtype.itemsize > self.nbytes:
            raise ValueError(f"shape {tuple(shape)} of {dtype} needs more than {self.nbytes} bytes")
        raw = (ctypes.c_byte * max(self.nbytes, 1)).from_address(self.ptr)
        return np.frombuffer(raw, dtype=dtype, count=count).reshape(shape)

    def close(self) -> None:
        self._finalizer()


def _free_host(ptr: int, device: Device) -> None:
    with on_device(device):
        call(cu.cuMemFreeHost, ptr)


def align_up(nbytes: int, alignment: int = ALIGNMENT) -> int:
    return (int(nbytes) + alignment - 1) // alignment * alignment


class WorkspaceLayout:
    """Named regions in one workspace, each 256-byte aligned. An op builds its layout with
    one planning function and uses it both to size the reservation and to run."""

    def __init__(self, **region_bytes: int) -> None:
        self.offsets: dict[str, int] = {}
        self.sizes: dict[str, int] = {}
        offset = 0
        for name, nbytes in region_bytes.items():
            if nbytes < 0:
                raise ValueError(f"workspace region {name!r}: negative size {nbytes}")
            self.offsets[name] = offset
            self.sizes[name] = int(nbytes)
            offset += align_up(nbytes)
        self.nbytes = offset

    def address(self, base: int, name: str) -> int:
        return base + self.offsets[name]

    def __repr__(self) -> str:
        regions = ", ".join(f"{n}={self.sizes[n]}@{self.offsets[n]}" for n in self.offsets)
        return f"WorkspaceLayout({regions}; {self.nbytes} bytes)"


class WorkspaceArena:
    """One growable device reservation per (device, stream). Work on one stream is ordered,
    so every op on that stream may reuse the same bytes. It never grows while its stream is
    being captured: reserve before capturing."""

    def __init__(self, device: Device, stream: Stream) -> None:
        self.device = device
        self.stream = stream
        self._buffer: DeviceBuffer | None = None

    @property
    def held(self) -> int:
        return 0 if self._buffer is None else self._buffer.nbytes

    def reserve(self, nbytes: int) -> int:
        """Return the base address of at least `nbytes` (256-byte aligned)."""
        nbytes = align_up(nbytes)
        if nbytes <= self.held and self._buffer is not None:
            return self._buffer.ptr
        if self.stream.is_capturing():
            raise CaptureAllocationError(
                f"workspace: the stream is capturing a graph and the arena must grow: asked "
                f"for {nbytes:,} bytes, it holds {self.held:,}. Reserve the workspace before "
                f"capture (ptxattn.arena_for(device, stream).reserve(n)) or pass workspace=."
            )
        if self._buffer is not None:
            # Earlier work on this stream may still read the old bytes.
            self.stream.synchronize()
            self._buffer.close()
            self._buffer = None
        self._buffer = DeviceBuffer(nbytes, self.device)
        return self._buffer.ptr

    def release(self) -> None:
        if self._buffer is not None:
            self.stream.synchronize()
            self._buffer.close()
            self._buffer = None


_arenas: dict[tuple[int, int], WorkspaceArena] = {}
_arenas_lock = threading.Lock()


def arena_for(device: Device, stream: Stream) -> WorkspaceArena:
    key = (device.ordinal, stream.ptr)
    with _arenas_lock:
        arena = _arenas.get(key)
        if arena is None:
            arena = _arenas[key] = WorkspaceArena(device, stream)
        return arena
