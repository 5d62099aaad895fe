"""`mtplib serve`'s HTTP layer over a fake backend (no model, milliseconds): request
validation and 4xx errors, the bounded queue, one generation at a time, streaming events,
llama-server's timings, the API key. The real models are tests/test_serve.py's."""

from __future__ import annotations

import json
import threading
import time

import numpy as np
import pytest

pytest.importorskip("fastapi")
pytest.importorskip("httpx")
from fastapi.testclient import TestClient  # noqa: E402

from mtplib.contract.labels import TIME_PARTS  # noqa: E402
from mtplib.errors import InputError  # noqa: E402
from mtplib.runtime.engine import Emitted  # noqa: E402
from mtplib.runtime.results import GenerationMetrics  # noqa: E402
from mtplib.runtime.sampling import token_logprob  # noqa: E402
from mtplib.serve.app import create_app  # noqa: E402
from mtplib.serve.config import ServeConfig  # noqa: E402
from mtplib.serve.errors import ApiError  # noqa: E402
from mtplib.serve.events import RunMetrics  # noqa: E402
from mtplib.serve.job import Job  # noqa: E402
from mtplib.serve.native import timings  # noqa: E402
from mtplib.serve.stops import StopText  # noqa: E402
from mtplib.serve.worker import GenerationWorker  # noqa: E402

EOG = 63


class FakeGeneration:
    def __init__(self, be: FakeBackend, prompt: list[int], n: int, sampler) -> None:
        self.be, self.prompt, self.n, self.sampler = be, prompt, n, sampler
        self.tokens: list[int] = []
        self.metrics: GenerationMetrics | None = None
        self.closed = False

    def __iter__(self):
        be = self.be
        with be.count_lock:
            be.active += 1
            be.max_active = max(be.max_active, be.active)
        try:
            for i in range(self.n):
                be.gate.wait(10)
                tok = be.next_token(self.prompt, i, self.sampler.seed)
                probs = None
                if self.sampler.logprobs is not None:  # from logits whose argmax is tok
                    lg = np.arange(64, dtype=np.float32) / 64
                    lg[tok] = 2.0
                    probs = [token_logprob(lg, tok, self.sampler.logprobs)]
                self.tokens.append(tok)
                time.sleep(be.step_s)
                yield Emitted([tok], probs)  # as the engine's steps: tokens with records
            self.metrics = GenerationMetrics(
                k=2, n_prompt=len(self.prompt), n_generated=self.n, drafted=6, accepted=4,
                acceptance_rate=4 / 6, accepted_per_position=[1.0, 1 / 3],
                accepted_per_position_counts=[3, 1], drafted_per_position=[3, 3],
                accept_len_hist={"0": 0, "1": 2, "2": 1}, verify_steps=3,
                plain_steps=max(self.n - 4, 0), rollbacks={}, ttft_s=0.010,
                decode_s=0.002 * max(self.n - 1, 0), decode_tok_s=500.0,
                time_s=dict.fromkeys(TIME_PARTS, 0.0))
        finally:
            with be.count_lock:
                be.active -= 1

    def close(self) -> None:
        self.closed = True

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class FakeBackend:
    """A deterministic stand-in with the library's interface (tokenize, detokenize, n_ctx,
    stream); counts how many generations ever ran at once."""

    n_ctx = 128

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.gate.set()
        self.step_s = 0.0
        self.active = self.max_active = 0
        self.count_lock = threading.Lock()
        self.eog_at: int | None = None
        self.fail: BaseException | None = None

    def next_token(self, prompt: list[int], i: int, seed: int) -> int:
        if self.eog_at is not None and i == self.eog_at:
            return EOG
        return (sum(prompt) + 7 * i + seed) % 50

    def tokenize(self, text: str) -> list[int]:
        return [1 + ord(c) % 40 for c in text]

    def detokenize(self, toks) -> str:
        return "".join(chr(ord("a") + t % 26) for t in toks)

    def stream(self, prompt, n, *, sampler=None):
        if self.fail is not None:
            raise self.fail
        return FakeGeneration(self, list(prompt), n, sampler)


