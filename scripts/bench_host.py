"""Host cost of every op, without a GPU: Python microseconds per call, eager and prepared.

The driver is replaced by no-ops at the cuda.bindings boundary (ptxattn.fake_driver), so what
is timed is ptxattn's own Python: argument checks, the binding cache, pointer rewrites and the
calls into cuda.bindings. It runs in a child process, since the fake cannot be taken out
again; CI runs it as a smoke check, so a host regression shows without a GPU. On the GPU
machine, the launch suite measures the same calls against the real driver.
"""
from __future__ import annotations

import json
import subprocess
import sys
import time


def run(args) -> list[dict]:
    child = subprocess.run([sys.executable, __file__, "--quick" if args.quick else "--full"],
                           capture_output=True, text=True, check=False)
    if child.returncode != 0:
        raise RuntimeError(f"bench_host: the measuring process failed:\n{child.stderr[-2000:]}")
    return json.loads(child.stdout)


def _per_call_us(fn, calls: int) -> float:
    """The best of three rounds of back-to-back calls, in microseconds per call."""
    fn()
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - start) / calls)
    return best * 1e6


def _cases():
    """(op, shape, eager call, prepared call) for every op, on device arrays."""
    import numpy as np

    import ptxattn

    bf16, f32 = ptxattn.bfloat16, np.float32
    s = ptxattn.Stream.create()
    e = ptxattn.empty
    q, out = e((2, 8, 512, 128), bf16), e((2, 8, 512, 128), bf16)
    lse = e((2, 8, 512), f32)
    yield ("sdpa", "B2 H8 S512 D128 causal, out=", lambda: ptxattn.sdpa(q, q, q, causal=True, out=out, stream=s),
           ptxattn.prepare(ptxattn.sdpa, q, q, q, causal=True, out=out, stream=s))
    yield ("sdpa", "B2 H8 S512 D128, out= out_lse=",
           lambda: ptxattn.sdpa(q, q, q, out=out, out_lse=lse, stream=s),
           ptxattn.prepare(ptxattn.sdpa, q, q, q, out=out, out_lse=lse, stream=s))
    tq = e((4, 16, 512, 128), bf16)  # more blocks than SMs: the persistent twin, on the fake H200 too
    yield ("sdpa", "B4 H16 S512 D128 causal, nothing preallocated (persistent)",
           lambda: ptxattn.sdpa(tq, tq, tq, causal=True, stream=s), None)
    dq, dout = e((8, 32, 1, 128), bf16), e((8, 32, 1, 128), bf16)
    kc = e((8, 8, 4096, 128), bf16)
    lens = e((8,), np.int32)
    ws = e((ptxattn.decode_workspace_bytes(dq, kc, kc),), np.uint8)
    yield ("decode", "B8 Hq32 Hkv8 T4096 D128, out= workspace=",
           lambda: ptxattn.decode(dq, kc, kc, lens, out=dout, workspace=ws, stream=s),
           ptxattn.prepare(ptxattn.decode, dq, kc, kc, lens, out=dout, workspace=ws, stream=s))
    yield ("decode", "B8 Hq32 Hkv8 T4096 D128, nothing preallocated",
           lambda: ptxattn.decode(dq, kc, kc, lens, stream=s), None)
    pool, table = e((8 * 256, 8, 16, 128), bf16), e((8, 256), np.int32)
    pws = e((ptxattn.paged_decode_workspace_bytes(dq, pool, pool, table),), np.uint8)
    yield ("paged_decode", "B8 Hq32 Hkv8 T4096 D128 page16, out= workspace=",
           lambda: ptxattn.paged_decode(dq, pool, pool, table, lens, out=dout, workspace=pws, stream=s),
           ptxattn.prepare(ptxattn.paged_decode, dq, pool, pool, table, lens, out=dout, workspace=pws, stream=s))
    kn = e((8, 8, 1, 128), bf16)
    yield ("kv_append", "B8 Hkv8 n1 D128", lambda: ptxattn.kv_append(kn, kn, kc, kc, lens, stream=s),
           ptxattn.prepare(ptxattn.kv_append, kn, kn, kc, kc, lens, stream=s))
    tokens, slots = e((64, 8, 128), bf16), e((64,), np.int32)
    yield ("paged_kv_append", "T64 Hkv8 D128", lambda: ptxattn.paged_kv_append(tokens, tokens, pool, pool, slots,
                                                                               stream=s),
           ptxattn.prepare(ptxattn.paged_kv_append, tokens, tokens, pool, pool, slots, stream=s))
    sq, sk, so = e((2048, 32, 128), bf16), e((2048, 8, 128), bf16), e((2048, 32, 128), bf16)
    offsets = e((5,), np.int32)
    yield ("ragged_attention", "4 seqs, 2048 tokens Hq32 Hkv8 D128 causal, out=",
           lambda: ptxattn.ragged_attention(sq, sk, sk, offsets, offsets, causal=True, out=so, stream=s),
           ptxattn.prepare(ptxattn.ragged_attention, sq, sk, sk, offsets, offsets, causal=True, out=so, stream=s))
    table4, lens4 = table[:4], lens[:4]  # sliced once: a slice costs the host ~2 us, not the op's
    sws = e((ptxattn.paged_attention_workspace_bytes(sq, pool, pool, offsets, table4),), np.uint8)
    yield ("paged_attention", "4 seqs, 2048 tokens Hq32 Hkv8 D128 page16, out= workspace=",
           lambda: ptxattn.paged_attention(sq, pool, pool, offsets, table4, lens4, out=so, workspace=sws, stream=s),
           ptxattn.prepare(ptxattn.paged_attention, sq, pool, pool, offsets, table4, lens4, out=so, workspace=sws,
                           stream=s))
    states, state_lse = e((4, 8, 32, 1, 128), bf16), e((4, 8, 32, 1), f32)
    mo, ml = e((8, 32, 1, 128), bf16), e((8, 32, 1), f32)
    yield ("merge_states_n", "N4 B8 H32 D128", lambda: ptxattn.merge_states_n(states, state_lse, out=mo, out_lse=ml,
                                                                              stream=s),
           ptxattn.prepare(ptxattn.merge_states_n, states, state_lse, out=mo, out_lse=ml, stream=s))
    x, y = e((64, 4096), f32), e((64, 4096), f32)
    yield ("softmax", "64 x 4096 f32", lambda: ptxattn.softmax(x, out=y, stream=s),
           ptxattn.prepare(ptxattn.softmax, x, out=y, stream=s))


def _measure(quick: bool) -> list[dict]:
    import ptxattn.fake_driver as fake

    fake.install()
    calls = 2000 if quick else 20000
    rows = []
    for op, shape, eager, prepared in _cases():
        rows.append({"op": op, "shape": shape, "eager_us": _per_call_us(eager, calls),
                     "prepared_us": _per_call_us(prepared.run, calls) if prepared is not None else None})
    return rows


if __name__ == "__main__":
    print(json.dumps(_measure(sys.argv[1] == "--quick")))
