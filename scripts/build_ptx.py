#!/usr/bin/env python3
"""Compile cu/ to ptx/<arch>/<family>.ptx with NVRTC and write ptx/manifest.json.

    python scripts/build_ptx.py            # rebuild ptx/ from cu/variants.json
    python scripts/build_ptx.py --check    # rebuild into a temp dir; fail if ptx/ differs

cu/variants.json is the table: a family's `kernels` are entry points written out in its
source; its `variants` become lines of the header variants.inc, which exists only in NVRTC's
memory (see VARIANT_LINES); the manifest carries both, with every variant's parameters.

NVRTC comes from the nvidia-cuda-nvrtc-cu12 wheel and is always loaded through ctypes, so
the build works whichever major version of cuda-python is installed; cuda_fp16.h and
cuda_bf16.h come from the nvidia-cuda-runtime-cu12 wheel's include/ folder. Both are pinned
in the `build` extra, which makes the output reproducible byte for byte.
"""
from __future__ import annotations

import argparse
import ctypes
import filecmp
import functools
import hashlib
import importlib.util
import json
import re
import shutil
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CU = ROOT / "cu"
PTX = ROOT / "ptx"
COMMON_OPTIONS = ["--std=c++17", "--device-as-default-execution-space"]


def _load_runtime_module(name: str):
    """runtime/<name>.py as a module of its own (importing the package would load the driver)."""
    spec = importlib.util.spec_from_file_location(f"ptxattn_{name}", ROOT / "runtime" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


kernel_names = _load_runtime_module("kernel_names")
ptx_text = _load_runtime_module("ptx_text")

# The wheels of the `build` extra: NVRTC and the CUDA headers.
BUILD_PACKAGES = {"nvidia.cuda_nvrtc": "nvidia-cuda-nvrtc-cu12", "nvidia.cuda_runtime": "nvidia-cuda-runtime-cu12"}


def _package_dir(package: str) -> Path | None:
    try:
        spec = importlib.util.find_spec(package)
    except ModuleNotFoundError:  # its parent (nvidia) is not installed either
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def missing_build_extra() -> str | None:
    """Why the PTX cannot be built here (the `build` extra is not installed), or None."""
    missing = [wheel for package, wheel in BUILD_PACKAGES.items() if _package_dir(package) is None]
    if not missing:
        return None
    return f"{', '.join(missing)} not installed: building the PTX needs the build extra (pip install -e '.[build]')"


class Nvrtc:
    """The handful of NVRTC entry points the build needs, through ctypes."""

    def __init__(self) -> None:
        lib_dir = _package_dir("nvidia.cuda_nvrtc") / "lib"
        candidates = sorted(lib_dir.glob("libnvrtc.so.*")) + sorted(lib_dir.glob("nvrtc64_*.dll"))
        if not candidates:
            sys.exit(f"build_ptx: no NVRTC library in {lib_dir}")
        self.lib = ctypes.CDLL(str(candidates[0]))
        major, minor = ctypes.c_int(), ctypes.c_int()
        self._check(self.lib.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor)), "nvrtcVersion")
        self.version = (major.value, minor.value)

    def _check(self, status: int, what: str) -> None:
        if status != 0:
            self.lib.nvrtcGetErrorString.restype = ctypes.c_char_p
            raise RuntimeError(f"{what} failed: {self.lib.nvrtcGetErrorString(status).decode()}")

    def compile(self, source: str, name: str, options: list[str], headers: dict[str, str]) -> str:
        """PTX of `source`; `headers` maps include names to contents NVRTC finds first."""
        prog = ctypes.c_void_p()
        contents = (ctypes.c_char_p * len(headers))(*(text.encode() for text in headers.values()))
        names = (ctypes.c_char_p * len(headers))(*(include.encode() for include in headers))
        self._check(self.lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), name.encode(), len(headers),
                                                contents, names), "nvrtcCreateProgram")
        try:
            argv = (ctypes.c_char_p * len(options))(*(o.encode() for o in options))
            status = self.lib.nvrtcCompileProgram(prog, len(options), argv)
            log_size = ctypes.c_size_t()
            self.lib.nvrtcGetProgramLogSize(prog, ctypes.byref(log_size))
            log = ctypes.create_string_buffer(log_size.value)
            self.lib.nvrtcGetProgramLog(prog, log)
            if status != 0:
                raise RuntimeError(f"NVRTC could not compile {name}:\n{log.value.decode(errors='replace')}")
            size = ctypes.c_size_t()
            self._check(self.lib.nvrtcGetPTXSize(prog, ctypes.byref(size)), "nvrtcGetPTXSize")
            ptx = ctypes.create_string_buffer(size.value)
            self._check(self.lib.nvrtcGetPTX(prog, ptx), "nvrtcGetPTX")
            return ptx.value.decode()
        finally:
            self.lib.nvrtcDestroyProgram(ctypes.byref(prog))


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


