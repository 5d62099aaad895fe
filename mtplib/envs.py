"""Every environment variable mtplib reads, typed, and read in this one module (after vLLM's
``vllm/envs.py``): one accessor per variable, read when it is called, never at import, so a
test's ``monkeypatch.setenv`` holds and importing mtplib reads nothing. Each accessor's
docstring says what the variable does and its default; `VARS` holds them all, with those
only the shell scripts read (`SHELL_VARS`), and docs/envs.md's table is generated from it
(`table`; tests/test_envs.py checks both that and that no other module reads the
environment). Copying this process's environment to build a child's is not reading it.

Foundation layer: imports only the standard library and `mtplib.errors`.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from mtplib.errors import InputError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Var:
    """One environment variable: its name, who reads it (``mtplib`` for this module's
    accessor, else the script), and what it does with its default (one paragraph)."""

    name: str
    read_by: str
    doc: str
    accessor: str | None = None


#: every variable, by name, in the order of docs/envs.md's table
VARS: dict[str, Var] = {}


def _var(name: str) -> Callable[[Callable], Callable]:
    """Register an accessor as ``name``'s, its docstring as the variable's doc."""
    def wrap(fn: Callable) -> Callable:
        VARS[name] = Var(name, "mtplib", " ".join((fn.__doc__ or "").split()), fn.__name__)
        return fn
    return wrap


def _text(name: str) -> str:
    """The variable's value, stripped ("" when unset)."""
    return os.environ.get(name, "").strip()


# -- the upstream build and how it runs ---------------------------------------------------
UPSTREAM = "MTPLIB_UPSTREAM"
UPSTREAM_BUILDS = ("stock", "patched")


@_var(UPSTREAM)
def upstream() -> str | None:
    """Which upstream build a process loads: ``stock`` (the pinned llama-cpp-python) or
    ``patched`` (``./dev.sh setup``'s, in .upstream/patched). Default: unset, which means
    patched where it is installed, else stock; the choice is written back for child
    processes when upstream is first loaded (`mtplib.runtime.choose_upstream`)."""
    which = _text(UPSTREAM)
    if not which:
        return None
    if which not in UPSTREAM_BUILDS:
        raise InputError(f"{UPSTREAM} must be one of {', '.join(UPSTREAM_BUILDS)}, "
                         f"got {which!r}")
    return which


SHOW_ERRORS = "MTPLIB_SHOW_ERRORS"


@_var(SHOW_ERRORS)
def show_errors() -> bool:
    """Any non-empty value: upstream's warning and error log lines go to stderr even without
    ``--verbose``. Default: unset, upstream's log is silent (kept for diagnostics)."""
    return bool(os.environ.get(SHOW_ERRORS))


EXTRA_BUFTS = "MTPLIB_EXTRA_BUFTS"


@_var(EXTRA_BUFTS)
def extra_bufts() -> bool:
    """``1``: keep upstream's extra CPU buffer types (weight repacking) on an AMX host,
    where mtplib turns them off because the scheduler aborts on V4's Q8_0 weights. Default:
    unset, mtplib decides per host."""
    return os.environ.get(EXTRA_BUFTS) == "1"


PIPELINE_PARALLEL = "MTPLIB_PIPELINE_PARALLEL"


@_var(PIPELINE_PARALLEL)
def pipeline_parallel() -> bool:
    """``1``: a model split over several devices keeps upstream's pipeline parallelism
    (four copies of each split input, graphs re-sent over RPC). Default: unset, one copy."""
    return os.environ.get(PIPELINE_PARALLEL) == "1"


CACHE_DIR = "MTPLIB_CACHE_DIR"
#: the old name of $MTPLIB_CACHE_DIR (lab/upstream_tools.py and dev.sh read it): still
#: taken, with one warning per process
CACHE_ALIAS = "MTPLIB_CACHE"
_warned: set[str] = set()


