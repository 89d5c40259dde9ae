// Scaled dot-product attention forward (FlashAttention-2 style).
//
//   q [B, Hq, Sq, Dqk], k [B, Hkv, Skv, Dqk], v [B, Hkv, Skv, Dv] -> o [B, Hq, Sq, Dv]
//   lse [B, Hq, Sq] fp32 (natural log, contiguous), optional.
//
// Grid: x = query block (reversed when heavy_first), y = query head, z = batch.
// f16/bf16: tensor cores (mma.sync m16n8k16, fp32 accumulate); each warp owns 16 query
// rows whose Q fragments stay in registers; K/V tiles stream through a cp.async ring
// of STAGES buffers; P is rounded to the input dtype in registers and is directly the
// A operand of P·V. f32: a SIMT kernel with the same semantics in exact fp32.
// Score semantics (softcap, causal/window, masks, -inf handling): attention_common.cuh.
#include "attention_common.cuh"

namespace ptxattn {

// Mirrored by runtime/ops/attention.py (_FlashFwdParams): same fields, same order.
struct FlashFwdParams {
  const void* q;
  const void* k;
  const void* v;
  void* o;
  float* lse;          // [B, Hq, Sq] contiguous, or null
  const void* mask;    // read through the four mask strides (0 = broadcast), or null
  const float* sinks;  // [Hq], or null
  long long q_batch_stride, q_head_stride, q_seq_stride;
  long long k_batch_stride, k_head_stride, k_seq_stride;
  long long v_batch_stride, v_head_stride, v_seq_stride;
  long long o_batch_stride, o_head_stride, o_seq_stride;
  long long mask_batch_stride, mask_head_stride, mask_query_stride, mask_key_stride;
  int heads_q, heads_kv, seq_q, seq_kv, dim_qk, dim_v;
  int mask_kind;  // MaskKind
  int diag_offset, window_left, window_right;
  float scale, softcap;
  int vector_io;    // host checked: q/k/v/o bases 16-byte aligned, batch/head/seq strides x8
  int heavy_first;  // visit query blocks last-first (causal: late blocks see more keys)
};

// ---- small PTX wrappers -------------------------------------------------------
__device__ __forceinline__ unsigned smem_u32(const void* ptr) {
  return static_cast<unsigned>(__cvta_generic_to_shared(ptr));
}

__device__ __forceinline__ void cp_async_16(void* smem_dst, const void* global_src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(smem_u32(smem_dst)),
               "l"(global_src));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

__device__ __forceinline__ void ldmatrix_x4(unsigned (&r)[4], const void* smem) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_u32(smem)));
}
__device__ __forceinline__ void ldmatrix_x4_trans(unsigned (&r)[4], const void* smem) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_u32(smem)));
}

