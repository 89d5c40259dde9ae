// Softmax and log-softmax along one axis of a contiguous tensor, viewed as
// x[outer, length, inner] (the reduced axis in the middle). fp32 accumulation, output in the
// input dtype, every reduction in a fixed order (same bits run after run).
//
//   inner == 1, length <= 32 * kTile   softmax_rows_warp_<dt>
//       a group of `lanes_per_row` lanes (a power of two <= 32) per row, the row held in
//       registers; 128-thread CTAs, several rows per warp when rows are short.
//   inner == 1, longer rows            softmax_rows_block_<dt>
//       one CTA per row: the row held in registers when length <= blockDim.x * kTile,
//       otherwise an online (max, sum) pass, then a second read that writes.
//   inner > 1                          softmax_cols_<dt>
//       threadIdx.x walks columns c = o * inner + i (adjacent threads, adjacent addresses),
//       threadIdx.y splits the length; the (max, sum) partials are folded in order.
//
// Rows are read with 16-byte vectors when both row starts are 16-byte aligned (checked per
// row), else with coalesced scalar accesses. Special rows follow runtime/reference.py: a row of
// all -inf, or one holding NaN or +inf, comes out all NaN.
#include "common.cuh"

namespace ptxattn {
namespace softmax {

struct SoftmaxParams {
  const void* x;
  void* y;
  long long outer;
  long long length;
  long long inner;
  int log_softmax;    // 0: softmax, 1: log_softmax
  int lanes_per_row;  // softmax_rows_warp only
};

constexpr int kTile = 32;  // floats a thread keeps in registers on the register paths

__device__ __forceinline__ float neg_inf() { return __int_as_float(0xff800000); }
__device__ __forceinline__ float pos_inf() { return __int_as_float(0x7f800000); }
__device__ __forceinline__ float quiet_nan() { return __int_as_float(0x7fffffff); }

// ---- (max, sum of exp(x - max)) ----------------------------------------------------------
struct MaxSum {
  float m;  // running max (-inf while empty; fmaxf skips NaN, which reaches s instead)
  float s;  // sum of exp(x - m)
};

__device__ __forceinline__ MaxSum empty_max_sum() { return {neg_inf(), 0.f}; }

// s * exp(m_part - m); an empty part (m_part = -inf) adds 0, even when m is -inf too.
__device__ __forceinline__ float rescaled(MaxSum part, float m) {
  return part.m == neg_inf() ? 0.f : part.s * expf(part.m - m);
}

__device__ __forceinline__ MaxSum combine(MaxSum a, MaxSum b) {
  const float m = fmaxf(a.m, b.m);
  return {m, rescaled(a, m) + rescaled(b, m)};
}

__device__ __forceinline__ void accumulate(MaxSum& a, float x) {
  if (x > a.m) {
    a.s = a.s * expf(a.m - x) + 1.f;
    a.m = x;
  } else if (x != neg_inf()) {
    a.s += expf(x - a.m);  // a NaN x lands here and makes s NaN
  }
}

// What the write pass needs of a row.
struct RowStats {
  float m, inv_s, log_s;
};

__device__ __forceinline__ RowStats finalize(MaxSum a) {
  // A row holding +inf has no softmax: NaN throughout, like the reference.
  const float s = a.m == pos_inf() ? quiet_nan() : a.s;
  return {a.m, 1.f / s, logf(s)};
}

__device__ __forceinline__ float row_output(float x, const RowStats& r, int log_softmax) {
  // For an all -inf row x - m is NaN, so both forms give NaN.
  return log_softmax ? (x - r.m) - r.log_s : expf(x - r.m) * r.inv_s;
}

// ---- warp and block reductions (xor butterflies: every lane gets the same bits) --------------
__device__ __forceinline__ float shfl_xor(float v, int lane_mask) {
  return __shfl_xor_sync(0xffffffffu, v, lane_mask);
}
__device__ __forceinline__ MaxSum shfl_xor(MaxSum v, int lane_mask) {
  return {shfl_xor(v.m, lane_mask), shfl_xor(v.s, lane_mask)};
}

struct MaxOp {
  __device__ float operator()(float a, float b) const { return fmaxf(a, b); }
};
struct SumOp {
  __device__ float operator()(float a, float b) const { return a + b; }
};
struct CombineOp {
  __device__ MaxSum operator()(MaxSum a, MaxSum b) const { return combine(a, b); }
};

// Reduce over aligned groups of `width` lanes (a power of two <= 32); all 32 lanes must call.
template <class V, class Op>
__device__ __forceinline__ V group_reduce(V v, int width, Op op) {
  for (int mask = width >> 1; mask > 0; mask >>= 1) v = op(v, shfl_xor(v, mask));
  return v;
}

// Reduce over the CTA (blockDim.x a multiple of 32, <= 1024); every thread gets the result.
template <class V, class Op>
__device__ __forceinline__ V block_reduce(V v, Op op) {
  __shared__ V per_warp[32];
  v = group_reduce(v, 32, op);
  __syncthreads();  // per_warp may still be read by an earlier call
  if ((threadIdx.x & 31) == 0) per_warp[threadIdx.x >> 5] = v;
  __syncthreads();
  V total = per_warp[0];
  for (int w = 1; w < (int)(blockDim.x >> 5); ++w) total = op(total, per_warp[w]);
  return total;
}

// ---- row tiles in registers -----------------------------------------------------------------
// Thread t of n threads on a row keeps kTile values. On the vector path slot j holds element
// (j / V * n + t) * V + j % V (16-byte chunks); on the scalar path element j * n + t. Either
// way the tile covers elements [0, n * kTile); slots past the row hold -inf.
template <class T>
struct alignas(16) Pack {
  static constexpr int size = 16 / sizeof(T);
  T e[size];
};

template <class T>
__device__ __forceinline__ bool rows_aligned(const T* x_row, const T* y_row) {
  return ((reinterpret_cast<unsigned long long>(x_row) |
           reinterpret_cast<unsigned long long>(y_row)) & 15ull) == 0;
}

template <class T>
__device__ __forceinline__ void load_tile(const T* row, long long length, int t, int n,
                                          bool vectors, float (&v)[kTile]) {
  constexpr int V = Pack<T>::size;
  if (vectors) {  // length is a multiple of V here: a chunk is either whole or past the row
#pragma unroll
    for (int k = 0; k < kTile / V; ++k) {
      const int first = (k * n + t) * V;  // < n * kTile: fits an int
      if (first < length) {
        const Pack<T> p = *reinterpret_cast<const Pack<T>*>(row + first);
#pragma unroll
        for (int i = 0; i < V; ++i) v[k * V + i] = to_float(p.e[i]);
      } else {
#pragma unroll
        for (int i = 0; i < V; ++i) v[k * V + i] = neg_inf();
      }
    }
  } else {
#pragma unroll
    for (int j = 0; j < kTile; ++j) {
      const int e = j * n + t;
      v[j] = e < length ? to_float(row[e]) : neg_inf();
    }
  }
}

template <class T>
__device__ __forceinline__ void store_tile(T* row, long long length, int t, int n, bool vectors,
                                           const float (&v)[kTile], const RowStats& r,
                                           int log_softmax) {
  constexpr int V = Pack<T>::size;
  if (vectors) {
#pragma unroll
    for (int k = 0; k < kTile / V; ++k) {
      const int first = (k * n + t) * V;  // < n * kTile: fits an int
      if (first < length) {
        Pack<T> p;
#pragma unroll
        for (int i = 0; i < V; ++i) p.e[i] = from_float<T>(row_output(v[k * V + i], r, log_softmax));
        *reinterpret_cast<Pack<T>*>(row + first) = p;
      }
    }
  } else {
#pragma unroll
    for (int j = 0; j < kTile; ++j) {
      const int e = j * n + t;
      if (e < length) row[e] = from_float<T>(row_output(v[j], r, log_softmax));
    }
  }
}

__device__ __forceinline__ float tile_max(const float (&v)[kTile]) {
  float m = v[0];
#pragma unroll
  for (int j = 1; j < kTile; ++j) m = fmaxf(m, v[j]);
  return m;
}

// Sum of exp(v - m); -inf slots add 0 (also when m is -inf: an all -inf row sums to 0).
__device__ __forceinline__ float tile_sum_exp(const float (&v)[kTile], float m) {
  float s = 0.f;
#pragma unroll
  for (int j = 0; j < kTile; ++j) s += v[j] == neg_inf() ? 0.f : expf(v[j] - m);
  return s;
}

// ---- kernels --------------------------------------------------------------------------------
// x, y: [outer, length], contiguous. blockDim.x = 128; each group of p.lanes_per_row lanes
// takes one row (length <= lanes_per_row * kTile).
template <class T>
__device__ __forceinline__ void rows_warp(const SoftmaxParams& p) {
  const int width = p.lanes_per_row;
  const int t = threadIdx.x & (width - 1);
  const long long rows_per_cta = blockDim.x / width;
  for (long long first_row = blockIdx.x * rows_per_cta; first_row < p.outer;
       first_row += (long long)gridDim.x * rows_per_cta) {
    const long long row = first_row + threadIdx.x / width;
    const bool live = row < p.outer;  // dead groups still join the shuffles
    const T* x_row = static_cast<const T*>(p.x) + (live ? row : 0) * p.length;
    T* y_row = static_cast<T*>(p.y) + (live ? row : 0) * p.length;
    // A uniform choice within each group (one row), so the shuffles below stay converged.
    const bool vectors = p.length % Pack<T>::size == 0 && rows_aligned(x_row, y_row);

    float v[kTile];
    load_tile(x_row, live ? p.length : 0, t, width, vectors, v);
    const float m = group_reduce(tile_max(v), width, MaxOp());
    const float s = group_reduce(tile_sum_exp(v, m), width, SumOp());
    if (live) store_tile(y_row, p.length, t, width, vectors, v, finalize({m, s}), p.log_softmax);
  }
}

// x, y: [outer, length], contiguous. One CTA per row (grid-stride), blockDim.x a multiple of 32.
template <class T>
__device__ __forceinline__ void rows_block(const SoftmaxParams& p) {
  constexpr int V = Pack<T>::size;
  const int t = threadIdx.x, n = blockDim.x;
  for (long long row = blockIdx.x; row < p.outer; row += gridDim.x) {
    const T* x_row = static_cast<const T*>(p.x) + row * p.length;
    T* y_row = static_cast<T*>(p.y) + row * p.length;
    const bool vectors = p.length % V == 0 && rows_aligned(x_row, y_row);

    if (p.length <= (long long)n * kTile) {  // the whole row fits the CTA's registers
      float v[kTile];
      load_tile(x_row, p.length, t, n, vectors, v);
      const float m = block_reduce(tile_max(v), MaxOp());
      const float s = block_reduce(tile_sum_exp(v, m), SumOp());
      store_tile(y_row, p.length, t, n, vectors, v, finalize({m, s}), p.log_softmax);
      continue;
    }

    MaxSum part = empty_max_sum();
    if (vectors) {
      for (long long first = (long long)t * V; first < p.length; first += (long long)n * V) {
        const Pack<T> pk = *reinterpret_cast<const Pack<T>*>(x_row + first);
#pragma unroll
        for (int i = 0; i < V; ++i) accumulate(part, to_float(pk.e[i]));
      }
    } else {
      for (long long e = t; e < p.length; e += n) accumulate(part, to_float(x_row[e]));
    }
    const RowStats r = finalize(block_reduce(part, CombineOp()));

    if (vectors) {
      for (long long first = (long long)t * V; first < p.length; first += (long long)n * V) {
        const Pack<T> in = *reinterpret_cast<const Pack<T>*>(x_row + first);
        Pack<T> out;
#pragma unroll
        for (int i = 0; i < V; ++i) out.e[i] = from_float<T>(row_output(to_float(in.e[i]), r, p.log_softmax));
        *reinterpret_cast<Pack<T>*>(y_row + first) = out;
      }
    } else {
      for (long long e = t; e < p.length; e += n)
        y_row[e] = from_float<T>(row_output(to_float(x_row[e]), r, p.log_softmax));
    }
  }
}

// x, y: [outer, length, inner], contiguous, inner > 1. blockDim = (columns per CTA, length
// splits), blockDim.x * blockDim.y <= 256.
template <class T>
__device__ __forceinline__ void cols(const SoftmaxParams& p) {
  __shared__ MaxSum partials[256];
  const long long columns = p.outer * p.inner;
  const long long column_step = p.inner;  // distance between consecutive elements of a column
  for (long long first_column = (long long)blockIdx.x * blockDim.x; first_column < columns;
       first_column += (long long)gridDim.x * blockDim.x) {
    const long long c = first_column + threadIdx.x;
    const bool live = c < columns;
    const long long o = c / p.inner, i = c - o * p.inner;
    const long long start = o * p.length * p.inner + i;
    const T* x_col = static_cast<const T*>(p.x) + start;
    T* y_col = static_cast<T*>(p.y) + start;

    MaxSum part = empty_max_sum();
    if (live)
      for (long long j = threadIdx.y; j < p.length; j += blockDim.y)
        accumulate(part, to_float(x_col[j * column_step]));
    __syncthreads();  // the previous column block may still read partials
    partials[threadIdx.y * blockDim.x + threadIdx.x] = part;
    __syncthreads();
    MaxSum total = partials[threadIdx.x];
    for (int k = 1; k < (int)blockDim.y; ++k) total = combine(total, partials[k * blockDim.x + threadIdx.x]);
    const RowStats r = finalize(total);

    if (live)
      for (long long j = threadIdx.y; j < p.length; j += blockDim.y)
        y_col[j * column_step] = from_float<T>(row_output(to_float(x_col[j * column_step]), r, p.log_softmax));
  }
}

}  // namespace softmax
}  // namespace ptxattn

using ptxattn::softmax::SoftmaxParams;

#define PTXATTN_SOFTMAX_KERNELS(suffix, T)                                                        \
  extern "C" __global__ void __launch_bounds__(128) softmax_rows_warp_##suffix(const SoftmaxParams p) { \
    ptxattn::softmax::rows_warp<T>(p);                                                            \
  }                                                                                               \
  extern "C" __global__ void __launch_bounds__(512) softmax_rows_block_##suffix(const SoftmaxParams p) { \
    ptxattn::softmax::rows_block<T>(p);                                                           \
  }                                                                                               \
  extern "C" __global__ void __launch_bounds__(256) softmax_cols_##suffix(const SoftmaxParams p) { \
    ptxattn::softmax::cols<T>(p);                                                                 \
  }

// One line a variant of the softmax table of cu/variants.json, made by scripts/build_ptx.py.
#include "variants.inc"
