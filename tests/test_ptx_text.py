"""ptx_text: each kernel's own module cut from its family's PTX file (module.py loads those),
checked on every shipped file, and its refusals of files it cannot cut."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from ptxattn import module
from ptxattn.device import Device
from ptxattn.module import PtxLoadError, manifest
from ptxattn.ptx_text import check_cuttable, kernel_module, preamble

PTX = Path(__file__).resolve().parent.parent / "ptx"
SHIPPED = [(family, arch) for family, info in sorted(manifest()["families"].items()) for arch in info["archs"]]
# A module-scope variable: its state space, then (after alignment and type) its name.
_VARIABLE = re.compile(rb"^(?:\.extern\s+)?\.(global|shared|const)\s[^;=]*?(\w+)\s*(?:\[\d*\])?\s*(?:=[^;]*)?;",
                       re.MULTILINE)


def _read(family: str, arch: str) -> bytes:
    return (PTX / arch / f"{family}.ptx").read_bytes()


@pytest.mark.parametrize("family, arch", SHIPPED)
def test_every_shipped_file_cuts_into_the_kernels_the_manifest_lists(family, arch):
    """check_cuttable accepts it, and the cuts, one a kernel, hold the whole file between them:
    the preamble once and every entry once, nothing else but blank lines."""
    ptx = _read(family, arch)
    names = check_cuttable(ptx, f"{arch}/{family}.ptx")
    assert sorted(names) == sorted(manifest()["families"][family]["kernels"])
    head = preamble(ptx)
    rest = ptx[len(head):]
    for name in names:
        own = kernel_module(ptx, name)
        assert own.startswith(head) and own.count(b".entry ") == 1
        entry = own[len(head):-1]
        assert rest.startswith(entry), name  # in file order
        rest = rest[len(entry):].lstrip()
    assert rest == b""


def _module_scope_state_used(ptx: bytes, label: str) -> dict[str, str]:
    """The module-scope variables some entry names, by state space, other than shared memory
    (per CTA, so a kernel's own copy is the same thing). Cut apart, each kernel would see its
    own copy of these: a .global or .const one that an entry used would need its family's
    module. Also fails on a preamble line that declares anything else (a function, say)."""
    check_cuttable(ptx, label)
    head = preamble(ptx)
    bodies = ptx[len(head):]
    lines = [line.strip() for line in head.splitlines() if line.strip()]
    declarations = [line for line in lines if not line.startswith((b".version", b".target", b".address_size"))]
    variables = _VARIABLE.findall(head)
    assert len(variables) == len(declarations), [line for line in declarations if not _VARIABLE.match(line)]
    # Named anywhere in a body, even inside a longer name: stricter than a word match, and fast.
    return {name.decode(): space.decode() for space, name in variables if space != b"shared" and name in bodies}


@pytest.mark.parametrize("family, arch", SHIPPED)
def test_no_kernel_shares_state_with_another_through_module_scope(family, arch):
    assert _module_scope_state_used(_read(family, arch), f"{arch}/{family}.ptx") == {}


def test_a_kernels_module_is_the_preamble_and_its_entry_alone():
    ptx = _read("merge", "sm_90")
    text = kernel_module(ptx, "merge_bf16_bf16")
    head = ptx[:ptx.index(b"\n.visible .entry ") + 1]  # worked out here, not by preamble()
    assert text.startswith(head) and re.findall(rb"\.entry\s+(\w+)", text) == [b"merge_bf16_bf16"]
    assert text.rstrip().endswith(b"}") and text[len(head):-1] in ptx
    assert kernel_module(ptx, "merge_bf16") is None  # a prefix of a name is not a kernel


_HEAD = b".version 8.8\n.target sm_90\n.address_size 64\n\n.global .align 4 .u32 k = 1;\n\n"
_ENTRY = b".visible .entry %s(\n\t.param .u64 p\n)\n{\n\t{\n\t.reg .b32 t;\n\t}\n\tret;\n\n}\n\n"


def test_the_state_check_sees_a_global_an_entry_reads_and_a_function():
    used = _HEAD + (_ENTRY % b"a").replace(b"\tret;", b"\tld.global.u32 %r1, [k];\n\tret;")
    assert _module_scope_state_used(used, "used.ptx") == {"k": "global"}
    with pytest.raises(AssertionError, match="func"):
        _module_scope_state_used(_HEAD + b".visible .func f()\n{\n\tret;\n}\n" + _ENTRY % b"a", "func.ptx")


def test_a_cut_keeps_inner_braces_and_ends_at_the_entrys_own():
    ptx = _HEAD + _ENTRY % b"a" + _ENTRY % b"b"
    assert check_cuttable(ptx, "two.ptx") == ["a", "b"]
    assert kernel_module(ptx, "a") == _HEAD + (_ENTRY % b"a").rstrip(b"\n") + b"\n"
    assert kernel_module(ptx, "b") == _HEAD + (_ENTRY % b"b").rstrip(b"\n") + b"\n"


@pytest.mark.parametrize("ptx, message", [
    (_HEAD, "no .entry in it"),
    (_HEAD + _ENTRY % b"a" + b".global .align 4 .u32 late = 2;\n" + _ENTRY % b"b",
     "expected only blank lines between the end of entry a and the next entry, got b'.global .align 4 .u32 late"),
    (_HEAD + _ENTRY % b"a" + b".visible .func f()\n{\n\tret;\n}\n" + _ENTRY % b"b",
     "expected only blank lines between the end of entry a and the next entry, got b'.visible .func f()"),
    (_HEAD + _ENTRY % b"a" + _ENTRY % b"a", "entry a appears twice"),
    (_HEAD + b".visible .entry a(\n)\n\tret;\n", "entry a has no closing brace"),
])
def test_files_a_cut_would_break_are_refused_by_name(ptx, message):
    with pytest.raises(ValueError, match="^bad.ptx: " + re.escape(message)):
        check_cuttable(ptx, "bad.ptx")


@pytest.mark.parametrize("text, message", [
    (_HEAD + _ENTRY % b"merge_f16_f16", "ptx/sm_90/merge.ptx has no kernel 'merge_bf16_bf16', which "
                                        "ptx/manifest.json lists there: rebuild it"),
    (_HEAD + b".visible .entry merge_bf16_bf16(\n)\n{\n\tret;\n", "ptx/sm_90/merge.ptx: entry merge_bf16_bf16 "
                                                                   "has no closing brace: rebuild it"),
])
def test_loading_from_a_file_that_disagrees_with_the_manifest_names_both(tmp_path, monkeypatch, text, message):
    """Before any driver call: the installed file lacks the kernel, or its entry is cut short."""
    h200 = Device(0, "H200", (9, 0), 132, 141 << 30, 232448, 60 << 20)
    manifest()  # read (and cached) from the real package first
    (tmp_path / "sm_90").mkdir()
    (tmp_path / "sm_90" / "merge.ptx").write_bytes(text)
    monkeypatch.setattr(module.resources, "files", lambda package: tmp_path)
    monkeypatch.setattr(module, "_check_driver_version", lambda: None)
    monkeypatch.setattr(module, "ptx_arch", lambda device: "sm_90")
    monkeypatch.setattr(module, "load_ptx", lambda *args: pytest.fail("the driver was asked to load it"))
    with pytest.raises(PtxLoadError, match="^" + re.escape(message)):
        module._load_kernel_module(h200, "merge", "merge_bf16_bf16")
