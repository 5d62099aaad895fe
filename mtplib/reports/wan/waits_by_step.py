"""Waits (synchronous round trips) and data bytes per step kind, for every drafter placement
and output-head placement, on one upstream build, over loopback relays (waits and bytes do
not depend on the RTT; `05_wan` measures the times).

    python -m mtplib.reports.wan.waits_by_step evidence/wan/waits-stock.json
    MTPLIB_UPSTREAM=patched python -m mtplib.reports.wan.waits_by_step \
        evidence/wan/waits-patched.json

The trained pair, plan 0-1,2-3, one held-out prompt (48 tokens), 16 new tokens, one
untimed warm-up per configuration (the first generation on a connection pays one-time
buffer allocations).
"""

from __future__ import annotations

import json
import logging

from mtplib import host, paths
from mtplib.contract.labels import Placement
from mtplib.reports import common

MODULE = "mtplib.reports.wan.waits_by_step"
#: named, not __name__ (which is __main__ under python -m)
log = logging.getLogger(MODULE)


def measure() -> dict:
    """Every (k, drafter placement, head) configuration's waits and bytes (module docstring);
    the result document without provenance."""
    from mtplib.distributed.ranged_mtp import RangedMTP
    from mtplib.lab.wan.inputs import trained_prompts
    from mtplib.model.trained import trained_paths
    from mtplib.runtime.engine_options import EngineOptions
    from mtplib.runtime.lib import upstream_info
    from mtplib.runtime.settings import DecodeSettings

    pair = trained_paths()
    prompt = trained_prompts(1, 48)[0]
    settings = DecodeSettings(n_ctx=256, n_threads=1)
    rows = []
    for placement in (Placement.TAIL, Placement.CLIENT):
        # the star: what the committed figures measured (the default seam then)
        with RangedMTP(str(pair.trunk), plan="0-1,2-3", sidecar=str(pair.sidecar),
                       mtp_placement=placement, allow_cache_crossing=True,
                       seam="star") as r:
            for k in (0, 2):
                if k == 0 and placement == "client":
                    continue
                for head in ("upstream", "client"):
                    opts = EngineOptions(k=k, settings=settings, head=head)
                    r.generate(prompt, 16, opts)  # warm-up
                    toks, m = r.generate(prompt, 16, opts)
                    rows.append({"k": k, "mtp_placement": placement if k else "-",
                                 "head": head, "waits_per_step": m.waits_per_step,
                                 "steps": m.steps_by_label,
                                 "bytes_by_class": m.wire_bytes_by_class,
                                 "cache_bytes_crossing": m.cache_bytes_crossing,
                                 "hidden_rows": m.hidden_rows, "tokens": toks})
                    log.info("%s %s %s %s %s", k, placement, head, m.waits_per_step,
                             m.cache_bytes_crossing)
    info = upstream_info()
    return {"upstream": {k: info[k] for k in ("build", "patches", "llama_cpp_commit")},
            "plan": "0-1,2-3", "prompt_tokens": len(prompt), "n_new": 16, "rows": rows}


def main(argv: list[str] | None = None) -> int:
    ap = common.parser(MODULE, __doc__)
    ap.add_argument("out", help="the result JSON (the committed ones: "
                    "evidence/wan/waits-<build>.json)")
    a = ap.parse_args(argv)
    common.setup_logging()
    from mtplib.runtime import build_info

    prov = host.provenance(paths.REPO, build_info(), common.command(MODULE, argv))
    out = {**measure(), "provenance": host.finish(prov)}  # measure() runs first
    with open(a.out, "w") as f:
        json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
