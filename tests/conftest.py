"""Shared fixtures: the tiny V4 pair is generated once per test session, never committed."""

from __future__ import annotations

import pytest

from mtplib.fixture import write_fixture


@pytest.fixture(scope="session")
def pair(tmp_path_factory):
    return write_fixture(tmp_path_factory.mktemp("fixture"), seed=0)


@pytest.fixture(scope="session")
def other_pair(tmp_path_factory):
    return write_fixture(tmp_path_factory.mktemp("fixture_other"), seed=1)
