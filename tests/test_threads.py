"""Client compute on shared cores (issue 29 item 3): OpenMP waits passively unless the user
chose otherwise, and a context's threads follow the size of the work it does here."""

from __future__ import annotations

import os
import subprocess
import sys
from types import SimpleNamespace

import pytest

from mtplib.runtime.model import SMALL_MODEL_BYTES, context_threads

#: the policy is set where the process first loads upstream (`choose_upstream`, called by
#: `mtplib.runtime.lib.load`), not at import of mtplib (tests/test_envs.py)
SHOW = ("import os; from mtplib.runtime import choose_upstream; choose_upstream(); "
        "print(os.environ.get('OMP_WAIT_POLICY'))")


def _policy(env: dict) -> str:
    r = subprocess.run([sys.executable, "-c", SHOW], capture_output=True, text=True,
                       env=env, timeout=60)
    assert r.returncode == 0, r.stderr
    return r.stdout.strip()


def test_openmp_waits_passively_by_default():
    """Set before llama_cpp loads (libgomp reads it once) and inherited by children."""
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    assert _policy(env) == "PASSIVE"


def test_a_users_openmp_policy_wins():
    assert _policy(dict(os.environ, OMP_WAIT_POLICY="ACTIVE")) == "ACTIVE"


def _model(size: int, endpoints: list[str] | None = None) -> SimpleNamespace:
    return SimpleNamespace(size_bytes=size, endpoints=endpoints or [])


@pytest.mark.parametrize("size,endpoints,requested,want", [
    (3_649_056, None, 2, 1),  # the trained pair's MTP block: barriers cost more than work
    (SMALL_MODEL_BYTES - 1, None, 8, 1),
    (SMALL_MODEL_BYTES, None, 8, 8),  # a large block (V4-Flash's: GBs) keeps every thread
    (4 << 30, ["127.0.0.1:1", "127.0.0.1:2"], 2, 1),  # ranged: layers on the shards
    (4 << 30, ["127.0.0.1:2"], 2, 1),  # an MTP block on the tail shard runs there
])
def test_context_threads_follow_the_work(size, endpoints, requested, want):
    assert context_threads(_model(size, endpoints), requested) == want
