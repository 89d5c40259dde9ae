"""The device fault buffer: how kernels report bad indices only the device can see.

Each device has one small int32 buffer (cu/common.cuh's `raise_fault` writes it: code, row,
value; the first fault wins). Kernels skip the bad work; the host reads the buffer after the
stream is synchronized and raises `DeviceFault`, then clears it so the context stays usable.
"""
from __future__ import annotations

import threading

import numpy as np

from .capture_mode import relaxed_capture_mode
from .context import on_device
from .device import Device
from .driver import call, cu
from .memory import DeviceBuffer
from .stream import Stream

__all__ = ["DeviceFault", "fault_buffer", "check_faults"]

_WORDS = 4
_MESSAGES = {
    1: "a block_table entry (page id) is outside the page pool",
    2: "a sequence length would pass the cache capacity",
    3: "a slot_mapping entry is outside the page pool",
    4: "a sequence length is negative",
    5: "sequence offsets (cu_seqlens / qo_indptr) decrease, are negative or pass the packed rows",
}


class DeviceFault(RuntimeError):
    def __init__(self, code: int, row: int, value: int) -> None:
        self.code, self.row, self.value = code, row, value
        what = _MESSAGES.get(code, f"unknown fault code {code}")
        super().__init__(f"device fault: {what} (row {row}, value {value}); that work was skipped")


_buffers: dict[int, DeviceBuffer] = {}
_lock = threading.Lock()


def fault_buffer(device: Device) -> int:
    """Device address of `device`'s fault buffer, made (zeroed) by the first op that reports faults."""
    with _lock:
        buffer = _buffers.get(device.ordinal)
        if buffer is None:
            buffer = _buffers[device.ordinal] = _zeroed_buffer(device)
        return buffer.ptr


def _zeroed_buffer(device: Device) -> DeviceBuffer:
    """That first op may run inside a graph capture (a host's own included), so the buffer is
    allocated in relaxed capture mode and zeroed on a stream of its own: a synchronous memset
    runs on the legacy stream, which a capturing blocking stream would have to wait for."""
    with on_device(device), relaxed_capture_mode():
        buffer = DeviceBuffer(_WORDS * 4, device)
        zeroing = Stream.create(device=device)
        try:
            call(cu.cuMemsetD8Async, buffer.ptr, 0, buffer.nbytes, zeroing.handle)
            zeroing.synchronize()
        finally:
            zeroing.close()
    return buffer


def check_faults(device: Device, stream: Stream) -> None:
    """Synchronize `stream`; raise DeviceFault (and clear it) if a kernel reported one."""
    ptr = fault_buffer(device)
    words = np.zeros(_WORDS, dtype=np.int32)
    with on_device(device):
        stream.synchronize()
        call(cu.cuMemcpyDtoH, words.ctypes.data, ptr, words.nbytes)
        if words[0] != 0:
            call(cu.cuMemsetD8, ptr, 0, words.nbytes)
    if words[0] != 0:
        raise DeviceFault(int(words[0]), int(words[1]), int(words[2]))
