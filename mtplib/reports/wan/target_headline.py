"""The WAN headline of issue 29 item 5: one table of every target cell measured so far,
from the results folders of the resumable target run (`run.sh`'s parts) and session 9's
2-shard cells (`../target-s9`).

    python -m mtplib.reports.wan.target_headline

prints one row per cell with k > 0 as a Markdown table (the speed-up over MTP off of the
same cell, paired by prompt and repetition, and its fraction of the tokens-per-verify ideal),
each figure as the part's own ``wan_summary.csv`` holds it; ``--csv PATH`` also writes the
rows as CSV (not committed: the parts' summaries are the sources). A part still running
counts with its finished cells (its ``wan.partial.json``); a cell is finished when it
holds n_prompts x reps rows.

``--steps`` prints instead, per cell, where a verify step's time goes against a plain
token's: the median ms per plain token (MTP off: one step per token) and per verify step
(k=2: decode seconds / steps of each generation), their difference (the verify step's extra
compute: the RTT waits are the same) and plain / verify, the per-step efficiency that caps
the fraction of the ideal whatever the acceptance.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

from mtplib.lab.wan.files import PARTIAL_JSON, WAN_JSON
from mtplib.lab.wan.summary import summarize
from mtplib.reports import common

MODULE = "mtplib.reports.wan.target_headline"
#: evidence/wan/target: the target run's parts, one folder each
HERE = common.evidence("wan") / "target"
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


def sources() -> list[Path]:
    """Session 9's 2-shard cells, then every part of the target run (sorted)."""
    return [HERE.parent / "target-s9", *sorted(p for p in HERE.iterdir() if p.is_dir())]


def rows() -> list[dict]:
    out = []
    for folder in sources():
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


def step_rows() -> list[dict]:
    """Per cell (plan, topology, RTT, bandwidth): median ms per plain token and per verify
    step, from the rows of each finished or running part."""
    import statistics

    out = []
    for folder in sources():
        got = _results(folder)
        if got is None:
            continue
        cells: dict[tuple, dict[int, list[float]]] = {}
        for r in got[0]["rows"]:
            if not r.get("decode_tok_s") or not r.get("n_generated"):
                continue
            steps = r["steps"] if r["k"] else r["n_generated"]
            key = (r["plan"], r["topology"], r["rtt_ms"], r.get("mbit"))
            cells.setdefault(key, {}).setdefault(r["k"], []).append(
                1000.0 * r["n_generated"] / r["decode_tok_s"] / steps)
        for (plan, topo, rtt, mbit), by_k in cells.items():
            if 0 not in by_k or 2 not in by_k:
                continue
            plain, verify = statistics.median(by_k[0]), statistics.median(by_k[2])
            out.append({"source": folder.relative_to(HERE.parent).as_posix(),
                        "shards": plan.count(",") + 1, "topology": topo, "rtt_ms": rtt,
                        "mbit": mbit, "plain_ms": plain, "verify_ms": verify,
                        "extra_ms": verify - plain, "plain_over_verify": plain / verify})
    return out


def _fmt(v) -> str:
    if v is None:
        return "unlimited"
    return f"{v:.3f}" if isinstance(v, float) else str(v)


def main(argv: list[str] | None = None) -> int:
    ap = common.parser(MODULE, __doc__)
    ap.add_argument("--csv", help="also write the rows to this CSV file")
    ap.add_argument("--steps", action="store_true",
                    help="print ms per plain token and per verify step per cell instead")
    a = ap.parse_args(argv)
    if a.steps:
        print("| source | shards | topology | RTT ms | Mbit/s | ms per plain token | "
              "ms per verify step | extra ms per verify step | plain / verify |")
        print("|" + "---|" * 9)
        for r in step_rows():
            print(f"| {r['source']} | {r['shards']} | {r['topology']} | {r['rtt_ms']:g} | "
                  f"{_fmt(r['mbit'])} | {r['plain_ms']:.1f} | {r['verify_ms']:.1f} | "
                  f"{r['extra_ms']:.1f} | {r['plain_over_verify']:.3f} |")
        return 0
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
    raise SystemExit(main())
