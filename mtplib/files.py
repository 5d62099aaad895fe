"""Writing files so that a reader never sees half of one, and names a user gave that must
stay one folder: run records, raw metrics, READMEs and run ids all go through here.

- `write_text_atomic` / `write_json`: the text goes to a temporary file in the same folder
  and replaces the target with ``os.replace`` (atomic on POSIX): a crash, a full disk or a
  kill mid-write leaves the previous file (or none), never a truncated one. A failed write
  removes its temporary file.
- `safe_component`: a run id (or any single name) that cannot leave its parent folder.
- `write_error`: a failed write as one line naming the file and the cause (numpy's short
  write, behind gguf's writer, says neither: "32768 requested and 22144 written";
  `short_write` gives it its cause).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from mtplib.errors import InputError, MtplibError

#: numpy's ``tofile`` (so gguf's writer too) on a short write: no errno, no file name
_SHORT_WRITE = re.compile(r"(\d+) requested and (\d+) written")


def _short_write_cause(folder: Path, missing: int) -> int | None:
    """The errno a short write most likely met: ENOSPC when ``folder``'s file system has
    less room left than the write lacked (``missing`` bytes); None when it cannot say."""
    try:
        st = os.statvfs(folder)
    except OSError:
        return None
    free = (st.f_bfree if os.geteuid() == 0 else st.f_bavail) * st.f_frsize
    return errno.ENOSPC if free < max(missing, 1) else None


def short_write(e: OSError, folder: str | Path) -> OSError:
    """``e`` with its cause where it is numpy's short write (no errno: "32768 requested and
    22144 written"), read from ``folder``'s free space while the partial file still holds
    it: ``OSError(ENOSPC, "No space left on device (32768 bytes requested, 22144
    written)")``. Any other error is returned as it is."""
    m = _SHORT_WRITE.fullmatch(str(e).strip())
    if e.errno is not None or e.filename is not None or m is None:
        return e
    asked, wrote = int(m.group(1)), int(m.group(2))
    sizes = f" ({asked} bytes requested, {wrote} written)"
    code = _short_write_cause(Path(folder), asked - wrote)
    if code is None:
        return OSError(f"the write stopped short and the system gave no reason{sizes}")
    return OSError(code, os.strerror(code) + sizes)


def write_error(path: str | Path, e: OSError) -> OSError:
    """``e``, raised while writing ``path``, as the one line a user can act on: "cannot
    write PATH: No space left on device (32768 bytes requested, 22144 written)" (numpy's
    short write given its cause by `short_write`). An error that already names a file is
    returned as it is, and so is mtplib's own refusal (`WouldOverwrite`: it says what to
    do). The new error keeps ``e``'s errno (so its OSError subclass) and has no filename:
    its message says it."""
    if e.filename is not None or isinstance(e, MtplibError):
        return e
    path = Path(path)
    e = short_write(e, path.parent)
    msg = f"cannot write {path}: {e.strerror or e}"
    return OSError(e.errno, msg) if e.errno is not None else OSError(msg)


@contextlib.contextmanager
def _replacing(path: Path) -> Iterator[str]:
    """A temporary file next to ``path`` (the body writes it); it replaces ``path`` when
    the body succeeds and is deleted when it fails (a failed write names ``path``:
    `write_error`)."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        yield tmp
        os.chmod(tmp, 0o644)  # mkstemp makes 0600; a record is as readable as write_text's
        os.replace(tmp, path)
    except OSError as e:
        named = write_error(path, e)  # before the unlink frees the room it lacked
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        if named is e:
            raise
        raise named from e
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
