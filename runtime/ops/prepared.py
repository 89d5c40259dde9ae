"""Prepared calls: an op validated, planned and bound once, then launched many times.

Every op is an `Op`: its array arguments by name, its options by name, and two functions of
its own module, `validate` (host only: shapes, dtypes, strides, options; raises before any
device work) and `bind` (plan, kernel lookup, parameter structs; returns a `Binding`). A
Binding records which struct fields hold which array's address, so a later call rewrites just
those pointers and launches: what FlashInfer splits into plan()/run() and cuDNN into
build/execute.

- `ptxattn.prepare(op, ...)` takes the arguments of an op call and returns a `Prepared`; its
  `run(**arrays)` rebinds only the arrays it is given (same shape, dtype, strides, alignment)
  and launches. Outputs and workspace the call would make are made once, at prepare time,
  so a prepared call can be captured into a graph as it is.
- An eager call looks its Binding up in a per-thread cache keyed by everything validation
  and planning read (the op, the context, each array's `meta`, each option with its type): equal keys
  cannot plan differently, so no stale plan runs. Per thread, because a run writes the
  struct it launches.
"""
from __future__ import annotations

import ctypes
import inspect
import numbers
import threading

import numpy as np

from ..arch import capability
from ..array import DeviceArray, array_kind
from ..context import default_device, on_device
from ..device import Device
from ..driver import CudaUnavailableError, call, cu, hot
from ..faults import check_faults
from ..interop import NotOnDevice, import_device_array, order_after_producers, producer_streams
from ..memory import CaptureAllocationError, DeviceBuffer, stream_workspace
from ..module import ParamStruct, get_kernel, launch_error
from ..stream import Stream, as_stream
from ..tensor_map import MapSlot, MapSpec

__all__ = ["Launch", "Binding", "Op", "Prepared", "prepare", "clear_bindings", "CACHE_ENTRIES"]

CACHE_ENTRIES = 256  # bindings kept per thread; the oldest goes first
_SUCCESS = cu.CUresult.CUDA_SUCCESS


# The PTX of an arch from this one on has griddepcontrol (cu/common.cuh).
_PROGRAMMATIC_ARCH = (9, 0)


class Launch:
    """One kernel launch of a binding: kernel, geometry and its bound parameter struct.

    `programmatic`: the kernel waits for the launch before it in the stream
    (wait_for_previous_grid, cu/common.cuh) before reading what that wrote, so it may be
    launched with the programmatic-serialization attribute and start its CTAs while that
    launch finishes. Taken only where the loaded PTX has the wait (sm_90 and newer); `config`
    is then its cuLaunchKernelEx configuration (the stream is set per launch), else None."""

    __slots__ = ("name", "function", "grid", "block", "shared", "params", "argv", "config")

    def __init__(self, device: Device, kernel: str, grid, block, params: ParamStruct, shared: int = 0,
                 programmatic: bool = False) -> None:
        found = get_kernel(kernel, device)
        if shared > found.max_dynamic_shared:
            raise ValueError(f"{kernel} needs {shared:,} bytes of shared memory per block, {device.name} offers "
                             f"{found.max_dynamic_shared:,}")
        self.name, self.function = kernel, found.function
        self.grid, self.block, self.shared = tuple(grid), tuple(block), shared
        self.params = params
        self.argv = params.kernel_args
        self.config = None
        if programmatic and capability(found.arch) >= _PROGRAMMATIC_ARCH:
            self.config = programmatic_config(self.grid, self.block, shared)

    def pointer(self, field: str) -> ctypes.c_uint64:
        """A view of one pointer field of the struct, to rewrite in place."""
        return ctypes.c_uint64.from_buffer(self.params, getattr(type(self.params), field).offset)


def programmatic_config(grid, block, shared: int):
    """A launch's cuLaunchKernelEx configuration with programmatic stream serialization (the
    stream is set per launch: Binding.launch_all)."""
    config = cu.CUlaunchConfig()
    config.gridDimX, config.gridDimY, config.gridDimZ = grid
    config.blockDimX, config.blockDimY, config.blockDimZ = block
    config.sharedMemBytes = shared
    attribute = cu.CUlaunchAttribute()
    attribute.id = cu.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
    attribute.value.programmaticStreamSerializationAllowed = 1
    config.attrs = [attribute]
    config.numAttrs = 1
    return config


