"""Star vs ring (patches/0007) per step kind and per link, by counting: waits and bytes.

    nice -n 19 python -m mtplib.reports.upstream_patches.ring_kinds \\
        evidence/upstream-patches/ring-kinds.json
    python -m mtplib.reports.upstream_patches.ring_kinds --table \\
        evidence/upstream-patches/ring-kinds.json

Issue 31 item 4. The trained pair, plans 0-1,2-3 and 0-0,1-2,3-3, seam star and ring; per
plan, seam and draft length k = 0 (plain decode) and 1, 2, 3 (verify) one `RangedMTP` (a
fresh client worker process, as a fresh `mtplib generate` has, and local shards), loaded
with that k: 4 held-out prompts (32 tokens) x 32 new tokens each, the MTP block and (for
k > 0) the output head in the client. Step
kinds are the relays' labels (`mtplib.contract.labels.StepKind`, as
mtplib.reports.graph_reuse.bytes_table reads them): ``prefill``, ``decode`` (a plain step),
``verify``, ``draft``, ``feed``. Per kind and per link (each client link, client <-> shard
i, and each peer link, shard i-1 -> shard i, counted at shard i's relay): client waits per
step (by the command that opened each round trip) and bytes per step by class and
direction: ``graph`` (graph descriptions), ``control`` (headers, descriptors, replies),
and the data classes of `mtplib.contract.wire` (``inputs``, ``seam``, ``outputs``,
``constants``, ``cache``). Direction ``up`` is into the link's shard (client -> shard; on a
peer link the pushing shard -> the shard pushed into), ``down`` out of it.

Counting only, no timing: every link at ``--rtt`` (40 ms) after loading so that a
pipelined request rides in its predecessor's round trip (over bare loopback a reply can
overtake it and the relay counts it again, `mtplib.distributed.relay`); the ring's peer
links pass the receiving shard's relay at the same RTT. Before the measured generations of
each k, one generation of the first prompt with 2 new tokens: its prefill is the first of a
32-token width in that client process (the engine's warm-up at load prefills 8 tokens),
kept as ``first_prefill``; after them, one generation of the first prompt cut to 24
tokens, a width not seen before (``new_width_prefill``). Every measured generation's tokens are
checked against the whole model's with MTP off.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
from pathlib import Path

from mtplib.reports import common

MODULE = "mtplib.reports.upstream_patches.ring_kinds"
#: named, not __name__ (which is __main__ under python -m)
log = logging.getLogger(MODULE)

RTT_MS = 40
N_PROMPTS, PROMPT_TOKENS, N_NEW = 4, 32, 32
KS = (0, 1, 2, 3)
PLANS = ("0-1,2-3", "0-0,1-2,3-3")
SEAMS = ("star", "ring")
#: labels that are not a generation's steps
NOT_STEPS = ("load", "setup", "other")
NEW_WIDTH = 24
#: a link's identity (not summed over generations)
ID_KEYS = ("link", "shard", "from_shard", "to_shard")


def _link_counts(relays, label: str) -> list[dict]:
    """One generation's counts under ``label`` on every link: the client links in plan
    order, then the peer links (into shard 1, 2, ...): waits (total and by command), and
    bytes by class and direction."""
    from mtplib.contract.wire import classify_by_direction

    out = []
    for peer in (False, True):
        classes = classify_by_direction(relays.peer_by_tensor_dir(label) if peer
                                        else relays.by_tensor_dir(label))
        cmds = relays.waits_by_command(label, peer=peer)
        for i, r in enumerate(relays.relays):
            if peer and i == 0:
                continue  # the head shard has no peer link into it
            snap = (r.peer_snapshot() if peer else r.snapshot()).get(label)
            c = snap or {"up": 0, "down": 0, "waits": 0, "graph": 0, "unparsed": 0}
            by = {cls: {("up" if way == "peer" else way): n for way, n in ways.items()}
                  for cls, ways in classes[i].items()}
            data = {w: sum(ways.get(w, 0) for ways in by.values()) for w in ("up", "down")}
            # graph descriptions go up only; what is neither data nor graph is control
            by["graph"] = {"up": c["graph"]}
            by["control"] = {"up": c["up"] - data["up"] - c["graph"],
                             "down": c["down"] - data["down"] - c["unparsed"]}
            if c["unparsed"]:
                by["unparsed"] = {"down": c["unparsed"]}
            out.append({"link": "peer" if peer else "client",
                        **({"from_shard": i - 1, "to_shard": i} if peer else {"shard": i}),
                        "waits": c["waits"], "waits_by_command": cmds[i],
                        "up": c["up"], "down": c["down"], "classes": by})
    return out


def _add(total: dict, more: dict) -> dict:
    """Numbers of ``more`` added into ``total`` (nested dicts alike)."""
    for k, v in more.items():
        if k in ID_KEYS:
            total.setdefault(k, v)
        elif isinstance(v, dict):
            _add(total.setdefault(k, {}), v)
        elif isinstance(v, (int, float)) and not isinstance(v, bool):
            total[k] = total.get(k, 0) + v
        else:
            total.setdefault(k, v)
    return total


def _per_step(d: dict, steps: int) -> dict:
    return {k: (_per_step(v, steps) if isinstance(v, dict) else
                v / steps if isinstance(v, (int, float)) and not isinstance(v, bool) else v)
            for k, v in d.items()}


def _generation(r, prompt: list[int], n: int, opts) -> tuple[list[int], dict]:
    """One generation: its tokens and, per step label, steps, tokens and link counts."""
    toks, m = r.generate(prompt, n, opts)
    steps = {}
    for label, row in m.seam_report["steps"].items():
        if label in NOT_STEPS or not row["steps"]:
            continue
        steps[label] = {"steps": row["steps"], "tokens": row["tokens"],
                        "links": _link_counts(r.rt.relays, label),
                        "cache_bytes": row["classes"]["cache"]}
    return toks, {"steps": steps, "head": m.head, "seam": m.seam}


def _row(plan: str, seam: str, k: int, label: str, agg: dict) -> dict:
    """A step kind's figures per step, summed over the measured generations."""
    s = agg["steps"]
    links = [_per_step({kk: v for kk, v in ln.items() if kk not in ID_KEYS}, s)
             | {kk: ln[kk] for kk in ID_KEYS if kk in ln} for ln in agg["links"]]
    client = [ln for ln in links if ln["link"] == "client"]
    peer = [ln for ln in links if ln["link"] == "peer"]
    tot = {}
    for ln in client:
        _add(tot, ln["classes"])
    ptot = {}
    for ln in peer:
        _add(ptot, ln["classes"])
    waits_cmd: dict = {}
    for ln in client:
        _add(waits_cmd, ln["waits_by_command"])
    return {"plan": plan, "n_shards": plan.count(",") + 1, "seam": seam, "k": k,
            "label": label, "kind": "plain" if label == "decode" else label,
            "steps": s, "tokens": agg["tokens"],
            "client_waits_per_step": sum(ln["waits"] for ln in client),
            "client_waits_per_step_by_link": [ln["waits"] for ln in client],
            "client_waits_per_step_by_command": waits_cmd,
            "peer_waits_per_step": sum(ln["waits"] for ln in peer),
            "client_bytes_per_step": {"up": sum(ln["up"] for ln in client),
                                      "down": sum(ln["down"] for ln in client)},
            "client_classes_per_step": tot,
            # the same, both directions together (what the table shows)
            "client_class_bytes_per_step": {c: sum(w.values()) for c, w in tot.items()},
            "peer_bytes_per_step": sum(ln["up"] + ln["down"] for ln in peer),
            "peer_classes_per_step": ptot,
            "peer_class_bytes_per_step": {c: sum(w.values()) for c, w in ptot.items()},
            "cache_bytes": agg["cache_bytes"], "links": links}


