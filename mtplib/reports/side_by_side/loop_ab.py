"""mtplib's plain-decoding loop against the thinnest Python loop over the same context.

    MODEL=FX/v4-v4-ratio-cpu-s0.gguf NT=2 \
        python -m mtplib.reports.side_by_side.loop_ab > loop-ab-t2.json

One process, one target context (n_ctx 1024, swa_full off as llama-server), the same
32-token prompt, 128 new tokens, greedy; three variants interleaved (order reversed every
round), 1 warm-up round + 7 measured:

  engine       mtplib's Engine (the speculative loop with k = 0: session, contract state
               steps, Sampler, metrics) via run_generation
  raw          decode one token, read its logits (Context.logits), numpy argmax: the least
               any Python loop does
  raw_noread   decode the next token without reading logits (not a real decoder: it shows
               what the first touch of the logits after a decode costs)

Decode tok/s as the runtime reports it: (n - 1) / (time of the last token - the first).
Prints one JSON object (the committed one: evidence/side-by-side/profile/loop-ab-t2.json).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import numpy as np

from mtplib.lab.correctness import seeded_prompt
from mtplib.lab.sidebyside.machine import loadavg
from mtplib.reports import common
from mtplib.runtime.drafters import Drafter
from mtplib.runtime.engine import Engine
from mtplib.runtime.generation import run_generation
from mtplib.runtime.model import Context, ContextConfig, Model

MODULE = "mtplib.reports.side_by_side.loop_ab"
N_NEW, N_PROMPT, ROUNDS = 128, 32, 8


def measure(path: str, nt: int) -> dict:
    """The three variants, interleaved (module docstring): the printed document."""
    model = Model(path)
    ctx = Context(model, ContextConfig(n_ctx=1024, n_threads=nt, swa_full=False))
    prompt = seeded_prompt(0, N_PROMPT, model.n_vocab)

    def engine() -> float:
        _, m = run_generation(Engine(ctx, Drafter(), k=0), prompt, N_NEW)
        return m.decode_tok_s

    def raw(read: bool) -> float:
        ctx.decode(prompt, range(N_PROMPT), logits=[False] * (N_PROMPT - 1) + [True])
        tok = int(np.argmax(ctx.logits(-1)))
        ts = []
        for i in range(N_NEW - 1):
            ctx.decode([tok], [N_PROMPT + i], logits=[True])
            if read:
                tok = int(np.argmax(ctx.logits(-1)))
            ts.append(time.perf_counter())
        ctx.clear()
        return (len(ts) - 1) / (ts[-1] - ts[0])

    variants = {"engine": engine, "raw": lambda: raw(True), "raw_noread": lambda: raw(False)}
    rows = []
    for rnd in range(ROUNDS):
        names = list(variants) if rnd % 2 == 0 else list(reversed(variants))
        for name in names:
            rows.append({"variant": name, "round": rnd, "warmup": rnd == 0,
                         "loadavg": loadavg(), "decode_tok_s": variants[name]()})
    med = {n: statistics.median(r["decode_tok_s"] for r in rows
                                if r["variant"] == n and not r["warmup"]) for n in variants}
    return {"model": path, "threads": nt, "median_tok_s": med,
            "engine_over_raw": med["engine"] / med["raw"],
            "raw_over_raw_noread": med["raw"] / med["raw_noread"], "rows": rows}


def main(argv: list[str] | None = None) -> int:
    common.parser(MODULE, __doc__, epilog="\n\n".join(__doc__.split("\n\n")[1:]),
                  formatter_class=argparse.RawDescriptionHelpFormatter).parse_args(argv)
    if "MODEL" not in os.environ:
        raise SystemExit(f"{MODULE}: error: set MODEL to the trunk GGUF")
    print(json.dumps(measure(os.environ["MODEL"], int(os.environ.get("NT", "2"))), indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
