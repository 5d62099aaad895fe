"""Golden fixtures: regenerating must reproduce tests/golden/contract byte for byte."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from mtplib.contract.golden import boundary_cases, check_golden, main, write_golden

GOLDEN = Path(__file__).parent / "golden" / "contract"


def _read(paths):
    return {p.name: p.read_bytes() for p in paths}


def test_matches_committed_golden(tmp_path):
    fresh = _read(write_golden(tmp_path))
    committed = _read(sorted(GOLDEN.glob("*.json")))
    assert sorted(fresh) == sorted(committed)
    for name, data in fresh.items():
        assert data == committed[name], f"{name} differs; regenerate with golden.py"


def test_regeneration_is_deterministic(tmp_path):
    a = _read(write_golden(tmp_path / "a"))
    b = _read(write_golden(tmp_path / "b"))
    assert a == b
    for data in a.values():
        assert data.endswith(b"\n") and data.isascii()
        assert str(tmp_path).encode() not in data
        json.loads(data)


def test_check_mode(tmp_path, capsys):
    write_golden(tmp_path)
    assert main(["--check", str(tmp_path)]) == 0
    (tmp_path / "seam_values.json").write_text("{}\n")
    (tmp_path / "session_transitions.json").unlink()
    assert check_golden(tmp_path) == ["seam_values.json", "session_transitions.json"]
    assert main(["--check", str(tmp_path)]) == 1
    assert "differs: seam_values.json" in capsys.readouterr().out


def test_cli_module(tmp_path):
    cmd = [sys.executable, "-m", "mtplib.contract.golden"]
    root = Path(__file__).resolve().parents[1]
    subprocess.run([*cmd, str(tmp_path)], check=True, cwd=root, capture_output=True)
    ok = subprocess.run([*cmd, "--check", str(tmp_path)], cwd=root, capture_output=True)
    assert ok.returncode == 0


def test_golden_content_covers_required_cases():
    cases = json.loads((GOLDEN / "boundary_messages.json").read_text())["cases"]
    assert len(cases) >= 10 and len(cases) == len(boundary_cases())
    verdicts = {c["name"]: c for c in cases}
    assert verdicts["ok_boundary_hidden"]["verdict"] == "accepted"
    for name in ("stale_epoch", "foreign_session", "wrong_width", "forbidden_kind_logits"):
        assert verdicts[name]["verdict"] == "refused"
    matrix = json.loads((GOLDEN / "negotiation_matrix.json").read_text())["matrix"]
    assert all(r["routed"] == "mtp.off" for r in matrix if r["policy"] == "alpha")
    assert any(r["routed"] != "mtp.off" for r in matrix if r["policy"] == "beta")
