"""`ptxattn demo`: the decode loop ptxattn is for, run three ways and checked to agree bit for bit.

An L-layer GQA decode step: each layer appends the token's K/V to its cache (kv_append, or
paged_kv_append into a paged pool) and attends (decode / paged_decode). The prompt is
prefilled with sdpa, and every layer's output feeds the next one (its first Hkv heads are the
next layer's new keys, the next Hkv its new values, all Hq its query; the last layer's output
starts the next token), so every step depends on the one before. The same tokens run eagerly,
as prepared calls, and as one captured graph replayed per token; the caches start from the
same prefill each time, and the three final outputs must be equal bit for bit. Without
weights this is not a language model: it is the attention of one, at the sizes of one.
"""
from __future__ import annotations

import argparse
import sys
import time

import numpy as np

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--layers", type=int, default=32, help="decoder layers (default 32)")
    parser.add_argument("--batch", type=int, default=8, help="sequences decoded together (default 8)")
    parser.add_argument("--heads", type=int, default=32, help="query heads Hq (default 32)")
    parser.add_argument("--kv-heads", type=int, default=8, help="key/value heads Hkv (default 8; GQA)")
    parser.add_argument("--head-dim", type=int, default=128, choices=(64, 128, 256), help="head dim (default 128)")
    parser.add_argument("--capacity", type=int, default=4096, help="KV cache capacity per sequence (default 4096)")
    parser.add_argument("--prompt", type=int, default=1024, help="prompt tokens prefilled by sdpa (default 1024)")
    parser.add_argument("--steps", type=int, default=64, help="tokens decoded in each mode (default 64)")
    parser.add_argument("--paged", action="store_true", help="a paged KV pool (16-token pages) instead of "
                                                              "contiguous caches")


