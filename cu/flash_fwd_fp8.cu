// sdpa over fp8 K/V (float8_e4m3fn / float8_e5m2, the type and scales runtime fields): the
// tensor-core kernel of flash_fwd_tc.cuh with FP8 set, for ragged_attention and
// paged_attention's prefill tiles (runtime/ops/ragged.py) on devices without the sm_90a
// kernels. Its own family so that it ships for two archs only, sm_80 (software e4m3
// conversion) and sm_89 (hardware cvt): the PTX is large (cu/serving_notes.md, v6).
#include "flash_fwd_tc.cuh"

// ---- variants: the flash_fwd_fp8 table of cu/variants.json -----------------------------------
// General kernels only (they run every serving call: softcap, any scale), Dqk = Dv = 64 or
// 128, on flash_fwd's general tiles.
#include "variants.inc"
