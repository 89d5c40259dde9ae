"""The software float32 -> fp8 conversion of cu/kv_cache.cu (fp8_from_float: what the
quantizing append runs on sm_80 / sm_86, where cvt.rn.satfinite does not exist), compiled for
the host from the kernel source itself and checked byte for byte against the reference's
rounding (reference.quantize_fp8: saturate, then ml_dtypes' round to nearest even) over every
float16 and bfloat16 value, the fp8 types' rounding midpoints and their float32 neighbours,
infinities, NaN and random float32 bit patterns. (Run once over all 2^32 float32 values when
it was written: no difference.) No GPU; skipped without a C++ compiler."""
from __future__ import annotations

import ctypes
import re
import shutil
import subprocess
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from ptxattn import reference
from ptxattn.dtypes import FP8

SOURCE = Path(__file__).resolve().parent.parent / "cu" / "kv_cache.cu"
# Host stand-ins for the few device intrinsics fp8_from_float uses.
PRELUDE = """#include <math.h>
#include <string.h>
#define __device__
#define __forceinline__ inline
static unsigned __float_as_uint(float x) { unsigned u; memcpy(&u, &x, 4); return u; }
static unsigned __float2uint_rn(float x) { return (unsigned)nearbyintf(x); }
"""
ENTRY = """
extern "C" void convert(const float* x, unsigned char* out, long n, int e5m2) {
  for (long i = 0; i < n; ++i) out[i] = e5m2 ? fp8_from_float<Fp8::e5m2>(x[i]) : fp8_from_float<Fp8::e4m3>(x[i]);
}
"""


@pytest.fixture(scope="module")
def convert(tmp_path_factory):
    compiler = shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
    if compiler is None:
        pytest.skip("no C++ compiler on this machine")
    text = SOURCE.read_text()
    pieces = [re.search(pattern, text, re.S).group(0) for pattern in (
        r"enum class Fp8 \{[^}]*\};", r"template <Fp8 F> constexpr float kFp8Max = [^;]*;",
        r"template <Fp8 F> __device__ __forceinline__ unsigned fp8_from_float\(float x\) \{.*?\n\}")]
    folder = tmp_path_factory.mktemp("fp8_convert")
    (folder / "convert.cpp").write_text(PRELUDE + "\n".join(pieces) + ENTRY)
    subprocess.run([compiler, "-O2", "-std=c++17", "-shared", "-fPIC", "convert.cpp", "-o", "convert.so"],
                   cwd=folder, check=True, capture_output=True)
    lib = ctypes.CDLL(str(folder / "convert.so"))

    def run(x: np.ndarray, fp8) -> np.ndarray:
        x = np.ascontiguousarray(x, np.float32)
        out = np.empty(x.shape, np.uint8)
        lib.convert(x.ctypes.data_as(ctypes.c_void_p), out.ctypes.data_as(ctypes.c_void_p), ctypes.c_long(x.size),
                    int(fp8 == FP8[1]))
        return out.view(fp8)

    return run


def inputs(fp8) -> np.ndarray:
    every16 = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    values = [every16.view(np.float16).astype(np.float32), every16.view(ml_dtypes.bfloat16).astype(np.float32)]
    grid = np.sort(np.arange(256, dtype=np.uint8).view(fp8).astype(np.float32))
    grid = grid[np.isfinite(grid)]
    fmax = np.float32(ml_dtypes.finfo(fp8).max)
    midpoints = (grid[1:] + grid[:-1]) / 2  # exact in float32
    edges = np.concatenate([midpoints, grid, np.array([fmax * 1.0625, fmax * 1.125, 1e30, np.inf, np.nan], np.float32)])
    edges = np.concatenate([edges, -edges])
    bits = edges.view(np.uint32)
    values += [edges, (bits + 1).view(np.float32), (bits - 1).view(np.float32)]
    values.append(np.random.default_rng(0).integers(0, 1 << 32, 1 << 20, dtype=np.uint64).astype(np.uint32)
                  .view(np.float32))
    return np.concatenate(values)


@pytest.mark.parametrize("fp8", FP8, ids=["e4m3", "e5m2"])
def test_software_conversion_is_the_reference_rounding(convert, fp8):
    x = inputs(fp8)
    got, want = convert(x, fp8), reference.quantize_fp8(x, 1.0, fp8)
    nan = np.isnan(x)
    assert np.isnan(got[nan].astype(np.float32)).all(), "NaN must stay NaN"
    differ = np.flatnonzero(got[~nan].view(np.uint8) != want[~nan].view(np.uint8))
    assert differ.size == 0, (f"{differ.size} values differ, e.g. {x[~nan][differ[:4]]} -> "
                              f"{got[~nan][differ[:4]].view(np.uint8)}, want {want[~nan][differ[:4]].view(np.uint8)}")
