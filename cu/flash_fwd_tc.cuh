// The tensor-core sdpa kernel (mma.sync m16n8k16, f16/bf16, fp32 accumulate) that
// flash_fwd.cu instantiates for f16/bf16 K/V and flash_fwd_fp8.cu for fp8 K/V (serving calls):
// each warp owns 16 or 32 query rows (one or two m16 tiles) whose Q fragments stay in registers
// or are re-read from shared memory; K/V tiles stream through a ring of STAGES buffers
// (cp.async; fp8: converted to the input dtype as they load, flash_fwd_common.cuh); P is
// rounded to the input dtype in registers and is directly the A operand of P·V. Two kernels a
// head dim: plain scores (no mask/softcap, scale > 0: the scale folds into the exponent, only
// edge tiles are cut) and general (per-element score path).
#pragma once
#include "flash_fwd_common.cuh"

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

extern __shared__ __align__(128) unsigned char dyn_smem[];

// ---- tensor-core kernel (f16 / bf16) ----------------------------------------------
// ldmatrix addressing in a swizzled [rows][COLS] b16 tile. A lane reads the 16-byte chunk
// 2 * step + sel of `row`; every row an ldmatrix touches has row & 7 == lane & 7. The
// swizzle only flips chunk bits 0-2, so the byte offset is lane_offset(row, sel) with
// bits 5-6 XOR-ed by step & 3 (chunk_step) and (step >> 2) * 128 added: one register a
// lane pattern instead of four. (lane_offset(row, c) is the byte offset of any chunk c of row.)
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
// the only cut keys are those outside each row's causal/window range or past Skv. FP8: K and V
// are fp8 (kv_fp8) with their scales, Dqk = Dv = the tile's (the host checks).
template <class T, class Tile, bool GENERAL, bool FP8>
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
  // fp8: each stage's keys' K and V scales.
  __shared__ __align__(16) float key_scales[STAGES][2][FP8 ? BC : 1];
  const TileRef st{tile_info};
  const int m0 = st.m0(), h = st.h();
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
    if constexpr (FP8) {  // packed or paged alike
      const unsigned k_addr = smem_u32(sk), v_addr = k_addr + BC * DQK * 2;
      load_fp8_tile<T, BC, DQK, NT>(p, fp8_rows<false>(p, hk), b, st.k_tok0(), n0, seq_kv - n0,
                                    [&](int r, int c) { return k_addr + lane_offset<DQK>(r, c); },
                                    key_scales[stage][0]);
      load_fp8_tile<T, BC, DV, NT>(p, fp8_rows<true>(p, hk), b, st.k_tok0(), n0, seq_kv - n0,
                                   [&](int r, int c) { return v_addr + lane_offset<DV>(r, c); },
                                   key_scales[stage][1]);
      return;
    }
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
  const float mul = softmax_mul<GENERAL>(p);

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
      if constexpr (FP8) {
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) scale_by_key<STILES>(&s[mt][0][0], key_scales[i % STAGES][0], lane);
      }
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

      if constexpr (FP8) {  // the row sums are taken: V's scales go into P
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) scale_by_key<STILES>(&s[mt][0][0], key_scales[i % STAGES][1], lane);
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
      const float sum = quad_sum(row_sum[mt][r]);
      const int row = my_row + 16 * mt + 8 * r;
      if (row >= seq_q) continue;
      const float inv = row_inverse(p, h, row_max[mt][r], sum);
      T* go = static_cast<T*>(p.o) + b * p.o_batch_stride + h * p.o_head_stride +
              (q_tok0 + row) * p.o_seq_stride;
#pragma unroll
      for (int d = 0; d < OTILES; ++d) {
        const int col = d * 8 + 2 * (lane & 3);
        const float lo = inv == 0.f ? 0.f : acc[mt][d][2 * r] * inv;
        const float hi = inv == 0.f ? 0.f : acc[mt][d][2 * r + 1] * inv;
        if (vector_io && col + 1 < p.dim_v) {
          *reinterpret_cast<unsigned*>(go + col) = pack2<T>(lo, hi);
        } else {
          if (col < p.dim_v) go[col] = from_float<T>(lo);
          if (col + 1 < p.dim_v) go[col + 1] = from_float<T>(hi);
        }
      }
      if (p.lse != nullptr && (lane & 3) == 0) store_lse(p, b, q_tok0, h, row, row_lse(row_max[mt][r], sum));
    }
}

}  // namespace ptxattn

// ---- entry points --------------------------------------------------------------------
// FLASH_FWD_TC(name, dtype, general, fp8, TcTile<Dqk, Dv, warps, m16 tiles a warp, keys a
// tile, stages, Q in registers> arguments).
#define FLASH_FWD_TC(NAME, T, GENERAL, FP8, ...)                                           \
  extern "C" __global__ void __launch_bounds__(ptxattn::TcTile<__VA_ARGS__>::THREADS,      \
                                               ptxattn::TcTile<__VA_ARGS__>::MIN_BLOCKS)   \
      NAME(const ptxattn::FlashFwdParams p) {                                             \
    ptxattn::flash_fwd_tc<T, ptxattn::TcTile<__VA_ARGS__>, GENERAL, FP8>(p);              \
  }
