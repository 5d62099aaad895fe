"""Evidence READMEs generated from a run's raw metrics, and the check that they only say
what the metrics say. This module picks the writer of a story; the writers themselves are
`mtplib.records.dgr065` and `mtplib.records.dgr066` (one function per README section),
sharing `mtplib.records.readme` (tracing rule, formatting, tables, links).

- `write_evidence_readme(run_dir, story, out)`: the README of a story, every number
  formatted from the run's raw metrics (``run_record.json`` and the story's own files,
  `STORY_RAW`: ``bench/bench.json`` for DGR-066, ``dgr065_ownership.json`` and
  ``dgr065_state.json`` for DGR-065; each read by its reader in
  `mtplib.records.raw_metrics`), and the criterion tests' results where they were
  recorded (``tests-<story>.json``, `mtplib.records.pytest_results`).
- `numbers_trace(text, raw)`: the numbers in a README that do not appear in the raw metrics
  (the rule is `TRACE_RULE`, also printed at the end of every README; DGR-065's README
  prints it as `TRACE_RULE_DGR065`, naming its own files).
- `copy_run(run_dir, story, dest)`: what ``mtplib evidence`` does: copy a run's executed
  notebooks, raw metrics, plots and run record into ``evidence/<story>/`` and write the
  README there (refusing to overwrite a different file unless forced); DGR-065 copies only
  its notebooks (01, 02), their metrics and the run record (`STORY_FILES`).

A run (``mtplib run``) writes its READMEs into ``outputs/<run-id>/evidence/<story>/``; it
never touches ``evidence/`` in the repo by itself.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

from mtplib.errors import InputError, WouldOverwrite
from mtplib.records import dgr065, dgr066, wan_evidence
from mtplib.records import pytest_results as pr
from mtplib.records import raw_metrics as rm
from mtplib.records.raw_metrics import BENCH_DIR
from mtplib.records.readme import CITED_BENCH_KEYS, Links, cited, numbers_trace, readme_numbers

__all__ = ["BENCH_DIR", "CITED_BENCH_KEYS", "DGR065_NOTEBOOKS", "DGR065_RAW", "STORY_FILES",
           "STORY_RAW", "TRACE_RULE", "TRACE_RULE_DGR065", "WRITERS", "Links", "cited",
           "copy_run", "load_raw", "numbers_trace", "readme_numbers", "render_readme",
           "run_files", "write_evidence_readme"]

TRACE_RULE = dgr066.TRACE_RULE
TRACE_RULE_DGR065 = dgr065.TRACE_RULE
DGR065_NOTEBOOKS = dgr065.NOTEBOOKS
DGR065_RAW = dgr065.RAW

#: The raw metrics a story's README may cite besides ``run_record.json``: key in the dict
#: `load_raw` returns -> (file in the run directory, its reader); read when present.
STORY_RAW: dict[str, dict[str, tuple[str, Callable[[Path], dict]]]] = {
    "DGR-066": {"bench": (rm.BENCH_JSON, rm.read_bench),
                "tests": (pr.results_file("DGR-066"), lambda d: pr.read_results(d, "DGR-066"))},
    "DGR-065": {"ownership": (rm.OWNERSHIP_JSON, rm.read_ownership),
                "state": (rm.STATE_JSON, rm.read_state),
                "tests": (pr.results_file("DGR-065"), lambda d: pr.read_results(d, "DGR-065"))},
    wan_evidence.STORY: {k: (f, wan_evidence.read_build(k))
                         for k, f in wan_evidence.RAW_FILES.items()},
}


def load_raw(run_dir: str | Path, story: str = "DGR-066") -> dict:
    """The raw metrics the story's README may cite: the run record and the story's own
    metrics files (`STORY_RAW`; DGR-066: the bench metrics)."""
    run_dir = Path(run_dir)
    raw = {"run_record": json.loads((run_dir / "run_record.json").read_text())}
    for key, (rel, read) in STORY_RAW.get(story, {}).items():
        if (run_dir / rel).exists():
            raw[key] = read(run_dir)
    return raw


#: The README writer of each story: (run_dir, raw metrics, links) -> README text.
WRITERS: dict[str, Callable[[Path, dict, Links], str]] = {
    dgr066.STORY: dgr066.render, dgr065.STORY: dgr065.render,
    wan_evidence.STORY: wan_evidence.render}


def render_readme(run_dir: str | Path, story: str, out: str | Path) -> str:
    if story not in WRITERS:
        raise InputError(f"no evidence README writer for story {story!r} "
                         f"(known: {sorted(WRITERS)})")
    run_dir = Path(run_dir)
    return WRITERS[story](run_dir, load_raw(run_dir, story), Links(run_dir, Path(out)))


def write_evidence_readme(run_dir: str | Path, story: str = "DGR-066",
                          out: str | Path = Path("evidence/DGR-066/README.md")) -> Path:
    """Write the story's README generated from the run's raw metrics; refuses a README
    with a number that does not trace to them."""
    out = Path(out)
    text = render_readme(run_dir, story, out)
    missing = numbers_trace(text, load_raw(run_dir, story))
    if missing:
        raise InputError(f"{story} README: numbers not in the raw metrics: {missing}")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    return out


# -- copying a run into evidence/ ---------------------------------------------------------
_COPY_SUFFIXES = {".ipynb", ".json", ".csv", ".png"}


def run_files(run_dir: Path) -> list[Path]:
    """What a run contributes to evidence: executed notebooks, raw metrics, plots, the run
    record (relative paths). Generated models and the run's own evidence/ are left out."""
    out = [p.relative_to(run_dir) for p in sorted(run_dir.iterdir())
           if p.is_file() and p.suffix in _COPY_SUFFIXES]
    bench = run_dir / BENCH_DIR
    if bench.is_dir():
        out += [p.relative_to(run_dir) for p in sorted(bench.rglob("*"))
                if p.is_file() and p.suffix in _COPY_SUFFIXES]
    return out


