// Scaled dot-product attention forward on Hopper tensor cores (wgmma, sm_90a only).
//
// Serves the calls flash_fwd.cu's mma.sync kernels serve (plain kernels: no mask, no
// softcap, scale > 0; general kernels: the rest; causal/window, sinks, GQA, LSE, serving
// batches all apply) at every head dim up to 256: variants of Dqk / Dv 64, 128, 192 / 128 and
// 256, a call running the smallest that holds its dims with the rest zero-padded. Copies are
// 16-byte cp.async where the host vouched for alignment and dims that are multiples of 8
// (vector_io), else element by element (strided K/V only: load_tile_scalar). Its
// _fp8 kernels serve fp8 K/V (Dqk = Dv = 64 or 128), as flash_fwd_fp8.cu's do. Same
// parameters and semantics; its query blocks are 64 * GROUPS rows (grid x), and the
// summation order differs from mma.sync's.
//
// A CTA is GROUPS warpgroups over 64 * GROUPS query rows, 64 a warpgroup (wgmma's M).
// Q, K and V tiles live in shared memory in wgmma's 128-byte-swizzle layout: a [rows][D]
// b16 tile is D / 64 [rows][64] halves of 128-byte rows, the 16-byte chunk c of row r
// stored at c ^ (r & 7), every half 1024-byte aligned. All threads stream the next
// KEYS-key K/V tile with cp.async (fp8: the bytes of the tile after it, converted to the
// input dtype when the next tile's stage frees: stage_fp8_rows) while the warpgroups
// compute on the current one:
//   S = Q K^T   wgmma m64nKEYSk16, A (Q) and B (K) from shared memory, both K-major
//   online softmax on S in registers (exp2, scale folded in), O rescaled
//   O += P V    wgmma m64nDvk16 (Dv = 256: two m64n128), A = P rounded to the input dtype in
//               registers (the accumulator layout of S is the A-fragment layout), B = V
//               from shared memory, MN-major (d contiguous)
// The accumulator layout is mma.sync's m16n8 one per warp (warp w of the group owns rows
// 16w..16w+15; register 4j+e is n8 block j), so masking, softmax and the epilogue follow
// flash_fwd.cu.
#include "flash_fwd_common.cuh"
#include "mma.cuh"

namespace ptxattn {
namespace sm90 {

// The shared-memory tiles of a kernel whose CTA holds ROWS query rows of head dim DQK (Q and
// K, a multiple of 64) and DV (V and O: 64, 128 or 256), KEYS keys a K/V tile (wgmma N of S),
// each tile [rows][D] stored as D / 64 swizzled [rows][64] halves. Sm90Tile and WsTile add
// their threads and stages.
template <int DQK_, int DV_, int ROWS_, int KEYS_>
struct TileGeometry {
  static constexpr int DQK = DQK_, DV = DV_, ROWS = ROWS_, KEYS = KEYS_;
  static constexpr int Q_HALF = ROWS * 128;      // one [ROWS][64] half of the Q tile, bytes
  static constexpr int KV_HALF = KEYS * 128;     // one [KEYS][64] half of a K or V tile
  static constexpr int Q_BYTES = Q_HALF * (DQK / 64);
  static constexpr int K_BYTES = KV_HALF * (DQK / 64), V_BYTES = KV_HALF * (DV / 64);
  static_assert(DQK % 64 == 0 && DQK <= 256 && (DV == 64 || DV == 128 || DV == 256), "head dims");
  static_assert(KEYS == 64 || KEYS == 80 || KEYS == 128, "S is m64n64, m64n80 or m64n128");
  // At Dv 256 O's rescale is 128 multiplies a thread a tile, against KEYS / 2 exponentials:
  // there the running max lags (online_softmax's LAZY) and the ws kernels skip most rescales.
  static constexpr bool LAZY_RESCALE = DV == 256;
};

// One variant: GROUPS warpgroups of 64 query rows, KEYS keys a K/V tile (128, or 80 / 64 where
// two 128-key stages do not fit beside Q: D256's plain kernels take 80, its general ones 64,
// as the general ws kernel spilled 248 B at 80). Calls with smaller head dims run the smallest variant that holds them,
// their columns zero-padded in shared memory (dim_qk / dim_v).
// Shared memory holds Q, then two stages of (K, V); its base is rounded up to 1024 bytes.
template <int DQK_, int DV_, int GROUPS_, int KEYS_>
struct Sm90Tile : TileGeometry<DQK_, DV_, 64 * GROUPS_, KEYS_> {
  using Geometry = TileGeometry<DQK_, DV_, 64 * GROUPS_, KEYS_>;
  static constexpr int GROUPS = GROUPS_;
  static constexpr int THREADS = 128 * GROUPS;
  static constexpr int SHARED = Geometry::Q_BYTES + 2 * (Geometry::K_BYTES + Geometry::V_BYTES) + 1024;
  static constexpr int FP8_STAGING = 2 * KEYS_ * DQK_;  // fp8 kernels: the next tile's K and V bytes, after the rest
  // ptxas -v reports 1 KB of static shared memory for these kernels (and the ws ones).
  static_assert(SHARED <= 227 * 1024 - 1024, "sm_90 opt-in shared memory per block, less static");
};

// ---- wgmma wrappers ----------------------------------------------------------------
// Shared-memory matrix descriptor, 128-byte swizzle: start address, leading and stride
// byte offsets (all >> 4), swizzle mode 1 in bits 62-63.
__device__ __forceinline__ unsigned long long sw128_desc(unsigned addr, unsigned lbo, unsigned sbo) {
  return static_cast<unsigned long long>((addr & 0x3FFFF) >> 4) |
         (static_cast<unsigned long long>(lbo >> 4) << 16) |
         (static_cast<unsigned long long>(sbo >> 4) << 32) | (1ull << 62);
}
// K-major operand (rows of 64 elements along k, 8-row groups 1024 bytes apart; the leading
// offset is unused when one k16 step stays inside a 128-byte row).
__device__ __forceinline__ unsigned long long k_major_desc(unsigned addr) { return sw128_desc(addr, 16, 1024); }
// MN-major operand: 64-element atoms along n `half` bytes apart, 8-key groups along k 1024
// bytes apart.
__device__ __forceinline__ unsigned long long mn_major_desc(unsigned addr, unsigned half) {
  return sw128_desc(addr, half, 1024);
}
// The descriptor of the operand `offset` bytes (a multiple of 16) past `desc`'s: one add on the
// address field (bits 0-13, address >> 4), which cannot carry out since shared addresses stay
// below 256 KB. Built from a base descriptor, a k step's descriptors cost one add each rather
// than sw128_desc's four operations on its address.
__device__ __forceinline__ unsigned long long desc_at(unsigned long long desc, unsigned offset) {
  const unsigned lo = static_cast<unsigned>(desc) + (offset >> 4), hi = static_cast<unsigned>(desc >> 32);
  return static_cast<unsigned long long>(hi) << 32 | lo;
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_wait_all() { asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory"); }
// Pins an accumulator array after a wait: the compiler may not move its reads above it.
template <int N>
__device__ __forceinline__ void fence_registers(float (&d)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i])::"memory");
}
// Shared memory written through the generic proxy (cp.async) before wgmma reads it.
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

// Accumulator operands of m64n128 (64 fp32 a thread), m64n80 (40) and m64n64 (32) wgmma: each
// list is the first 32, 40 or 64 of d's registers, put together from the pieces below.
#define PTXATTN_REGS_0_31 \
  "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, " \
  "%18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
#define PTXATTN_REGS_32_39 \
  ", %32, %33, %34, %35, %36, %37, %38, %39"
#define PTXATTN_REGS_40_63 \
  ", %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, " \
  "%58, %59, %60, %61, %62, %63"
#define PTXATTN_OUTS_0_31 \
  "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), \
  "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), \
  "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), \
  "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), \
  "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), \
  "+f"(d[30]), "+f"(d[31])