# ---- variants.inc: the lines that define a family's variants ---------------------------------
# One generator a family with variants: (line, the kernels it defines) for each variant, in
# table order. The PTX follows the order of definition: reordering the table changes it.
C_TYPES = {"f16": "__half", "bf16": "__nv_bfloat16", "f32": "float"}
FP8_C_TYPES = {"e4m3": "ptxattn::decode::fp8_e4m3", "e5m2": "ptxattn::decode::fp8_e5m2"}  # decode.cu's


def c_literal(value) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def _flash_fwd(info, fp8: bool = False):
    for v in info["variants"]:
        tile = ", ".join(c_literal(v[k]) for k in ("dim_qk", "dim_v", "warps", "m_tiles", "keys", "stages",
                                                   "q_in_regs"))
        for dtype in info["dtypes"]:
            name = kernel_names.flash_fwd(dtype, v["suffix"], v["general"], fp8)
            yield f"FLASH_FWD_TC({name}, {C_TYPES[dtype]}, {c_literal(v['general'])}, {c_literal(fp8)}, {tile})", [name]


def _flash_fwd_sm90(info):
    for v in info["variants"]:
        fp8 = v.get("fp8", False)
        dim_v, keys = v.get("dim_v", v["dim"]), v.get("keys", 128)  # Dv (default Dqk = dim), keys a K/V tile
        for dtype in info["dtypes"]:
            name = functools.partial(kernel_names.flash_fwd_sm90, dtype, v["dim"], dim_v, v["general"])
            if v.get("ws", False):  # warp-specialized kernel: `groups` consumers, `stages` K/V stages
                pingpong = v.get("pingpong", False)  # the consumers take turns on the tensor cores
                staged_mask = v.get("staged_mask", False)  # a general kernel's twin that stages 16-bit masks
                persistent = v.get("persistent", False)  # a plain kernel's twin whose CTAs run block after block
                ws = name(ws=True, groups=v["groups"], pingpong=pingpong, staged_mask=staged_mask, persistent=persistent)
                yield (f"FLASH_FWD_SM90_WS({ws}, {C_TYPES[dtype]}, {v['dim']}, {dim_v}, {keys}, {v['stages']}, "
                       f"{v['groups']}, {c_literal(pingpong)}, {c_literal(v['general'])}, "
                       f"{c_literal(staged_mask)}, {c_literal(persistent)})", [ws])
            elif fp8:
                yield f"FLASH_FWD_SM90_FP8({name(fp8=True)}, {C_TYPES[dtype]}, {v['dim']}, {v['groups']}, " \
                      f"{c_literal(v['general'])})", [name(fp8=True)]
            else:  # one definition, two entry points: strided and paged K/V
                yield (f"FLASH_FWD_SM90({name()}, {C_TYPES[dtype]}, {v['dim']}, {dim_v}, {v['groups']}, {keys}, "
                       f"{c_literal(v['general'])})", [name(), name(paged=True)])


