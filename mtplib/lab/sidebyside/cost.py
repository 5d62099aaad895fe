"""The cost ratio (`mtplib.lab.sidebyside`): one-token decode time of the MTP block over the
trunk's, timed around the C call only (`cost_ratio`), and the table of its result files.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from mtplib.contract.capabilities import Policy
from mtplib.lab.correctness import seeded_prompt
from mtplib.lab.sidebyside.machine import loadavg
from mtplib.runtime.routing import require_mtp


# -- the cost ratio -----------------------------------------------------------------------
def cost_ratio(trunk: str, sidecar: str, *, n_tokens: int = 200, n_prompt: int = 32,
               warmup: int = 16, threads: int = 2, n_ctx: int = 1024, seed: int = 0,
               policy: Policy | str | None = None) -> dict:
    """MTP-step / trunk-step one-token decode time (medians), interleaved, raw decode.
    The MTP block runs: refused (RouteRefused) under a policy that disables MTP."""
    from mtplib.runtime.model import Context, ContextConfig, Model
    from mtplib.runtime.timing import timed

    require_mtp("cost ratio", policy=policy)
    with Model(trunk) as tm, Model(sidecar, load_mtp=True) as sm:
        common = dict(n_ctx=n_ctx, n_threads=threads)
        with Context(tm, ContextConfig(**common, nextn_rows="all")) as tc, \
                Context(sm, ContextConfig(**common, mtp=True, nextn_rows="masked")) as mc:
            prompt = seeded_prompt(seed, n_prompt, tm.n_vocab)
            tc.decode(prompt, range(n_prompt), logits=[False] * (n_prompt - 1) + [True])
            rows = tc.nextn_rows(n_prompt)
            mc.decode(prompt[1:], range(1, n_prompt), rows=rows[:-1])
            h, tok = rows[-1].copy(), int(np.argmax(tc.logits(-1)))
            with timed(tc) as tt, timed(mc) as mt:
                for i in range(warmup + n_tokens):
                    p = n_prompt + i
                    if i % 2 == 0:  # alternate which goes first
                        mc.decode([tok], [p], logits=True, rows=h[None, :])
                        tc.decode([tok], [p], logits=True)
                    else:
                        tc.decode([tok], [p], logits=True)
                        mc.decode([tok], [p], logits=True, rows=h[None, :])
                    h = tc.nextn_rows(1)[0].copy()
                    tok = int(np.argmax(tc.logits(-1)))
    t_trunk = tt.times[warmup:]
    t_mtp = mt.times[warmup:]
    med_t, med_m = statistics.median(t_trunk), statistics.median(t_mtp)
    cpu_t, cpu_m = statistics.median(tt.cpu[warmup:]), statistics.median(mt.cpu[warmup:])
    return {"trunk_decode_ms_median": 1e3 * med_t, "mtp_decode_ms_median": 1e3 * med_m,
            "ratio_mtp_over_trunk": med_m / med_t, "one_over_ratio": med_t / med_m,
            "trunk_tok_s_raw": 1.0 / med_t,
            "trunk_cpu_ms_median": 1e3 * cpu_t, "mtp_cpu_ms_median": 1e3 * cpu_m,
            "cpu_ratio_mtp_over_trunk": cpu_m / cpu_t if cpu_t else None,
            "trunk_decode_ms_p10_p90": [1e3 * float(np.percentile(t_trunk, q)) for q in (10, 90)],
            "mtp_decode_ms_p10_p90": [1e3 * float(np.percentile(t_mtp, q)) for q in (10, 90)],
            "n_tokens": n_tokens, "warmup": warmup, "threads": threads, "n_ctx": n_ctx,
            "n_prompt": n_prompt, "loadavg": loadavg(),
            "method": "median one-token llama_decode time (perf_counter around the C call "
                      "only), trunk and MTP interleaved token by token, positions "
                      f"{n_prompt}..{n_prompt + warmup + n_tokens - 1}, first {warmup} "
                      "dropped"}


COST_RATIO_COLUMNS = ("threads", "trunk_decode_ms_median", "mtp_decode_ms_median",
                      "ratio_mtp_over_trunk", "one_over_ratio", "n_tokens")


def cost_ratio_table(paths: Sequence[str | Path]):
    """One row per cost-ratio JSON (`compare-upstream --cost-ratio-only`): the MTP step's
    cost as a fraction of a trunk step, with the load it was measured under."""
    import pandas as pd

    rows = []
    for p in paths:
        d = json.loads(Path(p).read_text())
        c = d["cost_ratio"]
        rows.append({"file": Path(p).name, "trunk": Path(d["trunk"]).name,
                     **{k: c.get(k) for k in COST_RATIO_COLUMNS},
                     "loadavg": c.get("loadavg", d.get("loadavg"))})
    return pd.DataFrame(rows).round(4)
