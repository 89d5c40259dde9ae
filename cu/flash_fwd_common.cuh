// What every sdpa forward kernel shares (flash_fwd.cu: mma.sync for sm_80+, and
// flash_fwd_sm90.cu: wgmma for sm_90a): the parameter struct, which sequence and query rows
// a block serves (a dense batch row, or a tile of a serving batch), the key range it visits,
// paged key/value rows, fp8 K/V tiles, and the finished row (normalisation, sinks, LSE).
#pragma once
#include "attention_common.cuh"
#include "fp8.cuh"
#include "mma.cuh"

namespace ptxattn {

// A CUtensorMap (cuTensorMapEncodeTiled's opaque 128 bytes, 64-byte aligned), written by the
// host (runtime/tensor_map.py) and read by TMA copies from the kernel's parameter space.
struct alignas(64) TensorMap {
  unsigned long long opaque[16];
};

// n / d for 0 <= n < 2^31 by a multiply and a shift, d > 0 given as mul = ceil(2^shift / d),
// shift = 31 + ceil(log2 d) (runtime/ops/attention.py, fast_divisor: the rounding up adds less
// than n / 2^shift < 1 / d to n / d, never enough to reach the next integer).
__device__ __forceinline__ int fast_div(int n, unsigned mul, int shift) {
  return static_cast<int>((static_cast<unsigned long long>(static_cast<unsigned>(n)) * mul) >> shift);
}

// A persistent twin's blocks the host deals out itself (FlashFwdParams.tail_blocks): up to
// TAIL_SLOTS for each of up to TAIL_CTAS CTAs (one an SM: every sm_90 part has at most 132),
// TAIL_NONE ending a CTA's list. Mirrored by runtime/ops/persistent_deal.py.
constexpr int TAIL_CTAS = 132;
constexpr int TAIL_SLOTS = 4;
constexpr unsigned TAIL_NONE = 0xffff;

// Mirrored by runtime/ops/attention.py (_FlashFwdParams): same fields, same order.
struct FlashFwdParams {
  const void* q;
  const void* k;
  const void* v;
  void* o;
  float* lse;          // [B, Hq, Sq] through the lse strides, or null
  const void* mask;    // read through the four mask strides (0 = broadcast), or null
  const float* sinks;  // [Hq], or null
  // Serving batches (ops/ragged.py); all null for a dense call. Packed q / o / lse index
  // their token axis by cu_seqlens_q[b] + row (their batch strides are 0).
  const int* cu_seqlens_q;  // [B + 1] query offsets
  const int* cu_seqlens_k;  // [B + 1] key offsets into packed k / v (ragged), or null
  const int* seq_lens_k;    // [B] live keys of each sequence (paged), or null
  const int* block_table;   // [B, max_pages] page ids (paged; k / v batch strides step pages)
  int* fault;
  // fp8 K / V (the _fp8 kernels): per-(token, kv head) scales addressed like k / v less their
  // last axis, or null for the per-tensor k_scale / v_scale.
  const float* k_scales;
  const float* v_scales;
  long long q_batch_stride, q_head_stride, q_seq_stride;
  long long k_batch_stride, k_head_stride, k_seq_stride;
  long long v_batch_stride, v_head_stride, v_seq_stride;
  long long o_batch_stride, o_head_stride, o_seq_stride;
  long long mask_batch_stride, mask_head_stride, mask_query_stride, mask_key_stride;
  long long lse_batch_stride, lse_head_stride, lse_seq_stride;
  long long block_table_stride;
  long long k_scale_batch_stride, k_scale_head_stride, k_scale_seq_stride;
  long long v_scale_batch_stride, v_scale_head_stride, v_scale_seq_stride;
  int heads_q, heads_kv, seq_q, seq_kv, dim_qk, dim_v;
  int mask_kind;  // MaskKind
  int diag_offset, window_left, window_right;
  float scale, softcap;
  int vector_io;    // host checked: q/k/v/o bases 16-byte aligned, batch/head/seq strides x8
  int heavy_first;  // query blocks last-first (causal: late blocks see more keys); dense grids are
                    // then laid out in runs of (batch, head) pairs (dense_tile)
  // Serving batches: grid x enumerates the query tiles of every sequence in order.
  int num_seqs;         // B
  int tokens_q, tokens_k;  // rows of packed q and of packed k / v: offsets past them fault
  int kv_capacity;      // paged: max_pages * page_size
  int num_pages, page_size_log2;
  int min_queries;      // sequences with fewer new queries get no tile (decode serves them)
  int kv_fp8;           // Fp8Kind of k and v (read by the _fp8 kernels only)
  float k_scale, v_scale;  // fp8 per-tensor scales, where k_scales / v_scales are null
  // tma 1 (dense sm_90a warp-specialized calls the host vouched for): the producer loads q, k
  // and v tiles by TMA through these maps over (dim, token, head, batch), each box one
  // 64-column panel of a tile's rows, 128-byte swizzle; 0: by cp.async, the maps unused.
  int tma;
  // The persistent twins (flash_fwd_sm90_ws.cuh, launched with fewer CTAs than blocks): the grid
  // the non-persistent kernel would run, whose blocks the CTAs share out (dense_tile's layout).
  int virtual_grid_x, virtual_grid_y, virtual_grid_z;
  // ... and the divisors virtual_tile takes its blocks apart by: virtual_grid_x, virtual_grid_y
  // and heads_q as fast_div's (mul, shift) pairs (set with virtual_grid; unused elsewhere).
  unsigned virtual_div_x_mul, virtual_div_y_mul, heads_q_div_mul;
  int virtual_div_x_shift, virtual_div_y_shift, heads_q_div_shift;
  // The staged-mask twins of the general ws kernels (launched with tma 1) also load each key
  // tile's mask tile through mask_map, over (key, query, head, batch), each box one 128-byte
  // panel of the tile's rows (flash_fwd_sm90_ws.cuh); unused by every other kernel.
  TensorMap q_map, k_map, v_map, mask_map;
  // The persistent twins store each warpgroup's 64 rows of O through o_map (over (dim, token,
  // head, batch), each box one 64-column panel of 64 rows, 128-byte swizzle); unused elsewhere.
  TensorMap o_map;
  // The persistent twins' last blocks as the host dealt them (runtime/ops/persistent_deal.py;
  // last in the struct, so no field before them moves): from the CTA's tail_round-th block on
  // (0: none, the snake deals every block), its k-th is block tail_round * gridDim.x +
  // tail_blocks[CTA * TAIL_SLOTS + k]; unused elsewhere.
  int tail_round;
  unsigned short tail_blocks[TAIL_CTAS * TAIL_SLOTS];
};

// The rows one block serves: query rows [m0, m0 + BR) of sequence b, whose queries start at
// token q_tok0 of q / o / lse and whose keys at token k_tok0 of k / v (packed layouts; 0 for
// dense ones), with seq_q queries and seq_kv keys.
struct SeqTile {
  int b, m0, seq_q, seq_kv;
  long long q_tok0, k_tok0;
  int diag_offset;
  int h;  // last: the fields before it keep their offsets (a new first field made ptxas serialize
          // d192 / 128 ws_pp's wgmmas, C7511)
};

// A serving batch's sequence b, checked: its query and key ranges and how many tiles of BR
// rows it gets. Bad offsets or lengths give no tile (the checker reports them).
struct Sequence {
  int tiles, q0, seq_q, k0, seq_kv;
};
template <int BR>
__device__ __forceinline__ Sequence sequence_at(const FlashFwdParams& p, int b, bool report) {
  const int q0 = p.cu_seqlens_q[b], q1 = p.cu_seqlens_q[b + 1];
  bool ok = q0 >= 0 && q1 >= q0 && q1 <= p.tokens_q;
  int k0 = 0, k1, code = FAULT_BAD_OFFSETS, value = q1;
  if (p.cu_seqlens_k != nullptr) {
    k0 = p.cu_seqlens_k[b], k1 = p.cu_seqlens_k[b + 1];
    if (ok && !(k0 >= 0 && k1 >= k0 && k1 <= p.tokens_k)) ok = false, value = k1;
  } else {
    k1 = p.seq_lens_k[b];
    if (ok && !(k1 >= 0 && k1 <= p.kv_capacity))
      ok = false, code = k1 < 0 ? FAULT_NEGATIVE_LENGTH : FAULT_PAST_CAPACITY, value = k1;
  }
  if (!ok) {
    if (report) raise_fault(p.fault, code, b, value);
    return {0, 0, 0, 0, 0};
  }
  const int n = q1 - q0;
  return {n >= p.min_queries && n > 0 ? (n + BR - 1) / BR : 0, q0, n, k0, k1 - k0};
}

// The rows of a dense grid's block: grid (query blocks, Hq, B), or with heavy_first (heads of
// a run, query blocks, runs) over the B x Hq (batch, head) pairs. Blocks start in launch order
// (x, then y, then z), so the latter's go heaviest first across a run's pairs: light blocks are
// left to fill the SMs at the run's end, and the run's K / V, sized by the host to the L2, is
// what the running blocks share.
template <int BR>
__device__ __forceinline__ void dense_tile(const FlashFwdParams& p, SeqTile& t) {
  t.seq_q = p.seq_q, t.seq_kv = p.seq_kv, t.q_tok0 = 0, t.k_tok0 = 0, t.diag_offset = p.diag_offset;
  if (!p.heavy_first) {
    t.b = blockIdx.z, t.h = blockIdx.y, t.m0 = blockIdx.x * BR;
    return;
  }
  const int head = blockIdx.z * gridDim.x + blockIdx.x;
  t.b = head / p.heads_q, t.h = head - t.b * p.heads_q, t.m0 = (gridDim.y - 1 - blockIdx.y) * BR;
}
// dense_tile's rows for a persistent twin's virtual block `block` (p.virtual_grid's blocks in
// launch order) in place of blockIdx / gridDim. Apart from dense_tile, whose every kernel's
// PTX moved (ctaid reads hoisted) when it called a shared body.
// Its divisions are fast_div's: a twin's consumer finds its next block's rows between two
// of its blocks, where four integer divisions (~25 instructions each) stood.
template <int BR>
__device__ __forceinline__ void virtual_tile(const FlashFwdParams& p, SeqTile& t, int block) {
  const int gx = p.virtual_grid_x, gy = p.virtual_grid_y;
  const int yz = fast_div(block, p.virtual_div_x_mul, p.virtual_div_x_shift);
  const int z = fast_div(yz, p.virtual_div_y_mul, p.virtual_div_y_shift);
  const int x = block - yz * gx, y = yz - z * gy;
  t.seq_q = p.seq_q, t.seq_kv = p.seq_kv, t.q_tok0 = 0, t.k_tok0 = 0, t.diag_offset = p.diag_offset;
  if (!p.heavy_first) {
    t.b = z, t.h = y, t.m0 = x * BR;
    return;
  }
  const int head = z * gx + x;
  t.b = fast_div(head, p.heads_q_div_mul, p.heads_q_div_shift);
  t.h = head - t.b * p.heads_q, t.m0 = (gy - 1 - y) * BR;
}

// Which rows this block serves, as warp 0 finds them; false when none (a spare block of a
// serving grid). Dense: dense_tile. Serving: grid (tile budget, Hq, 1); block x
// is the x-th tile counting sequence by sequence (each sequence's heaviest tile first when
// heavy_first), found by a warp-wide scan of the offsets 32 sequences at a time. Warp 0 of
// block (0, 0) scans every sequence and reports bad ones to the fault buffer.
template <int BR>
__device__ __forceinline__ bool find_tile(const FlashFwdParams& p, SeqTile& t) {
  if (p.cu_seqlens_q == nullptr) {
    dense_tile<BR>(p, t);
    return true;
  }
  const int lane = threadIdx.x & 31;
  const bool checker = blockIdx.x == 0 && blockIdx.y == 0 && threadIdx.x < 32;
  const int want = blockIdx.x;
  bool found = false;
  for (int b0 = 0, before = 0; b0 < p.num_seqs; b0 += 32) {
    const Sequence mine = b0 + lane < p.num_seqs ? sequence_at<BR>(p, b0 + lane, checker) : Sequence{0, 0, 0, 0, 0};
    int upto = mine.tiles;  // inclusive prefix sum over the lanes
#pragma unroll
    for (int off = 1; off < 32; off <<= 1) {
      const int x = __shfl_up_sync(0xffffffffu, upto, off);
      if (lane >= off) upto += x;
    }
    const int total = __shfl_sync(0xffffffffu, upto, 31);
    if (!found && want < before + total) {  // the lane whose sequence holds tile `want`
      const int src = __ffs(__ballot_sync(0xffffffffu, want < before + upto)) - 1;
      const int tiles = __shfl_sync(0xffffffffu, mine.tiles, src);
      const int tile = want - (before + __shfl_sync(0xffffffffu, upto, src) - tiles);
      t.b = b0 + src, t.h = blockIdx.y;
      t.m0 = (p.heavy_first ? tiles - 1 - tile : tile) * BR;
      t.q_tok0 = __shfl_sync(0xffffffffu, mine.q0, src);
      t.seq_q = __shfl_sync(0xffffffffu, mine.seq_q, src);
      t.k_tok0 = __shfl_sync(0xffffffffu, mine.k0, src);
      t.seq_kv = __shfl_sync(0xffffffffu, mine.seq_kv, src);
      t.diag_offset = t.seq_kv - t.seq_q;  // serving batches align causal / window bottom-right
      found = true;
      if (!checker) break;
    }
    before += total;
  }
  return found;
}

template <class T>
__device__ __forceinline__ T fresh(const T& x) { return *static_cast<const volatile T*>(&x); }

// The block's SeqTile in shared memory, each field read afresh where it is used, so that none
// of it stays in registers through the key loop: the kernels run at their register caps, and
// holding these fields cost the plain d128 mma.sync kernel 164 bytes of spills.
struct TileRef {
  const SeqTile& t;
  __device__ __forceinline__ int b() const { return fresh(t.b); }
  __device__ __forceinline__ int h() const { return fresh(t.h); }
  __device__ __forceinline__ int m0() const { return fresh(t.m0); }
  __device__ __forceinline__ int seq_q() const { return fresh(t.seq_q); }
  __device__ __forceinline__ int seq_kv() const { return fresh(t.seq_kv); }
  __device__ __forceinline__ long long q_tok0() const { return fresh(t.q_tok0); }
  __device__ __forceinline__ long long k_tok0() const { return fresh(t.k_tok0); }
  __device__ __forceinline__ KeyWindow window(const FlashFwdParams& p) const {
    return KeyWindow{fresh(t.diag_offset), p.window_left, p.window_right};
  }
};

// Finds the block's rows (warp 0) and shares them with every thread through `shared`; false
// (for the whole block) when it has none.
template <int BR>
__device__ __forceinline__ bool resolve_tile(const FlashFwdParams& p, SeqTile& shared, int& found) {
  if (threadIdx.x < 32) {
    SeqTile t;
    const bool any = find_tile<BR>(p, t);
    if (threadIdx.x == 0) {
      shared = t;
      found = any;
    }
  }
  __syncthreads();
  return fresh(found) != 0;
}

// The page of key `key` of sequence b in a paged pool, and the key's token in it; false for a
// page id outside the pool (reported; the key's row then loads as zeros).
__device__ __forceinline__ bool page_of(const FlashFwdParams& p, int b, int key, int& page, int& tok) {
  page = p.block_table[b * p.block_table_stride + (key >> p.page_size_log2)];
  tok = key & ((1 << p.page_size_log2) - 1);
  if (page < 0 || page >= p.num_pages) {
    raise_fault(p.fault, FAULT_PAGE_OUT_OF_RANGE, b, page);
    return false;
  }
  return true;
}

// Key `key` of kv head hk of sequence b in a paged pool (k or v: base, page / token strides),
// or null for a page id outside the pool.
template <class T>
__device__ __forceinline__ const T* paged_row(const FlashFwdParams& p, const T* pool, long long page_stride,
                                              long long tok_stride, int b, int key) {
  int page, tok;
  return page_of(p, b, key, page, tok) ? pool + page * page_stride + tok * tok_stride : nullptr;
}

// ---- fp8 K / V (the _fp8 kernels) -------------------------------------------------------------
// An fp8 tile is read with plain loads, each value converted exactly to T (every e4m3 and e5m2
// value is an f16 and a bf16 value) and stored where the kernel's cp.async would have put a T
// tile, in its own shared layout, so the tensor-core code after it is the same for every K/V
// dtype. The keys' scales go to shared memory beside the tile and are applied in fp32: to the
// scores (K's) and to the probabilities before they are rounded for P V (V's). Rounding
// value * scale to T instead cost up to 0.17 in the LSE of bf16 calls (scores near 20).

// K's or V's fp8 rows at kv head hk: element and scale strides (batch or page, token).
struct Fp8Rows {
  const unsigned char* data;
  const float* scales;  // at hk, or null: `scale` for every key
  long long page_stride, tok_stride, scale_page_stride, scale_tok_stride;
  float scale;
};
template <bool V>
__device__ __forceinline__ Fp8Rows fp8_rows(const FlashFwdParams& p, int hk) {
  if constexpr (V) {
    return {static_cast<const unsigned char*>(p.v) + hk * p.v_head_stride,
            p.v_scales != nullptr ? p.v_scales + hk * p.v_scale_head_stride : nullptr,
            p.v_batch_stride, p.v_seq_stride, p.v_scale_batch_stride, p.v_scale_seq_stride, p.v_scale};
  } else {
    return {static_cast<const unsigned char*>(p.k) + hk * p.k_head_stride,
            p.k_scales != nullptr ? p.k_scales + hk * p.k_scale_head_stride : nullptr,
            p.k_batch_stride, p.k_seq_stride, p.k_scale_batch_stride, p.k_scale_seq_stride, p.k_scale};
  }
}

// Where key n0 + r of sequence b lies: (batch row, token k_tok0 + n0 + r) in a packed layout,
// (page, token in page) through the block table; false for a row from rows_valid on or one
// of a page outside the pool (reported), whose bytes and scale are not read.
__device__ __forceinline__ bool locate_fp8_row(const FlashFwdParams& p, int b, long long k_tok0, int n0, int r,
                                               int rows_valid, long long& page, long long& tok) {
  page = b, tok = k_tok0 + n0 + r;
  bool read = r < rows_valid;
  if (read && p.block_table != nullptr) {
    int id, in_page;
    read = page_of(p, b, n0 + r, id, in_page);
    page = id, tok = in_page;
  }
  return read;
}

// Eight fp8 values (x's bytes, lowest first) as T, exactly: one 16-byte chunk.
template <class T>
__device__ __forceinline__ uint4 fp8x8_as(uint2 x, int kind) {
  unsigned out[4];
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const unsigned h = fp8x2_to_f16x2((j < 2 ? x.x : x.y) >> (16 * (j & 1)), kind);
    if constexpr (!is_bf16<T>) {
      out[j] = h;
    } else {
      const float2 f = __half22float2(*reinterpret_cast<const __half2*>(&h));
      out[j] = pack2<T>(f.x, f.y);
    }
  }
  return make_uint4(out[0], out[1], out[2], out[3]);
}

