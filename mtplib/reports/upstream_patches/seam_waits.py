"""Waits (round trips) per step kind, data bytes by class and by seam value, tokens: one
upstream build (MTPLIB_UPSTREAM), the trained pair, plans 0-1,2-3 and 0-0,1-2,3-3, MTP off
and k=2, drafter and head in the client, every shard behind a 20 ms link (pipelined requests
then count as the one round trip they cost; the counts do not depend on the RTT).

    MTPLIB_UPSTREAM=stock   python -m mtplib.reports.upstream_patches.seam_waits \\
        evidence/upstream-patches/seam-stock.json
    MTPLIB_UPSTREAM=patched python -m mtplib.reports.upstream_patches.seam_waits \\
        evidence/upstream-patches/seam-patched.json

One held-out prompt (48 tokens), 12 new tokens, one untimed warm-up per configuration.
"""

from __future__ import annotations

import json
import logging

from mtplib import host, paths
from mtplib.distributed.ranged_mtp import RangedMTP
from mtplib.distributed.relay import WanLink
from mtplib.lab.wan.inputs import trained_prompts
from mtplib.model.trained import trained_paths
from mtplib.reports import common
from mtplib.runtime import build_info
from mtplib.runtime.engine_options import EngineOptions
from mtplib.runtime.lib import upstream_info
from mtplib.runtime.settings import DecodeSettings

MODULE = "mtplib.reports.upstream_patches.seam_waits"
#: named, not __name__ (which is __main__ under python -m)
log = logging.getLogger(MODULE)
PLANS = ("0-1,2-3", "0-0,1-2,3-3")


def main(argv: list[str] | None = None) -> int:
    ap = common.parser(MODULE, __doc__)
    ap.add_argument("out", help="the result JSON (the committed ones: "
                    "evidence/upstream-patches/seam-<build>.json)")
    out_path = ap.parse_args(argv).out
    common.setup_logging()
    prov = host.provenance(paths.REPO, build_info(), common.command(MODULE, argv))
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
                log.info("%s %s %s", plan, k, m.waits_per_step)
    info = upstream_info()
    out = {"upstream": {k: info[k] for k in ("build", "patches", "llama_cpp_commit")},
           "prompt_tokens": len(prompt), "n_new": 12, "rtt_ms": 20, "rows": rows,
           "provenance": host.finish(prov)}
    with open(out_path, "w") as f:
        json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
