"""The op layer's host logic without a GPU: each check of fake_driver_checks.py runs in its
own process against ptxattn.fake_driver (no stale pointer after a cached binding is reused,
prepared calls rebind only what they are given, option types in the cache key, a bounded
cache, NumPy round trips, threads launching their own arrays, the serving ops' filled outputs, fp8
fields bound, kernel modules loaded and the fault buffer made in relaxed capture mode, TMA
tensor maps rewritten with the pointers, 16-bit masks staged by TMA where it can load them, the
persistent twins' deal of their blocks)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

CHECKS = ["no_stale_pointers", "prepared_rebinds_only_what_it_is_given", "options_are_keyed_with_their_types",
          "ops_with_equal_arguments_keep_their_own_bindings",
          "torch_tensors_are_classified_where_they_live",
          "cache_stays_bounded", "numpy_calls_round_trip", "threads_launch_their_own_pointers",
          "serving_outputs_made_are_filled", "fp8_fields_are_bound", "kernel_loads_run_in_relaxed_capture_mode",
          "fault_buffer_is_made_inside_a_capture", "tma_maps_follow_their_arrays", "masks_stage_by_tma",
          "persistent_twins_share_the_blocks_out", "persistent_twins_deal_their_last_blocks"]


@pytest.mark.parametrize("check", CHECKS)
def test_host_logic_on_the_fake_driver(check):
    script = Path(__file__).with_name("fake_driver_checks.py")
    done = subprocess.run([sys.executable, str(script), check], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"{check} failed:\n{done.stdout}\n{done.stderr[-4000:]}"


def test_host_benchmark_runs_without_a_gpu(tmp_path):
    bench = Path(__file__).resolve().parent.parent / "scripts" / "bench.py"
    done = subprocess.run([sys.executable, str(bench), "--suite", "host", "--quick", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    for op in ("sdpa", "decode", "paged_decode", "kv_append", "paged_kv_append", "merge_states_n", "softmax"):
        assert f"\n{op} " in done.stdout, f"no {op} row:\n{done.stdout}"
