"""Float64 NumPy oracle of every op: the definition of ptxattn's semantics.

Each op family has its own section below. Everything is computed in float64 from
the inputs' exact values (bfloat16/float16 widen exactly), with no tiling, so a
kernel is checked against the math, not against another implementation.
"""
from __future__ import annotations

import ml_dtypes
import numpy as np

# ==== sdpa: scaled dot-product attention ======================================
# q [B, Hq, Sq, Dqk], k [B, Hkv, Skv, Dqk], v [B, Hkv, Skv, Dv] -> o [B, Hq, Sq, Dv],
# lse [B, Hq, Sq]. Query head h reads kv head h // (Hq // Hkv).


def sdpa_visible_keys(sq: int, skv: int, *, causal: bool = False,
                      causal_align: str = "top_left", window=None) -> np.ndarray:
    """[Sq, Skv] bool: key j is visible to query i.

    Relative to the aligned diagonal d = i + diag_offset (diag_offset = Skv - Sq for
    "bottom_right", 0 for "top_left"), j is visible iff d - left <= j <= d + right.
    window = (left, right) with -1 (or None) meaning unbounded on that side;
    causal caps right at 0. No causal and no window: every key is visible.
    """
    if causal_align not in ("top_left", "bottom_right"):
        raise ValueError(f"causal_align: expected 'top_left' or 'bottom_right', got {causal_align!r}")
    left, right = (None, None) if window is None else window
    left = None if left is None or left < 0 else int(left)
    right = None if right is None or right < 0 else int(right)
    if causal:
        right = 0 if right is None else min(right, 0)
    diag = np.arange(sq)[:, None] + (skv - sq if causal_align == "bottom_right" else 0)
    j = np.arange(skv)[None, :]
    visible = np.ones((sq, skv), dtype=bool)
    if left is not None:
        visible &= j >= diag - left
    if right is not None:
        visible &= j <= diag + right
    return visible