// exp2 without denormal handling: weights below 2^-126 of the row max flush to 0.
__device__ __forceinline__ float exp2_ftz(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

template <class T> constexpr bool is_bf16 = false;
template <> constexpr bool is_bf16<__nv_bfloat16> = true;

// d += a (16x16, row) * b (16x8, col), fp32 accumulate.
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

// Two floats rounded to T, packed low-first into one 32-bit register.
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

// Shared tiles are [rows][cols] with 16-byte chunks XOR-swizzled by row, so the eight
// rows an ldmatrix reads (and a warp's cp.async writes) hit eight different bank groups.
__device__ __forceinline__ int swizzle(int row, int chunk) { return chunk ^ (row & 7); }

// Copies a [ROWS, COLS] tile whose row r starts at g + r * row_stride into swizzled
// shared memory; rows >= rows_valid and columns >= cols_valid become zeros (so padded
// K/V rows cannot inject NaN into P·V). Full 16-byte chunks go through cp.async when
// the host vouched for alignment; the rest element by element.
template <class T, int ROWS, int COLS, int NT>
__device__ __forceinline__ void load_tile(T* s, const T* g, long long row_stride, int rows_valid,
                                          int cols_valid, bool vector_io, int tid) {
  constexpr int kChunksPerRow = COLS / 8;
  constexpr int kChunks = ROWS * kChunksPerRow;
  static_assert(kChunks % NT == 0, "tile chunks must split evenly over the threads");
  if constexpr (NT % kChunksPerRow == 0) {
    // Hot path (a whole, aligned tile): each thread copies one column chunk of every
    // kRowStep-th row, so its addresses advance by constants.
    if (vector_io && rows_valid >= ROWS && cols_valid >= COLS) {
      constexpr int kRowStep = NT / kChunksPerRow;
      const int r0 = tid / kChunksPerRow, chunk = tid % kChunksPerRow;
      const T* src = g + r0 * row_stride + chunk * 8;
#pragma unroll
      for (int it = 0; it < kChunks / NT; ++it) {
        const int r = r0 + it * kRowStep;
        cp_async_16(s + r * COLS + swizzle(r, chunk) * 8, src + it * kRowStep * row_stride);
      }
      return;
    }
  }
#pragma unroll
  for (int it = 0; it < kChunks / NT; ++it) {
    const int c = it * NT + tid;
    const int r = c / kChunksPerRow, chunk = c % kChunksPerRow;
    T* dst = s + r * COLS + swizzle(r, chunk) * 8;
    const int valid = r < rows_valid ? cols_valid - chunk * 8 : 0;
    if (vector_io && valid >= 8) {
      cp_async_16(dst, g + r * row_stride + chunk * 8);
    } else {
      unsigned short e[8] = {0, 0, 0, 0, 0, 0, 0, 0};
      if (valid > 0) {
        const unsigned short* src =
            reinterpret_cast<const unsigned short*>(g + r * row_stride + chunk * 8);
#pragma unroll
        for (int x = 0; x < 8; ++x)
          if (x < valid) e[x] = src[x];
      }
      *reinterpret_cast<uint4*>(dst) =
          make_uint4(e[0] | (unsigned(e[1]) << 16), e[2] | (unsigned(e[3]) << 16),
                     e[4] | (unsigned(e[5]) << 16), e[6] | (unsigned(e[7]) << 16));
    }
  }
}

__device__ __forceinline__ long long mask_offset(const FlashFwdParams& p, int b, int h, int i,
                                                 int j) {
  return b * p.mask_batch_stride + h * p.mask_head_stride + i * p.mask_query_stride +
         j * p.mask_key_stride;
}

// Scaled, softcapped, masked score in the base-2 domain (-inf = not attended).
__device__ __forceinline__ float score_log2(const FlashFwdParams& p, const KeyWindow& win,
                                            float dot, int b, int h, int i, int j) {
  if (j >= p.seq_kv || i >= p.seq_q || !key_visible(win, i, j)) return neg_inf();
  float x = apply_softcap(dot * p.scale, p.softcap) * kLog2e;
  if (p.mask_kind != MASK_NONE) x += mask_bias_log2(p.mask_kind, p.mask, mask_offset(p, b, h, i, j));
  return x;
}

// The visible key range of query rows [row_lo, row_hi], clipped to [0, Skv), as BC tiles.
template <int BC>
__device__ __forceinline__ void key_tile_range(const FlashFwdParams& p, const KeyWindow& win,
                                               int row_lo, int row_hi, int& begin, int& end) {
  const long long lo = max(first_visible_key(win, row_lo), 0LL);
  const long long hi = min(last_visible_key(win, row_hi), (long long)p.seq_kv - 1);
  begin = static_cast<int>(lo / BC);
  end = hi >= lo ? static_cast<int>(hi / BC) + 1 : begin;
}

// Writes one output row's finished values: o = acc / denom, lse without the sink.
// A row with no visible key (sum 0) gets o = 0 and lse = -inf, sinks or not.
struct RowResult {
  float inv;  // 1 / (sum + sink term), or 0 for an empty row
  float lse;
};
__device__ __forceinline__ RowResult finish_row(const FlashFwdParams& p, int h, float row_max,
                                                float sum) {
  if (!(sum > 0.f)) return {0.f, neg_inf()};
  float denom = sum;
  if (p.sinks != nullptr) denom += exp2f(p.sinks[h] * kLog2e - row_max);
  return {1.f / denom, (row_max + log2f(sum)) * kLn2};
}

extern __shared__ __align__(128) unsigned char dyn_smem[];

// ---- tensor-core kernel (f16 / bf16) ----------------------------------------------
template <class T, int DQK, int DV, int WARPS, int BC, int STAGES>
__device__ __forceinline__ void flash_fwd_tc(const FlashFwdParams& p) {
  constexpr int BR = 16 * WARPS, NT = 32 * WARPS;
  constexpr int KSTEPS = DQK / 16;  // k16 steps of Q·K^T
  constexpr int STILES = BC / 8;    // n8 score tiles per warp
  constexpr int OTILES = DV / 8;    // n8 output tiles per warp
  constexpr bool Q_IN_REGS = DQK < 256;
  constexpr int STAGE_ELEMS = BC * (DQK + DV);  // one stage: K tile, then V tile
  // Once its fragments are in registers, Q's tile is dead: it borrows the last stage,
  // which the first prefetch of the key loop is the first to overwrite.
  constexpr bool Q_IN_STAGE = Q_IN_REGS && BR * DQK <= STAGE_ELEMS;
  static_assert(DQK % 64 == 0 && DV % 64 == 0 && BC % 16 == 0, "tile shape");

  T* stages = reinterpret_cast<T*>(dyn_smem);
  T* sq = Q_IN_STAGE ? stages + (STAGES - 1) * STAGE_ELEMS : stages + STAGES * STAGE_ELEMS;

  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int num_blocks = (p.seq_q + BR - 1) / BR;
  const int m0 = (p.heavy_first ? num_blocks - 1 - int(blockIdx.x) : int(blockIdx.x)) * BR;
  const int h = blockIdx.y, b = blockIdx.z;
  const int hk = h / (p.heads_q / p.heads_kv);
  const int rows = min(BR, p.seq_q - m0);
  const bool vector_io = p.vector_io != 0;
  const KeyWindow win{p.diag_offset, p.window_left, p.window_right};

  const T* gq = static_cast<const T*>(p.q) + b * p.q_batch_stride + h * p.q_head_stride +
                m0 * p.q_seq_stride;
  const T* gk = static_cast<const T*>(p.k) + b * p.k_batch_stride + hk * p.k_head_stride;
  const T* gv = static_cast<const T*>(p.v) + b * p.v_batch_stride + hk * p.v_head_stride;

  int tile_begin, tile_end;
  key_tile_range<BC>(p, win, m0, m0 + rows - 1, tile_begin, tile_end);

  auto load_kv = [&](int stage, int tile) {
    const int n0 = tile * BC;
    T* sk = stages + stage * STAGE_ELEMS;
    load_tile<T, BC, DQK, NT>(sk, gk + n0 * p.k_seq_stride, p.k_seq_stride, p.seq_kv - n0,
                              p.dim_qk, vector_io, tid);
    load_tile<T, BC, DV, NT>(sk + BC * DQK, gv + n0 * p.v_seq_stride, p.v_seq_stride,
                             p.seq_kv - n0, p.dim_v, vector_io, tid);
  };

  // This thread's accumulator rows: warp_row0 + lane/4 and + 8.
  const int warp_row0 = m0 + warp * 16;
  const int my_row = warp_row0 + (lane >> 2);
  float acc[OTILES][4];
#pragma unroll
  for (int t = 0; t < OTILES; ++t) acc[t][0] = acc[t][1] = acc[t][2] = acc[t][3] = 0.f;
  float row_max[2] = {neg_inf(), neg_inf()};
  float row_sum[2] = {0.f, 0.f};
  const float scale_log2 = p.scale * kLog2e;
  const bool plain_scores = p.mask_kind == MASK_NONE && !(p.softcap > 0.f);

  if (tile_begin < tile_end) {
    load_tile<T, BR, DQK, NT>(sq, gq, p.q_seq_stride, rows, p.dim_qk, vector_io, tid);
#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) {
      if (tile_begin + s < tile_end) load_kv(s, tile_begin + s);
      cp_async_commit();
    }
    cp_async_wait<STAGES - 2>();
    __syncthreads();

    // Q fragments (A operand): kept in registers for the whole key loop, or for the
    // widest head dim (where they would not fit beside the accumulators) re-read from
    // shared memory at each k-step.
    const int q_row = warp * 16 + (lane & 7) + (((lane >> 3) & 1) << 3);
    auto q_frag = [&](unsigned (&a)[4], int ks) {
      ldmatrix_x4(a, sq + q_row * DQK + swizzle(q_row, ks * 2 + (lane >> 4)) * 8);
    };
    unsigned qf[Q_IN_REGS ? KSTEPS : 1][4];
    if constexpr (Q_IN_REGS) {
#pragma unroll
      for (int ks = 0; ks < KSTEPS; ++ks) q_frag(qf[ks], ks);
    }
    if constexpr (Q_IN_STAGE) __syncthreads();  // all Q reads done before its stage refills

    // ldmatrix lane offsets (elements). Every row an ldmatrix touches has row & 7 ==
    // lane & 7, so the swizzled chunk of logical chunk 2*step + c is (2*step) ^ (c ^ lane&7):
    // it depends on step only through step & 3; the rest is a compile-time constant.
    int k_off[4], v_off[4];
    {
      const int k_row = (lane & 7) + ((lane >> 4) << 3), k_sel = ((lane >> 3) & 1) ^ (lane & 7);
      const int v_row = (lane & 7) + (((lane >> 3) & 1) << 3), v_sel = (lane >> 4) ^ (lane & 7);
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        k_off[q] = k_row * DQK + ((2 * q) ^ k_sel) * 8;
        v_off[q] = v_row * DV + ((2 * q) ^ v_sel) * 8;
      }
    }

    for (int t = tile_begin; t < tile_end; ++t) {
      const int i = t - tile_begin;
      if (i > 0) {
        cp_async_wait<STAGES - 2>();
        __syncthreads();  // tile t landed; everyone is done with the stage refilled next
      }
      if (t + STAGES - 1 < tile_end) load_kv((i + STAGES - 1) % STAGES, t + STAGES - 1);
      cp_async_commit();

      const T* skt = stages + (i % STAGES) * STAGE_ELEMS;
      const T* svt = skt + BC * DQK;
      const int n0 = t * BC;

      // S = Q K^T for this warp's 16 rows and the tile's BC keys.
      float s[STILES][4];
#pragma unroll
      for (int n = 0; n < STILES; ++n) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.f;
#pragma unroll
      for (int ks = 0; ks < KSTEPS; ++ks) {
        unsigned(&a)[4] = qf[Q_IN_REGS ? ks : 0];
        if constexpr (!Q_IN_REGS) q_frag(a, ks);
#pragma unroll
        for (int np = 0; np < BC / 16; ++np) {
          unsigned kb[4];
          ldmatrix_x4(kb, skt + k_off[ks & 3] + np * 16 * DQK + (ks >> 2) * 64);
          mma_16816<T>(s[2 * np], a, kb[0], kb[1]);
          mma_16816<T>(s[2 * np + 1], a, kb[2], kb[3]);
        }
      }

      // Scores to the base-2 domain; the per-element path only where some key of this
      // warp's rows is cut (causal/window edge, Skv end) or a mask/softcap applies.
      const bool whole_tile = plain_scores && n0 + BC <= p.seq_kv &&
                              n0 >= first_visible_key(win, warp_row0 + 15) &&
                              n0 + BC - 1 <= last_visible_key(win, warp_row0);
      if (whole_tile) {
#pragma unroll
        for (int n = 0; n < STILES; ++n)
#pragma unroll
          for (int e = 0; e < 4; ++e) s[n][e] *= scale_log2;
      } else {
#pragma unroll
        for (int n = 0; n < STILES; ++n)
#pragma unroll
          for (int e = 0; e < 4; ++e)
            s[n][e] = score_log2(p, win, s[n][e], b, h, my_row + (e >> 1) * 8,
                                 n0 + n * 8 + 2 * (lane & 3) + (e & 1));
      }

      // Online softmax; each row is spread over the 4 lanes of a quad.
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        float mx = row_max[r];
#pragma unroll
        for (int n = 0; n < STILES; ++n) mx = fmaxf(mx, fmaxf(s[n][2 * r], s[n][2 * r + 1]));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
        const float sub = exp_subtrahend(mx);
        const float alpha = exp2_ftz(row_max[r] - sub);
        row_max[r] = mx;
        row_sum[r] *= alpha;
#pragma unroll
        for (int d = 0; d < OTILES; ++d) {
          acc[d][2 * r] *= alpha;
          acc[d][2 * r + 1] *= alpha;
        }
#pragma unroll
        for (int n = 0; n < STILES; ++n) {
          s[n][2 * r] = exp2_ftz(s[n][2 * r] - sub);
          s[n][2 * r + 1] = exp2_ftz(s[n][2 * r + 1] - sub);
          row_sum[r] += s[n][2 * r] + s[n][2 * r + 1];
        }
      }

      // O += P V: the accumulator layout of two n8 score tiles is the A layout of one k16.
#pragma unroll
      for (int kk = 0; kk < BC / 16; ++kk) {
        const unsigned pa[4] = {pack2<T>(s[2 * kk][0], s[2 * kk][1]),
                                pack2<T>(s[2 * kk][2], s[2 * kk][3]),
                                pack2<T>(s[2 * kk + 1][0], s[2 * kk + 1][1]),
                                pack2<T>(s[2 * kk + 1][2], s[2 * kk + 1][3])};
#pragma unroll
        for (int dp = 0; dp < DV / 16; ++dp) {
          unsigned vb[4];
          ldmatrix_x4_trans(vb, svt + v_off[dp & 3] + kk * 16 * DV + (dp >> 2) * 64);
          mma_16816<T>(acc[2 * dp], pa, vb[0], vb[1]);
          mma_16816<T>(acc[2 * dp + 1], pa, vb[2], vb[3]);
        }
      }
    }
  }

  // Finish: quad-reduce the row sums (fixed xor order), normalise, store.
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    float sum = row_sum[r];
    sum += __shfl_xor_sync(0xffffffffu, sum, 1);
    sum += __shfl_xor_sync(0xffffffffu, sum, 2);
    const int row = my_row + r * 8;
    if (row >= p.seq_q) continue;
    const RowResult res = finish_row(p, h, row_max[r], sum);
    T* go = static_cast<T*>(p.o) + b * p.o_batch_stride + h * p.o_head_stride +
            row * p.o_seq_stride;
