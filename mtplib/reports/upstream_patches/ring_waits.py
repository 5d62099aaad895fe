"""Star vs ring (patches/0007) over an emulated WAN: waits per plain token by time alone.

    python -m mtplib.reports.upstream_patches.ring_waits \
        evidence/upstream-patches/ring-waits.json
    python -m mtplib.reports.upstream_patches.ring_waits \
        --peer-rtt 10 evidence/upstream-patches/ring-waits-asymmetric.json

``--peer-rtt MS``: the asymmetric topology of issue 31, every client link (the relay in
front of each shard) at 100 ms and the ring's shard-to-shard links at MS (``--peer-wan``;
the star has none, it pays the client links once per shard); the 0 ms baseline has both
at 0. ``--plans`` picks the plans (default both).

The trained pair, MTP off, plans 0-1,2-3 and 0-0,1-2,3-3, 4 held-out prompts (32 tokens)
x 24 new tokens, one untimed warm-up per configuration. Every shard link (the relay in
front of each shard) at RTT 0 and 100 ms; a ring's peer link passes the relay of the
shard it pushes into, so a shard-to-shard hop costs the same one-way delay as a client
hop. "Waits by time" = (s per decoded token at 100 ms - at 0 ms) / 0.1 s; the relays'
wait counts (taken behind the 100 ms links) are beside it.
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path

from mtplib import host, paths
from mtplib.distributed.ranged_mtp import RangedMTP
from mtplib.lab.wan.inputs import trained_prompts
from mtplib.model.trained import trained_paths
from mtplib.reports import common
from mtplib.runtime import build_info
from mtplib.runtime.engine_options import EngineOptions
from mtplib.runtime.lib import upstream_info
from mtplib.runtime.rpc import client_proto_minor
from mtplib.runtime.settings import DecodeSettings

MODULE = "mtplib.reports.upstream_patches.ring_waits"
#: named, not __name__ (which is __main__ under python -m)
log = logging.getLogger(MODULE)
RTT_MS = 100
N_NEW = 24


def main(argv: list[str] | None = None) -> int:
    """Measure (module docstring) and write the result JSON."""
    ap = common.parser(MODULE, __doc__)
    ap.add_argument("out", help="the result JSON")
    ap.add_argument("--peer-rtt", type=float, default=None, metavar="MS",
                    help="the ring's peer links at this RTT (default: as the client links)")
    ap.add_argument("--plans", default="0-1,2-3;0-0,1-2,3-3", help="plans, ';'-separated")
    a = ap.parse_args(argv)
    common.setup_logging()
    plans = a.plans.split(";")
    prov = host.provenance(paths.REPO, build_info(), common.command(MODULE, argv))
    pair = trained_paths()
    prompts = trained_prompts(4, 32)
    opts = EngineOptions(k=0, settings=DecodeSettings(n_ctx=256, n_threads=1))
    rows = []
    for plan in plans:
        for seam in ("star", "ring"):
            row = {"plan": plan, "n_shards": plan.count(",") + 1, "seam": seam}
            for rtt in (0, RTT_MS):
                peer = None if a.peer_rtt is None or seam == "star" else (
                    f"{a.peer_rtt:g}" if rtt else "0")
                with RangedMTP(str(pair.trunk), plan=plan, seam=seam,
                               wan=str(rtt) if rtt else None, peer_wan=peer) as r:
                    r.generate(prompts[0], 4, opts)  # warm-up
                    s_per_tok, tokens, waits, links = [], [], [], None
                    for p in prompts:
                        toks, m = r.generate(p, N_NEW, opts)
                        s_per_tok.append(m.decode_s / max(1, m.n_generated - 1))
                        tokens.append(toks)
                        waits.append(m.waits_per_step.get("decode"))
                        links = [x["seam"] for x in m.seam["links"]]
                        peer_wan = m.seam["peer_wan"]
                row[f"s_per_token_{rtt}ms"] = sum(s_per_tok) / len(s_per_tok)
                row[f"relay_waits_per_plain_step_{rtt}ms"] = waits
                row[f"tokens_{rtt}ms"] = tokens
                row["links"] = links
                row[f"peer_wan_{rtt}ms"] = peer_wan
            row["waits_by_time"] = ((row[f"s_per_token_{RTT_MS}ms"] - row["s_per_token_0ms"])
                                    / (RTT_MS / 1000))
            row["tokens_equal_across_rtt"] = row["tokens_0ms"] == row[f"tokens_{RTT_MS}ms"]
            rows.append(row)
            log.info("%s %s %.2f waits by time %s %s", plan, seam, row["waits_by_time"],
                     row[f"relay_waits_per_plain_step_{RTT_MS}ms"], row["links"])
    for plan in plans:
        star, ring = (r for r in rows if r["plan"] == plan)
        ring["tokens_equal_star"] = ring["tokens_0ms"] == star["tokens_0ms"]
    info = upstream_info()
    rpc_lib = Path(info["lib_dir"]) / "libggml-rpc.so.0"
    out = {"upstream": {k: info[k] for k in ("build", "patches", "llama_cpp_commit")},
           # what the client speaks and the RPC library it loaded: the patch list above is the
           # installed build's marker, which a hand-installed libggml-rpc does not update
           "rpc_protocol": f"7.{client_proto_minor()}",
           "libggml_rpc_sha256": hashlib.sha256(rpc_lib.read_bytes()).hexdigest(),
           "rtt_ms": RTT_MS, "peer_rtt_ms": a.peer_rtt, "n_prompts": len(prompts),
           "prompt_tokens": 32, "n_new": N_NEW,
           "rows": rows, "provenance": host.finish(prov)}
    with open(a.out, "w") as f:
        json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
