// Warp-specialized variant of flash_fwd_sm90.cu's plain and general kernels (issue 10):
// Dqk / Dv 64, 128, 192 / 128 and 256 (smaller dims zero-padded, multiples of 8), f16 / bf16,
// K/V through strides (dense and ragged calls; no paged, no fp8). Plain kernels take calls with no mask,
// no softcap and scale > 0; GENERAL ones (the "_general_ws" kernels) the rest, their scores
// made by general_scores as in flash_fwd_wgmma's general kernels. Same parameters and
// semantics as those kernels; query blocks of 64 GROUPS rows (grid x). Included by
// flash_fwd_sm90.cu after the per-tile steps it shares with flash_fwd_wgmma (issue_qk,
// general_scores, cut_keys, online_softmax, pack_p, issue_pv, stage_rows, store_rows_staged,
// named_bar_*).
//
// A CTA is 1 + GROUPS warpgroups: warpgroup 0 the producer, 1 .. GROUPS consumers of 64 query
// rows each (rows 64 (g - 1) .. of the block). setmaxnreg moves registers from the producer
// to the consumers: two consumers 40 / 232 (128 * 40 + 256 * 232 = 64512, the CTA's 384
// threads at 168), three 32 / 160 (65536, 512 threads at 128).
//
// Producer (128 threads; produce_tile: full tiles without per-copy checks): cp.async of the
// block's Q tile, then for each key tile t of the block's range [tile_begin, tile_end),
// i = t - tile_begin, into ring stage s = i % STAGES
// (its n-th use, n = i / STAGES): K(t) then V(t). Before refilling a stage (n > 0) it waits
// for that stage's K (or V) "empty" barrier to complete its use n - 1 (parity (n - 1) & 1).
// After issuing a tile's copies every producer thread does cp.async.mbarrier.arrive.noinc on
// the "full" barrier (count 128): the phase completes when all 128 threads' copies have
// landed. The producer never waits on a full barrier, waits for its own copies before it
// exits, and takes no part in any barrier after the role split.
// With p.tma (dense calls whose strides the host vouched for: runtime/tensor_map.py), thread
// 0 alone issues the same loads in the same order as TMA copies through the tensor maps in
// the parameters (tma_tile: an arrival expecting the tile's bytes, then one copy a 64-column
// panel), the full barriers count that one arrival, and the other producer threads exit at
// once; thread 0 exits after its last copy is issued (the consumers' waits on the full
// barriers keep the CTA alive until the copies land). tma implies a dense call (no token
// offsets: a block's rows start at m0, a tile's keys at t * KEYS). The layout is the same, and
// rows past the sequence's end (the map's last token) and columns past the head dim land as
// zeros as load_tile's do: the same bits either way.
// Staged masks (the STAGED_MASK twins of the general kernels, NAME ending _staged_mask, which
// the host runs for tma calls whose mask is f16, bf16 or bool and addressable by TMA:
// runtime/ops/attention.py): thread 0 also copies each key tile's mask tile (the block's ROWS
// query rows, or the one row of a mask that broadcasts its query axis, by the tile's KEYS keys,
// 128-byte swizzle) into the mask stage that follows the ring, through p.mask_map, its bytes
// expected on K's full barrier before K's arrival; the consumers read their bias from there
// (staged_mask_scores) instead of from global memory, where each tile's 32 loads a thread stood
// between S(t) and its softmax, and release K(t) only after making S(t)'s scores. Same sums,
// same bits. A twin of its own, not a branch of the general kernel: with both paths in one
// kernel, D128's spills grew from 8 to 124 bytes.
//
// Consumer (warpgroup g, rows r0 = m0 + 64 (g - 1)): its own tiles [my_begin, my_end) are the
// block's tiles its rows see (rows_see_tile; a contiguous range, since a row's visible keys
// are). Every consumer goes through every tile of the block's range in order: for a tile it
// does not compute it waits for K full, arrives on K empty, waits for V full, arrives on V
// empty (the wait keeps its arrival from counting towards the stage's previous use). Its own
// tiles run FA3's intra-warpgroup overlap:
//   S(b) = Q K(b); wait; softmax -> P(b)
//   for t in b+1 .. e-1: wait K(t) full; issue S(t) = Q K(t); wait V(t-1) full;
//                        issue O += P(t-1) V(t-1); wait S; release K(t); softmax(t) (alpha kept);
//                        wait O; release V(t-1); O *= alpha; P(t)
//   O += P(e-1) V(e-1); wait; release V(e-1)
// In the ping-pong kernels with 128-key tiles (Tile::NARROW_LAST; not their persistent twins), a
// warpgroup whose rows see no key of its last tile's second half (the causal diagonal's upper 64
// rows, or a sequence's end) scores, softmaxes and multiplies by V only that tile's first 64 keys
// (unless it is also its first: then only P V narrows). The keys left out would weigh exactly 0:
// same bits.
// ptxas moves "wait O" above the softmax (P(t)'s packing then starts beside the exponentials),
// so the softmax overlaps only the other consumers' wgmmas. With Tile::SOFTMAX_BESIDE_OWN_PV
// (Dv 256) it overlaps the warpgroup's own P V too: wait_after_softmax keeps "wait O" after
// it, and V(t-1) is waited for beside K(t), before S(t) is issued.
// The waits on full barriers are followed by fence.proxy.async where cp.async filled them
// (cp.async writes through the generic proxy, wgmma reads through the async one; one fence
// where K(t) and V(t-1) are waited for together); TMA's writes need none.
// A release is one arrival per warp (lane 0, after the warp's wgmma.wait_group): empty
// barriers count 4 * CONSUMERS.
// O sees the same operations in the same order as in flash_fwd_wgmma (its first rescale is of
// zeros, skipped here; then O += P V, O *= alpha, ... alternate exactly as there; in the
// persistent twins the first P V writes O where there it adds to zeros, the same sums but for
// the sign of an exact zero), and a skipped tile is one whose keys all its rows cut, which
// flash_fwd_wgmma skips too: outputs and LSE are bit-identical to the plain (general) kernel's
// (a twin's output zero may come out -0 where every product that made it was -0: V's -0.0s).
//
// Why no deadlock: phases of a stage's barriers alternate strictly (full n, empty n, full n+1,
// ...): the producer waits empty n - 1 before filling use n, and a consumer arrives on empty
// n only after full n. A consumer waiting on full(t) has released every tile before t - 1
// (its K(t-1) too); the producer filling tile t needs only releases of tile t - STAGES <=
// t - 2, which every consumer gives before it waits on anything of tile t (it waits for
// K(t) after releasing V(t-2) at the end of iteration t-1). The consumers never wait on each
// other, and no __syncthreads follows the role split (resolve_tile's comes before it).
//
// Ping-pong (Tile::PINGPONG, the "_ws_pp" kernels): the consumers take turns issuing their
// wgmmas, so one's GEMMs run on the tensor cores while the others do their softmax.
// Turns are numbered by the block's tiles, t = tile_begin .. tile_end (one more than its
// tiles; none when the block has no tile), the same for every consumer whatever tiles they
// compute: in turn t a consumer issues S(t) if t is its tile and P(t-1) V(t-1) if t - 1 is,
// nothing otherwise (a passed tile, or no tile of its own at all, is an empty turn). A turn is
//   wait on my named barrier (bar.sync id(g), 256); issue; arrive on the next consumer's
//   (bar.arrive id(next(g)), 256), next(g) = g % GROUPS + 1
// with id(g) = Tile::PP_BAR0 + g - 1 (ids 1 .. GROUPS: id 0 is __syncthreads'; the only other
// named barriers are the epilogue's, STORE_BAR0 + g - 1, one warpgroup's 128 threads each, which
// a persistent twin's consumer also waits on as each of its blocks starts),
// so the issue order is c1(t0), c2(t0), .., c1(t0+1), c2(t0+1), ..
// Consumer 1 skips the wait of its first turn and the last consumer the arrival of its last:
// each barrier then sees exactly as many bar.sync warpgroups as bar.arrive ones (barrier 1:
// N - 1 each, the others N each, N turns), and no barrier can complete on arrivals alone (an
// arrival of the next round comes only after the waiter's wait of this one). K(t)'s wait on
// its full barrier comes before turn t's wait, V(e-1)'s before turn e's, and V(t-1)'s inside
// turn t (before it, beside K(t)'s, with SOFTMAX_BESIDE_OWN_PV);
// passes (wait, release) sit between turns, pass(t) before turn t's wait (the tiles before
// a warpgroup's own) or turn t + 1's (those after).
// Why no deadlock, by induction over t: the only waits between a consumer's arrival of turn
// t - 1 and its arrival of turn t are on full barriers of tiles <= t and on turn t's named
// barrier; once every consumer has arrived in turn t - 1, each goes on to release every
// tile <= t - 2 without waiting on anything (wgmma waits, arrivals), so the producer, which
// needs only releases of tiles <= t - STAGES <= t - 2 to fill every tile <= t, fills them:
// all those full-barrier waits return. Consumer 1's named-barrier wait of turn t needs the
// last consumer's arrival of turn t - 1 (given); consumer g's (g > 1) needs consumer g - 1's
// of turn t, which follows only waits just shown to return (induction over g). (Base: turn
// tile_begin needs no release, and consumer 1 does not wait in it.) After the last turn
// nothing waits.
// Ping-pong moves no arithmetic: outputs stay bit-identical to the plain WS kernel's.
//
// Persistent twins (PERSISTENT, the "_persistent" kernels: plain D128 ping-pong, dense TMA calls;
// flash_fwd_notes v41, v43): gridDim.x CTAs, one an SM, run the blocks of the grid the kernel
// would otherwise be launched on (p.virtual_grid), each CTA those persistent_block deals it, one
// after another, with the same per-block steps as above. Two Q tiles: the CTA's i-th block's Q
// goes to Q tile i % 2, so the next block's Q loads while this one runs. Each consumer finds its
// blocks' rows itself (a dense call's rows follow from the block's index): its first thread
// writes block i + 1's into the consumer's own slot (i + 1) % 2 just after the consumer's barrier
// of block i, which every thread of it passes after its last read of block i - 1's slot, and
// block i + 1's barrier publishes them. So no data passes between warpgroups by mbarrier alone
// (compute-sanitizer's racecheck does not order generic accesses by mbarrier waits). The
// consumers stage a block's output rows in its Q tile as above, and each one's first thread
// stores its 64 rows by TMA (store_rows_tma, through p.o_map, which the host builds for the
// twin: an output TMA cannot store to gets no twin; a fence.proxy.async orders the stmatrix
// writes before the store's reads); after the consumer's barrier of block i + 1 that thread
// waits until the store has read them and every consumer warp arrives on the tile's empty
// barrier (after a fence.proxy.async, as TMA writes it next), which thread 0 waits on before
// loading block i + 2 there. Every block's Q is loaded, one with no key tile too, so the Q
// tiles' phases stay in step. The K / V ring runs on from block to block (KeyRing counts the
// CTA's tiles), and so do the turns: the last consumer also arrives after each block's last
// turn, consumer 1 waits in each block's first turn but the CTA's first, and it takes the last
// arrival after the CTA's last block, so every named barrier sees as many bar.sync warpgroups as
// bar.arrive ones. The deadlock argument above holds across blocks, the turns being numbered on
// through the CTA's blocks (a consumer's own barrier waits only on its own warps). Same bits as
// the non-persistent kernel.
#pragma once

