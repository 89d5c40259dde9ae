// Score semantics shared by every attention kernel (flash_fwd, decode, paged):
// softcap, the causal/sliding-window predicate, and exp2 that is safe on rows
// whose every score is -inf. The float64 oracle is runtime/reference.py (sdpa).
#pragma once
#include "common.cuh"

namespace ptxattn {

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

// NVRTC has no math.h, so no INFINITY macro.
__device__ __forceinline__ float neg_inf() { return __int_as_float(0xff800000u); }

// A window side at or past this many keys is unbounded (the host maps -1 / None to it).
constexpr int kUnboundedWindow = 1 << 30;

// The hardware's tanh (one MUFU op, relative error about 2^-11).
__device__ __forceinline__ float tanh_approx(float x) {
  float t;
  asm("tanh.approx.f32 %0, %1;\n" : "=f"(t) : "f"(x));
  return t;
}

// Softcap on a *scaled* score: cap * tanh(s / cap); cap == 0 turns it off.
// Applied before any mask (bool, additive, causal, window).
// Two ways to take tanh, picked by the operands' precision:
// - 16-bit and fp8 operands (EXACT false): the hardware's tanh.approx.f32 (sm_75+), one MUFU
//   op, relative error about 2^-11: the logit's error is at most about cap * 5e-4 where tanh
//   saturates and far less near 0, where most scores sit (FlashAttention's fast-math tanhf is
//   the same instruction), well inside what a 16-bit P carries. 1 - 2 / (e^{2x} + 1) (an ex2
//   and a reciprocal) made the softcap prefill kernels MUFU-bound (cu/flash_fwd_notes.md v8).
// - f32 operands (EXACT true), held to 1e-5 of the float64 oracle: 1 - 2 / (e^{2x} + 1) with
//   one ex2.approx and one fast reciprocal, whose absolute error (a few ulp of 1, times cap) is
//   ~1e-5 at cap 50. tanhf's ~20 instructions an element are not needed for that.
template <bool EXACT = false>
__device__ __forceinline__ float apply_softcap(float s, float cap) {
  if (!(cap > 0.f)) return s;
  if constexpr (EXACT) {
    float e;  // e^{2 s / cap}; +inf past the float range, then the quotient is 0 and tanh 1
    asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(e) : "f"(s * (2.f * kLog2e / cap)));
    return cap * (1.f - __fdividef(2.f, e + 1.f));
  } else {
    return cap * tanh_approx(s * (1.f / cap));
  }
}

// Which keys a query sees, relative to the aligned diagonal i + diag_offset:
//   key j is visible to query i  iff  i + diag_offset - left <= j <= i + diag_offset + right
// diag_offset = Skv - Sq for bottom-right alignment, 0 for top-left.
// causal is right = 0; no causal and no window is left = right = kUnboundedWindow.
struct KeyWindow {
  int diag_offset;
  int left;
  int right;
};

// 64-bit so i + diag_offset + kUnboundedWindow cannot overflow.
__device__ __forceinline__ long long first_visible_key(const KeyWindow& w, long long i) {
  return i + w.diag_offset - w.left;
}
__device__ __forceinline__ long long last_visible_key(const KeyWindow& w, long long i) {
  return i + w.diag_offset + w.right;
}
__device__ __forceinline__ bool key_visible(const KeyWindow& w, long long i, long long j) {
  return j >= first_visible_key(w, i) && j <= last_visible_key(w, i);
}

// Online softmax in base 2: p = exp2(x - row_max). When every score seen so far
// is -inf the row max is -inf and x - row_max would be NaN; using 0 as the
// subtrahend instead makes every p exactly 0, so a fully masked row keeps
// sum 0 and the finaliser writes o = 0, lse = -inf.
__device__ __forceinline__ float exp_subtrahend(float row_max) {
  return row_max == neg_inf() ? 0.f : row_max;
}
__device__ __forceinline__ float safe_exp2(float x, float row_max) {
  return exp2f(x - exp_subtrahend(row_max));
}

// The factor on a finished row's o (normalised over its keys, whose total weight is e^lse)
// once a sink's virtual key (logit sinks[head], or none when sinks is null) joins the
// denominator; 0 for a row that saw no key. Shared by merge.cu's combine and decode.cu's
// one-split direct write, so both give the same bits.
__device__ __forceinline__ float sink_scale(float lse, const float* sinks, int head) {
  if (lse == neg_inf()) return 0.f;
  return sinks == nullptr ? 1.f : 1.f / (1.f + expf(sinks[head] - lse));
}

// Explicit attention masks, read element by element through 64-bit offsets
// (stride 0 on broadcast axes). bool: nonzero byte = attend; float kinds are
// additive. Returned in the base-2 domain the online softmax works in.
enum MaskKind : int {
  MASK_NONE = 0,
  MASK_BOOL = 1,  // uint8
  MASK_F32 = 2,
  MASK_F16 = 3,
  MASK_BF16 = 4,
};

// One mask element as a base-2 bias (bool: 0 or -inf; additive: value * log2 e).
__device__ __forceinline__ float mask_bias_log2(unsigned char keep) { return keep ? 0.f : neg_inf(); }
template <class M>
__device__ __forceinline__ float mask_bias_log2(M value) { return to_float(value) * kLog2e; }

__device__ __forceinline__ float mask_bias_log2(int kind, const void* mask, long long offset) {
  switch (kind) {
    case MASK_BOOL: return mask_bias_log2(static_cast<const unsigned char*>(mask)[offset]);
    case MASK_F32: return mask_bias_log2(static_cast<const float*>(mask)[offset]);
    case MASK_F16: return mask_bias_log2(static_cast<const __half*>(mask)[offset]);
    case MASK_BF16: return mask_bias_log2(static_cast<const __nv_bfloat16*>(mask)[offset]);
    default: return 0.f;
  }
}

}  // namespace ptxattn
