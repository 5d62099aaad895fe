"""A run folder's results as tidy pandas DataFrames: ``mtplib.records.load(run_dir)``.

One reader for every results file a run (or a committed evidence folder) holds, so a user
gets DataFrames without knowing the JSON layouts. Each table is one row per measured
thing (a generation, a summary cell, a scenario), nested values spread over columns as
the CSVs have them (`mtplib.lab.common.tables`). Keys, present only where the run has the file:

- ``bench`` (one row per generation), ``bench_summary``, ``bench_sweep``,
  ``bench_sweep_runs``, ``bench_break_even``, ``bench_sampling``: ``bench/bench.json``
  (notebook 04).
- ``correctness`` (MTP on vs off per prompt seed and k), ``correctness_forced``,
  ``correctness_rollback``, ``correctness_sessions``, ``correctness_sampling``:
  ``correctness.json`` (notebook 03); ``seam_bytes`` (whole vs ranged per plan and k):
  ``seam_bytes.json`` or ``correctness.json``.
- ``wan`` (one row per generation), ``wan_summary``, ``wan_bytes_by_class``,
  ``wan_cost_model``, ``wan_targets``: every ``wan.json`` under the folder (notebook 05
  writes ``wan/<build>/`` and ``wan-target/<build>/``; evidence/upstream-patches has
  ``target/<build>/<mode>/``), with a ``build`` column (the build's folder: ``stock``,
  ``patched``, ``baseline``; a lone build's folder: the build it recorded) and a
  ``results`` column (the folders above it: ``wan`` the RTT sweep, ``wan-target`` the
  target cell; ``.`` none).
- ``side_by_side``, ``side_by_side_summary``, ``acceptance_sweep``,
  ``acceptance_sweep_summary``, ``acceptance_sweep_break_even``, ``cost_ratio``: the
  `mtplib compare-upstream` results (any ``*.json`` with their ``kind``), with a ``file``
  column.
- every other committed results file, by its name (`LAYOUTS`): its ``rows`` under the
  layout's key, its other lists of records under ``<key>_<list>``, and the file itself as
  one row of ``<key>_file`` (its scalars; a nested dict spread over ``a_b`` columns, a
  list kept whole in one cell); a ``source`` column first: the file's path under the
  folder (``file`` is a column some rows have themselves).

Every frame spells a missing value one way, ``pd.NA`` (JSON's null, NaN, an empty string
and the ``-`` placeholder alike), and its columns have nullable dtypes: ``Int64``,
``Float64``, ``boolean``, ``string`` (a column with no value at all: ``Float64``); only
columns of lists or of mixed kinds stay ``object``. A bench ``prompt`` label
(``p0:seed0``, ``p1:text``) is split into ``prompt_index`` and ``prompt_seed`` (<NA> for a
text prompt) beside it. What `load` did not read is named in ``Frames.skipped`` (path ->
why); a file of no known layout also raises a `SkippedWarning`.
"""

from __future__ import annotations

import json
import re
import warnings
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, Any

