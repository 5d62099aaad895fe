"""`LocalShards` starts its shard processes with the environment and working folder it is
given (the build they load, the checkout they import), so scripts and tests need not start
`mtplib shard serve` by hand."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from mtplib.distributed.processes import LocalShards

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="reads /proc/PID/environ and /proc/PID/cwd")


def _environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(x.decode().split("=", 1) for x in raw if b"=" in x)


def test_shards_get_the_given_environment_and_folder(tmp_path):
    env = dict(os.environ, MTPLIB_TEST_SHARD_MARK="given")
    with LocalShards(2, env=env, cwd=tmp_path) as sh:
        assert all(sh.alive()) and len(sh.endpoints) == 2
        for pid in sh.pids():
            assert _environ(pid)["MTPLIB_TEST_SHARD_MARK"] == "given"
            assert Path(os.readlink(f"/proc/{pid}/cwd")) == tmp_path.resolve()
        sh.restart(1)  # a restarted shard gets them too
        assert _environ(sh.pids()[1])["MTPLIB_TEST_SHARD_MARK"] == "given"
    assert not any(sh.alive())


def test_without_env_the_shards_inherit_this_process(monkeypatch):
    monkeypatch.setenv("MTPLIB_TEST_SHARD_MARK", "inherited")
    with LocalShards(1) as sh:
        pid = sh.pids()[0]
        assert _environ(pid)["MTPLIB_TEST_SHARD_MARK"] == "inherited"
        assert Path(os.readlink(f"/proc/{pid}/cwd")) == Path.cwd().resolve()