@_var(CACHE_DIR)
def cache_dir() -> Path:
    """The folder of mtplib's caches: row-source decisions (``row-source/``), the pinned
    sdist (``sdist/``, ./dev.sh), upstream's built tools (``upstream-tools/``) and wheels
    (``wheels/``, ./dev.sh). Default: ~/.cache/mtplib. ``MTPLIB_CACHE``, its old name, is
    still taken (with one warning) when this one is unset."""
    root = _text(CACHE_DIR)
    old = _text(CACHE_ALIAS)
    if old and CACHE_ALIAS not in _warned:
        _warned.add(CACHE_ALIAS)
        log.warning("%s is deprecated: set %s instead%s", CACHE_ALIAS, CACHE_DIR,
                    f" ({CACHE_ALIAS} is ignored: {CACHE_DIR} is set)" if root else "")
    return Path(root or old or Path.home() / ".cache" / "mtplib")


VARS[CACHE_ALIAS] = Var(CACHE_ALIAS, "mtplib, dev.sh",
                        f"Deprecated: the old name of {CACHE_DIR}, taken (with one warning) "
                        f"when {CACHE_DIR} is unset.", "cache_dir")


# -- shards and the ranged runtime --------------------------------------------------------
SHARD_DEVICE = "MTPLIB_SHARD_DEVICE"


@_var(SHARD_DEVICE)
def shard_device() -> str | None:
    """The device ``mtplib shard serve`` serves when ``--device`` is not given: ``cpu`` or
    ``gpu`` (so the shards a lane starts serve the GPU on a GPU machine). Default: cpu."""
    return _text(SHARD_DEVICE) or None


SHARD_SILENCE_S = "MTPLIB_SHARD_SILENCE_S"


@_var(SHARD_SILENCE_S)
def shard_silence_s() -> float | None:
    """Seconds a ranged call may go without progress from a shard before it fails (a hung
    shard). Default: 15 s."""
    raw = _text(SHARD_SILENCE_S)
    if not raw:
        return None
    try:
        v = float(raw)
    except ValueError:
        v = math.nan
    if not (0 < v < math.inf):
        raise InputError(f"{SHARD_SILENCE_S} must be a number of seconds > 0, got {raw!r}")
    return v


FORWARD_ALLOC_SIZES = "MTPLIB_FORWARD_ALLOC_SIZES"


@_var(FORWARD_ALLOC_SIZES)
def forward_alloc_sizes() -> bool:
    """Anything but empty or ``0``: every allocation-size query goes to the shards, none is
    answered by the client's relays (for side-by-side runs). Default: unset, the relays
    answer a CPU shard's."""
    return os.environ.get(FORWARD_ALLOC_SIZES, "") not in ("", "0")


PDEATHSIG = "MTPLIB_PDEATHSIG"


@_var(PDEATHSIG)
def pdeathsig() -> bool:
    """``1`` (set by mtplib's spawner for its children, not by users): the child asks the
    kernel to kill it when the spawning thread's process dies. Default: unset."""
    return os.environ.get(PDEATHSIG) == "1"


# -- policy, lanes, the service, logging --------------------------------------------------
POLICY = "MTPLIB_POLICY"


@_var(POLICY)
def policy() -> str | None:
    """The deployment policy when a caller names none (a lane sets it for its notebooks):
    ``alpha`` disables MTP, ``beta`` allows it. Default: beta."""
    return os.environ.get(POLICY) or None


MODEL_ROOT = "MTPLIB_MODEL_ROOT"


@_var(MODEL_ROOT)
def model_root() -> str | None:
    """Where a lane that needs real model files finds them, when its params file names no
    ``models.storage_root``. Default: unset (such a lane stops with a message)."""
    return os.environ.get(MODEL_ROOT) or None


API_KEY = "MTPLIB_API_KEY"


@_var(API_KEY)
def api_key() -> str | None:
    """The key ``mtplib serve`` requires when ``--api-key`` is not given (keeps it out of
    the process list); set but empty is refused. Default: unset, no key."""
    return os.environ.get(API_KEY)


LOG_LEVEL = "MTPLIB_LOG_LEVEL"
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")


