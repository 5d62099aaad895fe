"""The package layers point one way, and no import cycle exists (function-level imports
count: a lazy import is still a dependency). The notebooks' jupytext sources sit on top of
every layer and are checked like the package; evidence/ holds no code (its reports are
`mtplib.reports`, with the commands, imported by nothing else in the package).

    pins, errors, stamps, paths, host, files,   foundation (envs: every environment
    envs, logs                                 variable; logs: logging)
    contract, model, ownership           pure Python: never ctypes or llama_cpp
    runtime                              the native room (ctypes, llama_cpp, raw bindings)
    distributed, llama                   shard processes, worker, ranged runtime, relays;
                                         the adapter for llama-cpp-python's Llama
    lab                                  experiments
    records                              lanes, run records, evidence writers
    commands, cli, train, serve, reports entry points; the HTTP service (serve); the
                                         evidence's reports (python -m mtplib.reports...)
    notebooks                            notebooks/*.py: scripts

Native code (`NATIVE`) is imported only where `NATIVE_ROOMS` and `NATIVE_REPORTS` say, each
with its reason; every other module reaches upstream through the runtime's objects.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PKG = ROOT / "mtplib"
RANK = {"pins": 0, "errors": 0, "stamps": 0, "paths": 0, "host": 0, "files": 0,
        "envs": 0, "logs": 0, "__init__": 0,
        "contract": 1, "model": 1, "ownership": 1,
        "runtime": 2, "distributed": 3, "llama": 3, "lab": 4, "records": 5,
        "commands": 6, "cli": 6, "train": 6, "serve": 6, "reports": 6,
        "notebooks": 7}
PURE = {"contract", "model", "ownership"}
#: what reaches native code: imports of ctypes, llama-cpp-python and the runtime's raw
#: bindings (ggml's structs; `lib.load`, which hands out the loaded C libraries, and so the
#: `lib` module imported whole; `lib`'s other names, errors and upstream_info, are not), and
#: upstream's C functions called on a runtime object's library handle (``ctx.llama.llama_x``,
#: ``model.ext.llama_x``: the way the lab once timed decodes)
C_CALL = "a C call through a handle (.llama.llama_*, .ext.llama_*)"
NATIVE = ("ctypes", "llama_cpp", "mtplib.runtime.ggml_tensor", "mtplib.runtime.lib.load",
          "mtplib.runtime.lib", C_CALL)
#: the rooms that may import native code, what of it, and why
NATIVE_ROOMS = {
    "runtime": (set(NATIVE), "the native room: loads upstream and wraps its C API"),
    "llama": ({"llama_cpp", "mtplib.runtime.lib.load", C_CALL},
              "the adapter for llama-cpp-python's Llama: subclasses llama_cpp's classes and "
              "swaps the Llama's context through the runtime's bindings (no ctypes itself)"),
}
#: reports (`mtplib.reports`) that call upstream's C API themselves, on purpose, and why
NATIVE_REPORTS = {
    "mtplib.reports.upstream_bugs.repro_hidden_rows":
        ({"ctypes", "llama_cpp"}, "an upstream bug report's repro: llama_cpp's bindings only"),
    "mtplib.reports.upstream_bugs.repro_crashes":
        ({"ctypes", "llama_cpp"}, "crashes upstream on purpose (in children), raw C API"),
    "mtplib.reports.upstream_bugs.overlap_probe":
        ({"ctypes", "mtplib.runtime.ggml_tensor", "mtplib.runtime.lib"},
         "reads the graph's node addresses through ggml's structs in cb_eval"),
    "mtplib.reports.upstream_patches.rpc_llama_split":
        ({"ctypes", "mtplib.runtime.lib.load"},
         "a generic (non-V4) llama split over RPC, driven through the raw C API"),
    "mtplib.reports.side_by_side.overhead":
        ({"ctypes", C_CALL},
         "times the runtime's old C calls and ctypes row copies against its current ones"),
}


def _modules() -> dict[str, Path]:
    mods = {}
    for p in PKG.rglob("*.py"):
        parts = list(p.relative_to(PKG.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        mods[".".join(parts)] = p
    return mods


def _scripts() -> dict[str, Path]:
    """notebooks/*.py (the notebooks' jupytext sources), by path."""
    return {p.relative_to(ROOT).as_posix(): p for p in sorted(ROOT.glob("notebooks/*.py"))}


MODS = _modules()
SCRIPTS = _scripts()


@functools.cache
def _import_targets(name: str, source: str,
                    is_package: bool = False) -> tuple[tuple[str, int, bool], ...]:
    """(dotted target, line, from-import) of every import in ``source``, anywhere in its
    body: ``import a.b`` gives a.b, ``from a.b import c`` gives a.b.c (c a module or a
    name), relative imports resolved against ``name``'s package."""
    pkg = name if is_package else name.rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out += [(a.name, node.lineno, False) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg.split(".")[: len(pkg.split(".")) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            out += [(f"{mod}.{a.name}", node.lineno, True) for a in node.names]
    return tuple(out)


def _resolve(target: str) -> str:
    """The mtplib module an import target names (``from m import name`` -> m), else the
    target itself (an import of a module that does not exist stays unresolved); other
    packages by their top-level name."""
    if not target.startswith("mtplib"):
        return target.split(".")[0]
    if target in MODS:
        return target
    mod = target.rpartition(".")[0]
    return mod if mod in MODS else target


def _imports(name: str, path: Path) -> set[str]:
    """Every module ``name`` imports, anywhere in its body (mtplib modules resolved to
    the module, other imports to their top-level package). ``from p import m`` imports
    the package ``p`` too, even where ``m`` is a submodule: it reads p's namespace (and
    runs p's ``__init__``, with whatever that imports lazily), which is how
    ``mtplib.records`` -> records.frames -> ``from mtplib.records import ...`` was a cycle."""
    return _imports_of(name, path.read_text(), path.name == "__init__.py")


def _imports_of(name: str, source: str, is_package: bool = False) -> set[str]:
    out = set()
    for t, _, from_import in _import_targets(name, source, is_package):
        out.add(_resolve(t))
        if from_import and t.startswith("mtplib") and (pkg := t.rpartition(".")[0]) in MODS:
            out.add(pkg)
    return out - {name}


def _native(name: str, source: str, is_package: bool = False) -> set[str]:
    """The `NATIVE` entries ``source`` uses."""
    found = set()
    for t, _, _ in _import_targets(name, source, is_package):
        for n in NATIVE:
            if t == n or (t.startswith(n + ".") and n != "mtplib.runtime.lib"):
                found.add(n)
    for node in ast.walk(ast.parse(source)):
        if (isinstance(node, ast.Attribute) and node.attr.startswith(("llama_", "ggml_"))
                and isinstance(node.value, ast.Attribute) and node.value.attr in ("llama", "ext")):
            found.add(C_CALL)
    return found


GRAPH = {n: _imports(n, p) for n, p in MODS.items()} | {
    s: _imports(s, p) for s, p in SCRIPTS.items()}


def _room(mod: str) -> str:
    if mod in SCRIPTS:
        return mod.split("/")[0]
    parts = mod.split(".")
    return "__init__" if len(parts) == 1 else parts[1]


def test_every_module_has_a_room():
    assert {_room(m) for m in MODS} <= set(RANK), {_room(m) for m in MODS} - set(RANK)
    assert {_room(s) for s in SCRIPTS} == {"notebooks"}
    assert "reports" in {_room(m) for m in MODS}


def test_evidence_holds_no_code():
    """The evidence folders keep data, READMEs and run records; what made them is
    `mtplib.reports` (python -m mtplib.reports.<topic>.<name>)."""
    assert not sorted(p.relative_to(ROOT).as_posix() for p in ROOT.glob("evidence/**/*.py"))


