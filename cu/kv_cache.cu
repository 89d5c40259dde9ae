// Writing new keys and values into a KV cache, contiguous or paged.
//
//   k_new, v_new  [rows, Hkv, n, D] (contiguous mode)  or  [tokens, Hkv, D] (paged: rows = tokens, n = 1)
//   caches        addressed as (page, kv head, token in page, d) through strides, as in decode.cu
//   contiguous    row b's token i goes to (page b, slot seq_lens[b] + i); a row with
//                 seq_lens[b] + n > capacity (or seq_lens[b] < 0) is not written, and reported
//   paged         token r goes to slot_mapping[r] = page * page_size + offset (int32 or int64);
//                 -1 skips the token, a page outside the pool is reported and skipped
//   fp8 scales    per-(token, kv head) float32 arrays addressed like the cache less its last
//                 axis: k_scales / v_scales (the cache's, written), kn_scales / vn_scales (the
//                 new rows', read); null where the scale is per tensor
//
// kv_append: a flat grid-stride loop over 16-byte chunks of (row, token, head, K or V); the
// kernel only moves bytes, so one variant serves every dtype (elem_bytes scales the element
// strides), fp8 rows included, whose per-token scales it copies beside them.
// kv_append_quant_<src>_<fp8>: f16 / bf16 rows quantized into an fp8 cache, `group_lanes`
// lanes a row (see quantize). kv_advance: seq_lens[b] += n for every row the append wrote; a
// separate launch so that no thread of the append reads a length another thread has already
// moved.
#include "common.cuh"

