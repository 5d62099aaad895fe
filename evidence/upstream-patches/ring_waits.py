"""Star vs ring (patches/0007) over an emulated WAN: waits per plain token by time alone.

    PYTHONPATH=$PWD .venv/bin/python evidence/upstream-patches/ring_waits.py \
        evidence/upstream-patches/ring-waits.json

The trained pair, MTP off, plans 0-1,2-3 and 0-0,1-2,3-3, 4 held-out prompts (32 tokens)
x 24 new tokens, one untimed warm-up per configuration. Every shard link (the relay in
front of each shard) at RTT 0 and 100 ms; a ring's peer link passes the relay of the
shard it pushes into, so a shard-to-shard hop costs the same one-way delay as a client
hop. "Waits by time" = (s per decoded token at 100 ms - at 0 ms) / 0.1 s; the relays'
wait counts (taken behind the 100 ms links) are beside it.
"""

import hashlib
import json
import sys
from pathlib import Path

from mtplib import host, paths
from mtplib.distributed.ranged_mtp import RangedMTP
from mtplib.lab.wan_inputs import trained_prompts
from mtplib.model.trained import trained_paths
from mtplib.runtime import build_info
from mtplib.runtime.lib import upstream_info
from mtplib.runtime.rpc import client_proto_minor
from mtplib.runtime.settings import DecodeSettings
from mtplib.runtime.speculative import EngineOptions

RTT_MS = 100
N_NEW = 24

prov = host.provenance(paths.REPO, build_info(), ["evidence/upstream-patches/ring_waits.py",
                                                   *sys.argv[1:]])
pair = trained_paths()
prompts = trained_prompts(4, 32)
opts = EngineOptions(k=0, settings=DecodeSettings(n_ctx=256, n_threads=1))
rows = []
for plan in ("0-1,2-3", "0-0,1-2,3-3"):
    for seam in ("star", "ring"):
        row = {"plan": plan, "n_shards": plan.count(",") + 1, "seam": seam}
        for rtt in (0, RTT_MS):
            with RangedMTP(str(pair.trunk), plan=plan, seam=seam,
                           wan=str(rtt) if rtt else None) as r:
                r.generate(prompts[0], 4, opts)  # warm-up
                s_per_tok, tokens, waits, links = [], [], [], None
                for p in prompts:
                    toks, m = r.generate(p, N_NEW, opts)
                    s_per_tok.append(m.decode_s / max(1, m.n_generated - 1))
                    tokens.append(toks)
                    waits.append(m.waits_per_step.get("decode"))
                    links = [x["seam"] for x in m.seam["links"]]
            row[f"s_per_token_{rtt}ms"] = sum(s_per_tok) / len(s_per_tok)
            row[f"relay_waits_per_plain_step_{rtt}ms"] = waits
            row[f"tokens_{rtt}ms"] = tokens
            row["links"] = links
        row["waits_by_time"] = ((row[f"s_per_token_{RTT_MS}ms"] - row["s_per_token_0ms"])
                                / (RTT_MS / 1000))
        row["tokens_equal_across_rtt"] = row["tokens_0ms"] == row[f"tokens_{RTT_MS}ms"]
        rows.append(row)
        print(plan, seam, f"{row['waits_by_time']:.2f} waits by time",
              row[f"relay_waits_per_plain_step_{RTT_MS}ms"], row["links"], flush=True)
for plan in ("0-1,2-3", "0-0,1-2,3-3"):
    star, ring = (r for r in rows if r["plan"] == plan)
    ring["tokens_equal_star"] = ring["tokens_0ms"] == star["tokens_0ms"]
info = upstream_info()
rpc_lib = Path(info["lib_dir"]) / "libggml-rpc.so.0"
out = {"upstream": {k: info[k] for k in ("build", "patches", "llama_cpp_commit")},
       # what the client speaks and the RPC library it loaded: the patch list above is the
       # installed build's marker, which a hand-installed libggml-rpc does not update
       "rpc_protocol": f"7.{client_proto_minor()}",
       "libggml_rpc_sha256": hashlib.sha256(rpc_lib.read_bytes()).hexdigest(),
       "rtt_ms": RTT_MS, "n_prompts": len(prompts), "prompt_tokens": 32, "n_new": N_NEW,
       "rows": rows, "provenance": host.finish(prov)}
with open(sys.argv[1], "w") as f:
    json.dump(out, f, indent=1)
