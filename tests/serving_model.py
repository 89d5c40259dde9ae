"""A tiny random-weight GQA transformer served by a continuous-batching loop over paged KV
pools, and the same model computed densely per sequence (the oracle the loop is checked against).

The model (NumPy float32 weights): token embedding, `layers` x [RMSNorm -> q/k/v projections ->
rotary embedding of q and k at each token's absolute position -> attention -> output projection,
residual; RMSNorm -> SwiGLU MLP, residual], final RMSNorm, logits. `forward` computes it for some
tokens and takes the attention as a callback, so the dense oracle and the batched loop share
every line except the attention and the bookkeeping around it: the attention and the scheduler
are what is under test.

ContinuousBatcher: requests arrive over time, each takes a free row of the block table,
prefills its prompt in chunks of at most `chunk` tokens, then feeds one token a step (the
request's predetermined tokens, not a sampled one, so the dense check is exact), and leaves
when all its tokens are cached, freeing its row and pages for later arrivals. Every step
packs the new tokens of all live rows (prefill chunks and decode tokens mixed, in row order)
into one batch and, per layer, calls the backend's append (K/V of the new tokens into the
pool) and attend (paged attention of the new queries).
"""
from __future__ import annotations

import dataclasses

import numpy as np

from ptxattn import reference


# ---- the model ------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Config:
    vocab: int = 128
    d_model: int = 256
    layers: int = 2
    q_heads: int = 8
    kv_heads: int = 2  # GQA: query head h reads kv head h // 4
    head_dim: int = 64
    ffn: int = 512
    rope_theta: float = 10000.0


@dataclasses.dataclass
class Weights:
    config: Config
    embed: np.ndarray        # [vocab, d_model]
    layers: list[dict]       # norm1, wq, wk, wv, wo, norm2, w_gate, w_up, w_down
    norm: np.ndarray         # [d_model]
    lm_head: np.ndarray      # [d_model, vocab]

    def astype(self, dtype) -> "Weights":
        return Weights(self.config, self.embed.astype(dtype),
                       [{name: w.astype(dtype) for name, w in layer.items()} for layer in self.layers],
                       self.norm.astype(dtype), self.lm_head.astype(dtype))


def random_weights(config: Config, rng: np.random.Generator) -> Weights:
    """float32 weights scaled so every projection keeps its input's size (unit-variance scores)."""
    def matrix(rows, cols):
        return (rng.standard_normal((rows, cols)) / np.sqrt(rows)).astype(np.float32)

    def gain(n):
        return (1 + 0.1 * rng.standard_normal(n)).astype(np.float32)

    c = config
    hq, hkv = c.q_heads * c.head_dim, c.kv_heads * c.head_dim
    layers = [dict(norm1=gain(c.d_model), wq=matrix(c.d_model, hq), wk=matrix(c.d_model, hkv),
                   wv=matrix(c.d_model, hkv), wo=matrix(hq, c.d_model), norm2=gain(c.d_model),
                   w_gate=matrix(c.d_model, c.ffn), w_up=matrix(c.d_model, c.ffn), w_down=matrix(c.ffn, c.d_model))
              for _ in range(c.layers)]
    return Weights(c, rng.standard_normal((c.vocab, c.d_model)).astype(np.float32), layers, gain(c.d_model),
                   matrix(c.d_model, c.vocab))


def rms_norm(x, gain, eps=1e-6):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * gain


def rope(x, positions, theta):
    """Rotary embedding of x [n, H, D] at absolute positions [n]: dims i and i + D/2 rotate as a pair."""
    half = x.shape[-1] // 2
    angle = np.asarray(positions, np.float64)[:, None] * theta ** (-np.arange(half) / half)  # [n, D/2]
    cos, sin = (f(angle)[:, None, :].astype(x.dtype) for f in (np.cos, np.sin))
    x1, x2 = x[..., :half], x[..., half:]
    return np.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1)