def sdpa(q, k, v, *, attn_mask=None, causal=False, causal_align="top_left", window=None,
         scale=None, softcap=0.0, sinks=None):
    """Scaled dot-product attention in float64; returns (o, lse).

    scores = scale * q·k (scale defaults to 1/sqrt(Dqk); 0 is a real zero), then
    softcap (cap * tanh(s / cap), cap 0 = off), then masks: the causal/window
    predicate, a bool attn_mask (True = attend) or an additive float attn_mask,
    broadcast to [B, Hq, Sq, Skv] from any rank <= 4. sinks [Hq] join the softmax
    denominator only: o = sum_j e^{s_j} v_j / (sum_j e^{s_j} + e^{sink}), while
    lse = log sum_j e^{s_j} (natural log) excludes them. A row with no visible key
    has o = 0 and lse = -inf, with or without sinks.
    """
    q, k, v = (np.asarray(x).astype(np.float64) for x in (q, k, v))
    batch, hq, sq, dqk = q.shape
    hkv, skv, dv = k.shape[1], k.shape[2], v.shape[3]
    assert k.shape == (batch, hkv, skv, dqk) and v.shape == (batch, hkv, skv, dv)
    assert hq % hkv == 0, "Hq must be a multiple of Hkv"
    k = np.repeat(k, hq // hkv, axis=1)
    v = np.repeat(v, hq // hkv, axis=1)
    scale = 1.0 / np.sqrt(dqk) if scale is None else float(scale)

    s = np.einsum("bhqd,bhkd->bhqk", q, k) * scale
    if softcap:
        s = softcap * np.tanh(s / softcap)
    visible = sdpa_visible_keys(sq, skv, causal=causal, causal_align=causal_align, window=window)
    s = np.where(visible, s, -np.inf)
    if attn_mask is not None:
        mask = np.asarray(attn_mask)
        if mask.dtype == np.bool_:
            s = np.where(mask, s, -np.inf)
        else:
            s = s + mask.astype(np.float64)

    if skv == 0:
        return np.zeros((batch, hq, sq, dv)), np.full((batch, hq, sq), -np.inf)
    row_max = s.max(axis=-1, keepdims=True)
    shift = np.where(row_max == -np.inf, 0.0, row_max)  # keeps exp(-inf - -inf) out
    e = np.exp(s - shift)
    total = e.sum(axis=-1, keepdims=True)
    denom = total
    if sinks is not None:
        sink = np.asarray(sinks, dtype=np.float64).reshape(1, hq, 1, 1)
        denom = total + np.exp(sink - shift)
    live = total > 0
    o = np.einsum("bhqk,bhkd->bhqd", e, v) / np.where(live, denom, 1.0)
    o = np.where(live, o, 0.0)
    with np.errstate(divide="ignore"):
        lse = np.where(live, np.log(total) + shift, -np.inf)[..., 0]
    return o, lse

# ==== end sdpa =================================================================


# ==== softmax: softmax and log_softmax along one axis ==========================
# Rows of all -inf, and rows holding a NaN or +inf, come out all NaN, as in ONNX Softmax /
# LogSoftmax and torch.softmax (the max-shift is undefined there); -inf entries of any other
# row give probability 0 (log-probability -inf).


def _max_shifted(x, axis: int) -> np.ndarray:
    """x - max(x) along `axis`, in float64 (NaN where the shift is undefined)."""
    x = np.asarray(x).astype(np.float64)
    with np.errstate(invalid="ignore"):
        return x - np.max(x, axis=axis, keepdims=True)


def softmax(x, axis: int = -1) -> np.ndarray:
    """exp(x - max) / sum(exp(x - max)) along `axis`, in float64."""
    e = np.exp(_max_shifted(x, axis))
    with np.errstate(invalid="ignore"):
        return e / np.sum(e, axis=axis, keepdims=True)


def log_softmax(x, axis: int = -1) -> np.ndarray:
    """x - max - log(sum(exp(x - max))) along `axis`, in float64."""
    shifted = _max_shifted(x, axis)
    with np.errstate(invalid="ignore", divide="ignore"):
        return shifted - np.log(np.sum(np.exp(shifted), axis=axis, keepdims=True))

# ==== end softmax ==============================================================


# ==== decode / kv cache / merge: KV-cache attention ===========================
# Caches here are [B, Hkv, capacity, D] ("HND"); pools are [num_pages, Hkv, page_size, D]
# ("HND") or [num_pages, page_size, Hkv, D] ("NHD"). Lengths and slots are host integers.


def decode(q, k_cache, v_cache, seq_lens, *, scale=None, softcap=0.0, window=None, sinks=None):
    """Attention of q [B, Hq, Sq, Dqk] against each row's first seq_lens[b] cached keys,
    bottom-right causal (query t sees keys < seq_lens[b] - Sq + 1 + t), window / softcap /
    sinks / scale as in sdpa. Returns (o [B, Hq, Sq, Dv], lse [B, Hq, Sq])."""
    q = np.asarray(q)
    batch, hq, sq, _ = q.shape
    dv = np.asarray(v_cache).shape[3]
    o = np.zeros((batch, hq, sq, dv))
    lse = np.full((batch, hq, sq), -np.inf)
    for b, length in enumerate(np.asarray(seq_lens)):
        length = int(length)
        o[b:b + 1], lse[b:b + 1] = sdpa(
            q[b:b + 1], np.asarray(k_cache)[b:b + 1, :, :length], np.asarray(v_cache)[b:b + 1, :, :length],
            causal=True, causal_align="bottom_right", window=window, scale=scale, softcap=softcap,
            sinks=sinks)
    return o, lse


def gather_pages(pool, block_table, capacity: int, layout: str = "HND"):
    """The contiguous [B, Hkv, capacity, D] cache a paged pool holds for each block-table row
    (capacity = max_pages * page_size)."""
    pool = np.asarray(pool)
    if layout == "NHD":
        pool = pool.transpose(0, 2, 1, 3)
    pages = pool[np.asarray(block_table)]                    # [B, max_pages, Hkv, ps, D]
    batch, max_pages, hkv, page_size, dim = pages.shape
    cache = pages.transpose(0, 2, 1, 3, 4).reshape(batch, hkv, max_pages * page_size, dim)
    return cache[:, :, :capacity]


def paged_decode(q, k_pool, v_pool, block_table, seq_lens, *, layout="HND", **options):
    """decode() over the pages each row's block table names; layout is "HND" / "NHD" or a
    (k_layout, v_layout) pair."""
    k_layout, v_layout = (layout, layout) if isinstance(layout, str) else layout
    capacity = np.asarray(block_table).shape[1] * np.asarray(k_pool).shape[2 if k_layout == "HND" else 1]
    k_cache = gather_pages(k_pool, block_table, capacity, k_layout)
    v_cache = gather_pages(v_pool, block_table, capacity, v_layout)
    return decode(q, k_cache, v_cache, seq_lens, **options)


def _append_contiguous(new, cache, seq_lens) -> np.ndarray:
    """cache [B, H, capacity, ...] with new [B, H, n, ...] written at each row's length
    (rows that would pass the capacity left alone)."""
    cache, new = np.array(cache), np.asarray(new)
    n = new.shape[2]
    for b, start in enumerate(np.asarray(seq_lens)):
        if 0 <= start <= cache.shape[2] - n:
            cache[b, :, start:start + n] = new[b]
    return cache


def _append_paged(new, pool, slot_mapping, layout: str) -> np.ndarray:
    """pool [pages, H, page_size, ...] ("HND") or [pages, page_size, H, ...] ("NHD") with
    token r of new [T, H, ...] written to slot_mapping[r] (negative or past the pool: skipped)."""
    pool, new = np.array(pool), np.asarray(new)
    page_size = pool.shape[2 if layout == "HND" else 1]
    for r, slot in enumerate(np.asarray(slot_mapping)):
        page, offset = divmod(int(slot), page_size)
        if slot < 0 or page >= pool.shape[0]:
            continue
        if layout == "HND":
            pool[page, :, offset] = new[r]
        else:
            pool[page, offset] = new[r]
    return pool


def kv_append(k_new, v_new, k_cache, v_cache, seq_lens):
    """New caches and lengths after writing k_new/v_new [B, Hkv, n, D] at each row's length.
    A row that would pass the capacity is left unwritten (and keeps its length)."""
    lens = np.array(seq_lens)
    n = np.asarray(k_new).shape[2]
    capacity = np.asarray(k_cache).shape[2]
    lens[(lens >= 0) & (lens <= capacity - n)] += n
    return _append_contiguous(k_new, k_cache, seq_lens), _append_contiguous(v_new, v_cache, seq_lens), lens


def paged_kv_append(k_new, v_new, k_pool, v_pool, slot_mapping, *, layout="HND"):
    """New pools after writing token r of k_new/v_new [T, Hkv, D] to slot_mapping[r]
    (page * page_size + offset; negative = skip, a page outside the pool = skip)."""
    k_layout, v_layout = (layout, layout) if isinstance(layout, str) else layout
    return _append_paged(k_new, k_pool, slot_mapping, k_layout), _append_paged(v_new, v_pool, slot_mapping, v_layout)


# fp8 caches (float8_e4m3fn, float8_e5m2): a cached x stands for x * scale, the scale per
# tensor (a float) or per (token, kv head) (float32, the cache's shape less its last axis).
def quantize_fp8(x, scale, fp8):
    """x / scale as the quantizing append writes it: the quotient in float32 (x widened
    exactly, scale taken as float32), saturated to the fp8 type's finite range (infinities
    included; NaN stays NaN) and rounded to nearest even. `scale` broadcasts against x."""
    fmax = np.float32(ml_dtypes.finfo(fp8).max)
    with np.errstate(invalid="ignore", over="ignore"):  # NaN, inf and past-the-range inputs are meant
        quotient = np.asarray(x, np.float32) / np.asarray(scale, np.float32)
    return np.clip(quotient, -fmax, fmax).astype(fp8)


def fp8_token_scales(x, fp8) -> np.ndarray:
    """The per-token scales the quantizing append gives rows x [..., D]: the largest finite
    |x| over D over the fp8 type's largest finite value, in float32; 1 for a row without a
    finite nonzero value (all zeros, say: it reads back as zeros with any scale)."""
    x = np.asarray(x, np.float32)
    amax = np.where(np.isfinite(x), np.abs(x), np.float32(0)).max(axis=-1)
    return np.where(amax > 0, amax / np.float32(ml_dtypes.finfo(fp8).max), np.float32(1)).astype(np.float32)


def fp8_append_rows(new, fp8, scale, new_scale=None):
    """(rows in the fp8 type, their per-token scales or None) that an append into an `fp8`
    cache with `scale` (a float, or an array: per-token) writes for new rows [..., D]: fp8
    rows as they are (with new_scale, their own per-token scales, given exactly when `scale`
    is an array); 16-bit rows quantized (quantize_fp8) by `scale` or by fp8_token_scales."""
    new, per_token = np.asarray(new), not np.isscalar(scale)
    if new.dtype == np.dtype(fp8):
        return new, (np.asarray(new_scale, np.float32) if per_token else None)
    if not per_token:
        return quantize_fp8(new, scale, fp8), None
    scales = fp8_token_scales(new, fp8)
    return quantize_fp8(new, scales[..., None], fp8), scales


def kv_append_fp8(k_new, v_new, k_cache, v_cache, seq_lens, *, k_scale, v_scale, k_new_scale=None,
                  v_new_scale=None):
    """kv_append into fp8 caches [B, Hkv, capacity, D] whose scales are k_scale / v_scale
    (a float, or float32 [B, Hkv, capacity]): (k_cache, v_cache, lens, k_scale, v_scale), a
    per-token scale array updated at the slots written (fp8_append_rows says with what)."""
    k_rows, k_row_scales = fp8_append_rows(k_new, np.asarray(k_cache).dtype, k_scale, k_new_scale)
    v_rows, v_row_scales = fp8_append_rows(v_new, np.asarray(v_cache).dtype, v_scale, v_new_scale)
    k, v, lens = kv_append(k_rows, v_rows, k_cache, v_cache, seq_lens)
    scales = [scale if rows is None else _append_contiguous(rows, scale, seq_lens)
              for rows, scale in ((k_row_scales, k_scale), (v_row_scales, v_scale))]
    return k, v, lens, *scales


def paged_kv_append_fp8(k_new, v_new, k_pool, v_pool, slot_mapping, *, layout="HND", k_scale, v_scale,
                        k_new_scale=None, v_new_scale=None):
    """paged_kv_append into fp8 pools whose scales are k_scale / v_scale (a float, or float32
    shaped like the pool less its last axis): (k_pool, v_pool, k_scale, v_scale), as
    kv_append_fp8."""
    k_layout, v_layout = (layout, layout) if isinstance(layout, str) else layout
    k_rows, k_row_scales = fp8_append_rows(k_new, np.asarray(k_pool).dtype, k_scale, k_new_scale)
    v_rows, v_row_scales = fp8_append_rows(v_new, np.asarray(v_pool).dtype, v_scale, v_new_scale)
    k, v = paged_kv_append(k_rows, v_rows, k_pool, v_pool, slot_mapping, layout=layout)
    scales = [scale if rows is None else _append_paged(rows, scale, slot_mapping, lay)
              for rows, scale, lay in ((k_row_scales, k_scale, k_layout), (v_row_scales, v_scale, v_layout))]
    return k, v, *scales


def dequantize_fp8(cache, scale=None) -> np.ndarray:
    """The float64 values an fp8 cache stands for: x * scale (a float, or per token: the
    cache's shape less its last axis); without a scale (a cache of q's dtype), x as it is."""
    if scale is None:
        return np.asarray(cache)
    scale = np.asarray(scale, np.float64)
    return np.asarray(cache).astype(np.float64) * (scale[..., None] if scale.ndim else scale)


def merge_states(o_states, lse_states, sinks=None):
    """Attention over the union of disjoint key sets from each set's (o [..., H, S, D],
    lse [..., H, S]): lse = log sum exp(lse_i), o = sum exp(lse_i - lse) o_i; sinks [H]
    join the denominator only (lse excludes them). No key at all: o = 0, lse = -inf."""
    lse_i = np.stack([np.asarray(x, dtype=np.float64) for x in lse_states])
    o_i = np.stack([np.asarray(x, dtype=np.float64) for x in o_states])
    top = lse_i.max(axis=0)
    shift = np.where(top == -np.inf, 0.0, top)
    weights = np.exp(lse_i - shift)                           # 0 for -inf states
    total = weights.sum(axis=0)
    live = total > 0
    with np.errstate(divide="ignore"):
        lse = np.where(live, np.log(np.where(live, total, 1.0)) + shift, -np.inf)
    w = np.where(live, weights / np.where(live, total, 1.0), 0.0)
    o = np.einsum("n...,n...d->...d", w, np.where(w[..., None] > 0, o_i, 0.0))
    if sinks is not None:
        sink = np.asarray(sinks, dtype=np.float64).reshape(-1, 1)
        o = o * np.where(live, 1.0 / (1.0 + np.exp(sink - np.where(live, lse, 0.0))), 0.0)[..., None]
    return o, lse

# ==== end decode / kv cache / merge ============================================


# ==== serving batches: ragged and paged attention ==============================
# Packed token-major q [Nq, Hq, Dqk], k [Nk, Hkv, Dqk], v [Nk, Hkv, Dv] -> o [Nq, Hq, Dv],
# lse [Nq, Hq]. Each sequence is one sdpa (bottom-right aligned); rows outside every
# sequence get o = 0, lse = -inf. Offsets, lengths and block tables are host integers.
# fp8 K/V (or pools) come with a scale each: x stands for x * scale (dequantize_fp8).


def _offsets(cu, n: int, name: str) -> np.ndarray:
    """cu as int64 [B+1], asserted non-decreasing, >= 0 and <= n."""
    cu = np.asarray(cu).astype(np.int64)
    assert cu.ndim == 1 and cu.size >= 1, f"{name}: expected a 1-D [B+1] array, got shape {cu.shape}"
    assert cu[0] >= 0 and cu[-1] <= n and np.all(np.diff(cu) >= 0), \
        f"{name}: offsets must be non-decreasing within [0, {n}], got {cu.tolist()}"
    return cu


def _head_major(x):
    """token-major [L, H, D] -> [1, H, L, D]."""
    return np.asarray(x)[None].transpose(0, 2, 1, 3)


def _sequence_sdpa(q, k, v, **options):
    """sdpa of one sequence's token-major queries q [n, Hq, Dqk] against head-major
    k, v [1, Hkv, L, D], bottom-right aligned; returns (o [n, Hq, Dv], lse [n, Hq])."""
    o, lse = sdpa(_head_major(q), k, v, causal_align="bottom_right", **options)
    return o[0].transpose(1, 0, 2), lse[0].T


def ragged_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, *, causal=False, window=None,
                     scale=None, softcap=0.0, sinks=None, k_scale=None, v_scale=None):
    """sdpa per sequence b of q[cu_q[b]:cu_q[b+1]] against k, v[cu_k[b]:cu_k[b+1]], causal and
    window aligned bottom-right (query i's diagonal is i + Lk - Lq), scale / softcap / sinks
    as in sdpa; fp8 k / v are dequantized with k_scale / v_scale (a number, or [Nk, Hkv]).
    Returns (o [Nq, Hq, Dv], lse [Nq, Hq]); uncovered rows: o = 0, lse = -inf."""
    q, k, v = np.asarray(q), dequantize_fp8(k, k_scale), dequantize_fp8(v, v_scale)
    cu_q = _offsets(cu_seqlens_q, q.shape[0], "cu_seqlens_q")
    cu_k = _offsets(cu_seqlens_k, k.shape[0], "cu_seqlens_k")
    assert cu_q.size == cu_k.size, "cu_seqlens_q and cu_seqlens_k must both have B+1 entries"
    o = np.zeros((q.shape[0], q.shape[1], v.shape[2]))
    lse = np.full(q.shape[:2], -np.inf)
    for b in range(cu_q.size - 1):
        rows, keys = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        o[rows], lse[rows] = _sequence_sdpa(q[rows], _head_major(k[keys]), _head_major(v[keys]),
                                            causal=causal, window=window, scale=scale,
                                            softcap=softcap, sinks=sinks)
    return o, lse


def paged_attention(q, k_pool, v_pool, qo_indptr, block_table, seq_lens, *, layout="HND",
                    window=None, scale=None, softcap=0.0, sinks=None, k_scale=None, v_scale=None):
    """Sequence b's n_b = qo[b+1] - qo[b] queries q[qo[b]:qo[b+1]] against the first
    seq_lens[b] keys of the pages block_table[b] names, bottom-right causal (query i sees keys
    < seq_lens[b] - n_b + 1 + i), window / softcap / sinks / scale as in decode; layout is
    "HND" / "NHD" or a (k_layout, v_layout) pair. fp8 pools are dequantized with k_scale /
    v_scale (a number, or shaped like the pool less its last axis). Only the pages a row reads
    are looked up. Returns (o [Nq, Hq, Dv], lse [Nq, Hq]); uncovered rows: o = 0, lse = -inf."""
    q, table = np.asarray(q), np.asarray(block_table)
    k_pool, v_pool = dequantize_fp8(k_pool, k_scale), dequantize_fp8(v_pool, v_scale)
    k_layout, v_layout = (layout, layout) if isinstance(layout, str) else layout
    qo = _offsets(qo_indptr, q.shape[0], "qo_indptr")
    lens = np.asarray(seq_lens).astype(np.int64)
    assert table.ndim == 2 and qo.size == table.shape[0] + 1 == lens.size + 1, \
        "block_table [B, max_pages], qo_indptr [B+1] and seq_lens [B] must agree on B"
    page_size = np.asarray(k_pool).shape[2 if k_layout == "HND" else 1]
    num_pages = np.asarray(k_pool).shape[0]
    o = np.zeros((q.shape[0], q.shape[1], np.asarray(v_pool).shape[3]))
    lse = np.full(q.shape[:2], -np.inf)
    for b, length in enumerate(lens.tolist()):
        assert 0 <= length <= table.shape[1] * page_size, \
            f"seq_lens[{b}] = {length} outside [0, {table.shape[1] * page_size}]"
        pages = table[b:b + 1, :-(-length // page_size)]
        assert np.all((pages >= 0) & (pages < num_pages)), f"block_table[{b}] reads a page outside the pool"
        rows = slice(qo[b], qo[b + 1])
        o[rows], lse[rows] = _sequence_sdpa(
            q[rows], gather_pages(k_pool, pages, length, k_layout), gather_pages(v_pool, pages, length, v_layout),
            causal=True, window=window, scale=scale, softcap=softcap, sinks=sinks)
    return o, lse

# ==== end serving ==============================================================
