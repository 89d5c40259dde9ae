"""Streams we own, streams we are handed, and events for ordering and timing."""
from __future__ import annotations

import weakref

from .context import default_device, on_device
from .driver import call, cu, hot

__all__ = ["Stream", "Event", "as_stream", "LEGACY_DEFAULT"]

LEGACY_DEFAULT = 0  # the legacy default stream; where work goes when no stream is given


class Stream:
    """A CUDA stream. Made by `Stream.create()` (owned, destroyed by `close()` or when
    collected) or by `Stream.from_handle()` / `as_stream()` (borrowed, never destroyed)."""

    __slots__ = ("handle", "ptr", "owned", "_finalizer", "__weakref__")

    def __init__(self, handle, owned: bool) -> None:
        self.handle = handle if isinstance(handle, cu.CUstream) else cu.CUstream(int(handle))
        self.ptr = int(self.handle)
        self.owned = owned
        self._finalizer = (
            weakref.finalize(self, _destroy_stream, self.handle) if owned else None
        )

    @classmethod
    def create(cls, non_blocking: bool = True, device=None) -> "Stream":
        """A new stream on `device` (default: the current context's device, else device 0),
        made in the caller's context when it belongs to that device, else in its primary one."""
        flags = cu.CUstream_flags.CU_STREAM_NON_BLOCKING if non_blocking else cu.CUstream_flags.CU_STREAM_DEFAULT
        with on_device(device or default_device()):
            return cls(call(cu.cuStreamCreate, flags), owned=True)

    @classmethod
    def from_handle(cls, handle: int) -> "Stream":
        """Borrow a stream somebody else owns; we never destroy it."""
        return cls(handle, owned=False)

    def synchronize(self) -> None:
        call(cu.cuStreamSynchronize, self.handle)

    def is_capturing(self) -> bool:
        return hot().is_capturing(self.ptr)

    def wait(self, event: "Event") -> None:
        call(cu.cuStreamWaitEvent, self.handle, event.handle, 0)

    def close(self) -> None:
        if self._finalizer is not None:
            self._finalizer()

    def __cuda_stream__(self):
        return (0, self.ptr)

    def __eq__(self, other) -> bool:
        return isinstance(other, Stream) and other.ptr == self.ptr

    def __hash__(self) -> int:
        return hash(self.ptr)

    def __repr__(self) -> str:
        return f"Stream(0x{self.ptr:x}, {'owned' if self.owned else 'borrowed'})"


def _destroy_stream(handle) -> None:
    cu.cuStreamDestroy(handle)


def as_stream(stream) -> Stream:
    """Accept None (legacy default stream), a Stream, an int handle, or any object with
    `__cuda_stream__` (CuPy, PyTorch, cuda.core streams)."""
    if stream is None:
        return Stream.from_handle(LEGACY_DEFAULT)
    if isinstance(stream, Stream):
        return stream
    if isinstance(stream, int) and not isinstance(stream, bool):
        return Stream.from_handle(stream)
    protocol = getattr(stream, "__cuda_stream__", None)
    if protocol is not None:
        info = protocol() if callable(protocol) else protocol
        return Stream.from_handle(int(info[1]))
    raise TypeError(
        f"stream: expected None, a ptxattn.Stream, an int handle or an object with "
        f"__cuda_stream__, got {type(stream).__name__}"
    )


class Event:
    """A CUDA event on `device` (chosen as for Stream.create); `timing=True` to measure
    elapsed time."""

    __slots__ = ("handle", "_finalizer", "__weakref__")

    def __init__(self, timing: bool = False, device=None) -> None:
        flags = cu.CUevent_flags.CU_EVENT_DEFAULT if timing else cu.CUevent_flags.CU_EVENT_DISABLE_TIMING
        with on_device(device or default_device()):
            self.handle = call(cu.cuEventCreate, flags)
        self._finalizer = weakref.finalize(self, _destroy_event, self.handle)

    def record(self, stream: Stream) -> "Event":
        call(cu.cuEventRecord, self.handle, stream.handle)
        return self

    def synchronize(self) -> None:
        call(cu.cuEventSynchronize, self.handle)

    def elapsed_ms(self, end: "Event") -> float:
        """Milliseconds from this event to `end` (both recorded, `end` complete)."""
        return call(cu.cuEventElapsedTime, self.handle, end.handle)

    def close(self) -> None:
        self._finalizer()


def _destroy_event(handle) -> None:
    cu.cuEventDestroy(handle)
