"""The WAN headline of issue 29 item 5: one table of every target cell measured so far,
from the results folders of the resumable target run (`run.sh`'s parts) and session 9's
2-shard cells (`../target-s9`).

    PYTHONPATH=$PWD .venv/bin/python evidence/wan/target/headline.py

prints one row per cell with k > 0 as a Markdown table (the speed-up over MTP off of the
same cell, paired by prompt and repetition, and its fraction of the tokens-per-verify ideal),
each figure as the part's own ``wan_summary.csv`` holds it; ``--csv PATH`` also writes the
rows as CSV (not committed: the parts' summaries are the sources). A part still running
counts with its finished cells (its ``wan.partial.json``); a cell is finished when it
holds n_prompts x reps rows.
"""

from __future__ import annotations

import csv
import json
import sys
from pathlib import Path

from mtplib.lab.wan import PARTIAL_JSON, WAN_JSON, summarize

HERE = Path(__file__).resolve().parent
SOURCES = [HERE.parent / "target-s9", *sorted(p for p in HERE.iterdir() if p.is_dir())]
COLUMNS = ("source", "plan", "shards", "topology", "rtt_ms", "mbit", "k", "runs", "off_tok_s",
           "tok_s", "speedup_paired_median", "speedup_paired_min", "speedup_paired_max",
           "tokens_per_step", "speedup_over_ideal", "waits_per_plain", "waits_per_verify",
           "identical_to_off", "cache_bytes_crossing", "patches", "commit", "state")


def _results(folder: Path) -> tuple[dict, str] | None:
    for name, state in ((WAN_JSON, "finished"), (PARTIAL_JSON, "in progress")):
        p = folder / name
        if p.is_file():
            return json.loads(p.read_text()), state
    return None


def rows() -> list[dict]:
    out = []
    for folder in SOURCES:
        got = _results(folder)
        if got is None:
            continue
        data, state = got
        prov = data.get("provenance") or {}
        patches = (data.get("upstream") or {}).get("patch_set_sha256") or \
            (data.get("upstream") or {}).get("patches")
        for s in summarize(data["rows"]):
            if not s["k"]:
                continue
            out.append({
                "source": folder.relative_to(HERE.parent).as_posix(), "plan": s["plan"],
                "shards": s["plan"].count(",") + 1, "topology": s["topology"],
                "rtt_ms": s["rtt_ms"], "mbit": s.get("mbit"), "k": s["k"], "runs": s["runs"],
                **{c: s[c] for c in COLUMNS[8:18]},
                "cache_bytes_crossing": s["cache_bytes_crossing"],
                "patches": patches if isinstance(patches, str) else None,
                "commit": (prov.get("commit") or "")[:7] or None, "state": state})
    return out


def _fmt(v) -> str:
    if v is None:
        return "unlimited"
    return f"{v:.3f}" if isinstance(v, float) else str(v)


def main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--csv", help="also write the rows to this CSV file")
    a = ap.parse_args(argv)
    got = rows()
    if a.csv:
        with open(a.csv, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=COLUMNS, lineterminator="\n")
            w.writeheader()
            w.writerows(got)
    print("| source | shards | topology | RTT ms | Mbit/s | runs per k | MTP off tok/s | k=2 tok/s "
          "| speed-up, paired median (min-max) | tokens per step | of the ideal | tokens "
          "| cache bytes |")
    print("|" + "---|" * 13)
    for r in got:
        print(f"| {r['source']} | {r['shards']} | {r['topology']} | {r['rtt_ms']:g} | "
              f"{_fmt(r['mbit'])} | {r['runs']} | {_fmt(r['off_tok_s'])} | {_fmt(r['tok_s'])} | "
              f"{_fmt(r['speedup_paired_median'])} ({_fmt(r['speedup_paired_min'])}-"
              f"{_fmt(r['speedup_paired_max'])}) | {_fmt(r['tokens_per_step'])} | "
              f"{_fmt(r['speedup_over_ideal'])} | "
              f"{'identical' if r['identical_to_off'] else 'DIFFER'} | "
              f"{r['cache_bytes_crossing']} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
