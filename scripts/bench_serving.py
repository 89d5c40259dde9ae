"""Serving batches (bf16, D128): ragged prefill against our dense sdpa, paged prefill against
the same work on contiguous K/V, and a mixed step (prefill chunks plus decode rows) in one
paged_attention call against the best split into separate calls.

- ragged: 16 sequences with lengths drawn from U[256, 4096], H32, causal; TFLOP/s count only
  the live causal work (4 * H * D * L^2 / 2 a sequence, as the prefill suite counts S^2 / 2),
  beside our dense sdpa at B4 H32 S4096 causal in the same run.
- paged16 / paged64: paged_attention (decode_queries=0) over the same sequences in shuffled
  pools of 16- and 64-token pages; the ratio is ragged time over paged time.
- fp8: the ragged call over the same K/V quantized to e4m3 with per-token scales, beside bf16;
  its error against the reference over the dequantized K/V and over the bf16 K/V it came from.
- mixed: Hq32 Hkv8, 2 prefill chunks of 2048 new tokens (2048 cached before them) and 62
  decode rows of one query, every sequence at 4096 keys, pages of 16: one paged_attention call
  (eager, and its replayed graph) against paged_attention over the chunks plus paged_decode
  over the decode rows (two calls).
Each result is checked against the float64 reference (sequence 0 / a decode row, head 0).
"""
from __future__ import annotations

import numpy as np

import ptxattn
from ptxattn import reference

from bench_common import host_ms, random_host, relative_error, stream, time_ms, upload

BF16 = ptxattn.bfloat16
D = 128
CHECKED_ROWS = 256


def _offsets(lengths) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)


