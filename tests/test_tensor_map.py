"""tensor_map.spec: which [B, H, S, D] arrays the warp-specialized kernels can load by TMA, and
the map (dims innermost first, byte strides, box rows) each gets. No GPU."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from ptxattn import bfloat16
from ptxattn.tensor_map import MapSpec, spec

BF16_TYPE, F16_TYPE = 9, 6  # CUtensorMapDataType


def array(shape, element_strides=None, dtype=bfloat16, ptr=0x10000):
    if element_strides is None:
        element_strides, step = [], 1
        for n in reversed(shape):
            element_strides.insert(0, step)
            step *= n
    return SimpleNamespace(ptr=ptr, shape=tuple(shape), element_strides=tuple(element_strides), dtype=np.dtype(dtype))


def test_a_dense_array_maps_as_dim_token_head_batch():
    assert spec(array((2, 8, 300, 128)), 128) == MapSpec(BF16_TYPE, (128, 300, 8, 2), (256, 300 * 256, 8 * 300 * 256),
                                                         128, 64)
    assert spec(array((2, 8, 300, 64), dtype=np.float16), 192).data_type == F16_TYPE


def test_a_token_major_layout_keeps_its_strides():
    # [B, S, H, D] storage seen as [B, H, S, D]: token stride H * D, head stride D.
    arr = array((2, 8, 300, 128), (300 * 8 * 128, 128, 8 * 128, 1))
    assert spec(arr, 128) == MapSpec(BF16_TYPE, (128, 300, 8, 2), (8 * 256, 256, 300 * 8 * 256), 128, 64)


def test_axes_of_length_one_get_a_stride_tma_accepts():
    # Their strides are never stepped; whatever they were (here 3 and 5 elements), the map
    # gets the packed one, a multiple of 16 bytes.
    got = spec(array((1, 1, 300, 128), (3, 5, 128, 1)), 128)
    assert got is not None and got.strides == (256, 300 * 256, 300 * 256), got


def test_a_bool_mask_maps_128_keys_a_box_row():
    # A staged attention mask [B, 1, Sq, Skv] of bytes: its keys in the map's D.
    mask = array((2, 1, 300, 512), dtype=np.bool_)
    assert spec(mask, 128) == MapSpec(0, (512, 300, 1, 2), (512, 300 * 512, 300 * 512), 128, 128)


@pytest.mark.parametrize("why, arr, rows", [
    ("no keys", array((1, 2, 0, 128)), 128),
    ("float32", array((2, 8, 300, 128), dtype=np.float32), 128),
    ("base off 16 bytes", array((2, 8, 300, 128), ptr=0x10008), 128),
    ("last axis strided", array((2, 8, 300, 64), (8 * 300 * 128, 300 * 128, 128, 2)), 128),
    ("token stride off 16 bytes", array((2, 8, 300, 128), (8 * 300 * 132, 300 * 132, 132, 1)), 128),
    ("broadcast heads", array((2, 8, 300, 128), (300 * 128, 0, 128, 1)), 128),
    ("box over 256 rows", array((2, 8, 300, 128)), 257),
])
def test_arrays_tma_cannot_load_get_no_map(why, arr, rows):
    assert spec(arr, rows) is None, why