def forward(weights: Weights, tokens, positions, attention):
    """Logits [n, vocab] of n tokens at the given absolute positions, in the weights' dtype.
    attention(layer, q [n, Hq, D], k [n, Hkv, D], v [n, Hkv, D]) -> o [n, Hq, D] is the only
    part that sees other tokens (the dense oracle, or the batcher's paged KV cache)."""
    c = weights.config
    x = weights.embed[np.asarray(tokens)]
    n = x.shape[0]
    for i, w in enumerate(weights.layers):
        h = rms_norm(x, w["norm1"])
        q = rope((h @ w["wq"]).reshape(n, c.q_heads, c.head_dim), positions, c.rope_theta)
        k = rope((h @ w["wk"]).reshape(n, c.kv_heads, c.head_dim), positions, c.rope_theta)
        v = (h @ w["wv"]).reshape(n, c.kv_heads, c.head_dim)
        x = x + attention(i, q, k, v).astype(x.dtype).reshape(n, -1) @ w["wo"]
        h = rms_norm(x, w["norm2"])
        gate = h @ w["w_gate"]
        x = x + (gate / (1 + np.exp(-gate)) * (h @ w["w_up"])) @ w["w_down"]
    return rms_norm(x, weights.norm) @ weights.lm_head


def dense_forward(weights: Weights, tokens) -> np.ndarray:
    """Logits [len(tokens), vocab] of one whole sequence, all in float64, attention by
    reference.sdpa(causal=True) over the sequence itself: no cache, no pages, no batch."""
    def attention(layer, q, k, v):
        o, _ = reference.sdpa(*(x.transpose(1, 0, 2)[None] for x in (q, k, v)), causal=True)
        return o[0].transpose(1, 0, 2)

    return forward(weights.astype(np.float64), tokens, np.arange(len(tokens)), attention)


# ---- the serving loop ----------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Budget:
    """The fixed sizes of the loop: every step's batch has these shapes, live or not."""
    max_seqs: int    # rows of the block table: sequences live at once
    max_tokens: int  # new tokens (query rows) per step, all sequences together
    chunk: int       # prompt tokens of one sequence per step at most
    page_size: int
    num_pages: int   # pages of each layer's pool
    max_pages: int   # block table columns: a sequence holds at most max_pages * page_size tokens


@dataclasses.dataclass
class Request:
    rid: int
    arrival: int        # first step it may be admitted at
    tokens: np.ndarray  # every token it feeds: the prompt, then one per decode step
    prompt_len: int


@dataclasses.dataclass
class Sequence:
    """A request while it is live: its block-table row, its pages in order, its cached tokens."""
    request: Request
    row: int
    pages: list[int] = dataclasses.field(default_factory=list)
    cached: int = 0  # tokens whose K/V are in the pools (its seq_len)


