"""The rest of llama-server's request surface (issue 43, point 2), each in the shape its
README (tools/server/README.md of the pinned llama.cpp) and, where that is vague, its
server-*.cpp give: several prompts in one request answer a list (native) or one choice each
(OpenAI), ``n`` / ``n_cmpl`` choices per prompt (child seeds seed + j), ``logit_bias`` keyed
by text, ``timings_per_token``, ``return_progress``, a stream's ``n_probs`` one token per
event, ``post_sampling_probs``' ``prob``/``top_probs``, /metrics' headers, a CORS preflight's
200; and structured output's refusals (a bad grammar or schema is a 400 naming it).

Over the fake backend of tests/test_serve_http.py (milliseconds, no model), except the
last tests: on the committed trained pair, a token banned by logit_bias is drafted by MTP
and never accepted (the verify picks from the biased logits), and post-sampling
probabilities are the distribution the token was drawn from."""

from __future__ import annotations

import math
import time

import numpy as np
import pytest

pytest.importorskip("fastapi")
from fastapi.testclient import TestClient  # noqa: E402
from test_serve_http import FakeBackend, _cfg, _events, _expected  # noqa: E402

from mtplib.model.trained import trained_paths  # noqa: E402
from mtplib.serve.app import create_app  # noqa: E402
from mtplib.serve.protocol import prompts_of  # noqa: E402
from mtplib.serve.worker import GenerationWorker  # noqa: E402

PAIR = trained_paths()
needs_pair = pytest.mark.skipif(not PAIR.exists(), reason="evidence/trained-v4 missing")


@pytest.fixture
def served():
    be = FakeBackend()
    worker = GenerationWorker(be, _cfg(bos_id=None, queue_max=8))
    with TestClient(create_app(worker, on_shutdown=lambda: worker.stop(5))) as c:
        yield c, be, worker
    assert not worker.thread.is_alive()


def _stream(c, path: str, body: dict) -> list:
    with c.stream("POST", path, json={**body, "stream": True}) as r:
        assert r.status_code == 200, r.read()
        return _events(r.read().decode())


# -- several prompts, n choices -------------------------------------------------------------
def test_prompts_are_read_as_llama_server_reads_them():
    assert prompts_of("a") == ["a"]
    assert prompts_of([1, 2]) == [[1, 2]]  # a list holding an id: one prompt
    assert prompts_of([1, "a", 2]) == [[1, "a", 2]]  # ids mixed with text: one prompt
    assert prompts_of(["a"]) == ["a"]
    assert prompts_of(["a", "b"]) == ["a", "b"]  # no id in the list: several prompts
    assert prompts_of([[1, 2], "b", [3, "c"]]) == [[1, 2], "b", [3, "c"]]


def test_several_prompts_answer_a_list_natively_and_choices_in_openai(served):
    c, be, _ = served
    prompts = ["ab", [3, 4, 5], "xyz"]
    body = {"prompt": prompts, "n_predict": 4, "return_tokens": True, "seed": 2}
    got = c.post("/completion", json=body).json()
    assert isinstance(got, list) and [b["index"] for b in got] == [0, 1, 2]
    for b, p in zip(got, prompts, strict=True):
        toks = be.tokenize(p) if isinstance(p, str) else p
        assert b["tokens"] == [be.next_token(toks, i, 2) for i in range(4)]
        assert b["content"] == be.detokenize(b["tokens"]) and b["tokens_evaluated"] == len(toks)
    o = c.post("/v1/completions", json={"prompt": ["ab", "xyz"], "max_tokens": 3}).json()
    assert [ch["index"] for ch in o["choices"]] == [0, 1]
    assert o["choices"][1]["text"] == be.detokenize(_expected(be, "xyz", 3))
    assert o["usage"] == {"prompt_tokens": 5, "completion_tokens": 6, "total_tokens": 11}
    # streamed: each event names its prompt; every prompt ends with its own last event
    ev = _stream(c, "/completion", {"prompt": ["ab", "xyz"], "n_predict": 3})
    for i, p in enumerate(["ab", "xyz"]):
        mine = [e for e in ev if e["index"] == i]
        assert "".join(e["content"] for e in mine) == be.detokenize(_expected(be, p, 3))
        assert [e["stop"] for e in mine][-1] is True and mine[-1]["stop_type"] == "limit"
    assert sum(e["stop"] for e in ev) == 2


