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
// merge.cu's fixed-order combine turns the partials into o and lse (and applies sinks).
//
// decode_split_<dt>_d<D>: grid (splits, Hkv * row_blocks, B), 128 threads (4 warps), dynamic
// shared memory (16 * warps_m + stages * 2 * kKeysPerTile) * D * sizeof(T) bytes, and at least
// the end-of-CTA merge's (2 + D) * 64 floats (runtime/ops/decode.py sizes it). One CTA reads the keys
// [split * keys_per_split, +keys_per_split) of one (batch, kv head) once, for all Hq/Hkv query
// heads x Sq rows of its group ("rows", head-major: row = head_in_group * Sq + t). Rows are
// cut in m-tiles of 16 (mma.sync m16n8k16, fp32 accumulate): warps_m warps along the rows and
// 4 / warps_m along the keys; each warp keeps its own online-softmax state and the warps of an
// m-tile are merged in shared memory at the end. K/V tiles of 64 keys stream through a
// cp.async ring. Keys at or past the row's live end are never read (zero-filled), so NaN in
// the unused cache tail cannot reach the output.
//
// f32 operands run on the same bf16 tensor-core path, each value split into three bf16 terms
// (hi + mid + lo carries 24 mantissa bits) and the six significant cross products summed in
// fp32: fp32-level accuracy without a second code path.
#include "attention_common.cuh"

namespace ptxattn {
namespace decode {

struct DecodeParams {
  const void* q;
  const void* k;
  const void* v;
  const int* seq_lens;     // [B] live keys of each row
  const int* block_table;  // [B, max_pages] page ids, or null for a contiguous cache
  float* o_part;
  float* lse_part;
  int* fault;
  long long q_stride_b, q_stride_h, q_stride_s;
  long long k_stride_page, k_stride_head, k_stride_tok;
  long long v_stride_page, v_stride_head, v_stride_tok;
  long long block_table_stride;  // elements between two batch rows of block_table
  int hq, hkv, sq, dqk, dv;
  int capacity;        // keys a row can hold
  int num_pages;       // pages in the pool (paged only)
  int page_size_log2;  // paged only
  int num_splits;
  int keys_per_split;  // a multiple of kKeysPerTile
  int warps_m;         // 1, 2 or 4
  int stages;          // depth of the K/V cp.async ring: 2, 3 or 4
  int window_left;     // kUnboundedWindow when unbounded
  float scale;
  float softcap;
};

constexpr int kThreads = 128;
constexpr int kWarps = kThreads / 32;
constexpr int kKeysPerTile = 64;
constexpr int kKeysPerStep = 16;  // one warp's block of scores: 16 rows x 16 keys

// D_TILE bounds both Dqk and Dv (runtime values, multiples of 8 / 4 for f32, padded to 16).
template <class T, int D_TILE>
struct Config {
  static constexpr int kChunk = 16 / int(sizeof(T));  // elements in one 16-byte chunk
  static constexpr int kChunksPerRow = D_TILE / kChunk;
  static constexpr int kTileElems = kKeysPerTile * D_TILE;
  static_assert(kChunksPerRow >= 8, "the XOR swizzle needs rows of at least 128 bytes");
  static_assert(kThreads % kChunksPerRow == 0, "loader mapping");
};

// ---- shared-memory tiles: row-major, 16-byte chunks XOR-swizzled by row (no ldmatrix bank
// conflicts) -----------------------------------------------------------------------------
template <class T, int D_TILE>
__device__ __forceinline__ int swizzled(int row, int col) {
  constexpr int kChunk = Config<T, D_TILE>::kChunk;
  return row * D_TILE + (((col / kChunk) ^ (row & 7)) * kChunk) + (col % kChunk);
}

__device__ __forceinline__ unsigned smem_addr(const void* p) {
  return static_cast<unsigned>(__cvta_generic_to_shared(p));
}

// 16 bytes global -> shared (bypassing L1, asking L2 to fetch the whole 128-byte line);
// read = false writes zeros and reads nothing.
__device__ __forceinline__ void cp_async_16(void* dst, const void* src, bool read) {
  asm volatile("cp.async.cg.shared.global.L2::128B [%0], [%1], 16, %2;\n" ::"r"(smem_addr(dst)), "l"(src),
               "r"(read ? 16 : 0));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}
// Wait until at most stages - 2 groups are in flight (the ring depth is a runtime value).
__device__ __forceinline__ void cp_async_wait_ring(int stages) {
  if (stages >= 4) cp_async_wait<2>();
  else if (stages == 3) cp_async_wait<1>();
  else cp_async_wait<0>();
}

// ---- mma operands -------------------------------------------------------------------------
// Terms<T>: how many bf16/f16 terms carry one value of T. Fragments are arrays of 32-bit
// registers holding two 16-bit elements each, laid out as mma.m16n8k16 wants them.
template <class T> struct Operand { static constexpr int kTerms = 1; };
template <> struct Operand<float> { static constexpr int kTerms = 3; };

template <class T>
__device__ __forceinline__ unsigned pack2(float lo, float hi);
template <>
__device__ __forceinline__ unsigned pack2<__half>(float lo, float hi) {
  __half2 h = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<unsigned*>(&h);
}
template <>
__device__ __forceinline__ unsigned pack2<__nv_bfloat16>(float lo, float hi) {
  __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<unsigned*>(&h);
}

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
__device__ __forceinline__ void mma_16816(float (&c)[4], const unsigned (&a)[4], const unsigned (&b)[2]);
template <>
__device__ __forceinline__ void mma_16816<__half>(float (&c)[4], const unsigned (&a)[4], const unsigned (&b)[2]) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
template <>
__device__ __forceinline__ void mma_16816<__nv_bfloat16>(float (&c)[4], const unsigned (&a)[4],
                                                         const unsigned (&b)[2]) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

template <class T> struct MmaType { using type = T; };
template <> struct MmaType<float> { using type = __nv_bfloat16; };

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
    for (int j = kTerms - 1 - i; j >= 0; --j) mma_16816<typename MmaType<T>::type>(c, a.r[i], b.r[j]);
}

__device__ __forceinline__ void ldmatrix_x4(unsigned (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(p)));
}
__device__ __forceinline__ void ldmatrix_x4_trans(unsigned (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(p)));
}

