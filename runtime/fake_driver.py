"""A stand-in for libcuda, so the host path can run (and be timed and tested) without a GPU.

`install()` replaces the `cuda.bindings.driver` functions ptxattn calls, and its ctypes hot
path, with Python stand-ins that answer as an H200 would (one device, compute capability 9.0,
132 SMs), as tinygrad's fake libcuda does. Device memory is host memory, so copies move real
bytes; kernel launches and stream work are no-ops, so outputs hold whatever was there. Install
it in a fresh process before ptxattn touches the driver: it is not meant to be removed again.

    python -c "import ptxattn.fake_driver as f; f.install(); import ptxattn; ..."
"""
from __future__ import annotations

import ctypes
import itertools
import threading

import numpy as np

from cuda.bindings import driver as cu

from .driver import CudaError

__all__ = ["install", "launches", "fake_tensor_map"]

_OK = cu.CUresult.CUDA_SUCCESS
_A = cu.CUdevice_attribute
_ATTRIBUTES = {
    _A.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR: 9,
    _A.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR: 0,
    _A.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT: 132,
    _A.CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN: 232448,
    _A.CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE: 60 << 20,
}
_PRIMARY = 0x1000
_handles = itertools.count(0x10000)
_memory: dict[int, np.ndarray] = {}  # address -> the host buffer standing in for it


class _ContextStack(threading.local):
    """The calling thread's stack of current contexts: one a thread, as the driver's are."""

    def __init__(self) -> None:
        self.contexts: list[int] = []


_thread = _ContextStack()

launches = [0]  # kernel launches so far (tests read it)


def _alloc(nbytes: int) -> int:
    """Host bytes standing in for device memory (not cleared, as cuMemAlloc's are not),
    256-byte aligned like cuMemAlloc's."""
    buffer = np.empty(max(int(nbytes), 1) + 255, np.uint8)
    address = (buffer.ctypes.data + 255) & ~255
    _memory[address] = buffer
    return address


def _ok(*values):
    return (_OK, *values)


def _launch(function, gx, gy, gz, bx, by, bz, shared, stream, args, extra):
    launches[0] += 1
    return (_OK,)


def _launch_ex(config, function, args, extra):
    launches[0] += 1
    return (_OK,)


def _memcpy(dst, src, nbytes, *stream):
    ctypes.memmove(int(dst), int(src), int(nbytes))
    return (_OK,)


def _memset(dst, value, nbytes, *stream):
    ctypes.memset(int(dst), int(value), int(nbytes))
    return (_OK,)


def _memset32(dst, value, words, *stream):
    (ctypes.c_uint32 * int(words)).from_address(int(dst))[:] = [int(value)] * int(words)
    return (_OK,)


def _free(ptr, *stream):
    _memory.pop(int(ptr), None)
    return (_OK,)


def _push(ctx):
    _thread.contexts.append(int(ctx))
    return (_OK,)


def _pop():
    return _ok(cu.CUcontext(_thread.contexts.pop()))


_capture_modes: dict[int, object] = {}  # thread id -> its stream capture interaction mode


def _exchange_capture_mode(mode):
    thread = threading.get_ident()
    previous = _capture_modes.get(thread, cu.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_GLOBAL)
    _capture_modes[thread] = mode
    return _ok(previous)


