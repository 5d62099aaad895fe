"""Where a ranged step's non-wait time goes: per-phase ms per generated token (the engine's
``time_s``) and the time spent labelling the relays' counters at step boundaries.

    PYTHONPATH=$PWD .venv/bin/python evidence/upstream-patches/step_profile.py [RTT_MS] [PLAN]

The trained pair, every shard behind a relay (RTT_MS each, default 0), drafter and head in
the client, 3 held-out prompts x 32 tokens after one untimed generation, MTP off and k=2.
"""

from __future__ import annotations

import sys
import time

from mtplib.distributed import relay as R
from mtplib.distributed.ranged_mtp import RangedMTP
from mtplib.lab.wan import WanConfig, _settings, links_for, trained_prompts
from mtplib.model.trained import trained_paths
from mtplib.runtime.speculative import EngineOptions

LABELLING = {"s": 0.0, "n": 0}


def _timed(fn):
    def wrapper(*a, **kw):
        t = time.perf_counter()
        try:
            return fn(*a, **kw)
        finally:
            LABELLING["s"] += time.perf_counter() - t
            LABELLING["n"] += 1
    return wrapper


def main() -> None:
    rtt = float(sys.argv[1]) if len(sys.argv) > 1 else 0.0
    plan = sys.argv[2] if len(sys.argv) > 2 else "0-0,1-2,3-3"
    R.CountingRelay.quiesce = _timed(R.CountingRelay.quiesce)
    if hasattr(R.RelaySet, "settle"):
        R.RelaySet.settle = _timed(R.RelaySet.settle)
    pair = trained_paths()
    prompts = trained_prompts(4, 48)
    settings = _settings(WanConfig(), str(pair.trunk))
    # the star: what the committed figures measured (the default seam then)
    with RangedMTP(str(pair.trunk), plan=plan, sidecar=str(pair.sidecar),
                   mtp_placement="client", shard_threads=1,
                   opts=EngineOptions(k=2, settings=settings, head="client"),
                   seam="star") as r:
        relays = r.rt.relays.relays
        for relay, link in zip(relays, links_for("remote", len(relays), rtt), strict=True):
            relay.set_link(link)
        for k in (0, 2):
            opts = EngineOptions(k=k, settings=settings, head="client")
            r.generate(list(prompts[3]), 16, opts)
            for p in prompts[:3]:
                LABELLING.update(s=0.0, n=0)
                _, m = r.generate(list(p), 32, opts)
                n = m.n_generated - 1
                parts = {str(a): round(1000 * (b or 0) / n, 1) for a, b in m.time_s.items()
                         if a != "prefill"}
                print(f"k={k} {m.decode_tok_s:.2f} tok/s; ms/token {parts}; decode "
                      f"{1000 * m.decode_s / n:.1f} ms/token; labelling "
                      f"{1000 * LABELLING['s']:.0f} ms in {LABELLING['n']} calls (whole "
                      f"generation); steps "
                      f"{ {str(a): b for a, b in m.steps_by_label.items()} }", flush=True)


if __name__ == "__main__":
    main()