// Lane coordinates inside an mma fragment: g = row group, t = thread in group.
struct Lane {
  int g, t, lane;
};

// A = tile[row0 .. +16, col0 .. +16] (row-major).
template <class T, int D_TILE>
__device__ __forceinline__ FragA<T> load_a(const T* tile, int row0, int col0, Lane ln) {
  FragA<T> a;
  if constexpr (sizeof(T) == 2) {
    const int row = row0 + (ln.lane & 15), col = col0 + 8 * (ln.lane >> 4);
    ldmatrix_x4(a.r[0], tile + swizzled<T, D_TILE>(row, col));
  } else {
#pragma unroll
    for (int i = 0; i < 4; ++i) {  // reg i: row g + 8 (i & 1), cols 2t + 8 (i >> 1)
      const float2 x = *reinterpret_cast<const float2*>(
          tile + swizzled<T, D_TILE>(row0 + ln.g + 8 * (i & 1), col0 + 2 * ln.t + 8 * (i >> 1)));
      unsigned terms[3];
      to_terms<T>(x.x, x.y, terms);
#pragma unroll
      for (int j = 0; j < 3; ++j) a.r[j][i] = terms[j];
    }
  }
  return a;
}

// B for S = Q K^T: two n-tiles (keys key0 .. +8, +8 .. +16) over d col0 .. +16, K row-major [key][d].
template <class T, int D_TILE>
__device__ __forceinline__ void load_b_keys(const T* tile, int key0, int col0, Lane ln, FragB<T> (&b)[2]) {
  if constexpr (sizeof(T) == 2) {
    const int key = key0 + (ln.lane & 7) + 8 * (ln.lane >> 4), col = col0 + 8 * ((ln.lane >> 3) & 1);
    unsigned r[4];
    ldmatrix_x4(r, tile + swizzled<T, D_TILE>(key, col));
    b[0].r[0][0] = r[0], b[0].r[0][1] = r[1], b[1].r[0][0] = r[2], b[1].r[0][1] = r[3];
  } else {
#pragma unroll
    for (int n = 0; n < 2; ++n)
#pragma unroll
      for (int i = 0; i < 2; ++i) {  // reg i: key g, d 2t + 8 i
        const float2 x = *reinterpret_cast<const float2*>(
            tile + swizzled<T, D_TILE>(key0 + 8 * n + ln.g, col0 + 2 * ln.t + 8 * i));
        unsigned terms[3];
        to_terms<T>(x.x, x.y, terms);
#pragma unroll
        for (int j = 0; j < 3; ++j) b[n].r[j][i] = terms[j];
      }
  }
}