def test_n_choices_seed_each_child_as_llama_server(served):
    c, be, _ = served
    for field in ("n", "n_cmpl"):  # n_cmpl is llama-server's name
        got = c.post("/completion", json={"prompt": "ab", "n_predict": 3, "seed": 7,
                                          "return_tokens": True, field: 3}).json()
        assert [b["tokens"] for b in got] == [_expected(be, "ab", 3, seed=7 + j)
                                              for j in range(3)]
        assert [b["generation_settings"]["seed"] for b in got] == [7, 8, 9]
    chat = c.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "x"}], "max_tokens": 2, "n": 2}).json()
    assert [ch["index"] for ch in chat["choices"]] == [0, 1]
    assert chat["usage"]["completion_tokens"] == 4
    # two prompts x n=2: four choices, prompt-major
    o = c.post("/v1/completions", json={"prompt": ["ab", "cd"], "max_tokens": 2, "n": 2,
                                        "seed": 1}).json()
    assert [ch["text"] for ch in o["choices"]] == [
        be.detokenize(_expected(be, p, 2, seed=1 + j)) for p in ("ab", "cd") for j in (0, 1)]
    assert o["usage"]["prompt_tokens"] == 4  # each prompt counted once
    ev = _stream(c, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "x"}], "max_tokens": 2, "n": 2,
        "stream_options": {"include_usage": True}})
    assert ev[-1] == "[DONE]" and ev[-2]["usage"]["completion_tokens"] == 4
    finals = [e["choices"][0]["index"] for e in ev[:-2] if e["choices"][0]["finish_reason"]]
    assert sorted(finals) == [0, 1]
    r = c.post("/completion", json={"prompt": "ab", "n": 2, "n_cmpl": 3})
    assert r.status_code == 400 and r.json()["error"]["param"] == "n_cmpl"
    r = c.post("/completion", json={"prompt": "ab", "n": 9})  # past --queue 8
    assert r.status_code == 400 and "at most 8" in r.json()["error"]["message"]


# -- logit_bias by text -------------------------------------------------------------------
def test_logit_bias_keyed_by_text_biases_each_of_its_tokens(served):
    c, be, _ = served
    for bias, want in [
            ({" wo": -100, "7": 2}, [[7, 2.0]] + [[t, -100.0] for t in be.tokenize(" wo")]),
            ([[" wo", False], [3, 1.5]], [[3, 1.5]] + [[t, False] for t in be.tokenize(" wo")]),
            ({"5": False}, [[5, False]])]:
        b = c.post("/completion", json={"prompt": "a", "n_predict": 1,
                                        "logit_bias": bias}).json()
        assert b["generation_settings"]["logit_bias"] == want, bias
    for bad in ({"": 1}, [["x", True]], [[1, 2, 3]], {"99": 1.0}):
        r = c.post("/completion", json={"prompt": "a", "logit_bias": bad})
        assert r.status_code == 400 and r.json()["error"]["param"] == "logit_bias", bad


# -- timings_per_token, return_progress, n_probs and post_sampling_probs in a stream ----------
def test_timings_per_token_and_return_progress_in_each_stream(served):
    c, be, _ = served
    be.step_s = 0.03  # one event per step (the service sends at most one per 25 ms)
    ev = _stream(c, "/completion", {"prompt": "abc", "n_predict": 4,
                                    "timings_per_token": True, "return_progress": True})
    prog = [e["prompt_progress"] for e in ev if "prompt_progress" in e]
    assert [(p["total"], p["cache"], p["processed"]) for p in prog] == [(3, 0, 0), (3, 0, 3)]
    assert prog[1]["time_ms"] >= prog[0]["time_ms"] == 0
    toks = [e for e in ev if e["tokens"] and not e["stop"]]
    assert len(toks) == 4 and all("timings" in e for e in toks)
    assert [e["timings"]["predicted_n"] for e in toks] == [1, 2, 3, 4]
    assert all(e["timings"]["prompt_n"] == 3 for e in toks)
    for path, body in (("/v1/completions", {"prompt": "abc"}),
                       ("/v1/chat/completions", {"messages": [{"role": "user",
                                                               "content": "x"}]})):
        ev = _stream(c, path, {**body, "max_tokens": 3, "timings_per_token": True,
                               "return_progress": True})
        assert [e["prompt_progress"]["processed"] > 0 for e in ev[:-1]
                if "prompt_progress" in e] == [False, True]
        assert all("timings" in e for e in ev[:-1] if "prompt_progress" not in e)
    ev = _stream(c, "/completion", {"prompt": "abc", "n_predict": 2})
    assert not any("timings" in e or "prompt_progress" in e for e in ev[:-1])


