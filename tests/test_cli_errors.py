"""Corpus items of issue 15: inputs checked before long work, file-system errors on paths the
user gave as one line (exit 2), never a traceback."""

import subprocess
import sys

import pytest


@pytest.mark.parametrize("argv, says", [
    (["compare-upstream", "--model", "/no/such.gguf", "--mtp", "/no/mtp.gguf", "--out",
      "/tmp/never.json"], "not found"),  # before the 9-minute build of upstream's tools
    (["fixture", "--out", "/proc/mtplib-x"], "/proc/mtplib-x"),
])
def test_bad_paths_are_one_line_errors(argv, says):
    r = subprocess.run([sys.executable, "-m", "mtplib.cli", *argv], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr and says in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
