"""This thread's stream-capture mode, relaxed for calls that a capture must not refuse."""
from __future__ import annotations

import contextlib

from .driver import call, cu

__all__ = ["relaxed_capture_mode"]

_RELAXED = cu.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_RELAXED


@contextlib.contextmanager
def relaxed_capture_mode():
    """Some of the runtime's one-time set-up (loading a kernel's module, making the device's fault
    buffer) can come while this thread captures a graph: an op's first use inside `capture` or
    inside a host's own capture. In global and thread-local mode the driver may count such a call
    (a module load; an allocation) as potentially unsafe and invalidate the capture; none of them
    enqueues work on the capturing stream, so the thread takes the relaxed mode for them and gets
    its own mode back after."""
    previous = call(cu.cuThreadExchangeStreamCaptureMode, _RELAXED)
    try:
        yield
    finally:
        call(cu.cuThreadExchangeStreamCaptureMode, previous)
