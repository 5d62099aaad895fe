"""Markdown tables for README.md from the committed result files of this folder:
seam-<build>.json (seam_waits.py), wan/<build>/wan.json and target/<build>/<mode>/wan.json
(python -m mtplib.lab.wan; the target cell: measure_target.sh). The folder read and written
is --out's (default: evidence/upstream-patches).

    python -m mtplib.reports.upstream_patches.report [--write] [--out DIR]

--write puts them into DIR/README.md (default: evidence/upstream-patches/) between its
<!-- side by side -->, <!-- wan --> and <!-- target --> (and <!-- target rerun -->:
target-rerun/) markers.
"""

from __future__ import annotations

import json
import logging
import statistics
from pathlib import Path

from mtplib.reports import common

MODULE = "mtplib.reports.upstream_patches.report"
#: named, not __name__ (which is __main__ under python -m)
log = logging.getLogger(MODULE)
HERE = common.evidence("upstream-patches")
BUILDS = ("stock", "baseline", "patched")


def _load(p: Path) -> dict | None:
    return json.loads(p.read_text()) if p.is_file() else None


def side_by_side(here: Path = HERE) -> list[str]:
    runs = {b: _load(here / f"seam-{b}.json") for b in BUILDS}
    runs = {b: r for b, r in runs.items() if r}
    out = ["| plan | k | step | " + " | ".join(f"{b}: waits" for b in runs) + " | "
           + " | ".join(f"{b}: seam B / constants B / cache B per step" for b in runs)
           + " | seam values, last build | tokens equal |", "|" + "---|" * (5 + 2 * len(runs))]
    first = next(iter(runs.values()))
    for i, row in enumerate(first["rows"]):
        step = "decode" if row["k"] == 0 else "verify"
        cells = [f"`{row['plan']}`", str(row["k"]), step]
        rs = [runs[b]["rows"][i] for b in runs]
        cells += [f"{r['waits_per_step'][step]:g}" for r in rs]
        for r in rs:
            n = r["steps"][step]
            c = r["bytes_by_class"][step]
            cells.append(f"{c['seam'] / n:,.0f} / {c['constants'] / n:,.0f} / "
                         f"{c['cache'] / n:,.0f}")
        last = rs[-1]
        pv = last.get("seam_bytes_by_value", {}).get(step, {})
        n = last["steps"][step]
        cells.append(", ".join(f"{k} {v / n:,.0f}" for k, v in pv.items()) or "-")
        cells.append("yes" if all(r["tokens"] == rs[0]["tokens"] for r in rs) else "**no**")
        out.append("| " + " | ".join(cells) + " |")
    builds = ", ".join(f"{b}: `{r['upstream']['build']}` {r['upstream']['patches']}"
                       for b, r in runs.items())
    return out + ["", f"Builds: {builds}. Per step = the step kind's bytes over its count; "
                  "12 new tokens after a 48-token prompt, one run per row."]


def wan_tables(here: Path = HERE) -> list[str]:
    res = {b: _load(here / "wan" / b / "wan.json") for b in BUILDS}
    res = {b: r for b, r in res.items() if r}
    if not res:
        return ["(no WAN run)"]
    groups: dict[tuple, dict[str, list]] = {}
    for b, r in res.items():
        for x in r["rows"]:
            key = (x["plan"], x["rtt_ms"], x["k"])
            groups.setdefault(key, {}).setdefault(b, []).append(x)
    out = ["| plan | RTT ms | k | " + " | ".join(
        f"{b}: tok/s median [min-max] (n) | {b}: waits/token" for b in res)
        + " | patched / " + ("baseline" if "baseline" in res else "stock")
        + " | tokens = MTP off (all builds) |", "|" + "---|" * (5 + 2 * len(res))]
    ref = "baseline" if "baseline" in res else "stock"
    for key in sorted(groups, key=lambda k: (k[0], k[1], k[2])):
        g = groups[key]
        cells = [f"`{key[0]}`", f"{key[1]:g}", str(key[2])]
        med = {}
        for b in res:
            xs = g.get(b, [])
            t = [x["decode_tok_s"] for x in xs]
            w = [x["waits_decode_phase"] for x in xs if x["waits_decode_phase"] is not None]
            med[b] = statistics.median(t) if t else None
            cells.append(f"{med[b]:.2f} [{min(t):.2f}-{max(t):.2f}] ({len(t)})" if t else "-")
            cells.append(f"{statistics.median(w):.2f}" if w else "-")
        cells.append(f"{med['patched'] / med[ref]:.2f}x" if med.get("patched") and med.get(ref)
                     else "-")
        same = []
        for b in res:
            off = {(x["prompt"], x["rep"]): x["tokens"] for x in res[b]["rows"]
                   if x["plan"] == key[0] and x["rtt_ms"] == key[1] and x["k"] == 0}
            same += [x["tokens"] == off.get((x["prompt"], x["rep"])) for x in g.get(b, [])]
        cells.append("yes" if all(same) else "**no**")
        out.append("| " + " | ".join(cells) + " |")
    out.append("")
    out.append("MTP on over MTP off (median tok/s ratio), per build:")
    out.append("")
    out.append("| plan | RTT ms | " + " | ".join(res) + " |")
    out.append("|" + "---|" * (2 + len(res)))
    for plan, rtt in sorted({(k[0], k[1]) for k in groups}):
        cells = [f"`{plan}`", f"{rtt:g}"]
        for b in res:
            on = [x["decode_tok_s"] for x in groups.get((plan, rtt, 2), {}).get(b, [])]
            off = [x["decode_tok_s"] for x in groups.get((plan, rtt, 0), {}).get(b, [])]
            cells.append(f"{statistics.median(on) / statistics.median(off):.2f}x"
                         if on and off else "-")
        out.append("| " + " | ".join(cells) + " |")
    info = ", ".join(f"{b}: `{r['upstream']['build']}` {r['upstream'].get('patches')}, "
                     f"{r['wall_s']:.0f} s" for b, r in res.items())
    cfg = next(iter(res.values()))["config"]
    out += ["", f"Runs: {info}. Config: {cfg['n_prompts']} held-out prompts of "
            f"{cfg['prompt_len']} tokens, {cfg['n_new']} new tokens, {cfg['reps']} rep, "
            f"warm-up {cfg['warmup']}, topology {cfg['topologies']}, drafter "
            f"{cfg['placements']}, head `{cfg['head']}`."]
    return out


