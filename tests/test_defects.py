"""Issue 22, item 4: crash, data-loss and silent-wrong-output defects, one test each.

Library calls that used to crash the process run in a child process, so a regression
kills the child (and fails the test) rather than the test run.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import threading

import pytest

from mtplib.lab.correctness import seeded_prompt
from mtplib.runtime.model import RuntimeInputError, check_n_new, check_tokens

PROMPT = seeded_prompt(7, 10)


def _child(script: str, *args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(script), *args],
                          capture_output=True, text=True, timeout=timeout)


# -- closed runtime ------------------------------------------------------------------------
CLOSED = """
    import json, sys
    from mtplib.errors import InputError
    from mtplib.runtime.speculative import MTPRuntime

    rt = MTPRuntime(sys.argv[1], sys.argv[2], k=2, n_ctx=256, n_threads=1)
    before = rt.memory()["target_seq_state_bytes"] >= 0
    rt.close()
    rt.close()  # idempotent
    out = {"before": before}
    for name, fn in (("memory", rt.memory), ("memory(1)", lambda: rt.memory(1)),
                     ("generate", lambda: rt.generate([1, 2, 3], 2))):
        try:
            fn()
            out[name] = "accepted"
        except InputError as e:
            out[name] = "ok: " + str(e)
    print(json.dumps(out))
