"""Taking a host framework's device arrays into an op call, fast and capture-safe.

An op called per layer per token cannot afford a DLPack export per argument (PyTorch's
`__dlpack__` alone costs microseconds, and its stream handshake is illegal while a graph is
being captured). So the op path reads the few facts it needs straight from the array:
PyTorch tensors through their accessors, anything with `__cuda_array_interface__` (CuPy,
Numba, ...) through that dict, everything else through DLPack (`array.from_dlpack`).

Ordering follows DLPack's contract, once per call rather than once per array: work the
producer queued on its current stream comes before ours (one event), unless it is our
stream already, or our stream is capturing a graph (then the caller ordered its work on the
capturing stream, and a wait on uncaptured work would break the capture).
"""
from __future__ import annotations

import sys
import threading
import weakref

import numpy as np

from .array import DeviceArray, from_dlpack
from .device import get_device
from .driver import call, cu, hot
from .dtypes import normalize
from .stream import LEGACY_DEFAULT, Stream

__all__ = ["import_device_array", "producer_streams", "order_after_producers", "NotOnDevice"]

_CAI_LEGACY, _CAI_PER_THREAD = 1, 2
_PER_THREAD_STREAM = 2  # CU_STREAM_PER_THREAD
_torch_dtypes: dict = {}
_cupy_dtypes: dict = {}


def _torch_dtype(dtype) -> np.dtype:
    found = _torch_dtypes.get(dtype)
    if found is None:
        name = str(dtype).removeprefix("torch.")
        found = _torch_dtypes[dtype] = normalize(name, "dtype of a torch tensor")
    return found


def _torch_current_stream(index: int) -> int:
    torch = sys.modules["torch"]
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)  # ~20x cheaper than the public call
    return raw(index) if raw is not None else torch.cuda.current_stream(index).cuda_stream


class NotOnDevice(Exception):
    """A tensor taken for a CUDA one (array_kind(tensors_on_device=True)) is on the host."""


_seen = threading.local()  # per thread: id(tensor) -> (weak reference, dtype, the parts of its view)
_SEEN_ENTRIES = 1024


def _from_torch(t, producers: set) -> DeviceArray:
    """Straight from the tensor's accessors: DLPack's export alone costs more than the call.
    A host passes the same tensors every step, so what was read of one is kept (weakly) and
    reused after checking what can change in place: address, dtype, shape and strides."""
    try:
        seen = _seen.tensors
    except AttributeError:
        seen = _seen.tensors = {}
    hit = seen.get(id(t))
    if hit is not None:
        ref, torch_dtype, (ptr, shape, dtype, strides, device, meta) = hit
        if ref() is t and t.dtype is torch_dtype and t.data_ptr() == ptr and t.stride() == meta[1] \
                and t.shape == shape:
            arr = DeviceArray.view(ptr, shape, dtype, strides, device, t)
            arr._meta = meta
            producers.add(("torch", meta[3]))
            return arr
    index = t.get_device()
    if index < 0:
        raise NotOnDevice
    torch_dtype = t.dtype
    dtype = _torch_dtypes.get(torch_dtype) or _torch_dtype(torch_dtype)
    ptr, shape, element_strides = t.data_ptr(), tuple(t.shape), t.stride()
    strides = tuple([s * dtype.itemsize for s in element_strides])
    meta = (shape, element_strides, dtype, index, min(ptr & -ptr, 256) if ptr else 256)  # as DeviceArray.meta
    parts = (ptr, shape, dtype, strides, get_device(index), meta)
    if len(seen) >= _SEEN_ENTRIES:
        del seen[next(iter(seen))]
    seen[id(t)] = (weakref.ref(t), torch_dtype, parts)
    arr = DeviceArray.view(*parts[:5], t)
    arr._meta = meta
    producers.add(("torch", index))
    return arr


def _from_cupy(a, producers: set) -> DeviceArray:
    """Straight from the array's attributes; its producer is CuPy's current stream."""
    ptr, shape, strides = a.data.ptr, a.shape, a.strides
    dtype = _cupy_dtypes.get(a.dtype) or _cupy_dtypes.setdefault(a.dtype, normalize(a.dtype, "dtype of a CuPy array"))
    index = a.data.device_id
    itemsize = dtype.itemsize
    arr = DeviceArray.view(ptr, shape, dtype, strides, get_device(index), a)
    arr._meta = (shape, tuple([s // itemsize for s in strides]), dtype, index,
                 min(ptr & -ptr, 256) if ptr else 256)  # as DeviceArray.meta
    producers.add(("cupy", index))
    return arr


def _from_cai(obj, producers: set) -> DeviceArray:
    cai = obj.__cuda_array_interface__
    ptr = cai["data"][0] or 0
    shape = tuple(cai["shape"])
    dtype = normalize(np.dtype(cai["typestr"]), "dtype of a __cuda_array_interface__ array")
    strides = cai.get("strides")
    if strides is None:
        strides, step = [], dtype.itemsize
        for n in reversed(shape):
            strides.append(step)
            step *= max(n, 1)
        strides.reverse()
    device = getattr(obj, "device", None)
    ordinal = getattr(device, "id", None)
    if ordinal is None:
        ordinal = int(call(cu.cuPointerGetAttribute, cu.CUpointer_attribute.CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, ptr))
    stream = cai.get("stream")
    if stream is not None:
        producers.add({_CAI_LEGACY: LEGACY_DEFAULT, _CAI_PER_THREAD: _PER_THREAD_STREAM}.get(stream, stream))
    return DeviceArray.view(ptr, shape, dtype, tuple(strides), get_device(ordinal), obj)


def import_device_array(obj, kind: str, stream: Stream, producers: set) -> DeviceArray:
    """A DeviceArray over a foreign device array of `kind` (array.array_kind; no copy). What
    produced it is added to `producers` (see `producer_streams`); DLPack imports order
    themselves."""
    if kind == "torch":
        return _from_torch(obj, producers)
    if kind == "cai" and type(obj).__module__.split(".")[0] == "cupy":
        return _from_cupy(obj, producers)
    if kind == "cai":
        try:
            return _from_cai(obj, producers)
        except TypeError:
            pass  # a dtype the interface cannot spell (bfloat16): DLPack can
    return from_dlpack(obj, stream)


_events = threading.local()  # per thread, per context: a wait reads the event when it is queued


def _event():
    context = hot().current_context()
    events = _events.__dict__.setdefault("by_context", {})
    event = events.get(context)
    if event is None:
        event = events[context] = call(cu.cuEventCreate, cu.CUevent_flags.CU_EVENT_DISABLE_TIMING)
    return event


def producer_streams(producers: set) -> set[int]:
    """The stream handles behind `producers`: handles already, or (framework, device) pairs
    whose current stream is asked once per call rather than once per array."""
    streams = set()
    for producer in producers:
        if type(producer) is int:
            streams.add(producer)
        elif producer[0] == "torch":
            streams.add(_torch_current_stream(producer[1]))
        else:
            streams.add(sys.modules["cupy"].cuda.get_current_stream(producer[1]).ptr)
    return streams


def order_after_producers(stream: Stream, producers: set[int]) -> None:
    """Make `stream` wait for the work queued so far on each producer stream (not itself).
    Call in the context of the arrays' device."""
    for producer in producers:
        if producer == stream.ptr:
            continue
        event = _event()
        call(cu.cuEventRecord, event, cu.CUstream(producer))
        call(cu.cuStreamWaitEvent, stream.handle, event, 0)