def _decode(info):
    for v in info["variants"]:
        kv = v.get("kv")  # an fp8 cache type, else the cache holds q's dtype
        name = kernel_names.decode_split(v["dtype"], kv, v["d"])
        kv_type = FP8_C_TYPES[kv] if kv else C_TYPES[v["dtype"]]
        yield f"PTXATTN_DECODE_VARIANT({name}, {C_TYPES[v['dtype']]}, {kv_type}, {v['d']})", [name]


def _merge(info):
    for v in info["variants"]:
        name = kernel_names.merge(v["in"], v["out"])
        yield f"PTXATTN_MERGE_VARIANT({name}, {C_TYPES[v['in']]}, {C_TYPES[v['out']]})", [name]


def _kv_cache(info):
    for v in info["variants"]:
        name = kernel_names.kv_append_quant(v["src"], v["kv"])
        yield f"PTXATTN_KV_QUANT_VARIANT({name}, {C_TYPES[v['src']]}, {v['kv']})", [name]


def _softmax(info):
    for v in info["variants"]:
        dtype = v["dtype"]
        yield (f"PTXATTN_SOFTMAX_KERNELS({dtype}, {C_TYPES[dtype]})",
               [kernel_names.softmax(kind, dtype) for kind in ("rows_warp", "rows_block", "cols")])


VARIANT_LINES = {"flash_fwd": _flash_fwd, "flash_fwd_fp8": lambda info: _flash_fwd(info, fp8=True),
                 "flash_fwd_sm90": _flash_fwd_sm90, "decode": _decode, "merge": _merge, "softmax": _softmax,
                 "kv_cache": _kv_cache}


def expand(family: str, info: dict) -> tuple[dict[str, str], list[str]]:
    """The in-memory headers a family compiles with and every kernel it defines."""
    if "variants" not in info:
        return {}, list(info["kernels"])
    lines, kernels = [], list(info.get("kernels", []))
    for line, names in VARIANT_LINES[family](info):
        lines.append(line)
        kernels += names
    return {"variants.inc": "\n".join(lines) + "\n"}, kernels


def _compact(ptx: str) -> str:
    """The PTX with what ptxas ignores taken out, for issue 10's 40 MB budget: whole-line
    comments (NVRTC brackets every inline asm statement with "// begin inline asm" / "// end
    inline asm": ~12 % of the bytes), blank lines, indentation, runs of blanks inside a line
    (one space kept) and the space after a comma (~10 % more). ptxas gives every shipped
    kernel the same SASS from the compact text as from NVRTC's (cuobjdump, stop 36)."""
    lines = (re.sub(r"[ \t]+", " ", line.strip()).replace(", ", ",") for line in ptx.split("\n"))
    return "\n".join(line for line in lines if line and not line.startswith("//")) + "\n"


def _without_target(ptx: str) -> str:
    """The PTX less its .target line: what the code of two archs' builds is compared by."""
    return re.sub(r"^\.target [^\n]*\n", "", ptx, count=1, flags=re.M)


