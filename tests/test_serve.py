"""`mtplib serve` as a user runs it: a subprocess on a free loopback port, called with the
`openai` Python client. Tokens equal `mtplib generate`'s (greedy), MTP drafts show in the
timings, bad requests get a 4xx and the service keeps serving, concurrent requests from
threads all come back right, SIGTERM ends it with exit 0 (during a request too). The
HTTP layer's details are tests/test_serve_http.py's (a fake backend)."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from mtplib.model.trained import trained_paths  # noqa: E402

START_S = 180  # a cold load on a busy 2-core machine
REQ_S = 120
TRAINED = trained_paths()
PROMPTS = ["def main(", "import os\n", "class Config:\n    def __init__(self",
           "for i in range(", "return self."]


@dataclass
class Served:
    proc: subprocess.Popen
    url: str
    ready: dict
    stderr: list[str] = field(default_factory=list)

    def client(self, **kw) -> openai.OpenAI:
        kw.setdefault("api_key", "unused")
        return openai.OpenAI(base_url=self.url + "/v1", timeout=REQ_S, max_retries=0, **kw)

    def log(self) -> str:
        return "".join(self.stderr[-40:])


def start(*args: str, env: dict | None = None) -> Served:
    """`mtplib serve ARGS --port 0 --json`, waiting (bounded) for its listening line."""
    cmd = [sys.executable, "-m", "mtplib.cli", "serve", *args, "--port", "0", "--json"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, **(env or {})})
    lines: queue.Queue = queue.Queue()
    err: list[str] = []
    threading.Thread(target=lambda: [lines.put(x) for x in proc.stdout], daemon=True).start()
    threading.Thread(target=lambda: [err.append(x) for x in proc.stderr], daemon=True).start()
    try:
        line = lines.get(timeout=START_S)
    except queue.Empty:
        stop(proc)
        pytest.fail(f"mtplib serve did not start within {START_S} s: {''.join(err[-20:])}")
    ready = json.loads(line)
    if "listening" not in ready:
        stop(proc)
        pytest.fail(f"mtplib serve failed: {ready}")
    return Served(proc, ready["listening"], ready, err)


def stop(proc: subprocess.Popen, sig: int = signal.SIGTERM, timeout: float = 60) -> int:
    """Signal, wait (bounded), kill if needed; the exit status."""
    if proc.poll() is None:
        proc.send_signal(sig)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
    return proc.returncode


@pytest.fixture
def server_factory():
    started: list[Served] = []

    def make(*args: str, **kw) -> Served:
        s = start(*args, **kw)
        started.append(s)
        return s

    yield make
    for s in started:  # always: even when the test failed
        stop(s.proc)


def _generate(*args: str) -> dict:
    r = subprocess.run([sys.executable, "-m", "mtplib.cli", "generate", *args, "--json"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    return json.loads(r.stdout)


needs_trained = pytest.mark.skipif(not TRAINED.exists(), reason="evidence/trained-v4 missing")


@pytest.fixture(scope="module")
def trained_server():
    s = start("-m", str(TRAINED.trunk), "-md", str(TRAINED.sidecar), "--draft", "2",
              "-c", "512", "-t", "1")
    yield s
    assert stop(s.proc) == 0, s.log()


@needs_trained
def test_completion_equals_generate_and_mtp_drafts(trained_server):
    s = trained_server
    c = s.client()
    model = c.models.list().data[0].id
    assert model == TRAINED.trunk.name
    assert s.ready["upstream"]["build"] in ("stock", "patched")  # the build is named
    for prompt in PROMPTS[:2]:
        r = c.completions.create(model=model, prompt=prompt, max_tokens=16, temperature=0,
                                 extra_body={"return_tokens": True, "ignore_eos": True})
        want = _generate("-m", str(TRAINED.trunk), "-md", str(TRAINED.sidecar),
                         "--draft", "2", "-c", "512", "-t", "1", "-p", prompt, "-n", "16")
        assert r.model_extra["tokens"] == want["tokens"]
        assert r.choices[0].text == want["text"]
        assert r.usage.completion_tokens == 16
        t = r.model_extra["timings"]
        assert t["predicted_n"] == 16 and t["prompt_n"] == want["metrics"]["n_prompt"]
        assert t["draft_n"] > 0 and 0 < t["draft_n_accepted"] <= t["draft_n"]
        assert t["draft_n"] == want["metrics"]["drafted"]
        assert t["predicted_per_second"] > 0 and t["prompt_ms"] > 0


@needs_trained
def test_streaming_gives_the_same_text_and_ends_with_timings(trained_server):
    c = trained_server.client()
    model = c.models.list().data[0].id
    whole = c.completions.create(model=model, prompt=PROMPTS[2], max_tokens=12,
                                 extra_body={"ignore_eos": True})
    chunks = list(c.completions.create(model=model, prompt=PROMPTS[2], max_tokens=12,
                                       stream=True, extra_body={"ignore_eos": True}))
    assert len(chunks) > 2
    assert "".join(ch.choices[0].text for ch in chunks) == whole.choices[0].text
    assert chunks[-1].choices[0].finish_reason == "length"
    assert chunks[-1].model_extra["timings"]["predicted_n"] == 12


@needs_trained
def test_stop_sequences(trained_server):
    c = trained_server.client()
    model = c.models.list().data[0].id
    full = c.completions.create(model=model, prompt=PROMPTS[3], max_tokens=16,
                                extra_body={"ignore_eos": True}).choices[0].text
    stop = full[len(full) // 2:len(full) // 2 + 2]
    want = full[:full.find(stop)]
    r = c.completions.create(model=model, prompt=PROMPTS[3], max_tokens=16, stop=stop,
                             extra_body={"ignore_eos": True})
    assert r.choices[0].text == want and r.choices[0].finish_reason == "stop"
    parts = list(c.completions.create(model=model, prompt=PROMPTS[3], max_tokens=16,
                                      stop=[stop], stream=True,
                                      extra_body={"ignore_eos": True}))
    assert "".join(p.choices[0].text for p in parts) == want
    assert parts[-1].choices[0].finish_reason == "stop"


@needs_trained
def test_chat_completion_plain_and_streaming(trained_server):
    c = trained_server.client()
    model = c.models.list().data[0].id
    msgs = [{"role": "user", "content": "write a loop"}]
    r = c.chat.completions.create(model=model, messages=msgs, max_tokens=8, temperature=0)
    assert r.choices[0].message.role == "assistant"
    assert isinstance(r.choices[0].message.content, str)
    assert r.choices[0].finish_reason in ("length", "stop")
    parts = list(c.chat.completions.create(model=model, messages=msgs, max_tokens=8,
                                           temperature=0, stream=True))
    text = "".join(p.choices[0].delta.content or "" for p in parts if p.choices)
    assert text == r.choices[0].message.content


@needs_trained
def test_bad_requests_get_4xx_and_the_service_keeps_serving(trained_server):
    s = trained_server
    c = s.client()
    model = c.models.list().data[0].id
    # any model name, as llama-server with one model: the response names the served one
    assert c.completions.create(model="no-such-model", prompt="x", max_tokens=2).model == model
    # more than the context holds: it stops at the context's end, truncated (llama-server)
    r = c.completions.create(model=model, prompt="x", max_tokens=10_000)
    assert r.choices[0].finish_reason == "length" and r.model_extra["truncated"] is True
    assert r.usage.prompt_tokens + r.usage.completion_tokens == s.ready["n_ctx"]
    with pytest.raises(openai.BadRequestError, match="grammar"):  # structured output: a
        c.completions.create(model=model, prompt="x", max_tokens=2,  # bad grammar is a 400
                             extra_body={"grammar": 'root ::= "a'})
    with pytest.raises(openai.BadRequestError, match="response_format"):
        c.chat.completions.create(model=model, messages=[{"role": "user", "content": "x"}],
                                  response_format={"type": "xml"})
    with pytest.raises(openai.BadRequestError, match="context"):
        c.completions.create(model=model, prompt="x " * 600, max_tokens=4)
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        c.completions.create(model=model, prompt="x", max_tokens=-2)
    with pytest.raises(openai.BadRequestError, match="temperature"):
        c.completions.create(model=model, prompt="x", max_tokens=2, temperature=-1)
    raw = httpx.post(s.url + "/v1/completions", content=b"{oops", timeout=30,
                     headers={"content-type": "application/json"})
    assert raw.status_code == 400 and "not valid JSON" in raw.json()["error"]["message"]
    raw = httpx.post(s.url + "/v1/completions", json={"prompt": "x", "max_tokens": "9"},
                     timeout=30)
    assert raw.status_code == 400 and raw.json()["error"]["param"] == "max_tokens"
    r = c.completions.create(model=model, prompt="ok", max_tokens=3)
    assert r.usage.completion_tokens == 3
    assert httpx.get(s.url + "/health", timeout=30).json()["status"] == "ok"


@needs_trained
def test_top_k_1_at_temperature_1_is_greedy_and_llama_server_endpoints(trained_server):
    """The issue's example (top_k=1 at temperature 1 returned sampled text), and the
    native /completion and /tokenize on the real model."""
    s = trained_server
    c = s.client()
    greedy = c.completions.create(model="m", prompt="def main(", max_tokens=24,
                                  temperature=0).choices[0].text
    topk = c.completions.create(model="m", prompt="def main(", max_tokens=24, temperature=1,
                                seed=7, extra_body={"top_k": 1}).choices[0].text
    sampled = c.completions.create(model="m", prompt="def main(", max_tokens=24,
                                   temperature=1, seed=7).choices[0].text
    assert topk == greedy and sampled != greedy
    b = httpx.post(s.url + "/completion", json={"prompt": "def main(", "n_predict": 24,
                                                "temperature": 0}, timeout=REQ_S).json()
    assert b["content"] == greedy and b["tokens_predicted"] == 24
    assert b["timings"]["draft_n"] > 0
    toks = httpx.post(s.url + "/tokenize", json={"content": "def main("}, timeout=30).json()
    text = httpx.post(s.url + "/detokenize", json=toks, timeout=30).json()["content"]
    assert text.endswith("def main(")


@needs_trained
def test_concurrent_requests_from_threads_are_all_right(trained_server):
    c = trained_server.client()
    model = c.models.list().data[0].id

    def ask(p: str) -> list[int]:
        r = c.completions.create(model=model, prompt=p, max_tokens=10,
                                 extra_body={"return_tokens": True, "ignore_eos": True})
        return r.model_extra["tokens"]

    want = {p: ask(p) for p in PROMPTS}
    got: dict[str, list[int]] = {}
    errors: list[BaseException] = []

    def worker(p: str) -> None:
        try:
            got[p] = ask(p)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(p,)) for p in PROMPTS]
    for t in threads:
        t.start()
    for t in threads:
        t.join(REQ_S)
    assert not errors and got == want


@pytest.mark.slow
def test_sigterm_during_a_stream_exits_0(pair, server_factory):
    s = server_factory("-m", str(pair.trunk), "-md", str(pair.sidecar), "--draft", "2",
                       "-c", "256", "-t", "1", "--shutdown-timeout", "2")
    c = s.client()
    model = c.models.list().data[0].id
    stream = c.completions.create(model=model, prompt=[1, 2, 3], max_tokens=200, stream=True,
                                  extra_body={"ignore_eos": True})
    first = next(iter(stream))
    assert first.choices[0].finish_reason is None
    t0 = time.monotonic()
    s.proc.send_signal(signal.SIGTERM)
    try:  # finished within --shutdown-timeout, or cut when it ran out: both are clean
        for _ in stream:
            pass
    except (openai.APIError, httpx.HTTPError):
        pass
    assert s.proc.wait(60) == 0, s.log()
    assert time.monotonic() - t0 < 60
    assert "stopped" in s.log()
    with pytest.raises(httpx.ConnectError):
        httpx.get(s.url + "/health", timeout=5)


def test_non_loopback_host_needs_allow_remote(pair):
    r = subprocess.run([sys.executable, "-m", "mtplib.cli", "serve", "-m", str(pair.trunk),
                        "--host", "0.0.0.0", "--json"], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 2
    err = json.loads(r.stdout)
    assert "--allow-remote" in err["error"] and err["command"] == "serve"


def _cache_args() -> list[str]:
    """The stock build refuses ranged MTP by default (it would move cache state across
    the seam); the patched one, the default wherever ./dev.sh built it, needs no flag."""
    from mtplib.runtime import build_info

    return [] if build_info()["build"] == "patched" else ["--allow-cache-crossing"]


@pytest.mark.slow
def test_whole_and_ranged_serve_the_same_tokens(pair, server_factory):
    """The ranged service (local shards, the same MTP options as generate) answers with the
    whole model's tokens, says which seam its session runs (the default, auto: the ring
    where this build speaks RPC 7.2), and SIGTERM closes the shards and exits 0."""
    common = ["-m", str(pair.trunk), "-md", str(pair.sidecar), "--draft", "2", "-c", "256",
              "-t", "1"]
    body = {"return_tokens": True, "ignore_eos": True}
    whole = server_factory(*common)
    w = whole.client().completions.create(model=pair.trunk.name, prompt=[5, 6, 7, 8],
                                          max_tokens=12, extra_body=body)
    assert stop(whole.proc) == 0
    ranged = server_factory(*common, "--plan", "0-1,2-3", *_cache_args())
    c = ranged.client()
    r = c.completions.create(model=pair.trunk.name, prompt=[5, 6, 7, 8], max_tokens=12,
                             extra_body=body)
    assert r.model_extra["tokens"] == w.model_extra["tokens"]
    assert r.model_extra["timings"]["draft_n"] > 0
    chunks = list(c.completions.create(model=pair.trunk.name, prompt=[5, 6, 7, 8],
                                       max_tokens=12, stream=True, extra_body=body))
    assert chunks[-1].model_extra["tokens"] == w.model_extra["tokens"]
    from mtplib.runtime.rpc import client_proto_minor

    want = "ring" if client_proto_minor() >= 2 else "star"
    seam = ranged.ready["seam"]  # the ready line, and /v1/models' meta, say it per pair
    assert seam["requested"] == "auto" and seam["seam"] == want
    assert [p["seam"] for p in seam["pairs"]] == [want]
    assert c.models.list().data[0].model_extra["meta"]["seam"] == seam
    assert "seam" not in whole.ready  # a whole model has none
    assert stop(ranged.proc) == 0, ranged.log()


def test_api_key(pair, server_factory):
    s = server_factory("-m", str(pair.trunk), "-c", "128", "-t", "1",
                       env={"MTPLIB_API_KEY": "k-123"})
    with pytest.raises(openai.AuthenticationError):
        s.client(api_key="wrong").models.list()
    assert s.client(api_key="k-123").models.list().data[0].id == Path(pair.trunk).name
    assert httpx.get(s.url + "/health", timeout=30).status_code == 200


@pytest.mark.slow
def test_sigterm_while_loading_exits_0_and_stops_the_shards(pair):
    psutil = pytest.importorskip("psutil")
    cmd = [sys.executable, "-m", "mtplib.cli", "serve", "-m", str(pair.trunk), "-md",
           str(pair.sidecar), "--draft", "2", "--plan", "0-1,2-3", *_cache_args(), "-c", "256",
           "-t", "1", "--port", "0"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        lines: queue.Queue = queue.Queue()
        threading.Thread(target=lambda: [lines.put(x) for x in proc.stderr],
                         daemon=True).start()
        seen = []
        while not any("loading" in x for x in seen):
            seen.append(lines.get(timeout=START_S))
        time.sleep(0.3)  # inside the load: local shards take seconds to start and warm
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
        time.sleep(0.2)
        while not lines.empty():
            seen.append(lines.get_nowait())
        assert any("SIGTERM before serving" in x for x in seen), seen
        assert not any("listening" in x for x in seen)
    finally:
        stop(proc)
    deadline = time.monotonic() + 30
    while True:  # the shards it started die with it
        left = [p for p in psutil.process_iter(["cmdline"])
                if str(proc.pid) in (p.info["cmdline"] or [])
                and "--parent-pid" in (p.info["cmdline"] or [])]
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert not left


@pytest.mark.slow
def test_sigterm_answers_waiting_and_cut_requests_503_without_a_traceback(pair,
                                                                         server_factory):
    """Issue 30 item 4: the waiting requests get a JSON 503 at once, the running stream is
    cut after --shutdown-timeout with a 503 error event, the log has no traceback, exit 0.
    Ranged with an emulated 50 ms WAN, so the running generation is still running."""
    s = server_factory("-m", str(pair.trunk), "-c", "512", "-t", "1", "--plan", "0-1,2-3",
                       "--wan", "50", *_cache_args(), "--shutdown-timeout", "0.5")
    got: dict[str, httpx.Response] = {}

    def ask(name: str) -> None:
        got[name] = httpx.post(s.url + "/v1/completions", timeout=REQ_S,
                               json={"prompt": [1, 2, 3], "max_tokens": 4})

    with httpx.stream("POST", s.url + "/v1/completions", timeout=REQ_S, json={
            "prompt": [1, 2, 3], "max_tokens": 400, "stream": True,
            "ignore_eos": True}) as r:
        lines = r.iter_lines()
        assert next(x for x in lines if x).startswith("data: ")
        waiting = [threading.Thread(target=ask, args=(f"w{i}",)) for i in range(2)]
        for t in waiting:
            t.start()
        deadline = time.monotonic() + 30
        while httpx.get(s.url + "/health", timeout=10).json()["pending"] < 3:
            assert time.monotonic() < deadline, "the requests did not queue"
            time.sleep(0.05)
        s.proc.send_signal(signal.SIGTERM)
        rest = [x for x in lines if x]
        for t in waiting:
            t.join(30)
    for name in ("w0", "w1"):
        assert got[name].status_code == 503, got[name].text
        err = got[name].json()["error"]
        assert err["type"] == "unavailable_error" and "was waiting" in err["message"]
    last = json.loads(rest[-1][len("data: "):])
    assert last["error"]["code"] == 503 and "cut after --shutdown-timeout" in \
        last["error"]["message"]
    assert s.proc.wait(60) == 0, s.log()
    log = "".join(s.stderr)
    assert "SIGTERM: stopping; 2 waiting request(s) answered 503" in log, log
    assert "Traceback" not in log and "Exception in ASGI" not in log, log
