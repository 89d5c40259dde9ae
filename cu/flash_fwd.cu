// Scaled dot-product attention forward (FlashAttention-2 style).
//
//   q [B, Hq, Sq, Dqk], k [B, Hkv, Skv, Dqk], v [B, Hkv, Skv, Dv] -> o [B, Hq, Sq, Dv]
//   lse [B, Hq, Sq] fp32 (natural log), optional.
//   Serving batches (ops/ragged.py): packed q [Nq, Hq, Dqk] / o / lse by cu_seqlens_q, keys
//   packed by cu_seqlens_k or paged through a block table (flash_fwd_common.cuh).
//
// Grid: x = query block (reversed when heavy_first; a serving batch's tiles), y = query
// head, z = batch.
// f16/bf16: tensor cores (mma.sync m16n8k16, fp32 accumulate); each warp owns 16 or 32
// query rows (one or two m16 tiles) whose Q fragments stay in registers or are re-read
// from shared memory; K/V tiles stream through a cp.async ring of STAGES buffers; P is
// rounded to the input dtype in registers and is directly the A operand of P·V. Two
// kernels a head dim: plain scores (no mask/softcap, scale > 0: the scale folds into the
// exponent, only edge tiles are cut) and general (per-element score path).
// f32: a SIMT kernel with the same semantics in exact fp32.
// Score semantics (softcap, causal/window, masks, -inf handling): attention_common.cuh.
#include "flash_fwd_common.cuh"
#include "mma.cuh"

