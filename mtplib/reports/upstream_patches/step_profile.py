"""Where a ranged step's non-wait time goes: per-phase ms per generated token (the engine's
``time_s``) and the time spent labelling the relays' counters at step boundaries.

    python -m mtplib.reports.upstream_patches.step_profile [RTT_MS] [PLAN]

The trained pair, every shard behind a relay (RTT_MS each, default 0), drafter and head in
the client, 3 held-out prompts x 32 tokens after one untimed generation, MTP off and k=2.
Prints one line per generation (the profile is the product; nothing is written).
"""

from __future__ import annotations

import time

from mtplib.distributed import relay as R
from mtplib.distributed.ranged_mtp import RangedMTP
from mtplib.lab.wan.config import WanConfig
from mtplib.lab.wan.inputs import decode_settings, links_for, trained_prompts
from mtplib.model.trained import trained_paths
from mtplib.reports import common
from mtplib.runtime.engine_options import EngineOptions

MODULE = "mtplib.reports.upstream_patches.step_profile"

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


def main(argv: list[str] | None = None) -> int:
    ap = common.parser(MODULE, __doc__)
    ap.add_argument("rtt", nargs="?", type=float, default=0.0, metavar="RTT_MS",
                    help="every shard link's RTT in ms (default 0)")
    ap.add_argument("plan", nargs="?", default="0-0,1-2,3-3", metavar="PLAN")
    a = ap.parse_args(argv)
    rtt, plan = a.rtt, a.plan
    R.CountingRelay.quiesce = _timed(R.CountingRelay.quiesce)
    if hasattr(R.RelaySet, "settle"):
        R.RelaySet.settle = _timed(R.RelaySet.settle)
    pair = trained_paths()
    prompts = trained_prompts(4, 48)
    settings = decode_settings(WanConfig(), str(pair.trunk))
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
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
