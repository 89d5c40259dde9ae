// Split-KV decode attention over a KV cache, contiguous or paged, in one kernel.
//
//   q          [B, Hq, Sq, Dqk]   Sq small (1..16); query t sees keys < L - Sq + 1 + t,
//                                 L = seq_lens[b] (bottom-right causal), optionally a left window
//   K, V       addressed as (page, kv head, token in page, d) through strides:
//                contiguous cache [B, Hkv, cap, D] or [B, cap, Hkv, D]: page = batch row,
//                  block_table null, capacity = cap
//                paged pool [pages, Hkv, page_size, D] (HND) or [pages, page_size, Hkv, D] (NHD):
//                  page = block_table[b, key / page_size], capacity = max_pages * page_size
//   o_part     [B, Hq, Sq, splits, Dv] f32, o of each split normalised by its own sum
//   lse_part   [B, Hq, Sq, splits] f32, natural log; -inf for a split that saw no key
// merge.cu's fixed-order combine turns the partials into o and lse (and applies sinks); on
// sm_90 it is launched programmatically, so its CTAs start as the split's finish their keys
// (allow_dependent_launch) and wait for the whole split grid before reading. With
// one split there is nothing to combine: o_out is set instead, and the kernel writes the final
// o [B, Hq, Sq, Dv] in q's dtype and lse [B, Hq, Sq] itself, applying sinks as merge.cu does
// (the values its one-state combine would give), which saves the combine's launch and the
// partials' round trip through memory.
//
// decode_split_<dt>_d<D>: grid (Hkv * row_blocks, B, splits), 128 threads (4 warps), dynamic
// shared memory sized by runtime/ops/decode.py (shared_bytes). One CTA reads the keys
// [split * keys_per_split, +keys_per_split) of one (batch, kv head) once, for all Hq/Hkv query
// heads x Sq rows of its group ("rows", head-major: row = head_in_group * Sq + t). Scores are
// computed transposed (S^T = K Q^T, keys along the mma's m, mma.sync m16n8k16, fp32
// accumulate), so a warp holds 8 query rows along n: warps_m warps along the rows form a warp
// group, and the 4 / warps_m groups share the keys in blocks of 16 (block j of the split goes
// to group j % groups). Each group streams its blocks through its own cp.async ring and
// synchronises only its own warps (one warp: __syncwarp), so no CTA-wide barrier runs while
// keys stream. Each warp keeps its own online-softmax state; the groups are merged in shared
// memory at the end, in warp order. Keys at or past the row's live end are never read
// (zero-filled), so NaN in the unused cache tail cannot reach the output; a split with no live
// key writes its neutral partial and returns at once.
//
// f32 operands run on the same bf16 tensor-core path, each value split into three bf16 terms
// (hi + mid + lo carries 24 mantissa bits) and the six significant cross products summed in
// fp32: fp32-level accuracy without a second code path.
//
// fp8 caches (decode_split_<dt>_<e4m3|e5m2>_d<D>): K/V stream as bytes and become f16 in
// registers, exactly (every e4m3 and e5m2 value is an f16 value; one cvt a pair on sm_89+,
// one byte move for e5m2), and both products run on the f16 tensor cores. bf16 queries are
// scaled by a power of two per row into f16's range once per CTA (q_tile_for_fp8), the
// scores unscaled in fp32. A per-(token, kv head) K scale multiplies a key's score in fp32; a
// per-token V scale multiplies its probability, and P V runs on p * v_scale / R, R the running
// row maximum of |p * v_scale|, so the f16 operand stays in [-1, 1] whatever the scales and
// their signs (O is kept in units of R, as it is kept in units of the running max). Per-tensor
// scales are folded into `scale` (K) and `v_scale` (V) on the host. The bytes are read with
// the 16-bit ldmatrix, so a lane receives four consecutive bytes of a key: the queries are
// permuted once per CTA to match, and O's d come out permuted (undone at the end-of-CTA merge).
#include "attention_common.cuh"
#include "mma.cuh"