namespace ptxattn {

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
  // Edge tiles only: not unrolled, so the hot loop keeps its registers.
#pragma unroll 1
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

// As load_tile, for a paged pool: row r is key n0 + r of sequence b (vector_io only).
template <class T, int ROWS, int COLS, int NT>
__device__ __forceinline__ void load_paged_tile(T* s, const FlashFwdParams& p, const T* pool, long long page_stride,
                                                long long tok_stride, int b, int n0, int rows_valid,
                                                int cols_valid, int tid) {
  constexpr int kChunksPerRow = COLS / 8;
  constexpr int kChunks = ROWS * kChunksPerRow;
  static_assert(kChunks % NT == 0, "tile chunks must split evenly over the threads");
#pragma unroll
  for (int it = 0; it < kChunks / NT; ++it) {
    const int c = it * NT + tid;
    const int r = c / kChunksPerRow, chunk = c % kChunksPerRow;
    const T* row = r < rows_valid ? paged_row(p, pool, page_stride, tok_stride, b, n0 + r) : nullptr;
    const bool read = row != nullptr && chunk * 8 < cols_valid;
    cp_async_16_or_zero(s + r * COLS + swizzle(r, chunk) * 8, read ? row + chunk * 8 : pool, read);
  }
}

__device__ __forceinline__ long long mask_offset(const FlashFwdParams& p, int b, int h, int i,
                                                 int j) {
  return b * p.mask_batch_stride + h * p.mask_head_stride + i * p.mask_query_stride +
         j * p.mask_key_stride;
}

// Scaled, softcapped, masked score in the base-2 domain (-inf = not attended): the f32 SIMT
// kernel's per-element path (the tensor-core kernels take general_scores).
__device__ __forceinline__ float score_log2(const FlashFwdParams& p, int seq_q, int seq_kv, const KeyWindow& win,
                                            float dot, int b, int h, int i, int j) {
  if (j >= seq_kv || i >= seq_q || !key_visible(win, i, j)) return neg_inf();
  float x = apply_softcap(dot * p.scale, p.softcap) * kLog2e;
  if (p.mask_kind != MASK_NONE) x += mask_bias_log2(p.mask_kind, p.mask, mask_offset(p, b, h, i, j));
  return x;
}

extern __shared__ __align__(128) unsigned char dyn_smem[];

// ---- tensor-core kernel (f16 / bf16) ----------------------------------------------
// ldmatrix addressing in a swizzled [rows][COLS] b16 tile. A lane reads the 16-byte chunk
// 2 * step + sel of `row`; every row an ldmatrix touches has row & 7 == lane & 7. The
// swizzle only flips chunk bits 0-2, so the byte offset is lane_offset(row, sel) with
// bits 5-6 XOR-ed by step & 3 (chunk_step) and (step >> 2) * 128 added: one register a
// lane pattern instead of four.
template <int COLS>
__device__ __forceinline__ unsigned lane_offset(int row, int sel) {
  return (row * COLS + (sel ^ (row & 7)) * 8) * 2;
}
__device__ __forceinline__ unsigned chunk_step(unsigned lane_off, int step) {
  return (lane_off ^ ((step & 3) * 32)) + (step >> 2) * 128;
}

// Tile shape of one variant. Each warp owns MT m16 tiles (16 * MT consecutive query rows),
// so every K/V fragment it loads from shared memory feeds MT pairs of MMAs.
template <int DQK_, int DV_, int WARPS_, int MT_, int BC_, int STAGES_, bool Q_IN_REGS_>
struct TcTile {
  static constexpr int DQK = DQK_, DV = DV_, WARPS = WARPS_, MT = MT_, BC = BC_, STAGES = STAGES_;
  static constexpr bool Q_IN_REGS = Q_IN_REGS_;  // else Q fragments are re-read per k-step
  static constexpr int WR = 16 * MT;              // query rows per warp
  static constexpr int BR = WR * WARPS;           // query rows per block
  static constexpr int THREADS = 32 * WARPS;
  static constexpr int MIN_BLOCKS = WARPS < 8 ? 8 / WARPS : 1;  // 8 warps an SM: <= 255 registers
  static constexpr int STAGE_ELEMS = BC * (DQK + DV);  // one ring stage: K tile, then V tile
  // Once its fragments are in registers, Q's tile is dead: it borrows the last stage,
  // which the first prefetch of the key loop is the first to overwrite.
  static constexpr bool Q_IN_STAGE = Q_IN_REGS && BR * DQK <= STAGE_ELEMS;
  static_assert(DQK % 64 == 0 && DV % 64 == 0 && BC % 16 == 0, "tile shape");
};

// GENERAL: the per-element score path (masks, softcap, any scale). Otherwise scale > 0 and
// the only cut keys are those outside each row's causal/window range or past Skv.
template <class T, class Tile, bool GENERAL>
__device__ __forceinline__ void flash_fwd_tc(const FlashFwdParams& p) {
  constexpr int DQK = Tile::DQK, DV = Tile::DV, MT = Tile::MT, BC = Tile::BC;
  constexpr int STAGES = Tile::STAGES, WR = Tile::WR, BR = Tile::BR, NT = 32 * Tile::WARPS;
  constexpr int STAGE_ELEMS = Tile::STAGE_ELEMS;
  constexpr bool Q_IN_REGS = Tile::Q_IN_REGS;
  constexpr int KSTEPS = DQK / 16;  // k16 steps of Q·K^T
  constexpr int STILES = BC / 8;    // n8 score tiles per m16 tile
  constexpr int OTILES = DV / 8;    // n8 output tiles per m16 tile

  T* stages = reinterpret_cast<T*>(dyn_smem);
  T* sq = Tile::Q_IN_STAGE ? stages + (STAGES - 1) * STAGE_ELEMS : stages + STAGES * STAGE_ELEMS;

  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  __shared__ SeqTile tile_info;
  __shared__ int tile_found;
  if (!resolve_tile<BR>(p, tile_info, tile_found)) return;
  const TileRef st{tile_info};
  const int m0 = st.m0();
  const int h = blockIdx.y;
  const int hk = h / (p.heads_q / p.heads_kv);
  const int rows = min(BR, st.seq_q() - m0);
  const bool vector_io = p.vector_io != 0;

  const T* gq = static_cast<const T*>(p.q) + st.b() * p.q_batch_stride + h * p.q_head_stride +
                (st.q_tok0() + m0) * p.q_seq_stride;

  int tile_begin, tile_end;
  key_tile_range<BC>(st.seq_kv(), st.window(p), m0, m0 + rows - 1, tile_begin, tile_end);

  auto load_kv = [&](int stage, int tile) {
    const int n0 = tile * BC, b = st.b(), seq_kv = st.seq_kv();
    T* sk = stages + stage * STAGE_ELEMS;
    if (p.block_table != nullptr) {  // paged: the batch strides step pages
      load_paged_tile<T, BC, DQK, NT>(sk, p, static_cast<const T*>(p.k) + hk * p.k_head_stride,
                                      p.k_batch_stride, p.k_seq_stride, b, n0, seq_kv - n0, p.dim_qk, tid);
      load_paged_tile<T, BC, DV, NT>(sk + BC * DQK, p, static_cast<const T*>(p.v) + hk * p.v_head_stride,
                                     p.v_batch_stride, p.v_seq_stride, b, n0, seq_kv - n0, p.dim_v, tid);
      return;
    }
    // Recomputed from the parameters each time: cheaper than two 64-bit registers held
    // through the key loop.
    const T* gk = static_cast<const T*>(p.k) + b * p.k_batch_stride + hk * p.k_head_stride +
                  (st.k_tok0() + n0) * p.k_seq_stride;
    const T* gv = static_cast<const T*>(p.v) + b * p.v_batch_stride + hk * p.v_head_stride +
                  (st.k_tok0() + n0) * p.v_seq_stride;
    load_tile<T, BC, DQK, NT>(sk, gk, p.k_seq_stride, seq_kv - n0, p.dim_qk, vector_io, tid);
    load_tile<T, BC, DV, NT>(sk + BC * DQK, gv, p.v_seq_stride, seq_kv - n0, p.dim_v, vector_io, tid);
  };

  // This thread's accumulator rows: my_row + 16 * mt + 8 * r for m16 tile mt, half r.
  const int warp_row0 = m0 + warp * WR;
  const int my_row = warp_row0 + (lane >> 2);
  float acc[MT][OTILES][4];
  float row_max[MT][2], row_sum[MT][2];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
    for (int t = 0; t < OTILES; ++t) acc[mt][t][0] = acc[mt][t][1] = acc[mt][t][2] = acc[mt][t][3] = 0.f;
    row_max[mt][0] = row_max[mt][1] = neg_inf();
    row_sum[mt][0] = row_sum[mt][1] = 0.f;
  }
  // The exponent's multiplier: scores are raw dot products in plain kernels, base-2
  // logits in general ones.
  const float mul = GENERAL ? 1.f : p.scale * kLog2e;

