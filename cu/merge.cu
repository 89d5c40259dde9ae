// Merge attention states computed over disjoint key sets, by their LSE, in a fixed order.
//
//   o_in    [N states] x [B, H, S, D]   each state's o, normalised by its own softmax sum
//   lse_in  [N states] x [B, H, S]      natural log; -inf for a state that saw no key
//   sinks   [H] f32 or null             a virtual key's logit: joins the denominator only
//   o_out   [B, H, S, D], lse_out [B, H, S] (or null)
//
//   lse = log sum_i exp(lse_i);  o = sum_i exp(lse_i - lse) o_i  (then * 1 / (1 + e^(sink - lse)))
//
// Serves the split-KV combine of decode.cu (o_in = the f32 partials) and merge_states. A
// state whose weight is zero (lse_i = -inf, or exp underflows) is skipped by a select, never
// multiplied, so garbage or NaN in its o_i cannot leak. lse_out excludes the sink (see
// runtime/reference.py); a row with no key at all gives o = 0, lse = -inf.
//
// merge_<in>_<out>: one warp per (b, h, s) row, 4 rows per 128-thread CTA, 1-D grid.
#include "attention_common.cuh"

namespace ptxattn {
namespace merge {

struct MergeParams {
  const void* o_in;
  const float* lse_in;
  const float* sinks;
  void* o_out;
  float* lse_out;
  long long o_in_stride_state, o_in_stride_b, o_in_stride_h, o_in_stride_s;
  long long lse_in_stride_state, lse_in_stride_b, lse_in_stride_h, lse_in_stride_s;
  long long o_out_stride_b, o_out_stride_h, o_out_stride_s;
  long long lse_out_stride_b, lse_out_stride_h, lse_out_stride_s;
  int batch, heads, seq, dim, num_states;
};

constexpr int kRowsPerCta = 4;

// The same value in every lane: reduce down to lane 0, then broadcast.
__device__ __forceinline__ float warp_max(float x) {
  for (int step = 16; step > 0; step /= 2) x = fmaxf(x, __shfl_down_sync(0xffffffffu, x, step));
  return __shfl_sync(0xffffffffu, x, 0);
}
__device__ __forceinline__ float warp_sum(float x) {
  for (int step = 16; step > 0; step /= 2) x += __shfl_down_sync(0xffffffffu, x, step);
  return __shfl_sync(0xffffffffu, x, 0);
}

template <class TIn, class TOut>
__device__ __forceinline__ void merge_rows(const MergeParams& p) {
  const long long row = static_cast<long long>(blockIdx.x) * kRowsPerCta + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (row >= static_cast<long long>(p.batch) * p.heads * p.seq) return;
  const int s = int(row % p.seq), h = int(row / p.seq % p.heads), b = int(row / p.seq / p.heads);
  const float* lse_in = p.lse_in + b * p.lse_in_stride_b + h * p.lse_in_stride_h + s * p.lse_in_stride_s;
  const TIn* o_in = static_cast<const TIn*>(p.o_in) + b * p.o_in_stride_b + h * p.o_in_stride_h + s * p.o_in_stride_s;

  float m = neg_inf();
  for (int i = lane; i < p.num_states; i += 32) m = fmaxf(m, lse_in[i * p.lse_in_stride_state]);
  m = warp_max(m);
  float sum = 0.f;
  for (int i = lane; i < p.num_states; i += 32) {
    const float x = lse_in[i * p.lse_in_stride_state];
    if (x != neg_inf()) sum += expf(x - m);
  }
  sum = warp_sum(sum);
  const float lse = sum > 0.f ? m + logf(sum) : neg_inf();
  float out_scale = lse == neg_inf() ? 0.f : 1.f;
  if (p.sinks != nullptr && lse != neg_inf()) out_scale = 1.f / (1.f + expf(p.sinks[h] - lse));

  TOut* o_out = static_cast<TOut*>(p.o_out) + b * p.o_out_stride_b + h * p.o_out_stride_h + s * p.o_out_stride_s;
  for (int d = lane; d < p.dim; d += 32) {
    float acc = 0.f;
    for (int i = 0; i < p.num_states; ++i) {
      const float x = lse_in[i * p.lse_in_stride_state];
      const float w = x == neg_inf() ? 0.f : expf(x - lse);
      if (w > 0.f) acc += w * to_float(o_in[i * p.o_in_stride_state + d]);
    }
    o_out[d] = from_float<TOut>(acc * out_scale);
  }
  if (p.lse_out != nullptr && lane == 0)
    p.lse_out[b * p.lse_out_stride_b + h * p.lse_out_stride_h + s * p.lse_out_stride_s] = lse;
}

}  // namespace merge
}  // namespace ptxattn

#define PTXATTN_MERGE_VARIANT(NAME, TIN, TOUT)                                        \
  extern "C" __global__ void __launch_bounds__(32 * ptxattn::merge::kRowsPerCta)    \
      NAME(const ptxattn::merge::MergeParams p) {                                   \
    ptxattn::merge::merge_rows<TIN, TOUT>(p);                                       \
  }

PTXATTN_MERGE_VARIANT(merge_f32_f16, float, __half)
PTXATTN_MERGE_VARIANT(merge_f32_bf16, float, __nv_bfloat16)
PTXATTN_MERGE_VARIANT(merge_f32_f32, float, float)
PTXATTN_MERGE_VARIANT(merge_f16_f16, __half, __half)
PTXATTN_MERGE_VARIANT(merge_bf16_bf16, __nv_bfloat16, __nv_bfloat16)