namespace ptxattn {
namespace decode {

struct DecodeParams {
  const void* q;
  const void* k;
  const void* v;
  const int* seq_lens;     // [B] live keys of each row
  const int* block_table;  // [B, max_pages] page ids, or null for a contiguous cache
  float* o_part;        // null when o_out is set
  float* lse_part;
  void* o_out;          // one split: the final o, else null
  float* lse_out;       // one split: the final lse, or null when not wanted
  const float* sinks;   // one split: [Hq] or null
  int* fault;
  const float* k_scales;  // fp8 caches: per-(token, kv head) scales addressed like the cache, or null
  const float* v_scales;
  long long q_stride_b, q_stride_h, q_stride_s;
  long long k_stride_page, k_stride_head, k_stride_tok;
  long long v_stride_page, v_stride_head, v_stride_tok;
  long long block_table_stride;  // elements between two batch rows of block_table
  long long o_out_stride_b, o_out_stride_h, o_out_stride_s;
  long long lse_out_stride_b, lse_out_stride_h, lse_out_stride_s;
  long long k_scale_stride_page, k_scale_stride_head, k_scale_stride_tok;
  long long v_scale_stride_page, v_scale_stride_head, v_scale_stride_tok;
  int hq, hkv, sq, dqk, dv;
  int capacity;        // keys a row can hold
  int num_pages;       // pages in the pool (paged only)
  int page_size_log2;  // paged only
  int num_splits;
  int keys_per_split;  // a multiple of kBlockKeys<KV> * kWarps
  int warps_m;         // 1, 2 or 4 warps along the rows (a warp group)
  int stages;          // depth of each group's K/V cp.async ring: 2, 3 or 4
  int window_left;     // kUnboundedWindow when unbounded
  float scale;     // times the per-tensor K scale of an fp8 cache
  float softcap;
  float v_scale;   // the per-tensor V scale of an fp8 cache, else 1
};

constexpr int kThreads = 128;
constexpr int kWarps = kThreads / 32;
constexpr int kTileKeys = 16;  // keys of one mma m-tile of scores (16 keys x 8 query rows)
constexpr int kWarpRows = 8;   // query rows a warp holds: the n of its mma

// ---- fp8 cache elements ---------------------------------------------------------------------
// The bytes of an fp8 cache; only fp8_pair_to_f16 reads their meaning.
struct fp8_e4m3 { unsigned char bits; };
struct fp8_e5m2 { unsigned char bits; };
template <class KV> constexpr bool kIsFp8 = false;
template <> constexpr bool kIsFp8<fp8_e4m3> = true;
template <> constexpr bool kIsFp8<fp8_e5m2> = true;

// Keys a group takes per step from a cache of KV: one m-tile, or two for fp8, whose bytes
// cost so little that the per-step softmax work (column maxima, rescales) would set the pace
// (cu/decode_tuning.md v10).
template <class KV> constexpr int kBlockKeys = kIsFp8<KV> ? 2 * kTileKeys : kTileKeys;

// D_TILE bounds both Dqk and Dv (runtime values, multiples of 8 / 4 for f32).
template <class T, int D_TILE>
struct Config {
  static constexpr int kChunk = 16 / int(sizeof(T));  // elements in one 16-byte chunk
  static constexpr int kChunksPerRow = D_TILE / kChunk;
  static constexpr int kBlockElems = kBlockKeys<T> * D_TILE;
  static constexpr int kRowsPerLane = kBlockKeys<T> * kChunksPerRow / 32;  // one warp copies a block
  static_assert(kChunksPerRow >= 8, "the XOR swizzle needs rows of at least 128 bytes");
  static_assert(kThreads % kChunksPerRow == 0, "query loader mapping");
};
template <class A, class B> constexpr bool kSame = false;
template <class A> constexpr bool kSame<A, A> = true;

// Two fp8 values of x, the bytes `selector` (a __byte_perm selector) moves to bits 8..15 and
// 24..31, as a packed f16 pair (exact). An e5m2 byte is the top byte of its f16. e4m3 goes
// through the hardware conversion on sm_89+; before it, the exponent and mantissa shift under
// the sign into f16's low exponent and high mantissa bits and one multiply by 2^8 (15 - 7)
// fixes the exponent (subnormals included: the multiply keeps them), which reads e4m3fn's NaN
// (0x7f) as 480.
template <class KV>
__device__ __forceinline__ unsigned fp8_pair_to_f16(unsigned x, unsigned selector) {
  unsigned out;
  if constexpr (kSame<KV, fp8_e5m2>) {
    out = __byte_perm(x, 0u, selector);
  } else {
#if __CUDA_ARCH__ >= 890
    // The same two bytes as the low half, first one lowest: selector nibbles 1 and 3.
    const unsigned pair = __byte_perm(x, 0u, 0x4400u | ((selector >> 4) & 0xfu) | ((selector >> 8) & 0xf0u));
    asm("{\n.reg .b16 lo, hi;\nmov.b32 {lo, hi}, %1;\ncvt.rn.f16x2.e4m3x2 %0, lo;\n}\n" : "=r"(out) : "r"(pair));
#else
    const unsigned w = __byte_perm(x, 0u, selector);
    const unsigned bits = (w & 0x80008000u) | ((w >> 1) & 0x3f803f80u);
    asm("fma.rn.f16x2 %0, %1, %2, %3;\n" : "=r"(out) : "r"(bits), "r"(0x5c005c00u), "r"(0x80008000u));
#endif
  }
  return out;
}
// __byte_perm selectors: bytes (0, 1), (2, 3), (0, 2), (1, 3) of a register.
constexpr unsigned kBytes01 = 0x1404u, kBytes23 = 0x3424u, kBytes02 = 0x2404u, kBytes13 = 0x3414u;

// fp8_pair_to_f16 of the pair in half HALF of x (bytes 0, 1 or 2, 3): e4m3 on sm_89+ converts
// straight from that half (the conversion reads either half of a register), with no byte move.
template <class KV, int HALF>
__device__ __forceinline__ unsigned fp8_half_to_f16(unsigned x) {
#if __CUDA_ARCH__ >= 890
  if constexpr (kSame<KV, fp8_e4m3>) {
    unsigned out;
    if constexpr (HALF == 0) {
      asm("{\n.reg .b16 lo, hi;\nmov.b32 {lo, hi}, %1;\ncvt.rn.f16x2.e4m3x2 %0, lo;\n}\n" : "=r"(out) : "r"(x));
    } else {
      asm("{\n.reg .b16 lo, hi;\nmov.b32 {lo, hi}, %1;\ncvt.rn.f16x2.e4m3x2 %0, hi;\n}\n" : "=r"(out) : "r"(x));
    }
    return out;
  }
#endif
  return fp8_pair_to_f16<KV>(x, HALF == 0 ? kBytes01 : kBytes23);
}

// Shared-memory tiles are row-major with 16-byte chunks XOR-swizzled by row (mma.cuh).
template <class T, int D_TILE>
__device__ __forceinline__ int tile_offset(int row, int col) {
  constexpr int kChunk = Config<T, D_TILE>::kChunk;
  return row * D_TILE + swizzle(row, col / kChunk) * kChunk + col % kChunk;
}

// Column slice ks (elements 16 ks .. +16, chunks 2 ks and 2 ks + 1) of a 16-bit tile, for a
// lane whose ldmatrix row r has r % 8 fixed and which reads chunk 2 ks + h: the stored chunk
// (2 ks + h) ^ (r & 7) is (2 ks & ~7) + ((2 ks & 7) ^ x) with x = h ^ (r & 7), so x is computed
// once per lane and every ks costs one XOR with a constant.
__device__ __forceinline__ int slice_offset(int x, int ks) {
  return ((2 * ks) & ~7) * 8 + (((2 * ks) & 7) ^ x) * 8;
}

// Byte offset in an fp8 row of chunk c + h (c even; h = lane >> 4, in f8_x with the row's XOR):
// as in slice_offset, one XOR with a constant per c.
__device__ __forceinline__ int fp8_chunk_offset(int x, int c) { return ((c & ~7) | ((c & 7) ^ x)) << 4; }

// ---- mma operands -------------------------------------------------------------------------
// Operand<T>::kTerms: how many bf16/f16 terms carry one value of T. Fragments are arrays of
// 32-bit registers holding two 16-bit elements each, laid out as mma.m16n8k16 wants them.
template <class T> struct Operand { static constexpr int kTerms = 1; };
template <> struct Operand<float> { static constexpr int kTerms = 3; };

template <class T> struct MmaType { using type = T; };
template <> struct MmaType<float> { using type = __nv_bfloat16; };

// Whether T's softcap takes the accurate tanh (apply_softcap<true>): f32 queries and caches are
// held to 1e-5, which tanh.approx's ~2^-11 misses; 16-bit ones take tanh.approx.
template <class T> constexpr bool kExactSoftcap = false;
template <> constexpr bool kExactSoftcap<float> = true;

// The queries' type in the mma: q's own, or f16 against an fp8 cache (q_tile_for_fp8).
template <class T, class KV> struct QueryType { using type = T; };
template <class T> struct QueryType<T, fp8_e4m3> { using type = __half; };
template <class T> struct QueryType<T, fp8_e5m2> { using type = __half; };

// (x0, x1) as Operand<T>::kTerms packed pairs; for f32, x = hi + mid + lo in bf16.
template <class T>
__device__ __forceinline__ void to_terms(float x0, float x1, unsigned (&out)[Operand<T>::kTerms]) {
  if constexpr (Operand<T>::kTerms == 1) {
    out[0] = pack2<T>(x0, x1);
  } else {
#pragma unroll
    for (int i = 0; i < Operand<T>::kTerms; ++i) {
      const __nv_bfloat16 h0 = __float2bfloat16_rn(x0), h1 = __float2bfloat16_rn(x1);
      out[i] = pack2<__nv_bfloat16>(__bfloat162float(h0), __bfloat162float(h1));
      x0 -= __bfloat162float(h0);
      x1 -= __bfloat162float(h1);
    }
  }
}

template <class T>
struct FragA { unsigned r[Operand<T>::kTerms][4]; };
template <class T>
struct FragB { unsigned r[Operand<T>::kTerms][2]; };

// c += a * b over every term pair whose product is above fp32 rounding (i + j < terms).
template <class T>
__device__ __forceinline__ void mma(float (&c)[4], const FragA<T>& a, const FragB<T>& b) {
  constexpr int kTerms = Operand<T>::kTerms;
#pragma unroll
  for (int i = kTerms - 1; i >= 0; --i)
#pragma unroll
    for (int j = kTerms - 1 - i; j >= 0; --j) mma_16816<typename MmaType<T>::type>(c, a.r[i], b.r[j][0], b.r[j][1]);
}

// Lane coordinates inside an mma fragment (g = group, t = thread in group) and, for the
// 16-bit ldmatrix loads, each operand's row in a 16-row tile and its slice XOR.
struct Lane {
  int g, t, lane;
  int k_row, k_x;    // A = K: keys 0..7 / 8..15 (lanes 8..15, 24..31), chunk + 1 (lanes 16..31)
  int v_row, v_x;    // A = V^T (transposed load): keys 0..7 / 8..15 (lanes 16..31), chunk + 1 (lanes 8..15, 24..31)
  int f8_row, f8_x;  // fp8 K and V: keys as for K, two slices (chunks c, c + 1) per load
};

__device__ __forceinline__ Lane make_lane(int lane) {
  Lane ln;
  ln.g = lane / 4, ln.t = lane % 4, ln.lane = lane;
  ln.k_row = lane & 15, ln.k_x = (lane >> 4) ^ (lane & 7);
  ln.v_row = (lane & 7) + 8 * (lane >> 4), ln.v_x = ((lane >> 3) & 1) ^ (lane & 7);
  ln.f8_row = ln.k_row, ln.f8_x = ln.k_x;
  return ln;
}

// A = K, keys 0 .. 16 of a block over d 16 ks .. +16 (row-major, keys along m).
template <class T, int D_TILE>
__device__ __forceinline__ FragA<T> load_a_keys(const T* block, int ks, const Lane& ln) {
  FragA<T> a;
  if constexpr (sizeof(T) == 2) {
    ldmatrix_x4(a.r[0], smem_u32(block + ln.k_row * D_TILE + slice_offset(ln.k_x, ks)));
  } else {
#pragma unroll
    for (int i = 0; i < 4; ++i) {  // reg i: key g + 8 (i & 1), d 16 ks + 2t + 8 (i >> 1)
      const float2 x = *reinterpret_cast<const float2*>(
          block + tile_offset<T, D_TILE>(ln.g + 8 * (i & 1), 16 * ks + 2 * ln.t + 8 * (i >> 1)));
      unsigned terms[3];
      to_terms<T>(x.x, x.y, terms);
#pragma unroll
      for (int j = 0; j < 3; ++j) a.r[j][i] = terms[j];
    }
  }
  return a;
}

// A = V^T for O^T += V^T P^T: d 16 j .. +16 along m over the 16 keys of a block.
template <class T, int D_TILE>
__device__ __forceinline__ FragA<T> load_a_values(const T* block, int j, const Lane& ln) {
  FragA<T> a;
  if constexpr (sizeof(T) == 2) {
    ldmatrix_x4_trans(a.r[0], smem_u32(block + ln.v_row * D_TILE + slice_offset(ln.v_x, j)));
  } else {
#pragma unroll
    for (int i = 0; i < 4; ++i) {  // reg i: d 16 j + g + 8 (i & 1), keys 2t, 2t + 1 (+ 8 (i >> 1))
      const int key = 2 * ln.t + 8 * (i >> 1), col = 16 * j + ln.g + 8 * (i & 1);
      unsigned terms[3];
      to_terms<T>(block[tile_offset<T, D_TILE>(key, col)], block[tile_offset<T, D_TILE>(key + 1, col)], terms);
#pragma unroll
      for (int k = 0; k < 3; ++k) a.r[k][i] = terms[k];
    }
  }
  return a;
}

// B = Q^T for S^T = K Q^T: the warp's 8 query rows (row0 ..) along n, every slice of d, read
// once per CTA and kept in registers.
template <class T, int D_TILE>
__device__ __forceinline__ void load_b_queries(const T* q_tile, int row0, const Lane& ln,
                                               FragB<T> (&b)[D_TILE / 16]) {
  if constexpr (sizeof(T) == 2) {
#pragma unroll
    for (int ks = 0; ks < D_TILE / 16; ks += 2) {  // lane l: row l % 8, chunk 2 ks + l / 8
      unsigned r[4];
      ldmatrix_x4(r, smem_u32(q_tile + tile_offset<T, D_TILE>(row0 + (ln.lane & 7), 8 * (2 * ks + ln.lane / 8))));
      b[ks].r[0][0] = r[0], b[ks].r[0][1] = r[1], b[ks + 1].r[0][0] = r[2], b[ks + 1].r[0][1] = r[3];
    }
  } else {
#pragma unroll
    for (int ks = 0; ks < D_TILE / 16; ++ks)
#pragma unroll
      for (int i = 0; i < 2; ++i) {  // reg i: query g, d 16 ks + 2t + 8 i
        const float2 x = *reinterpret_cast<const float2*>(
            q_tile + tile_offset<T, D_TILE>(row0 + ln.g, 16 * ks + 2 * ln.t + 8 * i));
        unsigned terms[3];
        to_terms<T>(x.x, x.y, terms);
#pragma unroll
        for (int j = 0; j < 3; ++j) b[ks].r[j][i] = terms[j];
      }
  }
}

// P^T (probabilities of one 16-key block, S^T's accumulator layout: keys g, g + 8 and queries
// 2t, 2t + 1 in this lane) as the B operand of the next mma (keys 2t, 2t + 1, + 8 and query
// g): each packed 8 x 8 half transposed across the warp by movmatrix.
template <class T>
__device__ __forceinline__ FragB<T> probs_as_b(const float (&p)[4]) {
  FragB<T> b;
#pragma unroll
  for (int i = 0; i < 2; ++i) {  // reg i: keys 8 i ..
    unsigned terms[Operand<T>::kTerms];
    to_terms<T>(p[2 * i], p[2 * i + 1], terms);
#pragma unroll
    for (int j = 0; j < Operand<T>::kTerms; ++j) b.r[j][i] = movmatrix_trans(terms[j]);
  }
  return b;
}

// fp8 A operands, two 16-wide slices (chunks c, c + 1) per ldmatrix. K: lane (g, t) gets bytes
// 4t .. 4t + 3 of key g's chunk, so the mma's k index 2t + j is d 4t + j and 2t + 8 + j is
// d 4t + 2 + j (q_tile_for_fp8 permutes the queries alike). a[h]: slice c + h.
template <class KV, int D_TILE>
__device__ __forceinline__ void load_a_keys_fp8(const unsigned char* block, int c, const Lane& ln,
                                                FragA<__half> (&a)[2]) {
  unsigned r[4];  // r[2h]: keys 0 .. 8 of slice c + h, r[2h + 1]: keys 8 .. 16
  ldmatrix_x4(r, smem_u32(block + ln.f8_row * D_TILE + fp8_chunk_offset(ln.f8_x, c)));
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    a[h].r[0][0] = fp8_half_to_f16<KV, 0>(r[2 * h]);
    a[h].r[0][1] = fp8_half_to_f16<KV, 0>(r[2 * h + 1]);
    a[h].r[0][2] = fp8_half_to_f16<KV, 1>(r[2 * h]);
    a[h].r[0][3] = fp8_half_to_f16<KV, 1>(r[2 * h + 1]);
  }
}

// x's byte pairs (0, 2) and (1, 3) as f16 pairs, into even and odd. e4m3 on sm_89+ moves both
// pairs into the halves with one byte permute and converts each half (fp8_half_to_f16), where
// two selections would take a permute each.
template <class KV>
__device__ __forceinline__ void fp8_interleaved_pairs_to_f16(unsigned x, unsigned& even, unsigned& odd) {
#if __CUDA_ARCH__ >= 890
  if constexpr (kSame<KV, fp8_e4m3>) {
    const unsigned halves = __byte_perm(x, 0u, 0x3120u);  // bytes 0, 2, 1, 3
    even = fp8_half_to_f16<KV, 0>(halves);
    odd = fp8_half_to_f16<KV, 1>(halves);
    return;
  }
#endif
  even = fp8_pair_to_f16<KV>(x, kBytes02);
  odd = fp8_pair_to_f16<KV>(x, kBytes13);
}

// V^T: the transposed 16-bit load gives lane (g, t) keys 2t, 2t + 1 of columns 2g, 2g + 1 (one
// byte pair each), so slice c's m-tile holds the even columns (d = 16 c + 2g) in its rows
// 0 .. 8 and the odd ones in rows 8 .. 16; O^T's accumulator m-tile c keeps that order.
template <class KV, int D_TILE>
__device__ __forceinline__ void load_a_values_fp8(const unsigned char* block, int c, const Lane& ln,
                                                  FragA<__half> (&a)[2]) {
  unsigned r[4];
  ldmatrix_x4_trans(r, smem_u32(block + ln.f8_row * D_TILE + fp8_chunk_offset(ln.f8_x, c)));
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    fp8_interleaved_pairs_to_f16<KV>(r[2 * h], a[h].r[0][0], a[h].r[0][1]);
    fp8_interleaved_pairs_to_f16<KV>(r[2 * h + 1], a[h].r[0][2], a[h].r[0][3]);
  }
}

