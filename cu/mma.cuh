// Thin wrappers over the PTX instructions the tensor-core kernels share: shared-memory
// addresses, loads and stores, a 16-byte global store, cp.async with commit/wait groups,
// ldmatrix, movmatrix, mma.sync m16n8k16 (f16/bf16 in, fp32 accumulate), packing fp32 pairs
// into mma operands, ftz exp2, and the XOR swizzle of 16-byte chunks that keeps ldmatrix and
// cp.async free of bank conflicts.
#pragma once
#include "common.cuh"

namespace ptxattn {

__device__ __forceinline__ unsigned smem_u32(const void* ptr) {
  return static_cast<unsigned>(__cvta_generic_to_shared(ptr));
}

// 16 bytes to / from a shared-window byte address; 16 bytes to global memory.
__device__ __forceinline__ void st_shared_16(unsigned smem_addr, uint4 v) {
  asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};\n" ::"r"(smem_addr), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w)
               : "memory");
}
// Four 8x8 matrices of 16-bit elements from the warp's registers to shared memory (stmatrix):
// each lane's register i holds row lane / 4, columns 2 (lane % 4) and the next, of matrix i (an
// mma accumulator fragment's layout), and lanes 8 i .. 8 i + 7 give the addresses of matrix i's
// eight 16-byte rows.
__device__ __forceinline__ void stmatrix_x4(unsigned smem_addr, unsigned m0, unsigned m1, unsigned m2, unsigned m3) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(smem_addr), "r"(m0),
               "r"(m1), "r"(m2), "r"(m3)
               : "memory");
}
__device__ __forceinline__ uint4 ld_shared_16(unsigned smem_addr) {
  uint4 v;
  asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];\n" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(smem_addr)
               : "memory");
  return v;
}
// A 16-byte global store to a 16-byte aligned address, made where `store` holds (a predicated
// store: no branch around it). NVRTC compiled store_rows_staged's
// `*reinterpret_cast<uint4*>(dst) = ld_shared_16(..)` into four 4-byte stores, which moved each
// output sector four times (flash_fwd_notes v23).
__device__ __forceinline__ void st_global_16_if(void* ptr, uint4 v, bool store) {
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %5, 0;\n@p st.global.v4.b32 [%0], {%1, %2, %3, %4};\n}\n" ::"l"(ptr),
               "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w), "r"(static_cast<int>(store))
               : "memory");
}

// ---- asynchronous global -> shared copies ----------------------------------------
__device__ __forceinline__ void cp_async_16(void* smem_dst, const void* global_src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(smem_u32(smem_dst)),
               "l"(global_src));
}
// As cp_async_16, but when read is false nothing is read and 16 zero bytes are written
// (global_src must still be a valid address).
__device__ __forceinline__ void cp_async_16_or_zero(void* smem_dst, const void* global_src, bool read) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_u32(smem_dst)),
               "l"(global_src), "r"(read ? 16 : 0));
}
// Four bytes (cp.async.ca: the 4-byte size needs the L1 path), zeros when read is false.
__device__ __forceinline__ void cp_async_4_or_zero(void* smem_dst, const void* global_src, bool read) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(smem_u32(smem_dst)),
               "l"(global_src), "r"(read ? 4 : 0));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
// Waits until at most N of this thread's committed groups are still in flight.
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

// ---- ldmatrix: four 8x8 b16 matrices; lane l supplies the row address l ----------
// The address is a shared-window byte address (smem_u32), so tile offsets stay 32-bit.
__device__ __forceinline__ void ldmatrix_x4(unsigned (&r)[4], unsigned smem_addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr));
}
__device__ __forceinline__ void ldmatrix_x4_trans(unsigned (&r)[4], unsigned smem_addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr));
}

// Transposes an 8x8 b16 matrix held one packed pair a lane (row lane / 4, columns 2 (lane % 4)
// and + 1) across the warp: lane l receives row l / 4 of the transpose the same way.
__device__ __forceinline__ unsigned movmatrix_trans(unsigned x) {
  unsigned y;
  asm("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;\n" : "=r"(y) : "r"(x));
  return y;
}

// ---- mma.sync ----------------------------------------------------------------------
template <class T> constexpr bool is_bf16 = false;
template <> constexpr bool is_bf16<__nv_bfloat16> = true;

// d += a (16x16, row) * b (16x8, col), fp32 accumulate; T is __half or __nv_bfloat16.
template <class T>
__device__ __forceinline__ void mma_16816(float (&d)[4], const unsigned (&a)[4], unsigned b0,
                                          unsigned b1) {
  if constexpr (is_bf16<T>) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, "
        "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, "
        "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
}

// Two floats rounded to T, packed low-first into one 32-bit register (an mma operand).
template <class T>
__device__ __forceinline__ unsigned pack2(float lo, float hi) {
  if constexpr (is_bf16<T>) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<unsigned*>(&v);
  } else {
    __half2 v = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<unsigned*>(&v);
  }
}

// The A fragment (m16 x k16) of P from scores in the accumulator layout of two n8 tiles:
// s points at 8 consecutive floats, tile 0's four values then tile 1's. That layout is the
// A layout of one k16 step, so P feeds P V straight from registers.
template <class T>
__device__ __forceinline__ void scores_as_a_operand(const float* s, unsigned (&a)[4]) {
#pragma unroll
  for (int e = 0; e < 4; ++e) a[e] = pack2<T>(s[2 * e], s[2 * e + 1]);
}

// exp2 without denormal handling: results below 2^-126 flush to 0.
__device__ __forceinline__ float exp2_ftz(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// Shared tiles are [rows][cols] of b16 with each row's 16-byte chunks XOR-swizzled by
// row & 7, so the eight rows an ldmatrix reads (and a warp's cp.async writes) hit eight
// different bank groups. Needs cols >= 64 (eight chunks a row).
__device__ __forceinline__ int swizzle(int row, int chunk) { return chunk ^ (row & 7); }

}  // namespace ptxattn
