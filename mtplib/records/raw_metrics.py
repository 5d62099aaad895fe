"""The raw metrics files a run writes, each built, written and read here and nowhere else.

Notebooks measure and show; the dict a run keeps of a notebook is built by a function
here (`ownership_record`, `state_record`, `correctness_record`) and written by its
``write_*``; the evidence writers, the run record and tests read it back with the
matching ``read_*``. One place per file means a reader cannot drift from its writer: the
file name, the JSON layout and the conversions (DataFrames to row dicts, ``default=str``
for what JSON lacks) are fixed once.

| file (in the run directory) | written by notebook | read by |
|---|---|---|
| `OWNERSHIP_JSON` | 01_tensor_ownership | the DGR-065 README |
| `STATE_JSON` | 02_state_contract | the DGR-065 README |
| `SEAM_BYTES_JSON`, `CORRECTNESS_JSON` | 03_correctness | the run record (seam bytes) |
| `BENCH_JSON` (with CSVs, plots) | 04_benchmark | the DGR-066 README |
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mtplib import files

if TYPE_CHECKING:
    import pandas as pd

    from mtplib.lab.bench.summary import BenchResult
    from mtplib.ownership.derivation import CacheParams, Inventory, Ownership
    from mtplib.ownership.dspark import DSparkOwnership

BENCH_DIR = "bench"
BENCH_JSON = f"{BENCH_DIR}/bench.json"
OWNERSHIP_JSON = "dgr065_ownership.json"
STATE_JSON = "dgr065_state.json"
SEAM_BYTES_JSON = "seam_bytes.json"
CORRECTNESS_JSON = "correctness.json"

#: An ownership derivation of the V4-Flash tables: (n_shards, n_ctx, swa_full) -> Ownership,
#: as `mtplib.ownership.report.flash_ownerships` returns it.
FlashOwns = dict[tuple[int, int, bool], "Ownership"]


def _rows(table: pd.DataFrame | Sequence[dict]) -> list[dict]:
    """A notebook table as JSON rows (a DataFrame through pandas' own conversion, so a
    row list and the DataFrame shown above it give the same file)."""
    return table.to_dict("records") if hasattr(table, "to_dict") else list(table)


def _write(run_dir: str | Path, rel: str, data: Any, *, indent: int,
           default: Any = None) -> Path:
    """``data`` as JSON at ``run_dir/rel``, the folder made if missing: a notebook given a
    ``run_dir`` that does not exist yet (``papermill -p run_dir NEW``) writes its results
    after its long cells ran, so failing there would lose them."""
    path = Path(run_dir) / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    return files.write_json(path, data, indent=indent, default=default, end="")


def _read(run_dir: str | Path, rel: str) -> Any:
    return json.loads((Path(run_dir) / rel).read_text())


# -- 01_tensor_ownership ----------------------------------------------------------------
def ownership_record(*, fixture: Ownership, combined: Inventory, ctx: int,
                     reads: dict[str, dict], flash: FlashOwns, flash_files: dict,
                     flash_ctx: int, flash_shards: Sequence[int], seconds: float,
                     limit_s: float, table_check: pd.DataFrame, plans: pd.DataFrame,
                     dspark: DSparkOwnership | None = None, dspark_check: dict | None = None
                     ) -> dict:
    """Notebook 01's raw metrics (what the DGR-065 README's criteria 1 and 3 cite).

    ``fixture``: the fixture pair's derivation; ``combined``: the single-file layout's
    inventory; ``reads``: `check_pair` results by layout (``pair``, ``combined``);
    ``flash``: the V4-Flash derivations and ``seconds`` they took; ``flash_files``: the
    weight-less pair's `summary()`; ``table_check``/``plans``: the tables shown;
    ``dspark``/``dspark_check``: the fixture's DSpark draft's derivation and its
    `check_dspark` (the README's DSpark section; absent where not run)."""
    from mtplib.ownership import report as rep

    inv, cfg = fixture.inventory, fixture.inventory.config
    extra = {} if dspark is None or dspark_check is None else {"dspark": {
        "fixture": {"file": Path(dspark.paths["dspark"]).name, **dspark.to_json(tensors=False)},
        "reads": dspark_check["reads"], "reads_equal": dspark_check["reads_equal"],
        "parts_consistent": dspark_check["parts_consistent"],
        "part_contradictions": dspark_check["part_contradictions"]}}
    return {**extra, "derivation_seconds": seconds, "derivations": len(flash),
            "derivation_limit_seconds": limit_s, "flash_ctx": flash_ctx,
            "mtp_block_bytes": flash[(flash_shards[0], flash_ctx, True)].mtp_block_bytes,
            "table_check": _rows(table_check),
            "fixture": {"layout": inv.layout, "n_layer": cfg.n_layer, "n_mtp": cfg.n_mtp,
                        "plan": str(fixture.plan), "ctx": ctx,
                        "roles": _rows(rep.role_table(fixture)),
                        "unread": _rows(rep.unread_table(fixture)),
                        "combined_roles": _rows(rep.role_table(combined)),
                        "shards": _rows(rep.shard_table(fixture)),
                        "replicas": rep.replica_records(fixture)},
            "fixture_reads_equal": {k: r["reads_equal"] for k, r in reads.items()},
            "fixture_reads": {k: r["reads"] for k, r in reads.items()},
            "flash_files": {k: {"file": Path(flash_files[k]["path"]).name,
                                "bytes": flash_files[k]["bytes"],
                                "disk_bytes": flash_files[k]["disk_bytes"],
                                "sha256_header": flash_files[k]["sha256_header"]}
                            for k in ("trunk", "sidecar")},
            "flash_shards": {str(n): _rows(rep.shard_table(flash[(n, flash_ctx, True)]))
                             for n in flash_shards},
            "flash_replicas": {str(n): rep.replica_records(flash[(n, flash_ctx, True)])
                               for n in flash_shards},
            "flash_plans": _rows(plans)}


def write_ownership(run_dir: str | Path, record: dict) -> Path:
    return _write(run_dir, OWNERSHIP_JSON, record, indent=1, default=str)


def read_ownership(run_dir: str | Path) -> dict:
    return _read(run_dir, OWNERSHIP_JSON)


# -- 02_state_contract ------------------------------------------------------------------
def state_record(*, checks: Sequence[dict], variants: Sequence[CacheParams],
                 flash: FlashOwns, seconds: float, limit_s: float,
                 flash_shards: Sequence[int], flash_ctxs: Sequence[int],
                 golden: dict, policies: dict, dspark: dict | None = None) -> dict:
    """Notebook 02's raw metrics (what the DGR-065 README's criteria 2 to 4 cite).

    ``checks``: `check_pair` results, one per context of ``variants``; ``flash``: the
    V4-Flash derivations and ``seconds`` they took; ``golden``/``policies``: the contract
    checks of `mtplib.lab.contract_checks`. The seam bytes are those of the largest plan
    (last of ``flash_shards``) at the first context. ``dspark``: the DSpark draft's cache
    checks, crossings and V4-Flash feature sources (`dspark_state`; absent where not run)."""
    from mtplib.ownership import report as rep

    return {**({"dspark": dspark} if dspark is not None else {}),
            "fixture_caches_equal": [r["caches_equal"] for r in checks],
            "fixture_variants": [str(p) for p in variants],
            "fixture_checks": [{"params": dict(r["params"]), "caches_equal": r["caches_equal"],
                                "tensors_equal": [c["tensors_equal"] for c in r["caches"]],
                                "buffers": _rows(rep.caches_check_table(r))}
                               for r in checks],
            "derivation_seconds": seconds, "derivations": len(flash),
            "derivation_limit_seconds": limit_s,
            "flash_totals": _rows(rep.cache_totals(flash)),
            "golden": golden, "policies": policies,
            "flash": {f"{n}x{c}x{'full' if f else 'window'}": _rows(rep.cache_table(o))
                      for (n, c, f), o in flash.items()},
            "seam_bytes_per_token":
                flash[(flash_shards[-1], flash_ctxs[0], True)].seam_bytes()}


def dspark_state(*, checks: Sequence[dict], variants: Sequence[CacheParams],
                 crossings: dict, feature_plans: Sequence[dict]) -> dict:
    """Notebook 02's DSpark part: ``checks`` (`check_dspark`, one per context of
    ``variants``: the draft context's caches against upstream's), ``crossings`` (what
    crosses per placement at V4-Flash's sizes: `dspark_crossings` rows and step bytes)
    and ``feature_plans`` (per V4-Flash plan, the tail's remote target layers)."""
    from mtplib.ownership import report as rep

    return {"fixture_variants": [str(p) for p in variants],
            "fixture_checks": [{"params": dict(r["params"]), "caches_equal": r["caches_equal"],
                                "tensors_equal": r["caches"]["tensors_equal"],
                                "buffers": _rows(rep.caches_check_table(
                                    {"caches": [r["caches"]]}))}
                               for r in checks],
            "crossings": crossings, "feature_plans": list(feature_plans)}


def write_state(run_dir: str | Path, record: dict) -> Path:
    return _write(run_dir, STATE_JSON, record, indent=1, default=str)


def read_state(run_dir: str | Path) -> dict:
    return _read(run_dir, STATE_JSON)


# -- 03_correctness ---------------------------------------------------------------------
def correctness_record(*, equality: pd.DataFrame, forced: pd.DataFrame,
                       rollback: pd.DataFrame, sessions: pd.DataFrame, sampling: dict,
                       whole_vs_ranged: pd.DataFrame) -> dict:
    """Notebook 03's raw metrics: every table of `mtplib.lab.correctness` it showed."""
    return {"equality": _rows(equality), "forced": _rows(forced),
            "rollback": _rows(rollback), "sessions": _rows(sessions), "sampling": sampling,
            "whole_vs_ranged": _rows(whole_vs_ranged)}


def write_correctness(run_dir: str | Path, record: dict) -> Path:
    return _write(run_dir, CORRECTNESS_JSON, record, indent=2, default=str)


def read_correctness(run_dir: str | Path) -> dict:
    return _read(run_dir, CORRECTNESS_JSON)


def write_seam_bytes(run_dir: str | Path, whole_vs_ranged: pd.DataFrame | Sequence[dict]
                     ) -> Path:
    """The whole-vs-ranged rows on their own, written as soon as they are measured: the
    run record carries them (`mtplib.records.lanes`) even when a later cell fails."""
    return _write(run_dir, SEAM_BYTES_JSON, _rows(whole_vs_ranged), indent=2)


def read_seam_bytes(run_dir: str | Path) -> list[dict] | None:
    """The rows `write_seam_bytes` wrote, or None when the run measured none."""
    if not (Path(run_dir) / SEAM_BYTES_JSON).exists():
        return None
    return _read(run_dir, SEAM_BYTES_JSON)


# -- 04_benchmark -----------------------------------------------------------------------
def write_bench(run_dir: str | Path, result: BenchResult, *, plots: bool = True
                ) -> dict[str, Path]:
    """The benchmark's raw metrics, CSVs and plots under ``run_dir/bench/`` (the format is
    `mtplib.lab.bench.summary.save`'s)."""
    from mtplib.lab.bench import summary as bench_summary

    return bench_summary.save(result, Path(run_dir) / BENCH_DIR, plots=plots)


def read_bench(run_dir: str | Path) -> dict:
    """What `write_bench` wrote to ``bench.json`` (as DataFrames: `mtplib.records.load`)."""
    from mtplib.lab.bench import summary as bench_summary

    return bench_summary.load(Path(run_dir) / BENCH_DIR)
