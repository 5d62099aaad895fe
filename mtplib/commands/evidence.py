"""`mtplib evidence`: copy a run into evidence/<story>/ and write the story's README."""

from __future__ import annotations

import argparse
import json

from mtplib import paths
from mtplib.commands.common import add_json_arg


def run(a: argparse.Namespace) -> int:
    from mtplib.records.evidence import copy_run, load_raw
    from mtplib.records.readme import numbers_trace

    tests = None
    if a.tests:  # before the copy: the results file is part of the run's raw metrics
        from mtplib.records.pytest_results import record_tests

        tests = str(record_tests([(a.run, a.story)])[0])
        if not a.json:
            print(f"criterion tests recorded: {tests}")
    readme = copy_run(a.run, a.story, a.dest, force=a.force, allow_failed=a.allow_failed)
    missing = numbers_trace(readme.read_text(), load_raw(readme.parent, a.story))
    if a.json:
        print(json.dumps({"evidence_dir": str(readme.parent), "readme": str(readme),
                          "numbers_not_in_raw": missing, "tests": tests}))
        return 0
    print(f"evidence written: {readme.parent}")
    print(f"README: {readme} (numbers not in the raw metrics: {len(missing)})")
    return 0


def register(sub) -> None:
    e = sub.add_parser("evidence", help="copy a run into evidence/<story>/ with its README",
                       description="Copy a run's executed notebooks, raw metrics, plots and "
                       "run record into DEST/<story>/ and write the story's README from the "
                       "raw metrics (every number traced to them). Refuses a run whose record "
                       "does not say ok (failed or unfinished) unless --allow-failed. Refuses "
                       "to overwrite a different existing file, or to leave files of the "
                       "evidence it replaces that this run lacks, unless --force.")
    e.add_argument("--run", required=True, help="run directory (outputs/<run-id>)")
    e.add_argument("--story", default="DGR-066", help="story id")
    e.add_argument("--dest", default=str(paths.EVIDENCE), help="evidence root (the repo's "
                   "evidence/)")
    e.add_argument("--force", action="store_true",
                   help="overwrite different files and remove the replaced evidence's files "
                   "this run does not have (the notebooks its run record lists, the story's "
                   "raw metrics; files added by hand stay)")
    e.add_argument("--allow-failed", action="store_true",
                   help="copy a run whose record says failed (or never finished); the README "
                   "then opens with a warning saying so")
    add_json_arg(e, "the paths and the untraced numbers")
    e.add_argument("--tests", action="store_true",
                   help="first run the story's criterion tests (pytest; slow) and record "
                   "their results as tests-<story>.json in the run folder")
    e.set_defaults(fn=run)