// The power of two 2^k that brings a query row of largest magnitude amax just under 2^15 (f16's
// largest finite is 65504): 1 for a zero or non-finite amax. Exact both ways (|k| <= 126).
__device__ __forceinline__ float f16_row_factor(float amax, bool inverse) {
  int e;
  frexpf(amax, &e);  // amax < 2^e
  const int k = amax > 0.f && isfinite(amax) ? min(max(15 - e, -126), 126) : 0;
  return __int_as_float((127 + (inverse ? -k : k)) << 23);
}

// The CTA's query tile, rewritten in place for the fp8 kernels: each row times its
// f16_row_factor, as f16 (exact for f16 queries and for bf16 ones down to 2^-24 of the row's
// largest), each 16-wide slice in the order load_b_keys_fp8 gives d: position 2t + j <- d
// 4t + j and 8 + 2t + j <- d 4t + 2 + j. row_amax [rows] receives each row's largest
// magnitude. Each thread rewrites only the two chunks it read.
template <class T, int D_TILE>
__device__ __forceinline__ void q_tile_for_fp8(T* q_tile, float* row_amax, int rows) {
  constexpr int kSlices = D_TILE / 16;
  for (int r = threadIdx.x; r < rows; r += kThreads) {
    float amax = 0.f;
    for (int col = 0; col < D_TILE; col += 8) {
      __align__(16) T x[8];
      *reinterpret_cast<uint4*>(x) = *reinterpret_cast<const uint4*>(q_tile + tile_offset<T, D_TILE>(r, col));
#pragma unroll
      for (int i = 0; i < 8; ++i) amax = fmaxf(amax, fabsf(to_float(x[i])));
    }
    row_amax[r] = amax;
  }
  __syncthreads();
  for (int i = threadIdx.x; i < rows * kSlices; i += kThreads) {
    const int r = i / kSlices, col = 16 * (i % kSlices);
    const float factor = f16_row_factor(row_amax[r], false);
    uint4* chunk[2] = {reinterpret_cast<uint4*>(q_tile + tile_offset<T, D_TILE>(r, col)),
                       reinterpret_cast<uint4*>(q_tile + tile_offset<T, D_TILE>(r, col + 8))};
    __align__(16) T x[16];
    *reinterpret_cast<uint4*>(x) = *chunk[0];
    *reinterpret_cast<uint4*>(x + 8) = *chunk[1];
    unsigned out[8];
#pragma unroll
    for (int pos = 0; pos < 16; pos += 2) {  // positions pos, pos + 1 <- d, d + 1
      const int d = pos < 8 ? 2 * pos : 2 * (pos - 8) + 2;
      out[pos / 2] = pack2<__half>(to_float(x[d]) * factor, to_float(x[d + 1]) * factor);
    }
    *chunk[0] = make_uint4(out[0], out[1], out[2], out[3]);
    *chunk[1] = make_uint4(out[4], out[5], out[6], out[7]);
  }
}