def test_a_streams_n_probs_come_one_token_per_event(served):
    c, be, _ = served
    be.step_s = 0.0  # several tokens reach the stream together
    ev = _stream(c, "/completion", {"prompt": "abc", "n_predict": 6, "n_probs": 2})
    toks = [e for e in ev if not e["stop"]]
    assert len(toks) == 6 and all(len(e["tokens"]) == 1 for e in toks)
    for e in toks:
        (p,) = e["completion_probabilities"]
        assert p["id"] == e["tokens"][0] and p["token"] == e["content"]
        assert set(p) == {"id", "token", "logprob", "bytes", "top_logprobs"}
        assert len(p["top_logprobs"]) == 2
    assert [e["tokens_predicted"] for e in toks] == list(range(1, 7))
    assert "completion_probabilities" not in ev[-1]  # as llama-server's final event


def test_post_sampling_probs_shape(served):
    c, _, _ = served
    b = c.post("/completion", json={"prompt": "abc", "n_predict": 2, "n_probs": 3,
                                    "post_sampling_probs": True}).json()
    assert b["generation_settings"]["post_sampling_probs"] is True
    for p in b["completion_probabilities"]:
        assert set(p) == {"id", "token", "bytes", "prob", "top_probs"}
        assert 0 < p["prob"] <= 1 and 0 < len(p["top_probs"]) <= 3
        assert all(set(t) == {"id", "token", "bytes", "prob"} for t in p["top_probs"])
    r = c.post("/v1/completions", json={"prompt": "a", "post_sampling_probs": True})
    assert r.status_code == 400 and "/completion" in r.json()["error"]["message"]


# -- /metrics and CORS --------------------------------------------------------------------
def test_metrics_headers_and_cors_preflight_as_llama_server(served):
    c, _, _ = served
    m = c.get("/metrics")
    assert m.headers["content-type"] == "text/plain; version=0.0.4; charset=utf-8"
    assert abs(int(m.headers["process-start-time-unix"]) - time.time()) < 600
    assert "# TYPE llamacpp:prompt_tokens_cached_total counter" in m.text
    for headers in ({"Origin": "http://page.example", "Access-Control-Request-Method": "POST",
                     "Access-Control-Request-Headers": "x-stainless-os"},
                    {"Origin": "http://page.example"}, {}):
        pre = c.options("/completion", headers=headers)
        assert pre.status_code == 200 and pre.content == b"", headers
    assert "x-stainless-os" in c.options("/completion", headers={
        "Origin": "o", "Access-Control-Request-Headers": "x-stainless-os"}
    ).headers["access-control-allow-headers"]


# -- structured output's refusals (the constraint itself: tests/test_serve_structured.py) -----
@pytest.mark.parametrize("extra, param, says", [
    ({"grammar": 'root ::= ("a"'}, "grammar", "expecting ')'"),
    ({"grammar": "root ::= foo"}, "grammar", "Undefined rule identifier 'foo'"),
    ({"json_schema": {"type": "foo"}}, "json_schema", "unsupported or invalid schema"),
    ({"json_schema": {"type": "integer", "minimum": 3}}, "json_schema", "minimum"),
    ({"response_format": {"type": "xml"}}, "response_format", "text, json_object or"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": [1]}}},
     "response_format", "must be a JSON object"),
    ({"grammar": 'root ::= "a"', "json_schema": {}}, "grammar", "not both"),
    ({"grammar": 'root ::= "a"', "ignore_eos": True}, "ignore_eos", "ignore_eos"),
])
def test_a_bad_grammar_or_schema_is_a_400_naming_it(served, extra, param, says):
    c, _, worker = served
    for path, base in (("/completion", {"prompt": "a"}), ("/v1/chat/completions", {
            "messages": [{"role": "user", "content": "x"}]})):
        r = c.post(path, json={**base, **extra})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == param and says in err["message"], err
        assert "\n" not in err["message"]
    assert worker.stats.totals.requests["ok"] == 0  # refused before the worker


