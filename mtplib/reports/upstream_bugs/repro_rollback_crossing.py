"""Bug 4 with drafts rejected: cache bytes between shards during ranged MTP, k = 1 and 3.

Two models: the tiny random fixture (`mtplib fixture`, seed 0), whose drafts are all
rejected, and the committed trained pair (evidence/trained-v4/), which accepts some and
rejects others, so a verify step keeps part of its batch. Every rejection rolls the target
back (n_rs_seq = k: a tail removal) and the next step restores the compressor state from
the kept cells. Plans whose CSA/LID restore (layer 2) opens a shard; 16 new tokens after a
10-token prompt; one JSON line per (model, plan, k). Run on each build:

    MTPLIB_UPSTREAM=stock   python -m mtplib.reports.upstream_bugs.repro_rollback_crossing
    MTPLIB_UPSTREAM=patched python -m mtplib.reports.upstream_bugs.repro_rollback_crossing
"""

from __future__ import annotations

import json
import tempfile

from mtplib.distributed.ranged_mtp import RangedMTP
from mtplib.lab.correctness import seeded_prompt
from mtplib.model.fixture import write_fixture
from mtplib.model.trained import trained_paths
from mtplib.reports import common
from mtplib.runtime import build_info
from mtplib.runtime.engine_options import EngineOptions
from mtplib.runtime.settings import DecodeSettings

MODULE = "mtplib.reports.upstream_bugs.repro_rollback_crossing"
PLANS = ("0-1,2-3", "0-1,2-2,3-3")


def main(argv: list[str] | None = None) -> int:
    common.parser(MODULE, __doc__).parse_args(argv)
    with tempfile.TemporaryDirectory() as d:
        tiny, trained = write_fixture(d, seed=0), trained_paths()
        for model, pair in (("tiny", tiny), ("trained", trained)):
            for plan in PLANS:
                run(model, pair.trunk, pair.sidecar, plan)
    return 0


def run(model: str, trunk, sidecar, plan: str) -> None:
    # the star: what the committed figures measured (the default seam then)
    with RangedMTP(str(trunk), plan=plan, sidecar=str(sidecar),
                   allow_cache_crossing=True, seam="star") as r:
        for k in (1, 3):
            opts = EngineOptions(k=k, settings=DecodeSettings(n_threads=1))
            toks, m = r.generate(seeded_prompt(7, 10), 16, opts)
            print(json.dumps({"build": build_info()["build"], "model": model, "plan": plan,
                              "k": k,
                              "drafted": m.drafted, "accepted": m.accepted,
                              "rollbacks": dict(m.rollbacks),
                              "cache_bytes_crossing": m.cache_bytes_crossing,
                              "tokens": toks}), flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