// ---- moving keys and queries into shared memory ---------------------------------------------
// A ring stage: the K block, the V block and, for fp8 caches, the block's K then V scales.
template <class KV, int D_TILE>
struct Stage {
  static constexpr int kBlockBytes = Config<KV, D_TILE>::kBlockElems * int(sizeof(KV));
  static constexpr int kScaleBytes = kIsFp8<KV> ? 2 * kBlockKeys<KV> * 4 : 0;
  static constexpr int kBytes = 2 * kBlockBytes + kScaleBytes;
};

// A per-(token, kv head) fp8 scale array at one (batch row or page, kv head), or null.
struct ScaleSource {
  const float* base;
  long long page_stride, tok_stride;  // elements

  ScaleSource() = default;
  __device__ __forceinline__ ScaleSource(const float* scales, long long page, int kvh, long long stride_page,
                                         long long stride_head, long long stride_tok)
      : base(scales == nullptr ? nullptr : scales + page * stride_page + kvh * stride_head),
        page_stride(stride_page), tok_stride(stride_tok) {}

  // The scale of token `slot` of page `page` (0 for a contiguous cache, whose base holds the
  // batch row) into dst, or zero when read is false; nothing for a null array.
  __device__ __forceinline__ void load(long long page, long long slot, bool read, float* dst) const {
    if (base != nullptr) {
      const float* src = base + page * page_stride + slot * tok_stride;
      cp_async_4_or_zero(dst, read ? src : base, read);
    }
  }
};

// One warp copies one block (kBlockKeys<KV> keys of K and V) into a ring stage. Lane l copies the
// 16-byte column chunk l % chunks_per_row of kRowsPerLane consecutive rows, so the lane's rows
// lie in one page whenever pages hold at least kRowsPerLane keys: one block_table lookup per
// block, read a block ahead (page_of) so that the copies never wait for it, and a steady state
// with no per-row predicate. Keys at or past key_end, and keys whose
// page id lies outside the pool (reported), become zeros. Columns at or past Dqk / Dv are never
// written here (zero_padding cleared them once). Per-(token, head) fp8 scales: lane l copies
// key l's K and V scales, zero at or past key_end or on a bad page.
template <class KV, int D_TILE>
struct BlockLoader {
  using C = Config<KV, D_TILE>;
  static constexpr int kRows = C::kRowsPerLane;
  static constexpr int kRowBytes = D_TILE * int(sizeof(KV));
  static constexpr int kBlockBytes = Stage<KV, D_TILE>::kBlockBytes;
  const char* k;     // this lane's column in kv head kvh (and batch row b, when contiguous)
  const char* v;
  const int* table;  // row b of the block table, or null for a contiguous cache
  ScaleSource k_scale, v_scale;  // fp8 per-token scales (else unused)
  long long k_tok, v_tok, k_page, v_page;  // strides in bytes
  int row0;          // first of this lane's rows in a block
  int dst0;          // byte offset of row row0, chunk x, in a stage
  int x;             // chunk ^ (row0 & 7): row row0 + i keeps the lane's chunk at x ^ (i & 7)
  bool k_read, v_read;

  __device__ __forceinline__ BlockLoader(const DecodeParams& p, int b, int kvh, int lane) {
    const int chunk = lane % C::kChunksPerRow, col = chunk * C::kChunk;
    row0 = lane / C::kChunksPerRow * kRows;
    x = chunk ^ (row0 & 7);
    dst0 = row0 * kRowBytes;
    table = p.block_table == nullptr ? nullptr : p.block_table + b * p.block_table_stride;
    const long long page = table == nullptr ? b : 0;  // paged: the page comes per block
    const KV* k_col = static_cast<const KV*>(p.k) + page * p.k_stride_page + kvh * p.k_stride_head + col;
    const KV* v_col = static_cast<const KV*>(p.v) + page * p.v_stride_page + kvh * p.v_stride_head + col;
    k = reinterpret_cast<const char*>(k_col), v = reinterpret_cast<const char*>(v_col);
    k_tok = p.k_stride_tok * int(sizeof(KV)), v_tok = p.v_stride_tok * int(sizeof(KV));
    k_page = p.k_stride_page * int(sizeof(KV)), v_page = p.v_stride_page * int(sizeof(KV));
    k_read = col < p.dqk, v_read = col < p.dv;
    k_scale = ScaleSource(p.k_scales, page, kvh, p.k_scale_stride_page, p.k_scale_stride_head, p.k_scale_stride_tok);
    v_scale = ScaleSource(p.v_scales, page, kvh, p.v_scale_stride_page, p.v_scale_stride_head, p.v_scale_stride_tok);
  }

  // Byte offset of this lane's chunk of row row0 + i in a stage (row0 is a multiple of kRows,
  // a power of two, so (row0 + i) & 7 == (row0 & 7) ^ (i & 7)).
  __device__ __forceinline__ int dst(int i) const { return dst0 + i * kRowBytes + ((x ^ (i & 7)) << 4); }

  // Paged: the page id of this lane's first row of the block at key0, or -1 when that row is
  // at or past key_end (unused for a contiguous cache). Read when the block before is copied,
  // it has landed by the time the block's own copies need it: paged16 fp8 decode stalled on
  // this read before each block (cu/decode_tuning.md v13).
  __device__ __forceinline__ int page_of(const DecodeParams& p, int key0, int key_end) const {
    const int key = key0 + row0;
    return table != nullptr && key < key_end ? table[key >> p.page_size_log2] : -1;
  }

  // Pages of at least kRows keys hold each lane's rows of a block in one page: its page_of.
  __device__ __forceinline__ bool rows_in_one_page(const DecodeParams& p) const {
    return table == nullptr || (kRows >> p.page_size_log2) <= 1;
  }

  // Byte offsets of `key` in page `id` (paged) from k / v; false (reported) for a page id
  // outside the pool.
  __device__ __forceinline__ bool locate(const DecodeParams& p, int b, int key, int id, long long& k_off,
                                         long long& v_off) const {
    if (table == nullptr) {
      k_off = key * k_tok, v_off = key * v_tok;
      return true;
    }
    if (id < 0 || id >= p.num_pages) {
      raise_fault(p.fault, FAULT_PAGE_OUT_OF_RANGE, b, id);
      return false;
    }
    const int slot = key & ((1 << p.page_size_log2) - 1);
    k_off = id * k_page + slot * k_tok;
    v_off = id * v_page + slot * v_tok;
    return true;
  }

