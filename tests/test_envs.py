"""Issue 42, point 2: one module reads the environment (`mtplib.envs`, every variable typed
and read when asked), docs/envs.md's table is that module's, and importing mtplib changes
no process state (the environment, the import path, signal handlers, logging, the
excepthook); upstream's build is chosen where it is first loaded (`choose_upstream`)."""

from __future__ import annotations

import ast
import json
import logging
import re
import subprocess
import sys
from pathlib import Path

import pytest

from mtplib import envs
from mtplib.errors import InputError

REPO = Path(__file__).resolve().parent.parent
PKG = REPO / "mtplib"
#: the one module that reads the environment
READER = PKG / "envs.py"
#: methods of os.environ that read it (``setdefault`` writes a default: a write)
READS = {"get", "items", "keys", "values", "__getitem__", "__contains__"}
#: where a module may read variables that are not mtplib's (never a MTPLIB_* one), and why
SCRIPT_PARAMETERS = {
    "mtplib/reports/": "the evidence's reproduction scripts take their own parameters "
                       "(MODEL, NT, TRUNK, ...) from the environment, as they always have: "
                       "a script's inputs, not a setting of mtplib's",
}


def _name(node: ast.AST | None) -> str | None:
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None


def _environ_reads(source: str) -> list[tuple[int, str, str | None]]:
    """(line, what, the variable's name where it is a literal) of each read of the
    environment in ``source``: ``os.getenv``,
    ``os.environ.get/items/...``, ``os.environ[...]`` read, ``... in os.environ``. Copying it
    whole (``dict(os.environ, ...)``, ``os.environ.copy()``, ``**os.environ``: a child's
    environment) and writing it (``os.environ[k] = v``, ``update``, ``pop``) are not reads."""
    tree = ast.parse(source)
    parents = {c: n for n in ast.walk(tree) for c in ast.iter_child_nodes(n)}
    imported = [(a.name, a.asname or a.name) for n in ast.walk(tree)
                if isinstance(n, ast.ImportFrom) and n.module == "os" for a in n.names]
    environ = {"os.environ"} | {alias for name, alias in imported if name == "environ"}
    getenv = {"os.getenv"} | {alias for name, alias in imported if name == "getenv"}
    found = []

    def arg0(call: ast.AST | None) -> str | None:
        return _name(call.args[0]) if isinstance(call, ast.Call) and call.args else None

    for node in ast.walk(tree):
        text = ast.unparse(node) if isinstance(node, ast.Attribute | ast.Name) else ""
        if text in getenv:
            found.append((node.lineno, "os.getenv", arg0(parents.get(node))))
        if text not in environ:
            continue
        up = parents.get(node)
        if isinstance(up, ast.Attribute) and up.attr in READS:
            found.append((node.lineno, f"os.environ.{up.attr}", arg0(parents.get(up))))
        elif isinstance(up, ast.Subscript) and isinstance(up.ctx, ast.Load):
            found.append((node.lineno, "os.environ[...]", _name(up.slice)))
        elif isinstance(up, ast.Compare) and node in up.comparators and any(
                isinstance(op, ast.In | ast.NotIn) for op in up.ops):
            found.append((node.lineno, "in os.environ", _name(up.left)))
    return sorted(found)


def _offence(rel: str, name: str | None) -> bool:
    if any(rel.startswith(k) for k in SCRIPT_PARAMETERS):
        return name is not None and name.startswith("MTPLIB_")
    return True


def test_only_envs_reads_the_environment():
    offences = [f"{rel}:{line}: {what}" for p in sorted(PKG.rglob("*.py")) if p != READER
                for line, what, name in _environ_reads(p.read_text())
                if _offence(rel := p.relative_to(REPO).as_posix(), name)]
    assert not offences, "read the variable through mtplib.envs:\n" + "\n".join(offences)
    assert not _offence("mtplib/reports/x.py", "NT")
    assert _offence("mtplib/reports/x.py", "MTPLIB_POLICY") and _offence("mtplib/x.py", "NT")


def test_the_environment_scan_sees_each_kind_of_read():
    reads = ("import os\nos.environ.get('X')\nos.getenv('X')\nos.environ['X']\n"
             "'X' in os.environ\nfor k, v in os.environ.items(): pass\n"
             "from os import environ as E, getenv\nE.get('Y')\ngetenv('Y')\n")
    assert [(w, n) for _, w, n in _environ_reads(reads)] == [
        ("os.environ.get", "X"), ("os.getenv", "X"), ("os.environ[...]", "X"),
        ("in os.environ", "X"), ("os.environ.items", None), ("os.environ.get", "Y"),
        ("os.getenv", "Y")]
    writes = ("import os\nenv = dict(os.environ, A='1')\nc = os.environ.copy()\n"
              "d = {**os.environ}\nos.environ['A'] = '1'\nos.environ.update(d)\n"
              "os.environ.pop('A', None)\nos.environ.setdefault('B', '2')\n"
              "e = dict(os.environ if c else d)\n")
    assert _environ_reads(writes) == []


