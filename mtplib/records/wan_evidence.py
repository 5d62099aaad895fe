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

from mtplib.contract.labels import DECODING_STEPS
from mtplib.errors import InputError
from mtplib.records import readme as E
from mtplib.records.readme import Links

STORY = "wan"
WAN_DIR = "wan"
#: the target cell's runs (many prompts at one RTT, cold and warm), beside the RTT sweep
TARGET_DIR = "wan-target"
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


PLOTS_DIR = f"{WAN_DIR}/plots"


def story_files(run_dir: Path) -> list[Path]:
    """What ``mtplib evidence --story wan`` copies: the executed 05_wan notebook, the run
    record, each build's results (wan.json, the summary CSV, its run log) and the plots."""
    out = [Path(n) for n in ("05_wan.ipynb", "run_record.json") if (run_dir / n).is_file()]
    for folder in (WAN_DIR, TARGET_DIR):
        for b in BUILDS:
            d = run_dir / folder / b
            out += [p.relative_to(run_dir) for p in sorted(d.glob("*"))
                    if p.is_file() and p.suffix in (".json", ".csv", ".log")]
    out += [p.relative_to(run_dir) for p in sorted((run_dir / PLOTS_DIR).glob("*.png"))]
    return out


def save_plots(results: dict[str, dict], run_dir: Path) -> list[Path]:
    """Tokens/s and speed-up against every measured RTT, stock and patched on the same
    axes, one PNG per (mode, plan) under ``wan/plots/`` (the README links them)."""
    from mtplib.lab.wan import plots as W

    d = Path(run_dir) / PLOTS_DIR
    d.mkdir(parents=True, exist_ok=True)
    out = []
    summaries = {b: r["summary"] for b, r in results.items()}
    keys = sorted({(x.get("mode", "warm"), x["plan"], x.get("mbit")) for s in summaries.values()
                   for x in s}, key=lambda t: (t[0], t[1], t[2] is None, t[2] or 0))
    for mode, plan, mbit in keys:
        fig = W.plot_builds(summaries, plan=plan, mode=mode, mbit=mbit)
        if fig is None:
            continue
        bw = "" if mbit is None else f"-{mbit:g}mbit"  # unlimited: the name it always had
        p = d / f"rtt-{mode}-{plan.replace(',', '_')}{bw}.png"
        fig.savefig(p, dpi=110, bbox_inches="tight")
        out.append(p)
    return out


def raw_file(build: str, folder: str = WAN_DIR) -> str:
    return f"{folder}/{build}/wan.json"


#: raw key -> file: the sweep's per build ("stock", "patched"), the target cell's
#: ("target-stock", "target-patched")
RAW_FILES = {**{b: raw_file(b) for b in BUILDS},
             **{f"target-{b}": raw_file(b, TARGET_DIR) for b in BUILDS}}


def read_build(key: str):
    """The reader of one results file (a `RAW_FILES` key): the cited sections of it."""

    def read(run_dir: str | Path) -> dict:
        d = json.loads((Path(run_dir) / RAW_FILES[key]).read_text())
        return {k: d[k] for k in CITED_WAN_KEYS if k in d}

    return read


def _mode(r: dict) -> str:
    return r.get("mode", "warm")


def _speed_table(s: list[dict], mode: str, plan: str, topo: str, place: str,
                 mbit: float | None = None) -> list[str]:
    mine = [r for r in s if _mode(r) == mode and r["plan"] == plan and r.get("mbit") == mbit]
    rtts = sorted({r["rtt_ms"] for r in mine})
    ks = sorted({r["k"] for r in mine})
    rows = []
    for rtt in rtts:
        cells = [f"{rtt:g}"]
        for k in ks:
            r = next((x for x in mine if (x["topology"], x["rtt_ms"], x["k"]) ==
                      (topo, rtt, k) and (k == 0 or x["placement"] == place)), None)
            if r is None:
                cells.append("n/a")
            elif k == 0:
                cells.append(E.fmt(r["tok_s"], 2))
            else:
                cells.append(f"{E.fmt(r['tok_s'], 2)} ({E.fmt(r['speedup'], 2)}x)")
        rows.append(cells)
    head = ["RTT ms"] + ["MTP off tok/s" if k == 0 else f"k={k} tok/s (speed-up)" for k in ks]
    return E.table(head, rows)