_FUNCTIONS = {
    "cuInit": lambda flags: (_OK,),
    "cuDriverGetVersion": lambda: _ok(13000),
    "cuGetErrorString": lambda result: _ok(b"fake driver"),
    "cuDeviceGetCount": lambda: _ok(1),
    "cuDeviceGet": lambda ordinal: _ok(cu.CUdevice(ordinal)),
    "cuDeviceGetAttribute": lambda attr, dev: _ok(_ATTRIBUTES.get(attr, 0)),
    "cuDeviceGetName": lambda size, dev: _ok(b"Fake H200 (no GPU)\0"),
    "cuDeviceTotalMem": lambda dev: _ok(141 << 30),
    "cuDevicePrimaryCtxRetain": lambda dev: _ok(cu.CUcontext(_PRIMARY)),
    "cuCtxPushCurrent": _push,
    "cuCtxPopCurrent": _pop,
    "cuCtxGetDevice": lambda: _ok(cu.CUdevice(0)),
    "cuModuleLoadDataEx": lambda *args: _ok(cu.CUmodule(next(_handles))),
    "cuModuleGetFunction": lambda module, name: _ok(cu.CUfunction(next(_handles))),
    "cuFuncGetAttribute": lambda attr, fn: _ok(0),
    "cuFuncSetAttribute": lambda fn, attr, value: (_OK,),
    "cuLaunchKernel": _launch,
    "cuLaunchKernelEx": _launch_ex,
    "cuMemAlloc": lambda nbytes: _ok(cu.CUdeviceptr(_alloc(nbytes))),
    "cuMemAllocFromPoolAsync": lambda nbytes, pool, stream: _ok(cu.CUdeviceptr(_alloc(nbytes))),
    "cuMemFree": _free,
    "cuMemFreeAsync": _free,
    "cuMemGetInfo": lambda: _ok(140 << 30, 141 << 30),
    "cuMemPoolCreate": lambda props: _ok(cu.CUmemoryPool(next(_handles))),
    "cuMemPoolSetAttribute": lambda pool, attr, value: (_OK,),
    "cuMemPoolGetAttribute": lambda pool, attr: _ok(cu.cuuint64_t(0)),
    "cuMemHostAlloc": lambda nbytes, flags: _ok(_alloc(nbytes)),
    "cuMemFreeHost": _free,
    "cuMemsetD8": _memset,
    "cuMemsetD32Async": _memset32,
    "cuMemsetD8Async": _memset,
    "cuMemcpyHtoDAsync": _memcpy,
    "cuMemcpyDtoHAsync": _memcpy,
    "cuMemcpyDtoH": _memcpy,
    "cuMemcpyDtoDAsync": _memcpy,
    "cuPointerGetAttribute": lambda attr, ptr: _ok(0),
    "cuStreamCreate": lambda flags: _ok(cu.CUstream(next(_handles))),
    "cuStreamDestroy": lambda stream: (_OK,),
    "cuStreamSynchronize": lambda stream: (_OK,),
    "cuStreamIsCapturing": lambda stream: _ok(cu.CUstreamCaptureStatus.CU_STREAM_CAPTURE_STATUS_NONE),
    "cuStreamWaitEvent": lambda stream, event, flags: (_OK,),
    "cuEventCreate": lambda flags: _ok(cu.CUevent(next(_handles))),
    "cuEventRecord": lambda event, stream: (_OK,),
    "cuEventSynchronize": lambda event: (_OK,),
    "cuEventElapsedTime": lambda start, end: _ok(0.0),
    "cuEventDestroy": lambda event: (_OK,),
    "cuStreamBeginCapture": lambda stream, mode: (_OK,),
    "cuThreadExchangeStreamCaptureMode": _exchange_capture_mode,
    "cuStreamEndCapture": lambda stream: _ok(cu.CUgraph(next(_handles))),
    "cuGraphInstantiate": lambda graph, flags: _ok(cu.CUgraphExec(next(_handles))),
    "cuGraphLaunch": lambda graph_exec, stream: (_OK,),
    "cuGraphExecDestroy": lambda graph_exec: (_OK,),
    "cuGraphDestroy": lambda graph: (_OK,),
}


class _FakeHotPath:
    """ptxattn.driver's ctypes hot path, answered from the fake context stack."""

    lib = None

    def current_context(self) -> int:
        contexts = _thread.contexts
        return contexts[-1] if contexts else 0

    def push(self, context: int) -> None:
        _thread.contexts.append(context)

    def pop(self) -> None:
        _thread.contexts.pop()

    def alloc_async(self, nbytes: int, pool: int, stream: int) -> int:
        return _alloc(nbytes)

    def free_async(self, ptr: int, stream: int) -> int:
        _memory.pop(ptr, None)
        return 0

    def is_capturing(self, stream: int) -> bool:
        return False

    def encode_tensor_map(self, data_type: int, address: int, dims, strides, box) -> bytes:
        """No driver to ask: the map's 128 bytes hold its arguments instead (fake_tensor_map
        reads them back), so tests can see which map a launch got. Like the driver's, it
        refuses to encode without a current context."""
        if not _thread.contexts:
            raise CudaError("cuTensorMapEncodeTiled", cu.CUresult.CUDA_ERROR_INVALID_CONTEXT)
        words = (data_type, address, *dims, *strides, *box)
        return np.array(words + (0,) * (16 - len(words)), np.uint64).tobytes()


def fake_tensor_map(data: bytes) -> dict:
    """The arguments a fake tensor map was encoded from (see _FakeHotPath.encode_tensor_map)."""
    words = [int(w) for w in np.frombuffer(data, np.uint64)]
    return {"data_type": words[0], "address": words[1], "dims": tuple(words[2:6]), "strides": tuple(words[6:9]),
            "box": tuple(words[9:13])}


def install(compute_capability: tuple[int, int] = (9, 0)) -> None:
    """Replace the driver for the rest of this process (call before ptxattn uses it); its
    device reports `compute_capability` (an H200's by default)."""
    _ATTRIBUTES[_A.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR], \
        _ATTRIBUTES[_A.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR] = compute_capability
    for name, fn in _FUNCTIONS.items():
        setattr(cu, name, fn)
    from . import driver

    driver._hot = _FakeHotPath()
