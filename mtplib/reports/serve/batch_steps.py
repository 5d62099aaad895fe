"""What one batch step costs by the number of slots in it, ranged over emulated WAN links.

The library's `RangedMTP.batch` (the trained pair, k=2, local shards for plan 0-1,2-3 behind
relays of --wan ms): a warm-up set of 4 prompts, then 4 held-out prompts of 32 tokens join
together (one prefill batch) and generate 64 tokens each; every step's wall time is recorded
with the number of slots it carried (slots that finish leave at once, as the service does).

    python -m mtplib.reports.serve.batch_steps [--wan 100] [--out FILE]
"""

from __future__ import annotations

import json
import statistics
import time
from collections import defaultdict
from pathlib import Path

from mtplib.reports import common

MODULE = "mtplib.reports.serve.batch_steps"
HERE = common.evidence("serve")


def main(argv: list[str] | None = None) -> int:
    ap = common.parser(MODULE, __doc__)
    ap.add_argument("--wan", default="100")
    ap.add_argument("--n", type=int, default=64)
    ap.add_argument("--out", default=str(HERE / "batch-steps-ranged-100ms.json"))
    a = ap.parse_args(argv)

    from mtplib.distributed.ranged_mtp import RangedMTP
    from mtplib.host import cpu_info
    from mtplib.lab.wan.inputs import trained_prompts
    from mtplib.model.trained import trained_paths
    from mtplib.runtime.engine_options import EngineOptions

    tp = trained_paths()
    opts = EngineOptions.build(k=2, n_seq_max=4, n_ctx=1024)
    ps = trained_prompts(8, 32)
    per: dict[int, list[float]] = defaultdict(list)
    # the star: what the committed figures measured (the default seam then)
    with RangedMTP(str(tp.trunk), plan="0-1,2-3", sidecar=str(tp.sidecar), opts=opts,
                   wan=a.wan, seam="star") as r:
        b = r.batch()
        for q, _ in b.join_many([(p, 8, None) for p in ps[4:]]):  # warm-up, not counted
            while q in b.active():
                b.step()
            b.leave(q)
        t0 = time.perf_counter()
        ids = [q for q, _ in b.join_many([(p, a.n, None) for p in ps[:4]])]
        join_s = time.perf_counter() - t0
        while b.active():
            n = len(b.active())
            t0 = time.perf_counter()
            b.step()
            per[n].append(time.perf_counter() - t0)
            for q in ids:
                if q in b.slots and q not in b.active():
                    b.leave(q)
        b.close()
    out = {"what": "ranged batch step wall time by slots in the step (library, 4 prompts "
                   "joined together)",
           "command": " ".join(common.command(MODULE, argv)),
           "wan_ms": a.wan, "n_new": a.n, "cpu": cpu_info(),
           "join_4_prompts_s": join_s,
           "step_s_by_slots": {str(n): {"steps": len(v), "median": statistics.median(v),
                                        "min": min(v), "max": max(v)}
                               for n, v in sorted(per.items())}}
    Path(a.out).write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps(out["step_s_by_slots"]), out["join_4_prompts_s"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