namespace ptxattn {
namespace sm90 {

// One warp-specialized variant: head dims DQK (Q, K) and DV (V, O), KEYS keys a K/V tile,
// STAGES K/V stages in the ring, GROUPS consumers of 64 query rows. Shared memory holds Q
// (64 GROUPS rows), then STAGES stages of (K, V); base rounded up to 1024.
template <int DQK_, int DV_, int KEYS_, int STAGES_, int GROUPS_>
struct WsTile : TileGeometry<DQK_, DV_, 64 * GROUPS_, KEYS_> {
  using Geometry = TileGeometry<DQK_, DV_, 64 * GROUPS_, KEYS_>;
  static constexpr int STAGES = STAGES_;
  static constexpr int CONSUMERS = GROUPS_;
  static constexpr int THREADS = 128 * (CONSUMERS + 1);
  static constexpr int SHARED = Geometry::Q_BYTES + STAGES * (Geometry::K_BYTES + Geometry::V_BYTES) + 1024;
  // A stage's mask tile in the STAGED_MASK twins, after the ring: room for a tile's rows by its
  // keys of a 16-bit mask (a bool or query-broadcast one takes less of it).
  static constexpr int MASK_STAGE_BYTES = 64 * GROUPS_ * KEYS_ * 2;
  // Three consumers need 160 a thread (at 152 ptxas serialized their wgmmas, warning C7512),
  // so the producer keeps 32 there (40 spilled nothing beside two consumers; 24 spilled 72 B).
  static constexpr int PRODUCER_REGS = CONSUMERS == 3 ? 32 : 40, CONSUMER_REGS = CONSUMERS == 3 ? 160 : 232;
  static_assert(CONSUMERS == 2 || CONSUMERS == 3, "two or three consumers");
  static constexpr int PRODUCER_UNROLL = 4;  // copies a producer thread's loop issues unrolled
  static_assert(STAGES >= 2, "the consumers hold two stages at once");
  static_assert(SHARED <= 227 * 1024 - 1024, "sm_90 opt-in shared memory per block, less 1 KB static");
  // setmaxnreg only moves registers within those the CTA was launched with (its threads at the
  // launch-bounds cap, 65536 / THREADS rounded down to 8): asking for more hangs setmaxnreg.inc
  // (48 / 232, within the SM's 65536 but over the CTA's 64512, hung on the H200).
  static_assert(128 * PRODUCER_REGS + 128 * CONSUMERS * CONSUMER_REGS <= THREADS * (65536 / THREADS / 8 * 8),
                "the CTA's registers");
  static constexpr bool PINGPONG = false;
  // Whether a consumer's softmax of tile t runs beside its own P(t-1) V (FA3's intra-warpgroup
  // overlap; see the key loop). Only at Dv 256, where a P V is twice as long: on the H100 it
  // took S8192 D256 from 690 to 758 TFLOP/s, but cost the D128 and D64 rows 1-8 % and did
  // nothing for 192 / 128 (flash_fwd_notes v29).
  static constexpr bool SOFTMAX_BESIDE_OWN_PV = DV_ == 256;
  // Whether a plain kernel's consumer takes its last tile's first half alone where its rows see
  // no key of the second (the causal diagonal's upper rows; see the key loop): the ping-pong
  // kernels' (WsPingPongTile) with 128-key tiles, not their persistent twins, where a half is a
  // whole m64n64 wgmma and four k16 steps of P V. In the D64 and 192 / 128 kernels without
  // ping-pong ptxas then serialized the wgmmas (C7511: too few registers for their pipeline).
  static constexpr bool NARROW_LAST = false;
  // Named barriers (0 is __syncthreads'): consumer g's ping-pong turns (WsPingPongTile) are
  // PP_BAR0 + g - 1, its epilogue's (store_rows_staged) STORE_BAR0 + g - 1.
  static constexpr int PP_BAR0 = 1, STORE_BAR0 = PP_BAR0 + 3;
  static_assert(STORE_BAR0 >= PP_BAR0 + CONSUMERS, "the epilogue's barriers follow the turns'");
};

// The same variant with the consumers' ping-pong (a tile type of its own rather than a
// parameter of flash_fwd_ws, so the plain WS kernels' PTX keeps its names and bytes).
template <int DQK_, int DV_, int KEYS_, int STAGES_, int GROUPS_>
struct WsPingPongTile : WsTile<DQK_, DV_, KEYS_, STAGES_, GROUPS_> {
  static constexpr bool PINGPONG = true;
  // 192- and 256-wide producers spill at 40 registers (48 B at 192 / 128, in the copy loop).
  static constexpr int PRODUCER_REGS = DQK_ > 128 ? 56 : WsTile<DQK_, DV_, KEYS_, STAGES_, GROUPS_>::PRODUCER_REGS;
  static constexpr int CONSUMER_REGS = DQK_ > 128 ? 224 : WsTile<DQK_, DV_, KEYS_, STAGES_, GROUPS_>::CONSUMER_REGS;
  static constexpr bool NARROW_LAST = KEYS_ == 128;
  static_assert(128 * PRODUCER_REGS + 128 * GROUPS_ * CONSUMER_REGS <= 65536, "the CTA's registers");
};
template <int DQK, int DV, int KEYS, int STAGES, int GROUPS, bool PINGPONG>
struct WsTileFor {
  using type = WsTile<DQK, DV, KEYS, STAGES, GROUPS>;
};
template <int DQK, int DV, int KEYS, int STAGES, int GROUPS>
struct WsTileFor<DQK, DV, KEYS, STAGES, GROUPS, true> {
  using type = WsPingPongTile<DQK, DV, KEYS, STAGES, GROUPS>;
};

// A count of keys as a type: the key loop's steps are generic lambdas over a tile's width.
template <int N>
struct Width {
  static constexpr int value = N;
};

// ---- mbarrier and setmaxnreg wrappers ---------------------------------------------------
__device__ __forceinline__ void mbar_init(unsigned bar, unsigned count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_fence_init() {
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}
__device__ __forceinline__ void mbar_arrive(unsigned bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
// One arrival once every cp.async this thread issued so far has landed (the count must
// include it: .noinc).
__device__ __forceinline__ void mbar_arrive_cp_async(unsigned bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(bar) : "memory");
}
// TMA (tma 1): copies the PANELS panels of a tile (ROWS rows of 128 bytes, PANEL_COLS elements:
// 64 of a 16-bit element, 128 of a byte; 128-byte swizzle: sw128_offset's layout, panel p at
// dst + p ROWS 128) from `map` at (col0 + PANEL_COLS p, row, head, batch), their bytes completing
// on `bar`. Rows past the map's tokens and columns past its dim arrive as zeros.
template <int ROWS, int PANELS, int PANEL_COLS = 64>
__device__ __forceinline__ void tma_panels(unsigned dst, const TensorMap& map, int col0, int row, int head, int batch,
                                           unsigned bar) {
#pragma unroll
  for (int panel = 0; panel < PANELS; ++panel)
    asm volatile(
        "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
        " [%0], [%1, {%2, %3, %4, %5}], [%6];\n" ::"r"(dst + panel * ROWS * 128),
        "l"(reinterpret_cast<unsigned long long>(&map)), "r"(col0 + PANEL_COLS * panel), "r"(row), "r"(head),
        "r"(batch), "r"(bar)
        : "memory");
}
// One thread arrives on a tile's full barrier expecting the tile's bytes, then copies the tile
// (columns from 0); the barrier's phase completes when they land.
template <class T, int ROWS, int D>
__device__ __forceinline__ void tma_tile(unsigned dst, const TensorMap& map, int row, int head, int batch,
                                         unsigned bar) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar),
               "n"(ROWS * D * static_cast<int>(sizeof(T)))
               : "memory");
  tma_panels<ROWS, D / 64>(dst, map, 0, row, head, batch, bar);
}
// TMA store (the persistent twins' epilogue): the PANELS 128-byte panels at src (panel p at src
// + p PANEL_BYTES, 128-byte swizzle) to `map` at (64 p, row, head, batch), the box's rows each,
// as one bulk group; rows past the map's tokens are not written.
template <int PANELS, int PANEL_BYTES>
__device__ __forceinline__ void tma_store_panels(unsigned src, const TensorMap& map, int row, int head, int batch) {
#pragma unroll
  for (int panel = 0; panel < PANELS; ++panel)
    asm volatile("cp.async.bulk.tensor.4d.global.shared::cta.bulk_group [%0, {%1, %2, %3, %4}], [%5];\n" ::"l"(
                     reinterpret_cast<unsigned long long>(&map)),
                 "r"(64 * panel), "r"(row), "r"(head), "r"(batch), "r"(src + panel * PANEL_BYTES)
                 : "memory");
  asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
}
// Waits until this thread's TMA stores have read their shared memory (it may be written again).
__device__ __forceinline__ void tma_store_wait_read() { asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory"); }
// The persistent twins' epilogue: the warpgroup's rows staged in the Q tile (stage_rows) go out
// by its first thread's TMA store through p.o_map (the host launches a twin only with it;
// dense, so the block's rows are the map's tokens). That thread waits for the store's reads of
// the tile before its warp frees the tile (the persistent loop's release_q).
template <class T, class Tile>
__device__ __forceinline__ void store_rows_tma(const FlashFwdParams& p, const TileRef& st,
                                               const float (&o)[Tile::DV / 2], const float (&row_max)[2],
                                               const float (&row_sum)[2], unsigned q_group, int group_row0,
                                               int my_row, int lane, unsigned barrier) {
  stage_rows<T, Tile>(p, st, st.h(), o, row_max, row_sum, q_group, group_row0, my_row, lane);
  fence_proxy_async();  // stmatrix's writes before the TMA unit reads them
  named_bar_sync(barrier, 128);
  if ((threadIdx.x & 127) == 0)
    tma_store_panels<Tile::DV / 64, Tile::ROWS * 128>(q_group, p.o_map, group_row0, st.h(), st.b());
}
// Raises the bytes the barrier's current phase waits for, without an arrival: copies that
// complete on the barrier beside a tma_tile's, issued before its arrival.
__device__ __forceinline__ void mbar_expect_tx(unsigned bar, unsigned bytes) {
  asm volatile("mbarrier.expect_tx.relaxed.cta.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void prefetch_tensor_map(const TensorMap& map) {
  asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<unsigned long long>(&map)) : "memory");
}
// Waits for the completion of the barrier's phase of parity `parity`.
__device__ __forceinline__ void mbar_wait(unsigned bar, unsigned parity) {
  asm volatile(
      "{\n.reg .pred done;\nWS_WAIT:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra WS_WAIT;\n}\n" ::"r"(bar),
      "r"(parity)
      : "memory");
}
template <int N>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
// Keeps the key loop's wait for P(t-1) V, and P(t)'s packing behind it, after tile t's softmax.
// Left alone, ptxas hoists the wait above the softmax so that the packing (which overwrites
// the registers the P V still in flight reads) can start beside the exponentials: in every
// ws_pp kernel's SASS the wait came before the first MUFU, so a warpgroup's softmax never
// overlapped its own P V. A branch on the row sum, never taken (a sum is >= 0 or NaN), ends
// the softmax's block, and ptxas does not move the wait above it.
__device__ __forceinline__ void wait_after_softmax(float row_sum) {
  if (row_sum == -1.f) asm volatile("nanosleep.u32 0;\n");
}
template <int N>
__device__ __forceinline__ void setmaxnreg_dec() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(N));
}
template <int N>
__device__ __forceinline__ void setmaxnreg_inc() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(N));
}

