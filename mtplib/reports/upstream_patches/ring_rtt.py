"""Ring vs star (patches/0007) against the RTT, through the CLI: tokens/s, MTP off and on.

The full run (136 CLI processes, about an hour on 2 cores, most of it emulated WAN waits
and process start-up; run it on a quiet host, it is timed):

    nice -n 19 python -m mtplib.reports.upstream_patches.ring_rtt \\
        evidence/upstream-patches/ring-rtt.json
    python -m mtplib.reports.upstream_patches.ring_rtt --table \\
        evidence/upstream-patches/ring-rtt.json

Smoke test (1 prompt, 8 tokens, one RTT, 2 shards: 5 CLI processes, about a minute):

    nice -n 19 python -m mtplib.reports.upstream_patches.ring_rtt \\
        /tmp/ring-rtt-smoke.json --plans 0-1,2-3 --rtts 25 --prompts 1 --n 8

Issue 31 item 4 ("tokens/s against RTT"). Per plan (default 0-1,2-3 and 0-0,1-2,3-3), RTT
(default 25, 50, 100, 200 ms, every shard link, the ring's peer links through the relay of
the shard pushed into, so a shard-to-shard hop costs a client hop) and held-out prompt of
the trained pair (default 4, 64 tokens each, 64 new tokens): `mtplib generate --json` in a
fresh process per generation with the CLI's defaults (`mtplib.lab.wan.cold.seam_run`, as
ring_tokens.py runs it), for each k (default 0 = MTP off, and 2) with ``--seam star`` and
``--seam ring`` in alternating order per prompt (even prompts star first). Each plan and
prompt's MTP-off run at RTT 0 (``--seam ring``) gives the tokens every run must match.

Rows: one per generation (tokens/s, TTFT, waits per step, what the prefill waited on, the
seam that ran); summary: per plan, RTT and k, the medians and the ring / star ratio paired
per prompt. The file is rewritten after every prompt (``complete: false`` until the end);
the provenance carries the load average at the start and the end.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
from pathlib import Path

from mtplib import host, paths
from mtplib.lab.wan.cold import seam_run
from mtplib.lab.wan.inputs import trained_prompts
from mtplib.model.trained import trained_paths
from mtplib.reports import common
from mtplib.runtime import build_info
from mtplib.runtime.lib import upstream_info
from mtplib.runtime.rpc import client_proto_minor

MODULE = "mtplib.reports.upstream_patches.ring_rtt"
#: named, not __name__ (which is __main__ under python -m)
log = logging.getLogger(MODULE)

PROMPT_TOKENS = 64
#: what a row keeps of `seam_run`'s result (its tokens are checked, not kept)
KEEP = ("decode_tok_s", "ttft_s", "tokens_per_step", "acceptance_rate", "waits_per_step",
        "prefill_waits_by_command", "seam", "cache_bytes_crossing", "process_wall_s")


def summarize(rows: list[dict]) -> list[dict]:
    """Per plan, RTT and k: median tokens/s and TTFT of each seam, ring / star paired per
    prompt, waits per step, and whether every run gave its prompt's MTP-off tokens."""
    out = []
    keys = sorted({(r["plan"], r["rtt_ms"], r["k"]) for r in rows},
                  key=lambda x: (x[0].count(","), x[0], x[1], x[2]))
    for plan, rtt, k in keys:
        got = [r for r in rows if (r["plan"], r["rtt_ms"], r["k"]) == (plan, rtt, k)]
        by = {s: {r["prompt"]: r for r in got if r["seam_asked"] == s} for s in ("star", "ring")}
        pairs = sorted(set(by["star"]) & set(by["ring"]))
        ratio = [by["ring"][p]["decode_tok_s"] / by["star"][p]["decode_tok_s"] for p in pairs]
        cell = {"plan": plan, "n_shards": plan.count(",") + 1, "rtt_ms": rtt, "k": k,
                "n_prompts": len(pairs),
                "tokens_equal_mtp_off": all(r["tokens_equal_mtp_off"] for r in got),
                "cache_bytes_crossing": sum(r["cache_bytes_crossing"] for r in got)}
        for s in ("star", "ring"):
            rs = list(by[s].values())
            cell[f"{s}_tok_s_median"] = statistics.median(r["decode_tok_s"] for r in rs)
            cell[f"{s}_ttft_s_median"] = statistics.median(r["ttft_s"] for r in rs)
            cell[f"{s}_waits_per_step"] = sorted(
                {f"{lb} {w:g}" for r in rs for lb, w in r["waits_per_step"].items() if w})
        if ratio:
            cell |= {"ring_over_star_median": statistics.median(ratio),
                     "ring_over_star_min": min(ratio), "ring_over_star_max": max(ratio)}
        out.append(cell)
    return out


