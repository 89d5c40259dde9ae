"""Helpers for GPU tests: NaN-poisoned outputs framed by canaries, and error bounds."""
from __future__ import annotations

import numpy as np

import ptxattn

CANARY = 1024  # elements of guard on each side of an output


class GuardedOutput:
    """An output DeviceArray filled with NaN, inside a larger buffer whose margins hold a
    known pattern; `check()` proves nothing outside the output was written."""

    def __init__(self, shape, dtype, rng: np.random.Generator, device=None) -> None:
        dtype = np.dtype(dtype)
        size = int(np.prod(shape, dtype=np.int64))
        self.margin = rng.standard_normal(2 * CANARY).astype(np.float32).astype(dtype) if dtype.kind == "f" or dtype == ptxattn.bfloat16 \
            else rng.integers(0, 100, 2 * CANARY).astype(dtype)
        poison = np.full(size, np.nan, dtype=np.float32).astype(dtype) if dtype.kind == "f" or dtype == ptxattn.bfloat16 \
            else np.full(size, -12345, dtype=dtype)
        host = np.concatenate([self.margin[:CANARY], poison, self.margin[CANARY:]])
        self.whole = ptxattn.asarray(host, device=device)
        self.array = ptxattn.DeviceArray(self.whole.ptr + CANARY * dtype.itemsize, shape, dtype, None,
                                         self.whole.device, self.whole)
        self.size = size

    def check(self) -> np.ndarray:
        """The output as NumPy, after asserting the canaries are intact and nothing is NaN."""
        host = self.whole.get(self.array.stream)
        before, out, after = host[:CANARY], host[CANARY:CANARY + self.size], host[CANARY + self.size:]
        assert np.array_equal(before.view(np.uint8), self.margin[:CANARY].view(np.uint8)), "write before the output"
        assert np.array_equal(after.view(np.uint8), self.margin[CANARY:].view(np.uint8)), "write past the output"
        return out.reshape(self.array.shape)


def relative_error(out, ref) -> float:
    out = np.asarray(out, dtype=np.float64)
    ref = np.asarray(ref, dtype=np.float64)
    assert not np.isnan(out).any(), "NaN in the output"
    denom = np.linalg.norm(ref)
    return float(np.linalg.norm(out - ref) / (denom if denom > 0 else 1.0))


# ‖out − ref‖ / ‖ref‖ bounds per input dtype (fp32 accumulation throughout).
REL_TOL = {np.dtype(np.float32): 1e-5, np.dtype(np.float16): 2e-3, ptxattn.bfloat16: 1.6e-2}
