#!/usr/bin/env python3
"""Times builds of one PTX file (or versions of the checkout's files) against each other on the
GPU machine, in one call: each variant's text is put in place of the shipped
ptx/<arch>/<family>.ptx (or its files in place of the checkout's) in turn, `rounds` times
over (alternating, so drift shows as spread rather than as a difference), bench.py runs the
chosen suite and rows on it in a fresh process, and a table gives each row's metric per
variant and round beside a reference column of the same runs (cuDNN's, by default). The
shipped files are put back afterwards, whatever happened.

    python scripts/ab_ptx.py --rows 'S512|S1024' main=/tmp/main.ptx.gz cand=ptx/sm_90a/flash_fwd_sm90.ptx

A variant is NAME=PATH, PATH a PTX file or a gzip of one (read before anything is swapped, so
the shipped file itself can be a variant), or a tar archive (.tar, .tar.gz, .tgz) of files by
their paths in the repository, every one of which stands in for the checkout's file during the
variant's runs (files it lacks stay as they are): a runtime change timed with its PTX, e.g.

    git archive -o /tmp/main.tar main ptx runtime
    python scripts/ab_ptx.py main=/tmp/main.tar cand=/tmp/cand.tar

(an editable install runs the checkout's files). Each run's bench.py output lands in --out.
"""
from __future__ import annotations

import argparse
import contextlib
import gzip
import json
import signal
import subprocess
import sys
import tarfile
from importlib import resources
from pathlib import Path

BENCH = Path(__file__).resolve().with_name("bench.py")
REPO = BENCH.parent.parent
TREES = (".tar", ".tar.gz", ".tgz")


def read_variant(spec: str, target: Path, root: Path = REPO) -> tuple[str, dict[Path, bytes]]:
    """NAME=PATH -> (NAME, the files it puts in place: path -> bytes): a PTX file (gunzipped
    where PATH ends in .gz) for `target`, or a tar archive's regular files by their paths under
    `root`."""
    name, sep, path = spec.partition("=")
    if not sep or not name or not path:
        raise SystemExit(f"ab_ptx: a variant is NAME=PATH, got {spec!r}")
    if not path.endswith(TREES):
        data = Path(path).read_bytes()
        return name, {target: gzip.decompress(data) if path.endswith(".gz") else data}
    files = {}
    with tarfile.open(path) as tar:
        for member in tar.getmembers():
            if member.isfile():
                if member.name.startswith("/") or ".." in Path(member.name).parts:
                    raise SystemExit(f"ab_ptx: {path} holds {member.name!r}, a path outside the repository")
                files[root / member.name] = tar.extractfile(member).read()
    if not files:
        raise SystemExit(f"ab_ptx: {path} holds no files")
    return name, files


def exit_on_sigterm() -> None:
    """SIGTERM (an outer `timeout`) leaves through SystemExit, so `swapped` still puts the
    shipped files back (and subprocess.run kills the bench it waits for)."""
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))


@contextlib.contextmanager
def swapped(files: dict[Path, bytes]):
    """Each path holds its bytes inside; on the way out the ones that existed hold their own
    bytes again and the others are gone."""
    shipped = {path: path.read_bytes() if path.exists() else None for path in files}
    try:
        for path, data in files.items():
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(data)
        yield
    finally:
        for path, data in shipped.items():
            if data is None:
                path.unlink(missing_ok=True)
            else:
                path.write_bytes(data)


def summarize(runs: list[tuple[str, list[dict]]], metric: str, beside: str) -> list[str]:
    """A line a row (by its shape): each variant's metric, round after round, then the
    reference column's values over every run."""
    table: dict[str, dict[str, list]] = {}
    references: dict[str, list] = {}
    for name, rows in runs:
        for row in rows:
            table.setdefault(row["shape"], {}).setdefault(name, []).append(row.get(metric))
            references.setdefault(row["shape"], []).append(row.get(beside))

    def fmt(values):
        return ", ".join("-" if v is None else f"{v:.4g}" for v in values)
    return [f"{shape}: " + " | ".join(f"{name} {fmt(values)}" for name, values in per.items()) +
            f" | {beside} {fmt(references[shape])}" for shape, per in table.items()]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("variants", nargs="+", metavar="NAME=PATH")
    parser.add_argument("--family", default="flash_fwd_sm90")
    parser.add_argument("--arch", default="sm_90a")
    parser.add_argument("--suite", default="prefill")
    parser.add_argument("--rows", help="bench.py --rows (prefill and decode suites)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--metric", default="ptxattn_tflops")
    parser.add_argument("--beside", default="torch_cudnn_tflops", help="a reference column, shown over every run")
    parser.add_argument("--full", action="store_true", help="bench.py without --quick")
    parser.add_argument("--out", type=Path, default=Path("ab_results"))
    parser.add_argument("--run-timeout", type=float, help="seconds a bench.py run may take")
    args = parser.parse_args()
    exit_on_sigterm()
    target = Path(str(resources.files("ptxattn.ptx") / args.arch / f"{args.family}.ptx"))
    variants = [read_variant(spec, target) for spec in args.variants]
    names = [name for name, _ in variants]
    if len(set(names)) != len(names):
        raise SystemExit(f"ab_ptx: variant names must differ, got {names}")
    args.out.mkdir(parents=True, exist_ok=True)
    runs, failure = [], None
    for round_, (name, data) in ((r, v) for r in range(1, args.rounds + 1) for v in variants):
        out = args.out / f"{name}{round_}"
        command = [sys.executable, str(BENCH), "--suite", args.suite, "--out", str(out)]
        command += [] if args.full else ["--quick"]
        command += ["--rows", args.rows] if args.rows else []
        try:
            with swapped(data):
                done = subprocess.run(command, capture_output=True, text=True, timeout=args.run_timeout)
        except subprocess.TimeoutExpired:
            failure = f"{name}, round {round_}: bench.py ran past {args.run_timeout} s"
            break
        (args.out / f"{name}{round_}.log").write_text(done.stdout + done.stderr)
        if done.returncode != 0:
            failure = f"{name}, round {round_}: bench.py exited {done.returncode}:\n{done.stderr[-2000:]}"
            break
        runs.append((name, json.loads((out / "bench.json").read_text())[args.suite]))
        print(f"ab_ptx: {name}, round {round_} done", flush=True)
    print("\n".join(summarize(runs, args.metric, args.beside)))  # what was measured, even when cut short
    if failure:
        print(f"ab_ptx: {failure}")
    return 1 if failure else 0


if __name__ == "__main__":
    sys.exit(main())