def _spread(xs: list[float]) -> str:
    return (f"{statistics.median(xs):.3f} [{min(xs):.3f}-{max(xs):.3f}] (n={len(xs)})"
            if xs else "-")


def target_tables(folder: str = "target", here: Path = HERE) -> list[str]:
    """The target cell (100 ms, k=2, every shard remote, 16 prompts x 64 tokens): tok/s
    per build and mode, and the speed-ups paired by prompt (patched over baseline; MTP on
    over MTP off)."""
    runs = {(b, m): _load(here / folder / b / m / "wan.json")
            for b in ("baseline", "patched") for m in ("warm", "cold")}
    runs = {bm: r for bm, r in runs.items() if r}
    if not runs:
        return ["(no target run)"]
    rows: dict[tuple, dict[int, dict]] = {}  # (build, mode, plan, k) -> prompt -> row
    for (b, m), r in runs.items():
        for x in r["rows"]:
            rows.setdefault((b, m, x["plan"], x["k"]), {})[x["prompt"]] = x
    out = ["| plan | mode | k | baseline tok/s median [min-max] (n) | baseline waits/token "
           "| patched tok/s median [min-max] (n) | patched waits/token "
           "| patched / baseline, paired by prompt | tokens = MTP off |",
           "|" + "---|" * 9]
    plans = sorted({key[2] for key in rows}, key=lambda p: p.count(","))
    for plan in plans:
        for mode in ("warm", "cold"):
            for k in (0, 2):
                base, pat = rows.get(("baseline", mode, plan, k)), rows.get(
                    ("patched", mode, plan, k))
                if not base or not pat:
                    continue
                cells = [f"`{plan}`", mode, str(k)]
                for g in (base, pat):
                    t = [x["decode_tok_s"] for x in g.values()]
                    w = [x["waits_decode_phase"] for x in g.values()]
                    cells += [f"{statistics.median(t):.2f} [{min(t):.2f}-{max(t):.2f}] "
                              f"({len(t)})", f"{statistics.median(w):.2f}"]
                both = sorted(set(base) & set(pat))
                cells.append(_spread([pat[i]["decode_tok_s"] / base[i]["decode_tok_s"]
                                      for i in both]))
                same = []
                for b, g in (("baseline", base), ("patched", pat)):
                    off = rows.get((b, "warm", plan, 0), {})
                    same += [x["tokens"] == off[i]["tokens"] for i, x in g.items() if i in off]
                cells.append(("yes" if all(same) else "**no**") + f" ({len(same)})")
                out.append("| " + " | ".join(cells) + " |")
    out += ["", "MTP on (k=2) over MTP off, warm, paired by prompt:", "",
            "| plan | baseline | patched |", "|---|---|---|"]
    for plan in plans:
        cells = [f"`{plan}`"]
        for b in ("baseline", "patched"):
            on, off = rows.get((b, "warm", plan, 2), {}), rows.get((b, "warm", plan, 0), {})
            cells.append(_spread([on[i]["decode_tok_s"] / off[i]["decode_tok_s"]
                                  for i in sorted(set(on) & set(off))]))
        out.append("| " + " | ".join(cells) + " |")
    info = "; ".join(f"{b} {m}: `{r['upstream']['build']}` {r['upstream'].get('patches')}, "
                     f"{r['wall_s']:.0f} s" for (b, m), r in runs.items())
    out += ["", f"Runs: {info}."]
    return out


def write_readme(here: Path = HERE) -> Path:
    """Replace the text between each pair of markers in ``here``/README.md with the tables;
    the README's path."""
    path = here / "README.md"
    text = path.read_text()
    for name, lines in (("side by side", side_by_side(here)), ("wan", wan_tables(here)),
                        ("target", target_tables(here=here)),
                        ("target rerun", target_tables("target-rerun", here))):
        start, end = f"<!-- {name} -->", f"<!-- /{name} -->"
        i, j = text.index(start) + len(start), text.index(end)
        text = text[:i] + "\n" + "\n".join(lines) + "\n" + text[j:]
    path.write_text(text)
    return path


def main(argv: list[str] | None = None) -> int:
    ap = common.parser(MODULE, __doc__)
    ap.add_argument("--write", action="store_true",
                    help="write the tables into --out's README.md (else print them)")
    common.add_out(ap, "upstream-patches", "the folder read (and with --write, whose "
                   "README.md is written)")
    a = ap.parse_args(argv)
    common.setup_logging()
    if a.write:
        log.info("wrote %s", write_readme(a.out))
        return 0
    print("\n".join(["<!-- side by side -->", *side_by_side(a.out), "", "<!-- wan -->",
                     *wan_tables(a.out), "", "<!-- target -->", *target_tables(here=a.out), "",
                     "<!-- target rerun -->", *target_tables("target-rerun", a.out)]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