// Keys [n0, n0 + ROWS) of sequence b, fp8 rows of D values (the host checked D and 8-byte
// aligned rows), as a T tile: chunk c (values 8c .. 8c + 7) of row r to the shared address
// dst(r, c), and row r's scale to key_scales[r] (locate_fp8_row: rows not read become zeros
// with scale 0).
template <class T, int ROWS, int D, int NT, class Dst>
__device__ __forceinline__ void load_fp8_tile(const FlashFwdParams& p, const Fp8Rows& g, int b, long long k_tok0,
                                              int n0, int rows_valid, const Dst& dst, float* key_scales) {
  constexpr int kChunksPerRow = D / 8;
  // Not unrolled: the kernels keep their registers for the key loop this runs inside.
#pragma unroll 1
  for (int i = threadIdx.x; i < ROWS * kChunksPerRow; i += NT) {
    const int r = i / kChunksPerRow, c = i % kChunksPerRow;
    uint4 out = make_uint4(0u, 0u, 0u, 0u);
    float scale = 0.f;
    long long page, tok;
    const bool read = locate_fp8_row(p, b, k_tok0, n0, r, rows_valid, page, tok);
    if (read) {
      const uint2 x = *reinterpret_cast<const uint2*>(g.data + page * g.page_stride + tok * g.tok_stride + c * 8);
      out = fp8x8_as<T>(x, p.kv_fp8);
      if (c == 0) scale = g.scales != nullptr ? g.scales[page * g.scale_page_stride + tok * g.scale_tok_stride] : g.scale;
    }
    st_shared_16(dst(r, c), out);
    if (c == 0) key_scales[r] = scale;
  }
}

