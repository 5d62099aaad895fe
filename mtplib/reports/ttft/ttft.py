"""Time to first token of a cold `mtplib generate` over a WAN: allocation-size queries
answered by the client's relays vs sent to the shards.

    nice -n 19 python -m mtplib.reports.ttft.ttft evidence/ttft/ttft.json

Upstream's RPC client asks a shard, one blocking round trip each, the allocation size of
every tensor shape it has not seen in its process; a fresh `mtplib generate` pays that for
its prompt's width inside the prefill (22-31 round trips on the trained pair). Since
session 13 the relay in front of a shard that reported serving its CPU answers them itself
(`mtplib.distributed.relay._AllocSizeAnswers`); ``MTPLIB_FORWARD_ALLOC_SIZES=1`` sends them
to the shards as before.

Per plan, draft length and held-out prompt of the trained pair (64 tokens): `mtplib generate
--json` in a fresh process with the CLI's defaults (only the model, ``--plan``,
``--endpoints``, ``--mtp``/``--draft``, ``--n`` and ``--wan`` given), external `mtplib
shard serve` processes on this host (started once per plan, as a user tries it first),
every shard link at ``--rtt``; once with the queries forwarded and once answered, in
alternating order per prompt (even prompts forwarded first), paired per prompt. The file is
rewritten after every prompt (``complete: false`` until the end); ``--table`` prints the
markdown table of an existing result.
"""

from __future__ import annotations

import json
import logging
import os
import statistics

from mtplib import host, paths
from mtplib.distributed.processes import LocalShards
from mtplib.distributed.shard_report import FORWARD_ALLOC_SIZES_ENV
from mtplib.errors import InputError
from mtplib.lab.wan.cold import cli_generate, run_cli_json
from mtplib.lab.wan.inputs import trained_prompts
from mtplib.model.trained import trained_paths
from mtplib.reports import common
from mtplib.runtime import build_info
from mtplib.runtime.lib import upstream_info

MODULE = "mtplib.reports.ttft.ttft"
#: named, not __name__ (which is __main__ under python -m)
log = logging.getLogger(MODULE)

SETTINGS = ("forwarded", "answered")


def one(cmd: list[str], setting: str) -> dict:
    env = dict(os.environ)
    env.pop(FORWARD_ALLOC_SIZES_ENV, None)
    if setting == "forwarded":
        env[FORWARD_ALLOC_SIZES_ENV] = "1"
    rc, out, wall = run_cli_json(cmd, env=env)
    if "error" in out or rc != 0:
        raise InputError(f"{' '.join(cmd[:6])} ... ({setting}) failed (exit {rc}): "
                         f"{out.get('error')}")
    m = out["metrics"]
    prefill = m.get("seam_report", {}).get("steps", {}).get("prefill", {})
    return {"ttft_s": m["ttft_s"], "decode_tok_s": m.get("decode_tok_s"),
            "tokens": out["tokens"], "process_wall_s": wall,
            "prefill_waits": prefill.get("waits"),
            "prefill_waits_by_command": prefill.get("waits_by_command"),
            "prefill_answered_here": prefill.get("alloc_sizes_answered_here"),
            "cache_bytes_crossing": m.get("cache_bytes_crossing")}


def summarize(rows: list[dict]) -> dict:
    def col(s: str, key: str) -> list[float]:
        return [r[s][key] for r in rows]

    ratio = [r["answered"]["ttft_s"] / r["forwarded"]["ttft_s"] for r in rows]
    saved = [r["forwarded"]["ttft_s"] - r["answered"]["ttft_s"] for r in rows]
    out: dict = {"n_prompts": len(rows)}
    for s in SETTINGS:
        t = col(s, "ttft_s")
        out[s] = {"ttft_s_median": statistics.median(t), "ttft_s_min": min(t),
                  "ttft_s_max": max(t),
                  "prefill_waits": sorted(set(col(s, "prefill_waits"))),
                  "prefill_alloc_size_waits": sorted(
                      {(r[s]["prefill_waits_by_command"] or {}).get("GET_ALLOC_SIZE", 0)
                       for r in rows}),
                  "prefill_answered_here": sorted(set(col(s, "prefill_answered_here"))),
                  "decode_tok_s_median": statistics.median(col(s, "decode_tok_s")),
                  # the whole command: load, warm-up (its queries too), prefill, decode
                  "process_wall_s_median": statistics.median(col(s, "process_wall_s"))}
    out.update({"answered_over_forwarded_median": statistics.median(ratio),
                "answered_over_forwarded_min": min(ratio),
                "answered_over_forwarded_max": max(ratio),
                "saved_s_median": statistics.median(saved),
                "tokens_equal": all(r["tokens_equal"] for r in rows),
                "cache_bytes_crossing": sum(r[s]["cache_bytes_crossing"] or 0
                                            for r in rows for s in SETTINGS)})
    return out