def _cfg(**kw) -> ServeConfig:
    base = dict(model_id="fake.gguf", n_ctx=FakeBackend.n_ctx, n_vocab=64,
                eog=frozenset({EOG}), k=2, default_n=8, queue_max=2, max_body_bytes=4096)
    base.update(kw)
    return ServeConfig(**base)


@pytest.fixture
def served():
    """(client, backend, worker) for one app; the worker is stopped at the end."""
    be = FakeBackend()
    worker = GenerationWorker(be, _cfg())
    with TestClient(create_app(worker, on_shutdown=lambda: worker.stop(5))) as c:
        yield c, be, worker
    assert not worker.thread.is_alive()


def _expected(be: FakeBackend, prompt: str, n: int, seed: int = 0) -> list[int]:
    toks = be.tokenize(prompt)
    return [be.next_token(toks, i, seed) for i in range(n)]


def test_completion_text_tokens_usage_and_timings(served):
    c, be, _ = served
    r = c.post("/v1/completions", json={"model": "fake.gguf", "prompt": "hello",
                                        "max_tokens": 5, "return_tokens": True})
    assert r.status_code == 200, r.text
    body = r.json()
    want = _expected(be, "hello", 5)
    assert body["tokens"] == want
    assert body["choices"][0]["text"] == be.detokenize(want)
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["object"] == "text_completion" and body["model"] == "fake.gguf"
    assert body["usage"] == {"prompt_tokens": 5, "completion_tokens": 5, "total_tokens": 10}
    t = body["timings"]
    assert t["prompt_n"] == 5 and t["predicted_n"] == 5
    assert t["prompt_ms"] == pytest.approx(10.0) and t["predicted_ms"] == pytest.approx(8.0)
    assert t["predicted_per_second"] == pytest.approx(4 / 0.008)
    assert t["draft_n"] == 6 and t["draft_n_accepted"] == 4


def test_timings_names_are_llama_servers():
    t = timings(RunMetrics(ttft_s=0.5, decode_s=1.0, drafted=0), 10, 11)
    assert set(t) == {"cache_n", "prompt_n", "prompt_ms", "prompt_per_token_ms",
                      "prompt_per_second", "predicted_n", "predicted_ms",
                      "predicted_per_token_ms", "predicted_per_second"}  # no drafts: no draft_n
    assert t["predicted_per_second"] == pytest.approx(10.0)
    assert t["prompt_per_second"] == pytest.approx(20.0)


def test_defaults_token_prompts_and_seed(served):
    c, be, _ = served
    r = c.post("/v1/completions", json={"prompt": [3, 4, 5], "seed": 9, "return_tokens": True})
    assert r.status_code == 200, r.text
    assert r.json()["tokens"] == [be.next_token([3, 4, 5], i, 9) for i in range(8)]  # default_n
    r = c.post("/v1/completions", json={"prompt": ["hi"], "max_tokens": 2})
    assert r.status_code == 200


def test_chat_completion_shape(served):
    c, _, _ = served
    r = c.post("/v1/chat/completions", json={
        "model": "fake.gguf", "max_tokens": 3,
        "messages": [{"role": "system", "content": "be brief"},
                     {"role": "user", "content": [{"type": "text", "text": "hi"}]}]})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "chat.completion"
    msg = body["choices"][0]["message"]
    assert msg["role"] == "assistant" and len(msg["content"]) == 3
    assert body["usage"]["completion_tokens"] == 3


def _events(text: str) -> list:
    out = []
    for block in text.strip().split("\n\n"):
        assert block.startswith("data: "), block
        data = block[len("data: "):]
        out.append(data if data == "[DONE]" else json.loads(data))
    return out


def test_streaming_completion_events(served):
    c, be, _ = served
    with c.stream("POST", "/v1/completions", json={
            "prompt": "abc", "max_tokens": 4, "stream": True,
            "stream_options": {"include_usage": True}}) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        ev = _events(r.read().decode())
    assert ev[-1] == "[DONE]"
    usage = ev[-2]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 4
    last = ev[-3]
    assert last["choices"][0]["finish_reason"] == "length" and "timings" in last
    text = "".join(e["choices"][0]["text"] for e in ev[:-2])
    assert text == be.detokenize(_expected(be, "abc", 4))
    assert all(e["object"] == "text_completion" for e in ev[:-1])


