// Scaled dot-product attention forward (FlashAttention-2 style).
//
//   q [B, Hq, Sq, Dqk], k [B, Hkv, Skv, Dqk], v [B, Hkv, Skv, Dv] -> o [B, Hq, Sq, Dv]
//   lse [B, Hq, Sq] fp32 (natural log), optional.
//   Serving batches (ops/ragged.py): packed q [Nq, Hq, Dqk] / o / lse by cu_seqlens_q, keys
//   packed by cu_seqlens_k or paged through a block table (flash_fwd_common.cuh).
//
// Grid: x = query block (a serving batch's tiles), y = query head, z = batch; a dense grid with
// heavy_first is laid out otherwise (find_tile).
// f16/bf16: the tensor-core kernel of flash_fwd_tc.cuh (mma.sync m16n8k16, fp32 accumulate);
// flash_fwd_fp8.cu instantiates it for fp8 K/V. f32: a SIMT kernel with the same semantics in
// exact fp32.
// Score semantics (softcap, causal/window, masks, -inf handling): attention_common.cuh.
#include "flash_fwd_tc.cuh"

namespace ptxattn {

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
  float x = apply_softcap</*EXACT=*/true>(dot * p.scale, p.softcap) * kLog2e;
  if (p.mask_kind != MASK_NONE) x += mask_bias_log2(p.mask_kind, p.mask, mask_offset(p, b, h, i, j));
  return x;
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
  const int h = st.h, b = st.b;
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
  block_key_tile_range<F32_WARPS, 32>(seq_kv, win, m0, seq_q, tile_begin, tile_end);

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
  const float inv = row_inverse(p, h, row_max, row_sum);
  float* go = static_cast<float*>(p.o) + b * p.o_batch_stride + h * p.o_head_stride +
              (st.q_tok0 + row) * p.o_seq_stride;
#pragma unroll
  for (int c = 0; c < F32_MAX_DV / 32; ++c) {
    const int d = lane + 32 * c;
    if (d < p.dim_v) go[d] = inv == 0.f ? 0.f : acc[c] * inv;
  }
  if (p.lse != nullptr && lane == 0) store_lse(p, b, st.q_tok0, h, row, row_lse(row_max, row_sum));
}

}  // namespace ptxattn

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
