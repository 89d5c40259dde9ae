"""Tensor maps (CUtensorMap) for the TMA loads of the sm_90a warp-specialized sdpa kernels (and
the persistent twin's store of its output).

A dense q, k or v of shape [B, H, S, D] is described to the TMA unit as a 4-D tensor over
(dim, token, head, batch), innermost first, with byte strides, and a box of one 128-byte
panel (64 columns of a 16-bit element, the width of the 128-byte swizzle the kernels' shared
memory uses) by a tile's rows. The kernel copies tile panels through the map
(cu/flash_fwd_sm90_ws.cuh, tma_tile); rows past S and columns past D arrive as zeros (and a
store writes none past them). An output is mapped as q is, in boxes of a consumer's 64 rows;
an attention mask [B, Hq, Sq, Skv] (16-bit or bool: 128 columns a panel) the same way, its
keys in place of D (a staged mask).

`spec(arr, rows)` says whether an array can be loaded that way (and how), `encode(address,
spec, ordinal)` returns the map's 128 bytes. A map holds the array's address, so a call
rewrites its maps whenever it rewrites its pointers; `encode` caches them by its arguments, so
calls on the same buffers reuse a map rather than asking the driver again (and need no
context current: only an encode does).
"""
from __future__ import annotations

import ctypes
import functools
from typing import NamedTuple

import numpy as np

from .context import on_device
from .device import get_device
from .driver import hot
from .dtypes import bfloat16

__all__ = ["MAP_BYTES", "PANEL_BYTES", "MapSpec", "MapSlot", "spec", "layout_spec", "encode"]

MAP_BYTES = 128  # sizeof(CUtensorMap)
PANEL_BYTES = 128  # a box's row: the width of the kernels' 128-byte swizzle
_MAX_BOX = 256  # rows a box may cover
_MAX_STRIDE = 1 << 40  # bytes (cuTensorMapEncodeTiled's bound on a stride)
# CUtensorMapDataType of each dtype the kernels load by TMA (bool: a staged mask's bytes).
_DATA_TYPE = {np.dtype(np.float16): 6, bfloat16: 9, np.dtype(np.bool_): 0}


class MapSpec(NamedTuple):
    """Everything of a map but its address: CUtensorMapDataType, dims (D, S, H, B), the byte
    strides of token, head and batch, the box's rows and its columns (a 128-byte panel)."""
    data_type: int
    dims: tuple[int, int, int, int]
    strides: tuple[int, int, int]
    rows: int
    cols: int


def spec(arr, rows: int) -> MapSpec | None:
    """The map of a [B, H, S, D] array loaded in boxes of `rows` rows (layout_spec)."""
    return layout_spec(arr.dtype, arr.ptr, arr.shape, arr.element_strides, rows)


def layout_spec(dtype, ptr: int, shape, element_strides, rows: int) -> MapSpec | None:
    """The map of the [B, H, S, D] elements of `dtype` at `ptr` with those element strides
    (a mask: [B, Hq, Sq, Skv], its keys in a map's D), loaded in boxes of `rows` rows, or None
    where TMA cannot load it: an empty axis, a dtype other than f16 / bf16 / bool, a base off 16
    bytes, a last axis not contiguous, or a token, head or batch stride (of an axis longer than
    1) that is not a positive multiple of 16 bytes below 2^40. An axis of length 1 is never
    stepped, so its stride is replaced by one TMA accepts."""
    data_type = _DATA_TYPE.get(np.dtype(dtype))
    if data_type is None or ptr % 16 or element_strides[3] != 1 or not 0 < rows <= _MAX_BOX:
        return None
    b, h, s, d = shape
    if 0 in shape:  # a map's dims are positive (a call without keys copies nothing anyway)
        return None
    itemsize = np.dtype(dtype).itemsize
    strides = []
    span = d * itemsize  # bytes up to the next axis, if it were packed
    for n, element_stride in ((s, element_strides[2]), (h, element_strides[1]), (b, element_strides[0])):
        stride = element_stride * itemsize
        if n == 1:
            stride = -(-span // 16) * 16
        elif stride <= 0 or stride % 16 or stride >= _MAX_STRIDE:
            return None
        strides.append(stride)
        span = max(span, stride * n)
    return MapSpec(data_type, (d, s, h, b), tuple(strides), rows, PANEL_BYTES // itemsize)


@functools.lru_cache(maxsize=1024)
def encode(address: int, map_spec: MapSpec, ordinal: int) -> bytes:
    """The 128 bytes of `map_spec`'s map of the tensor at `address` on device `ordinal`
    (cuTensorMapEncodeTiled, in a context of that device, which the driver requires; a failure
    raises CudaError naming the call)."""
    with on_device(get_device(ordinal)):
        return hot().encode_tensor_map(map_spec.data_type, address, map_spec.dims, map_spec.strides,
                                       (map_spec.cols, map_spec.rows, 1, 1))


class MapSlot:
    """A slot of Binding.slots that holds a tensor map rather than an address: a call that
    writes an array's address to its slots (`slot.value = address`) writes the array's map
    here instead (at `dst`, a map field of a parameter struct)."""

    __slots__ = ("dst", "map_spec", "ordinal", "address")

    def __init__(self, dst: int, map_spec: MapSpec, ordinal: int) -> None:
        # A byte view of the field: assigning to a slice of it costs a sixth of a ctypes.memmove.
        self.dst = memoryview((ctypes.c_ubyte * MAP_BYTES).from_address(dst)).cast("B")
        self.map_spec, self.ordinal, self.address = map_spec, ordinal, None

    def _write(self, address: int) -> None:
        if address != self.address:  # calls on the same buffers keep their map
            self.dst[:] = encode(address, self.map_spec, self.ordinal)
            self.address = address

    value = property(None, _write, doc="Write-only: the address of the array whose map goes to `dst`.")
