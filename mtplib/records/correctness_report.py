"""The correctness section of the DGR-066 README: what notebook 03_correctness checked.

Why its own room: the section reads ``correctness.json`` (`mtplib.records.raw_metrics`,
notebook 03's raw metrics), which the benchmark sections never touch. `summary` counts
its rows once; the README cites only those counts (the tracing rule names them), so every
figure in the section is either a value of the committed file or a count of its rows.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from mtplib.records.raw_metrics import CORRECTNESS_JSON
from mtplib.records.readme import Links, fmt, table, yes


def _n(rows: list[dict], key: str) -> int:
    return sum(1 for r in rows if r.get(key) is True)


def _text(v) -> str:
    """A cell: a missing value (None, NaN) as n/a, a bool as yes / no (a fact, not a
    check: a failed check is `yes()`'s bold **no**)."""
    if v is None or isinstance(v, float) and math.isnan(v):
        return "n/a"
    return ("yes" if v else "no") if isinstance(v, bool) else str(v)


def summary(raw: dict) -> dict:
    """Counts of notebook 03's tables (the figures the section prints)."""
    eq = raw.get("equality", [])
    by_k = []
    for k in sorted({r["k"] for r in eq}):
        rows = [r for r in eq if r["k"] == k]
        diverged = [r for r in rows if not r["equal"]]
        by_k.append({"k": k, "prompts": len(rows), "equal": _n(rows, "equal"),
                     "near_tie": sum(1 for r in diverged if r["near_tie"]),
                     "unexplained": sum(1 for r in diverged if not r["near_tie"]),
                     "drafted": sum(r["drafted"] for r in rows),
                     "accepted": sum(r["accepted"] for r in rows)})
    fo, rb, se = raw.get("forced", []), raw.get("rollback", []), raw.get("sessions", [])
    sa = raw.get("sampling") or {}
    return {
        "equality": by_k,
        "forced": {"cases": len(fo), "same_output": _n(fo, "same_output"),
                   "steps_as_expected": sum(1 for r in fo
                                            if r["target_steps"] == r["expected_steps"])},
        "rollback": {"cases": len(rb), "within_noise_bound": _n(rb, "within_noise_bound"),
                     "argmax_equal": _n(rb, "argmax_equal"),
                     "max_abs_dlogit": max((r["max_abs_dlogit"] for r in rb), default=None)},
        "sessions": {"sessions": len(se), "same_as_alone": _n(se, "same_as_alone")},
        "sampling": {**sa, "differ": sa["seeds"] - sa["equal_streams"]} if sa else {},
        "whole_vs_ranged": raw.get("whole_vs_ranged", []),
    }


def read_correctness(run_dir: str | Path) -> dict:
    """The cited part of ``correctness.json``: its `summary`."""
    return summary(json.loads((Path(run_dir) / CORRECTNESS_JSON).read_text()))


def section(c: dict | None, link: Links) -> list[str]:
    """The README's correctness section from `summary` (None: notebook 03 did not run)."""
    head = ["## Correctness: MTP on emits the tokens of MTP off", ""]
    if c is None:
        return [*head, f"Notebook 03_correctness did not run in this run: no "
                f"`{CORRECTNESS_JSON}`, so no correctness figures here.", ""]
    out = [*head,
           f"Notebook {link('03_correctness.ipynb')} on the run's fixture pair; raw metrics "
           f"{link(CORRECTNESS_JSON)} (`mtplib.lab.correctness`; the counts below are "
           "counted from its rows by `mtplib.records.correctness_report.summary`). Greedy "
           "MTP on against MTP off, per seeded prompt (a divergence is allowed only at a "
           "near-tie of MTP off's top two logits, `mtplib.lab.quality`):", "",
           *table(["config", "prompts", "equal to MTP off", "near-tie divergences",
                   "unexplained divergences", "drafted", "accepted"],
                  [[f"k={e['k']}", str(e["prompts"]), str(e["equal"]), str(e["near_tie"]),
                    str(e["unexplained"]), str(e["drafted"]), str(e["accepted"])]
                   for e in c["equality"]]), ""]
    fo, rb, se, sa = c["forced"], c["rollback"], c["sessions"], c["sampling"]
    out += [f"- **Forced accept and reject** (an oracle drafter that drafts the target's own "
            f"continuation, or a wrong token): {fo['same_output']} of {fo['cases']} cases "
            f"emit MTP off's tokens; {fo['steps_as_expected']} of {fo['cases']} take the "
            "expected number of target steps.",
            f"- **Rollback** (`n_rs_seq` restore against a fresh context fed the accepted "
            f"prefix): {rb['within_noise_bound']} of {rb['cases']} within the noise bound, "
            f"argmax equal in {rb['argmax_equal']} of {rb['cases']}; largest |logit "
            f"difference| {fmt(rb['max_abs_dlogit'], 4)}.",
            f"- **Interleaved sessions**: {se['same_as_alone']} of {se['sessions']} "
            "sessions emit what each emits alone."]
    if sa:
        d = sa["differ"]
        differ = (f"; {d} differ{'s' if d == 1 else ''} (the run does not record where or "
                  "why)" if d else "")
        out.append(f"- **Sampling** (sample-and-match, k={sa['k']}, temperature "
                   f"{fmt(sa['temperature'])}, top-p {fmt(sa['top_p'], 2)}, {sa['n_new']} "
                   f"new tokens): {sa['equal_streams']} of {sa['seeds']} seeds give MTP "
                   f"off's sampled stream{differ}.")
    wr = c["whole_vs_ranged"]
    if wr:
        out += ["", "Whole model against the trunk on loopback RPC shards (the MTP block "
                "where the default placement puts it; `MTP on the tail` says whether it ran "
                "on the tail shard):", "",
                *table(["plan", "config", "equal to whole", "near-tie", "MTP placement",
                        "MTP on the tail", "drafted"],
                       [[f"`{w['plan']}`", "off" if w["k"] == 0 else f"k={w['k']}",
                         yes(w["equal"]), _text(w["near_tie"]),
                         _text(w["mtp_placement"]), _text(w["mtp_on_tail"]),
                         str(w["drafted"])] for w in wr])]
    out += ["", "Checked by tests, not by this run (so no figures here): draft lengths 4 to 8 "
            "on the committed trained pair emit MTP off's tokens and accept past the third "
            "draft (`tests/test_long_drafts.py`); the MTP block on the tail shard "
            "(`tests/test_ranged_mtp.py::test_ranged_equals_whole_mtp_off_and_on`, "
            "placement `tail`); a shard whose own report names another contract version or "
            "pin refuses MTP in one line (`tests/test_shard_report.py`).", ""]
    return out
