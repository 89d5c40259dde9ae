"""One kernel's own PTX module, cut from its family's PTX file.

The driver JIT-compiles a PTX module whole when it is loaded, so loading a family for one of
its kernels compiled all of them: ptxas 13.0 (on a 2-core CI-class machine) takes about a
minute over the sm_90a family (64 kernels, 15.6 MB) and 0.3-4 s over one of its kernels, cut
as below, whose SASS is the same as in the family's (cuobjdump, all 206 shipped kernels).
module.py loads each kernel this way.

A kernel's module is the family file's preamble (.version, .target, .address_size and the
module-scope declarations, which NVRTC writes before the first entry) followed by that
kernel's .entry. The cut finds the entry by name and ends it at the last line `}` before the
next entry: a few ms on the largest file, with no parse. check_cuttable is what makes that
right: scripts/build_ptx.py refuses a file it rejects, and tests/test_ptx_text.py runs it
over every shipped file, along with the check that no kernel reads module-scope state other
than shared memory (each kernel now has its own copy of every declaration).
"""
from __future__ import annotations

import re

__all__ = ["preamble", "kernel_module", "check_cuttable"]

_ENTRY_LINE = b"\n.visible .entry "  # how NVRTC starts each kernel
_NAME = re.compile(rb"([A-Za-z_$][\w$]*)\(")


def preamble(ptx: bytes) -> bytes:
    """What every kernel's module starts with: the file up to its first entry."""
    return ptx[:ptx.find(_ENTRY_LINE) + 1]


def kernel_module(ptx: bytes, name: str) -> bytes | None:
    """The PTX module of kernel `name` alone (None when `ptx` has no such kernel): the
    preamble, then its entry. ValueError when the entry has no closing brace line."""
    start = ptx.find(_ENTRY_LINE + name.encode() + b"(")
    if start < 0:
        return None
    start += 1
    following = ptx.find(_ENTRY_LINE, start)
    close = ptx.rfind(b"\n}", start, following if following >= 0 else len(ptx))
    if close < 0:
        raise ValueError(f"entry {name} has no closing brace")
    return preamble(ptx) + ptx[start:close + 2] + b"\n"


def _body_end(ptx: bytes, start: int, limit: int) -> int:
    """Just past the `}` that closes the body of the entry at `start` (a line of its own, as
    NVRTC writes it; inline asm scopes close on such lines too, so the braces are counted);
    -1 when none does before `limit`."""
    depth, pos = 0, start
    while True:
        close = ptx.find(b"\n}", pos, limit)
        if close < 0:
            return -1
        depth += ptx.count(b"{", pos, close + 2) - ptx.count(b"}", pos, close + 2)
        if depth <= 0:
            return close + 2 if depth == 0 else -1
        pos = close + 2


def check_cuttable(ptx: bytes, label: str) -> list[str]:
    """The kernels of `ptx` (named `label` in errors), in order, once it is checked that
    kernel_module cuts each one whole: every entry starts a line `.visible .entry NAME(`, its
    body's closing brace (braces counted) is followed by blank lines only, up to the next entry
    or the end (a declaration or function there would be lost or misplaced by the cut), and no
    name appears twice. Raises ValueError otherwise, or when there is no entry."""
    starts, pos = [], ptx.find(_ENTRY_LINE)
    while pos >= 0:
        starts.append(pos + 1)
        pos = ptx.find(_ENTRY_LINE, pos + 1)
    if not starts:
        raise ValueError(f"{label}: no .entry in it")
    names: list[str] = []
    for i, start in enumerate(starts):
        found = _NAME.match(ptx, start + len(_ENTRY_LINE) - 1)
        if found is None:
            raise ValueError(f"{label}: expected a kernel name and its parameters after .entry, got "
                             f"{ptx[start:start + 60]!r}")
        name = found.group(1).decode()
        limit = starts[i + 1] if i + 1 < len(starts) else len(ptx)
        end = _body_end(ptx, start, limit)
        if end < 0:
            raise ValueError(f"{label}: entry {name} has no closing brace")
        if ptx[end:limit].strip():
            raise ValueError(f"{label}: expected only blank lines between the end of entry {name} and "
                             f"{'the next entry' if i + 1 < len(starts) else 'the end of the file'}, got "
                             f"{ptx[end:limit].strip()[:60]!r}")
        if name in names:
            raise ValueError(f"{label}: entry {name} appears twice")
        names.append(name)
    return names