"""


def test_closed_runtime_memory_raises_not_segfaults(pair):
    """memory() after close() read a freed context (rc 139): now a clear error."""
    r = _child(CLOSED, str(pair.trunk), str(pair.sidecar))
    assert r.returncode == 0, (r.returncode, r.stderr[-2000:])
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["before"] is True
    for name in ("memory", "memory(1)", "generate"):
        assert out[name].startswith("ok: ") and "closed" in out[name], (name, out[name])


# -- threads on one runtime ------------------------------------------------------------------
THREADS = """
    import json, sys, threading, time
    from mtplib.runtime import model as M
    from mtplib.runtime.speculative import MTPRuntime

    # count the threads inside upstream's decode at once (a short sleep widens the window)
    inside, peak, guard, decode = [0], [0], threading.Lock(), M.Context.decode

    def counted(self, *a, **kw):
        with guard:
            inside[0] += 1
            peak[0] = max(peak[0], inside[0])
        try:
            time.sleep(0.0005)
            return decode(self, *a, **kw)
        finally:
            with guard:
                inside[0] -= 1

    M.Context.decode = counted
    prompts = [[1 + i, 5, 9, 2 + i, 7] for i in range(4)]
    with MTPRuntime(sys.argv[1], sys.argv[2], k=2, n_seq_max=2, n_ctx=256,
                    n_threads=1) as rt:
        want = [rt.generate(p, 12)[0] for p in prompts]
        got, errors = {}, []

        def work(i):
            try:
                for _ in range(3):
                    got.setdefault(i, []).append(rt.generate(prompts[i], 12)[0])
            except BaseException as e:  # noqa: BLE001
                errors.append(repr(e))

        ts = [threading.Thread(target=work, args=(i,)) for i in range(4)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
    print(json.dumps({"equal": all(g == [want[i]] * 3 for i, g in got.items()),
                      "n": sum(len(g) for g in got.values()), "errors": errors,
                      "most_threads_in_decode": peak[0]}))
"""


def test_concurrent_generate_on_one_runtime_is_serialized(pair):
    """4 threads x 3 generations on one MTPRuntime (n_seq_max 2) crashed the process in 11
    of 12 runs (SIGSEGV / SIGABRT) where the reporter ran them: the runtime's lock
    serializes them (never two threads inside upstream's decode at once), and each result
    equals the same generation run alone."""
    r = _child(THREADS, str(pair.trunk), str(pair.sidecar))
    assert r.returncode == 0, (r.returncode, r.stderr[-2000:])
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out == {"equal": True, "n": 12, "errors": [], "most_threads_in_decode": 1}


# -- n_new and token ids -----------------------------------------------------------------
def test_check_n_new_and_tokens():
    assert check_n_new(0) == 0 and check_n_new(5) == 5
    for bad in (-3, -1, 1.0, 2.5, True, "3", None):
        with pytest.raises(RuntimeInputError, match="n_new"):
            check_n_new(bad)
    assert check_tokens([1, 2], 10) == [1, 2]
    for bad, msg in (([1, 2.0], "not an integer"), ([1.5], "not an integer"),
                     ([True], "not an integer"), ([10], "out of range"), ([-1], "out of range"),
                     ("123", "sequence"), (5, "sequence")):
        with pytest.raises(RuntimeInputError, match=msg):
            check_tokens(bad, 10)


@pytest.fixture(scope="module")
def mtp_runtime(pair):
    from mtplib.runtime.speculative import MTPRuntime

    with MTPRuntime(str(pair.trunk), str(pair.sidecar), k=2, n_ctx=256, n_threads=1) as rt:
        yield rt


@pytest.mark.parametrize("k", [0, 2])
def test_n_zero_generates_nothing(pair, mtp_runtime, k):
    """n_new 0 used to emit the prefill's first token (whole, MTP on and off)."""
    from mtplib.runtime.speculative import MTPRuntime

    if k:
        toks, m = mtp_runtime.generate(PROMPT, 0)
    else:
        with MTPRuntime(str(pair.trunk), k=0, n_ctx=256, n_threads=1) as rt:
            toks, m = rt.generate(PROMPT, 0)
    assert toks == [] and m["n_generated"] == 0 and m["n_prompt"] == len(PROMPT)
    assert "memory" in m and "routing" in m
    assert len(mtp_runtime.generate(PROMPT, 1)[0]) == 1  # one is still one


@pytest.mark.parametrize("prompt, n_new, msg", [
    (PROMPT, -3, "n_new"), (PROMPT, 2.0, "n_new"), ([1, 2.5, 3], 2, "not an integer"),
    ([1.0, 2.0], 2, "not an integer"), ([1, 10**6], 2, "out of range"), ([], 2, "empty")])
def test_generate_refuses_bad_arguments(mtp_runtime, prompt, n_new, msg):
    with pytest.raises(RuntimeInputError, match=msg):
        mtp_runtime.generate(prompt, n_new)


def test_decode_refuses_float_token_ids(mtp_runtime):
    with pytest.raises(RuntimeInputError, match="not an integer"):
        mtp_runtime.target.decode([1, 2.5], [0, 1])


def test_cli_n_zero_prints_no_tokens(pair):
    r = subprocess.run([sys.executable, "-m", "mtplib.cli", "generate", "--model",
                        str(pair.trunk), "--mtp", str(pair.sidecar), "--tokens", "1,2,3",
                        "--n", "0", "--ctx", "256", "--json"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert json.loads(r.stdout)["tokens"] == []


# -- --ctx below upstream's padding ------------------------------------------------------
def test_ctx_is_honoured_below_upstream_padding(pair):
    """Upstream pads n_ctx to a multiple of 256; a context asked for 64 bounds positions at
    64 (it silently held 256 before)."""
    from mtplib.runtime.speculative import MTPRuntime

    with MTPRuntime(str(pair.trunk), k=0, n_ctx=64, n_threads=1) as rt:
        assert rt.target.n_ctx == 64 and rt.target.n_ctx_upstream == 256
        assert len(rt.generate(PROMPT, 64 - len(PROMPT))[0]) == 64 - len(PROMPT)
        with pytest.raises(RuntimeInputError, match="context of 64"):
            rt.generate(PROMPT, 64 - len(PROMPT) + 1)
        with pytest.raises(RuntimeInputError, match="outside the context"):
            rt.target.decode([1], [64])


def test_cli_ctx_64_refuses_what_does_not_fit(pair):
    r = subprocess.run([sys.executable, "-m", "mtplib.cli", "generate", "--model",
                        str(pair.trunk), "--tokens", "1,2,3", "--n", "100", "--ctx", "64"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "context of 64" in r.stderr, r.stderr[-2000:]
    assert "Traceback" not in r.stderr


# -- ranged --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def ranged(pair):
    from mtplib.distributed.ranged_mtp import RangedMTP

    with RangedMTP(str(pair.trunk), plan="0-1,2-3", sidecar=str(pair.sidecar)) as r:
        yield r


def test_ranged_n_zero_and_bad_arguments(ranged):
    from mtplib.runtime.speculative import EngineOptions

    toks, m = ranged.generate(PROMPT, 0, EngineOptions(k=2))
    assert toks == [] and m["n_generated"] == 0
    for prompt, n_new, msg in ((PROMPT, -3, "n_new"), ([1, 2.5], 2, "not an integer"),
                               ([1, 10**6], 2, "out of range")):
        with pytest.raises(RuntimeInputError, match=msg):
            ranged.generate(prompt, n_new, EngineOptions(k=2))


def test_ranged_threads_count_their_own_seam_bytes(ranged):
    """Two threads on one RangedMTP counted each other's traffic (seam_bytes doubled):
    generations are serialized from reset_counts to the metrics."""
    from mtplib.runtime.speculative import EngineOptions

    opts = EngineOptions(k=0)
    alone = ranged.generate(PROMPT, 6, opts)[1]["seam_bytes"]
    results: list = []
    ts = [threading.Thread(target=lambda: results.append(ranged.generate(PROMPT, 6, opts)))
          for _ in range(2)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert len(results) == 2
    for toks, m in results:
        assert len(toks) == 6
        # the same generation alone moves the same bytes, give or take a little protocol noise
        assert abs(m["seam_bytes"] - alone) <= 0.1 * alone, (m["seam_bytes"], alone)


def test_ranged_closed_raises(pair):
    from mtplib.distributed.ranged_mtp import RangedMTP

    r = RangedMTP(str(pair.trunk), plan="0-1,2-3")
    r.close()
    with pytest.raises(RuntimeInputError, match="closed"):
        r.generate(PROMPT, 2)