// A thread's values of one tile row pair in mma accumulator layout (s[4j + 2r + c]: key
// 8j + 2 (lane & 3) + c of the tile) times their keys' scales (key_scales: the tile's, in
// order, 8-byte aligned): K's on the raw scores, V's on the probabilities.
template <int N8>
__device__ __forceinline__ void scale_by_key(float* s, const float* key_scales, int lane) {
#pragma unroll
  for (int j = 0; j < N8; ++j) {
    const float2 k = *reinterpret_cast<const float2*>(key_scales + 8 * j + 2 * (lane & 3));
    s[4 * j] *= k.x;
    s[4 * j + 1] *= k.y;
    s[4 * j + 2] *= k.x;
    s[4 * j + 3] *= k.y;
  }
}

// A key offset within a tile, clamped to [-1, BC] (both ends mean "past the tile").
template <int BC>
__device__ __forceinline__ int clamp_to_tile(long long key) {
  return static_cast<int>(max(-1LL, min(key, static_cast<long long>(BC))));
}

// Two consecutive mask elements, loaded as one.
template <class M> struct MaskPair;
template <> struct MaskPair<unsigned char> { using type = uchar2; };
template <> struct MaskPair<float> { using type = float2; };
template <> struct MaskPair<__half> { using type = __half2; };
template <> struct MaskPair<__nv_bfloat16> { using type = __nv_bfloat162; };

