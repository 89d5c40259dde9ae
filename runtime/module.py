"""Finding, loading and launching the precompiled PTX.

`ptx/manifest.json` (written by scripts/build_ptx.py) lists every family, the archs it was
built for and its kernels. For a device of compute capability X.Y we use the highest arch
not above it (`sm_90a` only on exactly 9.0), and load each kernel as a module of its own
(ptx_text.py) at its first use in a context, with the JIT error log in the exception if the
driver rejects it. PTXATTN_ARCH=sm_XY makes that choice as a
device of compute capability X.Y would (see arch.py).
"""
from __future__ import annotations

import ctypes
import functools
import json
import os
import threading
from importlib import resources

from .arch import ARCH_ENV, arch_for, arch_key, capability, target_arch
from .capture_mode import relaxed_capture_mode
from .device import Device
from .driver import CudaError, call, cu, driver_version, hot
from .ptx_text import kernel_module
from .stream import Stream

__all__ = ["ParamStruct", "Kernel", "get_kernel", "manifest", "arch_for", "ptx_arch", "loaded_arch", "PtxLoadError"]


class PtxLoadError(RuntimeError):
    """No PTX fits the device, or the driver could not load it (the message carries its JIT log)."""


class ParamStruct(ctypes.Structure):
    """Base of every kernel's by-value parameter struct (see cu/README.md). The argument
    array cuLaunchKernel wants is built once and reused: update fields in place and launch
    again."""

    @property
    def kernel_args(self) -> int:
        argv = self.__dict__.get("_argv")
        if argv is None:
            argv = (ctypes.c_void_p * 1)(ctypes.addressof(self))
            self.__dict__["_argv"] = argv
        return ctypes.addressof(argv)


@functools.lru_cache(maxsize=None)
def manifest() -> dict:
    path = resources.files("ptxattn.ptx") / "manifest.json"
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise PtxLoadError(
            "ptx/manifest.json is missing from the installed package: rebuild it with "
            "scripts/build_ptx.py or reinstall ptxattn"
        ) from None


@functools.lru_cache(maxsize=None)
def _kernel_family() -> dict[str, str]:
    return {name: fam for fam, info in manifest()["families"].items() for name in info["kernels"]}


@functools.lru_cache(maxsize=None)
def _shipped_archs() -> tuple[str, ...]:
    """The archs the manifest lists whose ptx/<arch> folder is in the installed package."""
    root = resources.files("ptxattn.ptx")
    listed = {arch for info in manifest()["families"].values() for arch in info["archs"]}
    return tuple(sorted((arch for arch in listed if (root / arch).is_dir()), key=arch_key))


@functools.lru_cache(maxsize=None)
def ptx_arch(device: Device) -> str:
    """The arch whose PTX `device` loads: PTXATTN_ARCH when set, else the device's own
    (sm_XY of its compute capability). Read once per device, at first use, since the modules
    loaded then stay for the process. Each family loads its highest arch not above this one
    (`loaded_arch`; `Kernel.arch` records it)."""
    return target_arch(os.environ.get(ARCH_ENV), device, _shipped_archs())


def _check_driver_version() -> None:
    need = manifest()["min_driver_cuda_version"]
    have = driver_version()
    if have < tuple(need):
        raise PtxLoadError(
            f"the installed NVIDIA driver supports CUDA {have[0]}.{have[1]}, but the bundled PTX "
            f"(ISA {manifest()['ptx_isa_version']}) needs CUDA {need[0]}.{need[1]} or newer: "
            f"update the NVIDIA driver"
        )


_LOG_BYTES = 16384
_J = cu.CUjit_option


def _load_kernel_module(device: Device, family: str, name: str):
    """Kernel `name`'s own module (ptx_text.py: the JIT compiles only that kernel) and its arch."""
    arch = loaded_arch(device, family)
    if arch is None:
        major, minor = device.compute_capability
        target = ptx_arch(device)
        target = f"{ARCH_ENV}={target}" if target != device.arch else f"compute capability {major}.{minor}"
        raise PtxLoadError(f"no PTX of family {family!r} runs on {device.name} ({target}); built for "
                           f"{', '.join(manifest()['families'][family]['archs'])}")
    _check_driver_version()
    label = f"ptx/{arch}/{family}.ptx"
    ptx = (resources.files("ptxattn.ptx") / arch / f"{family}.ptx").read_bytes()
    try:
        own = kernel_module(ptx, name)
    except ValueError as exc:
        raise PtxLoadError(f"{label}: {exc}: rebuild it with scripts/build_ptx.py or reinstall ptxattn") from None
    if own is None:
        raise PtxLoadError(f"{label} has no kernel {name!r}, which ptx/manifest.json lists there: rebuild it "
                           f"with scripts/build_ptx.py or reinstall ptxattn")
    return load_ptx(own, f"{label} ({name})", device), arch


