"""NumPy-in/NumPy-out plumbing shared by every op.

An op call is either all-host (NumPy arrays: we upload, run, copy back and synchronize) or
all-device (DeviceArrays or foreign device arrays through DLPack/CAI: we run asynchronously
on the caller's stream and return DeviceArrays). `gather` decides which, before any device
work, so that validation can read shapes, dtypes and strides from either kind alike.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..array import DeviceArray, asarray, empty, from_dlpack, is_device_array_like
from ..context import default_device, on_device
from ..device import Device
from ..memory import CaptureAllocationError
from ..stream import Stream, as_stream

__all__ = ["OpCall", "gather"]


@dataclass
class OpCall:
    op: str
    on_host: bool
    stream: Stream
    arrays: dict = field(default_factory=dict)  # name -> np.ndarray (host) or DeviceArray
    _device: Device | None = None
    _uploads: list = field(default_factory=list)  # kept alive until finish(): kernels read them

    @property
    def device(self) -> Device:
        """Where the call runs (touches the driver: use after validation)."""
        if self._device is None:
            self._device = default_device()
            if self.on_host and self._capturing():
                raise RuntimeError(
                    f"{self.op}: NumPy inputs but the stream is capturing a graph; a captured "
                    f"step takes device arrays (ptxattn.asarray them before capture)"
                )
        return self._device

    def _capturing(self) -> bool:
        with on_device(self.device):  # the capture query needs a current context
            return self.stream.is_capturing()

    def to_device(self, name: str) -> DeviceArray:
        """The named input on the device (host inputs are uploaded, contiguous)."""
        arr = self.arrays[name]
        if isinstance(arr, DeviceArray):
            return arr
        uploaded = asarray(arr, self.stream, self.device)
        self._uploads.append(uploaded)
        return uploaded

    def output(self, shape, dtype, out=None, name: str = "out") -> DeviceArray:
        """A fresh output, or the caller's `out` after checking it matches."""
        shape = tuple(int(n) for n in shape)
        dtype = np.dtype(dtype)
        if out is None:
            if not self.on_host and self._capturing():
                nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
                raise CaptureAllocationError(
                    f"{self.op}: the stream is capturing a graph and the call would allocate its "
                    f"{name} ({nbytes:,} bytes): pass {name}= preallocated before capture"
                )
            return empty(shape, dtype, self.device)
        got = self.arrays.get(name)
        if got is None:
            raise AssertionError(f"{self.op}: pass out= to gather() before output()")
        if tuple(got.shape) != shape or got.dtype != dtype:
            raise ValueError(f"{self.op}: {name} must be {shape} {dtype}, got {tuple(got.shape)} {got.dtype}")
        return got if isinstance(got, DeviceArray) else empty(shape, dtype, self.device)

    def finish(self, result: DeviceArray, out=None):
        """Host calls: copy back (into `out` if given) and wait. Device calls: record the
        stream that produced the result and return it."""
        result.stream = self.stream
        if not self.on_host:
            return result
        host = result.get(self.stream)  # synchronizes: the uploads may be freed now
        self._uploads.clear()
        if out is not None:
            out[...] = host
            return out
        return host


def gather(op: str, stream=None, **arrays) -> OpCall:
    """Classify an op's array arguments (None entries are dropped) as all-host or
    all-device; refuse a mix, naming which is which."""
    present = {k: v for k, v in arrays.items() if v is not None}
    on_device = {k for k, v in present.items() if is_device_array_like(v)}
    if on_device and len(on_device) != len(present):
        host = sorted(set(present) - on_device)
        raise TypeError(
            f"{op}: arrays must be all NumPy (host) or all device arrays; "
            f"{', '.join(sorted(on_device))} on the device but {', '.join(host)} on the host"
        )
    st = as_stream(stream)
    if on_device:
        converted = {k: (v if isinstance(v, DeviceArray) else from_dlpack(v, st)) for k, v in present.items()}
        devices = {a.device.ordinal for a in converted.values()}
        if len(devices) > 1:
            raise ValueError(f"{op}: all arrays must be on one device, got devices {sorted(devices)}")
        device = next(iter(converted.values())).device
        return OpCall(op, False, st, converted, device)
    converted = {k: (v if isinstance(v, np.ndarray) else np.asarray(v)) for k, v in present.items()}
    return OpCall(op, True, st, converted)
