"""Command line: `ptxattn info`, `ptxattn demo` (also `python -m ptxattn ...`)."""
from __future__ import annotations

import argparse
import inspect
import sys

import numpy as np


def info() -> None:
    """What the package carries (PTX archs per kernel family, PTX ISA, the driver it needs),
    then the driver and each device: the PTX it loads and whether a probe kernel runs."""
    from . import __version__, device_count, get_device
    from .arch import ARCH_ENV
    from .driver import driver_version
    from .module import loaded_arch, manifest, ptx_arch

    m = manifest()
    need = m["min_driver_cuda_version"]
    print(f"ptxattn {__version__}")
    print(f"ptx:      NVRTC {m['nvrtc_version']}, PTX ISA {m['ptx_isa_version']}, "
          f"needs a driver for CUDA {need[0]}.{need[1]}+")
    width = max(len(family) for family in m["families"])
    for family, entry in m["families"].items():
        print(f"          {family.ljust(width)}  {' '.join(entry['archs'])}")
    major, minor = driver_version()
    print(f"driver:   supports CUDA {major}.{minor}")
    for ordinal in range(device_count()):
        dev = get_device(ordinal)
        archs = sorted({loaded_arch(dev, fam) or "none" for fam in m["families"]})
        chosen = f" ({ARCH_ENV}={ptx_arch(dev)})" if ptx_arch(dev) != dev.arch else ""
        print(f"device {ordinal}: {dev.name}, compute capability {dev.compute_capability[0]}."
              f"{dev.compute_capability[1]}, {dev.sm_count} SMs, {dev.total_memory / 2**30:.1f} GiB; "
              f"loads PTX for {', '.join(archs)}{chosen}; probe kernel {_run_probe(dev)}")


def _run_probe(dev) -> str:
    """Load the probe module on `dev`, store a value with it and read it back."""
    from . import zeros
    from .context import on_device
    from .ops.probe import ProbeParams, probe_kernel
    from .stream import as_stream

    cell = zeros((1,), np.int32, dev)
    with on_device(dev):
        probe_kernel(dev).launch((1, 1, 1), (32, 1, 1), ProbeParams(cell.ptr, 1234), as_stream(None))
    return "ran" if int(cell.get()[0]) == 1234 else "returned a WRONG value"


def demo(args) -> None:
    """The decode loop ptxattn is for: an L-layer GQA decode step (kv_append + decode a layer,
    the prompt prefilled by sdpa) run for N tokens eagerly, prepared and by graph replay,
    checked to agree bit for bit, with host and device microseconds a step and tokens/s.

    Defaults: 32 layers, B8, Hq32, Hkv8, D128, capacity 4096, a 1024-token prompt, 64 tokens."""
    from .demo import run

    run(args)


def main(argv=None) -> int:
    from . import __version__
    from .arch import ArchSettingError
    from .driver import CudaUnavailableError
    from .demo import add_arguments as demo_arguments
    from .module import PtxLoadError

    # name -> (function, what adds its options, or None when it takes none)
    commands = {"info": (info, None), "demo": (demo, demo_arguments)}
    parser = argparse.ArgumentParser(
        prog="ptxattn", description="ptxattn: attention kernels precompiled to PTX, run through the CUDA driver API.")
    parser.add_argument("--version", action="version", version=f"ptxattn {__version__}")
    subcommands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (fn, options) in commands.items():
        summary = inspect.getdoc(fn).split("\n\n")[0].replace("\n", " ")
        sub = subcommands.add_parser(name, help=summary, description=inspect.getdoc(fn))
        if options is not None:
            options(sub)
    args = parser.parse_args(argv)
    try:
        fn, options = commands[args.command]
        fn(args) if options is not None else fn()
    except (CudaUnavailableError, PtxLoadError, ArchSettingError) as exc:
        print(f"ptxattn {args.command}: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