// A base-2 score plus one staged mask element's bias, in the operations add_mask's `s +=
// mask_bias_log2(x)` compiles to in the general kernels (bool: + 0 or -inf; additive: one fused
// multiply-add of the element and log2 e): pinned here, where left to the compiler the twins
// fused the score's scaling instead and 30 to 9647 outputs of a call came out an ulp off the
// general kernels' (the ws tests compare the two bit for bit).
__device__ __forceinline__ float plus_mask_bias(float s, unsigned char keep) { return s + mask_bias_log2(keep); }
template <class M>
__device__ __forceinline__ float plus_mask_bias(float s, M value) { return __fmaf_rn(to_float(value), kLog2e, s); }

// Adds a mask tile the producer staged in shared memory (STAGED_MASK) to a thread's scores: rows
// of KEYS elements of M (bool or 16-bit) in 128-byte panels as tma_panels lays them out, the
// 128-byte swizzle moving 16-byte chunks by the row's low three bits. The thread's keys are
// 8 j + 2 (lane & 3) of its rows row0 and row1 of the tile, as in add_mask, which gives the same
// sums from the mask in global memory.
template <class M, int ROWS, int N8>
__device__ __forceinline__ void add_staged_mask(float* s, const unsigned char* tile, int row0, int row1, int lane) {
  using Pair = typename MaskPair<M>::type;
  constexpr int PANEL_COLS = 128 / sizeof(M);
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = r ? row1 : row0;
#pragma unroll
    for (int j = 0; j < N8; ++j) {
      const int col = 8 * j;  // the lane's pair starts 2 (lane & 3) elements in: within col's chunk
      const int chunk_byte = (col % PANEL_COLS) * static_cast<int>(sizeof(M));
      const int offset = col / PANEL_COLS * ROWS * 128 + row * 128 + (chunk_byte ^ ((row & 7) << 4)) +
                         2 * static_cast<int>(sizeof(M)) * (lane & 3);
      const Pair x = *reinterpret_cast<const Pair*>(tile + offset);
      s[4 * j + 2 * r] = plus_mask_bias(s[4 * j + 2 * r], x.x);
      s[4 * j + 2 * r + 1] = plus_mask_bias(s[4 * j + 2 * r + 1], x.y);
    }
  }
}
// The bytes of a stage's staged mask tile: its rows (1 where the mask broadcasts its query axis:
// every row reads that one) by KEYS elements of the mask's type.
template <int ROWS, int KEYS>
__device__ __forceinline__ unsigned staged_mask_bytes(const FlashFwdParams& p) {
  return (p.mask_query_stride ? ROWS : 1) * KEYS * (p.mask_kind == MASK_BOOL ? 1 : 2);
}
// Bool masks are staged only where a key tile's keys fill 128-byte panels of them; the host
// (staged_mask_map) stages none at other tile widths, so there neither side has a bool path.
template <int KEYS>
__device__ constexpr bool stages_bool_mask() { return KEYS % 128 == 0; }
// The producer's copies of key tile t's mask tile (the block's rows from m0, or the one row of a
// query-broadcast mask) into a stage, completing on `bar`.
template <int ROWS, int KEYS>
__device__ __forceinline__ void stage_mask_tile(const FlashFwdParams& p, unsigned dst, int t, int m0, int h, int b,
                                                unsigned bar) {
  const int row = p.mask_query_stride ? m0 : 0;
  const int head = p.mask_head_stride ? h : 0, batch = p.mask_batch_stride ? b : 0;
  if (p.mask_kind == MASK_BOOL) {
    if constexpr (stages_bool_mask<KEYS>()) tma_panels<ROWS, KEYS / 128, 128>(dst, p.mask_map, t * KEYS, row, head, batch, bar);
  } else {
    tma_panels<ROWS, KEYS / 64>(dst, p.mask_map, t * KEYS, row, head, batch, bar);
  }
}
// general_scores with the mask's bias from a staged tile (the host stages bool, f16 and bf16
// masks, so there is always one). row: the thread's first row of the block (its second is row + 8).
template <int ROWS, int N8>
__device__ __forceinline__ void staged_mask_scores(float* s, const FlashFwdParams& p, const unsigned char* tile,
                                                   int row, int lane) {
  scores_then_mask<N8>(s, p, [&] {
    const int row0 = p.mask_query_stride ? row : 0, row1 = p.mask_query_stride ? row + 8 : 0;
    if (p.mask_kind == MASK_BOOL) {
      if constexpr (stages_bool_mask<8 * N8>()) add_staged_mask<unsigned char, ROWS, N8>(s, tile, row0, row1, lane);
    } else if (p.mask_kind == MASK_F16) {
      add_staged_mask<__half, ROWS, N8>(s, tile, row0, row1, lane);
    } else {
      add_staged_mask<__nv_bfloat16, ROWS, N8>(s, tile, row0, row1, lane);
    }
  });
}