def build(out: Path) -> None:
    table = json.loads((CU / "variants.json").read_text())
    nvrtc = Nvrtc()
    include = _package_dir("nvidia.cuda_runtime") / "include"
    # Include paths are absolute on the build machine; they are not part of the recorded
    # options (they do not change the PTX).
    paths = [f"-I{include}", f"-I{CU}"]
    headers, kernels, jobs = {}, {}, []
    for family, info in table["families"].items():
        headers[family], kernels[family] = expand(family, info)
        for arch in info.get("archs", table["default_archs"]):
            options = COMMON_OPTIONS + info.get("options", []) + [f"--gpu-architecture={arch.replace('sm_', 'compute_')}"]
            jobs.append((family, info, arch, options))

    def compile_one(job):
        family, info, arch, options = job
        ptx = nvrtc.compile((CU / info["source"]).read_text(), info["source"], options + paths, headers[family])
        return _compact(ptx)

    with ThreadPoolExecutor(max_workers=4) as pool:
        results = list(pool.map(compile_one, jobs))

    families, isa_versions, below = {}, set(), {}
    for (family, info, arch, options), ptx in zip(jobs, results):
        # An arch whose PTX is the arch below's but for the .target line is not shipped: a
        # device loads the highest arch not above its own, so it runs the same code.
        if below.get(family) == _without_target(ptx):
            continue
        below[family] = _without_target(ptx)
        # The runtime loads each kernel as a module cut from this file (runtime/ptx_text.py).
        try:
            entries = set(ptx_text.check_cuttable(ptx.encode(), f"{family} for {arch}"))
        except ValueError as exc:
            raise SystemExit(f"build_ptx: {exc}: runtime/ptx_text.py could not cut it into a module per kernel")
        listed = set(kernels[family])
        if entries != listed:
            raise SystemExit(
                f"build_ptx: {family} for {arch}: cu/variants.json and the PTX disagree; only in the "
                f"table: {sorted(listed - entries)}, only in the PTX: {sorted(entries - listed)}"
            )
        isa_versions.add(re.search(r"^\.version (\d+\.\d+)", ptx, flags=re.M).group(1))
        (out / arch).mkdir(parents=True, exist_ok=True)
        (out / arch / f"{family}.ptx").write_text(ptx)
        entry = families.setdefault(family, {
            "source": info["source"],
            "source_sha256": sha256((CU / info["source"]).read_bytes()),
            "options": COMMON_OPTIONS + info.get("options", []),
            "archs": [],
            "kernels": sorted(listed),
            "ptx_sha256": {},
            **{key: info[key] for key in ("dtypes", "variants") if key in info},
        })
        entry["archs"].append(arch)
        entry["ptx_sha256"][arch] = sha256(ptx.encode())

    manifest = {
        "generated_by": "scripts/build_ptx.py",
        "nvrtc_version": f"{nvrtc.version[0]}.{nvrtc.version[1]}",
        "ptx_isa_version": max(isa_versions, key=lambda v: tuple(map(int, v.split(".")))) if isa_versions else None,
        # PTX from NVRTC X.Y needs a driver that supports CUDA X.Y.
        "min_driver_cuda_version": list(nvrtc.version),
        "header_sha256": {p.name: sha256(p.read_bytes()) for p in sorted(CU.glob("*.cuh")) + sorted(CU.glob("*.h"))},
        "families": families,
    }
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")


def _tree(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*") if p.is_file() and (p.suffix == ".ptx" or p.name == "manifest.json")}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="rebuild into a temp dir and compare with ptx/")
    args = parser.parse_args()
    reason = missing_build_extra()
    if reason:
        print(f"build_ptx: {reason}", file=sys.stderr)
        return 2
    if not args.check:
        for stale in PTX.glob("sm_*"):
            shutil.rmtree(stale)
        build(PTX)
        print(f"build_ptx: wrote {len(_tree(PTX))} files under {PTX.relative_to(ROOT)}/")
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        fresh = Path(tmp)
        build(fresh)
        committed, rebuilt = _tree(PTX), _tree(fresh)
        differ = sorted(p for p in committed & rebuilt if not filecmp.cmp(PTX / p, fresh / p, shallow=False))
        missing, extra = sorted(rebuilt - committed), sorted(committed - rebuilt)
        if differ or missing or extra:
            print("build_ptx --check: ptx/ does not match cu/ (run scripts/build_ptx.py and commit ptx/)")
            for label, paths in (("differs", differ), ("not committed", missing), ("stale", extra)):
                for p in paths:
                    print(f"  {label}: ptx/{p}")
            return 1
    print(f"build_ptx --check: ptx/ matches cu/ ({len(committed)} files)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
