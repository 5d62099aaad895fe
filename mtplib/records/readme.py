"""What every evidence README shares: the tracing rule's machinery, number formatting,
markdown tables, links into the run, and the rows that say how to repeat a run.

The per-story writers (`mtplib.records.ownership_report`,
`mtplib.records.benchmark_report`, `mtplib.records.wan_evidence`) build their sections from
these; `mtplib.records.evidence` picks the writer for a story. Keeping the
number rule here, next to the formatting, is what lets a test say "every number in a
README appears in the raw metrics": the README never formats a number any other way.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable
from pathlib import Path

#: The sections of bench.json a README may cite; its per-run rows (`runs`, `sweep_runs`)
#: are what the summaries are computed from (tests recompute them), not cited directly, so
#: that thousands of timings cannot make an arbitrary number "appear" by chance.
CITED_BENCH_KEYS = ("config", "reference_s9", "backend", "wall_s", "prompts", "summary",
                    "sweep", "break_even", "sampling")


# -- tracing ----------------------------------------------------------------------------
_WORD = re.compile(r"[^\s|()\[\],;:*]+")
_NUM = re.compile(r"\d+(?:\.\d+)?(%?)")
_IDENT = re.compile(r"[A-Za-z§#@_]")


def readme_numbers(text: str) -> list[str]:
    """Numbers of a README as written (``"12.5"``, ``"77.0%"``), by the stories' tracing
    rule (`mtplib.records.benchmark_report.TRACE_RULE`)."""
    out = []
    for line in text.splitlines():
        if line.lstrip().startswith("#"):
            continue
        line = re.sub(r"`[^`]*`", " ", line)
        line = re.sub(r"\]\([^)]*\)", "] ", line)
        for word in _WORD.findall(line):
            if _IDENT.search(word):
                continue
            for m in _NUM.finditer(word):
                out.append(m.group(0))
    return out


def _raw_values(obj) -> Iterable[float]:
    if isinstance(obj, bool) or obj is None:
        return
    if isinstance(obj, int | float):
        yield obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            if isinstance(k, str) and re.fullmatch(r"\d+(?:\.\d+)?", k):
                yield float(k)
            yield from _raw_values(v)
    elif isinstance(obj, list | tuple):
        for v in obj:
            yield from _raw_values(v)


def _formats(values: Iterable[float], scale: float, max_decimals: int = 6) -> set[str]:
    out = set()
    for v in values:
        for d in range(max_decimals + 1):
            out.add(f"{abs(v) * scale:.{d}f}")
    return out


def cited(raw: dict) -> dict:
    """The part of the raw metrics a README may cite (`CITED_BENCH_KEYS`)."""
    out = dict(raw)
    if "bench" in out:
        out["bench"] = {k: v for k, v in out["bench"].items() if k in CITED_BENCH_KEYS}
    return out


def numbers_trace(readme_text: str, raw: dict) -> list[str]:
    """The numbers in ``readme_text`` that do not appear in ``raw`` (by the tracing rule);
    ``raw`` as `mtplib.records.evidence.load_raw` returns it."""
    values = list(_raw_values(cited(raw)))
    plain, pct_ = _formats(values, 1.0), _formats(values, 100.0)
    missing = []
    for n in readme_numbers(readme_text):
        ok = (n[:-1] in pct_ or n[:-1] in plain) if n.endswith("%") else n in plain
        if not ok:
            missing.append(n)
    return missing


# -- formatting -------------------------------------------------------------------------
def fmt(v, d: int = 1) -> str:
    """A number with ``d`` decimals (the tracing rule matches exactly this), or n/a."""
    return "n/a" if v is None else f"{v:.{d}f}"


def pct(v, d: int = 1) -> str:
    """A fraction as a percentage (the rule's "times 100" case), or n/a."""
    return "n/a" if v is None else f"{100 * v:.{d}f}%"


def yes(v: bool) -> str:
    """A check's result; a failed one is bold so it cannot be overlooked."""
    return "yes" if v else "**no**"


def names(xs) -> str:
    return ", ".join(f"`{x}`" for x in xs) if xs else "none"


def table(header: list[str], rows: list[list[str]]) -> list[str]:
    """A markdown table as lines."""
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(r) + " |" for r in rows]
    return out


def run_rows(rec: dict) -> list[list[str]]:
    """The rows every story's "The run" table starts with: how to repeat the run."""
    git, pins = rec.get("git", {}), rec.get("pins", {})
    return [
        ["command", f"`{rec.get('command')}`"],
        ["lane", f"`{rec.get('lane')}` (`{rec.get('params_file')}`)"],
        ["git commit", f"`{git.get('commit')}` (uncommitted changes: `{git.get('dirty')}`)"],
        ["pins", f"`llama-cpp-python=={pins.get('llama_cpp_python')}`, llama.cpp "
                 f"`{pins.get('llama_cpp_commit')}`, `{pins.get('cmake_args')}`"],
    ]