#define PTXATTN_OUTS_32_39 \
  "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), \
  "+f"(d[38]), "+f"(d[39])
#define PTXATTN_OUTS_40_63 \
  "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), \
  "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), \
  "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), \
  "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
#define PTXATTN_REGS32 "{" PTXATTN_REGS_0_31 "}"
#define PTXATTN_REGS40 "{" PTXATTN_REGS_0_31 PTXATTN_REGS_32_39 "}"
#define PTXATTN_REGS64 "{" PTXATTN_REGS_0_31 PTXATTN_REGS_32_39 PTXATTN_REGS_40_63 "}"
#define PTXATTN_OUTS32 PTXATTN_OUTS_0_31
#define PTXATTN_OUTS40 PTXATTN_OUTS_0_31, PTXATTN_OUTS_32_39
#define PTXATTN_OUTS64 PTXATTN_OUTS_0_31, PTXATTN_OUTS_32_39, PTXATTN_OUTS_40_63

// d (m64 x nN, fp32) = (accumulate ? d : 0) + A (smem, K-major) * B (smem, K-major),
// N = 2 * (registers of d); DESCS and FLAG name the descriptors' and accumulate's operands.
#define PTXATTN_WGMMA_SS(N, TYPE, REGS, OUTS, DESCS, FLAG)                                 \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, " FLAG ", 0;\n"                          \
               "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." TYPE "." TYPE " " REGS      \
               ", " DESCS ", p, 1, 1, 0, 0;\n}\n"                                           \
               : OUTS                                                                        \
               : "l"(a_desc), "l"(b_desc), "r"(accumulate))
template <class T, int R>
__device__ __forceinline__ void wgmma_ss(float (&d)[R], unsigned long long a_desc,
                                         unsigned long long b_desc, int accumulate) {
  static_assert(R == 64 || R == 40 || R == 32, "m64n128, m64n80 or m64n64");
  if constexpr (R == 40 && is_bf16<T>) {
    PTXATTN_WGMMA_SS(80, "bf16", PTXATTN_REGS40, PTXATTN_OUTS40, "%40, %41", "%42");
  } else if constexpr (R == 40) {
    PTXATTN_WGMMA_SS(80, "f16", PTXATTN_REGS40, PTXATTN_OUTS40, "%40, %41", "%42");
  } else if constexpr (R == 64 && is_bf16<T>) {
    PTXATTN_WGMMA_SS(128, "bf16", PTXATTN_REGS64, PTXATTN_OUTS64, "%64, %65", "%66");
  } else if constexpr (R == 64) {
    PTXATTN_WGMMA_SS(128, "f16", PTXATTN_REGS64, PTXATTN_OUTS64, "%64, %65", "%66");
  } else if constexpr (is_bf16<T>) {
    PTXATTN_WGMMA_SS(64, "bf16", PTXATTN_REGS32, PTXATTN_OUTS32, "%32, %33", "%34");
  } else {
    PTXATTN_WGMMA_SS(64, "f16", PTXATTN_REGS32, PTXATTN_OUTS32, "%32, %33", "%34");
  }
}

// d (m64 x nN, fp32) = (accumulate ? d : 0) + A (registers, mma.sync's A-fragment layout) *
// B (smem, MN-major), N = 2 * (registers of d); A is operands a0..a3, B's descriptor the next
// one, FLAG accumulate's.
#define PTXATTN_WGMMA_RS(N, TYPE, REGS, OUTS, OPERANDS, FLAG)                              \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, " FLAG ", 0;\n"                          \
               "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." TYPE "." TYPE " " REGS      \
               ", " OPERANDS ", p, 1, 1, 1;\n}\n"                                            \
               : OUTS                                                                        \
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b_desc), "r"(accumulate))
template <class T, int R>
__device__ __forceinline__ void wgmma_rs(float (&d)[R], const unsigned (&a)[4], unsigned long long b_desc,
                                         int accumulate) {
  static_assert(R == 64 || R == 32, "m64n128 or m64n64");
  if constexpr (R == 64 && is_bf16<T>) {
    PTXATTN_WGMMA_RS(128, "bf16", PTXATTN_REGS64, PTXATTN_OUTS64, "{%64, %65, %66, %67}, %68", "%69");
  } else if constexpr (R == 64) {
    PTXATTN_WGMMA_RS(128, "f16", PTXATTN_REGS64, PTXATTN_OUTS64, "{%64, %65, %66, %67}, %68", "%69");
  } else if constexpr (is_bf16<T>) {
    PTXATTN_WGMMA_RS(64, "bf16", PTXATTN_REGS32, PTXATTN_OUTS32, "{%32, %33, %34, %35}, %36", "%37");
  } else {
    PTXATTN_WGMMA_RS(64, "f16", PTXATTN_REGS32, PTXATTN_OUTS32, "{%32, %33, %34, %35}, %36", "%37");
  }
}

// Named barriers of `count` threads: wait (with an arrival) / arrive without waiting.
__device__ __forceinline__ void named_bar_sync(unsigned id, unsigned count) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(count) : "memory");
}
__device__ __forceinline__ void named_bar_arrive(unsigned id, unsigned count) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(count) : "memory");
}
// ---- tile loads ------------------------------------------------------------------------
// Byte offset of 16-byte chunk c of row r in a swizzled [ROWS][D] tile.
template <int ROWS>
__device__ __forceinline__ unsigned sw128_offset(int r, int c) {
  return (c >> 3) * (ROWS * 128) + r * 128 + (((c & 7) ^ (r & 7)) << 4);
}

// Threads a row of D elements takes in the tile copies: one a 16-byte chunk, rounded up to a
// power of two (D = 192: a quarter of them idle) so that a thread's rows keep one swizzle phase.
template <int D>
constexpr int kLanesPerRow = D <= 64 ? 8 : D <= 128 ? 16 : 32;

// Bytes of 16-byte chunk c of a row that lie inside its first `cols` elements, a multiple of 8
// (chunks past them are zero-filled: zero-padded head dims).
__device__ __forceinline__ int chunk_bytes(int c, int cols) { return 8 * c < cols ? 16 : 0; }