def _block_table(rng, lengths, page_size: int) -> np.ndarray:
    """A shuffled block table giving each sequence the pages its length needs."""
    per_seq = [-(-int(n) // page_size) for n in lengths]
    order = rng.permutation(sum(per_seq))
    table = np.zeros((len(lengths), max(per_seq)), np.int32)
    for b, used in enumerate(np.cumsum([0] + per_seq[:-1])):
        table[b, :per_seq[b]] = order[used:used + per_seq[b]]
    return table


def _paginate(packed: np.ndarray, lengths, page_size: int, table: np.ndarray) -> np.ndarray:
    """The packed [N, H, D] rows of each sequence in the HND pool pages `table` gives them."""
    pool = np.zeros((int(table.max()) + 1, packed.shape[1], page_size, D), packed.dtype)
    start = 0
    for b, n in enumerate(lengths):
        for j in range(-(-int(n) // page_size)):
            chunk = packed[start + j * page_size:start + min(int(n), (j + 1) * page_size)]
            pool[table[b, j], :, :chunk.shape[0]] = chunk.transpose(1, 0, 2)
        start += int(n)
    return pool


def _check_last_rows(q, k, v, out, q0: int, k0: int, lq: int, lk: int) -> float:
    """Relative error of one sequence's last CHECKED_ROWS query rows, head 0, against the
    float64 reference (bottom-right causal)."""
    first = max(lq - CHECKED_ROWS, 0)
    q_h = q[q0 + first:q0 + lq, 0][None, None]
    k_h, v_h = (x[k0:k0 + lk, 0][None, None] for x in (k, v))
    want, _ = reference.sdpa(q_h, k_h, v_h, causal=True, causal_align="bottom_right")
    return relative_error(out[q0 + first:q0 + lq, 0], want[0, 0])


def _dense_causal_tflops(rng, h: int, repeat: int) -> float:
    """Our dense sdpa at B4 S4096 D128 causal, the ragged row's yardstick."""
    sets = [tuple(upload(random_host(rng, (4, h, 4096, D), BF16)) for _ in range(3)) for _ in range(2)]
    out = ptxattn.empty((4, h, 4096, D), BF16)

    def dense(i):
        ptxattn.sdpa(*sets[i], causal=True, out=out, stream=stream())

    return 4 * 4 * h * 4096 ** 2 * D / 2 / (time_ms(dense, repeat=repeat, rotate=len(sets)) * 1e-3) / 1e12


def _ragged_rows(rng, repeat: int) -> list[dict]:
    h = 32
    lengths = rng.integers(256, 4097, 16)
    cu = _offsets(lengths)
    n = int(cu[-1])
    q, k, v = (random_host(rng, (n, h, D), BF16) for _ in range(3))
    dq, dk, dv, dcu = upload(q), upload(k), upload(v), upload(cu)
    out = ptxattn.empty((n, h, D), BF16)
    live_flops = sum(4 * h * D * int(x) ** 2 / 2 for x in lengths)

    def ragged(i):
        ptxattn.ragged_attention(dq, dk, dv, dcu, dcu, causal=True, out=out, stream=stream())

    ragged_ms = time_ms(ragged, repeat=repeat)
    dense_tflops = _dense_causal_tflops(rng, h, repeat)
    ragged(0)
    host_out = out.get(stream())
    ragged_tflops = live_flops / (ragged_ms * 1e-3) / 1e12
    rows = [{"shape": f"ragged 16 seqs U[256, 4096] H{h} D{D} causal ({n} tokens)", "ptxattn_ms": ragged_ms,
             "ptxattn_tflops": ragged_tflops, "dense_sdpa_tflops (B4 S4096)": dense_tflops,
             "ratio_vs_dense": ragged_tflops / dense_tflops,
             "host_us": 1e3 * host_ms(ragged),
             "rel_err_vs_reference": _check_last_rows(q, k, v, host_out, 0, 0, int(lengths[0]), int(lengths[0])),
             "chart": {"unit": "TFLOP/s", "series": {"ragged": ragged_tflops, "dense": dense_tflops}}}]
    for page_size in (16, 64):
        table = _block_table(rng, lengths, page_size)
        pools = (upload(_paginate(k, lengths, page_size, table)), upload(_paginate(v, lengths, page_size, table)),
                 upload(table), upload(lengths.astype(np.int32)))

        def paged(i, pools=pools):
            ptxattn.paged_attention(dq, pools[0], pools[1], dcu, pools[2], pools[3], decode_queries=0, out=out,
                                    stream=stream())

        paged_ms = time_ms(paged, repeat=repeat)
        paged(0)
        tflops = live_flops / (paged_ms * 1e-3) / 1e12
        rows.append({"shape": f"paged{page_size} prefill, the same sequences", "ptxattn_ms": paged_ms,
                     "ptxattn_tflops": tflops, "ratio_vs_contiguous": ragged_ms / paged_ms,
                     "rel_err_vs_reference": _check_last_rows(q, k, v, out.get(stream()), 0, 0, int(lengths[0]),
                                                              int(lengths[0])),
                     "chart": {"unit": "TFLOP/s", "series": {"ragged": ragged_tflops, "paged": tflops}}})
        del pools
    return rows + [_fp8_ragged_row(q, k, v, lengths, ragged_ms, live_flops, repeat)]


def _fp8_ragged_row(q, k, v, lengths, bf16_ms: float, live_flops: float, repeat: int) -> dict:
    """The ragged row's call over e4m3 K/V with per-token scales (as the quantizing append
    writes them), beside its bf16 time and the bf16 call with softcap 50: fp8 runs the
    general kernels only, and softcap puts bf16 on them too."""
    fp8 = ptxattn.dtypes.float8_e4m3fn
    (k8, k_scale), (v8, v_scale) = ((reference.quantize_fp8(x, scale[..., None], fp8), scale)
                                    for x in (k, v) for scale in [reference.fp8_token_scales(x, fp8)])
    cu = _offsets(lengths)
    dq, dk, dv, dcu, dks, dvs = (upload(x) for x in (q, k8, v8, cu, k_scale, v_scale))
    out = ptxattn.empty(q.shape, BF16)

    def ragged(i):
        ptxattn.ragged_attention(dq, dk, dv, dcu, dcu, causal=True, k_scale=dks, v_scale=dvs, out=out,
                                 stream=stream())

    ms = time_ms(ragged, repeat=repeat)
    ragged(0)
    got = out.get(stream())
    bf16 = tuple(upload(x) for x in (k, v))

    def softcapped(i):
        ptxattn.ragged_attention(dq, *bf16, dcu, dcu, causal=True, softcap=50.0, out=out, stream=stream())

    general_ms = time_ms(softcapped, repeat=repeat)
    n0 = int(lengths[0])
    keys = (reference.dequantize_fp8(x, s) for x, s in ((k8, k_scale), (v8, v_scale)))
    return {"shape": "ragged over e4m3 K/V (per-token scales), the same sequences", "ptxattn_ms": ms,
            "ptxattn_tflops": live_flops / (ms * 1e-3) / 1e12, "ratio_vs_bf16": bf16_ms / ms,
            "ratio_vs_bf16_softcap": general_ms / ms,
            "rel_err_vs_reference": _check_last_rows(q, *keys, got, 0, 0, n0, n0),
            "rel_err_vs_unquantized": _check_last_rows(q, k, v, got, 0, 0, n0, n0),
            "chart": {"unit": "ms", "series": {"bf16": bf16_ms, "e4m3": ms}}}


def _mixed_row(rng, repeat: int) -> dict:
    hq, hkv, page_size, length, chunk, chunks, decodes = 32, 8, 16, 4096, 2048, 2, 62
    batch = chunks + decodes
    per_seq = length // page_size
    table = rng.permutation(batch * per_seq).reshape(batch, per_seq).astype(np.int32)
    k_pool, v_pool = (upload(random_host(rng, (batch * per_seq, hkv, page_size, D), BF16)) for _ in range(2))
    new = [chunk] * chunks + [1] * decodes
    qo = _offsets(new)
    q = random_host(rng, (int(qo[-1]), hq, D), BF16)
    lens = np.full(batch, length, np.int32)
    dq, dqo, dtable, dlens = upload(q), upload(qo), upload(table), upload(lens)
    out = ptxattn.empty(q.shape, BF16)
    ws = ptxattn.empty((ptxattn.paged_attention_workspace_bytes(dq, k_pool, v_pool, dqo, dtable),), np.uint8)

    def one_call(i):
        ptxattn.paged_attention(dq, k_pool, v_pool, dqo, dtable, dlens, decode_queries=1, out=out, workspace=ws,
                                stream=stream())

    # The split: the chunks through paged_attention, the decode rows through paged_decode.
    split_q, split_qo = upload(q[:chunks * chunk]), upload(qo[:chunks + 1])
    split_table, split_lens = upload(table[:chunks]), upload(lens[:chunks])
    dec_q = upload(np.ascontiguousarray(q[chunks * chunk:].reshape(decodes, 1, hq, D).transpose(0, 2, 1, 3)))
    dec_table, dec_lens = upload(table[chunks:]), upload(lens[chunks:])
    split_out = ptxattn.empty((chunks * chunk, hq, D), BF16)
    dec_out = ptxattn.empty((decodes, hq, 1, D), BF16)
    dec_ws = ptxattn.empty((max(1, ptxattn.paged_decode_workspace_bytes(dec_q, k_pool, v_pool, dec_table)),),
                           np.uint8)

    def split(i):
        ptxattn.paged_attention(split_q, k_pool, v_pool, split_qo, split_table, split_lens, decode_queries=0,
                                out=split_out, stream=stream())
        ptxattn.paged_decode(dec_q, k_pool, v_pool, dec_table, dec_lens, out=dec_out, workspace=dec_ws,
                             stream=stream())

    one_call(0)
    with ptxattn.capture(stream()) as graph:
        one_call(0)
    one_ms = time_ms(one_call, repeat=repeat)
    graph_ms = time_ms(lambda i: graph.replay(stream()), repeat=repeat)
    split_ms = time_ms(split, repeat=repeat)
    one_call(0)
    split(0)
    got = out.get(stream())
    want = np.concatenate([split_out.get(stream()), dec_out.get(stream()).transpose(0, 2, 1, 3).reshape(decodes, hq, D)])
    pools_host = k_pool.get(stream()), v_pool.get(stream())
    last = batch - 1  # a decode row, head 0, against the reference
    keys = [reference.gather_pages(p[:, :1], table[last:], length) for p in pools_host]
    ref, _ = reference.sdpa(q[qo[last]:qo[last + 1], :1].transpose(1, 0, 2)[None], keys[0], keys[1], causal=True,
                            causal_align="bottom_right")
    return {"shape": f"mixed Hq{hq} Hkv{hkv}: {chunks} chunks x {chunk} + {decodes} decode rows, all at {length} keys",
            "one_call_ms": one_ms, "one_call_graph_ms": graph_ms, "split_ms": split_ms,
            "one_call_vs_split": one_ms / split_ms, "graph_vs_split": graph_ms / split_ms,
            "host_us": 1e3 * host_ms(one_call),
            "rel_err_vs_split": relative_error(got, want),
            "rel_err_vs_reference": relative_error(got[qo[last]:qo[last + 1], :1].transpose(1, 0, 2), ref[0]),
            "chart": {"unit": "ms", "series": {"one call": one_ms, "graph": graph_ms, "split": split_ms}}}


def run(args) -> list[dict]:
    rng = np.random.default_rng(0)
    repeat = 5 if args.quick else 20
    return _ragged_rows(rng, repeat) + [_mixed_row(rng, repeat)]
