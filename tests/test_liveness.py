"""Ranged calls time out by liveness, not total time; the diagnosis names the real cause.

A call fails only after `silence_timeout_s` without progress (worker steps/decodes, shard
bytes, local shard CPU). A stopped shard is named; a long healthy call is never cut off;
a dead or asserting client worker is reported as the worker, not as a lost shard.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mtplib.distributed.client import (
    RangedRuntime,
    SessionFailedError,
    ShardLostError,
    silence_default,
)
from mtplib.distributed.processes import LocalShards
from mtplib.errors import InputError
from mtplib.runtime.generate import prefill
from mtplib.runtime.model import Context, ContextConfig
from mtplib.runtime.rpc import ShardError

PROMPT = list(range(1, 9))
CFG = ContextConfig(n_ctx=256, n_threads=1)
REPO = Path(__file__).resolve().parent.parent


def _decode_for(models, seconds: float) -> int:
    """Runs in the worker: decode one token at a time, with no step labels (so only the
    shard bytes and CPU show progress), for ``seconds``; returns the decodes done."""
    n = 0
    with Context(models.trunk, CFG) as ctx:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            pos = len(PROMPT) + n % 200
            if pos == len(PROMPT):
                ctx.clear()
                prefill(ctx, PROMPT)
            ctx.decode([1 + n % 7], [pos], logits=True)
            ctx.llama.llama_synchronize(ctx.ptr)
            n += 1
    return n


def _client_assert(models) -> None:
    """Runs in the worker: what an upstream assert in the client looks like."""
    sys.stderr.write("llama-context.cpp:123: GGML_ASSERT(seq_id < n_seq_max) failed\n")
    sys.stderr.flush()
    os.abort()


def test_silence_default_from_env(monkeypatch):
    monkeypatch.delenv("MTPLIB_SHARD_SILENCE_S", raising=False)
    assert silence_default() == 15.0
    monkeypatch.setenv("MTPLIB_SHARD_SILENCE_S", "4.5")
    assert silence_default() == 4.5
    for bad in ("0", "-1", "nan", "inf", "x"):
        monkeypatch.setenv("MTPLIB_SHARD_SILENCE_S", bad)
        with pytest.raises(InputError, match="MTPLIB_SHARD_SILENCE_S"):
            silence_default()


@pytest.mark.parametrize(("relay", "hung"), [(True, 1), (False, 0)])
def test_stopped_shard_is_named_within_the_silence_limit(pair, relay, hung):
    with LocalShards(2) as sh:
        with RangedRuntime(pair.trunk, "0-1,2-3", shards=sh, silence_timeout_s=3,
                           relay=relay) as rt:
            ctx = rt.context(CFG)
            prefill(ctx, PROMPT)
            os.killpg(sh.procs[hung].pid, signal.SIGSTOP)  # hangs, connection kept open
            try:
                t0 = time.monotonic()
                with pytest.raises(ShardLostError) as ei:
                    ctx.decode([1], [len(PROMPT)], logits=True)
                elapsed = time.monotonic() - t0
            finally:
                os.killpg(sh.procs[hung].pid, signal.SIGCONT)
            msg = str(ei.value)
            assert 3 <= elapsed < 15, elapsed
            assert f"shard {hung} ({sh.endpoints[hung]}): stopped" in msg, msg
            assert f"shard {1 - hung}" not in msg and "no progress for 3 s during decode" in msg
            with pytest.raises(SessionFailedError):
                ctx.decode([1], [0])


def test_healthy_call_longer_than_the_silence_limit_is_not_cut_off(pair):
    with LocalShards(2) as sh:
        with RangedRuntime(pair.trunk, "0-1,2-3", shards=sh, silence_timeout_s=2) as rt:
            t0 = time.monotonic()
            n = rt.call(_decode_for, 7.0)
            assert time.monotonic() - t0 > 6 and n > 10
            assert rt.failed is None


def test_dead_worker_is_reported_as_the_worker(pair):
    with LocalShards(2) as sh:
        with RangedRuntime(pair.trunk, "0-1,2-3", shards=sh, silence_timeout_s=5) as rt:
            ctx = rt.context(CFG)
            prefill(ctx, PROMPT)
            os.kill(rt._worker.pid, signal.SIGKILL)
            rt._worker.wait(timeout=5)
            with pytest.raises(ShardError) as ei:
                ctx.decode([1], [len(PROMPT)], logits=True)
            msg = str(ei.value)
            assert not isinstance(ei.value, ShardLostError), msg
            assert "client worker died" in msg and "SIGKILL" in msg and "no shard was lost" in msg
            assert all(sh.alive())
        with RangedRuntime(pair.trunk, "0-1,2-3", shards=sh, silence_timeout_s=5) as rt:
            with pytest.raises(ShardError) as ei:
                rt.call(_client_assert)
            msg = str(ei.value)
            assert not isinstance(ei.value, ShardLostError), msg
            assert "upstream assert" in msg and "GGML_ASSERT(seq_id < n_seq_max)" in msg, msg
            assert "SIGABRT" in msg and "shards are not at fault" in msg


def test_stopped_worker_is_reported_as_the_worker(pair):
    with LocalShards(1) as sh:
        with RangedRuntime(pair.trunk, "0-3", shards=sh, silence_timeout_s=2) as rt:
            ctx = rt.context(CFG)
            os.kill(rt._worker.pid, signal.SIGSTOP)
            try:
                with pytest.raises(ShardError) as ei:
                    ctx.decode([1], [0], logits=True)
            finally:
                if rt._worker.poll() is None:
                    os.kill(rt._worker.pid, signal.SIGCONT)
            msg = str(ei.value)
            assert not isinstance(ei.value, ShardLostError), msg
            assert "client worker made no progress" in msg and "stopped sending heartbeats" in msg


def _processes():
    """(pid, argv) of every process this user can read."""
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            argv = [a.decode() for a in (d / "cmdline").read_bytes().split(b"\0") if a]
        except (OSError, UnicodeDecodeError):
            continue
        yield int(d.name), argv


def _worker_of(parent: int) -> bool:
    """True when ``parent`` (a `mtplib generate --plan` process) runs its client worker."""
    return any(any("mtplib.distributed.worker" in a for a in argv) and argv[-1:] == [str(parent)]
               for _, argv in _processes())


def _shards_of(parent: int) -> list[tuple[str, int]]:
    """(endpoint, pid) of the `shard serve` processes started by ``parent``."""
    return sorted((argv[argv.index("--endpoint") + 1], pid) for pid, argv in _processes()
                  if "serve" in argv and "--parent-pid" in argv
                  and argv[argv.index("--parent-pid") + 1] == str(parent))


@pytest.mark.parametrize("when", ["starting", "loading", "generating"])
def test_cli_ranged_generation_with_a_stopped_shard_ends_clearly(pair, when):
    """`generate --plan` (the whole generation is one worker call): SIGSTOP a shard while it
    starts (before it answers its probe), while the client worker loads the model through it
    (loading allows long silences, not a stopped shard: this hung for 600 s before), or
    mid-generation; the run ends within a few silence limits, exit 2, naming that shard."""
    env = dict(os.environ, MTPLIB_SHARD_SILENCE_S="3", PYTHONPATH=str(REPO))
    p = subprocess.Popen([sys.executable, "-m", "mtplib.cli", "generate", "--model",
                          str(pair.trunk), "--tokens", "1,2,3", "--n", "4000", "--ctx", "4096",
                          "--plan", "0-1,2-3", "--threads", "1"], cwd=REPO, env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    stopped = None
    try:
        deadline = time.monotonic() + 60
        while len(found := _shards_of(p.pid)) < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert len(found) == 2, "the CLI did not start two shards"
        if when != "starting":
            # the client worker starts once every shard has answered its probe, then loads
            while not _worker_of(p.pid) and time.monotonic() < deadline:
                assert p.poll() is None, p.communicate()
                time.sleep(0.02)
            assert _worker_of(p.pid), "the CLI did not start its client worker"
        if when == "generating":
            time.sleep(2)
        assert p.poll() is None
        endpoint, stopped = found[1]
        os.kill(stopped, signal.SIGSTOP)
        t0 = time.monotonic()
        _, err = p.communicate(timeout=30)
        elapsed = time.monotonic() - t0
    finally:
        if stopped is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(stopped, signal.SIGCONT)
        if p.poll() is None:
            p.kill()
            p.wait()
    assert p.returncode == 2 and elapsed < 15, (p.returncode, elapsed, err)
    assert f"({endpoint}): stopped (SIGSTOP?)" in err and "Traceback" not in err, err
    assert err.count("): stopped") == 1, err
