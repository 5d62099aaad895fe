"""`mtplib bench`: run a lane's `bench:` section (MTP off vs on, sweep) without notebooks."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from mtplib import paths
from mtplib.commands.common import add_json_arg, add_tls_args
from mtplib.contract.labels import SEAM_CHOICES
from mtplib.runtime.request import DEFAULT_SEAM


def run(a: argparse.Namespace) -> int:
    import matplotlib

    matplotlib.use("Agg")
    import pandas as pd

    from mtplib.lab.bench import measure as B
    from mtplib.lab.bench import summary as BS
    from mtplib.records.lanes import (
        LaneError,
        check_lane_requirements,
        load_lane,
        new_run_id,
        open_run,
    )
    from mtplib.records.run_record import end_record, write_json

    lane = load_lane(a.params)
    if lane.bench is None:
        raise LaneError(f"{lane.path}: no 'bench:' section to run")
    if a.policy is not None:
        lane.policy = a.policy
    # --wan / --tls / --seam replace the lane's values before the section is checked, once, with
    # the lane: the WAN text is parsed there into each ranged plan's links, which its run
    # gets (`BenchConfig.wan_links`)
    lane.bench = {**lane.bench, **{k: v for k, v in (("wan", a.wan), ("tls", a.tls),
                                                            ("seam", a.seam))
                                   if v is not None}}
    cfg = check_lane_requirements(lane)
    assert cfg is not None  # the lane has a bench section
    out = Path(a.out) if a.out else paths.OUTPUTS / (new_run_id(lane.name) + "-bench")
    record, models = open_run(lane, out, argv=["mtplib", *sys.argv[1:]], what="--out",
                              unique=a.out is None)
    out = Path(record["run_dir"])
    record["policy"] = cfg.policy
    write_json(out / "run_record.json", record)
    log = (lambda s: None) if a.quiet else (lambda s: print(f"[bench] {s}", file=sys.stderr))
    try:
        result = B.run_bench(models["trunk"], models["sidecar"], cfg, log=log)
        saved = BS.save(result, out / "bench")
    except BaseException as e:  # the record says so, then the one-line error (or bug)
        end_record(record, "failed", error=f"{type(e).__name__}: {e}")
        write_json(out / "run_record.json", record)
        raise
    end_record(record, "ok")
    write_json(out / "run_record.json", record)
    data = BS.load(out / "bench")
    if a.json:
        print(json.dumps({"out": str(out), "bench_json": str(saved["json"]),
                          "plots": str(out / "bench" / "plots"), "wall_s": data["wall_s"],
                          "summary": data["summary"], "break_even": data["break_even"]}))
        return 0
    pd.set_option("display.width", 200)
    cols = ["plan", "k", "runs", "decode_tok_s_median", "decode_tok_s_min", "decode_tok_s_max",
            "speedup", "ttft_ms_median", "acceptance", "acceptance_pos_1", "acceptance_pos_2",
            "acceptance_pos_3", "equal_to_off_runs"]
    print(pd.DataFrame(data["summary"])[cols].to_string(index=False))
    if data["break_even"]:
        print()
        print(pd.DataFrame(data["break_even"])[["plan", "k", "break_even_acceptance",
                                                "max_speedup", "note"]].to_string(index=False))
    print(f"\nraw metrics: {saved['json']} (+ CSVs), plots: {out / 'bench' / 'plots'}, "
          f"bench wall {data['wall_s']:.1f} s")
    return 0


def register(sub) -> None:
    b = sub.add_parser("bench", help="MTP off vs on benchmark of a lane (no notebooks)",
                       description="Run the `bench:` section of a lane (params/*.yaml): MTP "
                       "off and on (k per the lane), the synthetic acceptance sweep and the "
                       "break-even acceptance. Writes OUT/bench/bench.json, CSVs and plots "
                       "and OUT/run_record.json; prints the summary table. The bench compares "
                       "MTP off with on, so under a policy that disables MTP (alpha) it is "
                       "refused before anything runs.")
    b.add_argument("--params", default=str(paths.DEFAULT_LANE),
                   help="lane params YAML (the default is the repo's, from any directory)")
    b.add_argument("--out", help="output directory (default: outputs/<run-id>-bench)")
    b.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    b.add_argument("--wan", metavar="RTT_MS[:MBIT][,...]", default=None,
                   help="ranged plans: emulate a WAN in front of each shard (as generate "
                   "--wan; default: the lane's bench.wan, else loopback)")
    b.add_argument("--seam", choices=SEAM_CHOICES, default=None,
                   help="ranged plans: how boundary values reach the next shard (as generate "
                   "--seam: star, ring = shard to shard with patches/0007, auto = the ring "
                   "where this build and every shard speak RPC 7.2 and, under --tls, every "
                   "shard gateway carries peer links, else the star); default: the lane's "
                   f"bench.seam, else "
                   f"{DEFAULT_SEAM}; each ranged row's seam says which ran and why, per shard "
                   "pair")
    b.add_argument("--policy", choices=["alpha", "beta"], default=None,
                   help="deployment policy (default: the lane's `policy:`, else beta); "
                   "alpha disables MTP, so the bench refuses to run (exit 2)")
    add_tls_args(b, "ranged plans: the local shards serve through mutual-TLS gateways with "
                 "DIR's certificates and the client connects with TLS (see `mtplib tls init`; "
                 "default: the lane's bench.tls, else plain loopback)", plaintext=False)
    add_json_arg(b, "the paths, summary and break-even rows")
    b.set_defaults(fn=run)
