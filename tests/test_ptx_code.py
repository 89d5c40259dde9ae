"""Properties of the code in the shipped PTX that no CPU run of a kernel can see."""
from __future__ import annotations

import re
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from ptxattn.module import manifest
from ptxattn.ptx_text import kernel_module

PTX = Path(__file__).resolve().parent.parent / "ptx"
# One 16-byte value stored as four 4-byte stores at +0, +4, +8, +12 of one address.
_SPLIT_16_BYTE_STORE = re.compile(
    rb"st\.global\.[ub]32 \[(%rd\d+)\],%r\d+;\n"
    rb"st\.global\.[ub]32 \[\1\+4\],%r\d+;\n"
    rb"st\.global\.[ub]32 \[\1\+8\],%r\d+;\n"
    rb"st\.global\.[ub]32 \[\1\+12\],%r\d+;")


def test_sm90_prefill_kernels_store_output_rows_16_bytes_at_a_time():
    """The sm_90a prefill epilogue (store_rows_staged) writes O 16 bytes a thread along a row.
    Written as a uint4 assignment, NVRTC split each store in four, which moved every output
    sector four times (flash_fwd_notes v23): every kernel must carry 16-byte stores but the
    persistent twins, which store O by TMA instead, and no 16-byte value may leave as four
    4-byte stores."""
    family = manifest()["families"]["flash_fwd_sm90"]
    for arch in family["archs"]:
        ptx = (PTX / arch / "flash_fwd_sm90.ptx").read_bytes()
        assert not _SPLIT_16_BYTE_STORE.search(ptx), f"{arch}/flash_fwd_sm90.ptx splits a 16-byte store"
        store = {k: b"cp.async.bulk.tensor.4d.global.shared::cta" if k.endswith("_persistent") else b"st.global.v4.b32"
                 for k in family["kernels"]}
        without = [k for k, text in store.items() if text not in kernel_module(ptx, k)]
        assert not without, f"{arch}: no 16-byte global store (or, persistent twins, TMA store) in {without}"


PTXAS = shutil.which("ptxas")
_SERIALIZED_WGMMA = "C7511"  # ptxas: "wgmma.mma_async instructions are serialized due to ..."


@pytest.mark.skipif(PTXAS is None, reason="ptxas (the CUDA toolkit) is not on PATH: the check needs it to "
                                          "compile the sm_90a PTX")
def test_sm90_ws_kernels_keep_their_wgmma_pipeline(tmp_path):
    """ptxas serializes a kernel's wgmmas where too few registers are left for their pipeline
    (info C7511) and says so only in a message: registers and spills do not move, but the
    narrow last tile's first build lost 26-30 % that way on an H100 (flash_fwd_notes v36), and a
    small change elsewhere in the ws kernels brought the message back. Every warp-specialized
    kernel of the shipped sm_90a PTX must compile without it."""
    ptx = (PTX / "sm_90a" / "flash_fwd_sm90.ptx").read_bytes()
    kernels = [k for k in manifest()["families"]["flash_fwd_sm90"]["kernels"] if "_ws" in k]
    assert kernels, "no warp-specialized kernel in the manifest"

    def messages(name: str) -> str:
        source = tmp_path / f"{name}.ptx"
        source.write_bytes(kernel_module(ptx, name))
        done = subprocess.run([PTXAS, "-arch=sm_90a", str(source), "-o", str(tmp_path / f"{name}.cubin")],
                              capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, f"ptxas failed on {name}: {done.stderr[-500:]}"
        return done.stderr

    with ThreadPoolExecutor() as pool:
        serialized = [name for name, text in zip(kernels, pool.map(messages, kernels)) if _SERIALIZED_WGMMA in text]
    assert not serialized, f"ptxas serializes the wgmmas (C7511) of {serialized}"
