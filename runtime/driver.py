"""The CUDA driver, loaded once, and every call through it checked.

`call(fn, *args)` runs a `cuda.bindings.driver` function and either returns what it
produced or raises `CudaError` naming the call, the CUresult and the driver's text. The
bindings are the same module in cuda-bindings 12.x and 13.x; the few calls whose
signatures differ between them are not used here.
"""
from __future__ import annotations

import ctypes
import sys
import threading

try:
    from cuda.bindings import driver as cu
except ImportError as exc:  # pragma: no cover - the package depends on cuda-python
    raise ImportError(
        "ptxattn needs cuda-python's bindings (cuda.bindings.driver): pip install 'cuda-python>=12.6'"
    ) from exc

__all__ = ["cu", "call", "CudaError", "CudaUnavailableError", "init", "driver_version", "hot"]

SUCCESS = cu.CUresult.CUDA_SUCCESS


class CudaError(RuntimeError):
    """A driver call failed. `call`, `result` (CUresult name) and `text` say which and why."""

    def __init__(self, call_name: str, result) -> None:
        self.call = call_name
        self.result = getattr(result, "name", str(result))
        self.code = int(result)
        self.text = _error_text(result)
        super().__init__(f"{call_name} failed: {self.result} ({self.text})")


class CudaUnavailableError(RuntimeError):
    """No usable CUDA driver or device on this machine; the message says what to do."""


def _error_text(result) -> str:
    try:
        err, text = cu.cuGetErrorString(result)
    except Exception:  # the driver itself may be what is missing
        return "no description available"
    if err != SUCCESS or text is None:
        return "no description available"
    return text.decode() if isinstance(text, bytes) else str(text)


def call(fn, *args):
    """Run a driver function; return its outputs (None, one value, or a tuple) or raise."""
    result = fn(*args)
    err = result[0]
    if err != SUCCESS:
        raise CudaError(fn.__name__, err)
    if len(result) == 1:
        return None
    return result[1] if len(result) == 2 else result[1:]


_init_lock = threading.Lock()
_initialized = False


def init() -> None:
    """cuInit once per process; turn 'no driver' and 'no device' into one clear sentence."""
    global _initialized
    if _initialized:
        return
    with _init_lock:
        if _initialized:
            return
        try:
            result = cu.cuInit(0)
        except Exception as exc:  # libcuda could not be loaded at all
            raise CudaUnavailableError(
                "No NVIDIA driver found (libcuda could not be loaded): run on a machine with an "
                "NVIDIA GPU and its driver installed."
            ) from exc
        err = result[0]
        if err == cu.CUresult.CUDA_ERROR_NO_DEVICE:
            raise CudaUnavailableError(
                "The NVIDIA driver is installed but reports no CUDA device: check that a GPU is "
                "visible (nvidia-smi, CUDA_VISIBLE_DEVICES)."
            )
        if err != SUCCESS:
            raise CudaError("cuInit", err)
        _initialized = True


def driver_version() -> tuple[int, int]:
    """The CUDA version the installed driver supports, e.g. (13, 0)."""
    init()
    v = call(cu.cuDriverGetVersion)
    return v // 1000, (v % 1000) // 10