@_var(LOG_LEVEL)
def log_level() -> int:
    """The lowest level of mtplib's log lines an entry point (the CLI, a ``python -m``
    module) shows on stderr: DEBUG, INFO, WARNING or ERROR. Default: INFO."""
    raw = _text(LOG_LEVEL).upper() or "INFO"
    if raw not in LOG_LEVELS:
        raise InputError(f"{LOG_LEVEL} must be one of {', '.join(LOG_LEVELS)}, "
                         f"got {os.environ.get(LOG_LEVEL)!r}")
    return logging.getLevelName(raw)


# -- variables of other tools that mtplib reads -------------------------------------------
JUPYTER_PATH = "JUPYTER_PATH"


@_var(JUPYTER_PATH)
def jupyter_path() -> list[str]:
    """Jupyter's data folders (Jupyter's own variable): a lane's kernels run with this
    interpreter's folder put first. Default: unset, Jupyter's defaults."""
    return [d for d in os.environ.get(JUPYTER_PATH, "").split(os.pathsep) if d]


VARS["OMP_WAIT_POLICY"] = Var(
    "OMP_WAIT_POLICY", "libgomp (set by mtplib)",
    "OpenMP's wait policy for upstream's CPU threads. mtplib sets PASSIVE when it first "
    "loads upstream, unless it is set (`mtplib.runtime.OMP_DEFAULTS`): a spinning thread "
    "holds the core a shard beside it needs. Written, never read, by mtplib.")

#: variables only the shell scripts (./dev.sh, device/h200_run.sh) or the tests read
SHELL_VARS = (
    Var("MTPLIB_WHEEL_CACHE", "dev.sh",
        "Where ./dev.sh keeps the pinned llama-cpp-python wheel it builds. Default: "
        "$MTPLIB_CACHE_DIR/wheels."),
    Var("MTPLIB_SKIP_PATCHED", "dev.sh, tests",
        "Non-empty: ./dev.sh setup does not build the patched upstream (the suite then "
        "runs on stock). Default: unset, it is built."),
    Var("MTPLIB_LAB_PORT", "dev.sh", "The port of ./dev.sh lab. Default: a free one."),
    Var("MTPLIB_DEVICE_BUNDLE", "device/h200_run.sh",
        "The bundle the device run unpacks. Default: .device."),
    Var("MTPLIB_DEVICE_WORK", "device/h200_run.sh",
        "The device run's work folder. Default: /tmp/mtplib-device."),
    Var("MTPLIB_DEVICE_REHEARSAL", "device/h200_run.sh",
        "Non-empty: rehearse the device run on a CPU (CUDA off). Default: unset."),
    Var("MTPLIB_DEVICE_JOBS", "device/h200_run.sh", "Build jobs. Default: nproc."),
    Var("MTPLIB_DEVICE_LANE", "device/h200_run.sh",
        "The lane file the device run runs. Default: params/gpu-fixture.yaml "
        "(cpu-fixture.yaml in a rehearsal)."),
    Var("MTPLIB_DEVICE_SKIP", "device/h200_run.sh",
        "Phases of the device run to leave out, space-separated. Default: none (the "
        "slice in a rehearsal)."),
    Var("MTPLIB_LAYER_STEPS", "device/h200_run.sh",
        "Steps of the device run's layer slice. Default: 30."),
    Var("MTPLIB_RPC_REPORT", "tests", "tests/test_rpc.py writes its report there if set."),
    Var("MTPLIB_TEST_SHARD_MARK", "tests",
        "A marker tests/test_local_shards_env.py passes to shards."),
)
VARS.update((v.name, v) for v in SHELL_VARS)


def table() -> str:
    """docs/envs.md's table (Markdown), from `VARS`."""
    rows = ["| variable | read by | what it does; default |", "| --- | --- | --- |"]
    for v in VARS.values():
        who = f"{v.read_by} (`envs.{v.accessor}()`)" if v.accessor else v.read_by
        rows.append(f"| `{v.name}` | {who} | {v.doc.replace('|', '/')} |")
    return "\n".join(rows) + "\n"
