"""scripts/ab_ptx.py without a GPU: its swap puts the shipped files back (and removes the ones it
added) when the run inside fails or a SIGTERM (an outer timeout) ends it, a tar variant stands
in for files by their repository paths, a failed bench run stops it with exit status 1, and a
whole run over the host suite (the fake driver) gives a line a row with every variant's rounds,
leaving the shipped file as it was."""
from __future__ import annotations

import gzip
import io
import signal
import json
import re
import subprocess
import sys
import tarfile
from importlib import resources
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"
sys.path.insert(0, str(SCRIPTS))

import ab_ptx  # noqa: E402


def test_swap_puts_the_shipped_bytes_back(tmp_path):
    target, added = tmp_path / "f.ptx", tmp_path / "new" / "g.py"
    target.write_bytes(b"shipped")
    with pytest.raises(RuntimeError):
        with ab_ptx.swapped({target: b"candidate", added: b"added"}):
            assert target.read_bytes() == b"candidate" and added.read_bytes() == b"added"
            raise RuntimeError("the bench failed")
    assert target.read_bytes() == b"shipped" and not added.exists()


def test_variants_read_plain_and_gzipped(tmp_path):
    target = tmp_path / "shipped.ptx"
    (tmp_path / "a.ptx").write_bytes(b"text")
    (tmp_path / "b.ptx.gz").write_bytes(gzip.compress(b"text"))
    assert ab_ptx.read_variant(f"a={tmp_path / 'a.ptx'}", target) == ("a", {target: b"text"})
    assert ab_ptx.read_variant(f"b={tmp_path / 'b.ptx.gz'}", target) == ("b", {target: b"text"})
    with pytest.raises(SystemExit):
        ab_ptx.read_variant(str(tmp_path / "a.ptx"), target)


def _tar(path: Path, files: dict[str, bytes]) -> Path:
    with tarfile.open(path, "w:gz" if path.name.endswith(".gz") else "w") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


def test_a_tar_variant_stands_in_for_files_by_their_repository_paths(tmp_path):
    root = tmp_path / "repo"
    archive = _tar(tmp_path / "main.tar.gz", {"ptx/sm_90a/f.ptx": b"ptx", "runtime/ops/attention.py": b"py"})
    name, files = ab_ptx.read_variant(f"main={archive}", tmp_path / "unused.ptx", root)
    assert name == "main" and files == {root / "ptx/sm_90a/f.ptx": b"ptx", root / "runtime/ops/attention.py": b"py"}
    for bad in ({"../outside.py": b"x"}, {"/abs.py": b"x"}, {}):
        with pytest.raises(SystemExit):
            ab_ptx.read_variant(f"bad={_tar(tmp_path / 'bad.tar', bad)}", tmp_path / "unused.ptx", root)


def test_summary_lists_each_variants_rounds_beside_the_reference():
    runs = [("main", [{"shape": "S512", "ours": 250.0, "ref": 340.0}]),
            ("cand", [{"shape": "S512", "ours": 260.0, "ref": 342.0}]),
            ("main", [{"shape": "S512", "ours": 251.0, "ref": None}])]
    assert ab_ptx.summarize(runs, "ours", "ref") == ["S512: main 250, 251 | cand 260 | ref 340, 342, -"]


def test_a_whole_run_on_the_host_suite(tmp_path):
    # Both variants hold the shipped bytes (b as a tar of the file by its repository path), so a
    # run cut short leaves the package as it was.
    shipped = Path(str(resources.files("ptxattn.ptx") / "sm_80" / "softmax.ptx"))
    before = shipped.read_bytes()
    _tar(tmp_path / "same.tar", {"ptx/sm_80/softmax.ptx": before})
    done = subprocess.run([sys.executable, str(SCRIPTS / "ab_ptx.py"), "--suite", "host", "--family", "softmax",
                           "--arch", "sm_80", "--metric", "eager_us", "--beside", "prepared_us",
                           "--out", str(tmp_path / "out"), f"a={shipped}", f"b={tmp_path / 'same.tar'}"],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    shapes = [row["shape"] for row in json.loads((tmp_path / "out" / "b2" / "bench.json").read_text())["host"]]
    lines = done.stdout.splitlines()[-len(shapes):]
    assert shapes and [line.partition(": a ")[0] for line in lines] == shapes, done.stdout
    assert all(re.fullmatch(r".*: a [\d.]+, [\d.]+ \| b [\d.]+, [\d.]+ \| prepared_us .*", line) for line in lines), \
        done.stdout
    assert shipped.read_bytes() == before


def test_sigterm_inside_a_swap_puts_the_shipped_bytes_back(tmp_path):
    # An outer `timeout` ends a run with SIGTERM: the file must not stay swapped.
    target = tmp_path / "f.ptx"
    target.write_bytes(b"shipped")
    code = (f"import os, signal, sys, time; sys.path.insert(0, {str(SCRIPTS)!r}); import ab_ptx; "
            f"ab_ptx.exit_on_sigterm(); from pathlib import Path\n"
            f"with ab_ptx.swapped({{Path({str(target)!r}): b'candidate'}}):\n"
            f"    os.kill(os.getpid(), signal.SIGTERM); time.sleep(30)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 128 + signal.SIGTERM, done.stderr
    assert target.read_bytes() == b"shipped"


def test_a_failed_run_stops_with_what_was_measured(tmp_path):
    # Without a GPU the prefill suite's bench.py exits 1 at once: ab_ptx says so, exits 1 and
    # leaves the shipped file as it was (the variant holds its bytes anyway).
    import bench
    if bench.gpu_unavailable() is None:
        pytest.skip("a GPU is here: bench.py's prefill suite would run rather than fail")
    shipped = Path(str(resources.files("ptxattn.ptx") / "sm_90a" / "flash_fwd_sm90.ptx"))
    before = shipped.read_bytes()
    done = subprocess.run([sys.executable, str(SCRIPTS / "ab_ptx.py"), "--out", str(tmp_path / "out"),
                           f"a={shipped}"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 1 and "a, round 1: bench.py exited 1" in done.stdout, done.stdout + done.stderr
    assert shipped.read_bytes() == before
