"""Waits (synchronous round trips) and data bytes per step kind, for every drafter placement
and output-head placement, on one upstream build, over loopback relays (waits and bytes do
not depend on the RTT; `05_wan` measures the times).

    .venv/bin/python evidence/wan/waits_by_step.py evidence/wan/waits-stock.json
    MTPLIB_UPSTREAM=patched .venv/bin/python evidence/wan/waits_by_step.py \
        evidence/wan/waits-patched.json

The trained pair, plan 0-1,2-3, one held-out prompt (48 tokens), 16 new tokens, one
untimed warm-up per configuration (the first generation on a connection pays one-time
buffer allocations).
"""

import json
import sys

from mtplib import host, paths
from mtplib.distributed.ranged_mtp import RangedMTP
from mtplib.lab.wan import trained_prompts
from mtplib.model.trained import trained_paths
from mtplib.runtime import build_info
from mtplib.runtime.lib import upstream_info
from mtplib.runtime.settings import DecodeSettings
from mtplib.runtime.speculative import EngineOptions

prov = host.provenance(paths.REPO, build_info(), ["evidence/wan/waits_by_step.py", *sys.argv[1:]])
pair = trained_paths()
prompt = trained_prompts(1, 48)[0]
settings = DecodeSettings(n_ctx=256, n_threads=1)
rows = []
for placement in ("tail", "client"):
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
                rows.append({"k": k, "mtp_placement": placement if k else "-", "head": head,
                             "waits_per_step": m.waits_per_step,
                             "steps": m.steps_by_label,
                             "bytes_by_class": m.wire_bytes_by_class,
                             "cache_bytes_crossing": m.cache_bytes_crossing,
                             "hidden_rows": m.hidden_rows, "tokens": toks})
                print(k, placement, head, m.waits_per_step, m.cache_bytes_crossing)
info = upstream_info()
out = {"upstream": {k: info[k] for k in ("build", "patches", "llama_cpp_commit")},
       "plan": "0-1,2-3", "prompt_tokens": len(prompt), "n_new": 16, "rows": rows,
       "provenance": host.finish(prov)}
with open(sys.argv[1], "w") as f:
    json.dump(out, f, indent=1)
