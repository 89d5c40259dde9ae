"""Properties of the code in the shipped PTX that no CPU run of a kernel can see."""
from __future__ import annotations

import re
from pathlib import Path

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
    sector four times (flash_fwd_notes v23): every kernel must carry 16-byte stores, and no
    16-byte value may leave as four 4-byte stores."""
    family = manifest()["families"]["flash_fwd_sm90"]
    for arch in family["archs"]:
        ptx = (PTX / arch / "flash_fwd_sm90.ptx").read_bytes()
        assert not _SPLIT_16_BYTE_STORE.search(ptx), f"{arch}/flash_fwd_sm90.ptx splits a 16-byte store"
        without = [k for k in family["kernels"] if b"st.global.v4.b32" not in kernel_module(ptx, k)]
        assert not without, f"{arch}: no 16-byte global store in {without}"
