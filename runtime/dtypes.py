"""The dtypes ptxattn arrays may hold, with their DLPack and CUDA Array Interface codes."""
from __future__ import annotations

import ml_dtypes
import numpy as np

__all__ = ["SUPPORTED", "bfloat16", "normalize", "dlpack_code", "typestr"]

bfloat16 = np.dtype(ml_dtypes.bfloat16)

SUPPORTED = (
    np.dtype(np.float16), bfloat16, np.dtype(np.float32), np.dtype(np.int32),
    np.dtype(np.int64), np.dtype(np.bool_), np.dtype(np.uint8),
)
_NAMES = ", ".join(str(d) for d in SUPPORTED)

# DLPack type codes: 0 int, 1 uint, 2 float, 4 bfloat, 6 bool.
_DLPACK = {
    np.dtype(np.float16): (2, 16), bfloat16: (4, 16), np.dtype(np.float32): (2, 32),
    np.dtype(np.int32): (0, 32), np.dtype(np.int64): (0, 64), np.dtype(np.bool_): (6, 8),
    np.dtype(np.uint8): (1, 8),
}


def normalize(dtype, what: str = "dtype") -> np.dtype:
    """np.dtype of a supported dtype (names like 'bfloat16' accepted), else a clear error."""
    try:
        # None is not NumPy's float64 here: no default dtype is guessed.
        dt = None if dtype is None else bfloat16 if dtype in ("bfloat16", "bf16") else np.dtype(dtype)
    except (TypeError, ValueError):
        dt = None
    if dt is None or dt not in SUPPORTED:
        raise TypeError(f"{what}: expected one of {_NAMES}, got {repr(dtype) if dt is None else dt}")
    return dt


def dlpack_code(dtype: np.dtype) -> tuple[int, int]:
    return _DLPACK[np.dtype(dtype)]


def typestr(dtype: np.dtype) -> str:
    """CUDA Array Interface typestr; bfloat16 has none (it needs DLPack)."""
    if np.dtype(dtype) == bfloat16:
        raise TypeError(
            "the CUDA Array Interface has no typestr for bfloat16: exchange bfloat16 arrays "
            "through DLPack (__dlpack__ / from_dlpack) instead"
        )
    return np.dtype(dtype).str