def model_rows(rec: dict, label: str) -> list[list[str]]:
    """One row per model file of the run: its name and sha256."""
    sha = rec.get("model_sha256", {})
    return [[f"{label}: {key}", f"`{Path(path).name}` sha256 `{sha.get(path, '?')}`"]
            for key, path in rec.get("models", {}).items()]


class Links:
    """Markdown links from the README at ``out`` to files of the run; a file the run
    lacks is said to be missing instead of linked."""

    def __init__(self, run_dir: Path, out: Path) -> None:
        self.run_dir, self.base = run_dir, out.parent

    def __call__(self, rel: str, text: str | None = None) -> str:
        p = self.run_dir / rel
        href = os.path.relpath(p, self.base).replace(os.sep, "/")
        return f"[{text or rel}]({href})" if p.exists() else f"{text or rel} (missing)"


# -- the gate's sections: changed files, tests, dependency handoff ----------------------
def changed_files_section(story: str, module: str, files: tuple[tuple[str, str], ...]
                          ) -> list[str]:
    """Where the story's code lives, from a list kept in its writer (``module``)."""
    return ["## Changed files", "",
            f"The files that implement {story} (listed in `{module}`; `git log` on these "
            "paths is the record of each change):", "",
            *table(["path", "what it holds"], [[f"`{p}`", what] for p, what in files]), ""]


def tests_section(story: str, by_criterion: tuple[tuple[str, tuple[str, ...]], ...],
                  results: dict | None, link: Links, notes: tuple[str, ...] = ()
                  ) -> list[str]:
    """The test files that check each criterion, with their results where a pytest run of
    them was recorded beside the run (``results``: ``tests-<story>.json``, written by
    `mtplib.records.pytest_results.record_tests`); without that file it says "not run"."""
    name = f"tests-{story}.json"
    files = sorted({f for _, fs in by_criterion for f in fs})
    how = ("To run them: `.venv/bin/python -m pytest -q " + " ".join(files) + "`; "
           f"`mtplib evidence --run RUN --story {story} --tests` runs them and records "
           f"their results in `{name}` beside the run, which this section prints."
           + ("" if not notes else " " + " ".join(notes)))
    if not results:
        return ["## Tests", "",
                f"Test results: **not run** for this README (no `{name}` beside its run; "
                "the pipeline that made the run does not run pytest).", "",
                *table(["criterion", "test files"],
                       [[c, ", ".join(f"`{f}`" for f in fs)] for c, fs in by_criterion]), "",
                how, ""]
    git, pin = results.get("git", {}), results.get("pins", {})
    code = results.get("exit_code")
    said = (f"Test results ({link(name)}): `{results.get('command')}`, run at commit "
            f"`{git.get('commit')}` (uncommitted changes: `{git.get('dirty')}`) from "
            f"`{results.get('started')}` to `{results.get('ended')}`, Python "
            f"`{results.get('python')}`, `llama-cpp-python=={pin.get('llama_cpp_python')}`. "
            f"pytest's exit code: {code} ("
            + ("every test passed or was skipped" if code == 0 else "**not all passed**")
            + f"; its last line: `{results.get('summary_line')}`). These are the results "
            "of that commit, which need not be the run's.")
    rows = []
    for c, fs in by_criterion:
        for f in fs:
            r = (results.get("files") or {}).get(f)
            if r is None:
                rows.append([c, f"`{f}`", "not reported", "", "", "", ""])
                continue
            rows.append([c, f"`{f}`", str(r["passed"]),
                         str(r["failed"]) if not r["failed"] else f"**{r['failed']}**",
                         str(r["errors"]) if not r["errors"] else f"**{r['errors']}**",
                         str(r["skipped"]), fmt(r["duration_s"], 1)])
    bad = [t for r in (results.get("files") or {}).values() if r for t in r["not_passed"]]
    return ["## Tests", "", said, "",
            *table(["criterion", "test file", "passed", "failed", "errors", "skipped",
                    "seconds"], rows), "",
            *(["Not passed: " + names(bad) + ".", ""] if bad else []),
            how, ""]


def dependency_section(story: str, inputs: tuple[tuple[str, str], ...],
                       outputs: tuple[tuple[str, str], ...], consumes: str, hands_on: str
                       ) -> list[str]:
    """The story's dependency handoff: one line per story it takes from or hands to."""
    return ["## Dependency handoff", "",
            f"{story} takes from " + ", ".join(s for s, _ in inputs) + " and hands on to "
            + ", ".join(s for s, _ in outputs) + " (as the issue that asked for this section lists "
            "them). The texts of "
            "those stories are not in this repository: no file, test or commit message here "
            "describes them, so each line says what this repository holds and no more.", "",
            *[f"- **{s} (in):** {line}" for s, line in inputs],
            *[f"- **{s} (out):** {line}" for s, line in outputs],
            f"- **What {story} consumes, as found in this repository:** {consumes}",
            f"- **What {story} hands on:** {hands_on}", ""]
