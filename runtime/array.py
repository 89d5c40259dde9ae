"""DeviceArray: a shape, a dtype and byte strides over device memory, with NumPy copies and
zero-copy exchange through DLPack and the CUDA Array Interface (v3)."""
from __future__ import annotations

import numpy as np

from . import dlpack
from .context import default_device, on_device
from .device import Device, get_device
from .driver import call, cu
from .dtypes import normalize, typestr
from .memory import DeviceBuffer
from .stream import LEGACY_DEFAULT, Event, Stream, as_stream

__all__ = ["DeviceArray", "asarray", "empty", "zeros", "from_dlpack", "is_device_array_like", "array_kind"]

_CU_STREAM_LEGACY = 1  # how DLPack and the CUDA Array Interface name the legacy default stream


def _contiguous_strides(shape, itemsize: int) -> tuple[int, ...]:
    strides, step = [], itemsize
    for n in reversed(shape):
        strides.append(step)
        step *= max(int(n), 1)
    return tuple(reversed(strides))


class DeviceArray:
    """An array in device memory. `strides` are in bytes, as in NumPy.

    `stream` is the stream of the last work that wrote it (None: the legacy default); `get()`
    and exports order themselves after it.
    """

    __slots__ = ("ptr", "shape", "dtype", "strides", "device", "stream", "_owner", "_meta", "__weakref__")

    def __init__(self, ptr: int, shape, dtype, strides, device: Device, owner, stream: Stream | None = None):
        self.ptr = int(ptr)
        self.shape = tuple(int(n) for n in shape)
        self.dtype = normalize(dtype)
        self.strides = tuple(int(s) for s in strides) if strides is not None else _contiguous_strides(self.shape, self.dtype.itemsize)
        self.device = device
        self.stream = stream
        self._owner = owner  # whatever keeps the memory alive (a DeviceBuffer or a foreign array)
        self._meta = None

    @classmethod
    def view(cls, ptr: int, shape: tuple, dtype: np.dtype, strides: tuple, device: Device, owner,
             stream: Stream | None = None) -> "DeviceArray":
        """A DeviceArray over checked parts (int ptr, tuple shape, a supported np.dtype, byte
        strides): the cheap constructor of the op path."""
        arr = cls.__new__(cls)
        arr.ptr, arr.shape, arr.dtype, arr.strides = ptr, shape, dtype, strides
        arr.device, arr.stream, arr._owner, arr._meta = device, stream, owner, None
        return arr

    @property
    def meta(self) -> tuple:
        """What a prepared op depends on: (shape, element strides, dtype, device ordinal,
        address alignment up to 256 bytes). Equal metas run the same plan."""
        meta = self._meta
        if meta is None:
            ptr = self.ptr
            align = min(ptr & -ptr, 256) if ptr else 256
            meta = self._meta = (self.shape, self.element_strides, self.dtype, self.device.ordinal, align)
        return meta

    # ---- metadata ----------------------------------------------------------
    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    @property
    def itemsize(self) -> int:
        return self.dtype.itemsize

    @property
    def nbytes(self) -> int:
        return self.size * self.itemsize

    @property
    def element_strides(self) -> tuple[int, ...]:
        return tuple(s // self.itemsize for s in self.strides)

    @property
    def is_contiguous(self) -> bool:
        """C-contiguous (axes of length 1 may carry any stride; an empty array always is)."""
        if self.size == 0:
            return True
        expected = _contiguous_strides(self.shape, self.itemsize)
        return all(n <= 1 or s == e for n, s, e in zip(self.shape, self.strides, expected))

    def __len__(self) -> int:
        if not self.shape:
            raise TypeError("len() of a 0-d DeviceArray")
        return self.shape[0]

    def __repr__(self) -> str:
        return f"DeviceArray(shape={self.shape}, dtype={self.dtype}, device={self.device.ordinal}, ptr=0x{self.ptr:x})"

    # ---- views ---------------------------------------------------------------
    def __getitem__(self, key) -> "DeviceArray":
        """Basic indexing of leading axes: integers and slices with a positive step."""
        if not isinstance(key, tuple):
            key = (key,)
        if len(key) > self.ndim:
            raise IndexError(f"too many indices: {len(key)} for a {self.ndim}-d DeviceArray")
        ptr, shape, strides = self.ptr, [], []
        for axis, k in enumerate(key):
            n, s = self.shape[axis], self.strides[axis]
            if isinstance(k, slice):
                start, stop, step = k.indices(n)
                if step <= 0:
                    raise IndexError(f"axis {axis}: DeviceArray slices need a positive step, got {step}")
                ptr += start * s
                shape.append(len(range(start, stop, step)))
                strides.append(s * step)
            elif isinstance(k, (int, np.integer)) and not isinstance(k, bool):
                i = int(k) + n if k < 0 else int(k)
                if not 0 <= i < n:
                    raise IndexError(f"index {int(k)} is out of bounds for axis {axis} of size {n}")
                ptr += i * s
            else:
                raise IndexError(f"DeviceArray supports integers and slices on leading axes, got {type(k).__name__}")
        shape += self.shape[len(key):]
        strides += self.strides[len(key):]
        # Parts of a checked array: the cheap constructor (the full one's conversions took ~2 us a slice).
        return DeviceArray.view(ptr, tuple(shape), self.dtype, tuple(strides), self.device, self._owner, self.stream)

    # ---- copies --------------------------------------------------------------
    def _span_bytes(self) -> int:
        """Bytes from `ptr` to the end of the last element the view can touch (strides >= 0)."""
        if self.size == 0:
            return 0
        return sum((n - 1) * s for n, s in zip(self.shape, self.strides)) + self.itemsize

    def get(self, stream=None) -> np.ndarray:
        """Copy to a new NumPy array (waits for the copy)."""
        st = as_stream(stream) if stream is not None else (self.stream or as_stream(None))
        span = self._span_bytes()
        raw = np.empty(span, dtype=np.uint8)
        if span:
            with on_device(self.device):
                call(cu.cuMemcpyDtoHAsync, raw.ctypes.data, self.ptr, span, st.handle)
                st.synchronize()
        if not span:
            return np.empty(self.shape, self.dtype)
        return np.ndarray(self.shape, self.dtype, buffer=raw, strides=self.strides).copy()

    def set(self, host: np.ndarray, stream=None) -> "DeviceArray":
        """Copy a NumPy array of the same shape and dtype into this (contiguous) array."""
        host = np.asarray(host)
        if host.shape != self.shape or host.dtype != self.dtype:
            raise ValueError(f"set: expected shape {self.shape} {self.dtype}, got {host.shape} {host.dtype}")
        if not self.is_contiguous:
            raise ValueError(f"set: the DeviceArray must be contiguous, its strides are {self.strides}")
        host = np.ascontiguousarray(host)
        st = as_stream(stream) if stream is not None else (self.stream or as_stream(None))
        if host.nbytes:
            with on_device(self.device):
                call(cu.cuMemcpyHtoDAsync, self.ptr, host.ctypes.data, host.nbytes, st.handle)
        self.stream = st
        return self

    # ---- CUDA Array Interface v3 -----------------------------------------------
    @property
    def __cuda_array_interface__(self) -> dict:
        producer = self.stream.ptr if self.stream is not None else LEGACY_DEFAULT
        return {
            "shape": self.shape,
            "typestr": typestr(self.dtype),
            "data": (self.ptr, False),
            "version": 3,
            "strides": None if self.is_contiguous else self.strides,
            # 0 is not allowed by the protocol; the legacy default stream is spelled 1.
            "stream": producer or _CU_STREAM_LEGACY,
        }

    # ---- DLPack ----------------------------------------------------------------
    def __dlpack_device__(self) -> tuple[int, int]:
        return (dlpack.KDL_CUDA, self.device.ordinal)

    def __dlpack__(self, *, stream=None, max_version=None, dl_device=None, copy=None):
        if dl_device is not None and tuple(dl_device) != self.__dlpack_device__():
            raise BufferError(f"__dlpack__: cannot export to device {tuple(dl_device)}; the array lives on {self.__dlpack_device__()}")
        if copy:
            raise BufferError("__dlpack__: copy=True is not supported; exports share memory")
        if stream is not None and stream != -1:
            self._order_before(stream)
        versioned = max_version is not None and tuple(max_version)[0] >= 1
        return dlpack.to_capsule(self, versioned=versioned)

    def _order_before(self, consumer: int) -> None:
        """Make the consumer stream wait for the work that produced this array."""
        producer = self.stream.ptr if self.stream is not None else LEGACY_DEFAULT
        if consumer in (_CU_STREAM_LEGACY, LEGACY_DEFAULT) and producer == LEGACY_DEFAULT:
            return
        if consumer == producer:
            return
        with on_device(self.device):
            event = Event().record(self.stream or as_stream(None))
            as_stream(consumer).wait(event)


# ---- constructors ------------------------------------------------------------
# Arguments are checked before anything touches the driver; each error names the function,
# the argument, what it takes and what came.
def _check_shape(fn: str, shape) -> tuple[int, ...]:
    dims = (shape,) if isinstance(shape, (int, np.integer)) else shape
    try:
        dims = tuple(dims)
    except TypeError:
        dims = None
    if dims is None or not all(isinstance(n, (int, np.integer)) and not isinstance(n, bool) for n in dims):
        raise TypeError(f"{fn}: shape: expected an int or a sequence of ints, got {shape!r}")
    if any(n < 0 for n in dims):
        raise ValueError(f"{fn}: shape: expected sizes >= 0, got {shape!r}")
    return tuple(int(n) for n in dims)


def _check_new(fn: str, shape, dtype, device) -> tuple[tuple[int, ...], np.dtype]:
    """The shape and dtype of a new array, checked, with its device argument."""
    shape, dt = _check_shape(fn, shape), normalize(dtype, f"{fn}: dtype")
    _check_device(fn, device)
    return shape, dt


def _check_device(fn: str, device) -> None:
    if device is None or isinstance(device, Device):
        return
    if isinstance(device, bool) or not isinstance(device, (int, np.integer)):
        raise TypeError(f"{fn}: device: expected None, a ptxattn.Device or a device ordinal (int), got {device!r}")


def _check_stream(fn: str, stream) -> Stream:
    try:
        return as_stream(stream)
    except TypeError as exc:
        raise TypeError(f"{fn}: {exc}") from None


def _device(device) -> Device:
    if device is None:
        return default_device()
    return device if isinstance(device, Device) else get_device(int(device))


def _new(shape: tuple[int, ...], dtype: np.dtype, device) -> DeviceArray:
    dev = _device(device)
    buffer = DeviceBuffer(int(np.prod(shape, dtype=np.int64)) * dtype.itemsize, dev)
    return DeviceArray(buffer.ptr, shape, dtype, None, dev, buffer)


def empty(shape, dtype, device=None) -> DeviceArray:
    """A new C-contiguous DeviceArray of `shape` and `dtype`, contents undefined.

    shape: an int or a sequence of ints >= 0. dtype: float16, bfloat16 (ptxattn.bfloat16 or
    "bfloat16"), float32, int32, int64, bool or uint8. device: a ptxattn.Device, an ordinal,
    or None for the current context's device (else device 0). Raises TypeError / ValueError
    for a bad argument (before touching the device) and OutOfMemoryError when the device
    cannot hold it.
    """
    shape, dt = _check_new("empty", shape, dtype, device)
    return _new(shape, dt, device)


def zeros(shape, dtype, device=None, stream=None) -> DeviceArray:
    """A new DeviceArray as `empty` makes it, filled with zeros asynchronously on `stream`
    (None: the legacy default stream; a ptxattn.Stream, an int handle or an object with
    __cuda_stream__); work on that stream, and `get()`, see the zeros."""
    shape, dt = _check_new("zeros", shape, dtype, device)
    st = _check_stream("zeros", stream)
    out = _new(shape, dt, device)
    if out.nbytes:
        with on_device(out.device):
            call(cu.cuMemsetD8Async, out.ptr, 0, out.nbytes, st.handle)
    out.stream = st
    return out


_KINDS: dict[type, str] = {}


def _kind_of_type(cls: type) -> str:
    """What a type's instances are, read from the class (so no property such as
    __cuda_array_interface__ runs: PyTorch's builds a dict and syncs streams)."""
    if issubclass(cls, DeviceArray):
        return "ptxattn"
    if issubclass(cls, np.ndarray):
        return "host"
    if cls.__module__.split(".")[0] == "torch" and hasattr(cls, "data_ptr"):
        return "torch"
    if hasattr(cls, "__cuda_array_interface__"):
        return "cai"
    if hasattr(cls, "__dlpack_device__"):
        return "dlpack"
    return "host"


def array_kind(obj, tensors_on_device: bool = False) -> str:
    """"ptxattn", "torch", "cai" (CUDA Array Interface) or "dlpack" for an array in device
    memory, "host" for anything else (NumPy, lists, CPU tensors). `tensors_on_device`: take
    a torch tensor to be a CUDA one unasked (the op path's importer checks it itself)."""
    cls = type(obj)
    kind = _KINDS.get(cls)
    if kind is None:
        kind = _KINDS[cls] = _kind_of_type(cls)
    if kind == "torch" and not tensors_on_device and not obj.is_cuda:
        return "host"
    if kind == "dlpack" and obj.__dlpack_device__()[0] not in (dlpack.KDL_CUDA, 13):
        return "host"
    return kind


def is_device_array_like(obj) -> bool:
    """True for DeviceArrays and foreign arrays that live on a CUDA device."""
    return array_kind(obj) != "host"


def from_dlpack(obj, stream=None) -> DeviceArray:
    """Zero-copy view of a device array exported through DLPack or the CUDA Array Interface
    (CuPy, PyTorch, JAX, ...). Work on `stream` is ordered after the producer's; while
    `stream` is capturing a graph nothing is ordered (the caller ordered its work on the
    capturing stream already, and a wait on uncaptured work would break the capture)."""
    from cuda.core.utils import StridedMemoryView

    st = _check_stream("from_dlpack", stream)
    consumer = -1 if st.ptr and st.is_capturing() else (st.ptr or _CU_STREAM_LEGACY)
    # cuda.core >= 1.2 spells the generic constructor from_any_interface.
    make = getattr(StridedMemoryView, "from_any_interface", None)
    view = make(obj, stream_ptr=consumer) if make else StridedMemoryView(obj, stream_ptr=consumer)
    if not view.is_device_accessible or view.device_id < 0:
        raise TypeError(f"from_dlpack: expected an array in device memory, got one on the host ({type(obj).__name__})")
    dtype = normalize(view.dtype, "from_dlpack: dtype")
    strides = None if view.strides is None else tuple(s * dtype.itemsize for s in view.strides)
    if strides is not None and any(s < 0 for s in strides):
        raise ValueError(f"from_dlpack: negative strides are not supported, got {strides}")
    return DeviceArray(view.ptr, view.shape, dtype, strides, get_device(view.device_id), (view, obj), st)


def asarray(obj, stream=None, device=None) -> DeviceArray:
    """A DeviceArray for `obj`, with no copy when it already lives on a device.

    - a DeviceArray: itself;
    - a foreign device array (DLPack or the CUDA Array Interface: CuPy, PyTorch, JAX, ...):
      a zero-copy view, with work on `stream` ordered after the producer's (from_dlpack);
    - host data (NumPy, or anything np.asarray takes) of a supported dtype (float16,
      bfloat16, float32, int32, int64, bool, uint8; convert float64 first): a contiguous
      copy on `device` (as in `empty`), uploaded asynchronously on `stream`.

    stream: None (the legacy default stream), a ptxattn.Stream, an int handle or an object
    with __cuda_stream__. Raises TypeError for a bad stream, device or dtype before any
    device work.
    """
    st = _check_stream("asarray", stream)
    _check_device("asarray", device)
    if isinstance(obj, DeviceArray):
        return obj
    if is_device_array_like(obj):
        return from_dlpack(obj, st)
    host = np.ascontiguousarray(obj)
    out = _new(host.shape, normalize(host.dtype, "asarray: obj's dtype"), device)
    return out.set(host, st)