// A [ROWS][D] tile whose row r starts at g + r * row_stride into the swizzled layout at
// shared address dst (halves ROWS * 128 bytes apart); rows >= rows_valid and columns >= cols
// become zeros (so padding cannot inject NaN). Thread t copies chunk t % L of rows t / L +
// k * step (L = kLanesPerRow<D>): its addresses advance by constants. UNROLL > 0 unrolls the
// copies only that far (the warp-specialized producer's few registers).
// Where THREADS cannot cover 8 rows of D at once (the warp-specialized producer's 128 threads
// at D 192 / 256), the tile is copied one 64-column half at a time.
template <class T, int ROWS, int D, int THREADS, int UNROLL = 0>
__device__ __forceinline__ void load_tile(unsigned dst, const T* g, long long row_stride, int rows_valid,
                                          int cols = D) {
  constexpr int kLanes = kLanesPerRow<D>, kStep = THREADS / kLanes;
  if constexpr (kStep < 8) {
#pragma unroll
    for (int half = 0; half < D / 64; ++half)
      load_tile<T, ROWS, 64, THREADS, UNROLL>(dst + half * ROWS * 128, g + half * 64, row_stride, rows_valid,
                                              cols - half * 64);
  } else {
    constexpr int kIters = (ROWS + kStep - 1) / kStep;
    const int tid = threadIdx.x, r0 = tid / kLanes, c = tid % kLanes;
    if (kLanes != D / 8 && c >= D / 8) return;
    const unsigned d0 = dst + sw128_offset<ROWS>(r0, c);
    const T* src = g + r0 * row_stride + c * 8;
    const int bytes = chunk_bytes(c, cols);
    static_assert(kStep % 8 == 0, "a thread's rows keep one swizzle phase");
#pragma unroll(UNROLL > 0 ? UNROLL : kIters)
    for (int i = 0; i < kIters; ++i) {
      const int r = r0 + i * kStep;
      if (ROWS % kStep != 0 && r >= ROWS) break;
      const bool read = r < rows_valid;
      asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(d0 + i * kStep * 128),
                   "l"(read ? src + i * kStep * row_stride : g), "r"(read ? bytes : 0));
    }
  }
}

// load_tile for a tile whose ROWS rows all lie before the end and whose D columns all count
// (rows_valid >= ROWS, cols == D): no per-copy row check or zero-fill, the source pointer
// advanced by one precomputed stride, so the warp-specialized producer issues about three
// instructions a copy instead of a dozen (they take issue slots from the consumers). Rows
// THREADS cannot cover 8 at a time go one 64-column half at a time, as in load_tile.
template <class T, int ROWS, int D, int THREADS>
__device__ __forceinline__ void load_full_tile(unsigned dst, const T* g, long long row_stride) {
  constexpr int kLanes = kLanesPerRow<D>, kStep = THREADS / kLanes;
  if constexpr (kStep < 8) {
#pragma unroll
    for (int half = 0; half < D / 64; ++half)
      load_full_tile<T, ROWS, 64, THREADS>(dst + half * ROWS * 128, g + half * 64, row_stride);
  } else {
    constexpr int kIters = ROWS / kStep;
    static_assert(kLanes == D / 8 && kStep % 8 == 0 && ROWS % kStep == 0, "whole rows, one swizzle phase");
    const int tid = threadIdx.x, r0 = tid / kLanes, c = tid % kLanes;
    const unsigned d0 = dst + sw128_offset<ROWS>(r0, c);
    const char* src = reinterpret_cast<const char*>(g + r0 * row_stride + c * 8);
    const long long step = kStep * row_stride * static_cast<long long>(sizeof(T));
#pragma unroll
    for (int i = 0; i < kIters; ++i, src += step)
      asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(d0 + i * kStep * 128), "l"(src));
  }
}

// load_tile for a call the host could not vouch for (vector_io 0: a base or row stride off 16
// bytes, or a head dim not a multiple of 8): the same layout and zeros, each element read on
// its own (2-byte loads) and each chunk stored synchronously, so the cp.async waits before a
// tile is read find nothing of it in flight. Only the plain (not warp-specialized) kernels
// take such calls.
template <class T, int ROWS, int D, int THREADS>
__device__ __forceinline__ void load_tile_scalar(unsigned dst, const T* g, long long row_stride, int rows_valid,
                                                 int cols) {
  static_assert(sizeof(T) == 2, "16-bit elements");
  const unsigned short* src = reinterpret_cast<const unsigned short*>(g);
  constexpr int kChunks = D / 8;
#pragma unroll 1
  for (int i = threadIdx.x; i < ROWS * kChunks; i += THREADS) {
    const int r = i / kChunks, c = i % kChunks;
    unsigned pair[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int col = 8 * c + 2 * e;
      const bool row_ok = r < rows_valid;
      const unsigned lo = row_ok && col < cols ? src[r * row_stride + col] : 0u;
      const unsigned hi = row_ok && col + 1 < cols ? src[r * row_stride + col + 1] : 0u;
      pair[e] = lo | hi << 16;
    }
    asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};\n" ::"r"(dst + sw128_offset<ROWS>(r, c)), "r"(pair[0]),
                 "r"(pair[1]), "r"(pair[2]), "r"(pair[3])
                 : "memory");
  }
}

// The tile copy a call's alignment allows: load_tile_scalar where the kernel takes calls of
// ANY_ALIGNMENT and this one's p.vector_io is 0, else load_tile.
template <class T, int ROWS, int D, int THREADS, bool ANY_ALIGNMENT>
__device__ __forceinline__ void load_tile_checked(const FlashFwdParams& p, unsigned dst, const T* g,
                                                  long long row_stride, int rows_valid, int cols) {
  if (ANY_ALIGNMENT && !p.vector_io)
    load_tile_scalar<T, ROWS, D, THREADS>(dst, g, row_stride, rows_valid, cols);
  else
    load_tile<T, ROWS, D, THREADS>(dst, g, row_stride, rows_valid, cols);
}

// Paged pools: the page ids of one ROWS-key tile (one per page it spans) are copied into
// shared memory a tile ahead, with the K/V copies of the tile before, so that no copy waits
// for a block-table read (reading each row's id from the table as its copy is issued ran
// 0.75x the contiguous rate).
template <int ROWS>
__device__ __forceinline__ void fetch_page_ids(int* ids, const FlashFwdParams& p, int b, int n0, int seq_kv) {
  const int count = max(1, ROWS >> p.page_size_log2), i = threadIdx.x;
  if (i < count) {
    const int key = n0 + (i << p.page_size_log2);
    cp_async_4_or_zero(ids + i, p.block_table + b * p.block_table_stride + (key >> p.page_size_log2), key < seq_kv);
  }
}

