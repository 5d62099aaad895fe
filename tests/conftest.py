"""Shared fixtures: the tiny V4 pair is generated once per test session, never committed."""

from __future__ import annotations

import pytest

from mtplib.model.fixture import write_combined, write_fixture
from mtplib.ownership.derivation import inventory_from_paths


@pytest.fixture(scope="session", autouse=True)
def _private_cache_dir(tmp_path_factory):
    """Row-source decisions are cached on disk across processes; tests use their own
    folder so they neither read the developer's cache nor leave entries in it."""
    mp = pytest.MonkeyPatch()
    mp.setenv("MTPLIB_CACHE_DIR", str(tmp_path_factory.mktemp("mtplib-cache")))
    yield
    mp.undo()


@pytest.fixture(scope="session")
def pair(tmp_path_factory):
    return write_fixture(tmp_path_factory.mktemp("fixture"), seed=0)


@pytest.fixture(scope="session")
def other_pair(tmp_path_factory):
    return write_fixture(tmp_path_factory.mktemp("fixture_other"), seed=1)


@pytest.fixture(scope="session")
def inv(pair):
    """The tiny pair's inventory (trunk + mtp- sidecar)."""
    return inventory_from_paths(pair.trunk, pair.sidecar)


@pytest.fixture(scope="session")
def combined(pair, tmp_path_factory):
    """The inventory of the same pair written as one combined file."""
    path = write_combined(pair.trunk, pair.sidecar, tmp_path_factory.mktemp("combined"))
    return inventory_from_paths(path)
