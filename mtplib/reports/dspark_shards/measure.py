"""DSpark drafting on shards, the client placement (issue 40 point 3): bytes, waits and
feature bytes per step kind, drafting on (k=3) and off, 2 and 3 local shards, ring and star,
on the tiny trunk with its random-weight DSpark draft (it accepts nothing: every verify
step commits one token and reads k+1 rows).

Run: python -m mtplib.reports.dspark_shards.measure OUT_DIR "0-1,2-3;0-0,1-2,3-3" \
     > evidence/dspark-shards/table.json

OUT_DIR gets the fixtures (the trunk and its DSpark draft); the table is printed.
"""

from __future__ import annotations

import json
from pathlib import Path

from mtplib import host, paths
from mtplib.distributed.ranged_mtp import RangedMTP
from mtplib.model.dspark.fixture import write_dspark_fixture
from mtplib.model.fixture import write_fixture
from mtplib.reports import common
from mtplib.runtime import build_info
from mtplib.runtime.dspark.ranged import feature_bytes
from mtplib.runtime.engine_options import EngineOptions
from mtplib.runtime.settings import DecodeSettings

MODULE = "mtplib.reports.dspark_shards.measure"
PROMPT = [1, 5, 9, 33, 7, 2, 100, 3]
N = 12
S = DecodeSettings(n_ctx=256, n_threads=1)


def step_rows(r, m) -> dict:
    per = {}
    for lab, row in m.seam_report["steps"].items():
        if lab in ("load", "setup", "other") or not row["steps"]:
            continue
        n = row["steps"]
        per[lab] = {"steps": n, "rows": row["tokens"],
                    "bytes_per_step": row["bytes"] / n,
                    "waits_per_step": row["waits_per_step"],
                    "bytes_per_shard": row["per_shard"],
                    "peer_bytes_per_step": row.get("peer", {}).get("bytes", 0) / n,
                    "feature_down_bytes": row["features"]["down"],
                    "feature_up_bytes": row["features"]["up"],
                    "feature_peer_bytes": row["features"]["peer"],
                    # which shard each feature was read from (its hc-mean ran there)
                    "feature_down_by_shard": [feature_bytes([d])["down"]
                                              for d in r.rt.relays.by_tensor_dir(lab)]}
    return per


def main(argv: list[str] | None = None) -> int:
    ap = common.parser(MODULE, __doc__)
    ap.add_argument("out_dir", metavar="OUT_DIR", help="where the fixtures are written")
    ap.add_argument("plans", metavar="PLANS", help="plans, ';'-separated")
    a = ap.parse_args(argv)
    common.setup_logging()
    prov = host.provenance(paths.REPO, build_info(), common.command(MODULE, argv))
    out = Path(a.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    pair = write_fixture(out, seed=0, sidecar=False)
    dsp = write_dspark_fixture(out, seed=0)
    rows = []
    for plan in a.plans.split(";"):
        for seam in ("ring", "star"):
            with RangedMTP(str(pair.trunk), plan=plan, sidecar=str(dsp), seam=seam,
                           opts=EngineOptions(k=3, settings=S)) as r:
                toks = {}
                for k in (3, 0):
                    t, m = r.generate(PROMPT, N, EngineOptions(k=k, settings=S))
                    toks[k] = t
                    rows.append({"plan": plan, "seam": m.seam["seam"], "k": k,
                                 "tokens": len(t), "drafted": m.drafted,
                                 "accepted": m.accepted, "verify_steps": m.verify_steps,
                                 "cache_bytes_crossing": m.cache_bytes_crossing,
                                 "wire_violations": m.wire_violations,
                                 "steps": step_rows(r, m),
                                 "placement": (m.routing.get("placement") or {}).get(
                                     "decisions")})
                rows[-1]["same_tokens_drafting_on_and_off"] = toks[0] == toks[3]
                rows[-2]["same_tokens_drafting_on_and_off"] = toks[0] == toks[3]
    print(json.dumps({
        "what": "DSpark on shards, the draft in the client: bytes, waits and feature bytes "
                "per step kind; tiny trunk + random-weight DSpark draft (accepts nothing)",
        "command": " ".join(common.command(MODULE, argv)), "prompt": PROMPT, "n": N,
        "rows": rows, "provenance": host.finish(prov)}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