def _spread_text(med, lo, hi, nd: int = 2) -> str:
    if med is None:
        return "n/a"
    return f"{E.fmt(med, nd)} [{E.fmt(lo, nd)}–{E.fmt(hi, nd)}]"


def _headline(raw: dict) -> list[str]:
    """The targets' cell (100 ms RTT, plan 0-1,2-3, k=2) for every build, mode and topology:
    n runs, medians with their ranges, speed-up against the ideal, waits, cache bytes."""
    rows = []
    bws = False
    used: list[str] = []
    for b in BUILDS:
        key = f"target-{b}" if f"target-{b}" in raw else b
        if key not in raw:
            continue
        used.append(key)
        summ = raw[key]["summary"]
        for t in raw[key]["targets"]:
            on = next((x for x in summ if (_mode(x), x["plan"], x["topology"], x["placement"],
                                           x["k"], x["rtt_ms"], x.get("mbit")) ==
                       (t.get("mode", "warm"), t["plan"], t["topology"], t["placement"],
                        t["k"], t["rtt_ms"], t.get("mbit"))), None)
            off = next((x for x in summ if (_mode(x), x["plan"], x["topology"], x["k"],
                                            x["rtt_ms"], x.get("mbit")) ==
                        (t.get("mode", "warm"), t["plan"], t["topology"], 0, t["rtt_ms"],
                         t.get("mbit"))), None)
            if on is None:
                continue
            if "mbit" in t:
                bws = True
            rows.append([
                f"`{b}`", f"`{t.get('mode', 'warm')}`", f"`{t['topology']}`",
                *([_bw(t)] if "mbit" in t else []),
                f"`{t['placement']}`", str(on["runs"]),
                "n/a" if off is None else _spread_text(off["tok_s"], off.get("tok_s_min"),
                                                       off.get("tok_s_max")),
                _spread_text(on["tok_s"], on.get("tok_s_min"), on.get("tok_s_max")),
                _spread_text(on.get("speedup_paired_median"), on.get("speedup_paired_min"),
                             on.get("speedup_paired_max"), 3),
                E.fmt(t["tokens_per_step"], 3), E.fmt(t["speedup_over_ideal"], 3),
                "n/a" if t["goal"] is None else E.fmt(t["goal"], 2),
                "n/a" if t["met"] is None else ("yes" if t["met"] else "**no**"),
                f"{E.fmt(t.get('waits_per_verify'), 2)} / "
                f"{E.fmt(t.get('waits_per_plain_off'), 2)}",
                str(t["cache_bytes_crossing"]),
                "yes" if t["identical_to_off"] else "**no**"])
    if not rows:
        return []
    seams = ", ".join(sorted({_seam_text(raw[k].get("config") or {}) for k in used}))
    out = ["## The path users take: 100 ms RTT, plan `0-1,2-3`, k=2", "",
           "`cold`: one `mtplib generate --json` process per generation with its default "
           "options (only the model, `--plan`, `--mtp/--draft` and `--wan` given; "
           f"{seams}); `warm`: one "
           "`RangedMTP` (the object `mtplib serve` holds) for every generation, engines warmed "
           "at load. tok/s are medians over the runs with [min–max]; the speed-up column is the "
           "median of the per-run paired ratios (same prompt and repetition, MTP on / off) "
           "with [min–max]; `ratio` = speed-up of the medians / tokens per verify step (the "
           "RTT-bound ideal).", ""]
    out += E.table(["build", "mode", "topology", *(["link"] if bws else []), "MTP on", "runs",
                    "MTP off tok/s",
                    "MTP on tok/s", "speed-up (paired)", "tokens/verify", "ratio", "goal",
                    "met", "waits verify / plain", "cache bytes crossing",
                    "tokens = MTP off"], rows)
    out.append("")
    return out