from mtplib.errors import InputError
from mtplib.lab.common import tables
from mtplib.lab.wan.config import MODES
from mtplib.lab.wan.files import build_of
from mtplib.records.raw_metrics import BENCH_JSON, CORRECTNESS_JSON, SEAM_BYTES_JSON

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
#: the other committed results files: name pattern (matched against the path's end) -> key
LAYOUTS = {
    "dgr065_ownership.json": "dgr065_ownership",  # notebook 01
    "dgr065_state.json": "dgr065_state",  # notebook 02
    "tests-*.json": "tests",  # mtplib evidence's pytest record (`records.pytest_results`)
    "layer-cost-*.json": "layer_cost",  # mtplib layer-cost
    "llama_speed.json": "llama_speed",  # the llama-cpp-python adapter's speed check
    "tls/tls_overhead.json": "tls_overhead",  # mtplib.lab.tls_overhead: TLS vs plaintext
    "tls/tls_micro.json": "tls_micro",  # the same, the transport alone (--micro)
    "serve-vs-library*.json": "serve",  # evidence/serve: mtplib serve against the library
    "serve/faults.json": "serve_faults",  # evidence/serve: a shard's fault, 503 and recovery
    "serve/batch-*.json": "serve_batch",  # evidence/serve: --parallel N against one client
    "serve/stress-*.json": "serve_stress",  # evidence/serve: mixed traffic vs alone
    "serve/structured.json": "serve_structured",  # evidence/serve: JSON schema vs none
    "profile/*.json": "profile",  # evidence/side-by-side/profile: the step profiles
    "trained-v4/metrics.json": "trained_metrics",
    "trained-v4/split.json": "trained_split",
    "trained-v4/train_summary.json": "train_summary",
    "trained-dspark/train_summary.json": "dspark_train_summary",  # its trained DSpark draft
    "trained-dspark/parity.json": "dspark_parity",  # the draft, torch vs upstream
    "trained-dspark/acceptance.json": "dspark_acceptance",  # DSpark vs MTP in the loop
    "upstream-bugs/crashes.json": "upstream_crashes",
    "upstream-bugs/hidden-matrix.json": "hidden_matrix",
    "seam-*.json": "seam_waits",  # mtplib.reports.upstream_patches.seam_waits
    "waits-*.json": "wan_waits",  # evidence/wan: waits per step, stock and patched
    "graph-reuse/bytes-*.json": "graph_bytes",  # bytes per step by kind and class
    "graph-reuse/shared-cores-*.json": "shared_cores",  # client drafting on shared cores
    "graph-reuse/wan-cells.json": "wan_cells",  # MTP off vs on over capped links
    "upstream-patches/windows_projection.json": "windows_projection",  # a design projection
    "upstream-patches/ring-waits*.json": "ring_waits",  # star vs ring: waits by time
    "upstream-patches/ring-tokens.json": "ring_tokens",  # star vs ring, MTP on: tokens/s
    "upstream-patches/ring-kinds.json": "ring_kinds",  # star vs ring per step kind and link
    "upstream-patches/ring-rtt.json": "ring_rtt",  # star vs ring: tokens/s against the RTT
    "graph-reuse/pipeline_ttft.json": "pipeline_ttft",  # prefill with/without pipeline copies
    "placement/placement.json": "placement",  # evidence/placement: which placement wins where
    "placement/waits.json": "placement_waits",  # waits per step by drafter and head place
    "upstream-patches/ring-*.json": "ring_waits",  # patches/0007: ring vs star waits
    "ttft/ttft.json": "ttft",  # evidence/ttft: cold TTFT, allocation sizes answered or not
    "ttft/setup-queries.json": "setup_queries",  # the warm-up's allocation-size queries
    "dspark-shards/table.json": "dspark_shards",  # DSpark drafting on shards, per step kind
}
#: top-level mappings of records (name -> record) read as rows, per layout key
RECORDS = {"tests": ("files",), "serve_structured": ("runs",)}
#: JSON files that are not results, and why they are not read
NOT_RESULTS = {"run_record.json": "the run record (mtplib.records.run_record.read_record)",
               "tokenizer.json": "a tokenizer, not results"}
#: the key suffix of a layout's one-row-per-file table
FILE_SUFFIX = "_file"
#: what a missing value is spelled as in a results file (besides null and NaN)
MISSING_TEXT = frozenset({"", "-"})
_PROMPT = re.compile(r"p(\d+):(?:seed(\d+)|text)")


class SkippedWarning(UserWarning):
    """`load` found a JSON file under the folder it has no reader for."""


class Frames(dict):
    """`load`'s result: key -> DataFrame, and ``skipped``: each JSON file under the folder
    that no table came from (its path under the folder -> why)."""

    skipped: dict[str, str]


def _json(p: Path):
    try:
        return json.loads(p.read_text())
    except (OSError, ValueError) as e:
        raise InputError(f"{p}: not a readable results file ({e})") from None


def _bench(run: Path, read: set[Path]) -> dict[str, list[dict]]:
    p = next((q for q in (run / BENCH_JSON, run / "bench.json") if q.is_file()), None)
    if p is None:
        return {}
    data = _json(p)
    read.add(p)
    return {("bench" if name == "runs" else f"bench_{name}"): data.get(name) or []
            for name in ("runs", "summary", "sweep", "sweep_runs", "break_even", "sampling")}


def _correctness(run: Path, read: set[Path]) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    p = run / CORRECTNESS_JSON
    if p.is_file():
        data = _json(p)
        read.add(p)
        out = {key: data[name] for name, key in CORRECTNESS_TABLES.items() if name in data}
        if isinstance(data.get("sampling"), dict):
            out["correctness_sampling"] = [data["sampling"]]
    p = run / SEAM_BYTES_JSON
    if p.is_file():
        read.add(p)  # the same rows as correctness.json's whole_vs_ranged, where both are
        if "seam_bytes" not in out:
            out["seam_bytes"] = _json(p)
    return out