// The producer's copy of a Q, K or V tile: load_full_tile where every row lies before the
// sequence's end and every column counts (all tiles but a sequence's last, at unpadded head
// dims), else load_tile with its row checks and zero-fill.
template <class T, int ROWS, int D, int UNROLL>
__device__ __forceinline__ void produce_tile(unsigned dst, const T* g, long long row_stride, int rows_valid, int cols) {
  if (rows_valid >= ROWS && cols == D)
    load_full_tile<T, ROWS, D, 128>(dst, g, row_stride);
  else
    load_tile<T, ROWS, D, 128, UNROLL>(dst, g, row_stride, rows_valid, cols);
}

// Where a block's key tile t sits in the K/V ring: the CTA's tiles go round the STAGES stages in
// the order it loads them, so tile t of a block whose range starts at tile `begin` is the CTA's
// (before + t - begin)-th, `before` the tiles of the blocks it ran earlier (a persistent twin's;
// else 0). A stage's n-th use waits for its release from use n - 1 (refill) and completes its
// barriers' phase of parity n & 1. UNSIGNED (the persistent twins): the index, never negative,
// divided as an unsigned, so its quotient and remainder need no sign fix-ups (twin SASS -7 %;
// in every ws kernel ptxas serialized the d128 ping-pong kernels' wgmmas, C7511).
template <int STAGES, bool UNSIGNED = false>
struct KeyRing {
  int begin, before;
  __device__ __forceinline__ auto index(int t) const {
    if constexpr (UNSIGNED)
      return static_cast<unsigned>(t - begin + before);
    else
      return t - begin + before;
  }
  __device__ __forceinline__ int stage(int t) const { return static_cast<int>(index(t) % STAGES); }
  __device__ __forceinline__ unsigned parity(int t) const { return static_cast<unsigned>(index(t) / STAGES) & 1u; }
  __device__ __forceinline__ bool refill(int t) const { return index(t) >= static_cast<decltype(index(t))>(STAGES); }
};

