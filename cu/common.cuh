// Shared device helpers for every kernel family: dtype conversion and the fault
// buffer. Kept tiny on purpose; family-specific math
// lives with its family.
#pragma once
#include <cuda_fp16.h>
#include <cuda_bf16.h>

namespace ptxattn {

// ---- dtype load/store -------------------------------------------------------
__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

template <class T> __device__ __forceinline__ T from_float(float x);
template <> __device__ __forceinline__ float from_float<float>(float x) { return x; }
template <> __device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}

// ---- fault buffer -----------------------------------------------------------
// A small int32 buffer the host owns (runtime/faults.py). The first fault wins:
// fault[0] = code, fault[1] = batch row (or token), fault[2] = offending value.
// Kernels skip the bad work and carry on; the host raises after synchronizing.
enum FaultCode : int {
  FAULT_NONE = 0,
  FAULT_PAGE_OUT_OF_RANGE = 1,   // block_table entry outside [0, num_pages)
  FAULT_PAST_CAPACITY = 2,       // seq_lens[b] (+ appended tokens) > capacity
  FAULT_SLOT_OUT_OF_RANGE = 3,   // slot_mapping entry outside the pool
  FAULT_NEGATIVE_LENGTH = 4,     // seq_lens[b] < 0
  FAULT_BAD_OFFSETS = 5,         // cu_seqlens / qo_indptr decreasing, negative or past the packed rows
};

__device__ __forceinline__ void raise_fault(int* fault, int code, int row, int value) {
  if (fault != nullptr && atomicCAS(fault, 0, code) == 0) {
    fault[1] = row;
    fault[2] = value;
  }
}

// ---- programmatic dependent launch (sm_90+) ---------------------------------
// A kernel the host launches with the programmatic-serialization attribute (Launch.programmatic
// in runtime/ops/prepared.py) may start while the launch before it in its stream is still
// running: its CTAs are scheduled as that grid's CTAs allow it (allow_dependent_launch, or their
// exit) and must wait_for_previous_grid before touching anything that grid writes; the wait
// returns once that grid has finished and its memory is visible. Without the attribute the wait
// returns at once. Below sm_90 both are nothing (the host sets the attribute only on sm_90+).
__device__ __forceinline__ void allow_dependent_launch() {
#if __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void wait_for_previous_grid() {
#if __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}

}  // namespace ptxattn
