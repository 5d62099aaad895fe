"""Every figure README.md and docs/*.md state is held by a committed results file the same
section cites (a JSON, JSONL or CSV under evidence/, or a folder of them), to the digits
printed: a figure no committed file holds fails (issue 32: "0 README figures without a
committed source"). Figures are decimals (1.816, 0.70) and comma-grouped counts (4,548)
in prose and tables; code spans and blocks (commands, options) and versions are not
figures. A paragraph may name a committed source of another kind (a script's constant, a
note) with ``<!-- source: PATH -->``; the figure must then be in that file's text."""

from __future__ import annotations

import csv
import functools
import json
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
NUM = re.compile(r"(?<![\w./+])(\d{1,3}(?:,\d{3})+|\d+\.\d+)(?![\w.]*\d)(?!\.\d)")
CITE = re.compile(r"evidence/[\w\-./<>]+")
SOURCE = re.compile(r"<!--\s*source:\s*([^>]+?)\s*-->")
#: words before a number that make it a version or a name, not a measurement
VERSION = re.compile(r"(?:Python|TLS|protocol|version|v|llama-cpp-python==|CUDA|nvcc)\s*$",
                     re.I)
#: a unit after a figure: a byte count printed in it (2.51 GB from 2514443904)
UNIT = re.compile(r"\s*(GB|MB|kB|GiB|MiB|KiB)\b")
SCALE = {"GB": 1e9, "MB": 1e6, "kB": 1e3, "GiB": 2**30, "MiB": 2**20, "KiB": 2**10}
CODE = re.compile(r"```.*?```|`[^`\n]*`", re.S)
DATA = (".json", ".jsonl", ".csv")


@functools.cache
def committed() -> tuple[str, ...]:
    out = subprocess.run(["git", "-C", str(ROOT), "ls-files", "evidence"],
                         capture_output=True, text=True, check=True).stdout.split()
    return tuple(out)


def _walk(x, vals: set) -> None:
    if isinstance(x, bool):
        return
    if isinstance(x, (int, float)):
        vals.add(x)
    elif isinstance(x, dict):
        for v in x.values():
            _walk(v, vals)
    elif isinstance(x, list):
        for v in x:
            _walk(v, vals)
    elif isinstance(x, str):
        try:
            vals.add(float(x) if "." in x else int(x))
        except ValueError:
            pass


@functools.cache
def numbers(rel: str) -> frozenset:
    vals: set = set()
    p = ROOT / rel
    if rel.endswith(".json"):
        _walk(json.loads(p.read_text()), vals)
    elif rel.endswith(".jsonl"):
        for line in p.read_text().splitlines():
            _walk(json.loads(line), vals)
    else:
        with p.open(newline="") as f:
            for row in csv.reader(f):
                for c in row:
                    _walk(c, vals)
    return frozenset(vals)


def cited(text: str) -> set[str]:
    """The committed data files ``text`` cites: files, or every data file under a cited
    folder (a README, script or notebook cited stands for its folder)."""
    out: set[str] = set()
    for c in CITE.findall(text):
        c = c.rstrip(".,):;")
        if c.endswith(DATA):
            out.update(f for f in committed() if f == c)
            continue
        if "." in c.rsplit("/", 1)[-1] or "<" in c:
            c = c.rsplit("/", 1)[0]
        out.update(f for f in committed() if f.startswith(c.rstrip("/") + "/")
                   and f.endswith(DATA))
    return out


def held(figure: str, vals: frozenset, scale: float = 1.0) -> bool:
    """Does a value in ``vals`` print as ``figure`` (rounded to its digits; divided by
    ``scale`` first where a unit follows the figure)?"""
    if "," in figure:
        return int(figure.replace(",", "")) in vals
    digits = len(figure.split(".")[1])
    want = float(figure)
    return any(round(v / scale, digits) == want for v in vals
               if isinstance(v, float) or want == int(want) or scale != 1.0)


def figures(md: Path) -> list[tuple[int, str, set[str], list[str], float]]:
    """(line, figure, the data files its section cites, the marked sources, its unit's
    scale)."""
    text = md.read_text()
    out = []
    for sec in re.split(r"\n(?=#+ )", text):
        sec_start = text.index(sec)
        sources = cited(sec)
        for para in re.split(r"\n\s*\n", sec):
            marks = [s.strip() for m in SOURCE.findall(para) for s in m.split(",")]
            prose = CODE.sub(lambda m: " " * len(m.group()), para)
            prose = SOURCE.sub(lambda m: " " * len(m.group()), prose)
            start = sec_start + sec.index(para)
            for m in NUM.finditer(prose):
                if VERSION.search(prose[:m.start()]):
                    continue
                line = text.count("\n", 0, start + m.start()) + 1
                unit = UNIT.match(prose, m.end())
                out.append((line, m.group(1), sources, marks,
                            SCALE[unit.group(1)] if unit else 1.0))
    return out


CASES = [(md, *f) for md in DOCS for f in figures(md)]


def test_the_docs_state_figures():
    assert len(CASES) >= 100


def test_every_doc_figure_is_in_a_committed_file_its_section_cites():
    bad = []
    for md, line, fig, sources, marks, scale in CASES:
        vals = frozenset().union(*(numbers(f) for f in sources)) if sources else frozenset()
        if held(fig, vals, scale):
            continue
        if any((ROOT / s).is_file() and fig in (ROOT / s).read_text() for s in marks):
            continue
        bad.append(f"{md.relative_to(ROOT)}:{line}: {fig} (cited data files: {len(sources)})")
    assert bad == [], "figures no committed file the section cites holds:\n" + "\n".join(bad)


@pytest.mark.parametrize("text, want", [
    ("runs 1.816x (1.487-2.625)", ["1.816", "1.487", "2.625"]),
    ("Python 3.11, TLS 1.3, `--rtts 0,100`, 4,548 drafts", ["4,548"]),
])
def test_figures_are_found_and_versions_and_code_are_not(tmp_path, text, want):
    md = tmp_path / "x.md"
    md.write_text(text + "\n")
    assert [f[1] for f in figures(md)] == want


def test_a_figure_is_held_only_to_its_printed_digits():
    assert held("1.816", frozenset({1.8159237845732914}))
    assert not held("1.88", frozenset({1.8159237845732914}))
    assert held("4,548", frozenset({4548})) and not held("4,548", frozenset({4549}))
    assert not held("0.70", frozenset({1, 2}))  # an integer is not a 2-digit figure
    assert held("2.51", frozenset({2514443904}), 1e9)