// How many blocks a persistent twin's CTAs share out (p.virtual_grid: the grid the
// non-persistent kernel would be launched on, dense_tile's layout), and the one a CTA runs as
// its i-th: dealt out in a snake (CTA c takes block c of the first gridDim.x, block
// gridDim.x - 1 - c of the next, ...; a causal grid's blocks come heaviest first within each
// (batch, head) pair, so the snake gives each CTA light blocks after heavy ones), but from round
// p.tail_round on as the host dealt them (p.tail_blocks), where that evens out the CTAs' work
// better than the snake's last rounds, which leave some CTAs a block more than others; past a
// CTA's last block, virtual_blocks(p).
__device__ __forceinline__ int virtual_blocks(const FlashFwdParams& p) {
  return p.virtual_grid_x * p.virtual_grid_y * p.virtual_grid_z;
}
__device__ __forceinline__ int persistent_block(const FlashFwdParams& p, int i) {
  const int ctas = static_cast<int>(gridDim.x), c = static_cast<int>(blockIdx.x);
  if (p.tail_round > 0 && i >= p.tail_round) {
    const int k = i - p.tail_round;
    const unsigned offset = k < TAIL_SLOTS ? p.tail_blocks[c * TAIL_SLOTS + k] : TAIL_NONE;
    return offset == TAIL_NONE ? virtual_blocks(p) : p.tail_round * ctas + static_cast<int>(offset);
  }
  return i * ctas + (i & 1 ? ctas - 1 - c : c);
}

