"""Facts about the machine and the checkout a measurement ran on (run records, side-by-side
results and evidence all describe the host the same way)."""

from __future__ import annotations

import os
import platform
import subprocess
from pathlib import Path


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