def test_streaming_chat_events(served):
    c, _, _ = served
    with c.stream("POST", "/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "x"}], "max_tokens": 3,
            "stream": True}) as r:
        ev = _events(r.read().decode())
    assert ev[0]["choices"][0]["delta"] == {"role": "assistant", "content": None}
    assert ev[-1] == "[DONE]"
    assert ev[-2]["choices"][0]["finish_reason"] == "length"
    assert ev[-2]["choices"][0]["delta"] == {}
    assert sum(len(e["choices"][0]["delta"].get("content") or "") for e in ev[:-1]) == 3


def test_end_of_generation_token_stops_unless_ignore_eos(served):
    c, be, _ = served
    be.eog_at = 2
    r = c.post("/v1/completions", json={"prompt": "a", "max_tokens": 6,
                                        "return_tokens": True})
    body = r.json()
    assert body["choices"][0]["finish_reason"] == "stop" and len(body["tokens"]) == 2
    assert EOG not in body["tokens"]
    r = c.post("/v1/completions", json={"prompt": "a", "max_tokens": 6, "ignore_eos": True,
                                        "return_tokens": True})
    body = r.json()
    assert body["choices"][0]["finish_reason"] == "length" and body["tokens"][2] == EOG


BAD = [
    (b"{not json", 400, "not valid JSON"),
    (b"[1, 2]", 400, "JSON object"),
    (b'{"prompt": "x", "max_tokens": "5"}', 400, "max_tokens"),
    (b'{"prompt": "x", "max_tokens": -2}', 400, "max_tokens"),
    (b'{"prompt": "x", "max_tokens": true}', 400, "max_tokens"),
    (b'{"prompt": 5}', 400, "prompt"),
    (b'{"max_tokens": 3}', 400, "prompt"),
    (b'{"prompt": "x", "temperature": -1}', 400, "temperature"),
    (b'{"prompt": "x", "temperature": NaN}', 400, "temperature"),
    (b'{"prompt": "x", "top_p": 0}', 400, "top_p"),
    (b'{"prompt": "x", "seed": -3}', 400, "seed"),
    (b'{"prompt": "x", "n": 3}', 400, "at most 2 per request"),  # --queue 2
    (b'{"prompt": "x", "n": 0}', 400, "n"),
    (b'{"prompt": "x", "stop": ["a", "b", "c", "d", "e"]}', 400, "stop takes up to 4"),
    (b'{"prompt": "x", "stop": [""]}', 400, "non-empty"),
    (b'{"prompt": "x", "stop": 3}', 400, "stop"),
    (b'{"prompt": "x", "logprobs": 21}', 400, "logprobs"),
    (b'{"prompt": "x", "top_k": 40, "grammar": "root ::= x"}', 400, "grammar"),
    (b'{"prompt": "x", "frobnicate": 1}', 400, "unknown field 'frobnicate'"),
    (b'{"prompt": "x", "echo": true}', 400, "echo"),
    (b'{"prompt": ["a", []]}', 400, "prompt[1] is empty"),
    (b'{"prompt": ["a", "b", "c"]}', 400, "at most 2 per request"),
    (b'{"prompt": []}', 400, "empty"),
    (b'{"prompt": [1, 99]}', 400, "out of range"),
    (b'{"prompt": "' + b"x" * 128 + b'", "max_tokens": 8}', 400, "leaves no room"),
    (b"[" * 2000 + b"]" * 2000, 400, "not valid JSON"),  # nested past json's recursion limit
    (b"[" * 3000 + b"]" * 3000, 413, "limit"),
    (b'{"prompt": "' + b"x" * 5000 + b'"}', 413, "limit"),
]


@pytest.mark.parametrize("body,status,words", BAD, ids=[f"bad{i}" for i in range(len(BAD))])
def test_bad_requests_get_a_4xx_json_error_and_the_service_keeps_serving(served, body,
                                                                         status, words):
    c, _, _ = served
    r = c.post("/v1/completions", content=body, headers={"content-type": "application/json"})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert words in err["message"] and err["code"] in (status, "model_not_found")
    assert c.post("/v1/completions", json={"prompt": "ok", "max_tokens": 1}).status_code == 200


