// Moving a serving batch's decode rows between packed and dense layouts, so that the split-KV
// decode kernel (decode.cu) can serve them inside one paged_attention call (ops/ragged.py).
//
//   packed  [Nq, H, row]: sequence b's n_b rows at tokens qo_indptr[b] ..
//   dense   [B, H, S, row]: sequence b's rows right-aligned at S - n_b .. S - 1, so decode's
//           bottom-right causal rule (query t sees keys < L - S + 1 + t) gives packed row i
//           the keys < L - n_b + 1 + i
//
// A sequence is a decode row when 1 <= n_b <= S (and its offsets are sound); the others keep
// dense length 0 (decode skips them) and their packed rows are left to the tile kernel.
// ragged_gather_decode: grid (B, H), copies q rows in (zeros in the unused leading rows) and,
// in block (b, 0), writes the dense length. ragged_scatter_decode: grid (B, H), copies o rows
// (and lse) back. Rows move as 16-byte chunks: dtype-agnostic, row_bytes a multiple of 16.
#include "common.cuh"

namespace ptxattn {
namespace ragged {

struct RaggedDecodeParams {
  const int* qo_indptr;  // [B + 1]
  const int* seq_lens;   // [B] live keys (gather reads them)
  int* dense_lens;       // [B] decode's lengths: seq_lens[b] for a decode row, else 0 (gather writes)
  const void* src;       // gather: packed q; scatter: dense o
  void* dst;             // gather: dense q; scatter: packed o
  const float* lse_src;  // scatter: dense lse, or null
  float* lse_dst;        // scatter: packed lse
  long long packed_tok, packed_head;                 // bytes
  long long dense_batch, dense_head, dense_row;      // bytes
  long long lse_packed_tok, lse_packed_head;         // elements
  long long lse_dense_batch, lse_dense_head, lse_dense_row;
  int num_seqs, rows, row_bytes, tokens_q;           // rows = S
};

// n_b when sequence b is a decode row, else 0.
__device__ __forceinline__ int decode_rows(const RaggedDecodeParams& p, int b) {
  const int q0 = p.qo_indptr[b], q1 = p.qo_indptr[b + 1];
  const bool sound = q0 >= 0 && q1 >= q0 && q1 <= p.tokens_q;
  return sound && q1 - q0 <= p.rows ? q1 - q0 : 0;
}

}  // namespace ragged
}  // namespace ptxattn

using ptxattn::ragged::RaggedDecodeParams;

extern "C" __global__ void __launch_bounds__(128) ragged_gather_decode(const RaggedDecodeParams p) {
  const int b = blockIdx.x, h = blockIdx.y;
  const int n = ptxattn::ragged::decode_rows(p, b);
  if (h == 0 && threadIdx.x == 0) p.dense_lens[b] = n > 0 ? p.seq_lens[b] : 0;
  const int chunks = p.row_bytes / 16;
  const long long q0 = p.qo_indptr[b];
  for (int c = threadIdx.x; c < p.rows * chunks; c += blockDim.x) {
    const int t = c / chunks, x = c % chunks, i = t - (p.rows - n);  // i: the packed row, if any
    uint4 value = make_uint4(0, 0, 0, 0);
    if (i >= 0)
      value = *reinterpret_cast<const uint4*>(static_cast<const char*>(p.src) + (q0 + i) * p.packed_tok +
                                              h * p.packed_head + x * 16);
    *reinterpret_cast<uint4*>(static_cast<char*>(p.dst) + b * p.dense_batch + h * p.dense_head +
                              t * p.dense_row + x * 16) = value;
  }
}

extern "C" __global__ void __launch_bounds__(128) ragged_scatter_decode(const RaggedDecodeParams p) {
  const int b = blockIdx.x, h = blockIdx.y;
  const int n = ptxattn::ragged::decode_rows(p, b);
  const int chunks = p.row_bytes / 16, lead = p.rows - n;
  const long long q0 = p.qo_indptr[b];
  for (int c = threadIdx.x; c < n * chunks; c += blockDim.x) {
    const int i = c / chunks, x = c % chunks;
    *reinterpret_cast<uint4*>(static_cast<char*>(p.dst) + (q0 + i) * p.packed_tok + h * p.packed_head + x * 16) =
        *reinterpret_cast<const uint4*>(static_cast<const char*>(p.src) + b * p.dense_batch + h * p.dense_head +
                                        (lead + i) * p.dense_row + x * 16);
  }
  if (p.lse_src != nullptr)
    for (int i = threadIdx.x; i < n; i += blockDim.x)
      p.lse_dst[(q0 + i) * p.lse_packed_tok + h * p.lse_packed_head] =
          p.lse_src[b * p.lse_dense_batch + h * p.lse_dense_head + (lead + i) * p.lse_dense_row];
}
