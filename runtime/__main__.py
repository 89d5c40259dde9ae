"""Command line: `ptxattn info`, `ptxattn demo` (also `python -m ptxattn ...`)."""
from __future__ import annotations

import argparse
import inspect
import sys
import time

import numpy as np


def info() -> None:
    """What the package carries (PTX archs per kernel family, PTX ISA, the driver it needs),
    then the driver and each device: the PTX it loads and whether a probe kernel runs."""
    from . import __version__, device_count, get_device
    from .driver import driver_version
    from .module import loaded_arch, manifest

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


def _timed(fn, stream, calls: int = 20) -> float:
    """Milliseconds per call of fn() on `stream`, over back-to-back calls after a warm-up."""
    from .stream import Event

    fn()
    start = Event(timing=True).record(stream)
    for _ in range(calls):
        fn()
    end = Event(timing=True).record(stream)
    end.synchronize()
    return start.elapsed_ms(end) / calls


def _check(name: str, error: float, bound: float) -> None:
    if not error < bound:
        raise SystemExit(f"demo: {name} does not match the float64 reference (error {error:.2e} > {bound:.0e})")


def demo() -> None:
    """Softmax, attention and a decode step on the GPU, each checked against the reference."""
    import ptxattn
    from . import reference
    from .context import on_device
    from .module import loaded_arch

    rng = np.random.default_rng()
    dev = ptxattn.get_device(0)
    print(f"device:   {dev.name} (compute capability {dev.compute_capability[0]}.{dev.compute_capability[1]}, "
          f"{dev.sm_count} SMs); PTX loaded for {loaded_arch(dev, 'softmax')}")
    with on_device(dev):
        stream = ptxattn.Stream.create()

    x = rng.standard_normal((64, 4096), dtype=np.float32) * 4
    ptxattn.softmax(x)  # NumPy in, NumPy out
    start = time.perf_counter()
    y = ptxattn.softmax(x)
    host_ms = (time.perf_counter() - start) * 1e3
    err = float(np.max(np.abs(y - reference.softmax(x))))
    _check("softmax", err, 1e-6)
    print(f"softmax:  {x.shape} float32, NumPy to NumPy in {host_ms:.3f} ms; max |error| {err:.1e}")

    b, h, s, d = 2, 8, 1024, 128
    q, k, v = (rng.standard_normal((b, h, s, d)).astype(ptxattn.bfloat16) for _ in range(3))
    qd, kd, vd = (ptxattn.asarray(t, stream) for t in (q, k, v))
    od = ptxattn.empty((b, h, s, d), ptxattn.bfloat16, dev)  # preallocated: the timing is the kernel's
    ms = _timed(lambda: ptxattn.sdpa(qd, kd, vd, causal=True, out=od, stream=stream), stream)
    o = od.get(stream)
    ref, _ = reference.sdpa(q, k, v, causal=True)
    err = float(np.linalg.norm(o.astype(np.float64) - ref) / np.linalg.norm(ref))
    _check("sdpa", err, 1.6e-2)
    flops = 4 * b * h * s * s * d / 2
    print(f"sdpa:     B{b} H{h} S{s} D{d} bfloat16 causal in {ms:.3f} ms ({flops / ms / 1e9:.0f} TFLOP/s); "
          f"relative error {err:.1e}")

    batch, hq, hkv, capacity = 8, 32, 8, 2048
    lengths = rng.integers(1, capacity + 1, batch).astype(np.int32)
    kc, vc = (rng.standard_normal((batch, hkv, capacity, d)).astype(ptxattn.bfloat16) for _ in range(2))
    qn = rng.standard_normal((batch, hq, 1, d)).astype(ptxattn.bfloat16)
    args = [ptxattn.asarray(t, stream) for t in (qn, kc, vc, lengths)]
    on = ptxattn.empty((batch, hq, 1, d), ptxattn.bfloat16, dev)
    ms = _timed(lambda: ptxattn.decode(*args, out=on, stream=stream), stream)
    o = on.get(stream)
    ref = reference.decode(qn, kc, vc, lengths)[0]
    err = float(np.linalg.norm(o.astype(np.float64) - ref) / np.linalg.norm(ref))
    _check("decode", err, 1.6e-2)
    print(f"decode:   B{batch} Hq{hq} Hkv{hkv} D{d} bfloat16, capacity {capacity}, live lengths "
          f"{lengths.min()}..{lengths.max()}, in {ms:.3f} ms; relative error {err:.1e}")
    print("demo: OK")


def main(argv=None) -> int:
    from . import __version__
    from .driver import CudaUnavailableError
    from .module import PtxLoadError

    commands = {"info": info, "demo": demo}
    parser = argparse.ArgumentParser(
        prog="ptxattn", description="ptxattn: attention kernels precompiled to PTX, run through the CUDA driver API.")
    parser.add_argument("--version", action="version", version=f"ptxattn {__version__}")
    subcommands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, fn in commands.items():
        summary = inspect.getdoc(fn).split("\n\n")[0].replace("\n", " ")
        subcommands.add_parser(name, help=summary, description=summary)
    args = parser.parse_args(argv)
    try:
        commands[args.command]()
    except (CudaUnavailableError, PtxLoadError) as exc:
        print(f"ptxattn {args.command}: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