#pragma unroll
    for (int d = 0; d < OTILES; ++d) {
      const int col = d * 8 + 2 * (lane & 3);
      const float lo = res.inv == 0.f ? 0.f : acc[d][2 * r] * res.inv;
      const float hi = res.inv == 0.f ? 0.f : acc[d][2 * r + 1] * res.inv;
      if (vector_io && col + 1 < p.dim_v) {
        *reinterpret_cast<unsigned*>(go + col) = pack2<T>(lo, hi);
      } else {
        if (col < p.dim_v) go[col] = from_float<T>(lo);
        if (col + 1 < p.dim_v) go[col + 1] = from_float<T>(hi);
      }
    }
    if (p.lse != nullptr && (lane & 3) == 0)
      p.lse[(static_cast<long long>(b) * p.heads_q + h) * p.seq_q + row] = res.lse;
  }
}

// ---- SIMT kernel (f32) --------------------------------------------------------------
// One warp per query row, F32_WARPS rows per block sharing each 32-key K/V tile in
// shared memory. Lane j scores key j of the tile; then every lane accumulates P·V for
// dims lane, lane + 32, ... in key order. Dynamic shared memory (floats):
// K [32][dim_qk | 1] (odd row pitch: conflict-free column reads), V [32][dim_v],
// Q [F32_WARPS][dim_qk].
constexpr int F32_WARPS = 4;
constexpr int F32_MAX_DV = 256;

