"""File hashes and timestamps, one definition each: run records, evidence, certificates and
fixtures all identify files and moments the same way."""

from __future__ import annotations

import hashlib
from datetime import UTC, datetime
from pathlib import Path


def sha256_file(path: str | Path, chunk: int = 1 << 22) -> str:
    """Hex sha256 of a file, read in chunks (GGUFs can be 150+ GB)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while b := f.read(chunk):
            h.update(b)
    return h.hexdigest()


def now_iso() -> str:
    """UTC now, ISO 8601 to the second."""
    return datetime.now(UTC).isoformat(timespec="seconds")


def run_stamp() -> str:
    """UTC now as a compact id part (20261130T154200Z)."""
    return datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
