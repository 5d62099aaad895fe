"""Facts about the machine and the checkout a measurement ran on (run records, side-by-side
results and evidence all describe the host the same way)."""

from __future__ import annotations

import os
import platform
import subprocess
from pathlib import Path

from mtplib.stamps import now_iso


def git_state(repo: Path) -> dict:
    def git(*args: str) -> str:
        try:
            return subprocess.run(["git", "-C", str(repo), *args], capture_output=True,
                                  text=True, timeout=10).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""

    commit = git("rev-parse", "HEAD")
    dirty = bool(git("status", "--porcelain", "--untracked-files=no"))
    return {"commit": commit or None, "dirty": dirty}


def cpu_info() -> dict:
    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal"):
                mem = int(line.split()[1]) * 1024
    except OSError:
        pass
    return {"model": model, "logical_cores": os.cpu_count(), "mem_total_bytes": mem,
            "machine": platform.machine()}


def gpu_info() -> list[dict]:
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return []
    gpus = []
    for line in out.stdout.strip().splitlines():
        name, driver, mem = (x.strip() for x in line.split(","))
        gpus.append({"name": name, "driver": driver, "memory": mem})
    return gpus


def load_average() -> list[float] | None:
    """The 1, 5 and 15 minute load averages (None where the OS has none): on a shared host
    they say how much of a timing was the measurement's own."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


#: how a provenance block's facts were recorded: by the run itself, or afterwards
AT_RUN_TIME = "at run time"
FROM_HISTORY = "recorded afterwards from git history"


def provenance(repo: Path, build: dict, argv: list[str]) -> dict:
    """What a results file says it ran, written by the run itself: the command, the
    checkout's commit (and whether it had uncommitted changes), the upstream build and
    patch set, the host, the load average and the start; `finish` adds the end. ``build``
    is `mtplib.runtime.build_info()` (this room is below the runtime, so callers pass it)."""
    return {"recorded": AT_RUN_TIME, "command": " ".join(argv), "git": git_state(repo),
            "build": build, "host": {**cpu_info(), "gpu": gpu_info()},
            "loadavg_start": load_average(), "started": now_iso()}


def finish(prov: dict) -> dict:
    """``prov`` with the end time and the load average at the end."""
    return {**prov, "loadavg_end": load_average(), "ended": now_iso()}
