"""The persistent twin of the plain D128 ping-pong kernel (cu/flash_fwd_sm90_ws.cuh, PERSISTENT:
a CTA an SM running block after block, loading the next block's Q and K / V while it finishes
one) against the float64 reference and, bit for bit, against the ping-pong kernel it stands in
for (PTXATTN_SM90_PERSISTENT=0), on calls of more query blocks than SMs, each run on the twin
(PTXATTN_SM90_PERSISTENT=1, also where by default it is not: causal heads of 16 and more query
blocks): causal in both
alignments (heavy-first runs of one pair and of many), non-causal, GQA, a window and rows with
no key (blocks with no key tile), sinks, with and without LSE, f16 and bf16; a CTA runs from one
block more than another to ~16, so the snake's partial last round, the K / V ring's and both Q
tiles' phases wrap many times; the S512 case's last blocks go by the host's deal of them. A
child process a setting runs every case (same seeded inputs, NaN-poisoned outputs with
canaries): one that hangs (a barrier bug) ends in its timeout.

    python tests/test_sdpa_sm90_persistent_gpu.py SEED OUT.npz NAME   # a child, CHILDREN[NAME]'s setting
"""
from __future__ import annotations

import os
import secrets
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import ptxattn
from ptxattn.ops import attention

from gpu_util import GuardedOutput
from test_sdpa_gpu import BF16, F16, Case, _check, _inputs, _options
from test_sdpa_sm90_ws_gpu import case_outputs

pytestmark = pytest.mark.gpu

# A child process a setting: its environment, and whether its calls run the persistent twin.
CHILDREN = {"persistent": ({attention.SM90_PERSISTENT_ENV: "1"}, True),
            "one_block_a_cta": ({attention.SM90_PERSISTENT_ENV: "0"}, False)}
CHILD_TIMEOUT_S = 300  # a cold driver JIT cache costs a child ~35 s of the sm_90a PTX

CASES = [
    Case(BF16, 32, 16, 16, 512, 512, 128, 128, causal=True),                          # 2048 blocks, runs of one pair
    Case(F16, 4, 16, 4, 1100, 1100, 128, 128, causal=True, sinks=True),                # 576, a cut last block
    Case(BF16, 2, 8, 8, 2100, 2100, 128, 128, causal=True, lse=False),                 # 272, runs of many pairs*
    Case(F16, 2, 16, 2, 1500, 700, 128, 128, causal=True, align="bottom_right"),       # 384, blocks with no key
    Case(BF16, 1, 64, 8, 1000, 1000, 128, 128, window=(100, 20), sinks=True),          # 512, the window cuts both ends
    Case(BF16, 2, 40, 8, 257, 3000, 128, 128),                                         # 240, long rows of keys
    Case(F16, 1, 133, 7, 128, 640, 128, 128, sinks=True),                              # 133: one CTA runs two
    Case(BF16, 1, 8, 2, 4096, 4096, 128, 128, causal=True),                            # 256, 32 key tiles a head*
    Case(F16, 16, 16, 4, 200, 200, 128, 128, causal=True, sinks=True),                 # 512, heads of 2 blocks, cut
]
# *: causal heads of MIN_RUN_BLOCKS query blocks or more, which by default keep a CTA a block.
RUN_BY_DEFAULT = [True, True, False, True, True, True, True, False, True]


def _launch(case: Case):
    """The launch this process plans for `case` (no device work)."""
    q = ptxattn.empty((case.batch, case.hq, case.sq, case.dqk), case.dtype)
    k = ptxattn.empty((case.batch, case.hkv, case.skv, case.dqk), case.dtype)
    v = ptxattn.empty((case.batch, case.hkv, case.skv, case.dv), case.dtype)
    (launch,) = ptxattn.prepare(ptxattn.sdpa, q, k, v, sinks=ptxattn.empty((case.hq,), np.float32) if case.sinks else None,
                                return_lse=case.lse, **_options(case)).launches
    return launch


def _runs_persistent(case: Case) -> bool:
    """Whether this process plans `case` on the persistent twin."""
    return _launch(case).name.endswith("_persistent")


@pytest.fixture(scope="module")
def seed():
    if not attention.runs_wgmma(ptxattn.get_device(0)):
        pytest.skip("the device does not load the sm_90a PTX")
    if os.environ.get(attention.SM90_PERSISTENT_ENV) or not attention.sm90_ws_enabled():
        pytest.skip("PTXATTN_SM90_PERSISTENT or PTXATTN_SM90_WS=0 is set: the children set what they run")
    return int(os.environ.get("PTXATTN_SEED", secrets.randbits(32)))


