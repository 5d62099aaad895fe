"""Ring vs star (patches/0007) with MTP on, through the CLI as a user runs it: tokens/s.

    nice -n 19 python -m mtplib.reports.upstream_patches.ring_tokens \
        evidence/upstream-patches/ring-tokens.json --plans "0-0,1-2,3-3;0-1,2-3"

Per plan and held-out prompt of the trained pair (64 tokens each): `mtplib generate --json`
in a fresh process per generation with the CLI's defaults (only the model, ``--plan``,
``--mtp``/``--draft``, ``--wan`` and ``--seam`` given; `mtplib.lab.wan.cold.seam_run`),
local shards behind the CLI's relays, every shard link at ``--rtt`` (the ring's peer links
pass the receiving shard's relay, so a shard-to-shard hop costs what a client hop costs):

- k = 2 with ``--seam star`` and with ``--seam ring``, in alternating order per prompt (even
  prompts star first), paired per prompt: ring tokens/s / star tokens/s;
- MTP off with ``--seam ring`` at RTT 0 (the tokens do not depend on the RTT:
  ring-waits.json), whose tokens both k = 2 runs must give.

The file is rewritten after every prompt (a run cut short keeps what it measured, with
``complete: false``); the provenance carries the load average at the start and the end.
``--table``: print the markdown table of an existing result (shard-to-shard.md's) instead.
"""

from __future__ import annotations

import json
import logging
import statistics

from mtplib import host, paths
from mtplib.lab.wan.cold import seam_run as run
from mtplib.lab.wan.inputs import trained_prompts
from mtplib.model.trained import trained_paths
from mtplib.reports import common
from mtplib.runtime import build_info
from mtplib.runtime.lib import upstream_info
from mtplib.runtime.rpc import client_proto_minor

MODULE = "mtplib.reports.upstream_patches.ring_tokens"
#: named, not __name__ (which is __main__ under python -m)
log = logging.getLogger(MODULE)


def summarize(rows: list[dict]) -> dict:
    ratio = [r["ring_over_star"] for r in rows]
    star = [r["star"]["decode_tok_s"] for r in rows]
    ring = [r["ring"]["decode_tok_s"] for r in rows]
    return {"n_prompts": len(rows),
            "ring_over_star_median": statistics.median(ratio),
            "ring_over_star_min": min(ratio), "ring_over_star_max": max(ratio),
            "ring_over_star_geomean": statistics.geometric_mean(ratio),
            "star_tok_s_median": statistics.median(star),
            "ring_tok_s_median": statistics.median(ring),
            "star_waits_per_verify": sorted({r["star"]["waits_per_step"].get("verify")
                                             for r in rows}),
            "ring_waits_per_verify": sorted({r["ring"]["waits_per_step"].get("verify")
                                             for r in rows}),
            "tokens_equal_mtp_off": all(r["tokens_equal"] for r in rows),
            "cache_bytes_crossing": sum(r[s]["cache_bytes_crossing"]
                                        for r in rows for s in ("star", "ring"))}


def table(doc: dict) -> str:
    """The markdown table of a result: per plan, medians and the paired ratio."""
    out = ["| plan | prompts | star k=2 tok/s, median | ring k=2 tok/s, median | ring / star, "
           "paired per prompt: median (range) | geometric mean | client waits per verify, "
           "star / ring | tokens = MTP off |", "|---|---|---|---|---|---|---|---|"]
    for s in doc["summary"]:
        waits = "/".join(f"{w:g}" for w in s["star_waits_per_verify"]) + " / " + "/".join(
            f"{w:g}" for w in s["ring_waits_per_verify"])
        out.append(f"| `{s['plan']}` | {s['n_prompts']} | {s['star_tok_s_median']:.2f} | "
                   f"{s['ring_tok_s_median']:.2f} | {s['ring_over_star_median']:.3f} "
                   f"({s['ring_over_star_min']:.3f}-{s['ring_over_star_max']:.3f}) | "
                   f"{s['ring_over_star_geomean']:.3f} | {waits} | "
                   f"{'yes' if s['tokens_equal_mtp_off'] else 'NO'} |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = common.parser(MODULE, __doc__)
    ap.add_argument("out", help="the result JSON (with --table: the one to print)")
    ap.add_argument("--table", action="store_true", help="print the table of OUT and stop")
    ap.add_argument("--plans", default="0-0,1-2,3-3", help="plans, ';'-separated")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--n", type=int, default=64)
    ap.add_argument("--k", type=int, default=2)
    ap.add_argument("--rtt", type=float, default=100.0)
    a = ap.parse_args(argv)
    common.setup_logging()
    if a.table:
        with open(a.out) as f:
            print(table(json.load(f)))
        return 0
    prov = host.provenance(paths.REPO, build_info(),
                           common.command(MODULE, argv))
    pair = trained_paths()
    trunk, sidecar = str(pair.trunk), str(pair.sidecar)
    prompts = trained_prompts(a.prompts, 64)
    info = upstream_info()
    doc = {"upstream": {k: info[k] for k in ("build", "patches", "llama_cpp_commit")},
           "rpc_protocol": f"7.{client_proto_minor()}", "rtt_ms": a.rtt, "k": a.k,
           "n_prompts": len(prompts), "prompt_tokens": 64, "n_new": a.n,
           "mode": "cold CLI, a fresh `mtplib generate --json` per generation, defaults",
           "rows": [], "summary": [], "complete": False}
    wan = f"{a.rtt:g}"
    for plan in a.plans.split(";"):
        rows: list[dict] = []
        doc["summary"].append({"plan": plan})
        for i, prompt in enumerate(prompts):
            off = run(trunk, sidecar, plan=plan, k=0, prompt=prompt, n=a.n, wan="0",
                      seam="ring")
            got = {}
            for seam in (("star", "ring") if i % 2 == 0 else ("ring", "star")):
                got[seam] = run(trunk, sidecar, plan=plan, k=a.k, prompt=prompt, n=a.n,
                                wan=wan, seam=seam)
            row = {"plan": plan, "prompt": i, "off_tokens": off["tokens"], "off_seam": off["seam"],
                   "star": got["star"], "ring": got["ring"],
                   "ring_over_star": got["ring"]["decode_tok_s"] / got["star"]["decode_tok_s"],
                   "tokens_equal": got["star"]["tokens"] == got["ring"]["tokens"]
                   == off["tokens"]}
            rows.append(row)
            doc["rows"].append(row)
            doc["summary"][-1] = {"plan": plan, **summarize(rows)}
            doc["provenance"] = host.finish(prov)
            with open(a.out, "w") as f:
                json.dump(doc, f, indent=1)
            log.info("%s %s star %.2f ring %.2f tok/s, x%.3f, tokens equal %s", plan, i,
                     got["star"]["decode_tok_s"], got["ring"]["decode_tok_s"],
                     row["ring_over_star"], row["tokens_equal"])
    doc["complete"] = True
    doc["provenance"] = host.finish(prov)
    with open(a.out, "w") as f:
        json.dump(doc, f, indent=1)
    print(json.dumps(doc["summary"], indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