// Adds the mask to a thread's scores of one mma accumulator tile (see general_scores).
// Where the mask's keys are contiguous, the thread's keys are all below Skv and its row's pair
// of keys (col0 even) is aligned, each pair is one load at a constant offset from the row
// pointer; else each element is its own clamped, strided load. The per-element loads and their
// 64-bit index arithmetic were most of a masked tile's instructions (cu/flash_fwd_notes.md v9).
template <class M, int N8>
__device__ __forceinline__ void add_mask(float* s, const FlashFwdParams& p, int b, int h, int row0, int seq_q,
                                         int col0, int seq_kv) {
  using Pair = typename MaskPair<M>::type;
  const bool contiguous = p.mask_key_stride == 1 && col0 + 8 * (N8 - 1) + 1 < seq_kv;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    // Rows past Sq and keys past Skv read an element that exists; the caller cuts them.
    const M* m = static_cast<const M*>(p.mask) + b * p.mask_batch_stride + h * p.mask_head_stride +
                 min(row0 + 8 * r, seq_q - 1) * p.mask_query_stride;
    if (contiguous && reinterpret_cast<unsigned long long>(m + col0) % sizeof(Pair) == 0) {
#pragma unroll
      for (int j = 0; j < N8; ++j) {
        const Pair x = *reinterpret_cast<const Pair*>(m + col0 + 8 * j);
        s[4 * j + 2 * r] += mask_bias_log2(x.x);
        s[4 * j + 2 * r + 1] += mask_bias_log2(x.y);
      }
    } else {
#pragma unroll
      for (int j = 0; j < N8; ++j)
#pragma unroll
        for (int c = 0; c < 2; ++c)
          s[4 * j + 2 * r + c] += mask_bias_log2(m[min(col0 + 8 * j + c, seq_kv - 1) * p.mask_key_stride]);
    }
  }
}

