"""Every ctypes parameter struct (a ParamStruct subclass in any module of ptxattn.ops) mirrors
the C struct of its name in cu/ (leading underscores dropped), field by field: same names, same
order, same types, hence the same offsets and size. A mirror's padding fields (named with a
leading underscore) stand for the gap C's 64-byte alignment of a TensorMap leaves, and each
TensorMap lands on a multiple of 64 in both. Every `struct <Name>Params` in cu/ has a mirror.
No GPU."""
from __future__ import annotations

import ctypes
import importlib
import pkgutil
import re
from pathlib import Path

import pytest

import ptxattn.ops
from ptxattn.module import ParamStruct

CU = Path(__file__).resolve().parent.parent / "cu"

# The C field types the kernels' structs use (cu/README.md) and their ctypes mirrors.
C_TYPES = {"long long": ctypes.c_int64, "int": ctypes.c_int32, "unsigned": ctypes.c_uint32, "float": ctypes.c_float,
           "unsigned short": ctypes.c_uint16,
           "TensorMap": ctypes.c_uint8 * 128}  # struct alignas(64) TensorMap in cu/flash_fwd_common.cuh


def _constants() -> dict[str, int]:
    """The `constexpr int NAME = <number>;` of cu/, which array fields are sized by."""
    return {name: int(value) for path in sorted(CU.glob("*.cu*"))
            for name, value in re.findall(r"^constexpr int (\w+) = (\d+);", path.read_text(), flags=re.M)}


def _length(expression: str) -> int:
    """An array field's length: a product of numbers and cu/'s constants, e.g. `TAIL_CTAS * TAIL_SLOTS`."""
    constants, length = _constants(), 1
    for factor in expression.split("*"):
        factor = factor.strip()
        length *= int(factor) if factor.isdigit() else constants[factor]
    return length


def _subclasses(cls: type) -> list[type]:
    return [c for sub in cls.__subclasses__() for c in (sub, *_subclasses(sub))]


def mirrors() -> list[type]:
    for module in pkgutil.iter_modules(ptxattn.ops.__path__):
        importlib.import_module(f"ptxattn.ops.{module.name}")
    return [cls for cls in _subclasses(ParamStruct) if cls.__module__.startswith("ptxattn.")]


def c_name(mirror: type) -> str:
    return mirror.__name__.lstrip("_")


def _declared(decl: str) -> list[tuple[str, type]]:
    """(name, ctypes type) of each declarator of one C declaration, e.g. `const float* sinks`."""
    array = re.fullmatch(r"(.*\w)\s*\[([^]]+)\]", decl.strip())  # one declarator with a length
    if array:
        (name, ctype), = _declared(array.group(1))
        return [(name, ctype * _length(array.group(2)))]
    match = re.fullmatch(r"((?:\w+\s+)*?\w+)\s*([*\s]*\w+(?:\s*,\s*[*\s]*\w+)*)", decl.strip())
    assert match, f"cannot parse the C field declaration {decl.strip()!r}"
    base = " ".join(word for word in match.group(1).split() if word != "const")
    fields = []
    for declarator in match.group(2).split(","):
        if "*" in declarator:
            fields.append((declarator.replace("*", "").strip(), ctypes.c_void_p))
        else:
            assert base in C_TYPES, f"no ctypes mirror for the C type {base!r} of {declarator.strip()!r}"
            fields.append((declarator.strip(), C_TYPES[base]))
    return fields


def c_structs() -> dict[str, list[tuple[str, type]]]:
    structs = {}
    for path in sorted(CU.glob("*.cu*")):
        text = re.sub(r"//[^\n]*", "", path.read_text())
        for name, body in re.findall(r"^struct (\w+Params) \{(.*?)^\};", text, flags=re.S | re.M):
            structs[name] = [field for decl in body.split(";") if decl.strip() for field in _declared(decl)]
    return structs


MIRRORS, C_STRUCTS = mirrors(), c_structs()


def test_every_c_struct_has_one_mirror():
    assert sorted(c_name(mirror) for mirror in MIRRORS) == sorted(C_STRUCTS)


@pytest.mark.parametrize("mirror", MIRRORS, ids=c_name)
def test_mirror_matches_its_c_struct_field_by_field(mirror):
    name = c_name(mirror)
    assert name in C_STRUCTS, f"{mirror.__module__}.{mirror.__qualname__}: no struct {name} in cu/"
    assert [(field, ctype) for field, ctype in mirror._fields_ if not field.startswith("_")] == C_STRUCTS[name]


@pytest.mark.parametrize("mirror", MIRRORS, ids=c_name)
def test_padding_is_exactly_what_tensor_map_alignment_needs(mirror):
    """C places each TensorMap at the next multiple of 64 and rounds the struct up to one: the
    mirror's padding must give the same offsets, and its size must be the C struct's (the
    driver copies that many bytes from it)."""
    offset, has_map = 0, False
    for field, ctype in mirror._fields_:
        if field.startswith("_"):
            continue
        if ctype is C_TYPES["TensorMap"]:
            offset, has_map = -(-offset // 64) * 64, True
        else:
            offset = -(-offset // ctypes.alignment(ctype)) * ctypes.alignment(ctype)
        assert getattr(mirror, field).offset == offset, f"{c_name(mirror)}.{field}"
        offset += ctypes.sizeof(ctype)
    alignment = 64 if has_map else max(ctypes.alignment(ctype) for _, ctype in mirror._fields_)
    assert ctypes.sizeof(mirror) == -(-offset // alignment) * alignment