  if (tile_begin < tile_end) {
    load_tile<T, BR, DQK, NT>(sq, gq, p.q_seq_stride, rows, p.dim_qk, vector_io, tid);
#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) {
      if (tile_begin + s < tile_end) load_kv(s, tile_begin + s);
      cp_async_commit();
    }
    cp_async_wait<STAGES - 2>();
    __syncthreads();

    // ldmatrix x4 lane offsets. Q (A operand) and V (B of P·V, transposed): lanes 0-7 /
    // 8-15 / 16-23 / 24-31 address rows 0-7 / 8-15 / 0-7 / 8-15 at chunks 2s / 2s / 2s+1 /
    // 2s+1. K (B of Q·K^T): keys 0-7 / 0-7 / 8-15 / 8-15 at chunks 2s / 2s+1 / 2s / 2s+1,
    // so each n8 tile's two B registers come out as a consecutive pair, as mma wants them.
    const int frag_row = (lane & 7) + (((lane >> 3) & 1) << 3);
    const unsigned q_off = lane_offset<DQK>(frag_row, lane >> 4);
    const unsigned k_off = lane_offset<DQK>((lane & 7) + ((lane >> 4) << 3), (lane >> 3) & 1);
    const unsigned v_off = lane_offset<DV>(frag_row, lane >> 4);  // = q_off when Dqk == Dv
    const unsigned stages_addr = smem_u32(stages);
    const unsigned sq_warp_addr = smem_u32(sq) + warp * WR * DQK * 2;
    auto q_frag = [&](unsigned (&a)[4], int mt, int ks) {
      ldmatrix_x4(a, sq_warp_addr + chunk_step(q_off, ks) + mt * 16 * DQK * 2);
    };

    // Q fragments kept in registers for the whole key loop, or (where they would not fit
    // beside the accumulators) re-read from shared memory at each k-step.
    unsigned qf[MT][Q_IN_REGS ? KSTEPS : 1][4];
    if constexpr (Q_IN_REGS) {
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int ks = 0; ks < KSTEPS; ++ks) q_frag(qf[mt][ks], mt, ks);
    }
    if constexpr (Tile::Q_IN_STAGE) __syncthreads();  // all Q reads done before its stage refills

    for (int t = tile_begin; t < tile_end; ++t) {
      const int i = t - tile_begin;
      if (i > 0) {
        cp_async_wait<STAGES - 2>();
        __syncthreads();  // tile t landed; everyone is done with the stage refilled next
      }
      if (t + STAGES - 1 < tile_end) load_kv((i + STAGES - 1) % STAGES, t + STAGES - 1);
      cp_async_commit();
      // A general kernel's warp computes only on the tiles its own rows see (as the sm_90a
      // kernel's warpgroups do). Not the plain ones: at their 255-register cap the check cost
      // the d128 kernel 32 more bytes of spills.
      if (GENERAL && __all_sync(0xffffffffu, !rows_see_tile<BC>(st, p, warp_row0, WR, t))) continue;

      const unsigned sk_addr = stages_addr + (i % STAGES) * STAGE_ELEMS * 2;
      const unsigned sv_addr = sk_addr + BC * DQK * 2;
      const int n0 = t * BC;

      // S = Q K^T for this warp's rows and the tile's BC keys.
      float s[MT][STILES][4];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int n = 0; n < STILES; ++n) s[mt][n][0] = s[mt][n][1] = s[mt][n][2] = s[mt][n][3] = 0.f;