namespace ptxattn {
namespace kv_cache {

struct KvAppendParams {
  const void* k_new;
  const void* v_new;
  void* k_cache;
  void* v_cache;
  int* seq_lens;             // contiguous mode: each row's write position (advanced by kv_advance)
  const void* slot_mapping;  // paged mode: [tokens] int32 or int64; null in contiguous mode
  int* fault;
  float* k_scales;           // fp8 caches with per-token scales, else null
  float* v_scales;
  const float* kn_scales;    // fp8 new rows with per-token scales (copied into k_scales), else null
  const float* vn_scales;
  long long kn_stride_row, kn_stride_head, kn_stride_tok;
  long long vn_stride_row, vn_stride_head, vn_stride_tok;
  long long k_stride_page, k_stride_head, k_stride_tok;
  long long v_stride_page, v_stride_head, v_stride_tok;
  long long ks_stride_page, ks_stride_head, ks_stride_tok;
  long long vs_stride_page, vs_stride_head, vs_stride_tok;
  long long kns_stride_row, kns_stride_head, kns_stride_tok;
  long long vns_stride_row, vns_stride_head, vns_stride_tok;
  int rows, heads, tokens;   // tokens = n per row (1 in paged mode)
  int dk, dv;                // elements; dk * elem_bytes and dv * elem_bytes are multiples of 16
  int elem_bytes;            // of the cache
  int capacity;              // contiguous mode
  int num_pages;             // paged mode
  int page_size_log2;        // paged mode
  int slot_is_int64;
  int group_lanes;           // quantizing kernels: lanes a row, a power of two <= 32
  float k_scale, v_scale;    // quantizing kernels: per-tensor scales (where k_scales / v_scales are null)
};

// Where row `row`'s token `tok` goes: (page, slot), or page < 0 when it is not written.
struct Destination {
  long long page, slot;
};

__device__ __forceinline__ Destination destination(const KvAppendParams& p, int row, int tok, bool report) {
  if (p.slot_mapping == nullptr) {
    const int start = p.seq_lens[row];
    if (start < 0 || start > p.capacity - p.tokens) {
      if (report) raise_fault(p.fault, start < 0 ? FAULT_NEGATIVE_LENGTH : FAULT_PAST_CAPACITY, row, start + p.tokens);
      return {-1, 0};
    }
    return {row, static_cast<long long>(start) + tok};
  }
  const long long slot = p.slot_is_int64 ? static_cast<const long long*>(p.slot_mapping)[row]
                                         : static_cast<const int*>(p.slot_mapping)[row];
  if (slot < 0) return {-1, 0};  // -1: padding token, skipped by design
  const long long page = slot >> p.page_size_log2;
  if (page >= p.num_pages) {
    if (report) raise_fault(p.fault, FAULT_SLOT_OUT_OF_RANGE, row, int(slot > 0x7fffffffLL ? 0x7fffffffLL : slot));
    return {-1, 0};
  }
  return {page, slot & ((1LL << p.page_size_log2) - 1)};
}

// One (row, token, head) of K or V: where its new elements are, where they go, and where its
// per-token scale goes (null: none). Offsets in elements.
struct RowAddress {
  long long src, out, scale;
  float* scales;
};

__device__ __forceinline__ RowAddress row_address(const KvAppendParams& p, bool is_k, int row, int head, int tok,
                                                  const Destination& dst) {
  if (is_k)
    return {row * p.kn_stride_row + head * p.kn_stride_head + tok * p.kn_stride_tok,
            dst.page * p.k_stride_page + head * p.k_stride_head + dst.slot * p.k_stride_tok,
            dst.page * p.ks_stride_page + head * p.ks_stride_head + dst.slot * p.ks_stride_tok, p.k_scales};
  return {row * p.vn_stride_row + head * p.vn_stride_head + tok * p.vn_stride_tok,
          dst.page * p.v_stride_page + head * p.v_stride_head + dst.slot * p.v_stride_tok,
          dst.page * p.vs_stride_page + head * p.vs_stride_head + dst.slot * p.vs_stride_tok, p.v_scales};
}

__device__ void append(const KvAppendParams& p) {
  const int k_chunks = p.dk * p.elem_bytes / 16, v_chunks = p.dv * p.elem_bytes / 16;
  const int per_head = k_chunks + v_chunks;
  const long long total = static_cast<long long>(p.rows) * p.tokens * p.heads * per_head;
  for (long long i = blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<long long>(gridDim.x) * blockDim.x) {
    int c = int(i % per_head);
    const int head = int(i / per_head % p.heads);
    const int tok = int(i / per_head / p.heads % p.tokens);
    const int row = int(i / per_head / p.heads / p.tokens);
    const Destination dst = destination(p, row, tok, c == 0 && head == 0 && tok == 0);
    if (dst.page < 0) continue;
    const bool is_k = c < k_chunks;
    if (!is_k) c -= k_chunks;
    const RowAddress at = row_address(p, is_k, row, head, tok, dst);
    const char* src = static_cast<const char*>(is_k ? p.k_new : p.v_new) + at.src * p.elem_bytes;
    char* out = static_cast<char*>(is_k ? p.k_cache : p.v_cache) + at.out * p.elem_bytes;
    reinterpret_cast<uint4*>(out)[c] = reinterpret_cast<const uint4*>(src)[c];
    if (c == 0 && at.scales != nullptr) {  // an fp8 row's own scale
      at.scales[at.scale] = is_k ? p.kn_scales[row * p.kns_stride_row + head * p.kns_stride_head + tok * p.kns_stride_tok]
                                 : p.vn_scales[row * p.vns_stride_row + head * p.vns_stride_head + tok * p.vns_stride_tok];
    }
  }
}

// ---- quantizing fp8 ---------------------------------------------------------------------------
enum class Fp8 { e4m3, e5m2 };

template <Fp8 F> constexpr float kFp8Max = F == Fp8::e4m3 ? 448.f : 57344.f;

// x as an fp8 byte, rounded to nearest even and saturated to +-kFp8Max (infinities included);
// NaN gives 0x7f. What cvt.rn.satfinite does on sm_89+, in integer steps for sm_80 / sm_86;
// tests/test_fp8_convert.py checks it against ml_dtypes on the host.
template <Fp8 F> __device__ __forceinline__ unsigned fp8_from_float(float x) {
  constexpr int kMantissa = F == Fp8::e4m3 ? 3 : 2, kBias = F == Fp8::e4m3 ? 7 : 15;
  constexpr unsigned kMaxBits = F == Fp8::e4m3 ? 0x7e : 0x7b;
  constexpr float kMinNormal = 1.f / (1 << (kBias - 1));
  const unsigned sign = (__float_as_uint(x) >> 24) & 0x80;
  const float a = fabsf(x);
  if (a != a) return 0x7f;
  if (a >= kFp8Max<F>) return sign | kMaxBits;
  if (a < kMinNormal)  // a subnormal (or zero): a whole number of the smallest step, 2^(1 - bias - mantissa)
    return sign | __float2uint_rn(a * float(1 << (kBias - 1 + kMantissa)));
  // Normal: drop the low mantissa bits of a's encoding, ties to even, and rebias the exponent.
  constexpr int kDrop = 23 - kMantissa;
  const unsigned u = __float_as_uint(a);
  const unsigned rounded = (u + (1u << (kDrop - 1)) - 1 + ((u >> kDrop) & 1)) >> kDrop;
  return sign | (rounded - ((127 - kBias) << kMantissa));
}

// Two floats as two fp8 bytes, lo in the low byte.
template <Fp8 F> __device__ __forceinline__ unsigned fp8x2_from_float(float lo, float hi) {
#if __CUDA_ARCH__ >= 890
  unsigned short out;
  if constexpr (F == Fp8::e4m3) {
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(out) : "f"(hi), "f"(lo));
  } else {
    asm("cvt.rn.satfinite.e5m2x2.f32 %0, %1, %2;" : "=h"(out) : "f"(hi), "f"(lo));
  }
  return out;
#else
  return fp8_from_float<F>(lo) | fp8_from_float<F>(hi) << 8;
#endif
}

// 16 elements of T (two 16-byte loads) as floats.
template <class T> __device__ __forceinline__ void load16(const T* src, float (&x)[16]) {
  const uint4 raw[2] = {reinterpret_cast<const uint4*>(src)[0], reinterpret_cast<const uint4*>(src)[1]};
  const T* v = reinterpret_cast<const T*>(raw);
#pragma unroll
  for (int i = 0; i < 16; ++i) x[i] = to_float(v[i]);
}

// The largest finite magnitude among a row's elements (NaN and +-inf left out, so that they
// do not decide the scale; they become NaN / +-max), `lanes` lanes sharing the row.
template <class T> __device__ __forceinline__ float row_amax(const T* src, int chunks, int sub, int lanes) {
  float amax = 0.f;
  for (int c = sub; c < chunks; c += lanes) {
    float x[16];
    load16(src + 16 * c, x);
#pragma unroll
    for (int i = 0; i < 16; ++i) amax = fmaxf(amax, isfinite(x[i]) ? fabsf(x[i]) : 0.f);
  }
  return amax;
}

// kv_append_quant: each (row, token, head) of K and of V is a unit of `group_lanes` lanes
// (enough 16-element chunks for a lane each, up to a warp); a warp takes 32 / group_lanes
// units at a time, K units then V units of a token, heads innermost. Per-token scales:
// scale = amax / FP8_MAX (1 for a row without a finite nonzero value), stored in the scale
// array; per tensor: p.k_scale / p.v_scale. Every element is written as x / scale, a true
// fp32 division (reference.quantize_fp8 computes the same float32 quotient) rounded to fp8.
template <class T, Fp8 F> __device__ void quantize(const KvAppendParams& p) {
  const int lanes = p.group_lanes, sub = threadIdx.x % lanes;
  const int per_warp = 32 / lanes;
  const long long units = 2LL * p.rows * p.tokens * p.heads;
  const long long warps = static_cast<long long>(gridDim.x) * blockDim.x / 32;
  // A warp's loop is uniform (its first unit decides), so all its lanes meet the shuffles.
  for (long long first = (blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x) / 32 * per_warp;
       first < units; first += warps * per_warp) {
    const long long unit = first + threadIdx.x % 32 / lanes;
    const int head = int(unit % p.heads);
    const bool is_k = unit / p.heads % 2 == 0;
    const int tok = int(unit / p.heads / 2 % p.tokens);
    const int row = int(unit / p.heads / 2 / p.tokens);
    Destination dst{-1, 0};
    if (unit < units) dst = destination(p, row, tok, is_k && head == 0 && tok == 0 && sub == 0);
    const RowAddress at = row_address(p, is_k, row, head, tok, dst);
    const T* src = static_cast<const T*>(is_k ? p.k_new : p.v_new) + at.src;
    const int chunks = (is_k ? p.dk : p.dv) / 16;
    const bool per_token = at.scales != nullptr;
    float amax = dst.page >= 0 && per_token ? row_amax(src, chunks, sub, lanes) : 0.f;
    for (int offset = lanes / 2; offset > 0; offset /= 2) amax = fmaxf(amax, __shfl_xor_sync(~0u, amax, offset));
    if (dst.page < 0) continue;
    const float scale = !per_token ? (is_k ? p.k_scale : p.v_scale) : amax > 0.f ? __fdiv_rn(amax, kFp8Max<F>) : 1.f;
    if (per_token && sub == 0) at.scales[at.scale] = scale;
    uint4* out = reinterpret_cast<uint4*>(static_cast<unsigned char*>(is_k ? p.k_cache : p.v_cache) + at.out);
    for (int c = sub; c < chunks; c += lanes) {
      float x[16];
      load16(src + 16 * c, x);
      unsigned word[4];
#pragma unroll
      for (int w = 0; w < 4; ++w) {
        word[w] = fp8x2_from_float<F>(__fdiv_rn(x[4 * w], scale), __fdiv_rn(x[4 * w + 1], scale)) |
                  fp8x2_from_float<F>(__fdiv_rn(x[4 * w + 2], scale), __fdiv_rn(x[4 * w + 3], scale)) << 16;
      }
      out[c] = make_uint4(word[0], word[1], word[2], word[3]);
    }
  }
}

__device__ void advance(const KvAppendParams& p) {
  const int row = blockIdx.x * blockDim.x + threadIdx.x;
  if (row >= p.rows) return;
  const int start = p.seq_lens[row];
  if (start >= 0 && start <= p.capacity - p.tokens) p.seq_lens[row] = start + p.tokens;
}

}  // namespace kv_cache
}  // namespace ptxattn

extern "C" __global__ void kv_append(const ptxattn::kv_cache::KvAppendParams p) { ptxattn::kv_cache::append(p); }
extern "C" __global__ void kv_advance(const ptxattn::kv_cache::KvAppendParams p) { ptxattn::kv_cache::advance(p); }

#define PTXATTN_KV_QUANT_VARIANT(name, T, fp8)                                  \
  extern "C" __global__ void name(const ptxattn::kv_cache::KvAppendParams p) { \
    ptxattn::kv_cache::quantize<T, ptxattn::kv_cache::Fp8::fp8>(p);             \
  }
#include "variants.inc"
