"""How many allocation-size queries a ranged engine's load and warm-up ask, per plan and
draft length: sent to the shards (``MTPLIB_FORWARD_ALLOC_SIZES=1``) or answered by the
client's relays (the default for CPU shards).

    python -m mtplib.reports.ttft.setup_queries evidence/ttft/setup-queries.json

One `RangedMTP` per setting, plan and k (its own `mtplib shard serve` processes, the
trained pair, no emulated WAN: these are counts, not times); the relays' counts per label
right after it is built and warmed, before any generation: GET_ALLOC_SIZE waits (queries the
shards answered, one round trip each over a link), queries answered here, and every wait by
the command that opened it (``load``: the weights' upload and the contexts; ``setup``: the
warm-up).
"""

from __future__ import annotations

import json
import logging
import os

from mtplib import host, paths
from mtplib.distributed.ranged_mtp import RangedMTP
from mtplib.distributed.relay import summed
from mtplib.distributed.shard_report import FORWARD_ALLOC_SIZES_ENV
from mtplib.model.trained import trained_paths
from mtplib.reports import common
from mtplib.runtime import build_info

MODULE = "mtplib.reports.ttft.setup_queries"
#: named, not __name__ (which is __main__ under python -m)
log = logging.getLogger(MODULE)


def count(plan: str, k: int) -> dict:
    p = trained_paths()
    with RangedMTP(str(p.trunk), plan=plan, sidecar=str(p.sidecar) if k else None) as r:
        rel = r.rt.relays
        labels = [str(lb) for lb in rel.labels()]
        return {"sent_to_shards": {lb: sum(w.get("GET_ALLOC_SIZE", 0)
                                           for w in rel.waits_by_command(lb)) for lb in labels},
                "answered_here": {lb: sum(rel.answered_here(lb)) for lb in labels},
                # every round trip the client waited on, by the command that opened it
                # (the emulated WAN starts after the load: over a real link each costs one)
                "waits_by_command": {lb: summed(rel.waits_by_command(lb)) for lb in labels}}


def main(argv: list[str] | None = None) -> int:
    ap = common.parser(MODULE, __doc__)
    ap.add_argument("out", help="the result JSON (the committed one: "
                    "evidence/ttft/setup-queries.json)")
    out = ap.parse_args(argv).out
    common.setup_logging()
    prov = host.provenance(paths.REPO, build_info(), common.command(MODULE, argv))
    rows = []
    for setting in ("forwarded", "answered"):
        if setting == "forwarded":
            os.environ[FORWARD_ALLOC_SIZES_ENV] = "1"
        else:
            os.environ.pop(FORWARD_ALLOC_SIZES_ENV, None)
        for plan in ("0-1,2-3", "0-0,1-2,3-3"):
            for k in (0, 2):
                row = {"setting": setting, "plan": plan, "k": k, **count(plan, k)}
                rows.append(row)
                log.info("%s", json.dumps(row))
    with open(out, "w") as f:
        json.dump({"rows": rows, "provenance": host.finish(prov)}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