// As load_tile for the K ([ROWS][DQK]) and V ([ROWS][DV]) tiles at once, from paged pools: row
// r is key n0 + r (n0 a multiple of ROWS), in page ids[r >> page_size_log2], one page lookup
// for both; a page outside the pool is reported and its rows become zeros.
template <class T, int ROWS, int DQK, int DV, int THREADS>
__device__ __forceinline__ void load_paged_kv(unsigned k_dst, unsigned v_dst, const FlashFwdParams& p, const T* k_pool,
                                              const T* v_pool, const int* ids, int b, int n0, int rows_valid) {
  constexpr int kLanes = kLanesPerRow<(DQK > DV ? DQK : DV)>, kStep = THREADS / kLanes;
  constexpr int kIters = (ROWS + kStep - 1) / kStep;
  const int tid = threadIdx.x, r0 = tid / kLanes, c = tid % kLanes;
  const bool copies_k = kLanes == DQK / 8 || c < DQK / 8, copies_v = kLanes == DV / 8 || c < DV / 8;
  const int k_bytes = chunk_bytes(c, p.dim_qk), v_bytes = chunk_bytes(c, p.dim_v);
  const unsigned d0 = sw128_offset<ROWS>(r0, c);
  const int in_page = (1 << p.page_size_log2) - 1;
#pragma unroll
  for (int i = 0; i < kIters; ++i) {
    const int r = r0 + i * kStep;
    if (ROWS % kStep != 0 && r >= ROWS) break;
    const int page = ids[r >> p.page_size_log2];
    bool read = r < rows_valid;
    if (read && (page < 0 || page >= p.num_pages)) {
      raise_fault(p.fault, FAULT_PAGE_OUT_OF_RANGE, b, page);
      read = false;
    }
    const int tok = (n0 + r) & in_page;
    const T* k_row = k_pool + page * p.k_batch_stride + tok * p.k_seq_stride + c * 8;
    const T* v_row = v_pool + page * p.v_batch_stride + tok * p.v_seq_stride + c * 8;
    const unsigned offset = d0 + i * kStep * 128;
    if (copies_k)
      asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(k_dst + offset),
                   "l"(read ? k_row : k_pool), "r"(read ? k_bytes : 0));
    if (copies_v)
      asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(v_dst + offset),
                   "l"(read ? v_row : v_pool), "r"(read ? v_bytes : 0));
  }
}

// fp8 K/V: a tile's bytes (and per-token scales) are cp.async'ed a tile ahead into a staging
// area of plain [KEYS][D]-byte rows, then converted (fp8x8_as) into the swizzled T stage the
// warpgroups read next. Thread t stages and converts the same 16-byte chunks (t + k * THREADS)
// and row scales, so no barrier sits between the two: cp.async.wait_group alone makes a
// thread's own copies visible to it. Rows from rows_valid on, and those of a page outside
// the pool (reported), stage as zeros with scale 0.
template <int KEYS, int D, int THREADS>
__device__ __forceinline__ void stage_fp8_rows(unsigned staging, float* scales, const FlashFwdParams& p,
                                               const Fp8Rows& g, int b, long long k_tok0, int n0, int rows_valid) {
  constexpr int kChunksPerRow = D / 16;
  static_assert(KEYS * kChunksPerRow % THREADS == 0, "every thread stages as many chunks");
#pragma unroll
  for (int k = 0; k < KEYS * kChunksPerRow / THREADS; ++k) {
    const int i = threadIdx.x + k * THREADS, r = i / kChunksPerRow, c = i % kChunksPerRow;
    long long page, tok;
    const bool read = locate_fp8_row(p, b, k_tok0, n0, r, rows_valid, page, tok);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(staging + i * 16),
                 "l"(read ? g.data + page * g.page_stride + tok * g.tok_stride + c * 16 : g.data), "r"(read ? 16 : 0));
    if (c != 0) continue;
    if (g.scales != nullptr) {
      cp_async_4_or_zero(scales + r, read ? g.scales + page * g.scale_page_stride + tok * g.scale_tok_stride : g.scales,
                         read);
    } else {
      scales[r] = read ? g.scale : 0.f;
    }
  }
}

// The staged chunks of this thread (stage_fp8_rows) as T, into the swizzled tile at dst, and
// their rows' scales into key_scales.
template <class T, int KEYS, int D, int THREADS>
__device__ __forceinline__ void convert_fp8_rows(unsigned dst, float* key_scales, unsigned staging,
                                                 const float* scales, int kind) {
  constexpr int kChunksPerRow = D / 16;
#pragma unroll
  for (int k = 0; k < KEYS * kChunksPerRow / THREADS; ++k) {
    const int i = threadIdx.x + k * THREADS, r = i / kChunksPerRow, c = i % kChunksPerRow;
    const uint4 x = ld_shared_16(staging + i * 16);
    st_shared_16(dst + sw128_offset<KEYS>(r, 2 * c), fp8x8_as<T>(make_uint2(x.x, x.y), kind));
    st_shared_16(dst + sw128_offset<KEYS>(r, 2 * c + 1), fp8x8_as<T>(make_uint2(x.z, x.w), kind));
    if (c == 0) key_scales[r] = scales[r];
  }
}

// ---- the per-tile steps of a warpgroup (flash_fwd_wgmma, and flash_fwd_sm90_ws.cuh's consumers) ----
// S = Q K^T issued (not waited for): DQK / 16 k16 steps, 4 in each half (32 bytes a step
// inside a row); q_group is the warpgroup's 64 rows of the Q tile, k the K stage. K's step
// descriptors come from one base (desc_at); Q's stay built a step at a time, since a Q base
// held across the key loop made the general and D256 kernels spill more (ptxas).
// KEYS: the tile's first keys to score (all of them but in a ws kernel's narrow last tile),
// into s's first KEYS / 2 registers (an m64nN accumulator's columns are its first registers').
template <class T, class Tile, int KEYS = Tile::KEYS>
__device__ __forceinline__ void issue_qk(float (&s)[Tile::KEYS / 2], unsigned q_group, unsigned k) {
  const unsigned long long k_desc = k_major_desc(k);
  wgmma_fence();
#pragma unroll
  for (int ks = 0; ks < Tile::DQK / 16; ++ks) {
    const unsigned step = (ks & 3) * 32, half = ks >> 2;
    wgmma_ss<T>(*reinterpret_cast<float(*)[KEYS / 2]>(s), k_major_desc(q_group + half * Tile::Q_HALF + step),
                desc_at(k_desc, half * Tile::KV_HALF + step), ks > 0);
  }
  wgmma_commit();
}

// cut_keys' loop over this thread's elements of tile n0: those left or right of a row's window
// or past Skv become -inf.
template <int KEYS>
__device__ __forceinline__ void cut_elements(float (&s)[KEYS / 2], const KeyWindow& win, int n0, int seq_kv, int my_row,
                                             int lane) {
  const int col0 = n0 + 2 * (lane & 3);
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = my_row + 8 * r;
    const int lo = clamp_to_tile<KEYS>(first_visible_key(win, row) - col0);
    const int hi = clamp_to_tile<KEYS>(min(last_visible_key(win, row), (long long)seq_kv - 1) - col0);
#pragma unroll
    for (int j = 0; j < KEYS / 8; ++j)
#pragma unroll
      for (int c = 0; c < 2; ++c)
        if (j * 8 + c < lo || j * 8 + c > hi) s[4 * j + 2 * r + c] = neg_inf();
  }
}

