"""A run folder's results as tidy pandas DataFrames: ``mtplib.records.load(run_dir)``.

One reader for every results file a run (or a committed evidence folder) holds, so a user
gets DataFrames without knowing the JSON layouts. Each table is one row per measured
thing (a generation, a summary cell, a scenario), nested values spread over columns as
the CSVs have them (`mtplib.lab.tables`). Keys, present only where the run has the file:

- ``bench`` (one row per generation), ``bench_summary``, ``bench_sweep``,
  ``bench_sweep_runs``, ``bench_break_even``, ``bench_sampling``: ``bench/bench.json``
  (notebook 04).
- ``correctness`` (MTP on vs off per prompt seed and k), ``correctness_forced``,
  ``correctness_rollback``, ``correctness_sessions``, ``correctness_sampling``:
  ``correctness.json`` (notebook 03); ``seam_bytes`` (whole vs ranged per plan and k):
  ``seam_bytes.json`` or ``correctness.json``.
- ``wan`` (one row per generation), ``wan_summary``, ``wan_bytes_by_class``,
  ``wan_cost_model``, ``wan_targets``: every ``wan/<build>/wan.json`` and
  ``wan-target/<build>/wan.json`` (notebook 05), with a ``build`` column (``stock``,
  ``patched``) and a ``results`` column (``wan``: the RTT sweep, ``wan-target``: the target
  cell).
- ``side_by_side``, ``side_by_side_summary``, ``acceptance_sweep``,
  ``acceptance_sweep_summary``, ``acceptance_sweep_break_even``, ``cost_ratio``: the
  `mtplib compare-upstream` results (``*.json`` in the folder or in its ``side-by-side/``),
  with a ``file`` column.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from mtplib.errors import InputError
from mtplib.lab import tables
from mtplib.lab import wan as W
from mtplib.records import raw_metrics as RM
from mtplib.records import wan_evidence as WE

if TYPE_CHECKING:
    import pandas as pd

#: correctness.json's tables -> their keys here (equality is *the* correctness table)
CORRECTNESS_TABLES = {"equality": "correctness", "forced": "correctness_forced",
                      "rollback": "correctness_rollback", "sessions": "correctness_sessions",
                      "whole_vs_ranged": "seam_bytes"}
WAN_TABLES = {"rows": "wan", "summary": "wan_summary", "bytes_by_class": "wan_bytes_by_class",
              "cost_model": "wan_cost_model", "targets": "wan_targets"}
#: a compare-upstream results file's ``kind`` -> (its tables -> their keys here)
SIDE_BY_SIDE_KINDS = {
    "side-by-side": {"rows": "side_by_side", "summary": "side_by_side_summary"},
    "acceptance-sweep": {"rows": "acceptance_sweep", "summary": "acceptance_sweep_summary",
                         "break_even": "acceptance_sweep_break_even"},
    "cost-ratio": {"cost_ratio": "cost_ratio"},
}


def _json(p: Path):
    try:
        return json.loads(p.read_text())
    except (OSError, ValueError) as e:
        raise InputError(f"{p}: not a readable results file ({e})") from None


def _bench(run: Path) -> dict[str, list[dict]]:
    p = next((q for q in (run / RM.BENCH_JSON, run / "bench.json") if q.is_file()), None)
    if p is None:
        return {}
    data = _json(p)
    return {("bench" if name == "runs" else f"bench_{name}"): data.get(name) or []
            for name in ("runs", "summary", "sweep", "sweep_runs", "break_even", "sampling")}


def _correctness(run: Path) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    p = run / RM.CORRECTNESS_JSON
    if p.is_file():
        data = _json(p)
        out = {key: data[name] for name, key in CORRECTNESS_TABLES.items() if name in data}
        if isinstance(data.get("sampling"), dict):
            out["correctness_sampling"] = [data["sampling"]]
    if "seam_bytes" not in out and (run / RM.SEAM_BYTES_JSON).is_file():
        out["seam_bytes"] = _json(run / RM.SEAM_BYTES_JSON)
    return out


def _wan_files(run: Path) -> list[Path]:
    """Every build's wan.json under ``run`` (or ``run``'s own: one build's folder)."""
    found = [p for folder in (WE.WAN_DIR, WE.TARGET_DIR)
             for p in sorted((run / folder).glob("*/wan.json"))]
    return found or ([run / "wan.json"] if (run / "wan.json").is_file() else [])


def _wan(run: Path) -> dict[str, list[dict]]:
    """The WAN tables of every build: ``build`` the build's folder name (the build
    `mtplib.lab.wan.run_builds` ran there; a lone folder's: the build it recorded),
    ``results`` the results set it belongs to (``wan``, ``wan-target``; ``.``: ``run``)."""
    out: dict[str, list[dict]] = {}
    for p in _wan_files(run):
        data = _json(p)
        lone = p.parent == run
        build = W.build_of(data) if lone else p.parent.name
        where = "." if lone else p.parent.parent.relative_to(run).as_posix()
        for name, key in WAN_TABLES.items():
            out.setdefault(key, []).extend(
                {"build": build, "results": where, **{k: v for k, v in r.items() if k != "build"}}
                for r in data.get(name) or [])
    return out


def _side_by_side(run: Path) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for d in (run, run / "side-by-side"):
        for p in sorted(d.glob("*.json")):
            try:
                data = json.loads(p.read_text())
            except (OSError, ValueError):
                continue
            keys = SIDE_BY_SIDE_KINDS.get(data.get("kind")) if isinstance(data, dict) else None
            for name, key in (keys or {}).items():
                rows = data.get(name) or []
                out.setdefault(key, []).extend(
                    {"file": p.name, **r} for r in ([rows] if isinstance(rows, dict) else rows))
    return out


def load(run_dir: str | Path) -> dict[str, pd.DataFrame]:
    """Every results table under ``run_dir`` (a lane's run folder, an evidence folder, a
    WAN or compare-upstream results folder) as a tidy DataFrame, by key (module table).
    Raises InputError when the folder is missing or holds no results."""
    run = Path(run_dir)
    if not run.is_dir():
        raise InputError(f"{run}: no such run folder")
    found = {**_bench(run), **_correctness(run), **_wan(run), **_side_by_side(run)}
    # one frame per key from all its rows (all builds, all files): dtypes decided once
    out = {k: tables.frame(rows) for k, rows in found.items()}
    if not out:
        raise InputError(
            f"{run}: no results found (looked for {RM.BENCH_JSON}, {RM.CORRECTNESS_JSON}, "
            f"{RM.SEAM_BYTES_JSON}, {WE.WAN_DIR}/<build>/wan.json, "
            f"{WE.TARGET_DIR}/<build>/wan.json and compare-upstream *.json)")
    return out
