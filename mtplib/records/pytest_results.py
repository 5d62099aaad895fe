"""Criterion test results for the evidence READMEs, from a real pytest run, stored as a raw
file of the run folder.

Why: a README's "Tests" section names the test files that check each criterion (the
story writer's ``TESTS``); whether they passed is a measurement like any other, so it is
recorded once, by running them, into ``tests-<story>.json`` beside the run's other raw
metrics, and the README prints it from there (and says "not run" where the file is
absent). `record_tests` runs pytest once over the union of the stories' files (several
stories share files) with JUnit XML and writes each story's part:

``{"story", "command", "exit_code", "started", "ended", "wall_s", "git": {"commit",
"dirty"}, "python", "pins", "criteria": [[criterion, [files]]], "files": {file: {"passed",
"failed", "errors", "skipped", "tests", "duration_s", "not_passed": [test ids]}},
"totals": {...}}``

``exit_code`` is pytest's own (0: all passed; 1: some failed; 2-4: interrupted, internal
or usage error; 5: nothing collected).
"""

from __future__ import annotations

import json
import platform
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections.abc import Sequence
from pathlib import Path

from mtplib import paths, pins
from mtplib.errors import InputError
from mtplib.files import write_json
from mtplib.host import git_state
from mtplib.stamps import now_iso

COUNTS = ("passed", "failed", "errors", "skipped")
"""The outcomes counted per test file (xfail counts as skipped, as JUnit XML has it)."""


def results_file(story: str) -> str:
    """The raw file of ``story``'s criterion test results in a run folder."""
    return f"tests-{story}.json"


def story_tests(story: str) -> tuple[tuple[str, tuple[str, ...]], ...]:
    """The (criterion, test files) of a story's README: its writer's ``TESTS``."""
    from mtplib.records import benchmark_report, ownership_report

    writers = {ownership_report.STORY: ownership_report, benchmark_report.STORY: benchmark_report}
    if story not in writers:
        raise InputError(f"no criterion tests listed for story {story!r} "
                         f"(known: {sorted(writers)})")
    return writers[story].TESTS


def _file_of(case: ET.Element) -> str:
    """The test file of a JUnit testcase: its ``file`` attribute (junit_family=xunit1),
    else the module path of its classname."""
    f = case.get("file")
    if f:
        return f
    parts = (case.get("classname") or "").split(".")
    while parts and not parts[-1].startswith("test_"):
        parts.pop()
    return "/".join(parts) + ".py" if parts else "?"


def parse_junit(xml_text: str) -> dict[str, dict]:
    """Per test file: counts of `COUNTS`, tests, summed duration and the ids of the tests
    that did not pass (failed or errored)."""
    out: dict[str, dict] = {}
    root = ET.fromstring(xml_text)
    for case in root.iter("testcase"):
        f = _file_of(case)
        row = out.setdefault(f, {**dict.fromkeys(COUNTS, 0), "tests": 0, "duration_s": 0.0,
                                 "not_passed": []})
        tags = {c.tag for c in case}
        outcome = ("errors" if "error" in tags else "failed" if "failure" in tags
                   else "skipped" if "skipped" in tags else "passed")
        row[outcome] += 1
        row["tests"] += 1
        row["duration_s"] = round(row["duration_s"] + float(case.get("time") or 0.0), 3)
        if outcome in ("failed", "errors"):
            row["not_passed"].append(f"{f}::{case.get('name')}")
    return out


def run_pytest(files: Sequence[str], *, python: str = sys.executable,
               cwd: Path = paths.REPO, timeout: float | None = None) -> dict:
    """Run pytest once on ``files`` (repository-relative) and return what happened."""
    missing = [f for f in files if not (cwd / f).is_file()]
    if missing:
        raise InputError(f"criterion test files not in {cwd}: {', '.join(missing)}")
    with tempfile.TemporaryDirectory() as tmp:
        junit = Path(tmp) / "junit.xml"
        args = ["-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "junit_family=xunit1"]
        started, t0 = now_iso(), time.perf_counter()
        proc = subprocess.run([python, *args, f"--junitxml={junit}", *files], cwd=cwd,
                              capture_output=True, text=True, timeout=timeout)
        wall = time.perf_counter() - t0
        per_file = parse_junit(junit.read_text()) if junit.exists() else {}
    tail = (proc.stdout + proc.stderr).strip().splitlines()
    return {"command": " ".join(["python", *args, *files]), "exit_code": proc.returncode,
            "started": started, "ended": now_iso(), "wall_s": round(wall, 1),
            "git": git_state(cwd), "python": platform.python_version(),
            "pins": pins.as_dict(), "files": per_file, "summary_line": tail[-1] if tail else ""}


def story_results(run: dict, story: str) -> dict:
    """``story``'s part of a `run_pytest` result: its criteria, its files, their totals. A
    listed file pytest reported nothing for is kept with no counts (not a zero)."""
    criteria = story_tests(story)
    files = sorted({f for _, fs in criteria for f in fs})
    per = {f: run["files"].get(f) for f in files}
    totals = {k: sum(r[k] for r in per.values() if r) for k in (*COUNTS, "tests")}
    return {"story": story, **{k: v for k, v in run.items() if k != "files"},
            "criteria": [[c, list(fs)] for c, fs in criteria], "files": per,
            "totals": totals}


def record_tests(targets: Sequence[tuple[str | Path, str]], *, python: str = sys.executable,
                 timeout: float | None = None) -> list[Path]:
    """Run the criterion tests of every (run folder, story) of ``targets`` in one pytest
    call and write each story's ``tests-<story>.json`` into its run folder."""
    if not targets:
        raise InputError("no run folder and story to record criterion tests for")
    for run_dir, _ in targets:
        if not (Path(run_dir) / "run_record.json").exists():
            raise InputError(f"{run_dir} is not a run directory (no run_record.json)")
    files = sorted({f for _, story in targets for _, fs in story_tests(story) for f in fs})
    run = run_pytest(files, python=python, timeout=timeout)
    out = []
    for run_dir, story in targets:
        p = Path(run_dir) / results_file(story)
        write_json(p, story_results(run, story), indent=1)
        out.append(p)
    return out


def read_results(run_dir: str | Path, story: str) -> dict | None:
    """``tests-<story>.json`` of a run folder, or None where the tests were not run."""
    p = Path(run_dir) / results_file(story)
    return json.loads(p.read_text()) if p.is_file() else None