// B for O += P V: two n-tiles (d col0 .. +8, +8 .. +16) over keys key0 .. +16, V row-major [key][d].
template <class T, int D_TILE>
__device__ __forceinline__ void load_b_values(const T* tile, int key0, int col0, Lane ln, FragB<T> (&b)[2]) {
  if constexpr (sizeof(T) == 2) {
    const int key = key0 + (ln.lane & 7) + 8 * ((ln.lane >> 3) & 1), col = col0 + 8 * (ln.lane >> 4);
    unsigned r[4];
    ldmatrix_x4_trans(r, tile + swizzled<T, D_TILE>(key, col));
    b[0].r[0][0] = r[0], b[0].r[0][1] = r[1], b[1].r[0][0] = r[2], b[1].r[0][1] = r[3];
  } else {
#pragma unroll
    for (int n = 0; n < 2; ++n)
#pragma unroll
      for (int i = 0; i < 2; ++i) {  // reg i: keys 2t, 2t + 1 (+ 8 i), d g
        const int key = key0 + 2 * ln.t + 8 * i, col = col0 + 8 * n + ln.g;
        unsigned terms[3];
        to_terms<T>(tile[swizzled<T, D_TILE>(key, col)], tile[swizzled<T, D_TILE>(key + 1, col)], terms);
#pragma unroll
        for (int j = 0; j < 3; ++j) b[n].r[j][i] = terms[j];
      }
  }
}

// P (scores of one 16 x 16 step, as accumulators) as the A operand of the next mma.
template <class T>
__device__ __forceinline__ FragA<T> scores_as_a(const float (&p)[2][4]) {
  FragA<T> a;
#pragma unroll
  for (int i = 0; i < 4; ++i) {  // reg i: row g + 8 (i & 1), keys 2t + 8 (i >> 1)
    unsigned terms[Operand<T>::kTerms];
    to_terms<T>(p[i >> 1][2 * (i & 1)], p[i >> 1][2 * (i & 1) + 1], terms);
#pragma unroll
    for (int j = 0; j < Operand<T>::kTerms; ++j) a.r[j][i] = terms[j];
  }
  return a;
}

// ---- the split kernel -----------------------------------------------------------------------
__host__ __device__ constexpr int round16(int x) { return (x + 15) / 16 * 16; }

// This thread's share of every K/V tile: one 16-byte column chunk of rows row0, row0 + kRowStep,
// ... Base pointers and steps are fixed per CTA, so a tile costs one multiply per thread on a
// contiguous cache; a paged one looks each row's page up (one table entry per row).
template <class T, int D_TILE>
struct KvLoader {
  static constexpr int kRowStep = kThreads / Config<T, D_TILE>::kChunksPerRow;
  const T* k;  // this thread's column in this kv head (and batch row, when contiguous)
  const T* v;
  int row0, col;
  bool k_write, v_write;  // the chunk lies inside the 16-padded head dim: shared memory gets it
  bool k_read, v_read;    // ... and inside the real one: global memory is read (else zeros)