# -- the accessors ---------------------------------------------------------------------------
def test_accessors_read_when_called(monkeypatch):
    monkeypatch.delenv(envs.POLICY, raising=False)
    assert envs.policy() is None
    monkeypatch.setenv(envs.POLICY, "alpha")
    assert envs.policy() == "alpha"
    monkeypatch.setenv(envs.SHARD_SILENCE_S, " 4.5 ")
    assert envs.shard_silence_s() == 4.5
    for bad in ("0", "-1", "soon", "inf", "nan"):
        monkeypatch.setenv(envs.SHARD_SILENCE_S, bad)
        with pytest.raises(InputError, match="MTPLIB_SHARD_SILENCE_S must be"):
            envs.shard_silence_s()
    monkeypatch.setenv(envs.FORWARD_ALLOC_SIZES, "0")
    assert not envs.forward_alloc_sizes()
    monkeypatch.setenv(envs.FORWARD_ALLOC_SIZES, "yes")
    assert envs.forward_alloc_sizes()
    monkeypatch.setenv(envs.UPSTREAM, "fancy")
    with pytest.raises(InputError, match="MTPLIB_UPSTREAM must be one of stock, patched"):
        envs.upstream()
    monkeypatch.setenv(envs.LOG_LEVEL, "debug")
    assert envs.log_level() == logging.DEBUG
    monkeypatch.setenv(envs.LOG_LEVEL, "loud")
    with pytest.raises(InputError, match="MTPLIB_LOG_LEVEL must be one of"):
        envs.log_level()


def test_one_cache_root_and_its_old_name_warns_once(monkeypatch, tmp_path, caplog):
    monkeypatch.setattr(envs, "_warned", set())
    monkeypatch.delenv(envs.CACHE_ALIAS, raising=False)
    monkeypatch.setenv(envs.CACHE_DIR, str(tmp_path / "new"))
    assert envs.cache_dir() == tmp_path / "new"
    monkeypatch.delenv(envs.CACHE_DIR)
    assert envs.cache_dir() == Path.home() / ".cache" / "mtplib"
    monkeypatch.setenv(envs.CACHE_ALIAS, str(tmp_path / "old"))
    with caplog.at_level(logging.WARNING, logger="mtplib.envs"):
        assert envs.cache_dir() == tmp_path / "old"
        assert envs.cache_dir() == tmp_path / "old"
    warned = [r.getMessage() for r in caplog.records if r.name == "mtplib.envs"]
    assert warned == ["MTPLIB_CACHE is deprecated: set MTPLIB_CACHE_DIR instead"]
    # every cache of mtplib's under the one root: row-source decisions, sdist, built tools
    from mtplib.lab import upstream_tools as U
    from mtplib.runtime import row_source

    monkeypatch.setenv(envs.CACHE_DIR, str(tmp_path / "new"))
    assert row_source._cache_dir() == tmp_path / "new" / "row-source"
    assert U.tools_dir().parent == tmp_path / "new" / "upstream-tools"
    assert tmp_path / "new" / "sdist" / U.SDIST_NAME in U.sdist_candidates()


# -- the table -------------------------------------------------------------------------------
def test_docs_table_is_generated_from_the_module():
    doc = (REPO / "docs" / "envs.md").read_text()
    begin, end = "<!-- envs table: begin -->\n", "<!-- envs table: end -->"
    assert begin in doc and end in doc
    shown = doc.split(begin, 1)[1].split(end, 1)[0]
    assert shown == envs.table(), ("docs/envs.md's table is stale; regenerate it: "
                                   "python -c 'from mtplib import envs; print(envs.table())'")
    for v in envs.VARS.values():
        assert v.doc and "Default" in v.doc or v.read_by != "mtplib", v.name
        if v.accessor is not None:
            assert callable(getattr(envs, v.accessor)), v.name