// The right edge alone of cut_elements' cut (cut_keys' UPPER_APART tiles) for a warpgroup's 64
// rows from group_row0, in 32-bit arithmetic and by bit masks. A row's last visible key less a
// column, last_visible_key(group_row0) - n0 + (row - group_row0) - (col0 - n0), is taken from a
// base made once in 64 bits and clamped to [-65, KEYS + 8]: row - group_row0 < 64 and
// col0 - n0 < 8, so every clamped base gives the same clamped hi as the true one. A row keeps a
// prefix of its keys: columns 8 j + c for j below (hi - c + 8) / 8, bit j of keep, which ptxas
// turns into predicates a few at a time (R2P) where each element otherwise took a compare.
template <int KEYS>
__device__ __forceinline__ void cut_upper_by_masks(float (&s)[KEYS / 2], const KeyWindow& win, int n0, int seq_kv,
                                                   int group_row0, int my_row, int lane) {
  static_assert(KEYS / 8 + 1 < 32, "a mask bit a column");
  const int base = static_cast<int>(max(-65LL, min(last_visible_key(win, group_row0) - n0, KEYS + 8LL)));
  const int col = 2 * (lane & 3);    // col0 - n0
  const int end = seq_kv - 1 - n0 - col;  // the last key less col0 (n0 < seq_kv)
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int hi = max(-1, min(min(base + my_row + 8 * r - group_row0 - col, end), KEYS));
#pragma unroll
    for (int c = 0; c < 2; ++c) {
      const unsigned keep = (1u << ((hi - c + 8) >> 3)) - 1u;
#pragma unroll
      for (int j = 0; j < KEYS / 8; ++j)
        if (!((keep >> j) & 1u)) s[4 * j + 2 * r + c] = neg_inf();
    }
  }
}

// Cuts the keys of key tile n0 outside a row's causal/window range or past Skv (on the tiles
// that have any); group_row0 is the warpgroup's first row, my_row this thread's first.
// UPPER_APART: where no row's window starts inside the tile (every tile of a causal call
// without a window), only the right edge is cut, by cut_upper_by_masks (the persistent twins;
// in the CTA-a-block ping-pong kernels a second loop had ptxas serialize the wgmmas, C7511).
// The tests are spelled out in each branch: taken once into named flags for both, they moved
// ptxas's spills in the CTA-a-block kernels.
template <int KEYS, bool UPPER_APART = false>
__device__ __forceinline__ void cut_keys(float (&s)[KEYS / 2], const KeyWindow& win, int n0, int seq_kv, int group_row0,
                                         int my_row, int lane) {
  if constexpr (UPPER_APART) {
    if (n0 < first_visible_key(win, group_row0 + 63))
      cut_elements<KEYS>(s, win, n0, seq_kv, my_row, lane);
    else if (n0 + KEYS > seq_kv || n0 + KEYS - 1 > last_visible_key(win, group_row0))
      cut_upper_by_masks<KEYS>(s, win, n0, seq_kv, group_row0, my_row, lane);
  } else if (n0 + KEYS > seq_kv || n0 < first_visible_key(win, group_row0 + 63) ||
             n0 + KEYS - 1 > last_visible_key(win, group_row0)) {
    cut_elements<KEYS>(s, win, n0, seq_kv, my_row, lane);
  }
}

// Online softmax of one S tile; each row is spread over the 4 lanes of a quad. S becomes P
// (unrounded), the row maxima and sums move on, and O is rescaled by alpha (RESCALE), or
// alpha is left for the caller to apply once O's pending P V is done. LAZY (FA4's trick): a
// row's max moves only when the tile passes it by more than 8 (log2 units), so P stays below
// 2^8 (exact in f16 / bf16 as any P is) and alpha is exactly 1 on most tiles.
template <int KEYS, int O_REGS, bool RESCALE, bool LAZY>
__device__ __forceinline__ void online_softmax(float (&s)[KEYS / 2], float (&o)[O_REGS], float (&row_max)[2],
                                               float (&row_sum)[2], float mul, float (&alpha_out)[2]) {
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    float mx = neg_inf();
#pragma unroll
    for (int j = 0; j < KEYS / 8; ++j) mx = fmaxf(mx, fmaxf(s[4 * j + 2 * r], s[4 * j + 2 * r + 1]));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
    mx = fmaxf(row_max[r], mx * mul);
    if constexpr (LAZY) mx = mx - row_max[r] > 8.f ? mx : row_max[r];  // -inf - -inf is NaN: keeps -inf
    const float sub = exp_subtrahend(mx);
    const float alpha = exp2_ftz(row_max[r] - sub);
    row_max[r] = mx;
    float sum = 0.f;
#pragma unroll
    for (int j = 0; j < KEYS / 8; ++j) {
      s[4 * j + 2 * r] = exp2_ftz(fmaf(s[4 * j + 2 * r], mul, -sub));
      s[4 * j + 2 * r + 1] = exp2_ftz(fmaf(s[4 * j + 2 * r + 1], mul, -sub));
      sum += s[4 * j + 2 * r] + s[4 * j + 2 * r + 1];
    }
    if constexpr (RESCALE) {
#pragma unroll
      for (int j = 0; j < O_REGS / 4; ++j) {
        o[4 * j + 2 * r] *= alpha;
        o[4 * j + 2 * r + 1] *= alpha;
      }
    }
    alpha_out[r] = alpha;
    row_sum[r] = row_sum[r] * alpha + sum;
  }
}

// O *= alpha, row by row (online_softmax's deferred rescale).
template <int O_REGS>
__device__ __forceinline__ void rescale_o(float (&o)[O_REGS], const float (&alpha)[2]) {
#pragma unroll
  for (int r = 0; r < 2; ++r)
#pragma unroll
    for (int j = 0; j < O_REGS / 4; ++j) {
      o[4 * j + 2 * r] *= alpha[r];
      o[4 * j + 2 * r + 1] *= alpha[r];
    }
}

// P (rounded to T) as P V's A fragments: keys 16 kk .. 16 kk + 15 are n8 blocks 2 kk and
// 2 kk + 1 of S.
template <class T, int KEYS>
__device__ __forceinline__ void pack_p(const float (&s)[KEYS / 2], unsigned (&pa)[KEYS / 16][4]) {
#pragma unroll
  for (int kk = 0; kk < KEYS / 16; ++kk) scores_as_a_operand<T>(s + 8 * kk, pa[kk]);
}

// O += P V issued (not waited for); v is the V stage; without accumulate, O = P V (O's
// registers are not read: a block's first P V need not zero them). Every A fragment is packed
// before the first wgmma, so one fence covers them all. O is one m64n64 or m64n128
// accumulator, or (DV = 256) two m64n128 ones side by side, the second over V's halves 2 and 3.
// KEYS: the tile's first keys to take (issue_qk's), the rest having P = 0.
template <class T, class Tile, int KEYS = Tile::KEYS, int O_REGS>
__device__ __forceinline__ void issue_pv(float (&o)[O_REGS], const unsigned (&pa)[Tile::KEYS / 16][4], unsigned v,
                                         bool accumulate = true) {
  constexpr int kSlab = O_REGS < 64 ? O_REGS : 64;  // accumulators of one wgmma
  const unsigned long long v_desc = mn_major_desc(v, Tile::KV_HALF);
  wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < KEYS / 16; ++kk)