def test_nothing_imports_the_reports():
    """The reports sit on top: no module outside `mtplib.reports` (commands, service and
    CLI included, which share its rank) imports one."""
    bad = [f"{a} -> {b}" for a, deps in GRAPH.items() for b in deps
           if b.startswith("mtplib.reports") and not a.startswith("mtplib.reports")]
    assert not bad, "imports of mtplib.reports from outside it:\n" + "\n".join(sorted(bad))


def test_no_import_points_up_a_layer():
    bad = [f"{a} -> {b}" for a, deps in GRAPH.items() for b in deps
           if b in MODS and RANK[_room(b)] > RANK[_room(a)]]
    assert not bad, "imports pointing up a layer:\n" + "\n".join(sorted(bad))


def _cycles(graph: dict[str, set[str]]) -> list[str]:
    """Every import cycle among the keys of ``graph`` (one path per back edge)."""
    state: dict[str, int] = {}
    cycles = []

    def visit(n: str, stack: list[str]) -> None:
        state[n] = 1
        for d in sorted(graph[n]):
            if d not in graph:
                continue
            if state.get(d) == 1:
                cycles.append(" -> ".join(stack[stack.index(d):] + [d]))
            elif d not in state:
                visit(d, stack + [d])
        state[n] = 2

    for n in sorted(graph):
        if n not in state:
            visit(n, [n])
    return cycles