def test_every_variable_named_anywhere_is_in_the_table():
    """Each ``MTPLIB_*`` name in the scripts, docs, tests and package is a variable `envs`
    lists (MTPLIB_PATCHES is the patched build's marker file; MTPLIB_ONLY a Python name)."""
    not_vars = {"MTPLIB_PATCHES", "MTPLIB_ONLY"}
    files = [REPO / "dev.sh", *REPO.glob("device/*.sh"), *REPO.glob("docs/*.md"),
             *REPO.glob("tests/*.py"), *PKG.rglob("*.py"), *REPO.glob(".ci/*")]
    named = {m for f in files if f.is_file()
             for m in re.findall(r"\bMTPLIB_[A-Z0-9_]+\b", f.read_text())}
    assert named - not_vars - set(envs.VARS) == set()


# -- importing mtplib ------------------------------------------------------------------------
_STATE = r"""
import json, logging, os, signal, sys, threading

def state():
    sigs = {int(s): repr(signal.getsignal(s)) for s in signal.valid_signals()
            if s not in (signal.SIGKILL, signal.SIGSTOP)}
    return {"environ": dict(os.environ), "path": list(sys.path), "signals": sigs,
            "excepthook": repr(sys.excepthook), "threading": repr(threading.excepthook),
            "root": repr(logging.getLogger().handlers), "level": logging.getLogger().level,
            "mtplib": repr(logging.getLogger("mtplib").handlers),
            "disabled": logging.root.manager.disable}
"""


def _import_state(mods: list[str], before: str = "") -> tuple[dict, dict, bool]:
    code = (_STATE + before + "\nb = state()\nimport importlib\n"
            + f"for m in {mods!r}: importlib.import_module(m)\n"
            + "print(json.dumps([b, state(), 'llama_cpp' in sys.modules]))\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=300, cwd=REPO)
    assert p.returncode == 0, p.stderr[-3000:]
    b, a, loaded = json.loads(p.stdout.strip().splitlines()[-1])
    return b, a, loaded


def _modules() -> list[str]:
    out = []
    for p in sorted(PKG.rglob("*.py")):
        parts = list(p.relative_to(REPO).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out.append(".".join(parts))
    return out


def test_importing_mtplib_changes_no_process_state():
    """Every module but the adapter's (`mtplib.llama`, below) and the ``python -m`` scripts
    (``__main__``), in one fresh process. papermill is imported first, as papermill itself
    does: its engine entry point is `mtplib.records.papermill_engine`, which wraps the
    excepthook on import by design (papermill's plugins have no other hook) and cannot be
    the first importer of papermill.engines (a circular import)."""
    import importlib.util

    # mtplib.train's modules need the optional `train` extra (torch): without it (CI)
    # they are not importable at all, so they are checked where torch is installed
    no_torch = importlib.util.find_spec("torch") is None
    mods = [m for m in _modules()
            if not m.startswith("mtplib.llama") and not m.endswith("__main__")
            and not (no_torch and m.startswith("mtplib.train."))]
    assert len(mods) > 100
    b, a, loaded = _import_state(mods, before="import papermill.engines")
    for key in b:
        assert a[key] == b[key], key
    assert not loaded, "importing mtplib loaded llama_cpp"


def test_the_adapter_changes_only_the_build_choice():
    """`mtplib.llama` subclasses llama_cpp's draft-model class, so importing it loads
    upstream: the build is chosen first, explicitly (`choose_upstream`), and that is all it
    changes: MTPLIB_UPSTREAM and the OpenMP defaults for children, the patched build's
    folder on the path."""
    from mtplib.runtime import OMP_DEFAULTS, PATCHED_DIR

    b, a, loaded = _import_state(["mtplib.llama", "mtplib.llama.build", "mtplib.llama.draft"])
    assert loaded
    changed = {k for k in set(a["environ"]) | set(b["environ"])
               if a["environ"].get(k) != b["environ"].get(k)}
    assert changed <= {envs.UPSTREAM, *OMP_DEFAULTS}
    assert a["environ"][envs.UPSTREAM] in envs.UPSTREAM_BUILDS
    assert set(a["path"]) - set(b["path"]) <= {str(PATCHED_DIR)}
    for key in ("signals", "excepthook", "root", "mtplib"):
        assert a[key] == b[key], key


def test_choose_upstream_acts_once(monkeypatch):
    import mtplib.runtime as R

    monkeypatch.setattr(R, "_chosen", {})
    monkeypatch.setenv(envs.UPSTREAM, "stock")
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    assert R.choose_upstream() == "stock"
    import os

    assert os.environ["OMP_WAIT_POLICY"] == "PASSIVE"
    monkeypatch.setenv(envs.UPSTREAM, "patched")  # later calls keep the first choice
    assert R.choose_upstream() == "stock"
