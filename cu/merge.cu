// Merge attention states computed over disjoint key sets, by their LSE, in a fixed order.
//
//   o_in    [N states] x [B, H, S, D]   each state's o, normalised by its own softmax sum
//   lse_in  [N states] x [B, H, S]      natural log; -inf for a state that saw no key
//   sinks   [H] f32 or null             a virtual key's logit: joins the denominator only
//   o_out   [B, H, S, D], lse_out [B, H, S] (or null)
//
//   lse = log sum_i exp(lse_i);  o = sum_i exp(lse_i - lse) o_i  (then * 1 / (1 + e^(sink - lse)))
//
// Serves the split-KV combine of decode.cu (o_in = the f32 partials; launched programmatically
// on sm_90, hence the wait_for_previous_grid, a no-op for merge_states' plain launches) and
// merge_states. A
// state whose weight is zero (lse_i = -inf, or exp underflows) is skipped by a select, never
// multiplied, so garbage or NaN in its o_i cannot leak. lse_out excludes the sink (see
// runtime/reference.py); a row with no key at all gives o = 0, lse = -inf.
//
// merge_<in>_<out>: one 128-thread CTA per (b, h, s) row (1-D grid of rows). Every warp finds
// the row's lse over all states; warp w sums states w, w + 4, ... (lanes own 4 consecutive d
// each; its first 8 states' loads issued together with the lse pass's), and the four warp sums
// are added in warp order through shared memory. Many states (a long single-sequence
// split-KV) stay cheap.
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

constexpr int kThreads = 128;
constexpr int kWarps = kThreads / 32;
constexpr int kVec = 4;    // consecutive d per lane
constexpr int kAhead = 8;  // states a warp loads at once

// The same value in every lane: reduce down to lane 0, then broadcast.
__device__ __forceinline__ float warp_max(float x) {
  for (int step = 16; step > 0; step /= 2) x = fmaxf(x, __shfl_down_sync(0xffffffffu, x, step));
  return __shfl_sync(0xffffffffu, x, 0);
}
__device__ __forceinline__ float warp_sum(float x) {
  for (int step = 16; step > 0; step /= 2) x += __shfl_down_sync(0xffffffffu, x, step);
  return __shfl_sync(0xffffffffu, x, 0);
}

// One state's lse and this lane's kVec values of its o.
struct StateSlice {
  float lse;
  float o[kVec];
};

// acc += weight * o, the weight exp(lse_i - lse); a zero-weight state is selected away,
// never multiplied (its o may be NaN).
__device__ __forceinline__ void accumulate(float (&acc)[kVec], const StateSlice& x, float lse) {
  const float w = x.lse == neg_inf() ? 0.f : expf(x.lse - lse);
#pragma unroll
  for (int v = 0; v < kVec; ++v) acc[v] += w > 0.f ? w * x.o[v] : 0.f;
}

template <class TIn, class TOut>
__device__ __forceinline__ void merge_row(const MergeParams& p) {
  __shared__ float warp_part[kWarps][32 * kVec];
  // As decode's combine it is launched programmatically: the partials are not ready before.
  wait_for_previous_grid();
  const long long row = blockIdx.x;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int s = int(row % p.seq), h = int(row / p.seq % p.heads), b = int(row / p.seq / p.heads);
  const float* lse_in = p.lse_in + b * p.lse_in_stride_b + h * p.lse_in_stride_h + s * p.lse_in_stride_s;
  const TIn* o_in = static_cast<const TIn*>(p.o_in) + b * p.o_in_stride_b + h * p.o_in_stride_h + s * p.o_in_stride_s;

  TOut* o_out = static_cast<TOut*>(p.o_out) + b * p.o_out_stride_b + h * p.o_out_stride_h + s * p.o_out_stride_s;
  float lse = 0.f, out_scale = 0.f;
  for (int d0 = 0; d0 < max(p.dim, 1); d0 += 32 * kVec) {  // once even for dim 0: the lse
    const int d = d0 + lane * kVec;
    auto load = [&](int i) {
      StateSlice x;
      x.lse = lse_in[i * p.lse_in_stride_state];
#pragma unroll
      for (int v = 0; v < kVec; ++v) x.o[v] = d + v < p.dim ? to_float(o_in[i * p.o_in_stride_state + d + v]) : 0.f;
      return x;
    };
    // This warp's states are w, w + 4, ..., taken kAhead at a time with their loads issued
    // together; the first round's go out before the row's lse (they do not depend on it), so
    // one memory round trip serves a combine of up to kAhead * kWarps states.
    float acc[kVec] = {};
    for (int first = warp; first < max(p.num_states, 1); first += kAhead * kWarps) {
      StateSlice ahead[kAhead];
#pragma unroll
      for (int k = 0; k < kAhead; ++k)
        if (first + k * kWarps < p.num_states) ahead[k] = load(first + k * kWarps);
      if (d0 == 0 && first == warp) {
        // The row's lse: an online (max, sum) over each lane's states, then across the lanes.
        float m = neg_inf(), sum = 0.f;
        for (int i = lane; i < p.num_states; i += 32) {
          const float x = lse_in[i * p.lse_in_stride_state];
          if (x > m) {
            sum = (m == neg_inf() ? 0.f : sum * expf(m - x)) + 1.f;
            m = x;
          } else if (x != neg_inf()) {
            sum += expf(x - m);
          }
        }
        const float m_all = warp_max(m);
        sum = warp_sum(m == neg_inf() ? 0.f : sum * expf(m - m_all));
        lse = sum > 0.f ? m_all + logf(sum) : neg_inf();
        out_scale = sink_scale(lse, p.sinks, h);
      }
#pragma unroll
      for (int k = 0; k < kAhead; ++k)
        if (first + k * kWarps < p.num_states) accumulate(acc, ahead[k], lse);
    }
#pragma unroll
    for (int v = 0; v < kVec; ++v) warp_part[warp][lane * kVec + v] = acc[v];
    __syncthreads();
    if (warp == 0) {
#pragma unroll
      for (int v = 0; v < kVec; ++v) {
        if (d + v >= p.dim) continue;
        float total = 0.f;
        for (int w = 0; w < kWarps; ++w) total += warp_part[w][lane * kVec + v];
        o_out[d + v] = from_float<TOut>(total * out_scale);
      }
    }
    __syncthreads();
  }
  if (p.lse_out != nullptr && threadIdx.x == 0)
    p.lse_out[b * p.lse_out_stride_b + h * p.lse_out_stride_h + s * p.lse_out_stride_s] = lse;
}

}  // namespace merge
}  // namespace ptxattn

#define PTXATTN_MERGE_VARIANT(NAME, TIN, TOUT)                                       \
  extern "C" __global__ void __launch_bounds__(ptxattn::merge::kThreads)           \
      NAME(const ptxattn::merge::MergeParams p) {                                  \
    ptxattn::merge::merge_row<TIN, TOUT>(p);                                       \
  }

// One line a variant of the merge table of cu/variants.json, made by scripts/build_ptx.py.
#include "variants.inc"