def table(doc: dict) -> str:
    """The markdown table of a result: per plan and k, TTFT medians and the paired ratio."""
    def waits(v: list) -> str:
        return "/".join(f"{w:g}" for w in v)

    out = ["| plan | k | prompts | TTFT, queries forwarded: median (range) | TTFT, answered "
           "here | answered / forwarded, paired: median (range) | saved, median | prefill "
           "waits (GET_ALLOC_SIZE), forwarded / answered | queries answered here | whole "
           "command, median: forwarded / answered | tokens equal |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]
    for s in doc["summary"]:
        f, a = s["forwarded"], s["answered"]
        out.append(
            f"| `{s['plan']}` | {s['k']} | {s['n_prompts']} | {f['ttft_s_median']:.3f} s "
            f"({f['ttft_s_min']:.3f}-{f['ttft_s_max']:.3f}) | {a['ttft_s_median']:.3f} s "
            f"({a['ttft_s_min']:.3f}-{a['ttft_s_max']:.3f}) | "
            f"{s['answered_over_forwarded_median']:.3f} "
            f"({s['answered_over_forwarded_min']:.3f}-{s['answered_over_forwarded_max']:.3f})"
            f" | {s['saved_s_median']:.3f} s | {waits(f['prefill_waits'])} "
            f"({waits(f['prefill_alloc_size_waits'])}) / {waits(a['prefill_waits'])} "
            f"({waits(a['prefill_alloc_size_waits'])}) | "
            f"{waits(a['prefill_answered_here'])} | "
            f"{f['process_wall_s_median']:.2f} s / {a['process_wall_s_median']:.2f} s | "
            f"{'yes' if s['tokens_equal'] else 'NO'} |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = common.parser(MODULE, __doc__)
    ap.add_argument("out", help="the result JSON (with --table or --resummarize: the one read)")
    ap.add_argument("--table", action="store_true", help="print the table of OUT and stop")
    ap.add_argument("--resummarize", action="store_true",
                    help="rewrite OUT's summary from its rows (after a change to `summarize`; "
                    "the rows are kept as measured) and stop")
    ap.add_argument("--plans", default="0-1,2-3;0-0,1-2,3-3", help="plans, ';'-separated")
    ap.add_argument("--ks", default="0,2", help="draft lengths, ','-separated")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--n", type=int, default=16, help="new tokens per generation")
    ap.add_argument("--rtt", type=float, default=100.0)
    a = ap.parse_args(argv)
    common.setup_logging()
    if a.table:
        with open(a.out) as f:
            print(table(json.load(f)))
        return 0
    if a.resummarize:
        with open(a.out) as f:
            doc = json.load(f)
        cells = dict.fromkeys((r["plan"], r["k"]) for r in doc["rows"])
        doc["summary"] = [{"plan": p, "k": k, **summarize(
            [r for r in doc["rows"] if (r["plan"], r["k"]) == (p, k)])} for p, k in cells]
        with open(a.out, "w") as f:
            json.dump(doc, f, indent=1)
        print(table(doc))
        return 0
    prov = host.provenance(paths.REPO, build_info(), common.command(MODULE, argv))
    pair = trained_paths()
    trunk, sidecar = str(pair.trunk), str(pair.sidecar)
    prompts = trained_prompts(a.prompts, 64)
    info = upstream_info()
    ks = [int(k) for k in a.ks.split(",")]
    doc = {"upstream": {k: info[k] for k in ("build", "patches", "llama_cpp_commit")},
           "rtt_ms": a.rtt, "ks": ks, "n_prompts": len(prompts), "prompt_tokens": 64,
           "n_new": a.n, "mode": "cold CLI, a fresh `mtplib generate --json` per generation, "
           "defaults, external `mtplib shard serve` processes on this host",
           "rows": [], "summary": [], "complete": False}
    for plan in a.plans.split(";"):
        n_shards = len(plan.split(","))
        with LocalShards(n_shards) as shards:
            for k in ks:
                rows: list[dict] = []
                doc["summary"].append({"plan": plan, "k": k})
                for i, prompt in enumerate(prompts):
                    cmd = cli_generate(trunk, sidecar if k else None, plan=plan, k=k,
                                       tokens=prompt, n_new=a.n, wan=f"{a.rtt:g}",
                                       endpoints=shards.endpoints)
                    got = {s: one(cmd, s) for s in (SETTINGS if i % 2 == 0
                                                    else SETTINGS[::-1])}
                    row = {"plan": plan, "k": k, "prompt": i, **got,
                           "tokens_equal": got["forwarded"]["tokens"]
                           == got["answered"]["tokens"]}
                    rows.append(row)
                    doc["rows"].append(row)
                    doc["summary"][-1] = {"plan": plan, "k": k, **summarize(rows)}
                    doc["provenance"] = host.finish(prov)
                    with open(a.out, "w") as f:
                        json.dump(doc, f, indent=1)
                    log.info("%s %s %s TTFT forwarded %.3f s, answered %.3f s, tokens "
                             "equal %s", plan, k, i, got["forwarded"]["ttft_s"],
                             got["answered"]["ttft_s"], row["tokens_equal"])
    doc["complete"] = True
    doc["provenance"] = host.finish(prov)
    with open(a.out, "w") as f:
        json.dump(doc, f, indent=1)
    print(table(doc))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
