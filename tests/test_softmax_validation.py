"""Every bad softmax / log_softmax argument is refused with an error naming it, before any
device work. The device arrays here point at no memory: validation must not touch them."""
from __future__ import annotations

import numpy as np
import pytest

import ptxattn
from ptxattn import DeviceArray, Device

OPS = [ptxattn.softmax, ptxattn.log_softmax]
FAKE_DEVICE = Device(ordinal=0, name="validation-only", compute_capability=(9, 0), sm_count=1,
                     total_memory=0, max_shared_per_block_optin=0, l2_bytes=0)


def fake_device_array(shape, dtype=np.float32, strides=None) -> DeviceArray:
    return DeviceArray(0x10000, shape, dtype, strides, FAKE_DEVICE, owner=None)


@pytest.fixture(params=OPS, ids=lambda op: op.__name__)
def op(request):
    return request.param


@pytest.mark.parametrize("dtype", [np.float64, np.int32, np.bool_])
def test_dtype(op, dtype):
    with pytest.raises(TypeError, match=f"{op.__name__}: x must be float16, bfloat16 or float32, got {np.dtype(dtype)}"):
        op(np.ones((2, 3), dtype))


@pytest.mark.parametrize("axis", [2, -3, 100])
def test_axis_out_of_range(op, axis):
    with pytest.raises(ValueError, match=rf"axis must be in \[-2, 2\) for a 2-d x, got {axis}"):
        op(np.ones((2, 3), np.float32), axis)


@pytest.mark.parametrize("axis", [1.0, True, None, (0,)])
def test_axis_not_an_int(op, axis):
    with pytest.raises(TypeError, match="axis must be an int"):
        op(np.ones((2, 3), np.float32), axis)


def test_zero_dimensional(op):
    with pytest.raises(ValueError, match="x must have at least 1 dimension"):
        op(np.float32(1.0))


@pytest.mark.parametrize("out", [np.empty((3, 2), np.float32), np.empty((2, 3), np.float16)])
def test_host_out_mismatch(op, out):
    with pytest.raises(ValueError, match=r"out must be \(2, 3\) float32"):
        op(np.ones((2, 3), np.float32), out=out)


@pytest.mark.parametrize("shape, dtype", [((3, 2), np.float32), ((2, 3), ptxattn.bfloat16)])
def test_device_out_mismatch(op, shape, dtype):
    with pytest.raises(ValueError, match=r"out must be \(2, 3\) float32"):
        op(fake_device_array((2, 3)), out=fake_device_array(shape, dtype))


def test_non_contiguous_device_input(op):
    transposed = fake_device_array((3, 2), strides=(4, 12))
    with pytest.raises(ValueError, match=r"x must be a contiguous \(C-order\) device array"):
        op(transposed)


def test_non_contiguous_device_out(op):
    every_other_row = fake_device_array((2, 3), strides=(24, 4))
    with pytest.raises(ValueError, match=r"out must be a contiguous \(C-order\) device array"):
        op(fake_device_array((2, 3)), out=every_other_row)


def test_host_and_device_arrays_mixed(op):
    with pytest.raises(TypeError, match="all NumPy .*out on the device but x on the host"):
        op(np.ones((2, 3), np.float32), out=fake_device_array((2, 3)))