class Binding:
    """What `bind` makes of one validated call: launches, and which fields hold which array's
    address (`point(name, launch, field, offset)`); outputs the call makes when the caller
    passes none (`make(name, shape, dtype)`), workspace bytes, and what the call returns."""

    def __init__(self, op: "Op", device: Device) -> None:
        self.op, self.device = op, device
        self.context = 0  # the context its kernels were looked up in (set by Op.build)
        self.launches: list[Launch] = []
        self.slots: list[list] = [[] for _ in op.arrays]  # per argument: [(view or MapSlot, offset)]
        self.makes: dict[int, tuple] = {}  # argument -> (shape, dtype, byte strides, bytes, fill)
        self.workspace_bytes = 0
        self.returns: tuple[str, ...] = ()
        self.returns_tuple = False

    def launch(self, kernel: str, grid, block, params: ParamStruct, shared: int = 0,
               programmatic: bool = False) -> Launch:
        found = Launch(self.device, kernel, grid, block, params, shared, programmatic)
        self.launches.append(found)
        return found

    def point(self, name: str, launch: Launch, field: str, offset: int = 0) -> None:
        self.slots[self.op.index[name]].append((launch.pointer(field), offset))

    def point_map(self, name: str, launch: Launch, field: str, map_spec: MapSpec) -> None:
        """Tensor-map field `field` describes argument `name`: rewritten with its pointers."""
        dst = ctypes.addressof(launch.params) + getattr(type(launch.params), field).offset
        self.slots[self.op.index[name]].append((MapSlot(dst, map_spec, self.device.ordinal), 0))

    def make(self, name: str, shape, dtype, fill: int | None = None) -> None:
        """`fill`: a 32-bit word the output is filled with when made (for outputs whose every
        element the kernels need not write), else None (left as allocated)."""
        dtype = np.dtype(dtype)
        strides, step = [], dtype.itemsize
        for n in reversed(shape):
            strides.append(step)
            step *= max(int(n), 1)
        shape = tuple(int(n) for n in shape)
        self.makes[self.op.index[name]] = (shape, dtype, tuple(reversed(strides)), step, fill)

    def result(self, *names: str, as_tuple: bool = False) -> None:
        self.returns = names
        self.returns_tuple = as_tuple

    # ---- running ---------------------------------------------------------------------------
    def write(self, index: int, ptr: int) -> None:
        for view, offset in self.slots[index]:
            view.value = ptr + offset

    def allocate(self, arrays: list, stream: Stream, persistent: bool) -> int:
        """Make the outputs the caller did not pass and return the workspace's address, if
        one is needed and not passed (else 0). Prepared calls own theirs (made once); eager
        calls take outputs from the stream-ordered pool and the workspace from their
        stream's (memory.stream_workspace), and refuse both while the stream is capturing."""
        op = self.op
        needs_workspace = self.workspace_bytes and arrays[op.workspace_index] is None
        if not persistent and stream.ptr and stream.is_capturing():
            raise CaptureAllocationError(self._capture_message(arrays))
        pool_stream = None if persistent else stream
        for index, (shape, dtype, strides, nbytes, fill) in self.makes.items():
            if arrays[index] is None:
                buffer = DeviceBuffer(nbytes, self.device, pool_stream)
                arrays[index] = DeviceArray.view(buffer.ptr, shape, dtype, strides, self.device, buffer, stream)
                if fill is not None and nbytes:
                    with on_device(self.device):
                        if fill == 0:
                            call(cu.cuMemsetD8Async, buffer.ptr, 0, nbytes, stream.handle)
                        else:  # a 4-byte element's pattern
                            call(cu.cuMemsetD32Async, buffer.ptr, fill, nbytes // 4, stream.handle)
        if not needs_workspace:
            return 0
        if persistent:
            buffer = DeviceBuffer(self.workspace_bytes, self.device)
            arrays[op.workspace_index] = DeviceArray.view(buffer.ptr, (buffer.nbytes,), np.dtype(np.uint8), (1,),
                                                          self.device, buffer)
            return buffer.ptr
        return stream_workspace(self.device, stream, self.workspace_bytes)

    def _capture_message(self, arrays: list) -> str:
        missing = [f"{self.op.arrays[i]} ({nbytes:,} bytes)" for i, (_, _, _, nbytes, _) in self.makes.items()
                   if arrays[i] is None]
        if self.workspace_bytes and arrays[self.op.workspace_index] is None:
            missing.append(f"workspace ({self.workspace_bytes:,} bytes)")
        return (f"{self.op.name}: the stream is capturing a graph and the call would allocate its "
                f"{', '.join(missing)}: pass them preallocated before capture, or capture a "
                f"ptxattn.prepare()d call")

    def _missing(self, arrays: list) -> bool:
        """Whether the call must make an output or its workspace."""
        for index in self.makes:
            if arrays[index] is None:
                return True
        return bool(self.workspace_bytes) and arrays[self.op.workspace_index] is None

    def execute(self, arrays: list, stream: Stream):
        """An eager call: make what the caller did not pass, write every array's address,
        launch on `stream`, and return the call's results."""
        hot_path = hot()
        pushed = hot_path.current_context() != self.context
        if pushed:
            hot_path.push(self.context)
        try:
            workspace = self.allocate(arrays, stream, persistent=False) if self._missing(arrays) else 0
            ws_index = self.op.workspace_index
            for index, slots in self.pointer_slots:
                ptr = workspace if index == ws_index and workspace else arrays[index].ptr
                for view, offset in slots:
                    view.value = ptr + offset
            self.launch_all(stream.ptr)
        finally:
            if pushed:
                hot_path.pop()
        if not self.returns:
            return None
        index = self.op.index
        results = [arrays[index[name]] for name in self.returns]
        for arr in results:
            if type(arr) is DeviceArray:
                arr.stream = stream
        return tuple(results) if self.returns_tuple else results[0]

    def launch_all(self, stream: int) -> None:
        """Every launch, in order, on the stream with this handle (the current context must
        be the binding's)."""
        launch = cu.cuLaunchKernel
        for function, gx, gy, gz, bx, by, bz, shared, argv, name, config in self.raw_launches:
            if config is None:
                err, = launch(function, gx, gy, gz, bx, by, bz, shared, stream, argv, 0)
            else:
                config.hStream = stream
                err, = cu.cuLaunchKernelEx(config, function, argv, 0)
            if err != _SUCCESS:
                raise launch_error(name, (gx, gy, gz), (bx, by, bz), shared, err,
                                   "cuLaunchKernel" if config is None else "cuLaunchKernelEx")

    @property
    def raw_launches(self) -> tuple:
        """The cuLaunchKernel arguments of every launch but the stream, flattened once."""
        found = self.__dict__.get("_raw_launches")
        if found is None:
            found = self._raw_launches = tuple((x.function, *x.grid, *x.block, x.shared, x.argv, x.name, x.config)
                                               for x in self.launches)
        return found

    @property
    def pointer_slots(self) -> tuple:
        """(argument index, its (view, offset) slots) for the arguments that have any."""
        found = self.__dict__.get("_pointer_slots")
        if found is None:
            found = self._pointer_slots = tuple((i, tuple(s)) for i, s in enumerate(self.slots) if s)
        return found


# ---- ops -----------------------------------------------------------------------------------
_local = threading.local()
_NUMBERS = (numbers.Number, np.number)


def _cache() -> dict:
    cache = getattr(_local, "bindings", None)
    if cache is None:
        cache = _local.bindings = {}
    return cache


def clear_bindings() -> None:
    """Forget this thread's cached bindings (tools that change planning functions call it)."""
    _cache().clear()


class Op:
    """An op's argument names and its validate / bind functions; calling it runs the op."""

    def __init__(self, name: str, arrays: tuple[str, ...], options: tuple[str, ...], *, validate, bind,
                 outputs: tuple[str, ...] = (), in_place: tuple[str, ...] = (), extra_key=None,
                 number_or_array: tuple[str, ...] = ()) -> None:
        self.name, self.arrays, self.options = name, arrays, options
        self.index = {n: i for i, n in enumerate(arrays)}
        self.workspace_index = self.index.get("workspace", -1)
        self.validate, self.bind = validate, bind
        self.outputs = outputs    # arrays the op only writes (never uploaded from the host)
        self.in_place = in_place  # arrays the op updates (copied back into NumPy arrays)
        self.extra_key = extra_key  # op-specific key parts beyond the metas (merge_states' gaps)
        # Arguments that are a number (an option) or an array (fp8 scales): named among both the
        # arrays and the options, and given in both places; _route keeps each in one.
        self.routes = tuple((self.index[n], options.index(n)) for n in number_or_array)

    def named(self, arrays) -> dict:
        return dict(zip(self.arrays, arrays))

    # ---- classifying the arguments -------------------------------------------------------------
    def _device_arrays(self, args, stream: Stream, strict: bool = False):
        """(arrays as DeviceArrays or None, on_host) after refusing a host/device mix. Torch
        tensors are taken to be CUDA ones until a CPU one shows (then `strict` asks each)."""
        arrays = list(args)
        foreign = host = None
        for i, a in enumerate(args):
            if a is None or type(a) is DeviceArray:
                continue
            kind = array_kind(a, tensors_on_device=not strict)
            if kind == "host":
                if not isinstance(a, np.ndarray) and np.asarray(a).dtype.kind in "OSUV":
                    raise TypeError(f"{self.name}: {self.arrays[i]} must be an array (NumPy or on the device), "
                                    f"got {type(a).__name__} {a!r:.40}")
                host = host or []
                host.append(i)
            elif kind != "ptxattn":
                foreign = foreign or []
                foreign.append((i, kind))
        if host and not strict and any(kind == "torch" for _, kind in foreign or ()):
            return self._device_arrays(args, stream, strict=True)
        if host:
            device_side = [self.arrays[i] for i, a in enumerate(args) if a is not None and i not in host]
            if device_side:
                raise TypeError(
                    f"{self.name}: arrays must be all NumPy (host) or all device arrays; "
                    f"{', '.join(device_side)} on the device but {', '.join(self.arrays[i] for i in host)} on the host")
            return arrays, True
        if foreign:
            capturing = bool(stream.ptr) and stream.is_capturing()
            producers: set = set()
            for i, kind in foreign:
                try:
                    arrays[i] = import_device_array(args[i], kind, stream, producers)
                except NotOnDevice:
                    return self._device_arrays(args, stream, strict=True)
                except TypeError as exc:
                    raise TypeError(f"{self.name}: {self.arrays[i]}: {exc}") from None
            producers = producer_streams(producers) if producers and not capturing else set()
            producers.discard(stream.ptr)
            if producers:
                with on_device(arrays[foreign[0][0]].device):
                    order_after_producers(stream, producers)
        return arrays, False

    def key(self, context: int, metas: tuple, arrays: list, options: tuple):
        extra = self.extra_key(arrays) if self.extra_key is not None else None
        return (self, context, metas, options, tuple(map(type, options)), extra)

    def build(self, arrays: list, options: tuple) -> Binding:
        named = self.named(arrays)
        devices = {a.device.ordinal for a in arrays if a is not None}
        if len(devices) > 1:
            raise ValueError(f"{self.name}: all arrays must be on one device, got devices {sorted(devices)}")
        checked = self.validate(named, *options)
        device = next(a.device for a in arrays if a is not None)
        binding = Binding(self, device)
        with on_device(device):  # the caller's context if it is this device's, else the primary one
            binding.context = hot().current_context()
            self.bind(binding, named, checked, *options)
        return binding

    def _route(self, args: tuple, options: tuple) -> tuple[tuple, tuple]:
        """A number (bools too: validation refuses them) stays an option, anything else an array.
        None (in both places already) and a float are told apart first: the ABC check in
        isinstance(.., numbers.Number) costs about half a microsecond an argument."""
        for i, j in self.routes:
            a = args[i]
            if a is None:
                continue
            if type(a) is float or (type(a) is not DeviceArray and isinstance(a, _NUMBERS)):
                args = (*args[:i], None, *args[i + 1:])
            else:
                options = (*options[:j], None, *options[j + 1:])
        return args, options

    # ---- calls -------------------------------------------------------------------------------
    def __call__(self, args: tuple, options: tuple, stream):
        if self.routes:
            args, options = self._route(args, options)
        st = stream if type(stream) is Stream else as_stream(stream)
        metas = []
        for a in args:  # the common case, every array a DeviceArray: nothing to import
            if a is None:
                metas.append(None)
            elif type(a) is DeviceArray:
                metas.append(a._meta or a.meta)
            else:
                return self._foreign_call(args, options, st)
        arrays = list(args)
        return self._binding(tuple(metas), arrays, options).execute(arrays, st)

    def _foreign_call(self, args: tuple, options: tuple, stream: Stream):
        arrays, on_host = self._device_arrays(args, stream)
        if on_host:
            return self._host_call(arrays, options, stream)
        metas = tuple([None if a is None else a.meta for a in arrays])
        return self._binding(metas, arrays, options).execute(arrays, stream)

    def _binding(self, metas: tuple, arrays: list, options: tuple) -> Binding:
        """The cached binding for these arrays and options, else a new one (validated here)."""
        cache = _cache()
        try:
            key = self.key(_current_context(), metas, arrays, options)
            binding = cache.get(key)
        except TypeError:  # an unhashable option (a list): validate and plan afresh
            key, binding = None, None
        if binding is None:
            binding = self.build(arrays, options)
            if key is not None:
                if len(cache) >= CACHE_ENTRIES:
                    del cache[next(iter(cache))]
                cache[key] = binding
        return binding

    def _host_call(self, arrays: list, options: tuple, stream: Stream):
        """NumPy in, NumPy out: validate on the host, upload, run, copy back, synchronize."""
        host = [None if a is None else np.asarray(a) for a in arrays]
        self.validate(self.named(host), *options, on_host=True)
        device = default_device()
        with on_device(device):
            if stream.ptr and stream.is_capturing():
                raise RuntimeError(f"{self.name}: NumPy inputs but the stream is capturing a graph; a captured "
                                   f"step takes device arrays (ptxattn.asarray them before capture)")
            uploads = [None if a is None or self.arrays[i] in self.outputs else _upload(a, device, stream)
                       for i, a in enumerate(host)]
            binding = self._binding(tuple([None if a is None else a.meta for a in uploads]), uploads, options)
            binding.execute(uploads, stream)
            results = []
            for name in binding.returns:
                target = host[self.index[name]]
                copy = uploads[self.index[name]].get(stream)
                if target is not None:
                    target[...] = copy
                    copy = target
                results.append(copy)
            for name in self.in_place:
                i = self.index[name]
                if host[i] is not None:  # an optional array (an fp8 scale given as a number)
                    host[i][...] = uploads[i].get(stream)
            check_faults(device, stream)
        if binding.returns_tuple:
            return tuple(results)
        return results[0] if results else None

    # ---- prepared calls ----------------------------------------------------------------------
    def prepare(self, args: tuple, options: tuple, stream) -> "Prepared":
        if self.routes:
            args, options = self._route(args, options)
        st = as_stream(stream)
        arrays, on_host = self._device_arrays(args, st)
        if on_host:
            raise TypeError(f"{self.name}: a prepared call takes device arrays (ptxattn.asarray NumPy ones first)")
        binding = self.build(arrays, options)
        return Prepared(binding, arrays, st)


def _current_context() -> int | None:
    """The calling thread's context; None without a driver, so that a first call's
    validation still runs (and names the bad argument) before the driver is needed."""
    try:
        return hot().current_context()
    except CudaUnavailableError:
        return None


def _upload(host: np.ndarray, device: Device, stream: Stream) -> DeviceArray:
    """A contiguous copy of `host` on the device, from the stream-ordered pool."""
    host = np.ascontiguousarray(host)
    buffer = DeviceBuffer(host.nbytes, device, stream)
    if host.nbytes:
        call(cu.cuMemcpyHtoDAsync, buffer.ptr, host.ctypes.data, host.nbytes, stream.handle)
    return DeviceArray.view(buffer.ptr, host.shape, host.dtype, host.strides, device, buffer, stream)


class Prepared:
    """An op call validated, planned and bound once. `run()` launches it again; arrays passed
    to `run` by name replace the bound ones (same shape, dtype, strides and alignment) and
    stay bound. Outputs and workspace the call would make were made at prepare time and are
    returned by every run. Not for use from several threads at once."""

    def __init__(self, binding: Binding, arrays: list, stream: Stream) -> None:
        self._binding = binding
        self.stream = stream
        self.op = binding.op.name
        self.device = binding.device
        binding.allocate(arrays, stream, persistent=True)
        self._arrays = arrays
        self._results = None
        self._metas = [None if a is None else a.meta for a in arrays]
        for index, arr in enumerate(arrays):
            if arr is not None:
                binding.write(index, arr.ptr)

    @property
    def launches(self) -> list[Launch]:
        """The kernel launches a run issues, in order (kernel name, grid, block, parameters)."""
        return self._binding.launches

    @property
    def arrays(self) -> dict:
        """The bound arrays by name (outputs and workspace included)."""
        return {n: a for n, a in self._binding.op.named(self._arrays).items() if a is not None}

    def run(self, stream=None, **arrays):
        """Launch on `stream` (default: the one given at prepare time); returns what the op
        returns (its bound outputs)."""
        st = self.stream if stream is None else as_stream(stream)
        if arrays:
            self._rebind(arrays, st)
        binding = self._binding
        hot_path = hot()
        pushed = hot_path.current_context() != binding.context
        if pushed:
            hot_path.push(binding.context)
        try:
            binding.launch_all(st.ptr)
        finally:
            if pushed:
                hot_path.pop()
        return self._results_on(st)

    def _rebind(self, arrays: dict, stream: Stream) -> None:
        """Bind the named arrays in place of the prepared ones, after checking they match."""
        binding = self._binding
        op = binding.op
        names = list(arrays)
        unknown = [n for n in names if n not in op.index]
        if unknown:
            raise TypeError(f"{op.name}.run: unknown array {unknown[0]!r}; the call's arrays are {', '.join(op.arrays)}")
        args = [None] * len(op.arrays)
        for n in names:
            args[op.index[n]] = arrays[n]
        imported, on_host = op._device_arrays(args, stream)
        if on_host:
            raise TypeError(f"{op.name}.run: takes device arrays, got NumPy for {', '.join(names)}")
        for n in names:
            i = op.index[n]
            new = imported[i]
            if new is None or new.meta != self._metas[i]:
                raise ValueError(
                    f"{op.name}.run: {n} must match the prepared one (shape, element strides, dtype, device, "
                    f"alignment {self._metas[i]}), got {None if new is None else new.meta}; prepare a new call for it")
        if op.extra_key is not None:
            trial = list(self._arrays)
            for n in names:
                trial[op.index[n]] = imported[op.index[n]]
            if op.extra_key(trial) != op.extra_key(self._arrays):
                raise ValueError(f"{op.name}.run: the arrays must keep the prepared relative placement")
        for n in names:
            i = op.index[n]
            self._arrays[i] = imported[i]
            binding.write(i, imported[i].ptr)
        self._results = None

    def _results_on(self, stream: Stream):
        """What the op returns (its bound outputs), each recorded as last written on `stream`."""
        if self._results is None:
            binding = self._binding
            found = [self._arrays[binding.op.index[name]] for name in binding.returns]
            self._results = (tuple(found) if binding.returns_tuple else found[0] if found else None,
                             [arr for arr in found if type(arr) is DeviceArray])
        result, arrays = self._results
        for arr in arrays:
            arr.stream = stream
        return result


def prepare(op, *args, stream=None, **kwargs) -> Prepared:
    """Prepare a call of `op` (ptxattn.sdpa, ptxattn.decode, ...) with the arguments you would
    pass it: validated, planned and bound now; `.run()` launches it.

        step = ptxattn.prepare(ptxattn.decode, q, k_cache, v_cache, seq_lens, out=o, stream=s)
        step.run()            # same arrays
        step.run(q=q2)        # q2 replaces q (same shape, dtype, strides, alignment)
    """
    spec = getattr(op, "op", None)
    if not isinstance(spec, Op):
        raise TypeError(f"prepare: expected a ptxattn op (ptxattn.sdpa, ptxattn.decode, ...), got {op!r}")
    bound = inspect.signature(op).bind(*args, stream=stream, **kwargs)
    bound.apply_defaults()
    values = bound.arguments
    return spec.prepare(tuple(values[n] for n in spec.arrays), tuple(values[n] for n in spec.options), stream)