#: What ``mtplib evidence`` copies for a story (default: `run_files`, the whole run).
STORY_FILES: dict[str, Callable[[Path], list[Path]]] = {
    dgr065.STORY: dgr065.story_files, wan_evidence.STORY: wan_evidence.story_files}


def copy_run(run_dir: str | Path, story: str = "DGR-066", dest: str | Path = "evidence",
             *, force: bool = False) -> Path:
    """Copy a run into ``dest/<story>/`` and write its README there; return the README.

    Refuses (FileExistsError, nothing written) to overwrite an existing file with different
    content unless ``force``."""
    run_dir, target = Path(run_dir), Path(dest) / story
    if not (run_dir / "run_record.json").exists():
        raise InputError(f"{run_dir} is not a run directory (no run_record.json)")
    if story not in WRITERS:
        raise InputError(f"no evidence README writer for story {story!r} "
                         f"(known: {sorted(WRITERS)})")
    files = STORY_FILES.get(story, run_files)(run_dir)
    # render from a staging copy so the README's links point at the copied files
    staging = target.parent / f".{story}.staging"
    if staging.exists():
        shutil.rmtree(staging)
    try:
        for rel in files:
            (staging / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(run_dir / rel, staging / rel)
        readme = write_evidence_readme(staging, story, staging / "README.md")
        new = [*files, Path(readme.name)]
        clash = [str(target / rel) for rel in new if (target / rel).exists()
                 and (target / rel).read_bytes() != (staging / rel).read_bytes()]
        if clash and not force:
            raise WouldOverwrite(
                f"{len(clash)} file(s) in {target} differ from this run (e.g. {clash[0]}); "
                "pass --force to overwrite")
        for rel in new:
            (target / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(staging / rel, target / rel)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target / "README.md"