  // The K and V scales of key `key` (one of this lane's rows, whose first row lies in page
  // `id`) into dst[0] and dst[kBlockKeys<KV>] (a per-tensor one is not copied); zero past
  // key_end or on a bad page.
  __device__ __forceinline__ void load_scales(const DecodeParams& p, int key, int key_end, int id, float* dst) const {
    bool read = key < key_end;
    long long slot = key, page = 0;
    if (read && table != nullptr) {
      if (!rows_in_one_page(p)) id = table[key >> p.page_size_log2];  // a bad id is reported by the K/V rows
      read = id >= 0 && id < p.num_pages;
      page = id, slot = key & ((1 << p.page_size_log2) - 1);
    }
    k_scale.load(page, slot, read, dst);
    v_scale.load(page, slot, read, dst + kBlockKeys<KV>);
  }

  // The block of keys key0 .. key0 + kBlockKeys<KV> (key0 a multiple of it) into stage; id:
  // its page_of.
  __device__ __forceinline__ void load(const DecodeParams& p, int b, int key0, int key_end, unsigned char* stage,
                                       int id) const {
    char* k_stage = reinterpret_cast<char*>(stage);
    char* v_stage = k_stage + kBlockBytes;
    if constexpr (kIsFp8<KV>) {
      // Lane l copies key l's scales; l is one of its own rows (kRows keys from row0 = l rounded
      // down to a multiple of kRows, since kBlockKeys<KV> == 32).
      static_assert(kBlockKeys<KV> == 32 && kRows == C::kChunksPerRow, "a lane copies one of its keys' scales");
      load_scales(p, key0 + threadIdx.x % 32, key_end, id,
                  reinterpret_cast<float*>(stage + 2 * kBlockBytes) + threadIdx.x % 32);
    }
    const int first = key0 + row0;
    const int live = key_end - first;  // rows of this lane inside the live length
    long long k_off = 0, v_off = 0;
    bool ok = live > 0 && locate(p, b, first, id, k_off, v_off);
    if (ok && live >= kRows && rows_in_one_page(p)) {
      const char* k_src = k + k_off;
      const char* v_src = v + v_off;
#pragma unroll
      for (int i = 0; i < kRows; ++i) {
        if (k_read) cp_async_16(k_stage + dst(i), k_src);
        if (v_read) cp_async_16(v_stage + dst(i), v_src);
        k_src += k_tok;
        v_src += v_tok;
      }
      return;
    }
    // The live end, a page boundary or a bad page falls inside this lane's rows.
#pragma unroll
    for (int i = 0; i < kRows; ++i) {
      const int key = first + i;
      if (i > 0 && i < live && table != nullptr && (key & ((1 << p.page_size_log2) - 1)) == 0)
        ok = locate(p, b, key, table[key >> p.page_size_log2], k_off, v_off);
      const bool read = ok && i < live;
      if (k_read) cp_async_16_or_zero(k_stage + dst(i), read ? k + k_off : k, read);
      if (v_read) cp_async_16_or_zero(v_stage + dst(i), read ? v + v_off : v, read);
      k_off += k_tok;
      v_off += v_tok;
    }
  }
};

// The query rows of this CTA into shared memory, every column of the tile (rows past the
// group and columns past Dqk: zeros).
template <class T, int D_TILE>
__device__ __forceinline__ void load_q(const DecodeParams& p, int b, int kvh, int row0, int rows, T* q_tile) {
  using C = Config<T, D_TILE>;
  const T* q = static_cast<const T*>(p.q);
  const int group_rows = (p.hq / p.hkv) * p.sq;
  const int col = threadIdx.x % C::kChunksPerRow * C::kChunk;
  for (int r = threadIdx.x / C::kChunksPerRow; r < rows; r += kThreads / C::kChunksPerRow) {
    const int gr = row0 + r;
    const bool live = gr < group_rows && col < p.dqk;
    long long off = 0;
    if (live) {
      const int head = kvh * (p.hq / p.hkv) + gr / p.sq, t = gr % p.sq;
      off = b * p.q_stride_b + head * p.q_stride_h + t * p.q_stride_s + col;
    }
    cp_async_16_or_zero(q_tile + tile_offset<T, D_TILE>(r, col), q + off, live);
  }
}

// Zeros in the columns at or past Dqk (K tiles) and Dv (V tiles) of every ring stage, which
// the block loader never writes: the mma then runs over the whole tile with no guard.
template <class KV, int D_TILE>
__device__ __forceinline__ void zero_padding(const DecodeParams& p, unsigned char* rings, int stages_total) {
  using C = Config<KV, D_TILE>;
  using S = Stage<KV, D_TILE>;
  constexpr int kKeys = kBlockKeys<KV>;
  const int chunks = stages_total * 2 * kKeys * C::kChunksPerRow;
  for (int i = threadIdx.x; i < chunks; i += kThreads) {
    const int chunk = i % C::kChunksPerRow, row = i / C::kChunksPerRow % kKeys;
    const int tile = i / (C::kChunksPerRow * kKeys);  // even: K, odd: V
    if (chunk * C::kChunk >= (tile % 2 ? p.dv : p.dqk)) {
      KV* block = reinterpret_cast<KV*>(rings + tile / 2 * S::kBytes + tile % 2 * S::kBlockBytes);
      *reinterpret_cast<uint4*>(block + tile_offset<KV, D_TILE>(row, chunk * C::kChunk)) = make_uint4(0, 0, 0, 0);
    }
  }
}

// ---- attention over one block ---------------------------------------------------------------
// Scores are computed transposed, S^T = K Q^T: the block's 16 keys along the mma's m and the
// warp's 8 query rows along n, so the 4 or 8 rows of a GQA group use half or all of each mma
// instead of a quarter or half of a 16-row tile (half the mma, softmax and O of rows-along-m;
// cu/decode_tuning.md v10). A lane holds keys g, g + 8 of query columns 2t, 2t + 1:
// s[i] is key g + 8 (i / 2), column 2t + i % 2, and every per-row quantity below is per column.
// O^T += V^T P^T keeps O with d along m: 32 floats a lane at d 128.
template <int D_TILE>
struct WarpState {
  float o[D_TILE / 16][4];  // unnormalised O^T, accumulator layout (m-tile of 16 d per entry)
  float m[2];               // running max of columns 2t, 2t + 1, base-2 scaled scores
  float l[2];               // this lane's part of their running sums
  float r[2];               // fp8 with per-token V scales: o is in units of r (attend_block_fp8)
};

// Visible keys [lo, hi) of this lane's columns 2t and 2t + 1, and the keys every column of the
// warp sees: blocks inside [full_lo, full_hi) need no mask.
struct ColumnKeys {
  int lo[2], hi[2];
  int full_lo, full_hi;
};

__device__ __forceinline__ float exp2_minus(float x, float col_max) { return exp2_ftz(x - exp_subtrahend(col_max)); }

// A column's largest value over the block from this lane's largest, x: over the 8 lanes of the column.
__device__ __forceinline__ float column_max(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 4));
  x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 8));
  return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 16));
}

// O times factor[c] in columns 2t + c, unless every factor of the warp is 1 (after the first
// keys a column's max rarely moves).
template <int D_TILE>
__device__ __forceinline__ void rescale_o(WarpState<D_TILE>& st, const float (&factor)[2]) {
  if (__any_sync(0xffffffffu, factor[0] != 1.f || factor[1] != 1.f)) {
#pragma unroll
    for (int j = 0; j < D_TILE / 16; ++j)
#pragma unroll
      for (int i = 0; i < 4; ++i) st.o[j][i] *= factor[i % 2];
  }
}