// The online softmax's exponent multiplier (exp2(s * mul - max)). Plain kernels' scores are
// raw dot products: scale * log2 e. GENERAL kernels take general_scores' units: 1 where it
// makes base-2 logits, cap * log2 e for a softcap call without a mask, whose scores it leaves
// as tanh(dot * scale / cap) (the softmax's one FFMA then does the two multiplies a score
// that base-2 logits cost there).
template <bool GENERAL>
__device__ __forceinline__ float softmax_mul(const FlashFwdParams& p) {
  if (!GENERAL) return p.scale * kLog2e;
  return p.softcap > 0.f && p.mask_kind == MASK_NONE ? p.softcap * kLog2e : 1.f;
}

// General kernels' scores: raw dot products in an m16 x (8 * N8) mma accumulator tile
// (s[4j + 2r + c] is row row0 + 8r, key col0 + 8j + c) become base-2 logits,
// softcap(dot * scale) * log2 e plus the mask's bias, as score_log2 makes them but with the
// branches on the call's options taken once a tile; or, for a softcap call without a mask,
// tanh(dot * scale / cap) (see softmax_mul). Keys outside the causal/window range or past Skv
// are left for the caller to cut. scores_then_mask takes the mask's part as `add_mask` (the
// general ws kernels' staged-mask twins add a mask they staged themselves).
template <int N8, class AddMask>
__device__ __forceinline__ void scores_then_mask(float* s, const FlashFwdParams& p, AddMask add_mask) {
  const float scale = p.scale, cap = p.softcap;
  if (cap > 0.f) {
    const float to_tanh = scale / cap;
#pragma unroll
    for (int i = 0; i < 4 * N8; ++i) s[i] = tanh_approx(s[i] * to_tanh);
    if (p.mask_kind == MASK_NONE) return;  // the softmax's softmax_mul takes them from here
    const float to_log2 = cap * kLog2e;
#pragma unroll
    for (int i = 0; i < 4 * N8; ++i) s[i] *= to_log2;
  } else {
#pragma unroll
    for (int i = 0; i < 4 * N8; ++i) s[i] *= scale * kLog2e;
  }
  add_mask();
}
template <int N8>
__device__ __forceinline__ void general_scores(float* s, const FlashFwdParams& p, int b, int h, int row0, int seq_q,
                                               int col0, int seq_kv) {
  scores_then_mask<N8>(s, p, [&] {
    switch (p.mask_kind) {
      case MASK_BOOL: add_mask<unsigned char, N8>(s, p, b, h, row0, seq_q, col0, seq_kv); break;
      case MASK_F32: add_mask<float, N8>(s, p, b, h, row0, seq_q, col0, seq_kv); break;
      case MASK_F16: add_mask<__half, N8>(s, p, b, h, row0, seq_q, col0, seq_kv); break;
      case MASK_BF16: add_mask<__nv_bfloat16, N8>(s, p, b, h, row0, seq_q, col0, seq_kv); break;
      default: break;
    }
  });
}

