"""Criterion test results: a real pytest run parsed from JUnit XML into tests-<story>.json,
and the README's Tests section printing it (or saying "not run" without it)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from mtplib.errors import InputError
from mtplib.records import benchmark_report, evidence, ownership_report, readme
from mtplib.records import pytest_results as pr
from mtplib.records.readme import Links, numbers_trace

REPO = Path(__file__).resolve().parent.parent

JUNIT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest">
<testcase classname="tests.test_a" name="test_ok" time="0.25" file="tests/test_a.py"/>
<testcase classname="tests.test_a" name="test_bad" time="1.5" file="tests/test_a.py">
  <failure message="x">boom</failure></testcase>
<testcase classname="tests.test_a" name="test_skip" time="0.0" file="tests/test_a.py">
  <skipped message="no"/></testcase>
<testcase classname="tests.test_b.TestX" name="test_err[1]" time="0.5">
  <error message="e">teardown</error></testcase>
</testsuite></testsuites>"""


def test_parse_junit_counts_each_outcome_per_file():
    out = pr.parse_junit(JUNIT)
    assert out["tests/test_a.py"] == {"passed": 1, "failed": 1, "errors": 0, "skipped": 1,
                                      "tests": 3, "duration_s": 1.75,
                                      "not_passed": ["tests/test_a.py::test_bad"]}
    b = out["tests/test_b.py"]  # no file attribute: from the classname
    assert (b["errors"], b["tests"], b["not_passed"]) == (1, 1, ["tests/test_b.py::test_err[1]"])


def test_run_pytest_records_a_real_run(tmp_path):
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_x.py").write_text(
        "import pytest\n\ndef test_a():\n    pass\n\ndef test_b():\n    assert 0\n\n"
        "@pytest.mark.skip\ndef test_c():\n    pass\n")
    (tmp_path / "tests" / "test_y.py").write_text("def test_y():\n    pass\n")
    run = pr.run_pytest(["tests/test_x.py", "tests/test_y.py"], cwd=tmp_path)
    assert run["exit_code"] == 1  # pytest's: some failed
    x = run["files"]["tests/test_x.py"]
    assert (x["passed"], x["failed"], x["skipped"], x["errors"]) == (1, 1, 1, 0)
    assert x["not_passed"] == ["tests/test_x.py::test_b"]
    assert run["files"]["tests/test_y.py"]["passed"] == 1
    assert "1 failed" in run["summary_line"] and run["command"].startswith("python -m pytest")
    assert run["python"] and run["pins"]["llama_cpp_python"] and "commit" in run["git"]
    with pytest.raises(InputError, match="not in"):
        pr.run_pytest(["tests/test_nope.py"], cwd=tmp_path)


def _fake_run(files: dict) -> dict:
    return {"command": "python -m pytest -q x", "exit_code": 1, "started": "s", "ended": "e",
            "wall_s": 12.5, "git": {"commit": "abc", "dirty": False}, "python": "3.11.0",
            "pins": {"llama_cpp_python": "0.3.36"}, "files": files, "summary_line": "1 failed"}


def test_story_results_keep_only_the_story_and_never_invent():
    row = {"passed": 7, "failed": 1, "errors": 0, "skipped": 2, "tests": 10,
           "duration_s": 3.25, "not_passed": ["tests/test_policy.py::test_z"]}
    res = pr.story_results(_fake_run({"tests/test_policy.py": row,
                                      "tests/test_unrelated.py": row}), "DGR-066")
    assert "tests/test_unrelated.py" not in res["files"]
    assert res["files"]["tests/test_policy.py"] == row
    assert res["files"]["tests/test_bench.py"] is None  # not reported: not a zero
    assert res["totals"] == {"passed": 7, "failed": 1, "errors": 0, "skipped": 2, "tests": 10}
    assert [c for c, _ in res["criteria"]] == [c for c, _ in benchmark_report.TESTS]
    with pytest.raises(InputError, match="no criterion tests"):
        pr.story_tests("DGR-999")


