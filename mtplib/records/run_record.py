"""Run records: what a reader needs to repeat a run (command, commit, pins, hashes, host)."""

from __future__ import annotations

import platform
import sys
from pathlib import Path

from mtplib import files, pins
from mtplib.host import cpu_info, git_state, gpu_info
from mtplib.stamps import now_iso, sha256_file


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
    """A run record, atomically (a kill or a full disk never leaves half of one)."""
    files.write_json(path, data, indent=2, sort_keys=True, default=str)
