"""Run records: what a reader needs to repeat a run (command, commit, pins, hashes, host)."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path

from mtplib import pins
from mtplib.fixture import sha256_file


def now_iso() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")


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


def file_hashes(paths: list[str | Path]) -> dict[str, str]:
    return {str(p): sha256_file(Path(p)) for p in paths}


def base_record(repo: Path, *, argv: list[str] | None = None) -> dict:
    return {
        "command": " ".join(argv if argv is not None else sys.argv),
        "git": git_state(repo),
        "pins": pins.as_dict(),
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "cpu": cpu_info(),
        "gpu": gpu_info(),
        "started": now_iso(),
    }


def write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True, default=str) + "\n")
