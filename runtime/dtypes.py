"""The dtypes ptxattn arrays may hold, with their DLPack and CUDA Array Interface codes."""
from __future__ import annotations

import ml_dtypes
import numpy as np

__all__ = ["SUPPORTED", "FP8", "bfloat16", "float8_e4m3fn", "float8_e5m2", "normalize", "dlpack_code", "typestr"]

bfloat16 = np.dtype(ml_dtypes.bfloat16)
float8_e4m3fn = np.dtype(ml_dtypes.float8_e4m3fn)
float8_e5m2 = np.dtype(ml_dtypes.float8_e5m2)
FP8 = (float8_e4m3fn, float8_e5m2)  # KV cache dtypes only (ops/checks.py says where)

SUPPORTED = (
    np.dtype(np.float16), bfloat16, np.dtype(np.float32), np.dtype(np.int32),
    np.dtype(np.int64), np.dtype(np.bool_), np.dtype(np.uint8), *FP8,
)
_NAMES = ", ".join(str(d) for d in SUPPORTED)
# Names NumPy does not know by itself (ml_dtypes' types have no string form there).
_BY_NAME = {"bfloat16": bfloat16, "bf16": bfloat16, "float8_e4m3fn": float8_e4m3fn, "float8_e5m2": float8_e5m2}

# DLPack type codes: 0 int, 1 uint, 2 float, 4 bfloat, 6 bool, 10 float8_e4m3fn, 12 float8_e5m2.
_DLPACK = {
    np.dtype(np.float16): (2, 16), bfloat16: (4, 16), np.dtype(np.float32): (2, 32),
    np.dtype(np.int32): (0, 32), np.dtype(np.int64): (0, 64), np.dtype(np.bool_): (6, 8),
    np.dtype(np.uint8): (1, 8), float8_e4m3fn: (10, 8), float8_e5m2: (12, 8),
}


def normalize(dtype, what: str = "dtype") -> np.dtype:
    """np.dtype of a supported dtype (names like 'bfloat16' accepted), else a clear error."""
    try:
        # None is not NumPy's float64 here: no default dtype is guessed.
        dt = None if dtype is None else _BY_NAME.get(dtype) if isinstance(dtype, str) and dtype in _BY_NAME \
            else np.dtype(dtype)
    except (TypeError, ValueError):
        dt = None
    if dt is None or dt not in SUPPORTED:
        raise TypeError(f"{what}: expected one of {_NAMES}, got {repr(dtype) if dt is None else dt}")
    return dt


def dlpack_code(dtype: np.dtype) -> tuple[int, int]:
    return _DLPACK[np.dtype(dtype)]


def typestr(dtype: np.dtype) -> str:
    """CUDA Array Interface typestr; bfloat16 and the fp8 types have none (they need DLPack)."""
    if np.dtype(dtype) in (bfloat16, *FP8):
        raise TypeError(
            f"the CUDA Array Interface has no typestr for {np.dtype(dtype)}: exchange such arrays "
            "through DLPack (__dlpack__ / from_dlpack) instead"
        )
    return np.dtype(dtype).str