template <class T, class Tile, bool GENERAL, bool STAGED_MASK, bool PERSISTENT>
__device__ __forceinline__ void flash_fwd_ws(const FlashFwdParams& p) {
  constexpr int DQK = Tile::DQK, DV = Tile::DV, ROWS = Tile::ROWS, KEYS = Tile::KEYS, STAGES = Tile::STAGES;
  constexpr int O_REGS = DV / 2;
  constexpr int Q_BUFS = PERSISTENT ? 2 : 1;  // a persistent twin loads the next block's Q beside this one's tiles
  using Ring = KeyRing<STAGES, PERSISTENT>;
  static_assert(GENERAL || !STAGED_MASK, "only general kernels take masks");
  static_assert(!STAGED_MASK || Tile::SHARED + STAGES * Tile::MASK_STAGE_BYTES <= 227 * 1024 - 1024,
                "the mask stages fit beside Q, K and V");
  static_assert(!PERSISTENT || (Tile::PINGPONG && !GENERAL && Tile::CONSUMERS == 2),
                "persistent twins: plain ping-pong kernels of two consumers");
  static_assert(Tile::SHARED + (Q_BUFS - 1) * Tile::Q_BYTES <= 227 * 1024 - 1024, "the second Q tile fits");
  const unsigned base = (smem_u32(smem) + 1023) & ~1023u;
  auto q_addr = [&](int buf) { return base + buf * Tile::Q_BYTES; };
  auto k_addr = [&](int stage) { return base + Q_BUFS * Tile::Q_BYTES + stage * (Tile::K_BYTES + Tile::V_BYTES); };
  auto v_addr = [&](int stage) { return k_addr(stage) + Tile::K_BYTES; };
  // Stage s's mask tile, after the ring (STAGED_MASK: the host launched with room for them).
  auto mask_addr = [&](int stage) { return k_addr(STAGES) + stage * Tile::MASK_STAGE_BYTES; };

  // Whether the producer loads by TMA rather than cp.async: a persistent twin always does (the
  // host launches one only with the maps), so its cp.async paths are not even compiled. Read
  // where used (p.tma read once up here moved every ws kernel's PTX).
  auto loads_by_tma = [&] { return PERSISTENT || p.tma; };

  __shared__ SeqTile tile_info[1];  // the block's rows (a persistent twin's first block)
  __shared__ int tile_found;
  // Q full, then K full, V full, K empty, V empty: STAGES each; then (persistent twins) Q tile 1's
  // full barrier and both Q tiles' empty ones.
  __shared__ __align__(8) unsigned long long bars[1 + 4 * STAGES + 3 * (Q_BUFS - 1)];
  const unsigned bar0 = smem_u32(bars);
  auto q_full = [&](int buf) { return bar0 + 8 * (buf ? 1 + 4 * STAGES : 0); };
  auto k_full = [&](int s) { return bar0 + 8 * (1 + s); };
  auto v_full = [&](int s) { return bar0 + 8 * (1 + STAGES + s); };
  auto k_empty = [&](int s) { return bar0 + 8 * (1 + 2 * STAGES + s); };
  auto v_empty = [&](int s) { return bar0 + 8 * (1 + 3 * STAGES + s); };
  auto q_empty = [&](int buf) { return bar0 + 8 * (2 + 4 * STAGES + buf); };
  // TMA (p.tma): one thread's loads of key tiles [first, last) of the block at row m0 of head h
  // of batch b, into the ring as `ring` places them, each refill waiting for its stage's release;
  // with first_q, the CTA's first Q before them (into Q tile 0, the maps prefetched first).
  auto tma_tiles = [&](int m0, int h, int b, Ring ring, bool first_q, int first, int last) {
    const int hk = h / (p.heads_q / p.heads_kv);
    if (first_q) {
      prefetch_tensor_map(p.k_map);
      prefetch_tensor_map(p.v_map);
      if constexpr (STAGED_MASK) prefetch_tensor_map(p.mask_map);
      tma_tile<T, ROWS, DQK>(q_addr(0), p.q_map, m0, h, b, q_full(0));
    }
    for (int t = first; t < last; ++t) {
      const int stage = ring.stage(t);
      const unsigned parity = ring.parity(t);
      const bool refill = ring.refill(t);
      if (refill) mbar_wait(k_empty(stage), parity ^ 1u);
      if constexpr (STAGED_MASK) {  // the mask tile rides on K's barriers: expected before K's arrival
        mbar_expect_tx(k_full(stage), staged_mask_bytes<ROWS, KEYS>(p));
        stage_mask_tile<ROWS, KEYS>(p, mask_addr(stage), t, m0, h, b, k_full(stage));
      }
      tma_tile<T, KEYS, DQK>(k_addr(stage), p.k_map, t * KEYS, hk, b, k_full(stage));
      if (refill) mbar_wait(v_empty(stage), parity ^ 1u);
      tma_tile<T, KEYS, DV>(v_addr(stage), p.v_map, t * KEYS, hk, b, v_full(stage));
    }
  };
  // The key tiles [begin, end) of the block at m0 whose rows `st` holds (in shared memory), and of
  // the block whose rows a producer thread found (t, in registers).
  auto tile_range = [&](const TileRef& st, int m0, int& begin, int& end) {
    block_key_tile_range<ROWS, KEYS>(st.seq_kv(), st.window(p), m0, st.seq_q(), begin, end);
  };
  auto block_key_tiles = [&](const SeqTile& t, int& begin, int& end) {
    block_key_tile_range<ROWS, KEYS>(t.seq_kv, KeyWindow{t.diag_offset, p.window_left, p.window_right}, t.m0, t.seq_q,
                                     begin, end);
  };
  if constexpr (PERSISTENT) {
    // Each consumer warp frees a Q tile once its block's rows are stored; only generic arrivals
    // and waits use these (no fence for the async proxy), which the __syncthreads below publishes.
    // Thread 0's: beside warp 1's inits, or with a fence, ptxas serialized the consumers' wgmmas
    // (C7511; thread 0, 64, 96 and 128 tried).
    if (threadIdx.x == 0) {
      mbar_init(q_empty(0), 4 * Tile::CONSUMERS);
      mbar_init(q_empty(1), 4 * Tile::CONSUMERS);
    }
  }
  if (threadIdx.x == 32) {  // warp 1, while warp 0 finds the block's rows
    const unsigned fillers = loads_by_tma() ? 1 : 128;  // the producer threads that arrive on a full barrier
    mbar_init(q_full(0), fillers);
    if constexpr (PERSISTENT) mbar_init(q_full(1), fillers);
#pragma unroll
    for (int s = 0; s < STAGES; ++s) {
      mbar_init(k_full(s), fillers);
      mbar_init(v_full(s), fillers);
      mbar_init(k_empty(s), 4 * Tile::CONSUMERS);
      mbar_init(v_empty(s), 4 * Tile::CONSUMERS);
    }
    mbar_fence_init();
    if (Tile::CONSUMERS == 2 && loads_by_tma()) {
      // Q and the ring's first tiles are on their way before the block's __syncthreads (a short
      // block's start is its Q and first K waited for): a dense call's rows come from blockIdx
      // and the parameters alone (tma implies dense), and barriers this thread initialized take
      // its copies once the inits are ordered before the async proxy's updates.
      fence_proxy_async();
      SeqTile t;
      if constexpr (PERSISTENT)
        virtual_tile<ROWS>(p, t, blockIdx.x);
      else
        dense_tile<ROWS>(p, t);
      int begin, end;
      block_key_tiles(t, begin, end);
      if (PERSISTENT || begin < end)  // a persistent twin's consumers wait for every block's Q
        tma_tiles(t.m0, t.h, t.b, Ring{begin, 0}, true, begin, min(end, begin + STAGES));
    }
  }
  if constexpr (PERSISTENT) {  // dense calls only: every CTA has its first block
    if (threadIdx.x == 0) virtual_tile<ROWS>(p, tile_info[0], blockIdx.x);
    __syncthreads();  // publishes the barriers and the tile
  } else if (!resolve_tile<ROWS>(p, tile_info[0], tile_found)) {
    return;  // its __syncthreads publishes the barriers
  }
  const TileRef st{tile_info[0]};
  const int m0 = st.m0();

  int tile_begin, tile_end;
  tile_range(st, m0, tile_begin, tile_end);

  const int role = __shfl_sync(0xffffffffu, threadIdx.x / 128, 0);  // warp-uniform to the compiler
  if (role == 0) {
    // ---- producer ----
    setmaxnreg_dec<Tile::PRODUCER_REGS>();
    const int h = st.h();
    if (loads_by_tma()) {
      constexpr int EARLY = Tile::CONSUMERS == 2 ? STAGES : 0;  // the tiles warp 1 issued, with Q
      if (threadIdx.x == 0) {
        if (tile_begin + EARLY < tile_end)
          tma_tiles(m0, h, st.b(), Ring{tile_begin, 0}, EARLY == 0, tile_begin + EARLY, tile_end);
        if constexpr (PERSISTENT) {
          // The CTA's later blocks: block i's Q into Q tile i % 2 once the consumers have freed
          // it of block i - 2 (its (i / 2 - 1)-th release), then its key tiles round the ring
          // after the earlier blocks'.
          int before = tile_end - tile_begin;
          for (int i = 1, block = persistent_block(p, 1); block < virtual_blocks(p); block = persistent_block(p, ++i)) {
            const int buf = i & 1;
            if (i >= 2) mbar_wait(q_empty(buf), static_cast<unsigned>((i >> 1) - 1) & 1u);
            SeqTile t;
            virtual_tile<ROWS>(p, t, block);
            int begin, end;
            block_key_tiles(t, begin, end);
            tma_tile<T, ROWS, DQK>(q_addr(buf), p.q_map, t.m0, t.h, t.b, q_full(buf));
            tma_tiles(t.m0, t.h, t.b, Ring{begin, before}, false, begin, end);
            before += end - begin;
          }
        }
      }
    } else if (tile_begin < tile_end) {
      const int hk = h / (p.heads_q / p.heads_kv);
      const T* gq = static_cast<const T*>(p.q) + st.b() * p.q_batch_stride + h * p.q_head_stride +
                    (st.q_tok0() + m0) * p.q_seq_stride;
      const T* gk = static_cast<const T*>(p.k) + st.b() * p.k_batch_stride + st.k_tok0() * p.k_seq_stride +
                    hk * p.k_head_stride;
      const T* gv = static_cast<const T*>(p.v) + st.b() * p.v_batch_stride + st.k_tok0() * p.v_seq_stride +
                    hk * p.v_head_stride;
      produce_tile<T, ROWS, DQK, Tile::PRODUCER_UNROLL>(q_addr(0), gq, p.q_seq_stride, st.seq_q() - m0, p.dim_qk);
      mbar_arrive_cp_async(q_full(0));
      const Ring ring{tile_begin, 0};
      for (int t = tile_begin; t < tile_end; ++t) {
        const int stage = ring.stage(t), n0 = t * KEYS, rows_valid = st.seq_kv() - n0;
        const bool refill = ring.refill(t);
        if (refill) mbar_wait(k_empty(stage), ring.parity(t) ^ 1u);
        produce_tile<T, KEYS, DQK, Tile::PRODUCER_UNROLL>(k_addr(stage), gk + n0 * p.k_seq_stride, p.k_seq_stride,
                                                         rows_valid, p.dim_qk);
        mbar_arrive_cp_async(k_full(stage));
        if (refill) mbar_wait(v_empty(stage), ring.parity(t) ^ 1u);
        produce_tile<T, KEYS, DV, Tile::PRODUCER_UNROLL>(v_addr(stage), gv + n0 * p.v_seq_stride, p.v_seq_stride,
                                                        rows_valid, p.dim_v);
        mbar_arrive_cp_async(v_full(stage));
      }
      asm volatile("cp.async.wait_all;\n" ::: "memory");
    }
  } else {
    // ---- consumers ----
    setmaxnreg_inc<Tile::CONSUMER_REGS>();
    const int lane = threadIdx.x & 31, warp_in_group = (threadIdx.x >> 5) & 3;
    // One block: rows from m0 (st), key tiles [tile_begin, tile_end) placed in the ring by `ring`,
    // its Q in Q tile `buf`, landed at that tile's full-barrier phase of parity q_parity. Ping-pong
    // turns run on from one block to the next: first_turn says this block's first turn is the
    // CTA's first (consumer 1 then has no arrival to wait for), last_turn that its last is the
    // CTA's last (the last consumer then arrives for no one).
    auto consume_block = [&](const TileRef& st, int m0, int tile_begin, int tile_end, Ring ring, int buf,
                             unsigned q_parity, bool first_turn, bool last_turn) {
      // The stage of key tile t and which use of it that is.
      auto stage_of = [&](int t) { return ring.stage(t); };
      auto parity_of = [&](int t) { return ring.parity(t); };
      const int group_row0 = m0 + (role - 1) * 64;
      const int my_row = group_row0 + warp_in_group * 16 + (lane >> 2);
      // O: zeroed here, or (the twins) set by the first P V (issue_pv without accumulate) and
      // zeroed only where the warpgroup has no tile: 64 instructions fewer a block at D128.
      // Not in the CTA-a-block kernels: there ptxas serialized the d192 / 128 ping-pong
      // kernels' wgmmas (C7511) and spilled more in the general d128 one.
      constexpr bool FIRST_PV_WRITES_O = PERSISTENT;
      float o[O_REGS];
      auto zero_o = [&] {
#pragma unroll
        for (int i = 0; i < O_REGS; ++i) o[i] = 0.f;
      };
      if constexpr (!FIRST_PV_WRITES_O) zero_o();
      float row_max[2] = {neg_inf(), neg_inf()}, row_sum[2] = {0.f, 0.f};
      const float mul = softmax_mul<GENERAL>(p);
      // S(t) as it comes out of the tensor cores -> the scores the softmax takes.
      auto make_scores = [&](float (&s)[KEYS / 2], int t) {
        if constexpr (STAGED_MASK)
          staged_mask_scores<ROWS, KEYS / 8>(s, p, smem + (mask_addr(stage_of(t)) - smem_u32(smem)), my_row - m0, lane);
        else if constexpr (GENERAL)
          general_scores<KEYS / 8>(s, p, st.b(), st.h(), my_row, st.seq_q(), t * KEYS + 2 * (lane & 3), st.seq_kv());
        cut_keys<KEYS, PERSISTENT>(s, st.window(p), t * KEYS, st.seq_kv(), group_row0, my_row, lane);
      };

      // The block's tiles rows_see_tile holds for this warpgroup's rows: (tile_end, tile_end)
      // where there are none. The twins take them in closed form, tile t iff
      // first_visible_key(first row) / KEYS <= t <= last_visible_key(last row) / KEYS (floor
      // division; keys past Skv count, as there), where two loops of 64-bit compares stood; in
      // the d128 and d192 / 128 ping-pong kernels that made ptxas serialize the wgmmas (C7511).
      int my_begin = tile_begin, my_end = tile_end;
      if constexpr (!PERSISTENT) {
        while (my_begin < my_end && !rows_see_tile<KEYS>(st, p, group_row0, 64, my_begin)) ++my_begin;
        while (my_end > my_begin && !rows_see_tile<KEYS>(st, p, group_row0, 64, my_end - 1)) --my_end;
      } else {
        my_begin = tile_end;
        const KeyWindow win = st.window(p);
        const long long first = max(first_visible_key(win, group_row0), 0LL);
        const long long last = last_visible_key(win, min(group_row0 + 64, st.seq_q()) - 1);
        if (group_row0 < st.seq_q() && last >= 0) {
          const int lo = max(static_cast<int>(min(first / KEYS, static_cast<long long>(tile_end))), tile_begin);
          const int hi = static_cast<int>(min(last / KEYS + 1, static_cast<long long>(tile_end)));
          if (lo < hi) my_begin = lo, my_end = hi;
        }
      }

      // A tile's K or V has landed; a wgmma may read it once a fence.proxy.async follows, where
      // cp.async wrote it (the generic proxy). TMA writes through the async proxy, as wgmma reads:
      // no fence.
      auto k_landed = [&](int t) { mbar_wait(k_full(stage_of(t)), parity_of(t)); };
      auto v_landed = [&](int t) { mbar_wait(v_full(stage_of(t)), parity_of(t)); };
      auto fence_copies = [&] {
        if (!loads_by_tma()) fence_proxy_async();
      };
      auto wait_k = [&](int t) {
        k_landed(t);
        fence_copies();
      };
      auto wait_v = [&](int t) {
        v_landed(t);
        fence_copies();
      };
      auto wait_k_and_previous_v = [&](int t) {  // K(t) and V(t - 1), one fence for both
        k_landed(t);
        v_landed(t - 1);
        fence_copies();
      };
      auto release_k = [&](int t) {
        if (lane == 0) mbar_arrive(k_empty(stage_of(t)));
      };
      // K(t)'s release once S(t) is made: right after its wgmmas, or, where its stage holds the
      // tile's staged mask, after make_scores has read that (every lane of the warp).
      auto release_k_before_scores = [&](int t) {
        if constexpr (!STAGED_MASK) release_k(t);
      };
      auto release_k_after_scores = [&](int t) {
        if constexpr (STAGED_MASK) {
          __syncwarp();
          release_k(t);
        }
      };
      auto release_v = [&](int t) {
        if (lane == 0) mbar_arrive(v_empty(stage_of(t)));
      };
      auto pass = [&](int t) {  // a tile this warpgroup's rows do not see
        k_landed(t);
        release_k(t);
        v_landed(t);
        release_v(t);
      };
      // Ping-pong turns (see the top comment): turn t's wait before its wgmmas are issued, its
      // arrival after; nothing without PINGPONG.
      auto turn_wait = [&](int t) {
        if constexpr (Tile::PINGPONG) {
          if (role != 1 || t > tile_begin || !first_turn) named_bar_sync(Tile::PP_BAR0 + role - 1, 256);
        }
      };
      auto turn_arrive = [&](int t) {
        if constexpr (Tile::PINGPONG) {
          if (role != Tile::CONSUMERS || t < tile_end || !last_turn) named_bar_arrive(Tile::PP_BAR0 + role % Tile::CONSUMERS, 256);
        }
      };
      auto empty_turn = [&](int t) {
        turn_wait(t);
        turn_arrive(t);
      };

      for (int t = tile_begin; t < my_begin; ++t) {
        pass(t);
        empty_turn(t);
      }
      if (my_begin < my_end) {
        const unsigned q_group = q_addr(buf) + (role - 1) * 64 * 128;  // this warpgroup's rows of each half
        float s[KEYS / 2], alpha[2];
        unsigned pa[KEYS / 16][4];
        // A narrow last tile (NARROW_LAST kernels): where none of this warpgroup's rows sees a key
        // of its last tile's second half (the causal diagonal's upper 64 rows, or a sequence's
        // end, cut them all), S, the softmax and P V take the first KEYS / 2 keys only. The keys
        // left out would score -inf and weigh exactly 0, so the sums and bits are the same.
        // Not in the twins: their short blocks ran 16 % faster without the narrow steps (S512
        // causal, flash_fwd_notes v50; the instruction count alone is not what paid, v52).
        constexpr bool NARROWS = Tile::NARROW_LAST && !GENERAL && !PERSISTENT;  // this kernel has the narrow steps
        const bool narrow = NARROWS &&
                            min(last_visible_key(st.window(p), min(group_row0 + 63, st.seq_q() - 1)),
                                static_cast<long long>(st.seq_kv()) - 1) < (my_end - 1) * KEYS + KEYS / 2;
        // Tile t's scores over its first W keys (s's first W / 2 registers), made (mask, cut) and
        // softmaxed into P (unrounded); pack rounds them into P V's A fragments.
        auto scores_and_softmax = [&](auto width, int t) {
          constexpr int W = decltype(width)::value;
          auto& sw = *reinterpret_cast<float(*)[W / 2]>(s);
          if constexpr (W == KEYS) {
            release_k_before_scores(t);
            make_scores(s, t);
            release_k_after_scores(t);
          } else {  // a plain kernel: the cut is all of make_scores
            release_k(t);
            cut_keys<W>(sw, st.window(p), t * KEYS, st.seq_kv(), group_row0, my_row, lane);
          }
          online_softmax<W, O_REGS, false, Tile::LAZY_RESCALE>(sw, o, row_max, row_sum, mul, alpha);
        };
        auto pack = [&](auto width) {
          constexpr int W = decltype(width)::value;
          pack_p<T, W>(*reinterpret_cast<float(*)[W / 2]>(s), *reinterpret_cast<unsigned(*)[W / 16][4]>(pa));
        };
        constexpr Width<KEYS> full{};
        constexpr Width<KEYS / 2> half{};
        // The first tile is scored in full even where it is a narrow last one (then only its P V
        // narrows): a narrow first tile beside the narrow step had ptxas serialize the wgmmas
        // (C7511, too few registers for their pipeline).
        auto first_tile = [&] {
          wait_k(my_begin);
          turn_wait(my_begin);
          issue_qk<T, Tile>(s, q_group, k_addr(stage_of(my_begin)));
          turn_arrive(my_begin);
          wgmma_wait<0>();
          fence_registers(s);
          scores_and_softmax(full, my_begin);  // O is 0 (a twin's: not yet written): no rescale
          pack(full);
        };
        // Tile t (> my_begin) of width W, whose previous tile was a full one.
        auto next_tile = [&](auto width, int t) {
          constexpr int W = decltype(width)::value;
          if constexpr (Tile::SOFTMAX_BESIDE_OWN_PV) {
            wait_k_and_previous_v(t);
          } else {
            wait_k(t);
          }
          turn_wait(t);
          issue_qk<T, Tile, W>(s, q_group, k_addr(stage_of(t)));
          fence_registers(s);
          if constexpr (!Tile::SOFTMAX_BESIDE_OWN_PV) wait_v(t - 1);
          issue_pv<T, Tile>(o, pa, v_addr(stage_of(t - 1)), !FIRST_PV_WRITES_O || t - 1 > my_begin);
          fence_registers(o);
          turn_arrive(t);
          wgmma_wait<1>();  // S(t) done; O's P V may still run
          fence_registers(s);
          scores_and_softmax(width, t);
          if constexpr (Tile::SOFTMAX_BESIDE_OWN_PV) wait_after_softmax(row_sum[0]);
          wgmma_wait<0>();
          fence_registers(o);
          release_v(t - 1);
          // O *= 1 changes nothing: with a lagging max a warp skips it when no row's max moved.
          if (!Tile::LAZY_RESCALE || __any_sync(0xffffffffu, alpha[0] != 1.f || alpha[1] != 1.f)) rescale_o(o, alpha);
          pack(width);
        };
        auto last_pv = [&](auto width) {
          constexpr int W = decltype(width)::value;
          wait_v(my_end - 1);
          turn_wait(my_end);
          issue_pv<T, Tile, W>(o, pa, v_addr(stage_of(my_end - 1)), !FIRST_PV_WRITES_O || my_end - 1 > my_begin);
          turn_arrive(my_end);
          wgmma_wait<0>();
          fence_registers(o);
          release_v(my_end - 1);
        };
        mbar_wait(q_full(buf), q_parity);
        const int full_end = narrow ? my_end - 1 : my_end;  // the tiles scored in full end here
        first_tile();
        for (int t = my_begin + 1; t < full_end; ++t) next_tile(full, t);
        if constexpr (NARROWS) {
          if (narrow && my_begin < full_end) next_tile(half, my_end - 1);
          if (narrow)
            last_pv(half);
          else
            last_pv(full);
        } else {
          last_pv(full);
        }
      } else {
        if constexpr (FIRST_PV_WRITES_O) zero_o();  // for the epilogue (its rows' factor is 0)
        if constexpr (Tile::PINGPONG) {
          if (tile_begin < tile_end) empty_turn(my_end);  // turn tile_end: the head loop passed every tile
        }
      }
      for (int t = my_end; t < tile_end; ++t) {  // (none when the head loop passed them all)
        pass(t);
        empty_turn(t + 1);
      }

      // A consumer with no tile of its own never waited for Q, whose copies land in its rows too.
      if (my_begin >= my_end && tile_begin < tile_end) mbar_wait(q_full(buf), q_parity);
      const unsigned q_group = q_addr(buf) + (role - 1) * 64 * 128;
      if constexpr (PERSISTENT)
        store_rows_tma<T, Tile>(p, st, o, row_max, row_sum, q_group, group_row0, my_row, lane,
                                Tile::STORE_BAR0 + role - 1);
      else
        store_rows_staged<T, Tile>(p, st, st.h(), o, row_max, row_sum, q_group, group_row0, my_row, lane,
                                   Tile::STORE_BAR0 + role - 1);
    };
    if constexpr (!PERSISTENT) {
      consume_block(st, m0, tile_begin, tile_end, Ring{tile_begin, 0}, 0, 0u, true, true);
    } else {
      // Block i's Q waits in Q tile i % 2 (its (i / 2)-th fill), its rows in this consumer's slot
      // i % 2, written by the consumer's first thread after its barrier of block i - 1 (block 0's
      // before the loop) and published by its barrier of block i. Every warp frees block i's Q
      // tile after its barrier of block i + 1 (or after the CTA's last block), once the TMA store
      // has read the rows (waited for by the thread that issued it) and its generic reads and
      // writes of the tile are ordered before the producer's next TMA write there: the producer
      // needs the tile only for block i + 2, and the barrier waits on this consumer's warps
      // alone. The last consumer arrives after every block's last turn, and consumer 1 takes the
      // CTA's last arrival after its last block.
      __shared__ SeqTile group_tiles[Tile::CONSUMERS][2];
      SeqTile(&slots)[2] = group_tiles[role - 1];
      const bool first_thread = (threadIdx.x & 127) == 0;
      // A warp frees Q tile `buf` of the block before the one begun (after that one's barrier: the
      // TMA store's read of the tile runs beside its start), or after the last block.
      auto release_q = [&](int buf) {
        if (first_thread) tma_store_wait_read();
        fence_proxy_async();
        __syncwarp();
        if (lane == 0) mbar_arrive(q_empty(buf));
      };
      if (first_thread) virtual_tile<ROWS>(p, slots[0], blockIdx.x);
      int before = 0;  // the key tiles of the blocks run so far: a turn was taken once there are any
      int i = 0;  // blocks begun
      for (int block = blockIdx.x; block < virtual_blocks(p);) {
        const int buf = i & 1;
        const unsigned q_parity = static_cast<unsigned>(i >> 1) & 1u;
        named_bar_sync(Tile::STORE_BAR0 + role - 1, 128);
        const int next = persistent_block(p, ++i);
        if (first_thread && next < virtual_blocks(p)) virtual_tile<ROWS>(p, slots[buf ^ 1], next);
        block = next;
        if (i > 1) release_q(buf ^ 1);  // block i - 2's
        mbar_wait(q_full(buf), q_parity);
        const TileRef bt{slots[buf]};
        const int b_m0 = bt.m0();
        int begin, end;
        tile_range(bt, b_m0, begin, end);
        consume_block(bt, b_m0, begin, end, Ring{begin, before}, buf, q_parity, before == 0, false);
        before += end - begin;
      }
      if (i > 0) release_q((i - 1) & 1);
      if (role == 1 && before > 0) named_bar_sync(Tile::PP_BAR0, 256);
    }
  }
}

}  // namespace sm90
}  // namespace ptxattn