// The visible key range of query rows [row_lo, row_hi], clipped to [0, Skv), as BC tiles.
template <int BC>
__device__ __forceinline__ void key_tile_range(int seq_kv, const KeyWindow& win, int row_lo, int row_hi,
                                               int& begin, int& end) {
  const long long lo = max(first_visible_key(win, row_lo), 0LL);
  const long long hi = min(last_visible_key(win, row_hi), (long long)seq_kv - 1);
  begin = static_cast<int>(lo / BC);
  end = hi >= lo ? static_cast<int>(hi / BC) + 1 : begin;
}

// The same for a block of ROWS query rows from m0, less the rows past seq_q.
template <int ROWS, int BC>
__device__ __forceinline__ void block_key_tile_range(int seq_kv, const KeyWindow& win, int m0, int seq_q, int& begin,
                                                     int& end) {
  key_tile_range<BC>(seq_kv, win, m0, min(m0 + ROWS, seq_q) - 1, begin, end);
}

// Whether any of the `count` query rows from row0 sees a key of key tile `tile` (one the
// block's key_tile_range holds): false for rows past the end and for a tile whose keys are
// all outside the rows' causal/window range.
template <int BC>
__device__ __forceinline__ bool rows_see_tile(const TileRef& st, const FlashFwdParams& p, int row0, int count,
                                              int tile) {
  const int seq_q = st.seq_q();
  if (row0 >= seq_q) return false;
  const KeyWindow win = st.window(p);
  const long long n0 = static_cast<long long>(tile) * BC;
  return n0 <= last_visible_key(win, min(row0 + count, seq_q) - 1) && n0 + BC - 1 >= first_visible_key(win, row0);
}