#pragma unroll
    for (int n = 0; n < O_REGS / kSlab; ++n)
      wgmma_rs<T>(*reinterpret_cast<float(*)[kSlab]>(o + n * kSlab), pa[kk],
                  desc_at(v_desc, n * 2 * Tile::KV_HALF + kk * 16 * 128), kk > 0 || accumulate);
  wgmma_commit();
}

// Columns 8 j + 2 (lane & 3) and the next of accumulator row r (0: my_row, 1: my_row + 8),
// times inv and rounded to T, packed (exactly 0 for an empty row, whatever O holds). One select
// of the packed pair rather than one an element: 64 fewer instructions an epilogue at D128.
template <class T, int N>
__device__ __forceinline__ unsigned normalised_pair(const float (&o)[N], int j, int r, float inv) {
  const unsigned pair = pack2<T>(o[4 * j + 2 * r] * inv, o[4 * j + 2 * r + 1] * inv);
  return inv == 0.f ? 0u : pair;
}

// This thread's row `row` (my_row or my_row + 8) finished: the quad's partial sums reduced (fixed
// xor order; every lane takes part), its LSE stored, and the factor that normalises it returned;
// 0 for a row past seq_q, which stores nothing. b, q_tok0 and seq_q are the tile's, read once by
// the caller.
__device__ __forceinline__ float finish_my_row(const FlashFwdParams& p, int b, long long q_tok0, int seq_q, int h,
                                               float row_max, float row_sum, int row, int lane) {
  const float sum = quad_sum(row_sum);
  if (row >= seq_q) return 0.f;
  if (p.lse != nullptr && (lane & 3) == 0) store_lse(p, b, q_tok0, h, row, row_lse(row_max, sum));
  return row_inverse(p, h, row_max, sum);
}

// Finish where 16-byte output stores are not safe (the plan's vector_io is 0: an output off 16
// bytes, or dim_v not a multiple of 8): this thread's rows my_row and my_row + 8 of head h, each
// through finish_my_row, their first dim_v columns stored two bytes at a time (D may be padded).
template <class T, int D>
__device__ __forceinline__ void store_rows_unaligned(const FlashFwdParams& p, const TileRef& st, int h,
                                                     const float (&o)[D / 2], const float (&row_max)[2],
                                                     const float (&row_sum)[2], int my_row, int lane) {
  const int seq_q = st.seq_q(), b = st.b();
  const long long q_tok0 = st.q_tok0();
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = my_row + 8 * r;
    const float inv = finish_my_row(p, b, q_tok0, seq_q, h, row_max[r], row_sum[r], row, lane);
    if (row >= seq_q) continue;
    unsigned short* go16 = reinterpret_cast<unsigned short*>(static_cast<T*>(p.o) + b * p.o_batch_stride +
                                                              h * p.o_head_stride + (q_tok0 + row) * p.o_seq_stride);
#pragma unroll
    for (int j = 0; j < D / 8; ++j) {
      const int col = j * 8 + 2 * (lane & 3);
      const unsigned pair = normalised_pair<T>(o, j, r, inv);
      if (col < p.dim_v) go16[col] = static_cast<unsigned short>(pair);
      if (col + 1 < p.dim_v) go16[col + 1] = static_cast<unsigned short>(pair >> 16);
    }
  }
}

// A warpgroup's 64 rows where the plan's vector_io holds, finished (finish_my_row: LSE stored)
// and rounded to T, into the warpgroup's own rows of the Q tile (q_group: free once its last
// wgmma was waited for, and DV <= DQK) in Q's swizzled layout by stmatrix (8 a warp at D128
// where there were 32 4-byte stores and their addresses); store_rows_staged or (persistent
// twins) flash_fwd_sm90_ws.cuh's store_rows_tma takes them out from there.
template <class T, class Tile>
__device__ __forceinline__ void stage_rows(const FlashFwdParams& p, const TileRef& st, int h,
                                           const float (&o)[Tile::DV / 2], const float (&row_max)[2],
                                           const float (&row_sum)[2], unsigned q_group, int group_row0, int my_row,
                                           int lane) {
  constexpr int DV = Tile::DV;
  static_assert(DV <= Tile::DQK, "O's rows fit in the warpgroup's rows of Q");
  const int seq_q = st.seq_q(), b = st.b();
  const long long q_tok0 = st.q_tok0();
  float inv[2];
#pragma unroll
  for (int r = 0; r < 2; ++r)
    inv[r] = finish_my_row(p, b, q_tok0, seq_q, h, row_max[r], row_sum[r], my_row + 8 * r, lane);
  // The warp's 16 rows by two 16-byte chunks (2k, 2k + 1) at a time, one stmatrix: matrix m is
  // rows 8 (m % 2) .. of chunk 2k + m / 2, so lane l gives row 8 ((l / 8) % 2) + l % 8 of chunk
  // 2k + l / 16. Its row keeps one swizzle phase, so chunk 2k + l / 16's address is chunk
  // l / 16's with bits 5-6 XORed by k % 4, plus k / 4 panels.
  const int lane_row = ((my_row - group_row0) & ~15) + 8 * ((lane >> 3) & 1) + (lane & 7);
  const unsigned lane_addr = q_group + sw128_offset<Tile::ROWS>(lane_row, lane >> 4);
#pragma unroll
  for (int k = 0; k < DV / 16; ++k)
    stmatrix_x4((lane_addr ^ ((k % 4) << 5)) + (k / 4) * (Tile::ROWS * 128), normalised_pair<T>(o, 2 * k, 0, inv[0]),
                normalised_pair<T>(o, 2 * k, 1, inv[1]), normalised_pair<T>(o, 2 * k + 1, 0, inv[0]),
                normalised_pair<T>(o, 2 * k + 1, 1, inv[1]));
}

// Finish through shared memory (stage_rows), then out as 16-byte stores, consecutive threads
// along a row (straight from the accumulators a warp's 4-byte stores would spread over 8 rows:
// flash_fwd_notes v18). `barrier` is a named barrier of the warpgroup's own. Outputs and LSE
// rounded as store_rows_unaligned's.
template <class T, class Tile>
__device__ __forceinline__ void store_rows_staged(const FlashFwdParams& p, const TileRef& st, int h,
                                                  const float (&o)[Tile::DV / 2], const float (&row_max)[2],
                                                  const float (&row_sum)[2], unsigned q_group, int group_row0,
                                                  int my_row, int lane, unsigned barrier) {
  constexpr int CHUNKS = Tile::DV / 8;  // 16-byte chunks an output row
  stage_rows<T, Tile>(p, st, h, o, row_max, row_sum, q_group, group_row0, my_row, lane);
  named_bar_sync(barrier, 128);
  const int seq_q = st.seq_q(), b = st.b();
  const long long q_tok0 = st.q_tok0();
  // Thread t takes chunk c = t % CHUNKS of rows r0 = t / CHUNKS, r0 + PASS, ...; where PASS is a
  // multiple of 8 its rows keep one swizzle phase, so its shared address steps by a constant as
  // its global one does, and the stores past seq_q or dim_v are predicated off rather than
  // branched around (each 16-byte chunk had rebuilt both addresses: ~17 instructions, now ~5).
  constexpr int PASS = 128 / CHUNKS;  // rows a pass of the warpgroup's threads
  static_assert(128 % CHUNKS == 0, "whole rows a pass");
  const int t = threadIdx.x & 127, r0 = t / CHUNKS, c = t % CHUNKS;
  const int rows = c * 8 < p.dim_v ? seq_q - group_row0 - r0 : 0;  // of r0, r0 + 1, ...: those to store
  T* dst = static_cast<T*>(p.o) + b * p.o_batch_stride + h * p.o_head_stride +
           (q_tok0 + group_row0 + r0) * p.o_seq_stride + c * 8;
  const long long step = PASS * p.o_seq_stride;
#pragma unroll
  for (int i = 0; i < 64 / PASS; ++i) {
    const unsigned src = PASS % 8 == 0 ? q_group + sw128_offset<Tile::ROWS>(r0, c) + i * PASS * 128
                                       : q_group + sw128_offset<Tile::ROWS>(r0 + i * PASS, c);
    st_global_16_if(dst + i * step, ld_shared_16(src), i * PASS < rows);
  }
}