def _seam_text(config: dict) -> str:
    """The seam a results folder's config ran: as configured, or the star where it names
    none (the default before `auto`; a config without the field predates the choice)."""
    if "seam" in config:
        return f"the seam `{config['seam']}`"
    return "the seam `star`, the default when it ran"


def _bw(r: dict) -> str:
    """A row's link bandwidth as a table cell."""
    m = r.get("mbit")
    return "unlimited" if m is None else f"{m:g} Mbit/s"


def _bandwidths(summary: list[dict]) -> list[float | None]:
    """The link bandwidths a summary has (capped ones up, unlimited last); [None] for a
    summary older than the field."""
    return sorted({r.get("mbit") for r in summary}, key=lambda m: (m is None, m or 0))


def _build_section(b: str, d: dict, what: str) -> list[str]:
    from mtplib.lab.wan import plots as W

    s = d["summary"]
    c = d["config"]
    out = [f"## Build: {b}, {what}", "",
           f"Config: modes `{c.get('modes', ['warm'])}`, `{c['n_prompts']}` held-out prompts of "
           f"`{c['prompt_len']}` tokens, `{c['n_new']}` new tokens, `{c['reps']}` repetitions; "
           f"warm RTTs `{c['rtts_ms']}` ms and k `{c['ks']}`; cold RTTs "
           f"`{c.get('cold_rtts_ms', [])}` ms and k `{c.get('cold_ks', [])}`.", ""]
    up = d.get("upstream", {})
    out.append(f"Upstream: `{up.get('build', b)}` build, patches `{up.get('patches', [])}`, "
               f"wall time of the sweep {E.fmt(d.get('wall_s'), 0)} s.")
    out.append("")
    for mode in sorted({_mode(r) for r in s}, key=lambda m: m != "cold"):
        mine = [r for r in s if _mode(r) == mode]
        for plan in sorted({r["plan"] for r in mine}):
            for topo in sorted({r["topology"] for r in mine if r["plan"] == plan}):
                for place in sorted({r["placement"] for r in mine if r["plan"] == plan
                                     and r["placement"] != "-"}):
                    for mbit in _bandwidths(mine):
                        bw = (f", links {W.bandwidth_text(mbit)}"
                              if any("mbit" in r for r in mine) else "")
                        out.append(f"`{mode}`: plan `{plan}`, topology `{topo}`, MTP on the "
                                   f"`{place}`{bw} (median tok/s of "
                                   f"{max(r['runs'] for r in mine if r['plan'] == plan)} runs):")
                        out.append("")
                        out += _speed_table(s, mode, plan, topo, place, mbit)
                        out.append("")
    out.append("Targets at 100 ms RTT, plan `0-1,2-3`, k=2 (speed-up over MTP off against "
               "tokens per verify step, the RTT-bound ideal):")
    out.append("")
    bws = any("mbit" in t for t in d["targets"])
    rows = [[f"`{t.get('mode', 'warm')}`", f"`{t['topology']}`", *([_bw(t)] if bws else []),
             f"`{t['placement']}`", E.fmt(t["speedup"], 3),
             E.fmt(t["tokens_per_step"], 3), E.fmt(t["speedup_over_ideal"], 3),
             "n/a" if t["goal"] is None else E.fmt(t["goal"], 2),
             "n/a" if t["met"] is None else ("yes" if t["met"] else "**no**"),
             E.fmt(t.get("waits_per_verify"), 2), E.fmt(t.get("waits_per_plain_off"), 2),
             str(t["cache_bytes_crossing"]),
             "yes" if t["identical_to_off"] else "**no**"] for t in d["targets"]]
    out += E.table(["mode", "topology", *(["link"] if bws else []), "MTP on", "speed-up",
                    "tokens/verify", "ratio", "goal",
                    "met",
                     "waits/verify", "waits/plain step (MTP off)", "cache bytes crossing",
                     "tokens = MTP off"], rows)
    out.append("")
    out.append("Waits (synchronous round trips) per step, median over the runs of each "
               "configuration; cache bytes that crossed a shard connection, all runs:")
    out.append("")
    rows, seen = [], set()
    for r in s:
        key = (_mode(r), r["plan"], r["topology"], r["placement"], r["k"])
        if key in seen or r["rtt_ms"] != max(x["rtt_ms"] for x in s if _mode(x) == _mode(r)):
            continue
        seen.add(key)
        rows.append([f"`{_mode(r)}`", f"`{r['plan']}`", f"`{r['topology']}`",
                     f"`{r['placement']}`",
                     str(r["k"]), E.fmt(r["waits_per_plain"], 2), E.fmt(r["waits_per_verify"], 2),
                     E.fmt(r["waits_per_draft"], 2), E.fmt(r["waits_per_token"], 2),
                     str(r["cache_bytes_crossing"])])
    out += E.table(["mode", "plan", "topology", "MTP on", "k", "plain step", "verify step",
                    "draft", "per token", "cache bytes (sum over runs)"], rows)
    out.append("")
    out.append("Data bytes per generated token by class (`mtplib.contract.wire`), by step "
               "kind, plan `0-1,2-3`, topology `remote`:")
    out.append("")
    rows = [[f"`{x.get('mode', 'warm')}`", str(x["k"]), f"`{x['placement']}`",
             f"`{x['step']}`", *[str(round(x.get(c, 0)))
                                 for c in ("seam", "outputs", "inputs", "constants", "cache")]]
            for x in d["bytes_by_class"] if x["plan"] == "0-1,2-3" and x["topology"] == "remote"
            and x["step"] in DECODING_STEPS]
    out += E.table(["mode", "k", "MTP on", "step", "seam", "outputs", "inputs", "constants",
                    "cache"], rows)
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
    if not any(k in raw for k in RAW_FILES):
        raise InputError(f"{run_dir}: no {WAN_DIR}/<build>/wan.json: the lane did not run "
                         "notebook 05_wan")
    rec = raw["run_record"]
    lines = ["# Ranged MTP over a WAN (issues 14, 20)", "",
             "Generated by `mtplib.records.wan_evidence` from run "
             f"`{Path(rec.get('run_dir') or run_dir).name}` ("
             + ", ".join(link(f) for k, f in RAW_FILES.items() if k in raw)
             + f", {link('run_record.json')}). Do not edit: `mtplib evidence --run RUN_DIR "
             "--story wan` rewrites it; every number traces to those files (rule at the end).",
             "",
             "## The run", ""]
    lines += E.table(["what", "value"], E.run_rows(rec) + [
        ["host", f"`{rec.get('cpu', {}).get('model')}`, "
                 f"`{rec.get('cpu', {}).get('logical_cores')}` cores"],
        ["models", "the committed trained tiny V4 pair (`evidence/trained-v4/`)"]])
    lines.append("")
    if rec.get("status") not in (None, "ok"):
        lines += [f"**The run's record says `{rec.get('status')}`**: the sections below show "
                  "what it left; read them as incomplete.", ""]
    lines += _headline(raw)
    plots = sorted((Path(run_dir) / PLOTS_DIR).glob("*.png"))
    if plots:
        lines += ["Tokens/s and speed-up against RTT, stock and patched on the same axes: "
                  + ", ".join(link(f"{PLOTS_DIR}/{p.name}") for p in plots) + ".", ""]
    for b in BUILDS:
        if b in raw:
            lines += _build_section(b, raw[b], "RTT sweep")
    for b in BUILDS:
        if f"target-{b}" in raw:
            lines += _build_section(b, raw[f"target-{b}"], "target cell")
    lines += ["## How numbers are traced", "", TRACE_RULE, ""]
    return "\n".join(lines)