class ContinuousBatcher:
    def __init__(self, weights: Weights, backend, budget: Budget, rng: np.random.Generator) -> None:
        self.weights, self.backend, self.budget = weights, backend, budget
        self.block_table = np.full((budget.max_seqs, budget.max_pages), -1, np.int32)  # -1: no page
        self.free_pages = [int(p) for p in rng.permutation(budget.num_pages)]  # a stack: freed pages go first
        self.rows: list[Sequence | None] = [None] * budget.max_seqs
        self.pools = [backend.new_pools() for _ in weights.layers]  # (k_pool, v_pool) per layer
        self.waiting: list[Request] = []
        self.finished: dict[int, Sequence] = {}
        self.steps = 0

    def submit(self, request: Request) -> None:
        assert len(request.tokens) <= self.budget.max_pages * self.budget.page_size
        self.waiting.append(request)

    def idle(self) -> bool:
        return not self.waiting and all(seq is None for seq in self.rows)

    def _pages(self, tokens: int) -> int:
        return -(-tokens // self.budget.page_size)

    def _admit(self) -> None:
        """First come, first served: a request that has arrived takes the lowest free row once
        the free pages cover its whole length besides what the live sequences will still take."""
        while self.waiting and self.waiting[0].arrival <= self.steps and None in self.rows:
            request = self.waiting[0]
            promised = sum(self._pages(len(s.request.tokens)) - len(s.pages) for s in self.rows if s)
            if len(self.free_pages) - promised < self._pages(len(request.tokens)):
                return
            row = self.rows.index(None)
            self.rows[row] = Sequence(request, row)
            self.waiting.pop(0)

    def _schedule(self) -> list[int]:
        """New tokens of each row this step: the next prompt chunk (<= chunk tokens) or one
        decode token, in row order until max_tokens are taken (a row past it waits a step)."""
        left, counts = self.budget.max_tokens, []
        for seq in self.rows:
            want = 0 if seq is None else min(self.budget.chunk, max(seq.request.prompt_len - seq.cached, 1))
            counts.append(min(want, left))
            left -= counts[-1]
        return counts

    def step(self) -> dict[int, tuple[int, np.ndarray]]:
        """One batch through the model: {rid: (position of its first new token, logits [n, vocab])}."""
        self._admit()
        counts = self._schedule()
        page_size = self.budget.page_size
        tokens, positions, slots, packed = [], [], [], []  # packed: (sequence, its first row in q, rows)
        for seq, n in zip(self.rows, counts):
            if n == 0:
                continue
            packed.append((seq, sum(map(len, tokens)), n))
            pos = np.arange(seq.cached, seq.cached + n)
            while len(seq.pages) * page_size < seq.cached + n:  # pages for the new tokens
                page = self.free_pages.pop()
                self.block_table[seq.row, len(seq.pages)] = page
                seq.pages.append(page)
            tokens.append(seq.request.tokens[pos])
            positions.append(pos)
            slots.append(self.block_table[seq.row, pos // page_size] * page_size + pos % page_size)
            seq.cached += n
        out = {}
        if packed:
            qo_indptr = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)  # empty rows repeat
            seq_lens = np.array([0 if seq is None else seq.cached for seq in self.rows], np.int32)
            slot_mapping = np.concatenate(slots).astype(np.int32)

            def attention(layer, q, k, v):
                k_pool, v_pool = self.backend.append(k, v, *self.pools[layer], slot_mapping)
                self.pools[layer] = (k_pool, v_pool)
                return self.backend.attend(q, k_pool, v_pool, qo_indptr, self.block_table, seq_lens)

            logits = forward(self.weights, np.concatenate(tokens), np.concatenate(positions), attention)
            out = {seq.request.rid: (seq.cached - n, logits[first:first + n]) for seq, first, n in packed}
        self._retire()
        self.steps += 1
        return out

    def _retire(self) -> None:
        """Sequences whose every token is cached leave: their rows and pages are free again."""
        for row, seq in enumerate(self.rows):
            if seq is not None and seq.cached == len(seq.request.tokens):
                self.free_pages.extend(reversed(seq.pages))
                self.block_table[row] = -1
                self.rows[row] = None
                self.finished[seq.request.rid] = seq


# ---- attention backends -----------------------------------------------------------------------
def _pool_shape(config: Config, budget: Budget, layout: str) -> tuple[int, ...]:
    if layout == "HND":
        return (budget.num_pages, config.kv_heads, budget.page_size, config.head_dim)
    return (budget.num_pages, budget.page_size, config.kv_heads, config.head_dim)


class ReferenceBackend:
    """The float64 oracle: reference.paged_kv_append and reference.paged_attention on NumPy pools
    (float32, NaN until written: a read of a slot no token was appended to shows up as NaN)."""

    def __init__(self, config: Config, budget: Budget, layout: str = "HND") -> None:
        self.shape, self.layout = _pool_shape(config, budget, layout), layout

    def new_pools(self):
        return np.full(self.shape, np.nan, np.float32), np.full(self.shape, np.nan, np.float32)

    def append(self, k_new, v_new, k_pool, v_pool, slot_mapping):
        return reference.paged_kv_append(k_new, v_new, k_pool, v_pool, slot_mapping, layout=self.layout)

    def attend(self, q, k_pool, v_pool, qo_indptr, block_table, seq_lens):
        o, _ = reference.paged_attention(q, k_pool, v_pool, qo_indptr, block_table, seq_lens, layout=self.layout)
        return o


class PtxattnBackend:
    """ptxattn on the device with fixed budgets: NaN-filled pools (bf16 by default); q, new K/V
    and slot buffers of max_tokens rows (rows past the step's tokens are zeros, slot -1, and no
    sequence covers them); block table [max_seqs, max_pages], qo_indptr [max_seqs + 1] and
    seq_lens [max_seqs] with empty rows as 0-query, 0-key sequences. Every call therefore has
    the same shapes and buffers, as one captured graph serving every step would. Uploads q,
    K/V and the step's indices, downloads o; the output is NaN-poisoned before each call inside
    canaries (GuardedOutput), and the rows no sequence covers must stay NaN."""

    def __init__(self, config: Config, budget: Budget, rng: np.random.Generator, *, layout: str = "HND",
                 decode_queries: int = 1, dtype=None) -> None:
        import ptxattn
        from gpu_util import GuardedOutput

        self.ptxattn, self.layout, self.decode_queries = ptxattn, layout, decode_queries
        self.dtype = np.dtype(ptxattn.bfloat16 if dtype is None else dtype)
        self.pool_shape, self.max_tokens = _pool_shape(config, budget, layout), budget.max_tokens
        t, hq, hkv, d = budget.max_tokens, config.q_heads, config.kv_heads, config.head_dim
        self.q = ptxattn.empty((t, hq, d), self.dtype)
        self.k_new, self.v_new = ptxattn.empty((t, hkv, d), self.dtype), ptxattn.empty((t, hkv, d), self.dtype)
        self.slot_mapping = ptxattn.empty((t,), np.int32)
        self.qo_indptr = ptxattn.empty((budget.max_seqs + 1,), np.int32)
        self.block_table = ptxattn.empty((budget.max_seqs, budget.max_pages), np.int32)
        self.seq_lens = ptxattn.empty((budget.max_seqs,), np.int32)
        self.out = GuardedOutput((t, hq, d), self.dtype, rng)
        self.poison = np.full((t, hq, d), np.nan, np.float32).astype(self.dtype)

    def _padded(self, x, fill=0):
        """x [n, ...] as max_tokens rows in the pool dtype (or x's own for integers)."""
        dtype = self.dtype if np.asarray(x).dtype.kind == "f" else np.asarray(x).dtype
        full = np.full((self.max_tokens,) + x.shape[1:], fill, dtype)
        full[:len(x)] = x
        return full

    def new_pools(self):
        nan = np.full(self.pool_shape, np.nan, np.float32).astype(self.dtype)
        return self.ptxattn.asarray(nan), self.ptxattn.asarray(nan)

    def append(self, k_new, v_new, k_pool, v_pool, slot_mapping):
        self.k_new.set(self._padded(k_new))
        self.v_new.set(self._padded(v_new))
        self.slot_mapping.set(self._padded(slot_mapping, fill=-1))
        self.ptxattn.paged_kv_append(self.k_new, self.v_new, k_pool, v_pool, self.slot_mapping, layout=self.layout)
        return k_pool, v_pool

    def attend(self, q, k_pool, v_pool, qo_indptr, block_table, seq_lens):
        n = len(q)
        self.q.set(self._padded(q))
        self.qo_indptr.set(qo_indptr)
        self.block_table.set(block_table)
        self.seq_lens.set(seq_lens)
        self.out.array.set(self.poison)
        self.ptxattn.paged_attention(self.q, k_pool, v_pool, self.qo_indptr, self.block_table, self.seq_lens,
                                     layout=self.layout, decode_queries=self.decode_queries, out=self.out.array)
        o = self.out.check(nan_allowed=True).astype(np.float32)
        assert not np.isnan(o[:n]).any(), "NaN in a row of a sequence"
        assert np.isnan(o[n:]).all(), "a row no sequence covers was written"
        return o[:n]