def table(doc: dict) -> str:
    """The markdown table of a result: per plan, RTT and k."""
    out = ["| plan | RTT ms | k | prompts | star tok/s, median | ring tok/s, median | ring / "
           "star, paired: median (range) | TTFT s, star / ring | tokens = MTP off |",
           "|---|---|---|---|---|---|---|---|---|"]
    for s in doc["summary"]:
        rng = (f"{s['ring_over_star_median']:.3f} ({s['ring_over_star_min']:.3f}-"
               f"{s['ring_over_star_max']:.3f})" if "ring_over_star_median" in s else "-")
        out.append(f"| `{s['plan']}` | {s['rtt_ms']:g} | {s['k']} | {s['n_prompts']} | "
                   f"{s['star_tok_s_median']:.2f} | {s['ring_tok_s_median']:.2f} | {rng} | "
                   f"{s['star_ttft_s_median']:.2f} / {s['ring_ttft_s_median']:.2f} | "
                   f"{'yes' if s['tokens_equal_mtp_off'] else 'NO'} |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = common.parser(MODULE, __doc__,
                                 epilog="\n\n".join(__doc__.split("\n\n")[1:5]),
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", help="the result JSON (with --table: the one to print)")
    ap.add_argument("--table", action="store_true", help="print the table of OUT and stop")
    ap.add_argument("--plans", default="0-1,2-3;0-0,1-2,3-3", help="plans, ';'-separated")
    ap.add_argument("--rtts", default="25,50,100,200", help="RTTs in ms, ','-separated")
    ap.add_argument("--ks", default="0,2", help="draft lengths, ','-separated (0: MTP off)")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--n", type=int, default=64, help="new tokens per generation")
    a = ap.parse_args(argv)
    common.setup_logging()
    if a.table:
        print(table(json.loads(Path(a.out).read_text())))
        return 0
    try:
        rtts = [float(x) for x in a.rtts.split(",")]
        ks = [int(x) for x in a.ks.split(",")]
    except ValueError as e:
        ap.error(f"--rtts and --ks take numbers: {e}")
    if a.prompts < 1 or a.n < 1 or any(r <= 0 for r in rtts) or any(k < 0 for k in ks):
        ap.error("--prompts and --n must be >= 1, --rtts > 0, --ks >= 0")
    prov = host.provenance(paths.REPO, build_info(),
                           common.command(MODULE, argv))
    pair = trained_paths()
    trunk, sidecar = str(pair.trunk), str(pair.sidecar)
    prompts = trained_prompts(a.prompts, PROMPT_TOKENS)
    info = upstream_info()
    doc = {"upstream": {k: info[k] for k in ("build", "patches", "llama_cpp_commit")},
           "rpc_protocol": f"7.{client_proto_minor()}", "rtts_ms": rtts, "ks": ks,
           "n_prompts": len(prompts), "prompt_tokens": PROMPT_TOKENS, "n_new": a.n,
           "mode": "cold CLI, a fresh `mtplib generate --json` per generation, defaults",
           "rows": [], "summary": [], "complete": False}
    for plan in a.plans.split(";"):
        for i, prompt in enumerate(prompts):
            off = seam_run(trunk, sidecar, plan=plan, k=0, prompt=prompt, n=a.n, wan="0",
                           seam="ring")["tokens"]
            for rtt in rtts:
                for k in ks:
                    for seam in (("star", "ring") if i % 2 == 0 else ("ring", "star")):
                        got = seam_run(trunk, sidecar, plan=plan, k=k, prompt=prompt, n=a.n,
                                       wan=f"{rtt:g}", seam=seam)
                        doc["rows"].append({
                            "plan": plan, "n_shards": plan.count(",") + 1, "rtt_ms": rtt,
                            "k": k, "seam_asked": seam, "prompt": i,
                            "tokens_equal_mtp_off": got["tokens"] == off,
                            **{key: got[key] for key in KEEP}})
                        log.info("%s %s %g ms k=%s %s: %.2f tok/s, ttft %.2f s, tokens "
                                 "equal %s", plan, i, rtt, k, seam, got["decode_tok_s"],
                                 got["ttft_s"], got["tokens"] == off)
            doc["summary"] = summarize(doc["rows"])
            doc["provenance"] = host.finish(prov)
            Path(a.out).write_text(json.dumps(doc, indent=1) + "\n")
    doc["complete"] = True
    doc["provenance"] = host.finish(prov)
    Path(a.out).write_text(json.dumps(doc, indent=1) + "\n")
    print(table(doc))
    return 0 if all(s["tokens_equal_mtp_off"] for s in doc["summary"]) else 1


if __name__ == "__main__":
    raise SystemExit(main())