#pragma unroll
      for (int ks = 0; ks < KSTEPS; ++ks) {
        const int qk = Q_IN_REGS ? ks : 0;  // the register slot of this k-step's Q fragments
        if constexpr (!Q_IN_REGS) {
#pragma unroll
          for (int mt = 0; mt < MT; ++mt) q_frag(qf[mt][0], mt, ks);
        }
#pragma unroll
        for (int np = 0; np < BC / 16; ++np) {
          unsigned kb[4];
          ldmatrix_x4(kb, sk_addr + chunk_step(k_off, ks) + np * 16 * DQK * 2);
#pragma unroll
          for (int mt = 0; mt < MT; ++mt) {
            mma_16816<T>(s[mt][2 * np], qf[mt][qk], kb[0], kb[1]);
            mma_16816<T>(s[mt][2 * np + 1], qf[mt][qk], kb[2], kb[3]);
          }
        }
      }

      // General kernels (mask, softcap or scale <= 0) turn every score into a base-2 logit.
      // Plain kernels keep raw dot products, folding scale * log2 e into the exponent's FFMA.
      // Both cut the keys outside each row's range, on the tiles that straddle an edge
      // (causal/window diagonal, Skv end).
      const int seq_kv = st.seq_kv();
      const KeyWindow win = st.window(p);
      if constexpr (GENERAL) {
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
          general_scores<STILES>(&s[mt][0][0], p, st.b(), h, my_row + 16 * mt, st.seq_q(), n0 + 2 * (lane & 3), seq_kv);
      }
      if (n0 + BC > seq_kv || n0 < first_visible_key(win, warp_row0 + WR - 1) ||
          n0 + BC - 1 > last_visible_key(win, warp_row0)) {
        const int col0 = n0 + 2 * (lane & 3);  // key of s[.][0][0]
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
          for (int r = 0; r < 2; ++r) {
            const int row = my_row + 16 * mt + 8 * r;
            const int lo = clamp_to_tile<BC>(first_visible_key(win, row) - col0);
            const int hi = clamp_to_tile<BC>(
                min(last_visible_key(win, row), (long long)seq_kv - 1) - col0);
#pragma unroll
            for (int n = 0; n < STILES; ++n)
#pragma unroll
              for (int c = 0; c < 2; ++c)
                if (n * 8 + c < lo || n * 8 + c > hi) s[mt][n][2 * r + c] = neg_inf();
          }
      }

      // Online softmax; each row is spread over the 4 lanes of a quad.
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          float mx = neg_inf();
#pragma unroll
          for (int n = 0; n < STILES; ++n) mx = fmaxf(mx, fmaxf(s[mt][n][2 * r], s[mt][n][2 * r + 1]));
          mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
          mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
          mx = fmaxf(row_max[mt][r], mx * mul);
          const float sub = exp_subtrahend(mx);
          const float alpha = exp2_ftz(row_max[mt][r] - sub);
          row_max[mt][r] = mx;
          float sum = 0.f;
#pragma unroll
          for (int n = 0; n < STILES; ++n) {
            s[mt][n][2 * r] = exp2_ftz(fmaf(s[mt][n][2 * r], mul, -sub));
            s[mt][n][2 * r + 1] = exp2_ftz(fmaf(s[mt][n][2 * r + 1], mul, -sub));
            sum += s[mt][n][2 * r] + s[mt][n][2 * r + 1];
          }
          row_sum[mt][r] = row_sum[mt][r] * alpha + sum;
#pragma unroll
          for (int d = 0; d < OTILES; ++d) {
            acc[mt][d][2 * r] *= alpha;
            acc[mt][d][2 * r + 1] *= alpha;
          }
        }

      // O += P V: the accumulator layout of two n8 score tiles is the A layout of one k16.
