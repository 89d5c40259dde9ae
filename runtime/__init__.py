"""ptxattn: attention kernels precompiled to PTX, run through the CUDA driver API on NumPy
and device arrays."""
from . import reference  # the float64 oracle that defines every op
from .arch import ArchSettingError
from .array import DeviceArray, asarray, empty, from_dlpack, zeros
from .context import on_device
from .device import Device, device_count, get_device
from .driver import CudaError, CudaUnavailableError
from .dtypes import bfloat16
from .faults import DeviceFault, check_faults
from .graph import Graph, capture
from .memory import CaptureAllocationError, OutOfMemoryError, WorkspaceLayout
from .module import PtxLoadError, ptx_arch
from .ops.attention import sdpa
from .ops.decode import decode, decode_workspace_bytes
from .ops.kv_cache import kv_append
from .ops.merge import merge_states, merge_states_n
from .ops.prepared import Prepared, prepare
from .ops.paged import paged_decode, paged_decode_workspace_bytes, paged_kv_append
from .ops.ragged import paged_attention, paged_attention_workspace_bytes, ragged_attention
from .ops.softmax import log_softmax, softmax
from .stream import Event, Stream, as_stream

__version__ = "0.1.0"
