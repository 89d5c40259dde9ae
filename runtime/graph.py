"""CUDA graph primitives: capture a stream's work, instantiate, replay, update.

Capture uses the thread-local mode, so other threads may keep allocating and launching while
one thread captures.

    with ptxattn.capture(stream) as graph:
        ptxattn.softmax(x, out=y, stream=stream)
    graph.replay()                    # on the capture stream, or graph.replay(other_stream)
"""
from __future__ import annotations

import weakref
from contextlib import contextmanager

from .context import default_device, on_device
from .device import Device
from .driver import call, cu
from .lifetime import capture_ended, capture_started, release
from .stream import Stream, as_stream

__all__ = ["Graph", "capture"]

_THREAD_LOCAL = cu.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL


class Graph:
    """An instantiated graph and the stream it was captured on."""

    def __init__(self, device: Device, stream: Stream) -> None:
        self.device = device
        self.stream = stream
        self._graph = None
        self._exec = None
        self._finalizer = None

    def _set(self, graph) -> None:
        self._graph = graph
        with on_device(self.device):
            self._exec = call(cu.cuGraphInstantiate, graph, 0)
        self._finalizer = weakref.finalize(self, release, _destroy, self._graph, self._exec, self.device)

    @property
    def instantiated(self) -> bool:
        return self._exec is not None

    def replay(self, stream=None) -> None:
        if self._exec is None:
            raise RuntimeError("replay: the graph was not captured (the capture block raised?)")
        st = self.stream if stream is None else as_stream(stream)
        with on_device(self.device):
            call(cu.cuGraphLaunch, self._exec, st.handle)

    def update(self, other: "Graph") -> None:
        """Take `other`'s node parameters (same topology) without re-instantiating."""
        with on_device(self.device):
            call(cu.cuGraphExecUpdate, self._exec, other._graph)

    def close(self) -> None:
        if self._finalizer is not None:
            self._finalizer()
            self._graph = self._exec = None


def _destroy(graph, graph_exec, device: Device) -> None:
    with on_device(device):
        cu.cuGraphExecDestroy(graph_exec)
        cu.cuGraphDestroy(graph)


@contextmanager
def capture(stream, device: Device | None = None):
    """Capture everything issued to `stream` inside the block into an instantiated Graph.
    The legacy default stream cannot be captured: pass a stream you created."""
    st = as_stream(stream)
    if st.ptr == 0:
        raise ValueError("capture: the legacy default stream cannot be captured; create a stream (ptxattn.Stream.create())")
    dev = device or default_device()
    graph = Graph(dev, st)
    with on_device(dev):
        call(cu.cuStreamBeginCapture, st.handle, _THREAD_LOCAL)
        capture_started()
        try:
            yield graph
        except BaseException:
            result = cu.cuStreamEndCapture(st.handle)
            if result[0] == cu.CUresult.CUDA_SUCCESS and result[1] is not None:
                cu.cuGraphDestroy(result[1])
            raise
        else:
            captured = call(cu.cuStreamEndCapture, st.handle)
        finally:
            capture_ended()  # runs the frees that were deferred during capture
    graph._set(captured)