class _Model:
    """Per-layer caches and the step's arrays on the device; `prefill()` resets the caches."""

    PAGE = 16

    def __init__(self, args, stream) -> None:
        import ptxattn

        self.args, self.stream = args, stream
        b, hq, hkv, d, cap, prompt = args.batch, args.heads, args.kv_heads, args.head_dim, args.capacity, args.prompt
        if hq % hkv or 2 * hkv > hq:
            raise SystemExit(f"demo: --heads ({hq}) must be a multiple of --kv-heads ({hkv}) and at least twice it")
        if prompt < 1 or prompt + args.steps + 1 > cap:
            raise SystemExit(f"demo: the prompt ({prompt}) plus --steps ({args.steps}) + 1 must fit the capacity "
                             f"({cap})")
        bf16 = ptxattn.bfloat16
        rng = np.random.default_rng(0)
        prompt_kv = [rng.standard_normal((b, hkv, prompt, d)).astype(bf16) for _ in range(2)]
        self.prompt_kv = [ptxattn.asarray(x, stream) for x in prompt_kv]
        self.prompt_q = ptxattn.asarray(rng.standard_normal((b, hq, prompt, d)).astype(bf16), stream)
        self.first = ptxattn.empty((b, hq, 1, d), bf16)  # the next token's layer-0 input
        self.outs = [ptxattn.empty((b, hq, 1, d), bf16) for _ in range(args.layers)]
        self.host_lens = np.zeros(b, np.int32)
        if args.paged:
            pages_per_seq = -(-cap // self.PAGE)
            self.table_host = rng.permutation(b * pages_per_seq).astype(np.int32).reshape(b, pages_per_seq)
            self.table = ptxattn.asarray(self.table_host, stream)
            # The prompt as tokens [B * prompt, Hkv, D] and the slot of each.
            self.prompt_tokens = [ptxattn.asarray(np.ascontiguousarray(x.transpose(0, 2, 1, 3)).reshape(
                b * prompt, hkv, d), stream) for x in prompt_kv]
            self.prompt_slots = ptxattn.asarray(self._slots(np.repeat(np.arange(b), prompt),
                                                            np.tile(np.arange(prompt), b)), stream)
            self.slots = ptxattn.empty((b,), np.int32)
            self.lens = [ptxattn.empty((b,), np.int32)] * args.layers  # one length array serves every layer
            shape = (b * pages_per_seq, hkv, self.PAGE, d)
        else:
            self.lens = [ptxattn.empty((b,), np.int32) for _ in range(args.layers)]  # kv_append advances each
            shape = (b, hkv, cap, d)
        self.caches = [(ptxattn.empty(shape, bf16), ptxattn.empty(shape, bf16)) for _ in range(args.layers)]

    def _slots(self, rows: np.ndarray, positions: np.ndarray) -> np.ndarray:
        return (self.table_host[rows, positions // self.PAGE] * self.PAGE + positions % self.PAGE).astype(np.int32)

    def _io(self, layer: int):
        """(q, k_new, v_new, out) of a layer: its input is the previous layer's output."""
        hkv = self.args.kv_heads
        x = self.outs[layer - 1] if layer else self.first
        return x, x[:, :hkv], x[:, hkv:2 * hkv], self.outs[layer]

    def prefill(self) -> None:
        """Every layer's cache holds the prompt (written by the append kernels), and the first
        token's input is sdpa over the prompt (its last position)."""
        import ptxattn

        s, prompt, b = self.stream, self.args.prompt, self.args.batch
        k, v = self.prompt_kv
        for layer, (kc, vc) in enumerate(self.caches):
            if self.args.paged:
                ptxattn.paged_kv_append(*self.prompt_tokens, kc, vc, self.prompt_slots, stream=s)
            else:
                self.lens[layer].set(np.zeros(b, np.int32), s)
                ptxattn.kv_append(k, v, kc, vc, self.lens[layer], stream=s)
        o = ptxattn.sdpa(self.prompt_q, k, v, causal=True, stream=s)
        self.first.set(np.ascontiguousarray(o.get(s)[:, :, -1:]), s)
        self.host_lens[:] = prompt
        if self.args.paged:
            self.lens[0].set(self.host_lens, s)

    def before_step(self) -> None:
        """Paged pools: the host says where this token goes and the lengths that include it,
        as a server's scheduler does (contiguous caches advance on the device)."""
        if self.args.paged:
            self.slots.set(self._slots(np.arange(self.args.batch), self.host_lens), self.stream)
            self.lens[0].set(self.host_lens + 1, self.stream)

    def after_step(self) -> None:
        self.host_lens += 1

    def eager_step(self) -> None:
        import ptxattn

        s = self.stream
        for layer, (kc, vc) in enumerate(self.caches):
            q, k_new, v_new, out = self._io(layer)
            lens = self.lens[layer]
            if self.args.paged:
                ptxattn.paged_kv_append(k_new[:, :, 0], v_new[:, :, 0], kc, vc, self.slots, stream=s)
                ptxattn.paged_decode(q, kc, vc, self.table, lens, out=out, stream=s)
            else:
                ptxattn.kv_append(k_new, v_new, kc, vc, lens, stream=s)
                ptxattn.decode(q, kc, vc, lens, out=out, stream=s)
        self.first_from_last()

    def first_from_last(self) -> None:
        """The last layer's output is the next token's input (a device-to-device copy)."""
        from .driver import call, cu

        call(cu.cuMemcpyDtoDAsync, self.first.ptr, self.outs[-1].ptr, self.first.nbytes, self.stream.handle)

    def prepared_step(self):
        """The step as prepared calls, bound once: each run launches with nothing to check.
        Returns (step, kernel launches a step)."""
        import ptxattn

        s, calls = self.stream, []
        for layer, (kc, vc) in enumerate(self.caches):
            q, k_new, v_new, out = self._io(layer)
            lens = self.lens[layer]
            if self.args.paged:
                calls.append(ptxattn.prepare(ptxattn.paged_kv_append, k_new[:, :, 0], v_new[:, :, 0], kc, vc,
                                             self.slots, stream=s))
                calls.append(ptxattn.prepare(ptxattn.paged_decode, q, kc, vc, self.table, lens, out=out, stream=s))
            else:
                calls.append(ptxattn.prepare(ptxattn.kv_append, k_new, v_new, kc, vc, lens, stream=s))
                calls.append(ptxattn.prepare(ptxattn.decode, q, kc, vc, lens, out=out, stream=s))

        def step():
            for prepared in calls:
                prepared.run()
            self.first_from_last()
        return step, sum(len(p.launches) for p in calls)


def _progress(mode: str, done: int, total: int) -> None:
    width = 30
    filled = width * done // total
    sys.stdout.write(f"\r  {mode:<9} [{'#' * filled}{'.' * (width - filled)}] {done}/{total}")
    sys.stdout.flush()


def _decode(model: _Model, mode: str, step, steps: int, stream):
    """Run `steps` tokens with `step()` from a fresh prefill: (host us/step, device us/step,
    the final output's bytes)."""
    from .stream import Event

    model.prefill()
    stream.synchronize()
    host = 0.0
    start = Event(timing=True).record(stream)
    for i in range(steps):
        model.before_step()
        begin = time.perf_counter()
        step()
        host += time.perf_counter() - begin
        model.after_step()
        if (i + 1) % max(1, steps // 30) == 0 or i + 1 == steps:
            _progress(mode, i + 1, steps)
    end = Event(timing=True).record(stream)
    end.synchronize()
    print()
    return host / steps * 1e6, start.elapsed_ms(end) / steps * 1e3, model.outs[-1].get(stream).tobytes()


def run(args) -> None:
    import ptxattn
    from .context import on_device

    dev = ptxattn.get_device(0)
    with on_device(dev):
        stream = ptxattn.Stream.create()
        model = _Model(args, stream)
        kind = "paged (16-token pages)" if args.paged else "contiguous"
        print(f"device:   {dev.name}, {dev.sm_count} SMs, PTX for {ptxattn.ptx_arch(dev)}")
        print(f"model:    {args.layers} layers, B{args.batch} Hq{args.heads} Hkv{args.kv_heads} D{args.head_dim} "
              f"bf16, {kind} KV cache of {args.capacity}, prompt {args.prompt} (prefilled by sdpa), "
              f"{args.steps} tokens a mode")
        results = {}
        model.prefill()
        model.eager_step()  # warm-up: modules, bindings, the fault buffer
        results["eager"] = _decode(model, "eager", model.eager_step, args.steps, stream)
        prepared, launches = model.prepared_step()
        results["prepared"] = _decode(model, "prepared", prepared, args.steps, stream)
        with ptxattn.capture(stream, dev) as graph:
            prepared()
        results["graph"] = _decode(model, "graph", graph.replay, args.steps, stream)
        ptxattn.check_faults(dev, stream)
    outputs = {mode: r[2] for mode, r in results.items()}
    if len(set(outputs.values())) != 1:
        raise SystemExit(f"demo: the three modes disagree: {sorted(m for m in outputs if outputs[m] != outputs['eager'])}"
                         f" differ from eager")
    print(f"\n{'mode':<9} {'host us/step':>13} {'device us/step':>15} {'tokens/s':>10}   ({launches} kernels and "
          f"a copy a step)")
    for mode, (host_us, device_us, _) in results.items():
        print(f"{mode:<9} {host_us:>13.1f} {device_us:>15.1f} {args.batch / (device_us * 1e-6):>10.0f}")
    print("demo: the three modes agree bit for bit; OK")
