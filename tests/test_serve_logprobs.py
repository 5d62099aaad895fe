"""Log-probabilities on `mtplib serve --plan` (local shards), one slot and four: each
endpoint's shape (OpenAI's completions ``logprobs``, chat ``logprobs`` + ``top_logprobs``,
llama-server's ``n_probs``) answers 200 with the whole model's values for the same greedy
request. Before, a ranged service answered 500: serve put a callback on the sampler, which
cannot be pickled to the ranged worker; now the engine computes each emitted token's
record where it runs and sends it back with the step's tokens, on every backend."""

from __future__ import annotations

import threading

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("openai")  # test_serve's helpers need it

from test_serve import REQ_S, TRAINED, _cache_args, start, stop  # noqa: E402

N, TOP = 12, 2
#: the tolerance between the whole model's log-probabilities and the shards' (float noise)
TOL = 1e-3
COMMON = ("-m", str(TRAINED.trunk), "-md", str(TRAINED.sidecar), "--draft", "2", "-c",
          "1024", "-t", "1")
GREEDY = {"temperature": 0, "ignore_eos": True}
#: name -> (endpoint, body): one request per shape that reports log-probabilities
REQUESTS = {
    "completions": ("/v1/completions", {"prompt": "def main(", "max_tokens": N,
                                        "logprobs": TOP, **GREEDY}),
    "chat": ("/v1/chat/completions", {
        "messages": [{"role": "user", "content": "import os"}], "max_tokens": N,
        "logprobs": True, "top_logprobs": TOP, **GREEDY}),
    "native": ("/completion", {"prompt": "class Config:", "n_predict": N, "n_probs": TOP,
                               **GREEDY}),
}

needs_trained = pytest.mark.skipif(not TRAINED.exists(),
                                   reason="evidence/trained-v4 missing")

#: (token, logprob, ((alternative, logprob), ...)) per emitted token
Entries = list[tuple[str, float, tuple[tuple[str, float], ...]]]


def _entries(name: str, body: dict) -> Entries:
    """One response's log-probabilities, whatever its shape, after checking the shape."""
    if name == "completions":
        lp = body["choices"][0]["logprobs"]
        assert set(lp) == {"tokens", "token_logprobs", "top_logprobs", "text_offset"}
        assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"])
        return [(t, v, tuple(top.items())) for t, v, top in
                zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"], strict=True)]
    if name == "chat":
        content = body["choices"][0]["logprobs"]["content"]
        for e in content:
            assert set(e) == {"token", "logprob", "bytes", "top_logprobs"}
            assert all(set(t) == {"token", "logprob", "bytes"} for t in e["top_logprobs"])
        return [(e["token"], e["logprob"],
                 tuple((t["token"], t["logprob"]) for t in e["top_logprobs"]))
                for e in content]
    probs = body["completion_probabilities"]
    for p in probs:
        assert set(p) == {"id", "token", "logprob", "bytes", "top_logprobs"}
        assert all(set(t) == {"id", "token", "logprob", "bytes"} for t in p["top_logprobs"])
        assert p["top_logprobs"][0]["id"] == p["id"]  # greedy: the pick is the top one
    return [(p["token"], p["logprob"],
             tuple((t["token"], t["logprob"]) for t in p["top_logprobs"])) for p in probs]


def _ask_all(url: str, *, together: bool) -> dict[str, Entries]:
    """Every request of REQUESTS (``together``: at once, from threads), checked: 200,
    N tokens, TOP alternatives each, the emitted token the most probable (greedy)."""
    got: dict[str, httpx.Response] = {}

    def ask(name: str) -> None:
        path, body = REQUESTS[name]
        got[name] = httpx.post(url + path, json=body, timeout=REQ_S)

    ts = [threading.Thread(target=ask, args=(n,)) for n in REQUESTS]
    for t in ts:
        t.start()
        if not together:
            t.join()
    for t in ts:
        t.join(REQ_S)
    out = {}
    for name in REQUESTS:
        r = got[name]
        assert r.status_code == 200, (name, r.text)
        out[name] = e = _entries(name, r.json())
        assert len(e) == N, (name, e)
        assert all(len(top) == TOP and top[0] == (tok, lp) for tok, lp, top in e), (name, e)
        assert all(lp <= 0 for _, lp, _ in e)
    return out


def _same(got: dict[str, Entries], want: dict[str, Entries]) -> None:
    for name in REQUESTS:
        for i, ((t, lp, top), (wt, wlp, wtop)) in enumerate(
                zip(got[name], want[name], strict=True)):
            assert t == wt, (name, i)
            assert lp == pytest.approx(wlp, abs=TOL), (name, i)
            assert [a for a, _ in top] == [a for a, _ in wtop], (name, i)
            assert [v for _, v in top] == pytest.approx([v for _, v in wtop], abs=TOL)


@pytest.fixture(scope="module")
def whole_logprobs() -> dict[str, Entries]:
    """The whole model's answers (one slot): what every other service must give."""
    if not TRAINED.exists():
        pytest.skip("evidence/trained-v4 missing")
    s = start(*COMMON)
    try:
        return _ask_all(s.url, together=False)
    finally:
        assert stop(s.proc) == 0, s.log()


@pytest.fixture
def server_factory():
    started = []

    def make(*args: str):
        s = start(*args)
        started.append(s)
        return s

    yield make
    for s in started:
        stop(s.proc)


@pytest.mark.slow
@needs_trained
@pytest.mark.parametrize("parallel", [1, 4])
def test_ranged_serve_logprobs_equal_the_whole_models(whole_logprobs, server_factory,
                                                      parallel):
    """On shards (``--parallel 4``: the three requests at once, stepped together), every
    shape answers 200 with the whole model's tokens and log-probabilities."""
    s = server_factory(*COMMON, "--plan", "0-1,2-3", "--parallel", str(parallel),
                       *_cache_args())
    _same(_ask_all(s.url, together=parallel > 1), whole_logprobs)
    assert stop(s.proc) == 0, s.log()


@pytest.mark.slow
@needs_trained
def test_whole_parallel_serve_logprobs_equal_one_slots(whole_logprobs, server_factory):
    """The whole model's batch (``--parallel 4``) reports them by the same mechanism."""
    s = server_factory(*COMMON, "--parallel", "4")
    _same(_ask_all(s.url, together=True), whole_logprobs)
    assert stop(s.proc) == 0, s.log()