def _json_files(run: Path) -> list[Path]:
    """Every ``*.json`` under ``run``, hidden folders (``.ipynb_checkpoints``) left out."""
    return sorted(p for p in run.rglob("*.json")
                  if not any(part.startswith(".") for part in p.relative_to(run).parts))


def _where(run: Path, p: Path, data: dict) -> tuple[str, str]:
    """(build, results set) of a wan.json: the build is its folder (a trailing folder
    named after the file's one mode, ``cold`` or ``warm``, left out); the results set the
    folders above it (``.`` none); a wan.json directly in ``run``: the build it recorded."""
    parts = list(p.parent.relative_to(run).parts)
    modes = (data.get("config") or {}).get("modes")
    if len(parts) > 1 and modes == [parts[-1]] and parts[-1] in MODES:
        parts.pop()
    if not parts:
        return build_of(data), "."
    return parts[-1], "/".join(parts[:-1]) or "."


def _wan(run: Path, read: set[Path]) -> dict[str, list[dict]]:
    """The WAN tables of every build (`_where` names the build and the results set)."""
    out: dict[str, list[dict]] = {}
    for p in _json_files(run):
        if p.name != "wan.json":
            continue
        data = _json(p)
        read.add(p)
        build, where = _where(run, p, data)
        for name, key in WAN_TABLES.items():
            out.setdefault(key, []).extend(
                {"build": build, "results": where, **{k: v for k, v in r.items() if k != "build"}}
                for r in data.get(name) or [])
    return out


def _side_by_side(run: Path, read: set[Path]) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for p in _json_files(run):
        if p in read:
            continue
        try:
            data = json.loads(p.read_text())
        except (OSError, ValueError):
            continue  # named in skipped
        keys = SIDE_BY_SIDE_KINDS.get(data.get("kind")) if isinstance(data, dict) else None
        for name, key in (keys or {}).items():
            rows = data.get(name) or []
            out.setdefault(key, []).extend(
                {"file": p.name, **r} for r in ([rows] if isinstance(rows, dict) else rows))
        if keys:
            read.add(p)
    return out


def _records(v: Any) -> bool:
    return isinstance(v, list) and bool(v) and all(isinstance(x, dict) for x in v)


def _scalars(d: dict, prefix: str = "") -> dict[str, Any]:
    """A mapping as one row: nested dicts spread over ``a_b`` columns, lists kept whole."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict) and v:
            out.update(_scalars(v, f"{prefix}{k}_"))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _layout_tables(key: str, rel: str, data: object) -> dict[str, list[dict]]:
    """A results file of a `LAYOUTS` kind as tables (module docstring)."""
    if isinstance(data, list):
        return {key: [{"source": rel, **r} for r in data if isinstance(r, dict)]}
    if not isinstance(data, dict):
        return {}
    out: dict[str, list[dict]] = {}
    one: dict[str, Any] = {}
    for name, v in data.items():
        if _records(v):
            out[key if name == "rows" else f"{key}_{name}"] = [{"source": rel, **r} for r in v]
        elif name in RECORDS.get(key, ()) and isinstance(v, dict):
            out[f"{key}_{name}"] = [{"source": rel, "name": n, **r} for n, r in v.items()]
        else:
            one[name] = v
    out[key + FILE_SUFFIX] = [{"source": rel, **_scalars(one)}]
    return out


def _layout(p: Path) -> str | None:
    """The `LAYOUTS` key of ``p`` (its pattern matched against the path's end, the
    folders above ``run`` included: ``load("evidence/trained-v4")`` reads metrics.json)."""
    path = PurePosixPath(p.absolute().as_posix())
    return next((key for pattern, key in LAYOUTS.items() if path.match(pattern)), None)


def _others(run: Path, read: set[Path], skipped: dict[str, str]) -> dict[str, list[dict]]:
    """Every JSON file the readers above left: a `LAYOUTS` kind's tables, else skipped."""
    out: dict[str, list[dict]] = {}
    for p in _json_files(run):
        if p in read:
            continue
        rel = p.relative_to(run).as_posix()
        key = _layout(p)
        if key is None:
            skipped[rel] = NOT_RESULTS.get(p.name) or "no reader for this layout"
            continue
        try:
            data = json.loads(p.read_text())
        except (OSError, ValueError) as e:
            skipped[rel] = f"not readable JSON ({e})"
            continue
        for k, rows in _layout_tables(key, rel, data).items():
            out.setdefault(k, []).extend(rows)
        read.add(p)
    return out