#pragma unroll
      for (int kk = 0; kk < BC / 16; ++kk) {
        unsigned pa[MT][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) scores_as_a_operand<T>(s[mt][2 * kk], pa[mt]);
#pragma unroll
        for (int dp = 0; dp < DV / 16; ++dp) {
          unsigned vb[4];
          ldmatrix_x4_trans(vb, sv_addr + chunk_step(v_off, dp) + kk * 16 * DV * 2);
#pragma unroll
          for (int mt = 0; mt < MT; ++mt) {
            mma_16816<T>(acc[mt][2 * dp], pa[mt], vb[0], vb[1]);
            mma_16816<T>(acc[mt][2 * dp + 1], pa[mt], vb[2], vb[3]);
          }
        }
      }
    }
  }

  // Finish: quad-reduce the row sums (fixed xor order), normalise, store.
  const int seq_q = st.seq_q(), b = st.b();
  const long long q_tok0 = st.q_tok0();
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      float sum = row_sum[mt][r];
      sum += __shfl_xor_sync(0xffffffffu, sum, 1);
      sum += __shfl_xor_sync(0xffffffffu, sum, 2);
      const int row = my_row + 16 * mt + 8 * r;
      if (row >= seq_q) continue;
      const RowResult res = finish_row(p, h, row_max[mt][r], sum);
      T* go = static_cast<T*>(p.o) + b * p.o_batch_stride + h * p.o_head_stride +
              (q_tok0 + row) * p.o_seq_stride;
#pragma unroll
      for (int d = 0; d < OTILES; ++d) {
        const int col = d * 8 + 2 * (lane & 3);
        const float lo = res.inv == 0.f ? 0.f : acc[mt][d][2 * r] * res.inv;
        const float hi = res.inv == 0.f ? 0.f : acc[mt][d][2 * r + 1] * res.inv;
        if (vector_io && col + 1 < p.dim_v) {
          *reinterpret_cast<unsigned*>(go + col) = pack2<T>(lo, hi);
        } else {
          if (col < p.dim_v) go[col] = from_float<T>(lo);
          if (col + 1 < p.dim_v) go[col + 1] = from_float<T>(hi);
        }
      }
      if (p.lse != nullptr && (lane & 3) == 0) store_lse(p, b, q_tok0, h, row, res.lse);
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
  __shared__ SeqTile tile_info;
  __shared__ int tile_found;
  if (!resolve_tile<F32_WARPS>(p, tile_info, tile_found)) return;
  const SeqTile st = tile_info;  // the SIMT kernel has registers to spare
  const int m0 = st.m0, seq_q = st.seq_q, seq_kv = st.seq_kv;
  const int h = blockIdx.y, b = st.b;
  const int hk = h / (p.heads_q / p.heads_kv);
  const int row = m0 + warp;
  const KeyWindow win{st.diag_offset, p.window_left, p.window_right};

  const bool paged = p.block_table != nullptr;  // then the batch strides step pages
  const float* gk = static_cast<const float*>(p.k) + (paged ? 0 : b * p.k_batch_stride + st.k_tok0 * p.k_seq_stride) +
                    hk * p.k_head_stride;
  const float* gv = static_cast<const float*>(p.v) + (paged ? 0 : b * p.v_batch_stride + st.k_tok0 * p.v_seq_stride) +
                    hk * p.v_head_stride;
  // Key j's row of K or V (null: a page outside the pool, read as zeros).
  auto key_row = [&](const float* g, long long page_stride, long long seq_stride, int j) -> const float* {
    return paged ? paged_row(p, g, page_stride, seq_stride, b, j) : g + j * seq_stride;
  };
  if (row < seq_q) {
    const float* gq = static_cast<const float*>(p.q) + b * p.q_batch_stride +
                      h * p.q_head_stride + (st.q_tok0 + row) * p.q_seq_stride;
    for (int d = lane; d < p.dim_qk; d += 32) sq[warp * p.dim_qk + d] = gq[d];
  }

  int tile_begin, tile_end;
  key_tile_range<32>(seq_kv, win, m0, min(m0 + F32_WARPS, seq_q) - 1, tile_begin, tile_end);

  float acc[F32_MAX_DV / 32];
