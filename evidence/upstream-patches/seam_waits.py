"""Waits (round trips) per step kind, data bytes by class and by seam value, tokens: one
upstream build (MTPLIB_UPSTREAM), the trained pair, plans 0-1,2-3 and 0-0,1-2,3-3, MTP off
and k=2, drafter and head in the client, every shard behind a 20 ms link (pipelined requests
then count as the one round trip they cost; the counts do not depend on the RTT).

    MTPLIB_UPSTREAM=stock   .venv/bin/python evidence/upstream-patches/seam_waits.py \\
        evidence/upstream-patches/seam-stock.json
    MTPLIB_UPSTREAM=patched .venv/bin/python evidence/upstream-patches/seam_waits.py \\
        evidence/upstream-patches/seam-patched.json

One held-out prompt (48 tokens), 12 new tokens, one untimed warm-up per configuration.
"""

from __future__ import annotations

import json
import sys

from mtplib import host, paths
from mtplib.distributed.ranged_mtp import RangedMTP
from mtplib.distributed.relay import WanLink
from mtplib.lab.wan import trained_prompts
from mtplib.model.trained import trained_paths
from mtplib.runtime import build_info
from mtplib.runtime.lib import upstream_info
from mtplib.runtime.settings import DecodeSettings
from mtplib.runtime.speculative import EngineOptions

PLANS = ("0-1,2-3", "0-0,1-2,3-3")


def main(out_path: str) -> None:
    prov = host.provenance(paths.REPO, build_info(),
                           ["evidence/upstream-patches/seam_waits.py", out_path])
    pair = trained_paths()
    prompt = trained_prompts(1, 48)[0]
    settings = DecodeSettings(n_ctx=256, n_threads=1)
    rows = []
    for plan in PLANS:
        # the star: what the committed figures measured (the default seam then)
        with RangedMTP(str(pair.trunk), plan=plan, sidecar=str(pair.sidecar),
                       mtp_placement="client", seam="star") as r:
            relays = r.rt.relays.relays
            for k in (0, 2):
                opts = EngineOptions(k=k, settings=settings, head="client")
                r.generate(prompt, 12, opts)  # warm-up over loopback
                for relay in relays:
                    relay.set_link(WanLink(20))
                toks, m = r.generate(prompt, 12, opts)
                for relay in relays:
                    relay.set_link(WanLink())
                rows.append({"plan": plan, "n_shards": len(relays), "k": k,
                             "waits_per_step": m.waits_per_step,
                             "steps": m.steps_by_label,
                             "bytes_by_class": m.wire_bytes_by_class,
                             "seam_bytes_by_value": m.seam_bytes_by_value,
                             "cache_bytes_crossing": m.cache_bytes_crossing,
                             "tokens": toks})
                print(plan, k, m.waits_per_step, flush=True)
    info = upstream_info()
    out = {"upstream": {k: info[k] for k in ("build", "patches", "llama_cpp_commit")},
           "prompt_tokens": len(prompt), "n_new": 12, "rtt_ms": 20, "rows": rows,
           "provenance": host.finish(prov)}
    with open(out_path, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