// NAME: the warp-specialized kernel (K/V through strides), the flash_fwd_sm90 table's "ws"
// variants; GROUPS consumers (NAME has _m192 for three); PINGPONG: with the consumers'
// ping-pong ("pingpong" variants, NAME ends _pp); GENERAL: the per-element score path (masks,
// softcap, any scale; NAME has _general); STAGED_MASK: a general kernel's twin for the masks it
// stages in shared memory by TMA (NAME ends _staged_mask; launched with tma 1 and MASK_STAGE_BYTES
// more shared memory a stage); PERSISTENT: a plain ping-pong kernel's persistent twin (NAME ends
// _persistent; launched with tma 1 on a dense call's grid of gridDim.x CTAs, a second Q tile's
// shared memory more, and the blocks in p.virtual_grid).
#define FLASH_FWD_SM90_WS(NAME, T, DQK, DV, KEYS, STAGES, GROUPS, PINGPONG, GENERAL, STAGED_MASK, PERSISTENT) \
  extern "C" __global__ void __launch_bounds__(                                                         \
      ptxattn::sm90::WsTileFor<DQK, DV, KEYS, STAGES, GROUPS, PINGPONG>::type::THREADS, 1)               \
      NAME(const __grid_constant__ ptxattn::FlashFwdParams p) {                                         \
    ptxattn::sm90::flash_fwd_ws<T, typename ptxattn::sm90::WsTileFor<DQK, DV, KEYS, STAGES, GROUPS, PINGPONG>::type, \
                                GENERAL, STAGED_MASK, PERSISTENT>(p);                                   \
  }