extern __shared__ __align__(1024) unsigned char smem[];

// PAGED: K and V in a paged pool (a kernel of its own: the paged copies' registers made the
// d128 kernel spill beside O and S, paged or not). GENERAL: the per-element score path of
// flash_fwd.cu's general kernels (masks, softcap, any scale); otherwise scale > 0 and the
// only cut keys are those outside each row's causal/window range or past Skv. FP8: K and V
// are fp8 (kv_fp8) with their scales, packed or paged alike (PAGED is false).
template <class T, class Tile, bool PAGED, bool GENERAL, bool FP8>
__device__ __forceinline__ void flash_fwd_wgmma(const FlashFwdParams& p) {
  constexpr int DQK = Tile::DQK, DV = Tile::DV, ROWS = Tile::ROWS, KEYS = Tile::KEYS, THREADS = Tile::THREADS;
  constexpr int O_REGS = DV / 2;  // fp32 accumulators of O a thread
  static_assert(!FP8 || (DQK == DV && Tile::SHARED + Tile::FP8_STAGING <= 227 * 1024 - 4096),
                "fp8 kernels: square head dims, and the staging area beside the stages");
  const unsigned base = (smem_u32(smem) + 1023) & ~1023u;
  const unsigned q_addr = base;
  auto k_addr = [&](int stage) { return base + Tile::Q_BYTES + stage * (Tile::K_BYTES + Tile::V_BYTES); };
  auto v_addr = [&](int stage) { return k_addr(stage) + Tile::K_BYTES; };

  const int tid = threadIdx.x, group = tid >> 7, lane = tid & 31, warp_in_group = (tid >> 5) & 3;
  __shared__ SeqTile tile_info;
  __shared__ int tile_found;
  __shared__ int page_ids[2][KEYS];  // paged pools: a tile's page ids, two tiles in flight
  // fp8: each stage's keys' K and V scales, and the next tile's as staged.
  __shared__ __align__(16) float key_scales[2][2][FP8 ? KEYS : 1];
  __shared__ float staged_scales[2][FP8 ? KEYS : 1];
  if (!resolve_tile<ROWS>(p, tile_info, tile_found)) return;
  const TileRef st{tile_info};
  const int m0 = st.m0(), h = st.h();
  const int hk = h / (p.heads_q / p.heads_kv);

  int tile_begin, tile_end;
  block_key_tile_range<ROWS, KEYS>(st.seq_kv(), st.window(p), m0, st.seq_q(), tile_begin, tile_end);

  // Paged, the batch strides step pages.
  const T* gk = static_cast<const T*>(p.k) +
                (PAGED ? 0 : st.b() * p.k_batch_stride + st.k_tok0() * p.k_seq_stride) + hk * p.k_head_stride;
  const T* gv = static_cast<const T*>(p.v) +
                (PAGED ? 0 : st.b() * p.v_batch_stride + st.k_tok0() * p.v_seq_stride) + hk * p.v_head_stride;
  // fp8: copies tile `tile`'s K and V bytes and scales into the staging area.
  const unsigned staging = base + Tile::SHARED - 1024;
  auto stage_fp8 = [&](int tile) {
    if constexpr (FP8) {
      const int n0 = tile * KEYS, rows_valid = st.seq_kv() - n0;
      stage_fp8_rows<KEYS, DQK, THREADS>(staging, staged_scales[0], p, fp8_rows<false>(p, hk), st.b(), st.k_tok0(), n0,
                                       rows_valid);
      stage_fp8_rows<KEYS, DQK, THREADS>(staging + KEYS * DQK, staged_scales[1], p, fp8_rows<true>(p, hk), st.b(),
                                       st.k_tok0(), n0, rows_valid);
    }
  };
  // Strided K/V of 16-bit inputs: any alignment (vector_io may be 0). Paged pools and fp8
  // calls are aligned (the host sends others to mma.sync), which spares their registers.
  constexpr bool ANY_ALIGNMENT = !PAGED && !FP8;
  // Copies tile `tile`'s K and V into `stage` (and, paged, the page ids of the tile after it).
  // fp8: converts the staged tile `tile` into `stage` and stages the tile after it.
  auto load_kv = [&](int stage, int tile) {
    const int n0 = tile * KEYS, seq_kv = st.seq_kv();
    if constexpr (FP8) {
      convert_fp8_rows<T, KEYS, DQK, THREADS>(k_addr(stage), key_scales[stage][0], staging, staged_scales[0], p.kv_fp8);
      convert_fp8_rows<T, KEYS, DQK, THREADS>(v_addr(stage), key_scales[stage][1], staging + KEYS * DQK,
                                            staged_scales[1], p.kv_fp8);
      if (tile + 1 < tile_end) stage_fp8(tile + 1);
      return;
    }
    if constexpr (PAGED) {
      const int b = st.b();
      load_paged_kv<T, KEYS, DQK, DV, THREADS>(k_addr(stage), v_addr(stage), p, gk, gv, page_ids[tile & 1], b, n0,
                                         seq_kv - n0);
      // page_ids[(tile + 1) & 1] was last read by the copies of tile - 1, before the barrier
      // that precedes this call.
      if (tile + 1 < tile_end) fetch_page_ids<KEYS>(page_ids[(tile + 1) & 1], p, b, n0 + KEYS, seq_kv);
      return;
    }
    load_tile_checked<T, KEYS, DQK, THREADS, ANY_ALIGNMENT>(p, k_addr(stage), gk + n0 * p.k_seq_stride, p.k_seq_stride,
                                                            seq_kv - n0, p.dim_qk);
    load_tile_checked<T, KEYS, DV, THREADS, ANY_ALIGNMENT>(p, v_addr(stage), gv + n0 * p.v_seq_stride, p.v_seq_stride,
                                                           seq_kv - n0, p.dim_v);
  };

  // This thread's rows: my_row and my_row + 8 (accumulator registers 4j + {0,1} / {2,3}).
  const int group_row0 = m0 + group * 64;
  const int my_row = group_row0 + warp_in_group * 16 + (lane >> 2);
  float o[O_REGS];
#pragma unroll
  for (int i = 0; i < O_REGS; ++i) o[i] = 0.f;
  float row_max[2] = {neg_inf(), neg_inf()}, row_sum[2] = {0.f, 0.f};
  const float mul = softmax_mul<GENERAL>(p);

  if (tile_begin < tile_end) {
    const T* gq = static_cast<const T*>(p.q) + st.b() * p.q_batch_stride + h * p.q_head_stride +
                  (st.q_tok0() + m0) * p.q_seq_stride;
    if constexpr (PAGED) {  // the first tile's page ids, before its copies
      fetch_page_ids<KEYS>(page_ids[tile_begin & 1], p, st.b(), tile_begin * KEYS, st.seq_kv());
      cp_async_commit();
      cp_async_wait<0>();
      __syncthreads();
    }
    load_tile_checked<T, ROWS, DQK, THREADS, ANY_ALIGNMENT>(p, q_addr, gq, p.q_seq_stride, st.seq_q() - m0, p.dim_qk);
    if constexpr (FP8) {  // the first tile's bytes, before its conversion
      stage_fp8(tile_begin);
      cp_async_commit();
      cp_async_wait<0>();
    }
    load_kv(0, tile_begin);
    cp_async_commit();

    // This warpgroup's 64 rows of Q: rows 64 * group of each half.
    const unsigned q_group = q_addr + group * 64 * 128;
    for (int t = tile_begin; t < tile_end; ++t) {
      const int stage = (t - tile_begin) & 1;
      cp_async_wait<0>();
      fence_proxy_async();
      __syncthreads();  // tile t landed for everyone; tile t - 1's stage is free to refill
      auto load_next = [&] {
        if (t + 1 < tile_end) load_kv(stage ^ 1, t + 1);
        cp_async_commit();
      };
      // fp8 kernels load the next tile once S's wgmmas are issued: its conversion then runs
      // beside them.
      if constexpr (!FP8) load_next();
      // Every thread copies the CTA's key tiles, but a warpgroup computes only on those its
      // own rows see (none past the end): on causal diagonals and short last tiles the
      // others have the tensor cores to themselves. Skipping a tile whose keys are all cut
      // leaves the results' bits as they were. (The vote tells the compiler the branch is
      // warp-uniform: a plain `if` cost the d128 kernel 16 bytes of spills.)
      if (__all_sync(0xffffffffu, !rows_see_tile<KEYS>(st, p, group_row0, 64, t))) {
        if constexpr (FP8) load_next();
        continue;
      }

      float s[KEYS / 2];
      issue_qk<T, Tile>(s, q_group, k_addr(stage));
      if constexpr (FP8) load_next();
      wgmma_wait_all();
      fence_registers(s);

      // General kernels turn every score into a base-2 logit; then the keys outside a row's
      // causal/window range or past Skv are cut, on the tiles that have any.
      const int n0 = t * KEYS, seq_kv = st.seq_kv();
      const KeyWindow win = st.window(p);
      if constexpr (FP8) scale_by_key<KEYS / 8>(s, key_scales[stage][0], lane);
      if constexpr (GENERAL) general_scores<KEYS / 8>(s, p, st.b(), h, my_row, st.seq_q(), n0 + 2 * (lane & 3), seq_kv);
      cut_keys<KEYS>(s, win, n0, seq_kv, group_row0, my_row, lane);

      float alpha[2];
      online_softmax<KEYS, O_REGS, true, Tile::LAZY_RESCALE>(s, o, row_max, row_sum, mul, alpha);

      if constexpr (FP8) scale_by_key<KEYS / 8>(s, key_scales[stage][1], lane);  // row sums taken: V's scales into P

      unsigned pa[KEYS / 16][4];
      pack_p<T, KEYS>(s, pa);
      issue_pv<T, Tile>(o, pa, v_addr(stage));
      wgmma_wait_all();
      fence_registers(o);
    }
  }

  if (ANY_ALIGNMENT && !p.vector_io)
    store_rows_unaligned<T, DV>(p, st, h, o, row_max, row_sum, my_row, lane);
  else
    store_rows_staged<T, Tile>(p, st, h, o, row_max, row_sum, q_addr + group * 64 * 128, group_row0, my_row, lane,
                               1 + group);  // the kernel's only named barriers
}

}  // namespace sm90
}  // namespace ptxattn

