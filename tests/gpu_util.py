"""Helpers for GPU tests: NaN-poisoned outputs framed by canaries, error bounds, and a test
run in a fresh process under another arch's PTX."""
from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

import ptxattn
from ptxattn.arch import ARCH_ENV, runs_on

CANARY = 1024  # elements of guard on each side of an output


class GuardedOutput:
    """An output DeviceArray poisoned before the kernel runs (NaN, or -12345 for integer
    dtypes), inside a larger buffer whose margins hold a known pattern. GPU tests read results
    back from one rather than from a fresh output: compute-sanitizer's initcheck does not count
    TMA stores (the sm_90 kernels' epilogues) as writes, so it flags a fresh output's read-back."""

    def __init__(self, shape, dtype, rng: np.random.Generator, device=None) -> None:
        dtype = np.dtype(dtype)
        size = int(np.prod(shape, dtype=np.int64))
        self.floating = dtype.kind == "f" or dtype == ptxattn.bfloat16
        if self.floating:
            self.margin = rng.standard_normal(2 * CANARY).astype(np.float32).astype(dtype)
            poison = np.full(size, np.nan, dtype=np.float32).astype(dtype)
        else:
            self.margin = rng.integers(0, 100, 2 * CANARY).astype(dtype)
            poison = np.full(size, -12345, dtype=dtype)
        host = np.concatenate([self.margin[:CANARY], poison, self.margin[CANARY:]])
        self.whole = ptxattn.asarray(host, device=device)
        self.array = ptxattn.DeviceArray(self.whole.ptr + CANARY * dtype.itemsize, shape, dtype, None,
                                         self.whole.device, self.whole)
        self.size = size

    def check(self, nan_allowed: bool = False) -> np.ndarray:
        """The output as NumPy, after asserting the canaries are intact (nothing outside the
        output was written) and, for a floating output, that no element is NaN (each was
        written, with a number). A test that expects NaN somewhere passes nan_allowed=True
        and checks those elements itself."""
        host = self.whole.get(self.array.stream)
        before, out, after = host[:CANARY], host[CANARY:CANARY + self.size], host[CANARY + self.size:]
        assert np.array_equal(before.view(np.uint8), self.margin[:CANARY].view(np.uint8)), "write before the output"
        assert np.array_equal(after.view(np.uint8), self.margin[CANARY:].view(np.uint8)), "write past the output"
        out = out.reshape(self.array.shape)
        if self.floating and not nan_allowed:
            nan = np.isnan(out.astype(np.float32))
            assert not nan.any(), (f"{int(nan.sum())} of {out.size} output elements are NaN (unwritten or "
                                   f"computed), the first at {np.unravel_index(nan.argmax(), out.shape)}")
        return out


def relative_error(out, ref) -> float:
    out = np.asarray(out, dtype=np.float64)
    ref = np.asarray(ref, dtype=np.float64)
    assert not np.isnan(out).any(), "NaN in the output"
    denom = np.linalg.norm(ref)
    return float(np.linalg.norm(out - ref) / (denom if denom > 0 else 1.0))


# ‖out − ref‖ / ‖ref‖ bounds per input dtype (fp32 accumulation throughout).
REL_TOL = {np.dtype(np.float32): 1e-5, np.dtype(np.float16): 2e-3, ptxattn.bfloat16: 1.6e-2}


def run_under_arch(test: str, arch: str) -> None:
    """Runs the test `test` (a pytest node id) in a fresh process with PTXATTN_ARCH=arch (the
    choice holds for a process) and asserts it passed; skips where the device cannot run that
    arch's PTX, and in a run that is itself a PTXATTN_ARCH pass."""
    if os.environ.get(ARCH_ENV):
        pytest.skip(f"this run is the {ARCH_ENV}={os.environ[ARCH_ENV]} pass; the per-arch processes run in the "
                    f"default one")
    device = ptxattn.get_device(0)
    if not runs_on(arch, device.compute_capability):
        pytest.skip(f"{device.name} (compute capability {device.compute_capability}) cannot run {arch} PTX")
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", test],
                          capture_output=True, text=True, env={**os.environ, ARCH_ENV: arch}, timeout=600)
    assert done.returncode == 0 and "1 passed" in done.stdout, done.stdout[-4000:] + done.stderr[-2000:]
