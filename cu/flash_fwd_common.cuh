// What every sdpa forward kernel shares (flash_fwd.cu: mma.sync for sm_80+, and
// flash_fwd_sm90.cu: wgmma for sm_90a): the parameter struct, the key range a block of
// query rows visits, and the finished row (normalisation, sinks, LSE).
#pragma once
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

// A key offset within a tile, clamped to [-1, BC] (both ends mean "past the tile").
template <int BC>
__device__ __forceinline__ int clamp_to_tile(long long key) {
  return static_cast<int>(max(-1LL, min(key, static_cast<long long>(BC))));
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

}  // namespace ptxattn