// The online softmax over one block's scores s (raw q.k of KT m-tiles of keys): scale (column c
// of the lane by col_scale[c]) and cap to base-2 logits, mask, update the running max and
// sum. s becomes P; corrections[c] is what the old P's of column c were multiplied by.
// EXACT_SOFTCAP: the accurate tanh for softcap (kExactSoftcap; attention_common.cuh).
template <int KT, int D_TILE, bool EXACT_SOFTCAP>
__device__ __forceinline__ void softmax_block(const DecodeParams& p, float (&s)[KT][4], int key0,
                                              const ColumnKeys& keys, const Lane& ln, WarpState<D_TILE>& st,
                                              const float (&col_scale)[2], float (&corrections)[2]) {
  // Scale and cap to base-2 logits (a warp-uniform branch keeps tanh off the common path).
  if (p.softcap > 0.f) {
#pragma unroll
    for (int i = 0; i < 4 * KT; ++i)
      s[i / 4][i % 4] = apply_softcap<EXACT_SOFTCAP>(s[i / 4][i % 4] * col_scale[i % 2], p.softcap) * kLog2e;
  } else {
    const float scale_log2[2] = {col_scale[0] * kLog2e, col_scale[1] * kLog2e};
#pragma unroll
    for (int i = 0; i < 4 * KT; ++i) s[i / 4][i % 4] *= scale_log2[i % 2];
  }

  // Mask only blocks that cross some column's window edge or live end (warp-uniform test).
  if (key0 < keys.full_lo || key0 + KT * kTileKeys > keys.full_hi) {
#pragma unroll
    for (int i = 0; i < 4 * KT; ++i) {
      const int c = i % 2, key = key0 + kTileKeys * (i / 4) + ln.g + 8 * (i % 4 / 2);
      if (!(key >= keys.lo[c] && key < keys.hi[c])) s[i / 4][i % 4] = neg_inf();
    }
  }

#pragma unroll
  for (int c = 0; c < 2; ++c) {
    // Maxima and sums start from the first tile's pair rather than -inf / 0, which cost an
    // instruction each (the same values: scores are never NaN, P is never -0).
    float top = fmaxf(s[0][c], s[0][c + 2]);
#pragma unroll
    for (int kt = 1; kt < KT; ++kt) top = fmaxf(top, fmaxf(s[kt][c], s[kt][c + 2]));
    const float m_new = fmaxf(st.m[c], column_max(top));
    const float correction = exp2_minus(st.m[c], m_new);
    float sum = 0.f;
#pragma unroll
    for (int kt = 0; kt < KT; ++kt) {
      s[kt][c] = exp2_minus(s[kt][c], m_new);
      s[kt][c + 2] = exp2_minus(s[kt][c + 2], m_new);
      sum = kt == 0 ? s[kt][c] + s[kt][c + 2] : sum + (s[kt][c] + s[kt][c + 2]);
    }
    st.l[c] = st.l[c] * correction + sum;
    st.m[c] = m_new;
    corrections[c] = correction;
  }
}

template <class T, int D_TILE>
__device__ __forceinline__ void attend_block(const DecodeParams& p, const FragB<T> (&q)[D_TILE / 16], const T* k_block,
                                             const T* v_block, int key0, const ColumnKeys& keys, const Lane& ln,
                                             WarpState<D_TILE>& st) {
  // S^T = K Q^T over d in steps of 16, in two accumulator chains (even / odd steps) to halve
  // the dependent mma latency, added at the end.
  float s[1][4] = {}, s_odd[4] = {};
#pragma unroll
  for (int ks = 0; ks < D_TILE / 16; ++ks)
    mma<T>(ks % 2 ? s_odd : s[0], load_a_keys<T, D_TILE>(k_block, ks, ln), q[ks]);
#pragma unroll
  for (int i = 0; i < 4; ++i) s[0][i] += s_odd[i];

  const float col_scale[2] = {p.scale, p.scale};
  float corrections[2];
  softmax_block<1, D_TILE, kExactSoftcap<T>>(p, s, key0, keys, ln, st, col_scale, corrections);
  rescale_o(st, corrections);

  const FragB<T> pb = probs_as_b<T>(s[0]);
#pragma unroll
  for (int j = 0; j < D_TILE / 16; ++j) mma<T>(st.o[j], load_a_values<T, D_TILE>(v_block, j, ln), pb);
}

// s[i] (key g + 8 (i / 2) of an m-tile) times the scale of that key in `scales` (the tile's).
__device__ __forceinline__ void scale_by_key(float (&s)[4], const float* scales, const Lane& ln) {
  const float lo = scales[ln.g], hi = scales[ln.g + 8];
  s[0] *= lo, s[1] *= lo, s[2] *= hi, s[3] *= hi;
}

