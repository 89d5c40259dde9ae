// Writing new keys and values into a KV cache, contiguous or paged.
//
//   k_new, v_new  [rows, Hkv, n, D] (contiguous mode)  or  [tokens, Hkv, D] (paged: rows = tokens, n = 1)
//   caches        addressed as (page, kv head, token in page, d) through strides, as in decode.cu
//   contiguous    row b's token i goes to (page b, slot seq_lens[b] + i); a row with
//                 seq_lens[b] + n > capacity (or seq_lens[b] < 0) is not written, and reported
//   paged         token r goes to slot_mapping[r] = page * page_size + offset (int32 or int64);
//                 -1 skips the token, a page outside the pool is reported and skipped
//
// kv_append: a flat grid-stride loop over 16-byte chunks of (row, token, head, K or V); the
// kernel only moves bytes, so one variant serves every dtype (elem_bytes scales the element
// strides). kv_advance: seq_lens[b] += n for every row that kv_append wrote; a separate launch
// so that no thread of kv_append reads a length another thread has already moved.
#include "common.cuh"

namespace ptxattn {
namespace kv_cache {

struct KvAppendParams {
  const void* k_new;
  const void* v_new;
  void* k_cache;
  void* v_cache;
  int* seq_lens;             // contiguous mode: each row's write position (advanced by kv_advance)
  const void* slot_mapping;  // paged mode: [tokens] int32 or int64; null in contiguous mode
  int* fault;
  long long kn_stride_row, kn_stride_head, kn_stride_tok;
  long long vn_stride_row, vn_stride_head, vn_stride_tok;
  long long k_stride_page, k_stride_head, k_stride_tok;
  long long v_stride_page, v_stride_head, v_stride_tok;
  int rows, heads, tokens;   // tokens = n per row (1 in paged mode)
  int dk, dv;                // elements; dk * elem_bytes and dv * elem_bytes are multiples of 16
  int elem_bytes;
  int capacity;              // contiguous mode
  int num_pages;             // paged mode
  int page_size_log2;        // paged mode
  int slot_is_int64;
};

// Where row `row`'s token `tok` goes: (page, slot), or page < 0 when it is not written.
struct Destination {
  long long page, slot;
};

__device__ __forceinline__ Destination destination(const KvAppendParams& p, int row, int tok, bool report) {
  if (p.slot_mapping == nullptr) {
    const int start = p.seq_lens[row];
    if (start < 0 || start > p.capacity - p.tokens) {
      if (report) raise_fault(p.fault, start < 0 ? FAULT_NEGATIVE_LENGTH : FAULT_PAST_CAPACITY, row, start + p.tokens);
      return {-1, 0};
    }
    return {row, static_cast<long long>(start) + tok};
  }
  const long long slot = p.slot_is_int64 ? static_cast<const long long*>(p.slot_mapping)[row]
                                         : static_cast<const int*>(p.slot_mapping)[row];
  if (slot < 0) return {-1, 0};  // -1: padding token, skipped by design
  const long long page = slot >> p.page_size_log2;
  if (page >= p.num_pages) {
    if (report) raise_fault(p.fault, FAULT_SLOT_OUT_OF_RANGE, row, int(slot > 0x7fffffffLL ? 0x7fffffffLL : slot));
    return {-1, 0};
  }
  return {page, slot & ((1LL << p.page_size_log2) - 1)};
}

__device__ void append(const KvAppendParams& p) {
  const int k_chunks = p.dk * p.elem_bytes / 16, v_chunks = p.dv * p.elem_bytes / 16;
  const int per_head = k_chunks + v_chunks;
  const long long total = static_cast<long long>(p.rows) * p.tokens * p.heads * per_head;
  for (long long i = blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<long long>(gridDim.x) * blockDim.x) {
    int c = int(i % per_head);
    const int head = int(i / per_head % p.heads);
    const int tok = int(i / per_head / p.heads % p.tokens);
    const int row = int(i / per_head / p.heads / p.tokens);
    const Destination dst = destination(p, row, tok, c == 0 && head == 0 && tok == 0);
    if (dst.page < 0) continue;
    const bool is_k = c < k_chunks;
    if (!is_k) c -= k_chunks;
    const char* src = static_cast<const char*>(is_k ? p.k_new : p.v_new) +
                      (is_k ? row * p.kn_stride_row + head * p.kn_stride_head + tok * p.kn_stride_tok
                            : row * p.vn_stride_row + head * p.vn_stride_head + tok * p.vn_stride_tok) * p.elem_bytes;
    char* out = static_cast<char*>(is_k ? p.k_cache : p.v_cache) +
                (is_k ? dst.page * p.k_stride_page + head * p.k_stride_head + dst.slot * p.k_stride_tok
                      : dst.page * p.v_stride_page + head * p.v_stride_head + dst.slot * p.v_stride_tok) * p.elem_bytes;
    reinterpret_cast<uint4*>(out)[c] = reinterpret_cast<const uint4*>(src)[c];
  }
}

__device__ void advance(const KvAppendParams& p) {
  const int row = blockIdx.x * blockDim.x + threadIdx.x;
  if (row >= p.rows) return;
  const int start = p.seq_lens[row];
  if (start >= 0 && start <= p.capacity - p.tokens) p.seq_lens[row] = start + p.tokens;
}

}  // namespace kv_cache
}  // namespace ptxattn

extern "C" __global__ void kv_append(const ptxattn::kv_cache::KvAppendParams p) { ptxattn::kv_cache::append(p); }
extern "C" __global__ void kv_advance(const ptxattn::kv_cache::KvAppendParams p) { ptxattn::kv_cache::advance(p); }
