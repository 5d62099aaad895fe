"""The CSVs committed beside a results JSON are derived from it, by the library's writer:
``wan_summary.csv`` from ``wan.json`` (`mtplib.lab.wan.files.write_summary_csv`) and the
``bench_*.csv`` from ``bench.json`` (`mtplib.lab.bench.summary.write_csvs`).

A CSV written by an older writer keeps the older format (lists as JSON text, ``rep`` as a
float, no ``build`` column) until it is written again. ``python -m
mtplib.records.derived_csvs FOLDER...`` rewrites every derived CSV under the folders from
the JSON beside it (never from the CSV: the numbers are the JSON's), ``--check`` only
compares and exits 1 when one differs; tests/test_derived_csvs.py runs the check on the
committed evidence. A CSV with no results file beside it is listed, never touched."""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from mtplib import logs, paths
from mtplib.errors import InputError
from mtplib.files import write_text_atomic
from mtplib.lab.bench import summary as B
from mtplib.lab.wan import files as W

log = logging.getLogger(__name__)

#: results file name -> its CSV writer (the file's data, a folder) -> the CSVs it wrote
WRITERS: dict[str, Callable[[dict, Path], Iterable[Path]]] = {
    W.WAN_JSON: lambda data, out: [W.write_summary_csv(data, out)],
    "bench.json": lambda data, out: B.write_csvs(data, out).values(),
}


@dataclass(frozen=True)
class Derived:
    """One CSV as the current writer derives it from its results file."""

    source: Path  # the results JSON
    csv: Path  # the CSV beside it
    text: str  # what the writer writes there

    @property
    def current(self) -> bool:
        """Is the CSV on disk exactly what the writer writes?"""
        return self.csv.is_file() and self.csv.read_text() == self.text


def sources(root: str | Path) -> list[Path]:
    """Every results file under ``root`` (itself included) that CSVs derive from."""
    root = Path(root)
    if not root.is_dir():
        raise InputError(f"{root}: no such folder")
    return sorted(p for name in WRITERS for p in root.rglob(name) if p.is_file())


def derive(source: str | Path) -> list[Derived]:
    """The CSVs the current writer makes from ``source`` (written into a scratch folder:
    nothing beside the source changes)."""
    source = Path(source)
    try:
        data = json.loads(source.read_text())
    except (OSError, ValueError) as e:
        raise InputError(f"{source}: not a readable results file ({e})") from None
    with tempfile.TemporaryDirectory() as tmp:
        return [Derived(source, source.parent / p.name, p.read_text())
                for p in WRITERS[source.name](data, Path(tmp))]


def derived(roots: Iterable[str | Path]) -> list[Derived]:
    """Every derived CSV under ``roots``."""
    return [d for root in roots for s in sources(root) for d in derive(s)]


def orphans(roots: Iterable[str | Path], found: Iterable[Derived]) -> list[Path]:
    """The CSVs under ``roots`` that no results file beside them derives (left as they are)."""
    made = {d.csv.resolve() for d in found}
    return sorted(p for root in roots for p in Path(root).rglob("*.csv")
                  if p.resolve() not in made)


def refresh(found: Iterable[Derived]) -> list[Path]:
    """Write each derived CSV that differs from the writer's; returns those written."""
    written = []
    for d in found:
        if not d.current:
            write_text_atomic(d.csv, d.text)
            written.append(d.csv)
    return written


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m mtplib.records.derived_csvs",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("folders", nargs="*", default=[str(paths.EVIDENCE)],
                    help="folders to search for results files (default: evidence/)")
    ap.add_argument("--check", action="store_true",
                    help="write nothing; exit 1 when a derived CSV differs from its writer's")
    a = ap.parse_args(argv)
    logs.configure()
    try:
        found = derived(a.folders)
    except InputError as e:
        log.error("error: %s", e)
        return 2
    for p in orphans(a.folders, found):
        print(f"no results file derives {p}: left as it is")
    if a.check:
        stale = [d.csv for d in found if not d.current]
        for p in stale:
            print(f"differs from its writer's: {p}")
        print(f"{len(found) - len(stale)} of {len(found)} derived CSVs current")
        return 1 if stale else 0
    written = refresh(found)
    for p in written:
        print(f"rewritten: {p}")
    print(f"{len(written)} of {len(found)} derived CSVs rewritten")
    return 0


if __name__ == "__main__":
    sys.exit(main())
