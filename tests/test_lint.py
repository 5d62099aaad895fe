"""ruff over everything the project lints: the package (its evidence reports, mtplib.reports,
included), the tests and the notebooks' jupytext sources (the call .ci/run makes), so
`./dev.sh test` fails on lint too, and no configuration change can quietly drop the notebook
sources from it. evidence/ holds no code (tests/test_layers.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("ruff")

ROOT = Path(__file__).resolve().parent.parent
LINTED = ("mtplib", "tests", "notebooks")


def _ruff(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ruff", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)


def test_ruff_sees_the_notebooks_and_the_reports():
    r = _ruff("check", "--show-files", *LINTED)
    assert r.returncode == 0, r.stderr
    seen = {Path(line).resolve() for line in r.stdout.splitlines() if line.strip()}
    scripts = [*ROOT.glob("notebooks/*.py"), *ROOT.glob("mtplib/reports/**/*.py")]
    assert len(scripts) > 6
    missing = sorted(str(p.relative_to(ROOT)) for p in scripts if p.resolve() not in seen)
    assert not missing, f"not linted: {missing}"
    # the executed evidence notebooks are records, not sources
    assert not [p for p in seen if p.suffix == ".ipynb"]


def test_ruff_clean():
    r = _ruff("check", "--output-format", "concise", *LINTED)
    assert r.returncode == 0, r.stdout + r.stderr
