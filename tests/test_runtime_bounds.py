"""Calls upstream asserts on, refused first: sequence ids, use after close(), row and
logit indices, thread counts, sampling values, and the CLI's options (the same bounds
whole-model and ranged). Each crashed the process before (SIGABRT / SIGSEGV)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import gguf_craft as C
import pytest

from mtplib.errors import InputError
from mtplib.runtime.model import ContextConfig, RuntimeInputError, check_threads, max_threads
from mtplib.runtime.sampling import Sampler

#: Library calls, run in a child process (a regression would kill it, not the test run);
#: each prints "name: ok" when refused with an InputError, else what happened.
LIBRARY = textwrap.dedent("""
    import json, sys
    from mtplib.errors import InputError
    from mtplib.runtime.model import Context, ContextConfig, Model
    from mtplib.runtime.speculative import MTPRuntime

    trunk, sidecar = sys.argv[1], sys.argv[2]
    out = {}

    def refused(name, fn):
        try:
            fn()
        except InputError as e:
            out[name] = "ok: " + str(e)
        except BaseException as e:  # noqa: BLE001
            out[name] = f"wrong error {type(e).__name__}: {e}"
        else:
            out[name] = "accepted"

    m = Model(trunk)
    ctx = Context(m, ContextConfig(n_ctx=256, n_threads=1, nextn_rows="all", n_rs_seq=2))
    ctx.decode([1, 2, 3], [0, 1, 2], logits=[False, False, True])
    blob = ctx.state_get(0)
    out["valid calls"] = [ctx.logits(-1).shape[0], ctx.logits(2).shape[0],
                          ctx.nextn_rows(3).shape[0], len(blob) > 0,
                          ctx.seq_pos_max(0), ctx.seq_rm(0, 2, -1)]
    refused("seq_rm(5, 0, -1)", lambda: ctx.seq_rm(5, 0, -1))
    refused("seq_rm(-2, 0, -1)", lambda: ctx.seq_rm(-2, 0, -1))
    refused("state_set(3, blob)", lambda: ctx.state_set(3, blob))
    refused("state_get(1)", lambda: ctx.state_get(1))
    refused("seq_pos_max(7)", lambda: ctx.seq_pos_max(7))
    refused("decode(seq_id=1)", lambda: ctx.decode([4], [3], seq_id=1))
    refused("nextn_rows(200000)", lambda: ctx.nextn_rows(200000))
    refused("nextn_rows(0)", lambda: ctx.nextn_rows(0))
    refused("logits(0) unflagged", lambda: ctx.logits(0))
    refused("logits(5) past the batch", lambda: ctx.logits(5))
    refused("logits(-2) past the outputs", lambda: ctx.logits(-2))
    refused("tokenize(bad UTF-8)", lambda: m.tokenize("caf\\udce9"))
    refused("detokenize([999])", lambda: m.detokenize([999]))
    ctx.close()
    for name, fn in [("decode", lambda: ctx.decode([1], [0])), ("logits", lambda: ctx.logits(-1)),
                     ("nextn_rows", lambda: ctx.nextn_rows(1)),
                     ("seq_rm", lambda: ctx.seq_rm(0, 0, -1)),
                     ("state_get", lambda: ctx.state_get(0)),
                     ("state_set", lambda: ctx.state_set(0, blob)), ("clear", ctx.clear)]:
        refused(f"context {name} after close()", fn)
    ctx2 = Context(m, ContextConfig(n_ctx=256, n_threads=1))
    m.close()
    refused("decode after the model's close()", lambda: ctx2.decode([1], [0]))
    refused("Context(closed model)", lambda: Context(m, ContextConfig(n_ctx=256, n_threads=1)))
    refused("tokenize after close()", lambda: m.tokenize("hi"))
    rt = MTPRuntime(trunk, sidecar, k=2, n_ctx=256, n_threads=1)
    rt.close()
    refused("MTPRuntime.generate after close()", lambda: rt.generate([1, 2, 3], 4))
    print(json.dumps(out))
