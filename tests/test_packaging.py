"""The wheel (built from the sdist) carries the PTX the manifest lists and the license,
setuptools builds both without a warning, the committed PTX matches cu/ (needs the `build`
extra) and stays within its size budget."""
from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BUILD_PTX = ROOT / "scripts" / "build_ptx.py"


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> tuple[Path, str]:
    """(the wheel, built from the sdist, and what the build printed)."""
    out = tmp_path_factory.mktemp("wheel")
    # cwd elsewhere: a build/ folder in the checkout would shadow the `build` package.
    proc = subprocess.run([sys.executable, "-m", "build", "--no-isolation", "--outdir", str(out), str(ROOT)],
                          check=True, capture_output=True, text=True, cwd=out)
    (path,) = out.glob("ptxattn-*.whl")
    return path, proc.stdout + proc.stderr


def test_wheel_contains_manifest_and_every_listed_ptx(built):
    names = set(zipfile.ZipFile(built[0]).namelist())
    assert "ptxattn/ptx/manifest.json" in names
    manifest = json.loads(zipfile.ZipFile(built[0]).read("ptxattn/ptx/manifest.json"))
    for family, info in manifest["families"].items():
        for arch in info["archs"]:
            assert f"ptxattn/ptx/{arch}/{family}.ptx" in names
    assert "ptxattn/__init__.py" in names and "ptxattn/ops/__init__.py" in names


def test_wheel_carries_the_license(built):
    wheel = zipfile.ZipFile(built[0])
    (license_file,) = [n for n in wheel.namelist() if n.endswith(".dist-info/licenses/LICENSE")]
    assert wheel.read(license_file) == (ROOT / "LICENSE").read_bytes()
    metadata = next(n for n in wheel.namelist() if n.endswith(".dist-info/METADATA"))
    assert "License-Expression: Apache-2.0" in wheel.read(metadata).decode()


def test_setuptools_builds_without_a_warning(built):
    # E.g. "WARNING Package 'ptxattn.ptx.sm_100' is absent from the `packages` configuration"
    # when a new PTX arch folder is not listed in pyproject.toml.
    warnings = [line for line in built[1].splitlines() if line.startswith("WARNING") or "Warning" in line]
    assert not warnings, "\n".join(warnings)


def test_committed_ptx_matches_sources():
    spec = importlib.util.spec_from_file_location("build_ptx", BUILD_PTX)
    build_ptx = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(build_ptx)
    reason = build_ptx.missing_build_extra()
    if reason:
        pytest.skip(reason)
    proc = subprocess.run([sys.executable, str(BUILD_PTX), "--check"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


PTX_BUDGET_BYTES = 40_000_000  # issue 10: all of ptx/ within 40 MB


def test_ptx_stays_within_its_budget():
    sizes = {p.relative_to(ROOT).as_posix(): p.stat().st_size for p in (ROOT / "ptx").rglob("*") if p.is_file()}
    largest = sorted(sizes, key=sizes.get, reverse=True)[:3]
    assert sum(sizes.values()) <= PTX_BUDGET_BYTES, (
        f"ptx/ holds {sum(sizes.values())} bytes, over its {PTX_BUDGET_BYTES}; largest: "
        + ", ".join(f"{p} {sizes[p]}" for p in largest))
