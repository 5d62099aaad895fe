"""Every evidence folder has a run record that says what ran (issue 32: command, commit,
build and patch set, host, load average, start/end; unknown only where it says so), and
every results file has an entry in it (`mtplib.records.evidence_runs`)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mtplib.records import evidence_runs as E

EVIDENCE = Path(__file__).resolve().parent.parent / "evidence"
FOLDERS = sorted(p for p in EVIDENCE.iterdir() if p.is_dir())


def test_there_are_the_evidence_folders():
    assert len(FOLDERS) >= 12


@pytest.mark.parametrize("folder", FOLDERS, ids=lambda p: p.name)
def test_every_evidence_folder_says_what_ran(folder):
    assert E.problems(folder) == []


def test_a_run_writing_provenance_names_every_field():
    for name in ("llama-cpp-python/llama_speed.json", "tls/tls_overhead.json"):
        prov = json.loads((EVIDENCE / name).read_text())["provenance"]
        assert prov["recorded"] == "at run time" and prov["git"]["commit"]
        assert prov["build"]["build"] in ("stock", "patched") and prov["loadavg_start"]
        assert prov["started"] <= prov["ended"]


def test_a_missing_entry_or_unknown_build_without_why_is_found(tmp_path):
    (tmp_path / "r.json").write_text('{"rows": []}')
    assert E.problems(tmp_path) == [f"{tmp_path.name}: no run_record.json"]
    rec = {"schema": E.SCHEMA, "runs": []}
    (tmp_path / E.RECORD).write_text(json.dumps(rec))
    assert E.problems(tmp_path) == [f"{tmp_path / E.RECORD}: no run entry for r.json"]
    rec["runs"] = [{"file": "r.json", **{k: E.UNKNOWN for k in E.FIELDS}}]
    (tmp_path / E.RECORD).write_text(json.dumps(rec))
    assert len(E.problems(tmp_path)) == 2  # no commit; no build and not why


def test_stamp_keeps_every_byte_and_adds_provenance(tmp_path):
    p = tmp_path / "x.json"
    p.write_text('{\n "a": [1, 2.50, NaN]\n}')
    e = {"commit": "c" * 40, "build": {"build": "stock"}, "commit_is": "added it"}
    assert E.stamp(p, e) and not E.stamp(p, e)
    text = p.read_text()
    assert text.startswith('{\n "a": [1, 2.50, NaN],\n "provenance": {')
    assert json.loads(text)["provenance"]["recorded"] == "recorded afterwards from git history"
