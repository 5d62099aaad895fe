"""`mtplib.lab.wan`, `.sidebyside` and `.projection` were split into modules by concern and
re-export what their callers read: every ``ALIAS.name`` the package, the tests, the notebooks'
sources and the evidence scripts use on them (``from mtplib.lab import wan as W``) and every
name they import from them still resolves there."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SPLIT = ("wan", "sidebyside", "projection")
SOURCES = sorted({*ROOT.glob("mtplib/**/*.py"), *ROOT.glob("tests/*.py"),
                  *ROOT.glob("notebooks/*.py"), *ROOT.glob("evidence/**/*.py")})
_ALIAS = re.compile(r"from mtplib\.lab import (" + "|".join(SPLIT) + r") as (\w+)")
_FROM = re.compile(r"from mtplib\.lab\.(" + "|".join(SPLIT)
                   + r") import (?:\(([^)]*)\)|([\w, ]+))")


def uses() -> set[tuple[str, str, str]]:
    """(file, module, name) for every name read from a split module."""
    out = set()
    for f in SOURCES:
        src = f.read_text()
        rel = f.relative_to(ROOT).as_posix()
        for mod, alias in _ALIAS.findall(src):
            out |= {(rel, mod, n) for n in re.findall(rf"\b{alias}\.(\w+)", src)}
        for mod, grouped, line in _FROM.findall(src):
            out |= {(rel, mod, n.split(" as ")[0].strip()) for n in (grouped or line).split(",")
                    if n.strip()}
    return out


def test_the_scan_finds_the_callers():
    found = uses()
    assert ("mtplib/commands/compare_upstream.py", "sidebyside", "SweepConfig") in found
    assert ("mtplib/lab/layer_cost.py", "projection", "LAYER_COST_SCHEMA") in found
    assert {m for _, m, _ in found} == set(SPLIT) and len(found) > 150


@pytest.mark.parametrize("mod", SPLIT)
def test_every_name_callers_read_resolves(mod):
    m = importlib.import_module(f"mtplib.lab.{mod}")
    missing = sorted(f"{f}: {n}" for f, mm, n in uses() if mm == mod and not hasattr(m, n))
    assert missing == []
