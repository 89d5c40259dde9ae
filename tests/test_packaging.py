"""The built wheel carries the PTX the manifest lists, and the committed PTX matches cu/."""
from __future__ import annotations

import json
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    # cwd elsewhere: a build/ folder in the checkout would shadow the `build` package.
    subprocess.run([sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", str(out), str(ROOT)],
                   check=True, capture_output=True, cwd=out)
    (path,) = out.glob("ptxattn-*.whl")
    return path


def test_wheel_contains_manifest_and_every_listed_ptx(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    assert "ptxattn/ptx/manifest.json" in names
    manifest = json.loads(zipfile.ZipFile(wheel).read("ptxattn/ptx/manifest.json"))
    for family, info in manifest["families"].items():
        for arch in info["archs"]:
            assert f"ptxattn/ptx/{arch}/{family}.ptx" in names
    assert "ptxattn/__init__.py" in names and "ptxattn/ops/__init__.py" in names


def test_committed_ptx_matches_sources():
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "build_ptx.py"), "--check"],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