""")


@pytest.fixture(scope="module")
def library(pair):
    r = subprocess.run([sys.executable, "-c", LIBRARY, str(pair.trunk), str(pair.sidecar)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, (r.returncode, r.stderr[-3000:])
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_valid_calls_still_work(library):
    """logits(-1), logits(2), nextn_rows(3), a checkpoint, seq_pos_max, a tail seq_rm."""
    assert library["valid calls"] == [256, 256, 3, True, 2, True]


@pytest.mark.parametrize("name", [
    "seq_rm(5, 0, -1)", "seq_rm(-2, 0, -1)", "state_set(3, blob)", "state_get(1)",
    "seq_pos_max(7)", "decode(seq_id=1)", "nextn_rows(200000)", "nextn_rows(0)",
    "logits(0) unflagged", "logits(5) past the batch", "logits(-2) past the outputs",
    "tokenize(bad UTF-8)", "detokenize([999])",
    "context decode after close()", "context logits after close()",
    "context nextn_rows after close()", "context seq_rm after close()",
    "context state_get after close()", "context state_set after close()",
    "context clear after close()", "decode after the model's close()",
    "Context(closed model)", "tokenize after close()", "MTPRuntime.generate after close()"])
def test_library_refuses(library, name):
    assert library[name].startswith("ok: "), (name, library[name])


def test_refusals_say_why(library):
    assert "n_seq_max=1" in library["seq_rm(5, 0, -1)"]
    assert "closed" in library["MTPRuntime.generate after close()"]
    assert "closed" in library["decode after the model's close()"]
    assert "3 row(s)" in library["nextn_rows(200000)"]


def test_threads_bounded_by_the_machine():
    assert check_threads(1) == 1 and check_threads(max_threads()) == max_threads()
    assert max_threads() == (os.cpu_count() or 1)
    for bad in (0, -1, max_threads() + 1, 100000, 2.0, True, "2"):
        with pytest.raises(RuntimeInputError, match="this machine's CPUs"):
            check_threads(bad)
    for bad in (100000, 0):
        with pytest.raises(RuntimeInputError, match="n_threads"):
            ContextConfig(n_threads=bad).validate()
    with pytest.raises(RuntimeInputError, match="n_rs_seq"):
        ContextConfig(n_rs_seq=-1).validate()


@pytest.mark.parametrize("kw", [
    {"temperature": float("nan")}, {"temperature": float("inf")}, {"temperature": -0.5},
    {"temperature": "1"}, {"top_p": -1.0}, {"top_p": 0.0}, {"top_p": float("nan")},
    {"top_p": 1.5}, {"seed": -1}, {"seed": 1.5}, {"seed": True}])
def test_sampler_refuses(kw):
    with pytest.raises(InputError):
        Sampler(**kw)


def test_sampler_tiny_temperature_is_greedy_not_nan():
    import numpy as np

    s = Sampler(temperature=1e-300, seed=3)
    logits = np.array([0.5, 2.0, 1.0, -3.0], dtype=np.float32)
    p = s.probs(logits)
    assert np.isfinite(p).all() and p.argmax() == 1 and p[1] == 1.0
    assert all(s.pick(logits, position=i) == 1 for i in range(20))


# -- the CLI: one line naming the option, exit 2, the same bounds whole-model and ranged ----
def _cli_cases(pair) -> dict[str, tuple[list, str]]:
    t, s = str(pair.trunk), str(pair.sidecar)
    base = ["generate", "--model", t, "--tokens", "1,2,3", "--n", "4"]
    ranged = base + ["--plan", "0-1,2-3", "--mtp", s]
    return {
        "temp-nan": (base + ["--temp", "nan"], "--temp"),
        "temp-inf": (base + ["--temp", "inf"], "--temp"),
        "top-p-negative": (base + ["--top-p", "-1"], "--top-p"),
        "seed-negative": (base + ["--seed", "-1"], "--seed"),
        "plan-empty": (base + ["--plan", ""], "--plan is empty"),
        "endpoints-empty": (base + ["--plan", "0-3", "--endpoints", ""], "--endpoints"),
        "draft-0-whole": (base + ["--mtp", s, "--draft", "0"], "--draft must be in 1..8"),
        "draft-0-ranged": (ranged + ["--draft", "0"], "--draft must be in 1..8"),
        "draft-9-whole": (base + ["--mtp", s, "--draft", "9"], "--draft must be in 1..8"),
        "draft-9-ranged": (ranged + ["--draft", "9"], "--draft must be in 1..8"),
        "draft-negative-ranged": (ranged + ["--draft", "-1"], "--draft must be in 1..8"),
        "threads-100000": (base + ["--threads", "100000"], "--threads must be in 1.."),
        "threads-0": (base + ["--threads", "0"], "--threads must be in 1.."),
        "shard-threads-100000": (ranged + ["--shard-threads", "100000"], "--shard-threads"),
        "ctx-0": (base + ["--ctx", "0"], "--ctx"),
        "shard-serve-threads": (["shard", "serve", "--endpoint", "127.0.0.1:1",
                                 "--threads", "100000"], "--threads must be in 1.."),
        "inventory-plan-empty": (["inventory", t, "--plan", ""], "empty shard plan"),
    }


def test_cli_options_refused_with_one_line(pair):
    cases = _cli_cases(pair)
    results = dict(zip(cases, C.run_many([argv for argv, _ in cases.values()], timeout=60),
                       strict=True))
    for name, (_, expect) in cases.items():
        line = results[name].one_line_error()
        assert expect in line, (name, line)


def test_invalid_utf8_prompt_names_the_option(pair):
    """argv bytes that are not UTF-8 arrive as surrogates; upstream's tokenizer never sees
    them (it used to fail with a raw "surrogates not allowed")."""
    r = subprocess.run([sys.executable, "-m", "mtplib.cli", "generate", "--model",
                        str(pair.trunk), "--prompt", b"caf\xe9 \xff", "--n", "2"],
                       capture_output=True, timeout=60)
    res = C.CliResult(("generate",), r.returncode, r.stdout.decode(), r.stderr.decode())
    assert "--prompt is not valid UTF-8" in res.one_line_error()
