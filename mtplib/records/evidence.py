"""Evidence READMEs generated from a run's raw metrics, and the check that they only say
what the metrics say. This module picks the writer of a story; the writers themselves are
`mtplib.records.ownership_report`, `mtplib.records.benchmark_report` and
`mtplib.records.wan_evidence` (one function per README section), sharing
`mtplib.records.readme` (tracing rule, formatting, tables, links).

- `write_evidence_readme(run_dir, story, out)`: the README of a story, every number
  formatted from the run's raw metrics (``run_record.json`` and the story's own files,
  `STORY_RAW`: ``bench/bench.json`` for DGR-066, ``dgr065_ownership.json`` and
  ``dgr065_state.json`` for DGR-065; each read by its reader in
  `mtplib.records.raw_metrics`), and the criterion tests' results where they were
  recorded (``tests-<story>.json``, `mtplib.records.pytest_results`).
- `mtplib.records.readme.numbers_trace(text, raw)`: the numbers in a README that do not
  appear in the raw metrics (each writer's rule is its `TRACE_RULE`, also printed at the end
  of its README).
- `copy_run(run_dir, story, dest)`: what ``mtplib evidence`` does: copy a run's executed
  notebooks, raw metrics, plots and run record into ``evidence/<story>/`` and write the
  README there (refusing to overwrite a different file unless forced); DGR-065 copies only
  its notebooks (01, 02), their metrics and the run record (`STORY_FILES`).

A run (``mtplib run``) writes its READMEs into ``outputs/<run-id>/evidence/<story>/``; it
never touches ``evidence/`` in the repo by itself.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

from mtplib.errors import InputError, WouldOverwrite
from mtplib.files import copy_atomic, write_text_atomic
from mtplib.records import benchmark_report, correctness_report, ownership_report, wan_evidence
from mtplib.records import pytest_results as pr
from mtplib.records import raw_metrics as rm
from mtplib.records.raw_metrics import BENCH_DIR
from mtplib.records.readme import Links, numbers_trace
from mtplib.records.run_record import read_record

#: The raw metrics a story's README may cite besides ``run_record.json``: key in the dict
#: `load_raw` returns -> (file in the run directory, its reader); read when present.
STORY_RAW: dict[str, dict[str, tuple[str, Callable[[Path], dict]]]] = {
    "DGR-066": {"bench": (rm.BENCH_JSON, rm.read_bench),
                "correctness": (rm.CORRECTNESS_JSON, correctness_report.read_correctness),
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
    raw = {"run_record": read_record(run_dir)}
    for key, (rel, read) in STORY_RAW.get(story, {}).items():
        if (run_dir / rel).exists():
            raw[key] = read(run_dir)
    return raw


#: The README writer of each story: (run_dir, raw metrics, links) -> README text.
WRITERS: dict[str, Callable[[Path, dict, Links], str]] = {
    benchmark_report.STORY: benchmark_report.render,
    ownership_report.STORY: ownership_report.render,
    wan_evidence.STORY: wan_evidence.render}


def render_readme(run_dir: str | Path, story: str, out: str | Path) -> str:
    if story not in WRITERS:
        raise InputError(f"no evidence README writer for story {story!r} "
                         f"(known: {sorted(WRITERS)})")
    run_dir = Path(run_dir)
    return WRITERS[story](run_dir, load_raw(run_dir, story), Links(run_dir, Path(out)))


def write_evidence_readme(run_dir: str | Path, story: str = "DGR-066",
                          out: str | Path = Path("evidence/DGR-066/README.md"), *,
                          warning: str | None = None) -> Path:
    """Write the story's README generated from the run's raw metrics (``warning``, when
    given, first); refuses a README with a number that does not trace to them."""
    out = Path(out)
    text = render_readme(run_dir, story, out)
    if warning:
        text = warning + "\n\n" + text
    missing = numbers_trace(text, load_raw(run_dir, story))
    if missing:
        raise InputError(f"{story} README: numbers not in the raw metrics: {missing}")
    out.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(out, text)
    return out


def _not_ok_warning(record: dict) -> str:
    """The README's first lines for evidence from a run that did not complete (digit-free,
    so the tracing rule has nothing to check in it)."""
    status = record.get("status")
    said = f"status `{status}`" if isinstance(status, str) and status.isalpha() else \
        "no final status"
    return (f"> **WARNING: this evidence comes from a run that did not complete.** Its run "
            f"record says {said} (see `status`, `failed_notebook` and `error` in "
            "run_record.json); it was copied with `mtplib evidence --allow-failed`. What "
            "follows is only what the run wrote before it stopped.")


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
    ownership_report.STORY: ownership_report.story_files,
    wan_evidence.STORY: wan_evidence.story_files}


def replaced_files(target: Path, story: str) -> list[Path]:
    """What evidence already in ``target`` came from its run (relative paths, present):
    the executed notebooks its run record lists, the story's raw metrics files, and the
    story's own selection (`STORY_FILES`; DGR-066: ``bench/``). Files added by hand (a
    script, a note, a JSON made elsewhere) are not in it."""
    out: set[Path] = set()
    try:
        old = read_record(target)
    except InputError:
        old = {}
    for nb in old.get("notebooks") or []:
        name = nb.get("notebook") if isinstance(nb, dict) else None
        if isinstance(name, str) and "/" not in name:
            out.add(Path(name))
    out |= {Path(rel) for rel, _ in STORY_RAW.get(story, {}).values()}
    if story in STORY_FILES:
        out |= set(STORY_FILES[story](target))
    elif (target / BENCH_DIR).is_dir():
        out |= {p.relative_to(target) for p in (target / BENCH_DIR).rglob("*") if p.is_file()}
    return sorted(p for p in out if (target / p).is_file())


def copy_run(run_dir: str | Path, story: str = "DGR-066", dest: str | Path = "evidence",
             *, force: bool = False, allow_failed: bool = False) -> Path:
    """Copy a run into ``dest/<story>/`` and write its README there; return the README.

    Refuses a run whose record does not say ``ok`` (a failed or unfinished run) unless
    ``allow_failed``, and then the README opens with a warning saying so. Refuses
    (FileExistsError, nothing written) to overwrite an existing file with different
    content, or to leave files of the evidence it replaces that this run does not have
    (`replaced_files`: e.g. the notebooks of a longer lane), unless ``force``: those are
    then removed; files added by hand stay. Every file is written atomically."""
    run_dir, target = Path(run_dir), Path(dest) / story
    record = read_record(run_dir)
    if story not in WRITERS:
        raise InputError(f"no evidence README writer for story {story!r} "
                         f"(known: {sorted(WRITERS)})")
    status = record.get("status")
    if status != "ok" and not allow_failed:
        what = f" (notebook {record['failed_notebook']} failed)" \
            if record.get("failed_notebook") else ""
        raise InputError(f"{run_dir}: its run record says status {status!r}{what}, not 'ok': "
                         "evidence is written from a completed run only; rerun the lane, or "
                         "pass --allow-failed to copy it with a warning in the README")
    warning = _not_ok_warning(record) if status != "ok" else None
    files = STORY_FILES.get(story, run_files)(run_dir)
    # render from a staging copy so the README's links point at the copied files
    staging = target.parent / f".{story}.staging"
    if staging.exists():
        shutil.rmtree(staging)
    try:
        for rel in files:
            (staging / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(run_dir / rel, staging / rel)
        readme = write_evidence_readme(staging, story, staging / "README.md", warning=warning)
        new = [*files, Path(readme.name)]
        clash = [str(target / rel) for rel in new if (target / rel).exists()
                 and (target / rel).read_bytes() != (staging / rel).read_bytes()]
        if clash and not force:
            raise WouldOverwrite(
                f"{len(clash)} file(s) in {target} differ from this run (e.g. {clash[0]}); "
                "pass --force to overwrite")
        stale = [rel for rel in replaced_files(target, story) if rel not in set(new)]
        if stale and not force:
            raise WouldOverwrite(
                f"{len(stale)} file(s) of the evidence in {target} are not in this run (e.g. "
                f"{target / stale[0]}); pass --force to replace that evidence (they are "
                "removed; files added by hand stay)")
        for rel in new:
            (target / rel).parent.mkdir(parents=True, exist_ok=True)
            copy_atomic(staging / rel, target / rel)
        for rel in stale:
            (target / rel).unlink()
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target / "README.md"