class _HotPath:
    """The context calls made on every op call, through ctypes: they fill a reused pointer
    instead of building CUcontext objects. Everything else goes through `call`."""

    def __init__(self) -> None:
        init()
        lib = ctypes.CDLL("nvcuda.dll" if sys.platform == "win32" else "libcuda.so.1")
        self.lib = lib
        self._get_current = self._function("cuCtxGetCurrent", ctypes.POINTER(ctypes.c_void_p))
        self._push = self._function("cuCtxPushCurrent_v2", ctypes.c_void_p)
        self._pop = self._function("cuCtxPopCurrent_v2", ctypes.POINTER(ctypes.c_void_p))
        self._alloc_async = self._function("cuMemAllocFromPoolAsync", ctypes.POINTER(ctypes.c_uint64),
                                           ctypes.c_size_t, ctypes.c_void_p, ctypes.c_void_p)
        self._free_async = self._function("cuMemFreeAsync", ctypes.c_uint64, ctypes.c_void_p)
        self._is_capturing = self._function("cuStreamIsCapturing", ctypes.c_void_p, ctypes.POINTER(ctypes.c_int))
        u32p, u64p = ctypes.POINTER(ctypes.c_uint32), ctypes.POINTER(ctypes.c_uint64)
        self._encode_tiled = self._function("cuTensorMapEncodeTiled", ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32,
                                            ctypes.c_void_p, u64p, u64p, u32p, u32p, ctypes.c_int, ctypes.c_int,
                                            ctypes.c_int, ctypes.c_int)
        self._slots = threading.local()  # the driver writes into it with the GIL released

    def _function(self, name: str, *argtypes):
        fn = getattr(self.lib, name)
        fn.restype = ctypes.c_int
        fn.argtypes = list(argtypes)
        return fn

    def _slot(self):
        slot = getattr(self._slots, "ctx", None)
        if slot is None:
            slot = self._slots.ctx = ctypes.c_void_p()
            self._slots.ref = ctypes.byref(slot)
            self._slots.ptr = ctypes.c_uint64()
            self._slots.ptr_ref = ctypes.byref(self._slots.ptr)
            self._slots.status = ctypes.c_int()
            self._slots.status_ref = ctypes.byref(self._slots.status)
        return slot

    def current_context(self) -> int:
        """Handle of the calling thread's current context (0 if none)."""
        try:
            slot, ref = self._slots.current
        except AttributeError:
            slot, ref = self._slots.current = (self._slot(), self._slots.ref)
        err = self._get_current(ref)
        if err:
            raise CudaError("cuCtxGetCurrent", cu.CUresult(err))
        return slot.value or 0

    def push(self, context: int) -> None:
        err = self._push(context)
        if err:
            raise CudaError("cuCtxPushCurrent", cu.CUresult(err))

    def pop(self) -> None:
        self._slot()
        err = self._pop(self._slots.ref)
        if err:
            raise CudaError("cuCtxPopCurrent", cu.CUresult(err))

    def alloc_async(self, nbytes: int, pool: int, stream: int) -> int:
        """cuMemAllocFromPoolAsync: the address of `nbytes` from `pool`, in `stream`'s order."""
        self._slot()
        err = self._alloc_async(self._slots.ptr_ref, nbytes, pool, stream)
        if err:
            raise CudaError("cuMemAllocFromPoolAsync", cu.CUresult(err))
        return self._slots.ptr.value

    def free_async(self, ptr: int, stream: int) -> int:
        """cuMemFreeAsync; returns the CUresult (the caller decides what a failure means)."""
        return self._free_async(ptr, stream)

    def is_capturing(self, stream: int) -> bool:
        self._slot()
        err = self._is_capturing(stream, self._slots.status_ref)
        if err:
            raise CudaError("cuStreamIsCapturing", cu.CUresult(err))
        return self._slots.status.value != 0  # CU_STREAM_CAPTURE_STATUS_NONE

    def encode_tensor_map(self, data_type: int, address: int, dims, strides, box) -> bytes:
        """cuTensorMapEncodeTiled of a tensor at `address` (dims innermost first, the byte
        strides of all but the first, a box of `box`), no interleave, 128-byte swizzle, L2
        promotion of 128 bytes, out-of-bounds elements read as zeros: the map's 128 bytes."""
        rank = len(dims)
        buffer = (ctypes.c_uint8 * 192)()  # a CUtensorMap is 64-byte aligned
        out = (ctypes.addressof(buffer) + 63) & ~63
        err = self._encode_tiled(out, data_type, rank, address, (ctypes.c_uint64 * rank)(*dims),
                                 (ctypes.c_uint64 * (rank - 1))(*strides), (ctypes.c_uint32 * rank)(*box),
                                 (ctypes.c_uint32 * rank)(*(1,) * rank), 0, 3, 2, 0)
        if err:
            raise CudaError("cuTensorMapEncodeTiled", cu.CUresult(err))
        return ctypes.string_at(out, 128)


_hot: _HotPath | None = None


def hot() -> _HotPath:
    global _hot
    if _hot is None:
        _hot = _HotPath()
    return _hot