// ---- entry points: the flash_fwd_sm90 table of cu/variants.json ---------------------------
// scripts/build_ptx.py compiles this file with variants.inc made from it, one FLASH_FWD_SM90
// (or, fp8 variants, FLASH_FWD_SM90_FP8) line a variant and dtype.
#define PTXATTN_SM90_ENTRY(NAME, T, DQK, DV, GROUPS, KEYS, PAGED, GENERAL, FP8)                              \
  extern "C" __global__ void __launch_bounds__(ptxattn::sm90::Sm90Tile<DQK, DV, GROUPS, KEYS>::THREADS, 1)    \
      NAME(const ptxattn::FlashFwdParams p) {                                                              \
    ptxattn::sm90::flash_fwd_wgmma<T, ptxattn::sm90::Sm90Tile<DQK, DV, GROUPS, KEYS>, PAGED, GENERAL, FP8>(p); \
  }
// NAME reads K and V through strides (dense and ragged calls), NAME##_paged through a block table.
#define FLASH_FWD_SM90(NAME, T, DQK, DV, GROUPS, KEYS, GENERAL)                \
  PTXATTN_SM90_ENTRY(NAME, T, DQK, DV, GROUPS, KEYS, false, GENERAL, false) \
  PTXATTN_SM90_ENTRY(NAME##_paged, T, DQK, DV, GROUPS, KEYS, true, GENERAL, false)
// NAME reads fp8 K and V, strided or paged (the fp8 loads look pages up themselves).
#define FLASH_FWD_SM90_FP8(NAME, T, D, GROUPS, GENERAL) PTXATTN_SM90_ENTRY(NAME, T, D, D, GROUPS, 128, false, GENERAL, true)

// Three warpgroups: while one runs its softmax the others keep the tensor cores busy.
// General kernels have two: their per-element mask and softcap work spilled hundreds of
// bytes at three warpgroups' 168-register cap.
// scripts/sdpa_tune.py on the H200 (bf16, kernels launched directly, one run), TFLOP/s with
// 2 / 3 warpgroups and FA2 in the same run: B4 H32 S4096 D128 410 / 456 (357), causal
// 377 / 407 (324), B2 Hq32 Hkv8 S8192 causal 402 / 459 (338), B1 Hq32 Hkv8 S16384 causal
// 428 / 473 (343), B8 H16 S2048 D64 310 / 356 (291). ptxas: 168 registers, no spills.
// fp8 kernels: general ones only (they run every serving call), to keep the PTX small.
// "ws" variants: the warp-specialized plain kernel of flash_fwd_sm90_ws.cuh (FLASH_FWD_SM90_WS).
#include "flash_fwd_sm90_ws.cuh"
#include "variants.inc"
