"""The WAN benchmark once per upstream build (`mtplib.lab.wan`): each build in its own Python
process (the build is chosen before llama_cpp is imported), driven by its progress lines.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

from mtplib.errors import InputError
from mtplib.lab.wan.config import LOG, WanConfig
from mtplib.lab.wan.files import load

#: a line the child prints per generation under ``--progress`` ("PREFIX done/total"); the
#: parent drives its bar with it and keeps it out of run.log
PROGRESS_PREFIX = "mtplib-wan-progress "


def run_builds(cfg: WanConfig, out_dir, *, builds: Sequence[str] = ("stock", "patched"),
               overrides: dict[str, dict] | None = None, log: LOG | None = None,
               progress: bool = False) -> dict[str, dict]:
    """Run the benchmark once per upstream build, each in its own Python process with
    ``MTPLIB_UPSTREAM`` set, into ``out_dir/<build>/``; returns build -> loaded results.
    ``overrides``: build -> WanConfig fields that differ for that build (e.g. a smaller
    grid for the stock comparison). A build that is not installed (``.upstream/patched``
    missing) is skipped with a note. ``progress``: a bar (`mtplib.lab.common.progress.bar`) per
    build over its generations, fed by the child's progress lines."""
    import json
    import os
    import subprocess
    import sys

    from mtplib.lab.common.progress import bar
    from mtplib.runtime import PATCHED_DIR

    log = log or (lambda s: None)
    out: dict[str, dict] = {}
    for build in builds:
        if build == "patched" and not (PATCHED_DIR / "llama_cpp" / "MTPLIB_PATCHES").is_file():
            log(f"{build}: not installed ({PATCHED_DIR}); run ./dev.sh setup. Skipped.")
            continue
        d = Path(out_dir) / build
        d.mkdir(parents=True, exist_ok=True)
        env = dict(os.environ, MTPLIB_UPSTREAM=build, PYTHONUNBUFFERED="1")
        bcfg = replace(cfg, **(overrides or {}).get(build, {}), upstream=build)
        cmd = [sys.executable, "-m", "mtplib.lab.wan", "--config",
               json.dumps(bcfg.__dict__), "--out", str(d)] + (["--progress"] if progress else [])
        log(f"{build}: {' '.join(cmd[:3])} ... --out {d}")
        # appended to: a rerun into the same folder resumes the run (its finished cells kept)
        with (d / "run.log").open("a") as f, bar(None, f"wan {build}", progress) as pb:
            child = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, errors="replace")
            assert child.stdout is not None
            for line in child.stdout:
                if line.startswith(PROGRESS_PREFIX):
                    done, total = (int(x) for x in line[len(PROGRESS_PREFIX):].split("/"))
                    pb.total = total
                    pb.update(done - pb.n)
                else:
                    f.write(line)
            rc = child.wait()
        if rc != 0:
            tail = (d / "run.log").read_text()[-2000:]
            raise InputError(f"the {build} WAN run failed (exit {rc}); log {d / 'run.log'}:\n"
                             f"{tail}")
        out[build] = load(d)
    return out