def load_ptx(ptx: bytes, label: str, device: Device):
    """cuModuleLoadDataEx in the current context; on failure the JIT log is in the error."""
    log = bytearray(_LOG_BYTES)
    options = [_J.CU_JIT_ERROR_LOG_BUFFER, _J.CU_JIT_ERROR_LOG_BUFFER_SIZE_BYTES]
    try:
        return call(cu.cuModuleLoadDataEx, ptx + b"\0", len(options), options, [log, _LOG_BYTES])
    except CudaError as exc:
        text = bytes(log).split(b"\0", 1)[0].decode(errors="replace").strip()
        raise PtxLoadError(f"loading {label} on {device.name} failed: {exc}\nJIT log:\n{text or '(empty)'}") from exc


_SUCCESS = cu.CUresult.CUDA_SUCCESS
_FA = cu.CUfunction_attribute


class Kernel:
    """A kernel function in one context, its attributes set when it was looked up."""

    __slots__ = ("name", "function", "arch", "max_dynamic_shared")

    def __init__(self, name: str, function, arch: str, max_dynamic_shared: int = 48 * 1024) -> None:
        self.name = name
        self.function = function
        self.arch = arch
        self.max_dynamic_shared = max_dynamic_shared

    def launch(self, grid, block, params: ParamStruct, stream: Stream, shared_bytes: int = 0) -> None:
        gx, gy, gz = grid
        bx, by, bz = block
        # cuda-python's own wrapper measured faster than a ctypes call with 11 arguments
        # (scripts/bench_launch.py prints both).
        err, = cu.cuLaunchKernel(self.function, gx, gy, gz, bx, by, bz, shared_bytes, stream.handle,
                                 params.kernel_args, 0)
        if err != _SUCCESS:
            raise launch_error(self.name, grid, block, shared_bytes, err)


def launch_error(name: str, grid, block, shared_bytes: int, err, call: str = "cuLaunchKernel") -> CudaError:
    return CudaError(f"{call}({name}, grid={tuple(grid)}, block={tuple(block)}, shared={shared_bytes})", err)


# The decode K/V ring is what keeps bytes in flight: as many CTAs as shared memory allows.
_PREFER_SHARED_CARVEOUT = ("decode",)


def _configure(function, device: Device, family: str) -> int:
    """Let the kernel use all the dynamic shared memory the device offers a block (and, for
    the families that ask, the largest carveout), once per kernel; return that limit."""
    static = call(cu.cuFuncGetAttribute, _FA.CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES, function)
    limit = device.max_shared_per_block_optin - static
    call(cu.cuFuncSetAttribute, function, _FA.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, limit)
    if family in _PREFER_SHARED_CARVEOUT:
        call(cu.cuFuncSetAttribute, function, _FA.CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT, 100)
    return limit


_cache_lock = threading.Lock()
_kernels: dict[tuple[int, str], Kernel] = {}


def get_kernel(name: str, device: Device) -> Kernel:
    """The kernel `name` in the current context (call inside `on_device(device)`); its
    module is loaded and its attributes set on first use, cached per context."""
    ctx = hot().current_context()
    kernel = _kernels.get((ctx, name))
    if kernel is not None:
        return kernel
    family = _kernel_family().get(name)
    if family is None:
        raise KeyError(f"kernel {name!r} is not in ptx/manifest.json")
    with _cache_lock:
        kernel = _kernels.get((ctx, name))
        if kernel is not None:
            return kernel
        with relaxed_capture_mode():
            module, arch = _load_kernel_module(device, family, name)
            function = call(cu.cuModuleGetFunction, module, name.encode())
            kernel = Kernel(name, function, arch, _configure(function, device, family))
        _kernels[(ctx, name)] = kernel
    return kernel


def loaded_arch(device: Device, family: str) -> str | None:
    """Which arch of `family` a device would load (None if none fits), as a device of
    `ptx_arch(device)` would."""
    return arch_for(capability(ptx_arch(device)), manifest()["families"][family]["archs"])
