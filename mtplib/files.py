"""Writing files so that a reader never sees half of one, and names a user gave that must
stay one folder: run records, raw metrics, READMEs and run ids all go through here.

- `write_text_atomic` / `write_json`: the text goes to a temporary file in the same folder
  and replaces the target with ``os.replace`` (atomic on POSIX): a crash, a full disk or a
  kill mid-write leaves the previous file (or none), never a truncated one. A failed write
  removes its temporary file.
- `safe_component`: a run id (or any single name) that cannot leave its parent folder.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any

from mtplib.errors import InputError


def write_text_atomic(path: str | Path, text: str) -> Path:
    """Write ``text`` to ``path`` atomically (temp file in the same folder + os.replace)."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)  # mkstemp makes 0600; a record is as readable as write_text's
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return path


def write_json(path: str | Path, data: Any, *, indent: int | None = 2,
               sort_keys: bool = False, default: Any = None, end: str = "\n") -> Path:
    """``data`` as JSON (then ``end``) at ``path``, atomically. Serialized first, so an
    unserializable value raises before anything is written."""
    text = json.dumps(data, indent=indent, sort_keys=sort_keys, default=default) + end
    return write_text_atomic(path, text)


def safe_component(name: object, what: str = "--run-id") -> str:
    """``name`` if it is one plain path component (no separator, not '.', '..' or hidden,
    printable, at most 200 characters), else InputError naming ``what``: joined to a
    parent folder it stays directly inside that folder."""
    ok = (isinstance(name, str) and 0 < len(name) <= 200 and name not in (".", "..")
          and not name.startswith(".") and "/" not in name and "\\" not in name
          and "\x00" not in name and name.isprintable() and name.strip() == name)
    if not ok:
        raise InputError(f"{what} must be a single folder name (letters, digits, '-', '_', "
                         f"'.'; no '/', no leading '.'; at most 200 characters), got {name!r}")
    return name