// lse of query row `row` of sequence b, whose queries start at token q_tok0.
__device__ __forceinline__ void store_lse(const FlashFwdParams& p, int b, long long q_tok0, int h, int row,
                                          float lse) {
  p.lse[b * p.lse_batch_stride + h * p.lse_head_stride + (q_tok0 + row) * p.lse_seq_stride] = lse;
}

// A row's total over the four lanes of its quad (fixed xor order: bitwise deterministic). Every
// lane of the warp must call it (before any lane leaves for a row past the end).
__device__ __forceinline__ float quad_sum(float x) {
  x += __shfl_xor_sync(0xffffffffu, x, 1);
  return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

// A finished row's o is acc * row_inverse and its lse row_lse (without the sink). A row with no
// visible key (sum 0, row_saw_keys false) gets o = 0 and lse = -inf, sinks or not. Apart, so that
// a call without an lse output skips the log (inlined together, its ~30 instructions ran on
// every row).
__device__ __forceinline__ bool row_saw_keys(float sum) { return sum > 0.f; }
__device__ __forceinline__ float row_inverse(const FlashFwdParams& p, int h, float row_max, float sum) {
  if (!row_saw_keys(sum)) return 0.f;
  float denom = sum;
  if (p.sinks != nullptr) denom += exp2f(p.sinks[h] * kLog2e - row_max);
  return 1.f / denom;
}
__device__ __forceinline__ float row_lse(float row_max, float sum) {
  return row_saw_keys(sum) ? (row_max + log2f(sum)) * kLn2 : neg_inf();
}

}  // namespace ptxattn