#pragma unroll
  for (int c = 0; c < F32_MAX_DV / 32; ++c) acc[c] = 0.f;
  float row_max = neg_inf(), row_sum = 0.f;

  for (int t = tile_begin; t < tile_end; ++t) {
    const int n0 = t * 32;
    __syncthreads();  // previous tile fully consumed (and Q staged, on the first pass)
    for (int x = tid; x < 32 * p.dim_qk; x += 32 * F32_WARPS) {
      const int j = x / p.dim_qk, d = x % p.dim_qk;
      const float* g = n0 + j < seq_kv ? key_row(gk, p.k_batch_stride, p.k_seq_stride, n0 + j) : nullptr;
      sk[j * k_pitch + d] = g != nullptr ? g[d] : 0.f;
    }
    for (int x = tid; x < 32 * p.dim_v; x += 32 * F32_WARPS) {
      const int j = x / p.dim_v, d = x % p.dim_v;
      const float* g = n0 + j < seq_kv ? key_row(gv, p.v_batch_stride, p.v_seq_stride, n0 + j) : nullptr;
      sv[j * p.dim_v + d] = g != nullptr ? g[d] : 0.f;
    }
    __syncthreads();
    if (row >= seq_q) continue;

    float dot = 0.f;
    for (int d = 0; d < p.dim_qk; ++d) dot = fmaf(sq[warp * p.dim_qk + d], sk[lane * k_pitch + d], dot);
    const float x = score_log2(p, seq_q, seq_kv, win, dot, b, h, row, n0 + lane);

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

  if (row >= seq_q) return;
  const RowResult res = finish_row(p, h, row_max, row_sum);
  float* go = static_cast<float*>(p.o) + b * p.o_batch_stride + h * p.o_head_stride +
              (st.q_tok0 + row) * p.o_seq_stride;
#pragma unroll
  for (int c = 0; c < F32_MAX_DV / 32; ++c) {
    const int d = lane + 32 * c;
    if (d < p.dim_v) go[d] = res.inv == 0.f ? 0.f : acc[c] * res.inv;
  }
  if (p.lse != nullptr && lane == 0) store_lse(p, b, st.q_tok0, h, row, res.lse);
}

}  // namespace ptxattn

// ---- entry points --------------------------------------------------------------------
// FLASH_FWD_TC(name, dtype, general, TcTile<Dqk, Dv, warps, m16 tiles a warp, keys a tile,
// stages, Q in registers> arguments).
#define FLASH_FWD_TC(NAME, T, GENERAL, ...)                                                \
  extern "C" __global__ void __launch_bounds__(ptxattn::TcTile<__VA_ARGS__>::THREADS,      \
                                               ptxattn::TcTile<__VA_ARGS__>::MIN_BLOCKS)   \
      NAME(const ptxattn::FlashFwdParams p) {                                             \
    ptxattn::flash_fwd_tc<T, ptxattn::TcTile<__VA_ARGS__>, GENERAL>(p);                   \
  }

// ---- variants --------------------------------------------------------------------------
// The tiles are the flash_fwd table of cu/variants.json; scripts/build_ptx.py compiles this
// file with variants.inc made from it, one FLASH_FWD_TC line a kernel. Why those tiles:
// plain-score kernels: 4 warps of 32 query rows (two m16 tiles, so each K/V fragment feeds
// four MMAs), 2 blocks an SM at <= 255 registers. Where Q's fragments would not fit beside
// the 32 x Dv accumulators and the scores, they are re-read from shared memory per k-step.
// ptxas (sm_90, from the PTX): d64 244 registers, d192_128 254, d256 252; general d64 254,
// d128 222, d192_128 213, d256 249; no spills. d128 takes 64 keys a tile with Q re-read
// although it spills a little: scripts/sdpa_tune.py on the H200 (kernels launched directly,
// bf16, TFLOP/s) measured it against the 32-key tile at 340 vs 322 (B4 H32 S4096), 310 vs
// 296 (same, causal), 326 vs 310 (B2 Hq32 Hkv8 S8192 causal), 336 vs 318 (B1 Hq32 Hkv8
// S16384 causal); FA2 in the same run: 352, 314, 330, 338.
// General kernels keep the 16-rows-a-warp tiles: the per-element score path (mask loads,
// softcap) needs the registers.
// H200, bf16, scripts/bench.py --suite prefill (2026-11-29, one run), TFLOP/s ours / FA2:
//   B4 H32 S4096 D128 302 / 338, causal 269 / 302; B2 Hq32 Hkv8 S8192 D128 causal
//   292 / 325; B8 H16 S2048 D64 215 / 245; B1 Hq32 Hkv8 S16384 D128 causal 311 / 332
//   (0.88-0.94x; the 16-row tiles before ran 0.70-0.80x). scripts/sdpa_tune.py times
//   candidate tiles side by side.
#include "variants.inc"

extern "C" __global__ void __launch_bounds__(32 * ptxattn::F32_WARPS)
    flash_fwd_f32(const ptxattn::FlashFwdParams p) {
  ptxattn::flash_fwd_simt_f32(p);
}
