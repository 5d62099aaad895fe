"""`mtplib run`: execute a lane's notebooks with papermill."""

from __future__ import annotations

import argparse
import json
import sys

from mtplib import paths
from mtplib.commands.common import add_json_arg


def run(a: argparse.Namespace) -> int:
    from mtplib.records.lanes import run_lane

    run_dir = run_lane(a.params, out_root=a.out, run_id=a.run_id,
                       progress=not (a.no_progress or a.json), argv=["mtplib", *sys.argv[1:]])
    if a.json:
        print(json.dumps({"run_dir": str(run_dir),
                          "run_record": str(run_dir / "run_record.json"), "status": "ok"}))
        return 0
    print(f"run complete: {run_dir}")
    print(f"run record:   {run_dir / 'run_record.json'}")
    return 0


def register(sub) -> None:
    r = sub.add_parser("run", help="execute a lane's notebooks with papermill",
                       description="Run every notebook of a lane (params/*.yaml) with "
                       "papermill into OUT/<run-id>/, with a run record (run_record.json). "
                       "The lane file is validated first (keys, types, notebook parameters "
                       "against each notebook's parameters cell): a bad one stops with one "
                       "line and no run folder. A notebook that raises stops the lane (exit "
                       "2): one line names it and its partial output, and the run record "
                       "says failed.")
    r.add_argument("--params", default=str(paths.DEFAULT_LANE),
                   help="lane params YAML (the default is the repo's, from any directory)")
    r.add_argument("--out", default=str(paths.OUTPUTS), help="output root")
    r.add_argument("--run-id", help="run directory name (default: timestamp-lane)")
    r.add_argument("--no-progress", action="store_true", help="no progress bars")
    add_json_arg(r, '{"run_dir", "run_record", "status"} (no progress bars)')
    r.set_defaults(fn=run)
