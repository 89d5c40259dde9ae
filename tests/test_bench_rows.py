"""scripts/bench.py --rows: the prefill and decode rows a device call runs, chosen by name on this machine."""
from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
import bench_decode  # noqa: E402
import bench_prefill  # noqa: E402


def _args(rows: str | None, quick: bool) -> argparse.Namespace:
    return argparse.Namespace(rows=None if rows is None else re.compile(rows), quick=quick)


def test_rows_pick_by_name_from_every_row_even_under_quick():
    chosen = bench_prefill.chosen_shapes(_args("S512|S1024|D256", quick=True))
    assert [s.name for s in chosen] == ["B2 H16 S8192 D256", "B2 H16 S8192 D256 causal", "B32 H16 S512 D128 causal",
                                        "B16 H16 S1024 D128 causal"]


def test_without_rows_quick_and_full_keep_their_lists():
    assert bench_prefill.chosen_shapes(_args(None, quick=True)) == bench_prefill.QUICK
    assert bench_prefill.chosen_shapes(_args(None, quick=False)) == bench_prefill.SHAPES


def test_a_pattern_matching_no_row_names_the_rows():
    with pytest.raises(SystemExit, match=r"--rows 'S3': no prefill row matches.*B32 H16 S512 D128 causal"):
        bench_prefill.chosen_shapes(_args("S3", quick=False))


def test_decode_rows_pick_by_name():
    chosen = bench_decode.chosen_shapes(_args("B1 T|B64 ", quick=True))
    assert [bench_decode.shape_name(s) for s in chosen] == ["B64 T8192 full", "B1 T32768 full"]
    assert bench_decode.chosen_shapes(_args(None, quick=True)) == bench_decode.SHAPES


def test_a_decode_pattern_matching_no_row_names_the_rows():
    with pytest.raises(SystemExit, match=r"--rows 'B2 ': no decode row matches.*B8 T8192 uniform"):
        bench_decode.chosen_shapes(_args("B2 ", quick=False))
