"""empty / zeros / asarray refuse a bad shape, dtype, device or stream before any device work,
with an error naming the function, the argument, what it takes and what came."""
from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

import ptxattn
from ptxattn import array
from ptxattn.device import Device

FAKE_DEVICE = Device(0, "fake", (9, 0), 132, 1 << 30, 227 << 10, 50 << 20)
SUPPORTED = "expected one of float16, bfloat16, float32, int32, int64, bool, uint8, float8_e4m3fn, float8_e5m2"


@pytest.fixture
def no_device_work(monkeypatch):
    """Every way ptxattn.array reaches the driver fails the test instead."""
    def reached(*args, **kwargs):
        raise AssertionError("reached the device before the arguments were checked")

    for name in ("call", "on_device", "default_device", "get_device", "DeviceBuffer"):
        monkeypatch.setattr(array, name, reached)


def test_the_fixture_sees_device_work(no_device_work):
    with pytest.raises(AssertionError, match="reached the device"):
        ptxattn.empty((2,), np.float32)


@pytest.mark.parametrize("make", ["empty", "zeros"])
@pytest.mark.parametrize("shape, error, message", [
    ((-1,), ValueError, r"shape: expected sizes >= 0, got \(-1,\)"),
    ((2, -3), ValueError, r"shape: expected sizes >= 0, got \(2, -3\)"),
    (-1, ValueError, r"shape: expected sizes >= 0, got -1"),
    ((2.5,), TypeError, r"shape: expected an int or a sequence of ints, got \(2\.5,\)"),
    (2.5, TypeError, r"shape: expected an int or a sequence of ints, got 2\.5"),
    ("abc", TypeError, r"shape: expected an int or a sequence of ints, got 'abc'"),
    (None, TypeError, r"shape: expected an int or a sequence of ints, got None"),
    ((True,), TypeError, r"shape: expected an int or a sequence of ints, got \(True,\)"),
])
def test_bad_shape(no_device_work, make, shape, error, message):
    with pytest.raises(error, match=f"^{make}: {message}$"):
        getattr(ptxattn, make)(shape, np.float32)


@pytest.mark.parametrize("make", ["empty", "zeros"])
@pytest.mark.parametrize("dtype, shown", [
    (np.float64, "float64"), (np.complex64, "complex64"), (complex, "complex128"), (object, "object"),
    ("nonsense", "'nonsense'"), (None, "None"),
])
def test_bad_dtype_lists_the_supported_ones(no_device_work, make, dtype, shown):
    with pytest.raises(TypeError, match=f"^{make}: dtype: {SUPPORTED}, got {shown}$"):
        getattr(ptxattn, make)((2, 3), dtype)


@pytest.mark.parametrize("make", ["empty", "zeros", "asarray"])
@pytest.mark.parametrize("device", ["x", 1.0, True])
def test_bad_device(no_device_work, make, device):
    first = np.zeros(2, np.float32) if make == "asarray" else (2,)
    args = (first,) if make == "asarray" else (first, np.float32)
    with pytest.raises(TypeError, match=rf"^{make}: device: expected None, a ptxattn\.Device or a device "
                                        rf"ordinal \(int\), got {device!r}$"):
        getattr(ptxattn, make)(*args, device=device)


@pytest.mark.parametrize("make, args", [
    ("zeros", ((2,), np.float32)),
    ("asarray", (np.zeros(2, np.float32),)),
    ("asarray", (array.DeviceArray(0x1000, (2,), np.float32, None, FAKE_DEVICE, owner=None),)),
    ("from_dlpack", (np.zeros(2, np.float32),)),
])
def test_bad_stream(no_device_work, make, args):
    with pytest.raises(TypeError, match=f"^{make}: stream: expected None, a ptxattn.Stream, .* got str$"):
        getattr(array, make)(*args, stream="abc")


@pytest.mark.parametrize("data, shown", [
    (np.zeros(3), "float64"), ([1.5, 2.5], "float64"), (np.zeros(2, np.complex64), "complex64"),
    (np.array([None]), "object"),
])
def test_asarray_of_unsupported_host_data(no_device_work, data, shown):
    with pytest.raises(TypeError, match=f"^asarray: obj's dtype: {SUPPORTED}, got {shown}$"):
        ptxattn.asarray(data)


def test_reference_is_an_attribute_of_the_package():
    code = "import ptxattn, numpy as np; print(ptxattn.reference.softmax(np.zeros(4))[0])"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0 and proc.stdout.strip() == "0.25", proc.stderr