def test_tests_section_prints_results_or_says_not_run(tmp_path):
    link = Links(tmp_path, tmp_path / "README.md")
    absent = "\n".join(readme.tests_section("DGR-066", benchmark_report.TESTS, None, link))
    assert "Test results: **not run**" in absent and "`tests-DGR-066.json`" in absent
    row = {"passed": 7, "failed": 1, "errors": 0, "skipped": 2, "tests": 10,
           "duration_s": 3.25, "not_passed": ["tests/test_policy.py::test_z"]}
    res = pr.story_results(_fake_run({"tests/test_policy.py": row}), "DGR-066")
    text = "\n".join(readme.tests_section("DGR-066", benchmark_report.TESTS, res, link))
    assert "| The deployment policy on every MTP path | `tests/test_policy.py` | 7 | **1** | " \
           "0 | 2 | 3.2 |" in text
    assert "| `tests/test_bench.py` | not reported |" in text
    assert "pytest's exit code: 1 (**not all passed**" in text
    assert "Not passed: `tests/test_policy.py::test_z`." in text
    assert "commit `abc`" in text
    assert numbers_trace(text, {"run_record": {}, "tests": res}) == []
    assert numbers_trace(text, {"run_record": {}}) != []  # the numbers come from the file


def test_record_tests_writes_each_story_and_the_readme_reads_it(tmp_path, monkeypatch):
    """One pytest call for two stories; load_raw picks the file up and the copy carries it."""
    calls = []

    def fake(files, **kw):
        calls.append(files)
        return _fake_run({f: {"passed": 1, "failed": 0, "errors": 0, "skipped": 0,
                              "tests": 1, "duration_s": 0.5, "not_passed": []} for f in files})

    monkeypatch.setattr(pr, "run_pytest", fake)
    a, b = tmp_path / "a", tmp_path / "b"
    for d in (a, b):
        d.mkdir()
        (d / "run_record.json").write_text("{}")
    pa, pb = pr.record_tests([(a, "DGR-065"), (b, "DGR-066")])
    assert len(calls) == 1 and "tests/test_policy.py" in calls[0]
    assert json.loads(pa.read_text())["story"] == "DGR-065" and pb.name == "tests-DGR-066.json"
    assert evidence.load_raw(a, "DGR-065")["tests"]["totals"]["passed"] == len(
        {f for _, fs in ownership_report.TESTS for f in fs})
    assert "tests" not in evidence.load_raw(tmp_path / "a", "DGR-066")
    assert Path("tests-DGR-065.json") in ownership_report.story_files(a)
    with pytest.raises(InputError, match="not a run directory"):
        pr.record_tests([(tmp_path, "DGR-065")])


def test_committed_readmes_print_their_recorded_results(tmp_path):
    """A committed evidence folder with its results file renders the results; without it,
    "not run" (a copy of the folder with the file removed)."""
    for story, mod in (("DGR-065", ownership_report), ("DGR-066", benchmark_report)):
        folder = REPO / "evidence" / story
        if not (folder / "run_record.json").exists():
            pytest.skip(f"evidence/{story} not committed")
        raw = evidence.load_raw(folder, story)
        text = (folder / "README.md").read_text()
        if "tests" in raw:
            assert "Test results (" in text and "**not run**" not in text
            assert f"`{raw['tests']['git']['commit']}`" in text
        else:
            assert "Test results: **not run**" in text
        copy = tmp_path / story
        shutil.copytree(folder, copy)
        (copy / pr.results_file(story)).unlink(missing_ok=True)
        out = evidence.render_readme(copy, story, copy / "README.md")
        assert "Test results: **not run**" in out and mod.STORY == story


def test_evidence_cli_has_tests_flag():
    r = subprocess.run([sys.executable, "-m", "mtplib.cli", "evidence", "--help"],
                       capture_output=True, text=True, cwd=REPO, timeout=60)
    assert r.returncode == 0 and "--tests" in r.stdout
