"""Exporting a DeviceArray as a DLPack capsule (legacy and versioned 1.x).

Importing goes through cuda.core's StridedMemoryView (see array.from_dlpack); exporting has
no library equivalent for a raw device pointer, so the few C structs are declared here.
"""
from __future__ import annotations

import ctypes

from .dtypes import dlpack_code

KDL_CUDA = 2
_LEGACY_NAME = b"dltensor"
_VERSIONED_NAME = b"dltensor_versioned"


class _Device(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _Tensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p), ("device", _Device), ("ndim", ctypes.c_int32),
        ("dtype", _DataType), ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)), ("byte_offset", ctypes.c_uint64),
    ]


class _Managed(ctypes.Structure):
    pass


_Deleter = ctypes.CFUNCTYPE(None, ctypes.c_void_p)
_Managed._fields_ = [("dl_tensor", _Tensor), ("manager_ctx", ctypes.c_void_p), ("deleter", _Deleter)]


class _Version(ctypes.Structure):
    _fields_ = [("major", ctypes.c_uint32), ("minor", ctypes.c_uint32)]


class _ManagedVersioned(ctypes.Structure):
    _fields_ = [
        ("version", _Version), ("manager_ctx", ctypes.c_void_p), ("deleter", _Deleter),
        ("flags", ctypes.c_uint64), ("dl_tensor", _Tensor),
    ]


# Everything a live capsule points at, keyed by the managed struct's address, until the
# consumer (or the capsule's destructor, if never consumed) calls the deleter.
_alive: dict[int, tuple] = {}


@_Deleter
def _delete(address):
    _alive.pop(address, None)


_PyCapsule_New = ctypes.pythonapi.PyCapsule_New
_PyCapsule_New.restype = ctypes.py_object
_PyCapsule_New.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
# The destructor receives a capsule whose reference count is already zero: it must be
# handled as a raw pointer, never as a Python object (that would revive and free it twice).
_PyCapsule_IsValid = ctypes.PYFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_char_p)(
    ("PyCapsule_IsValid", ctypes.pythonapi))
_PyCapsule_GetPointer = ctypes.PYFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p, ctypes.c_char_p)(
    ("PyCapsule_GetPointer", ctypes.pythonapi))

_CapsuleDestructor = ctypes.CFUNCTYPE(None, ctypes.c_void_p)


def _make_destructor(name: bytes):
    @_CapsuleDestructor
    def destructor(capsule):
        # A consumer renames the capsule ("used_dltensor...") and owns the deleter from then
        # on; a capsule never consumed still holds its name, so we free it here.
        if _PyCapsule_IsValid(capsule, name):
            _delete(_PyCapsule_GetPointer(capsule, name))
    return destructor


_destructors = {name: _make_destructor(name) for name in (_LEGACY_NAME, _VERSIONED_NAME)}


def to_capsule(array, versioned: bool, read_only: bool = False):
    """A DLPack capsule over `array`'s memory that keeps `array` alive until deleted."""
    ndim = array.ndim
    shape = (ctypes.c_int64 * max(ndim, 1))(*array.shape)
    strides = (ctypes.c_int64 * max(ndim, 1))(*(s // array.itemsize for s in array.strides))
    code, bits = dlpack_code(array.dtype)
    managed = _ManagedVersioned() if versioned else _Managed()
    tensor = managed.dl_tensor
    tensor.data = array.ptr
    tensor.device = _Device(KDL_CUDA, array.device.ordinal)
    tensor.ndim = ndim
    tensor.dtype = _DataType(code, bits, 1)
    tensor.shape = ctypes.cast(shape, ctypes.POINTER(ctypes.c_int64))
    tensor.strides = ctypes.cast(strides, ctypes.POINTER(ctypes.c_int64))
    tensor.byte_offset = 0
    managed.deleter = _delete
    if versioned:
        managed.version = _Version(1, 0)
        managed.flags = 1 if read_only else 0  # DLPACK_FLAG_BITMASK_READ_ONLY
    address = ctypes.addressof(managed)
    _alive[address] = (managed, shape, strides, array)
    name = _VERSIONED_NAME if versioned else _LEGACY_NAME
    return _PyCapsule_New(address, name, ctypes.cast(_destructors[name], ctypes.c_void_p))
