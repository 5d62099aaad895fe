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
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from mtplib.errors import InputError


@contextlib.contextmanager
def _replacing(path: Path) -> Iterator[str]:
    """A temporary file next to ``path`` (the body writes it); it replaces ``path`` when
    the body succeeds and is deleted when it fails."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        yield tmp
        os.chmod(tmp, 0o644)  # mkstemp makes 0600; a record is as readable as write_text's
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def write_text_atomic(path: str | Path, text: str) -> Path:
    """Write ``text`` to ``path`` atomically (temp file in the same folder + os.replace)."""
    path = Path(path)
    with _replacing(path) as tmp, open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
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


def make_dirs(path: str | Path) -> list[Path]:
    """``mkdir -p path``, returning the folders it created (outermost first), so that a
    failure can remove exactly those (`remove_dirs`) and nothing that was there before."""
    path = Path(path)
    missing = []
    p = path
    while not p.exists() and p != p.parent:
        missing.append(p)
        p = p.parent
    made = []
    for d in reversed(missing):
        try:
            d.mkdir()
        except FileExistsError:  # made meanwhile by someone else: not ours to remove
            if not d.is_dir():
                raise
            continue
        made.append(d)
    return made


def remove_dirs(made: list[Path]) -> None:
    """Remove folders `make_dirs` created, innermost first, where they are empty."""
    for d in reversed(made):
        with contextlib.suppress(OSError):
            d.rmdir()


def copy_atomic(src: str | Path, dst: str | Path) -> Path:
    """``shutil.copy2(src, dst)`` through a temporary file next to ``dst`` + os.replace:
    a reader of ``dst`` sees the old file or the whole new one."""
    import shutil

    dst = Path(dst)
    with _replacing(dst) as tmp:
        shutil.copy2(src, tmp)
    return dst