  __device__ __forceinline__ KvLoader(const DecodeParams& p, int b, int kvh) {
    row0 = threadIdx.x / Config<T, D_TILE>::kChunksPerRow;
    col = (threadIdx.x % Config<T, D_TILE>::kChunksPerRow) * Config<T, D_TILE>::kChunk;
    const long long page = p.block_table == nullptr ? b : 0;  // paged: the page comes per key
    k = static_cast<const T*>(p.k) + page * p.k_stride_page + kvh * p.k_stride_head + col;
    v = static_cast<const T*>(p.v) + page * p.v_stride_page + kvh * p.v_stride_head + col;
    k_write = col < round16(p.dqk), v_write = col < round16(p.dv);
    k_read = col < p.dqk, v_read = col < p.dv;
  }

  // One 64-key tile into shared memory; keys >= key_end, and keys whose page id is outside
  // the pool (reported), become zeros.
  __device__ __forceinline__ void load(const DecodeParams& p, int b, int key0, int key_end, T* k_tile,
                                       T* v_tile) const {
    if (!k_write && !v_write) return;
    long long k_off = static_cast<long long>(key0 + row0) * p.k_stride_tok;
    long long v_off = static_cast<long long>(key0 + row0) * p.v_stride_tok;
#pragma unroll
    for (int i = 0; i < kKeysPerTile / kRowStep; ++i) {
      const int row = row0 + i * kRowStep, key = key0 + row;
      bool live = key < key_end;
      long long ko = k_off, vo = v_off;
      if (p.block_table != nullptr && live) {
        const int id = p.block_table[b * p.block_table_stride + (key >> p.page_size_log2)];
        const long long slot = key & ((1 << p.page_size_log2) - 1);
        live = id >= 0 && id < p.num_pages;
        if (!live) raise_fault(p.fault, FAULT_PAGE_OUT_OF_RANGE, b, id);
        ko = id * p.k_stride_page + slot * p.k_stride_tok;
        vo = id * p.v_stride_page + slot * p.v_stride_tok;
      }
      const int at = swizzled<T, D_TILE>(row, col);
      if (k_write) cp_async_16(k_tile + at, k + (live ? ko : 0), live && k_read);
      if (v_write) cp_async_16(v_tile + at, v + (live ? vo : 0), live && v_read);
      k_off += kRowStep * p.k_stride_tok;
      v_off += kRowStep * p.v_stride_tok;
    }
  }
};

// The query rows of this CTA into shared memory (rows past the group and d past Dqk: zeros).
template <class T, int D_TILE>
__device__ __forceinline__ void load_q(const DecodeParams& p, int b, int kvh, int row0, int rows, T* q_tile) {
  using C = Config<T, D_TILE>;
  const T* q = static_cast<const T*>(p.q);
  const int group_rows = (p.hq / p.hkv) * p.sq;
  const int chunk = threadIdx.x % C::kChunksPerRow, col = chunk * C::kChunk;
  if (col >= round16(p.dqk)) return;
  for (int r = threadIdx.x / C::kChunksPerRow; r < rows; r += kThreads / C::kChunksPerRow) {
    const int gr = row0 + r;
    const bool live = gr < group_rows && col < p.dqk;
    long long off = 0;
    if (live) {
      const int head = kvh * (p.hq / p.hkv) + gr / p.sq, t = gr % p.sq;
      off = b * p.q_stride_b + head * p.q_stride_h + t * p.q_stride_s + col;
    }
    cp_async_16(q_tile + swizzled<T, D_TILE>(r, col), q + off, live);
  }
}

// One warp's running state for its 16 rows: rows g and g + 8 of the m-tile for this lane.
template <int D_TILE>
struct WarpState {
  float o[D_TILE / 8][4];  // unnormalised P V, accumulator layout (n-tile of 8 d per entry)
  float m[2];              // running max, base-2 scaled scores
  float l[2];              // this lane's part of the running sum
};

