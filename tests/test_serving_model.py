"""A continuous-batching loop (tests/serving_model.py) serving a 2-layer random-weight GQA
transformer: six requests with prompts of 1 to 70 tokens arrive over time, prefill in chunks
of <= 16 tokens (8-token pages, so chunks cross pages; a 32-token step budget cuts some
chunks short), decode, and leave; two arrive only once others have left and take their rows
and pages. Steps mix prefill chunks with decode tokens and have empty rows between live ones.
At every step, each sequence's logits for its new tokens must equal the dense float64
forward of its whole token history so far. With the float64 reference attention
this checks the loop itself; with ptxattn.paged_attention (bf16 pools) it checks the op."""
from __future__ import annotations

import pytest

from gpu_util import relative_error
from serving_model import (Budget, Config, ContinuousBatcher, PtxattnBackend, ReferenceBackend, Request,
                           dense_forward, random_weights)

CONFIG = Config()  # 2 layers, d_model 256, Hq 8, Hkv 2, head dim 64
BUDGET = Budget(max_seqs=4, max_tokens=32, chunk=16, page_size=8, num_pages=22, max_pages=10)
REQUESTS = [  # (arrival step, prompt tokens, decode steps)
    (0, 33, 8), (0, 70, 5), (1, 1, 14), (3, 7, 6),
    # After requests 1 and 3 leave (step 9) and 0 (step 10): rows 0 and 1 and their freed pages are
    # reused; at step 10 row 1 is empty between live rows, and at step 11 their two 16-token
    # chunks fill the step's 32 tokens, so request 2 (9 keys cached) sits the step out.
    (11, 19, 10), (11, 40, 12),
]


def serve(backend, rng, tol):
    """Runs every request through the loop, checking each step's new rows against the dense
    model; returns the batcher (finished) and the worst relative error seen."""
    weights = random_weights(CONFIG, rng)
    batcher = ContinuousBatcher(weights, backend(weights.config), BUDGET, rng)
    requests = [Request(rid, arrival, rng.integers(CONFIG.vocab, size=prompt + decode), prompt)
                for rid, (arrival, prompt, decode) in enumerate(REQUESTS)]
    for request in requests:
        batcher.submit(request)
    checked = [0] * len(requests)  # tokens of each request checked so far
    worst, mixed_steps = 0.0, 0
    while not batcher.idle():
        assert batcher.steps < 60, "the loop does not finish"
        step = batcher.steps
        new_rows = batcher.step()
        for rid, (start, logits) in new_rows.items():
            assert start == checked[rid], f"step {step}: request {rid} fed token {start}, expected {checked[rid]}"
            checked[rid] += len(logits)
            expected = dense_forward(weights, requests[rid].tokens[:checked[rid]])[start:]
            err = relative_error(logits, expected)
            assert err < tol, f"step {step}: request {rid}, tokens {start}..{checked[rid] - 1}: relative error {err:.3g}"
            worst = max(worst, err)
        mixed_steps += len({len(logits) > 1 for _, logits in new_rows.values()}) == 2
    assert checked == [len(r.tokens) for r in requests], "a request did not feed all its tokens"
    assert mixed_steps >= 5, "too few steps mixed prefill chunks and decode tokens"
    assert sorted(batcher.free_pages) == list(range(BUDGET.num_pages)), "pages leaked or freed twice"
    assert (batcher.block_table == -1).all()
    return batcher, worst


def test_continuous_batching_matches_dense_model_reference(rng):
    batcher, _ = serve(lambda config: ReferenceBackend(config, BUDGET), rng, tol=1e-5)
    assert 20 <= batcher.steps <= 40
    done = batcher.finished
    assert set(done[4].pages) & set(done[0].pages), "request 4 did not reuse request 0's pages"
    assert set(done[5].pages) & set(done[1].pages), "request 5 did not reuse request 1's pages"
    assert (done[4].row, done[5].row) == (0, 1), "requests 4 and 5 did not reuse rows 0 and 1"


@pytest.mark.gpu
@pytest.mark.parametrize("decode_queries", [1, 4])
@pytest.mark.parametrize("layout", ["HND", "NHD"])
def test_continuous_batching_matches_dense_model_ptxattn_bf16(rng, layout, decode_queries):
    import ptxattn

    backend = lambda config: PtxattnBackend(config, BUDGET, rng, layout=layout, decode_queries=decode_queries)
    serve(backend, rng, tol=2e-2)
    ptxattn.check_faults(ptxattn.get_device(0), ptxattn.as_stream(None))
