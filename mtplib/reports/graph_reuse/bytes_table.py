"""Bytes per step on the shard connections, by step kind, class and direction (issue 29 item 2).

One ranged generation per draft length (MTP off = plain steps, k = 1..3 = verify steps), the
drafter and the head in the client (the defaults), after one untimed generation on the same
prompt so that every graph width has been seen. Byte counts are exact and the same on every
run of the same build and prompt (the relays count every byte), so one prompt is enough;
the tokens are checked against MTP off.

    python -m mtplib.reports.graph_reuse.bytes_table --builds stock,patched \\
        --model evidence/trained-v4/v4-trained.gguf --mtp evidence/trained-v4/mtp-v4-trained.gguf \\
        --plan 0-1,2-3 --out evidence/graph-reuse/bytes-trained.json

Each build runs in its own process (MTPLIB_UPSTREAM); the stock build opts into its cache
crossing (`allow_cache_crossing`), which the table shows as the `cache` class.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

from mtplib.contract.labels import StepKind
from mtplib.paths import REPO
from mtplib.reports import common

MODULE = "mtplib.reports.graph_reuse.bytes_table"
#: named, not __name__ (which is __main__ under python -m)
log = logging.getLogger(MODULE)
PROMPT = [5, 9, 17, 33, 2, 40, 41, 42]
LABELS = (StepKind.PREFILL, StepKind.DECODE, StepKind.VERIFY)


def measure(model: str, mtp: str, plan: str, ks: list[int], n_new: int) -> dict:
    """In this process (the build MTPLIB_UPSTREAM selects): one row per (k, step kind)."""
    from mtplib.contract.wire import classify_by_direction
    from mtplib.distributed.ranged_mtp import RangedMTP
    from mtplib.runtime.engine_options import EngineOptions
    from mtplib.runtime.lib import upstream_info
    from mtplib.runtime.settings import DecodeSettings

    rows, tokens = [], {}
    for k in ks:
        # the star: what the committed figures measured (the default seam then)
        with RangedMTP(model, plan=plan, sidecar=mtp if k else None,
                       allow_cache_crossing=True, seam="star") as r:
            opts = EngineOptions(k=k, settings=DecodeSettings(n_ctx=512, n_threads=1))
            r.generate(PROMPT, n_new, opts)  # every width seen (and set up at load)
            toks, m = r.generate(PROMPT, n_new, opts)
            relays = r.rt.relays
            tokens[k] = toks
            rep = m.seam_report
            for label, row in rep["steps"].items():
                if label not in LABELS or not row["steps"]:
                    continue
                by_class: dict[str, dict[str, int]] = {}
                for link in classify_by_direction(relays.by_tensor_dir(label)):
                    for cls, ways in link.items():
                        for way, n in ways.items():
                            by_class.setdefault(cls, {"up": 0, "down": 0})[way] += n
                s = row["steps"]
                rows.append({
                    "k": k, "label": label, "steps": s, "tokens": row["tokens"],
                    "bytes": row["bytes"] / s, "up": row["up"] / s, "down": row["down"] / s,
                    "graph": row["graph"] / s, "graph_sends": row["graph_sends"],
                    "control": row["control"] / s, "data": row["data"] / s,
                    "classes": {c: {w: v / s for w, v in d.items()}
                                for c, d in sorted(by_class.items())},
                    "waits_per_step": row["waits_per_step"],
                    # the contract's minimum seam bytes (boundary values only) per step
                    "contract_min_per_step": (rep["contract_min_per_seam"][
                        "prefill_token" if label == "prefill" else "decode_token"]
                        * rep["n_seams"] * row["tokens"] / s),
                })
    same = all(tokens[k] == tokens[ks[0]] for k in ks)
    return {"build": upstream_info()["build"], "upstream": upstream_info(), "rows": rows,
            "tokens_equal_across_k": same, "tokens": tokens[ks[0]]}


def tiny_slice(out_dir: str) -> tuple[str, str]:
    """The `tiny-slice` preset's fixture (`mtplib.model.presets.TINY_SLICE`: the `tiny`
    widths with V4-Flash's first six layer kinds, `v4-flash-slice`'s structure in 7 MB)."""
    from mtplib.model.fixture import write_fixture

    pair = write_fixture(out_dir, preset="tiny-slice")
    return str(pair.trunk), str(pair.sidecar)


def main(argv: list[str] | None = None) -> int:
    ap = common.parser(MODULE, __doc__)
    ap.add_argument("--builds", default="stock,patched")
    ap.add_argument("--model")
    ap.add_argument("--mtp")
    ap.add_argument("--tiny-slice", metavar="DIR",
                    help="write the tiny-slice fixture into DIR and measure it")
    ap.add_argument("--plan", required=True)
    ap.add_argument("--ks", default="0,1,2,3")
    ap.add_argument("--n-new", type=int, default=24)
    ap.add_argument("--out", required=True)
    ap.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    ks = [int(x) for x in a.ks.split(",")]
    if a.tiny_slice:
        a.model, a.mtp = tiny_slice(a.tiny_slice)
    if not (a.model and a.mtp):
        ap.error("give --model and --mtp, or --tiny-slice DIR")
    if a.one:
        print(json.dumps(measure(a.model, a.mtp, a.plan, ks, a.n_new)))
        return 0
    started = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    common.setup_logging()
    out = {"command": " ".join(common.command(MODULE, argv)),
           "commit": subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"],
                                    capture_output=True, text=True).stdout.strip(),
           "host": {"machine": platform.machine(), "cpus": os.cpu_count(),
                    "loadavg_start": os.getloadavg()},
           "started": started, "model": a.model, "mtp": a.mtp, "plan": a.plan,
           "prompt": PROMPT, "n_new": a.n_new, "builds": {}}
    for build in a.builds.split(","):
        r = subprocess.run([sys.executable, "-m", MODULE, "--one", "--model", a.model, "--mtp",
                            a.mtp, "--plan", a.plan, "--ks", a.ks, "--n-new", str(a.n_new),
                            "--out", a.out],
                           capture_output=True, text=True, cwd=REPO,
                           env=dict(os.environ, MTPLIB_UPSTREAM=build))
        if r.returncode:
            log.error("the %s build's run failed:\n%s", build, r.stderr[-3000:])
            return 1
        out["builds"][build] = json.loads(r.stdout.strip().splitlines()[-1])
    toks = {b: v["tokens"] for b, v in out["builds"].items()}
    out["tokens_equal_across_builds"] = len({json.dumps(t) for t in toks.values()}) == 1
    out["ended"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    out["host"]["loadavg_end"] = os.getloadavg()
    Path(a.out).write_text(json.dumps(out, indent=1, sort_keys=True) + "\n")
    print(table(out))
    return 0


def table(out: dict) -> str:
    """The markdown table the README shows: bytes per step, by kind and class."""
    lines = ["| build | step (k) | steps | bytes/step | up | down | graph | whole graphs sent "
             "| control | inputs | seam | outputs | cache | contract min |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for build, res in out["builds"].items():
        for r in res["rows"]:
            def cls(name: str, c: dict = r["classes"]) -> str:
                d = c.get(name)
                return f"{sum(d.values()):,.0f}" if d else "0"
            kind = "plain" if r["label"] == "decode" else r["label"]
            lines.append(
                f"| {build} | {kind} ({r['k']}) | {r['steps']} | {r['bytes']:,.0f} | "
                f"{r['up']:,.0f} | {r['down']:,.0f} | {r['graph']:,.0f} | {r['graph_sends']} | "
                f"{r['control']:,.0f} | {cls('inputs')} | {cls('seam')} | {cls('outputs')} | "
                f"{cls('cache')} | {r['contract_min_per_step']:,.0f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
