"""A WAN run's results folder (`mtplib.lab.wan`): wan.json and wan_summary.csv written from the
raw rows (`save`, `finish`, `resummarize`) and read back, one build or every build of a
run (`load`, `load_builds`).
"""

from __future__ import annotations

from pathlib import Path

from mtplib.errors import InputError
from mtplib.files import write_json
from mtplib.lab.wan.summary import bytes_by_class, fit_cost_model, summarize, targets

#: the results file of a finished run
WAN_JSON = "wan.json"
#: where a run in progress keeps its finished cells (`run_wan` with ``out_dir``); the
#: finished run's wan.json replaces it
PARTIAL_JSON = "wan.partial.json"


def build_of(result: dict) -> str | None:
    """The upstream build a results file measured (its ``upstream``, else its config's)."""
    return (result.get("upstream") or {}).get("build") or result["config"].get("upstream")


def write_summary_csv(data: dict, out_dir) -> Path:
    """``wan_summary.csv``: the summary rows with the ``build`` they measured first (a
    run's builds sit in sibling folders; concatenated CSVs stay apart)."""
    from mtplib.lab.common import tables

    return tables.to_csv(data["summary"], Path(out_dir) / "wan_summary.csv",
                         build=build_of(data))


def save(result: dict, out_dir) -> dict:
    """Write ``wan.json`` (config, raw rows, summary, bytes by class, cost-model check,
    targets) and ``wan_summary.csv`` into ``out_dir``; returns their paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    summary = summarize(result["rows"])
    cost = fit_cost_model(summary, result["config"]["fit_rtts_ms"])
    tol = result["config"].get("cost_model_tolerance", 0.15)
    measured = {k: v for k, v in result.items() if k != "provenance"}
    data = {**measured, "summary": summary, "bytes_by_class": bytes_by_class(result["rows"]),
            "cost_model": cost, "targets": targets(summary),
            "cost_model_check": {
                "predictions": len(cost), "tolerance": tol,
                "within_tolerance": sum(c["rel_error"] <= tol for c in cost),
                "worst_rel_error": max((c["rel_error"] for c in cost), default=None)}}
    if "provenance" in result:  # what ran, last (where a stamp from git history puts it)
        data["provenance"] = result["provenance"]
    p = out / WAN_JSON
    write_json(p, data, indent=1, default=str)
    return {"json": p, "csv": write_summary_csv(data, out)}


def finish(result: dict, out_dir) -> dict:
    """`save` a finished run and drop its checkpoint (`PARTIAL_JSON`): the wan.json now
    holds every cell."""
    paths = save(result, out_dir)
    (Path(out_dir) / PARTIAL_JSON).unlink(missing_ok=True)
    return paths


def resummarize(out_dir) -> dict:
    """Rewrite a results folder's derived sections (summary, bytes, cost model, targets)
    from its raw rows with this code; the measurement (rows, config, upstream) is kept."""
    d = load(out_dir)
    keep = {k: d[k] for k in ("config", "rows", "wall_s", "sessions", "upstream",
                                  "provenance") if k in d}
    save(keep, out_dir)
    return load(out_dir)


def build_dirs(run_dir) -> dict[str, Path]:
    """build -> its results folder under ``run_dir``: ``<build>/wan.json`` (what `run_builds`
    writes into its folder) or ``wan/<build>/wan.json`` (a lane's run folder)."""
    run = Path(run_dir)
    for base in (run, run / "wan"):
        found = {p.parent.name: p.parent for p in sorted(base.glob(f"*/{WAN_JSON}"))}
        if found:
            return found
    return {}


def load(out_dir) -> dict:
    """One build's results (``out_dir/wan.json``). A folder that holds one results folder
    per build instead is named in the error, with `load_builds` to read them all."""
    import json

    p = Path(out_dir) / WAN_JSON
    if not p.is_file():
        subs = build_dirs(out_dir)
        if subs:
            names = ", ".join(str(d) for d in subs.values())
            raise InputError(f"{p} not found: {out_dir} holds one results folder per build "
                             f"({names}); load one of those, or all with "
                             "mtplib.lab.wan.files.load_builds(run_dir) (as DataFrames: "
                             "mtplib.records.load(run_dir))")
        raise InputError(f"{p} not found: run the WAN benchmark first (notebook 05_wan)")
    return json.loads(p.read_text())


def load_builds(run_dir) -> dict[str, dict]:
    """build -> its results, for every build's folder under ``run_dir`` (`build_dirs`)."""
    subs = build_dirs(run_dir)
    if not subs:
        raise InputError(f"no {WAN_JSON} under {run_dir} (looked in <build>/ and "
                         "wan/<build>/): run the WAN benchmark first (notebook 05_wan)")
    return {b: load(d) for b, d in subs.items()}