@pytest.fixture(scope="module")
def children(seed, tmp_path_factory):
    """The seed and each child's outputs of every case."""
    results = {}
    for name, (env, _) in CHILDREN.items():
        out = tmp_path_factory.mktemp(name) / f"{name}.npz"
        try:
            child = subprocess.run([sys.executable, str(Path(__file__)), str(seed), str(out), name],
                                   env=dict(os.environ, **env), timeout=CHILD_TIMEOUT_S, capture_output=True, text=True)
        except subprocess.TimeoutExpired as exc:
            pytest.fail(f"child {name} ({env}, seed {seed}) ran past {CHILD_TIMEOUT_S} s (a hang?):\n"
                        f"{exc.stdout}\n{exc.stderr}")
        assert child.returncode == 0, f"child {name} (seed {seed}) failed:\n{child.stdout}\n{child.stderr}"
        with np.load(out) as data:
            results[name] = dict(data)
    return seed, results


def test_every_case_has_more_blocks_than_sms_and_the_default_runs_the_twin_where_it_pays(seed):
    """Each case can run the twin (more blocks than SMs; the children check which kernel they
    run), and by default runs it but for causal heads of many query blocks."""
    sms = ptxattn.get_device(0).sm_count
    for case in CASES:
        assert -(-case.sq // 128) * case.hq * case.batch > sms, case
    assert [_runs_persistent(case) for case in CASES] == RUN_BY_DEFAULT


def test_some_case_runs_blocks_the_host_dealt(seed):
    """The S512 causal case's last blocks go by the host's deal (FlashFwdParams.tail_blocks,
    runtime/ops/persistent_deal.py), so the bits compared below cover the kernel's reading of it."""
    assert _launch(CASES[0]).params.tail_round > 0


@pytest.mark.parametrize("i", range(len(CASES)), ids=[str(c) for c in CASES])
def test_persistent_matches_reference_and_one_block_a_cta_bit_for_bit(children, i):
    seed, results = children
    case, twin, plain = CASES[i], results["persistent"], results["one_block_a_cta"]
    q, k, v, mask, sinks = _inputs(case, np.random.default_rng([seed, i]))
    lse = twin.get(f"lse{i}")
    _check(case, twin[f"o{i}"].view(case.dtype), lse, q, k, v, mask, sinks)
    assert np.array_equal(twin[f"o{i}"], plain[f"o{i}"]), \
        f"o: {int((twin[f'o{i}'] != plain[f'o{i}']).sum())} elements differ (seed {seed})"
    if lse is not None:
        assert np.array_equal(lse.view(np.uint32), plain[f"lse{i}"].view(np.uint32)), f"lse differs (seed {seed})"


def test_persistent_stores_into_an_out_of_another_layout(seed):
    """The twin stores its output through a map of `out` (o_map), here a [B, H, S, D] view of
    [B, S, H, D] memory inside canaries: by default on the twin, matching the reference and, bit
    for bit, the same call into a contiguous out."""
    case = Case(BF16, 2, 16, 4, 1000, 1000, 128, 128)  # 256 blocks, not causal: the twin by default
    rng = np.random.default_rng([seed, len(CASES)])
    q, k, v, mask, sinks = _inputs(case, rng)
    bshd = GuardedOutput((case.batch, case.sq, case.hq, case.dv), case.dtype, rng)
    item = np.dtype(case.dtype).itemsize
    out = ptxattn.DeviceArray(bshd.array.ptr, (case.batch, case.hq, case.sq, case.dv), case.dtype,
                              (case.sq * case.hq * case.dv * item, case.dv * item, case.hq * case.dv * item, item),
                              bshd.array.device, bshd.whole)
    dev = [ptxattn.asarray(x) for x in (q, k, v)]
    (launch,) = ptxattn.prepare(ptxattn.sdpa, *dev, out=out, **_options(case)).launches
    assert launch.name.endswith("_persistent"), launch.name
    assert ptxattn.sdpa(*dev, out=out, **_options(case)) is out
    got = bshd.check().transpose(0, 2, 1, 3)
    _check(case, got, None, q, k, v, mask, sinks)
    contiguous = GuardedOutput((case.batch, case.hq, case.sq, case.dv), case.dtype, rng)
    ptxattn.sdpa(*dev, out=contiguous.array, **_options(case))
    assert np.array_equal(got.view(np.uint16), contiguous.check().view(np.uint16)), "o differs from a contiguous out's"


if __name__ == "__main__":
    _, persistent = CHILDREN[sys.argv[3]]
    runs = [_runs_persistent(case) for case in CASES]
    assert runs == [persistent] * len(CASES), f"{sys.argv[3]}: persistent twin per case {runs}"
    np.savez(sys.argv[2], **case_outputs(CASES, int(sys.argv[1])))