def _prefill(plan: str, seam: str, k: int, what: str, n_prompt: int, gen: dict) -> dict:
    """A probe generation's prefill: its client waits, by link and by command."""
    row = gen["steps"]["prefill"]
    client = [ln for ln in row["links"] if ln["link"] == "client"]
    cmds: dict = {}
    for ln in client:
        _add(cmds, ln["waits_by_command"])
    return {"plan": plan, "n_shards": plan.count(",") + 1, "seam": seam, "k": k,
            "probe": what, "prompt_tokens": n_prompt, "steps": row["steps"],
            "client_waits": sum(ln["waits"] for ln in client),
            "client_waits_by_link": [ln["waits"] for ln in client],
            "client_waits_by_command": dict(sorted(cmds.items())),
            "client_waits_by_link_and_command": [ln["waits_by_command"] for ln in client]}


def measure(rtt_ms: float) -> dict:
    """Every plan, seam and k (module docstring); the result document without provenance."""
    from mtplib.distributed.ranged_mtp import RangedMTP
    from mtplib.distributed.relay import WanLink
    from mtplib.lab.wan.inputs import trained_prompts
    from mtplib.model.trained import trained_paths
    from mtplib.runtime.engine_options import EngineOptions
    from mtplib.runtime.settings import DecodeSettings
    from mtplib.runtime.speculative import MTPRuntime

    pair = trained_paths()
    prompts = trained_prompts(N_PROMPTS, PROMPT_TOKENS)
    settings = DecodeSettings(n_ctx=256, n_threads=1)

    def opts(k: int) -> EngineOptions:
        # the CLI's default head for each (`resolve_head`), fixed: no measured choice
        return EngineOptions(k=k, settings=settings, head="client" if k else "upstream")

    with MTPRuntime(str(pair.trunk), None, opts=opts(0)) as whole:
        mtp_off = [whole.generate(p, N_NEW)[0] for p in prompts]
    rows, probes, checks, seams = [], [], [], []
    for plan in PLANS:
        for seam in SEAMS:
            for k in KS:
                with RangedMTP(str(pair.trunk), plan=plan, sidecar=str(pair.sidecar),
                               seam=seam, mtp_placement="client", opts=opts(k)) as r:
                    for relay in r.rt.relays.relays:
                        relay.set_link(WanLink(rtt_ms))
                    _, first = _generation(r, prompts[0], 2, opts(k))
                    probes.append(_prefill(plan, seam, k, "first_prefill", PROMPT_TOKENS,
                                           first))
                    agg: dict = {}
                    for i, p in enumerate(prompts):
                        toks, gen = _generation(r, p, N_NEW, opts(k))
                        checks.append({"plan": plan, "seam": seam, "k": k, "prompt": i,
                                       "tokens_equal_mtp_off": toks == mtp_off[i]})
                        for label, st in gen["steps"].items():
                            a = agg.setdefault(label, {"steps": 0, "tokens": 0,
                                                       "cache_bytes": 0, "links": None})
                            a["steps"] += st["steps"]
                            a["tokens"] += st["tokens"]
                            a["cache_bytes"] += st["cache_bytes"]
                            a["links"] = ([_add(x, y) for x, y in zip(a["links"], st["links"],
                                                                       strict=True)]
                                          if a["links"] else [dict(x) for x in st["links"]])
                    rows += [_row(plan, seam, k, label, a) for label, a in sorted(agg.items())]
                    _, later = _generation(r, prompts[0][:NEW_WIDTH], 2, opts(k))
                    probes.append(_prefill(plan, seam, k, "new_width_prefill", NEW_WIDTH,
                                           later))
                    seams.append({"plan": plan, "seam_asked": seam, "k": k,
                                  "head": gen["head"], "seam": gen["seam"]})
                    log.info("%s %s k=%s %s first prefill %s", plan, seam, k,
                             {x["label"]: x["client_waits_per_step"]
                              for x in rows[-len(agg):]},
                             probes[-2]["client_waits_by_command"])
    return {"rtt_ms": rtt_ms, "n_prompts": N_PROMPTS, "prompt_tokens": PROMPT_TOKENS,
            "n_new": N_NEW, "ks": list(KS), "plans": list(PLANS), "mtp_placement": "client",
            "rows": rows, "prefill_probes": probes, "tokens": checks, "seams": seams,
            "tokens_equal_mtp_off": all(c["tokens_equal_mtp_off"] for c in checks),
            "cache_bytes": sum(x["cache_bytes"] for x in rows)}