template <class T, int D_TILE>
__device__ __forceinline__ void attend_step(const DecodeParams& p, const T* q_tile, const T* k_tile,
                                            const T* v_tile, int q_row0, int step_key0, int tile_key0,
                                            const int (&lo)[2], const int (&hi)[2], Lane ln,
                                            WarpState<D_TILE>& st) {
  // S = Q K^T over d in steps of 16, in two accumulator chains (even / odd steps) to halve
  // the dependent mma latency, added at the end.
  float s[2][4] = {}, s_odd[2][4] = {};
#pragma unroll
  for (int ks = 0; ks < D_TILE / 16; ++ks) {
    if (ks * 16 < p.dqk) {
      const FragA<T> a = load_a<T, D_TILE>(q_tile, q_row0, ks * 16, ln);
      FragB<T> b[2];
      load_b_keys<T, D_TILE>(k_tile, step_key0, ks * 16, ln, b);
      float (&acc)[2][4] = ks % 2 ? s_odd : s;
      mma<T>(acc[0], a, b[0]);
      mma<T>(acc[1], a, b[1]);
    }
  }
#pragma unroll
  for (int i = 0; i < 8; ++i) s[i / 4][i % 4] += s_odd[i / 4][i % 4];

  // Scale and cap to base-2 logits (a warp-uniform branch keeps tanh off the common path).
  if (p.softcap > 0.f) {
#pragma unroll
    for (int i = 0; i < 8; ++i) s[i / 4][i % 4] = apply_softcap(s[i / 4][i % 4] * p.scale, p.softcap) * kLog2e;
  } else {
    const float scale_log2 = p.scale * kLog2e;
#pragma unroll
    for (int i = 0; i < 8; ++i) s[i / 4][i % 4] *= scale_log2;
  }

  // Mask, then the online softmax update, one row (g or g + 8) at a time.
  float corrections[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    float row_max = neg_inf();
#pragma unroll
    for (int n = 0; n < 2; ++n)
#pragma unroll
      for (int c = 0; c < 2; ++c) {
        const int key = tile_key0 + step_key0 + 8 * n + 2 * ln.t + c;
        if (!(key >= lo[r] && key < hi[r])) s[n][2 * r + c] = neg_inf();
        row_max = fmaxf(row_max, s[n][2 * r + c]);
      }
    row_max = fmaxf(row_max, __shfl_xor_sync(0xffffffffu, row_max, 1));
    row_max = fmaxf(row_max, __shfl_xor_sync(0xffffffffu, row_max, 2));
    const float m_new = fmaxf(st.m[r], row_max);
    const float correction = safe_exp2(st.m[r], m_new);
    float sum = 0.f;
#pragma unroll
    for (int n = 0; n < 2; ++n)
#pragma unroll
      for (int c = 0; c < 2; ++c) {
        s[n][2 * r + c] = safe_exp2(s[n][2 * r + c], m_new);
        sum += s[n][2 * r + c];
      }
    st.l[r] = st.l[r] * correction + sum;
    st.m[r] = m_new;
    corrections[r] = correction;
  }
  // Rescale O only when some row's max moved (after the first keys it rarely does).
  if (__any_sync(0xffffffffu, corrections[0] != 1.f || corrections[1] != 1.f)) {
#pragma unroll
    for (int n = 0; n < D_TILE / 8; ++n)
#pragma unroll
      for (int i = 0; i < 4; ++i) st.o[n][i] *= corrections[i / 2];
  }

  const FragA<T> pa = scores_as_a<T>(s);
#pragma unroll
  for (int j = 0; j < D_TILE / 16; ++j) {
    if (j * 16 < p.dv) {
      FragB<T> b[2];
      load_b_values<T, D_TILE>(v_tile, step_key0, j * 16, ln, b);
      mma<T>(st.o[2 * j], pa, b[0]);
      mma<T>(st.o[2 * j + 1], pa, b[1]);
    }
  }
}

