"""Loading the pinned upstream: pin check, backend init, and where upstream's logs go.

This module (and its siblings in `mtplib.runtime`, and the `mtplib.llama` adapter) is the
only code that imports `llama_cpp`; `load` hands out the raw C libraries, so outside those
two rooms only its other names (errors, `upstream_info`, logging) are imported. Import is
lazy so that `mtplib --help`, the contract and the fixture writer work without the
compiled library.
"""

from __future__ import annotations

import collections
import ctypes
import sys
import threading
from pathlib import Path
from types import ModuleType

from mtplib import envs, pins
from mtplib.errors import UpstreamFault
from mtplib.runtime import choose_upstream


class UpstreamError(UpstreamFault):
    """The installed upstream is missing, the wrong build, or refused a call."""


_lock = threading.Lock()
_state: dict = {"llama": None, "ext": None, "cb": None, "log_file": None, "verbose": False}
#: The most recent upstream log lines (parsed for buffer sizes; kept short).
LOG_TAIL: collections.deque[str] = collections.deque(maxlen=4000)
#: upstream's line for each RPC server pair's seam (patches/0007: one per pair, logged once,
#: so kept here for the life of the process: `mtplib.runtime.rpc.seam_links` reads them)
SEAM_LINES: list[str] = []


def check_pins(llama_cpp: ModuleType) -> dict:
    """Verify the imported llama_cpp is the pinned build with RPC and MTP bindings."""
    problems = []
    version = getattr(llama_cpp, "__version__", "?")
    if version != pins.LLAMA_CPP_PYTHON_VERSION:
        problems.append(f"llama-cpp-python is {version}, pinned {pins.LLAMA_CPP_PYTHON_VERSION}")
    lib_dir = Path(llama_cpp.__file__).parent / "lib"
    for name in pins.REQUIRED_LIBS:
        if not (lib_dir / name).exists():
            what = "the RPC backend" if "rpc" in name else "the llama library"
            problems.append(f"{name} (for {what}) missing in {lib_dir}")
    try:
        from llama_cpp import llama_cpp_ext
    except Exception as e:  # noqa: BLE001 - any import failure means no MTP bindings
        problems.append(f"llama_cpp.llama_cpp_ext does not import ({e})")
    else:
        for sym in pins.REQUIRED_EXT_SYMBOLS:
            if not hasattr(llama_cpp_ext, sym):
                problems.append(f"llama_cpp_ext lacks {sym}")
    if problems:
        raise UpstreamError(
            "upstream llama.cpp is not the pinned build: " + "; ".join(problems)
            + ". Fix: " + pins.FIX_HINT)
    marker = Path(llama_cpp.__file__).parent / "MTPLIB_PATCHES"
    lines = marker.read_text().split() if marker.is_file() else []
    build = {"build": "patched" if lines else "stock", "patch_set_sha256": lines[0] if lines
             else None, "patches": lines[1:]}
    return {"version": version, "lib_dir": str(lib_dir), **pins.as_dict(), **build}


def _install_logger() -> None:
    llama = _state["llama"]
    last = {"level": 1}

    @llama.llama_log_callback
    def _log(level: int, text: bytes, _user: ctypes.c_void_p) -> None:
        if level == 5:  # GGML_LOG_LEVEL_CONT continues the previous line's level
            level = last["level"]
        last["level"] = level
        s = text.decode("utf-8", "replace") if text else ""
        LOG_TAIL.append(s)
        if s.startswith("RPC seam ") and len(SEAM_LINES) < 4096:
            SEAM_LINES.append(s)
        f = _state["log_file"]
        if f is not None:
            f.write(s)
        # ggml's levels: 3 WARN, 4 ERROR (MTPLIB_SHOW_ERRORS=1 shows both without --verbose)
        if _state["verbose"] or level in (3, 4) and envs.show_errors():
            sys.stderr.write(s)

    _state["cb"] = _log  # keep a reference: upstream holds the pointer
    llama.llama_log_set(_log, ctypes.c_void_p(0))


def load() -> tuple[ModuleType, ModuleType]:
    """Import llama_cpp once (the build `mtplib.runtime.choose_upstream` chooses, first),
    check the pins, route its logs, init the backend."""
    with _lock:
        if _state["llama"] is None:
            choose_upstream()
            try:
                import llama_cpp
                from llama_cpp import llama_cpp as llama
                from llama_cpp import llama_cpp_ext
            except ImportError as e:
                raise UpstreamError(f"cannot import llama_cpp ({e}). Fix: {pins.FIX_HINT}") from e
            check_pins(llama_cpp)
            _state["llama"], _state["ext"] = llama, llama_cpp_ext
            _install_logger()
            llama.llama_backend_init()
        return _state["llama"], _state["ext"]


#: set to 1 to keep upstream's extra CPU buffer types on a host where mtplib turns them off
EXTRA_BUFTS_ENV = envs.EXTRA_BUFTS


def has_amx(system_info: str) -> bool:
    """Does this build's CPU backend repack weights for AMX (``AMX_INT8 = 1`` in upstream's
    system info: built and running on an AMX CPU)?"""
    return "AMX_INT8 = 1" in system_info


def extra_bufts_ok() -> bool:
    """May a model load use upstream's extra CPU buffer types (weight repacking)? Not on an
    AMX host: the AMX buffer takes DeepSeek-V4's Q8_0 weights (attention, shared experts),
    then a node that uses one is supported by no backend and the scheduler aborts the
    process (GGML_ASSERT(*cur_backend_id != -1) in ggml_backend_sched_split_graph, at the
    pin, stock and patched alike: tests/test_layer_slice.py's typed files). Off there
    (CPU_REPACK goes with it), unless $MTPLIB_EXTRA_BUFTS=1."""
    if envs.extra_bufts():
        return True
    llama, _ = load()
    info = llama.llama_print_system_info()
    return not has_amx(info.decode() if isinstance(info, bytes) else str(info))


def configure_logging(*, verbose: bool = False, log_file: str | Path | None = None) -> None:
    """Upstream's log lines are silent by default; ``verbose`` shows them on stderr."""
    _state["verbose"] = verbose
    old = _state["log_file"]
    if old is not None:
        old.close()
    _state["log_file"] = open(log_file, "a", buffering=1) if log_file else None  # noqa: SIM115


def upstream_info() -> dict:
    """Pins plus what the loaded build says about itself (system info line)."""
    llama, _ = load()
    import llama_cpp

    info = check_pins(llama_cpp)
    sysinfo = llama.llama_print_system_info()
    info["system_info"] = sysinfo.decode() if isinstance(sysinfo, bytes) else str(sysinfo)
    return info