def _num(v: float) -> str:
    """A count per step as the docs print one: whole, comma-grouped (4,096); a mean that is
    not whole with one decimal and no grouping (13322.3), so that either reads back as a
    value of the JSON (tests/test_doc_figures.py)."""
    return f"{v:,.0f}" if v == int(v) else f"{v:.1f}"


def _bytes(c: dict, cls: str) -> str:
    return _num(c.get(cls, 0))


def table(doc: dict) -> str:
    """The markdown table shard-to-shard.md shows: per plan, step kind and seam, client
    waits per step (per client link) and bytes per step by class (client links; the peer
    links' seam apart)."""
    out = ["| plan | step (k) | seam | client waits / step (per link) | graph | inputs "
           "| seam, client links | seam, peer links | outputs | control | client up / down "
           "| steps |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    order = {"plain": 0, "verify": 1, "prefill": 2}
    # plain steps of MTP off, verify steps of k = 1..3, every k's prefill
    # plain steps of MTP off, verify steps of k = 1..3, the prefill of k = 0 and 2 (those
    # of k = 1 and 3 differ from k = 2's in their inputs only: the JSON has them)
    rows = [r for r in doc["rows"] if (r["kind"], r["k"]) in
            {("plain", 0), ("verify", 1), ("verify", 2), ("verify", 3), ("prefill", 0),
             ("prefill", 2)}]
    rows.sort(key=lambda r: (r["n_shards"], order[r["kind"]], r["k"], r["seam"] != "star"))
    for r in rows:
        c, p = r["client_class_bytes_per_step"], r["peer_class_bytes_per_step"]
        per = "/".join(f"{w:g}" for w in r["client_waits_per_step_by_link"])
        out.append(
            f"| `{r['plan']}` | {r['kind']} ({r['k']}) | {r['seam']} | "
            f"{r['client_waits_per_step']:g} ({per}) | {_bytes(c, 'graph')} | "
            f"{_bytes(c, 'inputs')} | {_bytes(c, 'seam')} | {_bytes(p, 'seam')} | "
            f"{_bytes(c, 'outputs')} | {_bytes(c, 'control')} | "
            f"{_num(r['client_bytes_per_step']['up'])} / "
            f"{_num(r['client_bytes_per_step']['down'])} | {r['steps']} |")
    return "\n".join(out)


def probe_table(doc: dict) -> str:
    """The prefill probes: client waits of a prefill of a width the process has not run
    before (per client link, and by command), against the measured prefills' (a width run
    before)."""
    out = [f"| plan | seam | k | first {PROMPT_TOKENS}-token prefill: client waits (per link) "
           f"| by command | then a {NEW_WIDTH}-token prefill | the measured {PROMPT_TOKENS}-"
           "token prefills, per step |", "|---|---|---|---|---|---|---|"]
    for p in doc["prefill_probes"]:
        if p["probe"] != "first_prefill":
            continue
        key = (p["plan"], p["seam"], p["k"])
        new = next(q for q in doc["prefill_probes"] if q["probe"] == "new_width_prefill"
                   and (q["plan"], q["seam"], q["k"]) == key)
        warm = next(r for r in doc["rows"] if r["label"] == "prefill"
                    and (r["plan"], r["seam"], r["k"]) == key)
        per = "/".join(str(w) for w in p["client_waits_by_link"])
        cmds = ", ".join(f"{c} {n}" for c, n in p["client_waits_by_command"].items())
        out.append(f"| `{p['plan']}` | {p['seam']} | {p['k']} | {p['client_waits']} ({per}) "
                   f"| {cmds} | {new['client_waits']} | "
                   f"{warm['client_waits_per_step']:g} |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = common.parser(MODULE, __doc__,
                                 epilog=__doc__.split("\n\n")[1],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", help="the result JSON (with --table: the one to print)")
    ap.add_argument("--table", action="store_true", help="print the tables of OUT and stop")
    ap.add_argument("--rtt", type=float, default=RTT_MS,
                    help=f"every link's RTT in ms while counting (default {RTT_MS})")
    a = ap.parse_args(argv)
    common.setup_logging()
    if a.table:
        doc = json.loads(Path(a.out).read_text())
        print(table(doc) + "\n\n" + probe_table(doc))
        return 0
    from mtplib import host, paths
    from mtplib.runtime import build_info
    from mtplib.runtime.lib import upstream_info
    from mtplib.runtime.rpc import client_proto_minor

    prov = host.provenance(paths.REPO, build_info(),
                           common.command(MODULE, argv))
    doc = measure(a.rtt)
    info = upstream_info()
    rpc_lib = Path(info["lib_dir"]) / "libggml-rpc.so.0"
    out = {"upstream": {k: info[k] for k in ("build", "patches", "llama_cpp_commit")},
           "rpc_protocol": f"7.{client_proto_minor()}",
           "libggml_rpc_sha256": hashlib.sha256(rpc_lib.read_bytes()).hexdigest(),
           **doc, "provenance": host.finish(prov)}
    Path(a.out).write_text(json.dumps(out, indent=1) + "\n")
    print(table(out) + "\n\n" + probe_table(out))
    return 0 if out["tokens_equal_mtp_off"] and not out["cache_bytes"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