def _missing(v: Any) -> bool:
    if v is None or (isinstance(v, float) and v != v):
        return True
    if isinstance(v, str):
        return v in MISSING_TEXT
    try:
        import pandas as pd

        return v is pd.NA or v is pd.NaT
    except ImportError:  # pragma: no cover - pandas is a dependency
        return False


def _kind(present: list[Any]) -> str:
    """The nullable dtype of a column's present values ("object" where none fits)."""
    if not present:
        return "Float64"
    if all(isinstance(v, bool) for v in present):
        return "boolean"
    if all(isinstance(v, int) and not isinstance(v, bool) for v in present):
        return "Int64"
    if all(isinstance(v, int | float) and not isinstance(v, bool) for v in present):
        return "Float64"
    if all(isinstance(v, str) for v in present):
        return "string"
    return "object"


def tidy(df: pd.DataFrame) -> pd.DataFrame:
    """``df`` with one missing-value spelling (pd.NA) and nullable dtypes (module
    docstring); a bench ``prompt`` label split into ``prompt_index``, ``prompt_seed``."""
    import numpy as np
    import pandas as pd

    out = {}
    for c in df.columns:
        values = [None if _missing(v) else (v.item() if isinstance(v, np.generic) else v)
                  for v in df[c].tolist()]
        kind = _kind([v for v in values if v is not None])
        if kind == "object":
            out[c] = pd.Series([pd.NA if v is None else v for v in values], dtype=object,
                               index=df.index)
        else:
            out[c] = pd.Series(pd.array(values, dtype=kind), index=df.index)
        if c == "prompt" and kind == "string":
            parts = [_PROMPT.fullmatch(v) if v is not None else None for v in values]
            if any(parts) and all(m is not None for v, m in zip(values, parts, strict=True)
                                  if v is not None):
                out["prompt_index"] = pd.Series(pd.array(
                    [int(m[1]) if m else None for m in parts], dtype="Int64"), index=df.index)
                out["prompt_seed"] = pd.Series(pd.array(
                    [int(m[2]) if m and m[2] else None for m in parts], dtype="Int64"),
                    index=df.index)
    return pd.DataFrame(out, index=df.index)


def load(run_dir: str | Path) -> Frames:
    """Every results table under ``run_dir`` (a lane's run folder, an evidence folder, a
    WAN or compare-upstream results folder) as a tidy DataFrame, by key (module
    docstring); ``.skipped`` names the JSON files no table came from. Raises InputError
    when the folder is missing or holds no results."""
    run = Path(run_dir)
    if not run.is_dir():
        raise InputError(f"{run}: no such run folder")
    read: set[Path] = set()
    skipped: dict[str, str] = {}
    found: dict[str, list[dict]] = {}
    for reader in (_bench, _correctness, _wan, _side_by_side):
        for k, rows in reader(run, read).items():
            found.setdefault(k, []).extend(rows)
    for k, rows in _others(run, read, skipped).items():
        found.setdefault(k, []).extend(rows)
    unknown = sorted(rel for rel, why in skipped.items() if rel.rsplit("/", 1)[-1]
                     not in NOT_RESULTS)
    if unknown:
        warnings.warn(f"{run}: no reader for {', '.join(unknown)} (skipped; see "
                      "Frames.skipped)", SkippedWarning, stacklevel=2)
    import pandas as pd

    # one frame per key from all its rows (all builds, all files): dtypes decided once; a
    # file's own row keeps its lists whole (tables.frame would spread raw samples over
    # hundreds of columns)
    out = Frames({k: tidy(pd.DataFrame(rows) if k.endswith(FILE_SUFFIX)
                          else tables.frame(rows)) for k, rows in found.items()})
    out.skipped = skipped
    if not out:
        raise InputError(
            f"{run}: no results found (looked for {BENCH_JSON}, {CORRECTNESS_JSON}, "
            f"{SEAM_BYTES_JSON}, wan.json, compare-upstream *.json and "
            + ", ".join(LAYOUTS) + (f"; skipped: {', '.join(sorted(skipped))}" if skipped
                                    else "") + ")")
    return out
