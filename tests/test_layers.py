"""The package layers point one way, and no import cycle exists (function-level imports
count: a lazy import is still a dependency).

    pins, errors, stamps, paths, host, files    foundation
    contract, model, ownership           pure Python: never ctypes or llama_cpp
    runtime                              the only ctypes room
    distributed                          shard processes, worker, ranged runtime, relays
    lab                                  experiments
    records                              lanes, run records, evidence writers
    commands, cli, train                 entry points
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parent.parent / "mtplib"
RANK = {"pins": 0, "errors": 0, "stamps": 0, "paths": 0, "host": 0, "files": 0,
        "__init__": 0,
        "contract": 1, "model": 1, "ownership": 1,
        "runtime": 2, "distributed": 3, "llama": 3, "lab": 4, "records": 5,
        "commands": 6, "cli": 6, "train": 6}
PURE = {"contract", "model", "ownership"}
NATIVE = {"ctypes", "llama_cpp"}


def _modules() -> dict[str, Path]:
    mods = {}
    for p in PKG.rglob("*.py"):
        parts = list(p.relative_to(PKG.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        mods[".".join(parts)] = p
    return mods


MODS = _modules()


def _imports(name: str, path: Path) -> set[str]:
    """Every module ``name`` imports, anywhere in its body (mtplib modules resolved to
    the module, other imports to their top-level package)."""
    pkg = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg.split(".")[: len(pkg.split(".")) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            targets = [f"{mod}.{a.name}" if f"{mod}.{a.name}" in MODS else mod
                       for a in node.names]
        else:
            continue
        for t in targets:
            if t.startswith("mtplib"):
                while t not in MODS and "." in t:
                    t = t.rpartition(".")[0]
                if t != name:
                    out.add(t)
            else:
                out.add(t.split(".")[0])
    return out


GRAPH = {n: _imports(n, p) for n, p in MODS.items()}


def _room(mod: str) -> str:
    parts = mod.split(".")
    return "__init__" if len(parts) == 1 else parts[1]


def test_every_module_has_a_room():
    assert {_room(m) for m in MODS} <= set(RANK), {_room(m) for m in MODS} - set(RANK)


def test_no_import_points_up_a_layer():
    bad = [f"{a} -> {b}" for a, deps in GRAPH.items() for b in deps
           if b in MODS and RANK[_room(b)] > RANK[_room(a)]]
    assert not bad, "imports pointing up a layer:\n" + "\n".join(sorted(bad))


def test_no_import_cycle():
    state: dict[str, int] = {}
    cycles = []

    def visit(n: str, stack: list[str]) -> None:
        state[n] = 1
        for d in sorted(GRAPH[n]):
            if d not in MODS:
                continue
            if state.get(d) == 1:
                cycles.append(" -> ".join(stack[stack.index(d):] + [d]))
            elif d not in state:
                visit(d, stack + [d])
        state[n] = 2

    for n in sorted(MODS):
        if n not in state:
            visit(n, [n])
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


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
    assert not reached & NATIVE, f"{mod} reaches {sorted(reached & NATIVE)}"
    higher = sorted(m for m in reached if m in MODS and RANK[_room(m)] > 1)
    assert not higher, f"{mod} reaches {higher}"


def test_the_checker_sees_function_level_imports(tmp_path):
    """A lazy import inside a function is found (what made the old cycle invisible)."""
    p = tmp_path / "m.py"
    p.write_text("def f():\n    from mtplib.runtime import model\n    import ctypes\n")
    assert {"mtplib.runtime.model", "ctypes"} <= _imports("mtplib.model.x", p)
