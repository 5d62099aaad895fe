"""The WAN story's README (evidence/wan/README.md), generated from one run's raw files.

A run of notebook 05_wan (lane params/wan-cpu.yaml) writes ``wan/<build>/wan.json`` for each
upstream build it ran (stock; patched with patches/*.patch). The README sets the builds side
by side: tokens/s and speed-up against RTT, the issue's targets at 100 ms, waits per step
kind, bytes per step by class, the cache bytes that crossed, and the cost model's check.
Every number in it traces to those files or the run record (`numbers_trace`).
"""

from __future__ import annotations

import json
from pathlib import Path

from mtplib.errors import InputError
from mtplib.records import readme as E
from mtplib.records.readme import Links

STORY = "wan"
WAN_DIR = "wan"
BUILDS = ("stock", "patched")
CITED_WAN_KEYS = ("config", "summary", "targets", "cost_model", "cost_model_check",
                  "bytes_by_class", "wall_s", "upstream")
TRACE_RULE = (
    "A number in this README traces to the raw metrics when formatting some numeric value "
    "of `run_record.json` or of the cited sections of `wan/<build>/wan.json` (config, "
    "summary, targets, cost_model, bytes_by_class, wall_s, upstream; the per-run rows they "
    "are computed from are not cited) with the same number of decimals gives the same text; "
    "a number directly before `%` may also match the raw value times 100. Not numbers, by "
    "rule: headings, code spans in backticks, link targets, and words that contain a letter "
    "or one of `§#@` (identifiers such as `k=2`, V4).")


def story_files(run_dir: Path) -> list[Path]:
    """What ``mtplib evidence --story wan`` copies: the executed 05_wan notebook, the run
    record and each build's results (wan.json, the summary CSV, its run log)."""
    out = [Path(n) for n in ("05_wan.ipynb", "run_record.json") if (run_dir / n).is_file()]
    for b in BUILDS:
        d = run_dir / WAN_DIR / b
        out += [p.relative_to(run_dir) for p in sorted(d.glob("*"))
                if p.is_file() and p.suffix in (".json", ".csv", ".log")]
    return out


def raw_file(build: str) -> str:
    return f"{WAN_DIR}/{build}/wan.json"


def read_build(build: str):
    """The reader of one build's results: the cited sections of its wan.json."""

    def read(run_dir: str | Path) -> dict:
        d = json.loads((Path(run_dir) / raw_file(build)).read_text())
        return {k: d[k] for k in CITED_WAN_KEYS if k in d}

    return read


def _speed_table(s: list[dict], plan: str, topo: str, place: str) -> list[str]:
    rtts = sorted({r["rtt_ms"] for r in s if r["plan"] == plan})
    ks = sorted({r["k"] for r in s if r["plan"] == plan})
    rows = []
    for rtt in rtts:
        cells = [f"{rtt:g}"]
        for k in ks:
            r = next((x for x in s if (x["plan"], x["topology"], x["rtt_ms"], x["k"]) ==
                      (plan, topo, rtt, k) and (k == 0 or x["placement"] == place)), None)
            if r is None:
                cells.append("n/a")
            elif k == 0:
                cells.append(E.fmt(r["tok_s"], 2))
            else:
                cells.append(f"{E.fmt(r['tok_s'], 2)} ({E.fmt(r['speedup'], 2)}x)")
        rows.append(cells)
    head = ["RTT ms"] + ["MTP off tok/s" if k == 0 else f"k={k} tok/s (speed-up)" for k in ks]
    return E.table(head, rows)


