"""No module of mtplib uses another module's private names: a leading-underscore name (a
function, class, constant or submodule) is its own module's business. A helper two modules
share gets a public name where it is defined; one only a single module uses moves there.

The scan reads every module's source (function-level imports included) for
``from mtplib.x import _y`` and for ``_y`` read off an imported mtplib module
(``import mtplib.x as m; m._y``, ``from mtplib import x; x._y``). Dunder names
(``__version__``) are not private. Other packages' private names (llama-cpp-python's
``_internals``, which the llama adapter wraps) are those packages' business, not this
rule's.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PKG = ROOT / "mtplib"


def _modules() -> dict[str, Path]:
    mods = {}
    for p in PKG.rglob("*.py"):
        parts = list(p.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        mods[".".join(parts)] = p
    return mods


MODS = _modules()


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _absolute(name: str, node: ast.ImportFrom, is_package: bool) -> str:
    """The module an ``ImportFrom`` reads from, relative imports resolved against ``name``."""
    if not node.level:
        return node.module or ""
    pkg = (name if is_package else name.rpartition(".")[0]).split(".")
    base = pkg[: len(pkg) - node.level + 1]
    return ".".join(base + ([node.module] if node.module else []))


def private_uses(name: str, source: str, is_package: bool = False,
                 modules: set[str] | None = None) -> list[str]:
    """``name:line: what`` for every private name of another mtplib module that ``source``
    (the module ``name``) imports or reads off an imported module."""
    modules = set(MODS) if modules is None else modules
    tree = ast.parse(source)
    found: list[str] = []
    aliases: dict[str, str] = {}  # a local name -> the mtplib module it is bound to
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            src = _absolute(name, node, is_package)
            if not src.startswith("mtplib"):
                continue
            for a in node.names:
                full = f"{src}.{a.name}"
                if src != name and (_private(a.name) or any(map(_private, src.split(".")))):
                    found.append(f"{name}:{node.lineno}: from {src} import {a.name}")
                if full in modules:
                    aliases[a.asname or a.name] = full
        elif isinstance(node, ast.Import):
            for a in node.names:
                if not a.name.startswith("mtplib"):
                    continue
                if any(map(_private, a.name.split("."))) and a.name != name:
                    found.append(f"{name}:{node.lineno}: import {a.name}")
                if a.asname:
                    aliases[a.asname] = a.name
                else:  # ``import mtplib.x.y`` binds ``mtplib``: read as a dotted chain
                    aliases["mtplib"] = "mtplib"
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Attribute) and _private(node.attr)):
            continue
        chain, value = [], node.value
        while isinstance(value, ast.Attribute):
            chain.insert(0, value.attr)
            value = value.value
        if not isinstance(value, ast.Name) or value.id not in aliases:
            continue
        module = ".".join([aliases[value.id], *chain])
        if module in modules and module != name:
            found.append(f"{name}:{node.lineno}: {module}.{node.attr}")
    return found


def test_no_module_uses_another_modules_private_names():
    bad = [b for n, p in sorted(MODS.items())
           for b in private_uses(n, p.read_text(), p.name == "__init__.py")]
    assert not bad, ("private names used across modules (give the shared helper a public "
                     "name where it is defined, or move it to its one user):\n"
                     + "\n".join(bad))


def test_the_scan_fails_on_a_private_name_from_another_module():
    """The checker itself, on synthetic sources: each way of reaching another module's
    private name is found; public names, dunders, a module's own names and other packages'
    private names are not."""
    mods = {"mtplib.lab.wan.cells", "mtplib.lab.wan.measure", "mtplib.runtime",
            "mtplib.runtime.model", "mtplib.lab"}
    src = ("from mtplib.lab.wan.cells import cells, _cell\n"
           "def f():\n    from mtplib.runtime.model import _ctx\n"
           "from mtplib.lab.wan import cells as C\nx = C._n_runs\n"
           "import mtplib.runtime.model as M\ny = M._lib\n"
           "import mtplib.runtime.model\nz = mtplib.runtime.model._h\n"
           "from . import cells as R\nw = R._cell_text\n")
    assert private_uses("mtplib.lab.wan.measure", src, modules=mods) == [
        "mtplib.lab.wan.measure:1: from mtplib.lab.wan.cells import _cell",
        "mtplib.lab.wan.measure:3: from mtplib.runtime.model import _ctx",
        "mtplib.lab.wan.measure:5: mtplib.lab.wan.cells._n_runs",
        "mtplib.lab.wan.measure:7: mtplib.runtime.model._lib",
        "mtplib.lab.wan.measure:9: mtplib.runtime.model._h",
        "mtplib.lab.wan.measure:11: mtplib.lab.wan.cells._cell_text"]
    fine = ("from mtplib.lab.wan.cells import cells, make_cell\n"
            "from mtplib.lab.wan.measure import _own\n"  # its own name: not across modules
            "from mtplib import __version__\n"
            "from llama_cpp import _internals\n"
            "from mtplib.lab.wan import cells as C\nx = C.__doc__\n"
            "class K:\n    def f(self):\n        return self._private\n")
    assert private_uses("mtplib.lab.wan.measure", fine, modules=mods) == []
    # a private submodule is private too
    assert private_uses("mtplib.lab", "from mtplib.runtime import _lib\n", modules=mods) == [
        "mtplib.lab:1: from mtplib.runtime import _lib"]