template <class T, int D_TILE>
__device__ __forceinline__ void decode_split(const DecodeParams& p) {
  using C = Config<T, D_TILE>;
  extern __shared__ __align__(128) unsigned char smem[];

  const int split = blockIdx.x;
  const int row_blocks = gridDim.y / p.hkv;
  const int kvh = blockIdx.y / row_blocks;
  const int b = blockIdx.z;
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const Lane ln = {lane / 4, lane % 4, lane};
  const int warps_m = p.warps_m, warps_k = kWarps / warps_m;
  const int wm = warp % warps_m, wk = warp / warps_m;
  const int cta_rows = 16 * warps_m;
  const int row0 = (blockIdx.y % row_blocks) * cta_rows;  // first group row of this CTA
  const int group_rows = (p.hq / p.hkv) * p.sq;

  // Live length; a bad one is reported (once per batch row) and the row reads no key.
  int len = p.seq_lens[b];
  const bool reporter = split == 0 && blockIdx.y == 0 && threadIdx.x == 0;
  if (len < 0 || len > p.capacity) {
    if (reporter) raise_fault(p.fault, len < 0 ? FAULT_NEGATIVE_LENGTH : FAULT_PAST_CAPACITY, b, len);
    len = 0;
  }
  const KeyWindow window = {len - p.sq, p.window_left, 0};
  const int split_begin = split * p.keys_per_split;
  const int key_end = min(split_begin + p.keys_per_split, len);
  // Tiles stay aligned to the split start; skip whole tiles left of every row's window.
  const long long first_key = max(first_visible_key(window, 0), (long long)split_begin);
  const int begin = split_begin + int((first_key - split_begin) / kKeysPerTile) * kKeysPerTile;
  const int num_tiles = key_end > begin ? (key_end - begin + kKeysPerTile - 1) / kKeysPerTile : 0;

  T* q_tile = reinterpret_cast<T*>(smem);
  T* ring = q_tile + cta_rows * D_TILE;
  auto k_stage = [&](int s) { return ring + s * 2 * C::kTileElems; };
  auto v_stage = [&](int s) { return ring + s * 2 * C::kTileElems + C::kTileElems; };

  // Per-lane rows g and g + 8: their visible keys [lo, hi), hi capped at this split's end.
  int lo[2], hi[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int gr = row0 + wm * 16 + ln.g + 8 * r;
    if (gr < group_rows) {
      const int t = gr % p.sq;
      lo[r] = int(max(first_visible_key(window, t), 0LL));
      hi[r] = int(min(last_visible_key(window, t) + 1, (long long)key_end));
    } else {
      lo[r] = hi[r] = 0;
    }
  }

  WarpState<D_TILE> st;
#pragma unroll
  for (int n = 0; n < D_TILE / 8; ++n) st.o[n][0] = st.o[n][1] = st.o[n][2] = st.o[n][3] = 0.f;
  st.m[0] = st.m[1] = neg_inf();
  st.l[0] = st.l[1] = 0.f;

  const KvLoader<T, D_TILE> loader(p, b, kvh);
  if (num_tiles > 0) load_q<T, D_TILE>(p, b, kvh, row0, cta_rows, q_tile);
  for (int s = 0; s < p.stages - 1; ++s) {
    if (s < num_tiles) loader.load(p, b, begin + s * kKeysPerTile, key_end, k_stage(s), v_stage(s));
    cp_async_commit();
  }
  for (int it = 0; it < num_tiles; ++it) {
    cp_async_wait_ring(p.stages);
    __syncthreads();  // tile `it` landed for every thread; the stage read at it - 1 is free
    const int next = it + p.stages - 1;
    if (next < num_tiles)
      loader.load(p, b, begin + next * kKeysPerTile, key_end, k_stage(next % p.stages), v_stage(next % p.stages));
    cp_async_commit();

    const int tile_key0 = begin + it * kKeysPerTile;
    for (int step = wk; step < kKeysPerTile / kKeysPerStep; step += warps_k) {
      if (tile_key0 + step * kKeysPerStep >= key_end) break;
      attend_step<T, D_TILE>(p, q_tile, k_stage(it % p.stages), v_stage(it % p.stages), wm * 16,
                             step * kKeysPerStep, tile_key0, lo, hi, ln, st);
    }
  }
  cp_async_wait<0>();

  // Each lane holds part of its rows' sums: total them over the 4 lanes of the row.
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    st.l[r] += __shfl_xor_sync(0xffffffffu, st.l[r], 1);
    st.l[r] += __shfl_xor_sync(0xffffffffu, st.l[r], 2);
  }

  // Merge the warps_k warps of each m-tile in shared memory, in warp order.
  __syncthreads();  // every warp is done with the ring
  float* stat_m = reinterpret_cast<float*>(smem);
  float* stat_l = stat_m + kWarps * 16;
  float* part_o = stat_l + kWarps * 16;  // [warp][16 rows][D_TILE]
  {
    float* my_o = part_o + warp * 16 * D_TILE;
#pragma unroll
    for (int n = 0; n < D_TILE / 8; ++n) {
      if (n * 8 < p.dv) {
#pragma unroll
        for (int i = 0; i < 4; ++i) my_o[(ln.g + 8 * (i >> 1)) * D_TILE + n * 8 + 2 * ln.t + (i & 1)] = st.o[n][i];
      }
    }
    if (ln.t == 0) {
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        stat_m[warp * 16 + ln.g + 8 * r] = st.m[r];
        stat_l[warp * 16 + ln.g + 8 * r] = st.l[r];
      }
    }
  }
  __syncthreads();

  for (int idx = threadIdx.x; idx < cta_rows * p.dv; idx += kThreads) {
    const int rr = idx / p.dv, d = idx % p.dv;
    const int gr = row0 + rr;
    if (gr >= group_rows) continue;
    const int m_tile = rr / 16, r = rr % 16;
    float m_all = neg_inf();
    for (int w = m_tile; w < kWarps; w += warps_m) m_all = fmaxf(m_all, stat_m[w * 16 + r]);
    float l_all = 0.f, o = 0.f;
    for (int w = m_tile; w < kWarps; w += warps_m) {
      const float weight = safe_exp2(stat_m[w * 16 + r], m_all);
      l_all += weight * stat_l[w * 16 + r];
      o += weight * part_o[(w * 16 + r) * D_TILE + d];
    }
    const int head = kvh * (p.hq / p.hkv) + gr / p.sq, t = gr % p.sq;
    const long long part = ((static_cast<long long>(b) * p.hq + head) * p.sq + t) * p.num_splits + split;
    p.o_part[part * p.dv + d] = l_all > 0.f ? o / l_all : 0.f;
    if (d == 0) p.lse_part[part] = l_all > 0.f ? (m_all + log2f(l_all)) * kLn2 : neg_inf();
  }
}

}  // namespace decode
}  // namespace ptxattn

#define PTXATTN_DECODE_VARIANT(NAME, T, D)                                           \
  extern "C" __global__ void __launch_bounds__(ptxattn::decode::kThreads)            \
      NAME(const ptxattn::decode::DecodeParams p) {                                  \
    ptxattn::decode::decode_split<T, D>(p);                                          \
  }

PTXATTN_DECODE_VARIANT(decode_split_f16_d64, __half, 64)
PTXATTN_DECODE_VARIANT(decode_split_f16_d128, __half, 128)
PTXATTN_DECODE_VARIANT(decode_split_f16_d256, __half, 256)
PTXATTN_DECODE_VARIANT(decode_split_bf16_d64, __nv_bfloat16, 64)
PTXATTN_DECODE_VARIANT(decode_split_bf16_d128, __nv_bfloat16, 128)
PTXATTN_DECODE_VARIANT(decode_split_bf16_d256, __nv_bfloat16, 256)
PTXATTN_DECODE_VARIANT(decode_split_f32_d64, float, 64)
PTXATTN_DECODE_VARIANT(decode_split_f32_d128, float, 128)
