"""`mtplib bench`: run a lane's `bench:` section (MTP off vs on, sweep) without notebooks."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def run(a: argparse.Namespace) -> int:
    import matplotlib

    matplotlib.use("Agg")
    import pandas as pd

    from mtplib import bench as B
    from mtplib.pipeline import (
        REPO,
        LaneError,
        check_lane_requirements,
        load_lane,
        new_run_id,
        resolve_models,
    )
    from mtplib.record import base_record, file_hashes, now_iso, write_json
    from mtplib.runtime.devices import backend_info

    lane = load_lane(a.params)
    if lane.bench is None:
        raise LaneError(f"{lane.path}: no 'bench:' section to run")
    check_lane_requirements(lane)
    cfg = B.BenchConfig.from_dict(lane.bench, threads=lane.threads)
    out = Path(a.out) if a.out else REPO / "outputs" / (new_run_id(lane.name) + "-bench")
    if out.exists() and any(out.iterdir()):
        raise LaneError(f"{out} already exists and is not empty; pick another --out")
    out.mkdir(parents=True, exist_ok=True)
    record = base_record(REPO, argv=["mtplib", *sys.argv[1:]])
    record.update({"lane": lane.name, "params_file": str(lane.path), "run_dir": str(out),
                   "threads": lane.threads, "network": "loopback", "notebooks": [],
                   "fixture": lane.fixture, "backend": backend_info()})
    models = resolve_models(lane, out)
    record.update(models=models, model_sha256=file_hashes(list(models.values())))
    write_json(out / "run_record.json", record)
    log = (lambda s: None) if a.quiet else (lambda s: print(f"[bench] {s}", file=sys.stderr))
    result = B.run_bench(models["trunk"], models["sidecar"], cfg, log=log)
    paths = B.save(result, out / "bench")
    record.update(ended=now_iso(), status="ok")
    write_json(out / "run_record.json", record)
    data = B.load(out / "bench")
    pd.set_option("display.width", 200)
    cols = ["plan", "k", "runs", "decode_tok_s_median", "decode_tok_s_min", "decode_tok_s_max",
            "speedup", "ttft_ms_median", "acceptance", "acceptance_pos_1", "acceptance_pos_2",
            "acceptance_pos_3", "equal_to_off_runs"]
    print(pd.DataFrame(data["summary"])[cols].to_string(index=False))
    if data["break_even"]:
        print()
        print(pd.DataFrame(data["break_even"])[["plan", "k", "break_even_acceptance",
                                                "max_speedup", "note"]].to_string(index=False))
    print(f"\nraw metrics: {paths['json']} (+ CSVs), plots: {out / 'bench' / 'plots'}, "
          f"bench wall {data['wall_s']:.1f} s")
    return 0


def register(sub) -> None:
    b = sub.add_parser("bench", help="MTP off vs on benchmark of a lane (no notebooks)",
                       description="Run the `bench:` section of a lane (params/*.yaml): MTP "
                       "off and on (k per the lane), the synthetic acceptance sweep and the "
                       "break-even acceptance. Writes OUT/bench/bench.json, CSVs and plots "
                       "and OUT/run_record.json; prints the summary table.")
    b.add_argument("--params", default="params/cpu-fixture.yaml", help="lane params YAML")
    b.add_argument("--out", help="output directory (default: outputs/<run-id>-bench)")
    b.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    b.set_defaults(fn=run)
