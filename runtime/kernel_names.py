"""Kernel entry-point names, one function a kernel family: scripts/build_ptx.py names the
kernels it instantiates with them and the runtime the kernels it launches, so the two cannot
drift apart. Dtypes are spelled as in the names ("f16", "bf16", "f32"; caches "e4m3", "e5m2").
Imports nothing: build_ptx loads this file on its own, without the package or a driver."""
from __future__ import annotations


def flash_fwd(dtype: str, suffix: str, general: bool, fp8: bool = False) -> str:
    """cu/flash_fwd.cu's tensor-core kernels (mma.sync), and cu/flash_fwd_fp8.cu's with `fp8`."""
    return f"flash_fwd_{dtype}_{suffix}" + ("_general" if general else "") + ("_fp8" if fp8 else "")


def flash_fwd_sm90(dtype: str, dim: int, dim_v: int, general: bool, *, ws: bool = False, groups: int = 2,
                   pingpong: bool = False, staged_mask: bool = False, persistent: bool = False, fp8: bool = False,
                   paged: bool = False) -> str:
    """cu/flash_fwd_sm90.cu's wgmma kernels: flash_fwd_sm90_<dtype>_d<dim>[_<dim_v>][_general], then
    _ws[_m<rows>][_pp][_staged_mask][_persistent] for a warp-specialized one (rows where a CTA's are
    not 128, _pp for ping-pong consumers, _staged_mask for a general one's twin that stages masks in
    shared memory by TMA, _persistent for a plain one's twin whose CTAs run block after block),
    _fp8 for fp8 K/V, or _paged for K/V through a block table."""
    stem = f"flash_fwd_sm90_{dtype}_d{dim}" + (f"_{dim_v}" if dim_v != dim else "") + ("_general" if general else "")
    if ws:
        rows = "" if groups == 2 else f"_m{64 * groups}"
        return (f"{stem}_ws{rows}" + ("_pp" if pingpong else "") + ("_staged_mask" if staged_mask else "")
                + ("_persistent" if persistent else ""))
    return stem + ("_fp8" if fp8 else "_paged" if paged else "")


def decode_split(dtype: str, kv: str | None, d: int) -> str:
    """cu/decode.cu's split kernel for queries in `dtype` over a cache of `kv` (None: q's dtype)."""
    return f"decode_split_{dtype}_{kv}_d{d}" if kv else f"decode_split_{dtype}_d{d}"


def merge(dtype_in: str, dtype_out: str) -> str:
    return f"merge_{dtype_in}_{dtype_out}"


def kv_append_quant(src: str, kv: str) -> str:
    return f"kv_append_quant_{src}_{kv}"


def softmax(kind: str, dtype: str) -> str:
    """kind: "rows_warp", "rows_block" or "cols"."""
    return f"softmax_{kind}_{dtype}"