__device__ __forceinline__ void flash_fwd_simt_f32(const FlashFwdParams& p) {
  const int k_pitch = p.dim_qk | 1;
  float* sk = reinterpret_cast<float*>(dyn_smem);
  float* sv = sk + 32 * k_pitch;
  float* sq = sv + 32 * p.dim_v;

  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int num_blocks = (p.seq_q + F32_WARPS - 1) / F32_WARPS;
  const int m0 = (p.heavy_first ? num_blocks - 1 - int(blockIdx.x) : int(blockIdx.x)) * F32_WARPS;
  const int h = blockIdx.y, b = blockIdx.z;
  const int hk = h / (p.heads_q / p.heads_kv);
  const int row = m0 + warp;
  const KeyWindow win{p.diag_offset, p.window_left, p.window_right};

  const float* gk = static_cast<const float*>(p.k) + b * p.k_batch_stride + hk * p.k_head_stride;
  const float* gv = static_cast<const float*>(p.v) + b * p.v_batch_stride + hk * p.v_head_stride;
  if (row < p.seq_q) {
    const float* gq = static_cast<const float*>(p.q) + b * p.q_batch_stride +
                      h * p.q_head_stride + row * p.q_seq_stride;
    for (int d = lane; d < p.dim_qk; d += 32) sq[warp * p.dim_qk + d] = gq[d];
  }

  int tile_begin, tile_end;
  key_tile_range<32>(p, win, m0, min(m0 + F32_WARPS, p.seq_q) - 1, tile_begin, tile_end);

  float acc[F32_MAX_DV / 32];
#pragma unroll
  for (int c = 0; c < F32_MAX_DV / 32; ++c) acc[c] = 0.f;
  float row_max = neg_inf(), row_sum = 0.f;

  for (int t = tile_begin; t < tile_end; ++t) {
    const int n0 = t * 32;
    __syncthreads();  // previous tile fully consumed (and Q staged, on the first pass)
    for (int x = tid; x < 32 * p.dim_qk; x += 32 * F32_WARPS) {
      const int j = x / p.dim_qk, d = x % p.dim_qk;
      sk[j * k_pitch + d] = n0 + j < p.seq_kv ? gk[(n0 + j) * p.k_seq_stride + d] : 0.f;
    }
    for (int x = tid; x < 32 * p.dim_v; x += 32 * F32_WARPS) {
      const int j = x / p.dim_v, d = x % p.dim_v;
      sv[j * p.dim_v + d] = n0 + j < p.seq_kv ? gv[(n0 + j) * p.v_seq_stride + d] : 0.f;
    }
    __syncthreads();
    if (row >= p.seq_q) continue;

    float dot = 0.f;
    for (int d = 0; d < p.dim_qk; ++d) dot = fmaf(sq[warp * p.dim_qk + d], sk[lane * k_pitch + d], dot);
    const float x = score_log2(p, win, dot, b, h, row, n0 + lane);

    float mx = x;
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, off));
    mx = fmaxf(mx, row_max);
    const float sub = exp_subtrahend(mx);
    const float alpha = exp2f(row_max - sub);
    row_max = mx;
    const float pj = exp2f(x - sub);
    float tile_sum = pj;
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) tile_sum += __shfl_xor_sync(0xffffffffu, tile_sum, off);
    row_sum = row_sum * alpha + tile_sum;