def test_bad_chat_requests(served):
    c, _, _ = served
    for body, words in (({"messages": []}, "messages"),
                        ({"messages": [{"role": "robot", "content": "x"}]}, "role"),
                        ({"messages": [{"role": "user", "content": 3}]}, "content"),
                        ({"messages": "hi"}, "messages")):
        r = c.post("/v1/chat/completions", json=body)
        assert r.status_code == 400 and words in r.json()["error"]["message"], r.text


#: (endpoint, raw body, param): text with an unpaired surrogate on every endpoint that takes
#: text (issue 39 item 3), escaped or as raw bytes, in a value or a key
SURROGATES = [
    ("/apply-template", b'{"messages": [{"role": "user", "content": "\\ud800"}]}',
     "messages.0.content"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": [{"type": "text", '
     b'"text": "a\\udc00"}]}], "max_tokens": 1}', "messages.0.content.0.text"),
    ("/tokenize", b'{"content": "\\ud800"}', "content"),
    ("/tokenize", b'{"content": "\xed\xa0\x80"}', "content"),  # its raw bytes
    ("/detokenize", b'{"tokens": [1], "\\ud800": 1}', "\\ud800"),  # a key, escaped
    ("/completion", b'{"prompt": "x\\udfff", "n_predict": 1}', "prompt"),
    ("/completions", b'{"prompt": [5, "\\udbff"], "n_predict": 1}', "prompt.1"),
    ("/v1/completions", b'{"prompt": "\\ud800", "max_tokens": 1}', "prompt"),
    ("/v1/completions", b'{"prompt": "x", "stop": ["\\ud800"], "max_tokens": 1}', "stop.0"),
]


@pytest.mark.parametrize("path,body,param", SURROGATES,
                         ids=[f"{p}-{i}" for i, (p, _, _) in enumerate(SURROGATES)])
