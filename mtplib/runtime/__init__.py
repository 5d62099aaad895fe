"""The only room that touches llama.cpp (ctypes, llama_cpp).

Which upstream build it loads is chosen here, before any module imports ``llama_cpp``:
``MTPLIB_UPSTREAM=stock`` (default: the pinned llama-cpp-python in the environment) or
``patched`` (the same pin with ``patches/*.patch`` applied, installed by ``./dev.sh setup``
into ``.upstream/patched``). Child processes (shards, the ranged worker) inherit the choice.
"""

from __future__ import annotations

import os
import sys

from mtplib.errors import InputError
from mtplib.paths import REPO

UPSTREAM_BUILDS = ("stock", "patched")
PATCHED_DIR = REPO / ".upstream" / "patched"


def selected_upstream() -> str:
    which = os.environ.get("MTPLIB_UPSTREAM", "stock") or "stock"
    if which not in UPSTREAM_BUILDS:
        raise InputError(f"MTPLIB_UPSTREAM must be one of {', '.join(UPSTREAM_BUILDS)}, "
                         f"got {which!r}")
    return which


def _select() -> None:
    if selected_upstream() != "patched":
        return
    if not (PATCHED_DIR / "llama_cpp" / "MTPLIB_PATCHES").is_file():
        raise InputError(f"MTPLIB_UPSTREAM=patched but {PATCHED_DIR} holds no patched build; "
                         "run ./dev.sh setup (or ./dev.sh patched)")
    loaded = sys.modules.get("llama_cpp")
    if loaded is not None and not str(loaded.__file__).startswith(str(PATCHED_DIR)):
        raise InputError("MTPLIB_UPSTREAM=patched, but the stock llama_cpp is already imported "
                         "in this process; set the variable before starting Python")
    if str(PATCHED_DIR) not in sys.path:
        sys.path.insert(0, str(PATCHED_DIR))


_select()
