"""Run records: what a reader needs to repeat a run (command, commit, pins, hashes, host)."""

from __future__ import annotations

import json
import platform
import sys
from pathlib import Path

from mtplib import files, pins
from mtplib.errors import InputError
from mtplib.host import cpu_info, git_state, gpu_info, load_average
from mtplib.stamps import now_iso, sha256_file


def file_hashes(paths: list[str | Path]) -> dict[str, str]:
    return {str(p): sha256_file(Path(p)) for p in paths}


def base_record(repo: Path, *, argv: list[str] | None = None) -> dict:
    from mtplib.runtime import build_info

    return {
        "command": " ".join(argv if argv is not None else sys.argv),
        "git": git_state(repo),
        "pins": pins.as_dict(),
        # the upstream build this run and its children load (stock / patched, patch ids)
        "upstream": build_info(),
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "cpu": cpu_info(),
        "gpu": gpu_info(),
        # on a shared host the load says how much of a timing was the run's own
        "loadavg_start": load_average(),
        "started": now_iso(),
    }


def end_record(record: dict, status: str, **more) -> dict:
    """``record`` completed: the end time, the load average at the end and the status."""
    record.update(ended=now_iso(), loadavg_end=load_average(), status=status, **more)
    return record


def read_record(run_dir: str | Path) -> dict:
    """A run folder's ``run_record.json``, or InputError saying why it cannot be used
    (missing, unreadable, truncated or not a JSON object)."""
    p = Path(run_dir) / "run_record.json"
    if not p.is_file():
        raise InputError(f"{run_dir} is not a run directory (no run_record.json)")
    try:
        rec = json.loads(p.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as e:
        why = e.strerror if isinstance(e, OSError) else " ".join(str(e).split())
        raise InputError(f"{p} cannot be read as JSON ({why}): the run record is damaged "
                         "or was cut short; rerun the lane") from None
    if not isinstance(rec, dict):
        raise InputError(f"{p} is not a run record (a JSON object), got "
                         f"{type(rec).__name__}")
    return rec


def write_json(path: Path, data: dict) -> None:
    """A run record, atomically (a kill or a full disk never leaves half of one)."""
    files.write_json(path, data, indent=2, sort_keys=True, default=str)
