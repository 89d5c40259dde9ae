"""Device buffers, pinned host buffers, the stream-ordered pool, and workspace layouts.

Buffers are freed deterministically by `close()`, or when collected, or at interpreter
exit (weakref.finalize), always inside their device's context. A buffer made on a stream
comes from ptxattn's stream-ordered pool and is freed in that stream's order: neither its
allocation nor its release waits for the device.
"""
from __future__ import annotations

import ctypes
import sys
import threading
import weakref

import numpy as np

from .context import on_device
from .device import Device
from .driver import CudaError, call, cu, hot
from .lifetime import release
from .stream import Stream

__all__ = [
    "DeviceBuffer", "PinnedBuffer", "OutOfMemoryError", "CaptureAllocationError",
    "WorkspaceLayout", "live_device_bytes", "pool_bytes_in_use", "stream_workspace", "release_workspaces",
    "ALIGNMENT",
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
_live_lock = threading.Lock()


def live_device_bytes() -> tuple[int, int]:
    """(buffers, bytes) of device memory ptxattn holds right now: a leak shows here."""
    return _live["buffers"], _live["bytes"]


def _count(buffers: int, nbytes: int) -> None:
    with _live_lock:
        _live["buffers"] += buffers
        _live["bytes"] += nbytes


# ---- the stream-ordered pool ---------------------------------------------------------------
_pools: dict[int, int] = {}  # device ordinal -> CUmemoryPool handle
_pools_lock = threading.Lock()
_KEEP_EVERYTHING = cu.cuuint64_t(2**64 - 1)


def _pool(device: Device) -> int:
    """ptxattn's own memory pool on `device` (made once). Not the device's default pool, so a
    host's settings of that one stay as they were; it keeps freed memory for reuse instead
    of returning it to the driver at every synchronization."""
    pool = _pools.get(device.ordinal)
    if pool is None:
        with _pools_lock:
            pool = _pools.get(device.ordinal)
            if pool is None:
                props = cu.CUmemPoolProps()
                props.allocType = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
                props.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
                props.location.id = device.ordinal
                with on_device(device):
                    pool = int(call(cu.cuMemPoolCreate, props))
                    call(cu.cuMemPoolSetAttribute, cu.CUmemoryPool(pool),
                         cu.CUmemPool_attribute.CU_MEMPOOL_ATTR_RELEASE_THRESHOLD, _KEEP_EVERYTHING)
                _pools[device.ordinal] = pool
    return pool


def pool_bytes_in_use(device: Device) -> int:
    """Bytes of ptxattn's pool on `device` handed out and not yet freed (0 before first use)."""
    pool = _pools.get(device.ordinal)
    if pool is None:
        return 0
    with on_device(device):
        value = call(cu.cuMemPoolGetAttribute, cu.CUmemoryPool(pool), cu.CUmemPool_attribute.CU_MEMPOOL_ATTR_USED_MEM_CURRENT)
    return int(value)


class DeviceBuffer:
    """`nbytes` of device memory on `device`; `ptr` is the device address (an int). With a
    `stream` it comes from the stream-ordered pool, usable by work queued on that stream
    (or ordered after it), and is freed in that stream's order."""

    __slots__ = ("ptr", "nbytes", "device", "_stream", "_live", "__weakref__")

    def __init__(self, nbytes: int, device: Device, stream: Stream | None = None) -> None:
        self._live = False  # until the memory exists (__del__ runs after a failed __init__ too)
        self.nbytes = int(nbytes)
        self.device = device
        size = max(self.nbytes, 1)  # an empty buffer still gets a valid address
        try:
            if stream is None:
                with on_device(device):
                    dptr = int(call(cu.cuMemAlloc, size))
            elif stream.ptr:  # the pool and the stream name the device: no context switch needed
                dptr = hot().alloc_async(size, _pool(device), stream.ptr)
            else:  # the legacy default stream is the current context's
                with on_device(device):
                    dptr = hot().alloc_async(size, _pool(device), 0)
        except CudaError as exc:
            if exc.result != "CUDA_ERROR_OUT_OF_MEMORY":
                raise
            with on_device(device):
                free, total = call(cu.cuMemGetInfo)
            raise OutOfMemoryError(device, self.nbytes, free, total) from None
        self.ptr = dptr
        self._stream = stream
        self._live = True
        _count(1, self.nbytes)

    def close(self) -> None:
        if self._live:
            self._live = False
            release(_free_device, self.ptr, self.device, self.nbytes, self._stream)

    def __del__(self) -> None:
        # __del__ rather than weakref.finalize: an eager call makes one of these per output,
        # and a finalizer costs more than the stream-ordered allocation itself. At
        # interpreter exit the process's memory goes with its context.
        if not sys.is_finalizing():
            self.close()

    @property
    def closed(self) -> bool:
        return not self._live


def _free_device(dptr: int, device: Device, nbytes: int, stream: Stream | None) -> None:
    _count(-1, -nbytes)
    if stream is not None and stream.ptr and hot().free_async(dptr, stream.ptr) == 0:
        return
    with on_device(device):
        if stream is not None and stream.ptr == 0 and hot().free_async(dptr, 0) == 0:
            return
        # Not from the pool, or its stream was destroyed first: free once the device is done.
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


# ---- eager calls' workspace ----------------------------------------------------------------------
_workspaces: dict[tuple[int, int], DeviceBuffer] = {}
_workspaces_lock = threading.Lock()


def stream_workspace(device: Device, stream: Stream, nbytes: int) -> int:
    """The address of at least `nbytes` of scratch for eager calls on `stream`. Work on one
    stream is ordered, so every call on it may reuse the same bytes; a larger need replaces
    the buffer in the stream's order (the old one is freed after the work queued before it),
    so nothing waits. Held until release_workspaces(); a captured graph never uses it (the
    buffer could be replaced under the graph)."""
    key = (device.ordinal, stream.ptr)
    buffer = _workspaces.get(key)
    if buffer is not None and buffer.nbytes >= nbytes:
        return buffer.ptr
    with _workspaces_lock:
        grown = DeviceBuffer(align_up(max(nbytes, 1)), device, stream)
        old, _workspaces[key] = _workspaces.get(key), grown
    if old is not None:
        old.close()
    return grown.ptr


def release_workspaces() -> None:
    """Give the eager calls' per-stream workspaces back to the pool (each in its stream's order)."""
    with _workspaces_lock:
        held = list(_workspaces.values())
        _workspaces.clear()
    for buffer in held:
        buffer.close()

