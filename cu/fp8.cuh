// fp8 KV caches (float8_e4m3fn, float8_e5m2) as the sdpa tile kernels read them: the type a
// call's K and V hold (a runtime field, so one kernel reads both) and the exact conversion of
// two values to an f16 pair.
#pragma once
#include "common.cuh"

namespace ptxattn {

// FlashFwdParams::kv_fp8; runtime/ops/fp8.py mirrors it (KV_FP8_CODES).
enum Fp8Kind : int {
  FP8_NONE = 0,  // K and V hold q's dtype
  FP8_E4M3 = 1,
  FP8_E5M2 = 2,
};

// The fp8 values in bytes 0 and 1 of x as a packed f16 pair (byte 0 in the low half), exact:
// every e4m3 and e5m2 value is an f16 value. An e5m2 byte is the top byte of its f16. e4m3
// converts in hardware on sm_89+; before it, its exponent and mantissa shift under the sign
// into f16's, and one multiply by 2^8 (bias 15 - 7) fixes the exponent, subnormals included
// (e4m3fn's NaN, 0x7f, then reads as 480).
__device__ __forceinline__ unsigned fp8x2_to_f16x2(unsigned x, int kind) {
  const unsigned high = __byte_perm(x, 0u, 0x1404u);  // byte 0 to bits 8-15, byte 1 to bits 24-31
  if (kind == FP8_E5M2) return high;
  unsigned out;
#if __CUDA_ARCH__ >= 890
  asm("{\n.reg .b16 lo, hi;\nmov.b32 {lo, hi}, %1;\ncvt.rn.f16x2.e4m3x2 %0, lo;\n}\n" : "=r"(out) : "r"(x));
#else
  const unsigned bits = (high & 0x80008000u) | ((high >> 1) & 0x3f803f80u);
  asm("fma.rn.f16x2 %0, %1, %2, %3;\n" : "=r"(out) : "r"(bits), "r"(0x5c005c00u), "r"(0x80008000u));
#endif
  return out;
}

}  // namespace ptxattn