def _build_section(b: str, d: dict) -> list[str]:
    s = d["summary"]
    out = [f"## Build: {b}", ""]
    up = d.get("upstream", {})
    out.append(f"Upstream: `{up.get('build', b)}` build, patches `{up.get('patches', [])}`, "
               f"wall time of the sweep {E.fmt(d.get('wall_s'), 0)} s.")
    out.append("")
    for plan in sorted({r["plan"] for r in s}):
        for topo in sorted({r["topology"] for r in s if r["plan"] == plan}):
            for place in sorted({r["placement"] for r in s if r["plan"] == plan
                                 and r["placement"] != "-"}):
                out.append(f"Plan `{plan}`, topology `{topo}`, MTP on the `{place}`:")
                out.append("")
                out += _speed_table(s, plan, topo, place)
                out.append("")
    out.append("Targets at 100 ms RTT, plan `0-1,2-3`, k=2 (speed-up over MTP off against "
               "tokens per verify step, the RTT-bound ideal):")
    out.append("")
    rows = [[f"`{t['topology']}`", f"`{t['placement']}`", E.fmt(t["speedup"], 3),
             E.fmt(t["tokens_per_step"], 3), E.fmt(t["speedup_over_ideal"], 3),
             "n/a" if t["goal"] is None else E.fmt(t["goal"], 2),
             "n/a" if t["met"] is None else ("yes" if t["met"] else "**no**"),
             E.fmt(t.get("waits_per_verify"), 2), E.fmt(t.get("waits_per_plain_off"), 2),
             str(t["cache_bytes_crossing"]),
             "yes" if t["identical_to_off"] else "**no**"] for t in d["targets"]]
    out += E.table(["topology", "MTP on", "speed-up", "tokens/verify", "ratio", "goal", "met",
                     "waits/verify", "waits/plain step (MTP off)", "cache bytes crossing",
                     "tokens = MTP off"], rows)
    out.append("")
    out.append("Waits (synchronous round trips) per step, median over the runs of each "
               "configuration; cache bytes that crossed a shard connection, all runs:")
    out.append("")
    rows, seen = [], set()
    for r in s:
        key = (r["plan"], r["topology"], r["placement"], r["k"])
        if key in seen or r["rtt_ms"] != max(x["rtt_ms"] for x in s):
            continue
        seen.add(key)
        rows.append([f"`{r['plan']}`", f"`{r['topology']}`", f"`{r['placement']}`",
                     str(r["k"]), E.fmt(r["waits_per_plain"], 2), E.fmt(r["waits_per_verify"], 2),
                     E.fmt(r["waits_per_draft"], 2), E.fmt(r["waits_per_token"], 2),
                     str(r["cache_bytes_crossing"])])
    out += E.table(["plan", "topology", "MTP on", "k", "plain step", "verify step", "draft",
                     "per token", "cache bytes"], rows)
    out.append("")
    out.append("Data bytes per generated token by class (`mtplib.contract.wire`), by step "
               "kind, plan `0-1,2-3`, topology `remote`:")
    out.append("")
    rows = [[str(x["k"]), f"`{x['placement']}`", f"`{x['step']}`", *[
        str(round(x.get(c, 0))) for c in ("seam", "outputs", "inputs", "constants", "cache")]]
        for x in d["bytes_by_class"] if x["plan"] == "0-1,2-3" and x["topology"] == "remote"
        and x["step"] in ("decode", "verify", "draft", "feed", "rollback")]
    out += E.table(["k", "MTP on", "step", "seam", "outputs", "inputs", "constants", "cache"],
                    rows)
    out.append("")
    c = d.get("cost_model_check") or {}
    if c.get("predictions"):
        out.append(f"Cost model `s/token = compute + RTT x waits` fitted per configuration on "
                   f"RTT {d['config']['fit_rtts_ms']} ms and checked on the others: "
                   f"{c['within_tolerance']} of {c['predictions']} predictions within "
                   f"{E.pct(c['tolerance'], 0)} (worst {E.pct(c['worst_rel_error'])}).")
        out.append("")
    return out


def render(run_dir: Path, raw: dict, link: Links) -> str:
    """The README of the run in ``run_dir`` (``raw``: `mtplib.records.evidence.load_raw`)."""
    if not any(b in raw for b in BUILDS):
        raise InputError(f"{run_dir}: no {WAN_DIR}/<build>/wan.json: the lane did not run "
                         "notebook 05_wan")
    rec = raw["run_record"]
    lines = ["# Ranged MTP over a WAN (issue 14)", "",
             "Generated by `mtplib.records.wan_evidence` from run "
             f"`{Path(rec.get('run_dir') or run_dir).name}` ("
             + ", ".join(link(raw_file(b)) for b in BUILDS if b in raw)
             + f", {link('run_record.json')}). Do not edit: `mtplib evidence --run RUN_DIR "
             "--story wan` rewrites it; every number traces to those files (rule at the end).",
             "",
             "## The run", ""]
    lines += E.table(["what", "value"], E.run_rows(rec) + [
        ["host", f"`{rec.get('cpu', {}).get('model')}`, "
                 f"`{rec.get('cpu', {}).get('logical_cores')}` cores"],
        ["models", "the committed trained tiny V4 pair (`evidence/trained-v4/`)"]])
    lines.append("")
    for b in BUILDS:
        if b in raw:
            lines += _build_section(b, raw[b])
    lines += ["## How numbers are traced", "", TRACE_RULE, ""]
    return "\n".join(lines)