#pragma unroll
    for (int c = 0; c < F32_MAX_DV / 32; ++c) acc[c] *= alpha;
    for (int j = 0; j < 32; ++j) {
      const float pk = __shfl_sync(0xffffffffu, pj, j);
#pragma unroll
      for (int c = 0; c < F32_MAX_DV / 32; ++c) {
        const int d = lane + 32 * c;
        if (d < p.dim_v) acc[c] = fmaf(pk, sv[j * p.dim_v + d], acc[c]);
      }
    }
  }

  if (row >= p.seq_q) return;
  const RowResult res = finish_row(p, h, row_max, row_sum);
  float* go = static_cast<float*>(p.o) + b * p.o_batch_stride + h * p.o_head_stride +
              row * p.o_seq_stride;
#pragma unroll
  for (int c = 0; c < F32_MAX_DV / 32; ++c) {
    const int d = lane + 32 * c;
    if (d < p.dim_v) go[d] = res.inv == 0.f ? 0.f : acc[c] * res.inv;
  }
  if (p.lse != nullptr && lane == 0)
    p.lse[(static_cast<long long>(b) * p.heads_q + h) * p.seq_q + row] = res.lse;
}

}  // namespace ptxattn

// ---- entry points --------------------------------------------------------------------
// Tile table (mirrored by runtime/ops/attention.py _TILES):
//   name suffix   Dqk  Dv  warps(rows = 16 x warps)  BC(keys/tile)  stages
// Chosen on the H200 (bf16, 2026-11-29, one run each, TFLOP/s):
//   B4 H32 S4096 D128 non-causal / causal: 8 warps, BC 64: 2 stages 226 / 198, 3 stages
//   242 / 209 (268 after the ftz exp2 and hot-path loads), 4 stages 268; 4 warps (2 blocks
//   an SM) 193 / 174; BC 32: 213 / 188. All fit sm_86's 99 KiB only because Q borrows a stage.
//   B8 H16 S2048 D64: BC 64 3 stages 177, 4 warps 178, BC 128 2 stages 192 (231 after
//   the same changes), BC 128 3 stages 231, BC 256 (spills) 199.
//   D128 BC 128 (spills, sm_90-only shared memory): 267 / 221 against this table's 267 / 236.
//   PyTorch flash (FA2) ran 348 / 305 and 249 on those shapes: still short, see issue 3.
#define FLASH_FWD_TC(NAME, T, DQK, DV, WARPS, BC, STAGES)                            \
  extern "C" __global__ void __launch_bounds__(32 * WARPS)                          \
      NAME(const ptxattn::FlashFwdParams p) {                                       \
    ptxattn::flash_fwd_tc<T, DQK, DV, WARPS, BC, STAGES>(p);                        \
  }
#define FLASH_FWD_TC_DTYPES(SUFFIX, DQK, DV, WARPS, BC, STAGES)                     \
  FLASH_FWD_TC(flash_fwd_bf16_##SUFFIX, __nv_bfloat16, DQK, DV, WARPS, BC, STAGES) \
  FLASH_FWD_TC(flash_fwd_f16_##SUFFIX, __half, DQK, DV, WARPS, BC, STAGES)

FLASH_FWD_TC_DTYPES(d64, 64, 64, 8, 128, 2)
FLASH_FWD_TC_DTYPES(d128, 128, 128, 8, 64, 3)
FLASH_FWD_TC_DTYPES(d192_128, 192, 128, 8, 32, 2)
FLASH_FWD_TC_DTYPES(d256, 256, 256, 4, 32, 2)

extern "C" __global__ void __launch_bounds__(32 * ptxattn::F32_WARPS)
    flash_fwd_f32(const ptxattn::FlashFwdParams p) {
  ptxattn::flash_fwd_simt_f32(p);
}
