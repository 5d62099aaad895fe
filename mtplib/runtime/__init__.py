"""The native room: the code that loads llama.cpp and calls C (ctypes, llama_cpp, the raw
bindings in `lib` and `ggml_tensor`, libc's prctl in `libc`). One other room imports
llama_cpp: `mtplib.llama`, the adapter that plugs MTP into llama-cpp-python's own `Llama`
(it subclasses its classes and swaps the Llama's context through this room's bindings).
Every other room reaches upstream through this room's objects; tests/test_layers.py
checks which rooms import what.

Which upstream build it loads is chosen here, before any module imports ``llama_cpp``:
``patched`` (the same pin with ``patches/*.patch`` applied, installed by ``./dev.sh setup``
into ``.upstream/patched``: the default wherever that build exists, because only it keeps
every V4 cache on its own shard) or ``stock`` (the pinned llama-cpp-python in the
environment: the default where no patched build was made). ``MTPLIB_UPSTREAM=stock|patched``
chooses explicitly. The choice is made by `choose_upstream`, called where upstream is first
loaded (`mtplib.runtime.lib.load`, the adapter `mtplib.llama.draft`), never by importing
mtplib: child processes (shards, the ranged worker) inherit it from there.
"""

from __future__ import annotations

import os
import sys

from mtplib import envs
from mtplib.errors import InputError
from mtplib.paths import REPO

UPSTREAM_BUILDS = envs.UPSTREAM_BUILDS
PATCHED_DIR = REPO / ".upstream" / "patched"


def patched_installed() -> bool:
    """``./dev.sh setup`` built and installed the patched upstream here."""
    return (PATCHED_DIR / "llama_cpp" / "MTPLIB_PATCHES").is_file()


def selected_upstream() -> str:
    """$MTPLIB_UPSTREAM if set, else ``patched`` where it is installed, else ``stock``."""
    return envs.upstream() or ("patched" if patched_installed() else "stock")


def build_info() -> dict:
    """The upstream build this process loads, as results name it: ``{"build": "stock" |
    "patched", "patch_set_sha256", "patches"}`` (from the marker ./dev.sh writes)."""
    which = selected_upstream()
    marker = PATCHED_DIR / "llama_cpp" / "MTPLIB_PATCHES"
    lines = marker.read_text().split() if which == "patched" and marker.is_file() else []
    return {"build": which, "patch_set_sha256": lines[0] if lines else None,
            "patches": lines[1:]}


#: OpenMP settings for upstream's CPU threads, defaults only (a value in the environment
#: wins). libgomp reads them once, when llama_cpp loads its libraries, so `choose_upstream`
#: sets them before the first import of it, and children (shards, the ranged worker,
#: kernels, upstream's own tools: `mtplib.lab.upstream_tools`) inherit them.
#: ggml's CPU backend is built with OpenMP: every graph node ends in an ``omp barrier`` and
#: every graph in a parallel region's end, where libgomp's default spins (GOMP_SPINCOUNT,
#: 300,000 iterations) before it sleeps. On a host whose cores are shared (shards next to
#: the client, the way anyone tries shards first) a spinning thread holds the core the
#: thread it waits for needs: drafting and feeding on the client ran about 90x slower
#: (issue 29). PASSIVE sleeps at once.
OMP_DEFAULTS = {"OMP_WAIT_POLICY": "PASSIVE"}

_chosen: dict[str, str] = {}


def choose_upstream() -> str:
    """Make this process load the selected build (`selected_upstream`) and return its name;
    the first call acts, later ones return the same name. Called right before the first
    import of llama_cpp (`mtplib.runtime.lib.load`, `mtplib.llama.draft`), never at import
    of mtplib, since it changes the process: `OMP_DEFAULTS` into ``os.environ`` (unless
    set); ``MTPLIB_UPSTREAM`` into ``os.environ``, so that children load the same build;
    for the patched build, its folder first on ``sys.path``. InputError where the patched
    build is asked for but missing, or the stock llama_cpp is already imported."""
    if "build" in _chosen:
        return _chosen["build"]
    which = selected_upstream()
    if which == "patched":
        if not patched_installed():
            raise InputError(f"MTPLIB_UPSTREAM=patched but {PATCHED_DIR} holds no patched "
                             "build; run ./dev.sh setup (or ./dev.sh patched)")
        loaded = sys.modules.get("llama_cpp")
        if loaded is not None and not str(loaded.__file__).startswith(str(PATCHED_DIR)):
            raise InputError("MTPLIB_UPSTREAM=patched, but the stock llama_cpp is already "
                             "imported in this process; set the variable before starting "
                             "Python")
    for key, value in OMP_DEFAULTS.items():
        os.environ.setdefault(key, value)
    # children (shards, the ranged worker, papermill kernels) load the same build
    os.environ[envs.UPSTREAM] = which
    if which == "patched" and str(PATCHED_DIR) not in sys.path:
        sys.path.insert(0, str(PATCHED_DIR))
    _chosen["build"] = which
    return which