def test_a_grammar_is_reported_in_the_settings(served):
    c, _, _ = served
    b = c.post("/completion", json={"prompt": "a", "n_predict": 1,
                                    "grammar": 'root ::= "a"'}).json()
    assert b["generation_settings"]["grammar"] == 'root ::= "a"'
    b = c.post("/completion", json={"prompt": "a", "n_predict": 1,
                                    "response_format": {"type": "json_object"}}).json()
    assert "root ::=" in b["generation_settings"]["grammar"]


# -- on the trained pair: what a ban does to MTP, post-sampling probabilities ----------------
@pytest.fixture(scope="module")
def prompts():
    from mtplib.lab.trained_eval import heldout_modules, heldout_tokens, prompts_from

    docs = heldout_tokens(PAIR.trunk, heldout_modules(PAIR.trunk.parent / "split.json"))
    return prompts_from(docs, n=4, length=32, seed=0)


@needs_pair
def test_a_banned_token_is_drafted_but_never_accepted(prompts):
    """MTP drafts from its own head, which knows nothing of logit_bias: the banned token
    (the most frequent one of the unbiased output) is proposed, and the verify rejects it
    every time (each pick comes from the biased logits; an accepted draft is a pick), so
    no output holds it, greedy or sampled, while every step still verified drafts."""
    from collections import Counter

    from mtplib.runtime.sampling import Sampler
    from mtplib.runtime.speculative import MTPRuntime

    n = 48
    drafted: list[int] = []
    with MTPRuntime(str(PAIR.trunk), str(PAIR.sidecar), k=2, n_ctx=256, n_threads=1) as rt:
        plain = [rt.generate(p, n)[0] for p in prompts]
        banned = Counter(t for toks in plain for t in toks).most_common(1)[0][0]
        propose = rt.engine.drafter.propose

        def spy(*a, **kw):
            out = propose(*a, **kw)
            drafted.extend(int(t) for t in out)
            return out

        rt.engine.drafter.propose = spy
        runs = [[rt.generate(p, n, sampler=s) for p in prompts] for s in (
            Sampler(logit_bias=((banned, -math.inf),)),
            Sampler(temperature=0.8, seed=3, logit_bias=((banned, -math.inf),)))]
    assert drafted.count(banned) >= 4, drafted.count(banned)  # proposed, again and again
    for run in runs:
        assert all(banned not in toks for toks, _ in run)
        assert sum(m.accepted for _, m in run) > 0  # MTP still worked around it
    assert [t for t, _ in runs[0]] != plain


@needs_pair
def test_post_sampling_probs_are_the_distribution_drawn_from(prompts):
    from mtplib.runtime.sampling import Sampler
    from mtplib.runtime.speculative import MTPRuntime

    with MTPRuntime(str(PAIR.trunk), str(PAIR.sidecar), k=2, n_ctx=256, n_threads=1) as rt:
        s = Sampler(logprobs=4, post_sampling_probs=True)
        out = list(rt.stream(prompts[0], 8, sampler=s))
        recs = [r for step in out for r in step.logprobs]
        assert all(r.logprob == 0.0 and r.top[0] == (r.token, 0.0) for r in recs)
        assert all(all(lp == -math.inf for _, lp in r.top[1:]) for r in recs)
        s = Sampler(temperature=0.9, top_k=3, seed=5, logprobs=4, post_sampling_probs=True)
        recs = [r for step in rt.stream(prompts[1], 8, sampler=s) for r in step.logprobs]
    for r in recs:  # top-k 3: three tokens left, their probabilities summing to 1
        p = np.exp([lp for _, lp in r.top])
        assert p[3] == 0 and p[:3].sum() == pytest.approx(1.0) and np.all(p[:3] > 0)
        assert r.token in [t for t, _ in r.top[:3]]