// 1 / x within an ulp (rcp.approx, subnormals kept): attend_block_fp8's unit r takes one every
// block on the way to the P V mma, where a division's correctly rounded sequence cost ~13
// instructions a column. O / r's error stays ~2^-23 an update of r.
__device__ __forceinline__ float approx_rcp(float x) {
  float y;
  asm("rcp.approx.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// attend_block for an fp8 stage (K bytes, V bytes, scales; two m-tiles of keys) against the
// f16 queries that q_tile_for_fp8 made; col_scale: the softmax scale over each lane column's
// query factor.
template <class KV, int D_TILE>
__device__ __forceinline__ void attend_block_fp8(const DecodeParams& p, const FragB<__half> (&q)[D_TILE / 16],
                                                 const unsigned char* stage, int key0, const ColumnKeys& keys,
                                                 const Lane& ln, WarpState<D_TILE>& st,
                                                 const float (&col_scale)[2]) {
  using S = Stage<KV, D_TILE>;
  constexpr int kTiles = kBlockKeys<KV> / kTileKeys;
  constexpr int kTileBytes = kTileKeys * D_TILE;  // one m-tile of K or V bytes
  const float* scales = reinterpret_cast<const float*>(stage + 2 * S::kBlockBytes);  // K's, then V's
  float s[kTiles][4] = {}, s_odd[kTiles][4] = {};
#pragma unroll
  for (int c = 0; c < D_TILE / 16; c += 2) {
#pragma unroll
    for (int kt = 0; kt < kTiles; ++kt) {
      FragA<__half> a[2];
      load_a_keys_fp8<KV, D_TILE>(stage + kt * kTileBytes, c, ln, a);
      mma<__half>(s[kt], a[0], q[c]);
      mma<__half>(s_odd[kt], a[1], q[c + 1]);
    }
  }
#pragma unroll
  for (int kt = 0; kt < kTiles; ++kt) {
#pragma unroll
    for (int i = 0; i < 4; ++i) s[kt][i] += s_odd[kt][i];
    if (p.k_scales != nullptr) scale_by_key(s[kt], scales + kt * kTileKeys, ln);
  }

  float corrections[2];
  softmax_block<kTiles, D_TILE, /*EXACT_SOFTCAP=*/false>(p, s, key0, keys, ln, st, col_scale, corrections);
  if (p.v_scales == nullptr) {
    rescale_o(st, corrections);
  } else {
    // P times the keys' V scales (after the sum: l counts P itself), over the running column
    // maximum r of those products' magnitudes: O is kept in units of r, and the f16 operand in
    // [-1, 1] (a scale may be negative: its keys' values then count with their sign flipped).
    float factor[2], inv[2];
#pragma unroll
    for (int kt = 0; kt < kTiles; ++kt) scale_by_key(s[kt], scales + kBlockKeys<KV> + kt * kTileKeys, ln);
#pragma unroll
    for (int c = 0; c < 2; ++c) {
      float top = fmaxf(fabsf(s[0][c]), fabsf(s[0][c + 2]));
#pragma unroll
      for (int kt = 1; kt < kTiles; ++kt) top = fmaxf(top, fmaxf(fabsf(s[kt][c]), fabsf(s[kt][c + 2])));
      top = column_max(top);
      const float r_old = st.r[c] * corrections[c];  // o's unit after this block's new max
      const float r_new = fmaxf(r_old, top);
      inv[c] = r_new > 0.f ? approx_rcp(r_new) : 0.f;
      factor[c] = r_new == r_old ? 1.f : r_old * inv[c];
      st.r[c] = r_new;
    }
    rescale_o(st, factor);
#pragma unroll
    for (int kt = 0; kt < kTiles; ++kt)
#pragma unroll
      for (int i = 0; i < 4; ++i) s[kt][i] *= inv[i % 2];
  }

#pragma unroll
  for (int kt = 0; kt < kTiles; ++kt) {
    const FragB<__half> pb = probs_as_b<__half>(s[kt]);
#pragma unroll
    for (int c = 0; c < D_TILE / 16; c += 2) {
      FragA<__half> a[2];
      load_a_values_fp8<KV, D_TILE>(stage + S::kBlockBytes + kt * kTileBytes, c, ln, a);
      mma<__half>(st.o[c], a[0], pb);
      mma<__half>(st.o[c + 1], a[1], pb);
    }
  }
}

// ---- the split kernel -----------------------------------------------------------------------
// Barrier before and after each block: a group of one warp needs only __syncwarp; larger
// groups use __syncthreads, so every warp of the CTA runs the same number of iterations
// (a named barrier per group let groups with different block counts pass different numbers
// of barriers, which compute-sanitizer's racecheck reported as hazards with the merge).
__device__ __forceinline__ void group_sync(int warps) {
  if (warps == 1) {
    __syncwarp();
  } else {
    __syncthreads();
  }
}

// Wait until at most `pending` (0..7) of this thread's cp.async groups are in flight.
__device__ __forceinline__ void cp_async_wait_pending(int pending) {
  if (pending >= 7) cp_async_wait<7>();
  else if (pending == 6) cp_async_wait<6>();
  else if (pending == 5) cp_async_wait<5>();
  else if (pending == 4) cp_async_wait<4>();
  else if (pending == 3) cp_async_wait<3>();
  else if (pending == 2) cp_async_wait<2>();
  else if (pending == 1) cp_async_wait<1>();
  else cp_async_wait<0>();
}

// Four consecutive elements of an output row, times `scale`, rounded to T: one 16- or 8-byte
// store when dst is aligned for it (a caller's out may have odd row strides), else four.
template <class T>
__device__ __forceinline__ void store4(T* dst, float4 v, float scale) {
  v.x *= scale, v.y *= scale, v.z *= scale, v.w *= scale;
  const unsigned long long address = reinterpret_cast<unsigned long long>(dst);
  if constexpr (sizeof(T) == 4) {
    if (address % 16 == 0) {
      *reinterpret_cast<float4*>(dst) = v;
      return;
    }
  } else {
    if (address % 8 == 0) {
      *reinterpret_cast<uint2*>(dst) = make_uint2(pack2<T>(v.x, v.y), pack2<T>(v.z, v.w));
      return;
    }
  }
  dst[0] = from_float<T>(v.x), dst[1] = from_float<T>(v.y), dst[2] = from_float<T>(v.z), dst[3] = from_float<T>(v.w);
}

// Row gr's result over this split, written by one warp: lane l stores elements 4 l .. 4 l + 3
// (then + 128 ...) from o4(d), the float4 of elements d .. d + 3 of o normalised by the
// split's own sum (Dv is a multiple of 4). With one split this is the final output, scaled by
// sink_scale as merge.cu's combine scales it (whose lse and weight for one state are exactly
// this lse and 1: same values); else it is the split's partial.
template <class T, class RowValues>
__device__ __forceinline__ void store_row(const DecodeParams& p, int b, int kvh, int gr, int split, float lse,
                                          int lane, const RowValues& o4) {
  const int head = kvh * (p.hq / p.hkv) + gr / p.sq, t = gr % p.sq;
  if (p.o_out != nullptr) {
    const float out_scale = sink_scale(lse, p.sinks, head);
    T* row = static_cast<T*>(p.o_out) + b * p.o_out_stride_b + head * p.o_out_stride_h + t * p.o_out_stride_s;
    for (int d = 4 * lane; d < p.dv; d += 128) store4<T>(row + d, o4(d), out_scale);
    if (lane == 0 && p.lse_out != nullptr)
      p.lse_out[b * p.lse_out_stride_b + head * p.lse_out_stride_h + t * p.lse_out_stride_s] = lse;
    return;
  }
  const long long part = ((static_cast<long long>(b) * p.hq + head) * p.sq + t) * p.num_splits + split;
  for (int d = 4 * lane; d < p.dv; d += 128) *reinterpret_cast<float4*>(p.o_part + part * p.dv + d) = o4(d);
  if (lane == 0) p.lse_part[part] = lse;
}

// Floats between two rows of a warp's o in the end-of-CTA merge: the padding spreads the
// stores of columns 2t (rows 0, 2, 4, 6) over all 32 banks.
template <int D_TILE>
constexpr int kPartStride = D_TILE + 4;

template <class T, class KV, int D_TILE>
__device__ __forceinline__ void decode_split(const DecodeParams& p) {
  using S = Stage<KV, D_TILE>;
  using QT = typename QueryType<T, KV>::type;  // the queries as the mma reads them
  extern __shared__ __align__(128) unsigned char smem[];

  // Split slowest: a grid of more than one wave (many rows, or the benchmarks' override)
  // starts every row's first splits before any row's later ones.
  const int split = blockIdx.z;
  const int row_blocks = gridDim.x / p.hkv;
  const int kvh = blockIdx.x / row_blocks;
  const int b = blockIdx.y;
  const int warp = threadIdx.x / 32;
  const Lane ln = make_lane(threadIdx.x % 32);
  const int warps_m = p.warps_m, groups = kWarps / warps_m;
  const int wm = warp % warps_m, wk = warp / warps_m;  // row tile, key group
  const int cta_rows = kWarpRows * warps_m;
  const int row0 = (blockIdx.x % row_blocks) * cta_rows;  // first group row of this CTA
  const int group_rows = (p.hq / p.hkv) * p.sq;

  // Live length; a bad one is reported (once per batch row) and the row reads no key.
  int len = p.seq_lens[b];
  const bool reporter = split == 0 && blockIdx.x == 0 && threadIdx.x == 0;
  if (len < 0 || len > p.capacity) {
    if (reporter) raise_fault(p.fault, len < 0 ? FAULT_NEGATIVE_LENGTH : FAULT_PAST_CAPACITY, b, len);
    len = 0;
  }
  const KeyWindow window = {len - p.sq, p.window_left, 0};
  const int split_begin = split * p.keys_per_split;
  const int key_end = min(split_begin + p.keys_per_split, len);
  // Blocks stay aligned to the split start; skip whole blocks left of every row's window.
  const long long first_key = max(first_visible_key(window, 0), (long long)split_begin);
  constexpr int kKeys = kBlockKeys<KV>;
  const int begin = split_begin + int((first_key - split_begin) / kKeys) * kKeys;
  if (key_end <= begin) {  // no live key: the neutral partial, at once
    for (int rr = warp; rr < cta_rows && row0 + rr < group_rows; rr += kWarps)
      store_row<T>(p, b, kvh, row0 + rr, split, neg_inf(), ln.lane, [](int) { return make_float4(0.f, 0.f, 0.f, 0.f); });
    return;
  }

  // This group's blocks: begin + (wk + n * groups) * kKeys for n < num_blocks. Group 0 has
  // the most; with CTA-wide barriers every warp iterates that many times.
  const int group_begin = begin + wk * kKeys, group_step = groups * kKeys;
  const int num_blocks = group_begin < key_end ? (key_end - group_begin + group_step - 1) / group_step : 0;
  const int iterations = warps_m == 1 ? num_blocks : (key_end - begin + group_step - 1) / group_step;

  T* q_tile = reinterpret_cast<T*>(smem);
  // fp8: each query row's largest magnitude (q_tile_for_fp8) between the tile and the rings.
  float* row_amax = reinterpret_cast<float*>(smem + cta_rows * D_TILE * int(sizeof(T)));
  unsigned char* rings = reinterpret_cast<unsigned char*>(row_amax + (kIsFp8<KV> ? cta_rows : 0));
  unsigned char* ring = rings + wk * p.stages * S::kBytes;

  // Per-lane columns 2t and 2t + 1: their visible keys [lo, hi), hi capped at this split's
  // end. Columns past the group never force a mask (their zero queries give finite scores).
  ColumnKeys keys;
#pragma unroll
  for (int c = 0; c < 2; ++c) {
    const int gr = row0 + wm * kWarpRows + 2 * ln.t + c;
    if (gr < group_rows) {
      const int t = gr % p.sq;
      keys.lo[c] = int(max(first_visible_key(window, t), 0LL));
      keys.hi[c] = int(min(last_visible_key(window, t) + 1, (long long)key_end));
    } else {
      keys.lo[c] = 0, keys.hi[c] = key_end;
    }
  }
  keys.full_lo = __reduce_max_sync(0xffffffffu, max(keys.lo[0], keys.lo[1]));
  keys.full_hi = __reduce_min_sync(0xffffffffu, min(keys.hi[0], keys.hi[1]));

  WarpState<D_TILE> st;
#pragma unroll
  for (int j = 0; j < D_TILE / 16; ++j) st.o[j][0] = st.o[j][1] = st.o[j][2] = st.o[j][3] = 0.f;
  st.m[0] = st.m[1] = neg_inf();
  st.l[0] = st.l[1] = 0.f;
  st.r[0] = st.r[1] = 0.f;

  // Queries and padding first, then the first stages - 1 blocks of each group (block n is
  // copied by warp n % warps_m of the group, so every thread commits one group per block).
  load_q<T, D_TILE>(p, b, kvh, row0, cta_rows, q_tile);
  cp_async_commit();
  if (p.dqk < D_TILE || p.dv < D_TILE) zero_padding<KV, D_TILE>(p, rings, groups * p.stages);
  const BlockLoader<KV, D_TILE> loader(p, b, kvh, ln.lane);
  // This warp copies blocks wm, wm + warps_m, ... of its group, in that order; page_id is the
  // page_of of the next one.
  auto block_key = [&](int n) { return group_begin + n * group_step; };
  int page_id = loader.page_of(p, block_key(wm), key_end);
  auto copy_block = [&](int n, unsigned char* stage) {
    loader.load(p, b, block_key(n), key_end, stage, page_id);
    page_id = loader.page_of(p, block_key(n + warps_m), key_end);
  };
  for (int n = 0; n < p.stages - 1; ++n) {
    if (n < num_blocks && (n & (warps_m - 1)) == wm) copy_block(n, ring + n * S::kBytes);
    cp_async_commit();
  }
  cp_async_wait_pending(p.stages - 1);  // the queries have landed (the blocks need not have)
  __syncthreads();
  // fp8: the softmax scale over each of this lane's columns' query factor (unused otherwise).
  float col_scale[2] = {p.scale, p.scale};
  if constexpr (kIsFp8<KV>) {
    q_tile_for_fp8<T, D_TILE>(q_tile, row_amax, cta_rows);
    __syncthreads();
#pragma unroll
    for (int c = 0; c < 2; ++c) col_scale[c] = p.scale * f16_row_factor(row_amax[wm * kWarpRows + 2 * ln.t + c], true);
  }
  FragB<QT> q[D_TILE / 16];
  load_b_queries<QT, D_TILE>(reinterpret_cast<const QT*>(q_tile), wm * kWarpRows, ln, q);

  int read_stage = 0, write_stage = p.stages - 1;
  for (int n = 0; n < iterations; ++n) {
    group_sync(warps_m);  // every warp of the group is done with the stage written next
    const int next = n + p.stages - 1;
    if (next < num_blocks && (next & (warps_m - 1)) == wm) copy_block(next, ring + write_stage * S::kBytes);
    cp_async_commit();
    cp_async_wait_pending(p.stages - 1);
    group_sync(warps_m);  // block n has landed for every thread of the group
    const unsigned char* stage = ring + read_stage * S::kBytes;
    if (n < num_blocks) {
      const int key0 = block_key(n);
      if constexpr (kIsFp8<KV>) {
        attend_block_fp8<KV, D_TILE>(p, q, stage, key0, keys, ln, st, col_scale);
      } else {
        const T* k_block = reinterpret_cast<const T*>(stage);
        attend_block<T, D_TILE>(p, q, k_block, k_block + Config<T, D_TILE>::kBlockElems, key0, keys, ln, st);
      }
    }
    read_stage = read_stage + 1 == p.stages ? 0 : read_stage + 1;
    write_stage = write_stage + 1 == p.stages ? 0 : write_stage + 1;
  }
  cp_async_wait<0>();
  // This CTA's keys are read: the combine (launched programmatically after this kernel) may
  // take its place on the SM; it waits for the whole grid before reading any partial.
  // Triggering here rather than at the start keeps its CTAs out of a many-wave grid's way.
  allow_dependent_launch();

  // Each lane holds part of its columns' sums: total them over the 8 lanes of the column.
#pragma unroll
  for (int c = 0; c < 2; ++c) {
    st.l[c] += __shfl_xor_sync(0xffffffffu, st.l[c], 4);
    st.l[c] += __shfl_xor_sync(0xffffffffu, st.l[c], 8);
    st.l[c] += __shfl_xor_sync(0xffffffffu, st.l[c], 16);
  }

  // Merge the groups' warps of each row tile in shared memory, in warp order: one warp a row.
  __syncthreads();  // every warp is done with the rings
  constexpr int kStride = kPartStride<D_TILE>;
  float* stat_m = reinterpret_cast<float*>(smem);
  float* stat_l = stat_m + kWarps * kWarpRows;
  float* part_o = stat_l + kWarps * kWarpRows;  // [warp][kWarpRows rows][kStride]
  {
    float* my_o = part_o + warp * kWarpRows * kStride;
    // With per-token V scales an fp8 o is in units of r (attend_block_fp8).
    const bool in_units = kIsFp8<KV> && p.v_scales != nullptr;
    const float unit[2] = {in_units ? st.r[0] : 1.f, in_units ? st.r[1] : 1.f};
#pragma unroll
    for (int j = 0; j < D_TILE / 16; ++j) {
      if (j * 16 < p.dv) {
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          // m-tile j's rows g, g + 8: d 16j + g, + 8 (16-bit V) or 16j + 2g, + 1 (fp8 V:
          // even and odd columns, load_a_values_fp8).
          const int d = 16 * j + (kIsFp8<KV> ? 2 * ln.g + i / 2 : ln.g + 8 * (i / 2));
          my_o[(2 * ln.t + i % 2) * kStride + d] = st.o[j][i] * unit[i % 2];
        }
      }
    }
    if (ln.g == 0) {
#pragma unroll
      for (int c = 0; c < 2; ++c) {
        stat_m[warp * kWarpRows + 2 * ln.t + c] = st.m[c];
        stat_l[warp * kWarpRows + 2 * ln.t + c] = st.l[c];
      }
    }
  }
  __syncthreads();

  for (int rr = warp; rr < cta_rows && row0 + rr < group_rows; rr += kWarps) {
    // Row rr lives in row tile rr / kWarpRows, held by warps tile + j * warps_m (j < groups).
    const int tile = rr / kWarpRows, r = rr % kWarpRows;
    float m_all = neg_inf();
#pragma unroll
    for (int j = 0; j < kWarps; ++j)
      if (j < groups) m_all = fmaxf(m_all, stat_m[(tile + j * warps_m) * kWarpRows + r]);
    float weight[kWarps];
    float l_all = 0.f;
#pragma unroll
    for (int j = 0; j < kWarps; ++j) {
      const int w = tile + j * warps_m;
      weight[j] = j < groups ? safe_exp2(stat_m[w * kWarpRows + r], m_all) : 0.f;
      if (j < groups) l_all += weight[j] * stat_l[w * kWarpRows + r];
    }
    const float lse = l_all > 0.f ? (m_all + log2f(l_all)) * kLn2 : neg_inf();
    store_row<T>(p, b, kvh, row0 + rr, split, lse, ln.lane, [&](int d) {
      float4 o = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
      for (int j = 0; j < kWarps; ++j) {
        if (j < groups) {
          const float4 x =
              *reinterpret_cast<const float4*>(part_o + ((tile + j * warps_m) * kWarpRows + r) * kStride + d);
          o.x += weight[j] * x.x, o.y += weight[j] * x.y, o.z += weight[j] * x.z, o.w += weight[j] * x.w;
        }
      }
      if (l_all > 0.f) {
        const float v = kIsFp8<KV> ? p.v_scale : 1.f;  // an fp8 cache's per-tensor V scale
        return make_float4(o.x * v / l_all, o.y * v / l_all, o.z * v / l_all, o.w * v / l_all);
      }
      return make_float4(0.f, 0.f, 0.f, 0.f);
    });
  }
}

}  // namespace decode
}  // namespace ptxattn

#define PTXATTN_DECODE_VARIANT(NAME, T, KV, D)                                       \
  extern "C" __global__ void __launch_bounds__(ptxattn::decode::kThreads)            \
      NAME(const ptxattn::decode::DecodeParams p) {                                  \
    ptxattn::decode::decode_split<T, KV, D>(p);                                      \
  }

// One line a variant of the decode table of cu/variants.json, made by scripts/build_ptx.py.
#include "variants.inc"
