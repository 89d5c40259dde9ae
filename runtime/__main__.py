"""Command line: `python -m ptxattn info` and `python -m ptxattn demo`."""
from __future__ import annotations

import argparse
import sys
import time

import numpy as np


def info() -> None:
    from . import device_count, get_device
    from .driver import driver_version
    from .module import loaded_arch, manifest

    m = manifest()
    major, minor = driver_version()
    print(f"driver:   supports CUDA {major}.{minor}")
    print(f"ptx:      NVRTC {m['nvrtc_version']}, PTX ISA {m['ptx_isa_version']}, "
          f"needs a driver for CUDA {m['min_driver_cuda_version'][0]}.{m['min_driver_cuda_version'][1]}+")
    for ordinal in range(device_count()):
        dev = get_device(ordinal)
        archs = sorted({loaded_arch(dev, fam) or "none" for fam in m["families"]})
        print(f"device {ordinal}: {dev.name}, compute capability {dev.compute_capability[0]}."
              f"{dev.compute_capability[1]}, {dev.sm_count} SMs, {dev.total_memory / 2**30:.1f} GiB; "
              f"loads PTX for {', '.join(archs)}; probe kernel {_run_probe(dev)}")


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


def demo() -> None:
    import ptxattn
    from .module import loaded_arch
    from . import reference

    rng = np.random.default_rng()
    x = rng.standard_normal((64, 4096), dtype=np.float32) * 4
    dev = ptxattn.get_device(0)
    ptxattn.softmax(x)  # load the module and warm up
    start = time.perf_counter()
    y = ptxattn.softmax(x)
    elapsed = time.perf_counter() - start
    err = float(np.max(np.abs(y - reference.softmax(x))))
    print(f"device:   {dev.name} (compute capability {dev.compute_capability[0]}.{dev.compute_capability[1]})")
    print(f"ptx:      softmax loaded from ptx/{loaded_arch(dev, 'softmax')}/softmax.ptx")
    print(f"softmax:  {x.shape} float32 in {elapsed * 1e3:.3f} ms (host to host); "
          f"max |error| vs float64 reference {err:.2e}")
    if not err < 1e-6:
        raise SystemExit("demo: the GPU result does not match the reference")
    print("demo: OK")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="ptxattn", description="ptxattn command line")
    parser.add_argument("command", choices=["info", "demo"])
    args = parser.parse_args(argv)
    from .driver import CudaUnavailableError

    try:
        {"info": info, "demo": demo}[args.command]()
    except CudaUnavailableError as exc:
        print(f"ptxattn {args.command}: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