def test_no_import_cycle():
    cycles = _cycles({n: GRAPH[n] for n in MODS})
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def test_the_cycle_check_sees_a_package_cycle():
    """The records cycle as it was: the package's lazy ``load`` imports records.frames,
    which imported ``from mtplib.records import raw_metrics`` (the package again)."""
    sources = {
        "mtplib.records": ("mtplib.records", "def __getattr__(name):\n"
                           "    from mtplib.records.frames import load\n", True),
        "mtplib.records.frames": ("mtplib.records.frames",
                                  "from mtplib.records import raw_metrics as RM\n", False),
    }
    graph = {n: _imports_of(*args) & set(MODS) for n, args in sources.items()}
    assert _cycles(graph) == ["mtplib.records -> mtplib.records.frames -> mtplib.records"]
    fixed = {**graph, "mtplib.records.frames": _imports_of(
        "mtplib.records.frames", "from mtplib.records.raw_metrics import BENCH_JSON\n")}
    assert _cycles(fixed) == []


def _reach(start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for d in GRAPH.get(todo.pop(), ()):
            if d not in seen:
                seen.add(d)
                if d in MODS:
                    todo.append(d)
    return seen


@pytest.mark.parametrize("mod", sorted(m for m in MODS if _room(m) in PURE))
def test_pure_packages_never_reach_native_code(mod):
    reached = _reach(mod)
    assert not reached & {"ctypes", "llama_cpp"}, f"{mod} reaches {sorted(reached)}"
    higher = sorted(m for m in reached if m in MODS and RANK[_room(m)] > 1)
    assert not higher, f"{mod} reaches {higher}"


@functools.cache
def _top_names(path: Path) -> frozenset[str] | None:
    """The names a module defines at top level (defs, classes, assignments, imports, also
    under top-level if/try/with); None where a module ``__getattr__`` makes any name valid."""
    names: set[str] = set()

    def scan(body: list[ast.stmt]) -> None:
        for n in body:
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(n.name)
            elif isinstance(n, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
                targets = n.targets if isinstance(n, ast.Assign) else [n.target]
                names.update(x.id for t in targets for x in ast.walk(t)
                             if isinstance(x, ast.Name))
            elif isinstance(n, ast.Import):
                names.update((a.asname or a.name).split(".")[0] for a in n.names)
            elif isinstance(n, ast.ImportFrom):
                names.update(a.asname or a.name for a in n.names)
            elif isinstance(n, (ast.If, ast.Try, ast.With)):
                for part in ("body", "orelse", "finalbody"):
                    scan(getattr(n, part, []))
                for h in getattr(n, "handlers", []):
                    scan(h.body)

    scan(ast.parse(path.read_text()).body)
    return None if "__getattr__" in names else frozenset(names)


def _unresolved(name: str, source: str, is_package: bool = False) -> list[str]:
    """mtplib imports in ``source`` that name no module, or a name its module lacks."""
    bad = []
    for t, line, from_import in _import_targets(name, source, is_package):
        if not t.startswith("mtplib") or t in MODS:
            continue
        mod, _, attr = t.rpartition(".")
        if not from_import or mod not in MODS:
            bad.append(f"{name}:{line}: no module {mod if from_import else t}")
            continue
        names = _top_names(MODS[mod])
        if names is not None and attr not in names:
            bad.append(f"{name}:{line}: {mod} has no {attr}")
    return bad


def test_every_mtplib_import_resolves():
    """Scripts are run by hand, so an import of a moved module (the evidence scripts once
    imported mtplib.fixture and mtplib.sidebyside) fails only when someone runs them."""
    bad = [b for n, p in (MODS | SCRIPTS).items()
           for b in _unresolved(n, p.read_text(), p.name == "__init__.py")]
    assert not bad, "imports of missing mtplib modules or names:\n" + "\n".join(bad)


def _native_offences(name: str, source: str, is_package: bool = False) -> list[str]:
    """The `NATIVE` imports of ``name`` that its room (or its `NATIVE_REPORTS` entry)
    does not allow."""
    allowed: set[str] = set()
    if name in NATIVE_REPORTS:
        allowed = NATIVE_REPORTS[name][0]
    elif _room(name) in NATIVE_ROOMS:
        allowed = NATIVE_ROOMS[_room(name)][0]
    return sorted(f"{name} uses {n}" for n in _native(name, source, is_package) - allowed)


def test_only_the_native_rooms_import_native_code():
    bad = [b for n, p in (MODS | SCRIPTS).items()
           for b in _native_offences(n, p.read_text(), p.name == "__init__.py")]
    assert not bad, ("native code used outside runtime, the llama adapter and NATIVE_REPORTS "
                     "(go through mtplib.runtime, or list the report with a reason):\n"
                     + "\n".join(bad))


def test_native_allowances_are_used():
    """A listed allowance that nothing needs any more is dropped, not kept as a hole."""
    for s, (allowed, _) in NATIVE_REPORTS.items():
        assert s in MODS, f"NATIVE_REPORTS names a missing module {s}"
        assert _native(s, MODS[s].read_text()) == allowed, s
    for room, (allowed, _) in NATIVE_ROOMS.items():
        used = set().union(*(_native(m, p.read_text(), p.name == "__init__.py")
                             for m, p in MODS.items() if _room(m) == room))
        assert used and used <= allowed, (room, used)


def test_the_checker_sees_function_level_imports(tmp_path):
    """A lazy import inside a function is found (what made the old cycle invisible)."""
    p = tmp_path / "m.py"
    p.write_text("def f():\n    from mtplib.runtime import model\n    import ctypes\n")
    assert {"mtplib.runtime.model", "ctypes"} <= _imports("mtplib.model.x", p)


def test_the_native_check_fails_on_a_new_offender():
    """The checker itself, on synthetic sources: a lab module, a distributed module and a
    notebook that import native code are refused; what they may import is not."""
    lazy = "def f():\n    import ctypes\n    return ctypes.CDLL(None)\n"
    assert _native_offences("mtplib.lab.new", lazy) == ["mtplib.lab.new uses ctypes"]
    assert _native_offences("mtplib.distributed.new", "from llama_cpp import Llama\n") == [
        "mtplib.distributed.new uses llama_cpp"]
    raw = "from mtplib.runtime.lib import load\nfrom mtplib.runtime import ggml_tensor\n"
    assert _native_offences("notebooks/99_new.py", raw) == [
        "notebooks/99_new.py uses mtplib.runtime.ggml_tensor",
        "notebooks/99_new.py uses mtplib.runtime.lib.load"]
    assert _native_offences("mtplib.commands.new", "from mtplib.runtime import lib\n") == [
        "mtplib.commands.new uses mtplib.runtime.lib"]
    fine = "from mtplib.runtime.lib import UpstreamError, upstream_info\nimport mtplib.llama\n"
    assert _native_offences("mtplib.lab.new", fine) == []
    # the adapter may import llama_cpp and the bindings, but not ctypes
    bindings = "import llama_cpp\nfrom mtplib.runtime.lib import load\n"
    assert _native_offences("mtplib.llama.new", bindings) == []
    assert _native_offences("mtplib.llama.new", lazy) == ["mtplib.llama.new uses ctypes"]
    assert _native_offences("mtplib.runtime.new", lazy + raw) == []
    # a C function called on a runtime context's library handle, as the lab's timers and
    # the ranged worker once did
    sync = "def wait(ctx):\n    ctx.llama.llama_synchronize(ctx.ptr)\n"
    assert _native_offences("mtplib.distributed.new", sync) == [
        f"mtplib.distributed.new uses {C_CALL}"]
    assert _native_offences("mtplib.lab.new", "x = m.ext.llama_get_embeddings_nextn\n") == [
        f"mtplib.lab.new uses {C_CALL}"]
    assert _native_offences("mtplib.lab.new", "f = mtplib.llama.mtp_llama\n") == []


def test_the_resolver_fails_on_a_moved_module():
    src = ("from mtplib.fixture import write_fixture\nfrom mtplib.model.fixture import nope\n"
           "import mtplib.sidebyside\nfrom mtplib.model.fixture import write_fixture\n"
           "from mtplib.runtime import rows\nfrom mtplib import pins\n")
    assert _unresolved("evidence/x.py", src) == [
        "evidence/x.py:1: no module mtplib.fixture",
        "evidence/x.py:2: mtplib.model.fixture has no nope",
        "evidence/x.py:3: no module mtplib.sidebyside"]