def test_a_lone_surrogate_is_a_400_on_every_endpoint_without_a_traceback(
        served, capsys, caplog, path, body, param):
    c, _, _ = served
    r = c.post(path, content=body, headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error", err
    assert err["code"] == 400 and "surrogate" in err["message"]
    logged = capsys.readouterr().err + caplog.text
    assert "Traceback" not in logged and "internal error" not in logged, logged
    # a paired surrogate is one character (U+1F600), and the service keeps serving
    r = c.post("/tokenize", content=b'{"content": "\\ud83d\\ude00"}',
               headers={"content-type": "application/json"})
    assert r.status_code == 200 and r.json()["tokens"], r.text


def test_unknown_route_and_method_are_json(served):
    c, _, _ = served
    r = c.get("/v1/nothing")
    assert r.status_code == 404 and "error" in r.json()
    r = c.get("/v1/completions")
    assert r.status_code == 405 and "error" in r.json()


def test_models_and_health(served):
    c, _, _ = served
    m = c.get("/v1/models").json()
    assert [d["id"] for d in m["data"]] == ["fake.gguf"]
    assert m["data"][0]["meta"]["n_ctx"] == 128
    assert c.get("/health").json()["status"] == "ok"


def test_a_backend_refusal_is_400_and_a_fault_500(served):
    c, be, _ = served
    be.fail = InputError("the prompt is wrong somehow")
    r = c.post("/v1/completions", json={"prompt": "x"})
    assert r.status_code == 400 and "wrong somehow" in r.json()["error"]["message"]
    be.fail = RuntimeError("boom")
    r = c.post("/v1/completions", json={"prompt": "x"})
    assert r.status_code == 500 and "RuntimeError" in r.json()["error"]["message"]
    be.fail = None
    assert c.post("/v1/completions", json={"prompt": "x"}).status_code == 200


def test_concurrent_requests_run_one_at_a_time_and_each_gets_its_own_tokens(served):
    c, be, _ = served
    be.step_s = 0.002
    prompts = [f"p{i}" for i in range(6)]
    got: dict[str, list] = {}
    errors: list = []

    def ask(p: str) -> None:
        for _ in range(40):  # the queue holds 2: retry a 503 as a client would
            r = c.post("/v1/completions", json={"prompt": p, "max_tokens": 6,
                                                "return_tokens": True})
            if r.status_code != 503:
                break
            time.sleep(0.02)
        if r.status_code != 200:
            errors.append(r.text)
            return
        got[p] = r.json()["tokens"]

    threads = [threading.Thread(target=ask, args=(p,)) for p in prompts]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors
    assert got == {p: _expected(be, p, 6) for p in prompts}
    assert be.max_active == 1


def test_a_full_queue_answers_503():
    be = FakeBackend()
    be.gate.clear()  # the running generation blocks
    worker = GenerationWorker(be, _cfg(queue_max=1))
    import asyncio

    from mtplib.runtime.sampling import Sampler

    loop = asyncio.new_event_loop()
    try:
        def job() -> Job:
            return Job(prompt="x", n_new=1, sampler=Sampler(), ignore_eos=False, loop=loop)

        worker.submit(job())
        deadline = time.monotonic() + 5
        while not worker.busy.is_set() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert worker.busy.is_set()
        worker.submit(job())  # waits
        with pytest.raises(ApiError) as e:
            worker.submit(job())
        assert e.value.status == 503
    finally:
        be.gate.set()
        assert worker.stop(5)
        loop.close()


def test_api_key_is_required_except_for_health():
    be = FakeBackend()
    worker = GenerationWorker(be, _cfg(api_key="s3cret"))
    with TestClient(create_app(worker, on_shutdown=lambda: worker.stop(5))) as c:
        assert c.get("/health").status_code == 200
        r = c.get("/v1/models")
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        assert c.get("/v1/models", headers={"Authorization": "Bearer nope"}).status_code == 401
        ok = {"Authorization": "Bearer s3cret"}
        assert c.get("/v1/models", headers=ok).status_code == 200
        r = c.post("/v1/completions", json={"prompt": "x", "max_tokens": 1}, headers=ok)
        assert r.status_code == 200


def test_shutdown_refuses_new_work_and_aborts_the_running_generation():
    be = FakeBackend()
    be.gate.clear()
    worker = GenerationWorker(be, _cfg())
    import asyncio

    from mtplib.runtime.sampling import Sampler

    loop = asyncio.new_event_loop()
    try:
        worker.submit(Job(prompt="x", n_new=5, sampler=Sampler(), ignore_eos=False, loop=loop))
        threading.Timer(0.2, be.gate.set).start()
        assert worker.stop(5)
        with pytest.raises(ApiError) as e:
            worker.submit(Job(prompt="x", n_new=1, sampler=None, ignore_eos=False, loop=loop))
        assert e.value.status == 503
    finally:
        loop.close()


def test_stop_text_holds_back_what_may_become_a_stop_sequence():
    t = StopText(["END", "\n\n"])
    assert t.feed("abc E") == ("abc ", False)  # "E" may start "END"
    assert t.feed("x") == ("Ex", False)
    assert t.feed("yE") == ("y", False)
    assert t.feed("N") == ("", False)
    assert t.feed("Dzz") == ("", True)  # "END" straddled three pieces: cut before it
    assert t.flush() == ""
    t = StopText(["END"])
    assert t.feed("tail EN") == ("tail ", False)
    assert t.flush() == "EN"  # the generation ended: what was held is shown
    assert StopText([]).feed("anything") == ("anything", False)


@pytest.mark.parametrize("stream", [False, True])
def test_stop_sequences_end_the_text_before_them(served, stream):
    c, be, _ = served
    full = be.detokenize(_expected(be, "hello", 8))
    stop = full[3:5]
    body = {"prompt": "hello", "max_tokens": 8, "stop": [stop, "never-there"]}
    if not stream:
        r = c.post("/v1/completions", json=body).json()
        text, finish = r["choices"][0]["text"], r["choices"][0]["finish_reason"]
    else:
        with c.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
            ev = _events(r.read().decode())[:-1]
        text = "".join(e["choices"][0]["text"] for e in ev)
        finish = ev[-1]["choices"][0]["finish_reason"]
    assert full.find(stop) == 3 and text == full[:3] and finish == "stop"
