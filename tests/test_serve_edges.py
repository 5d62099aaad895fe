"""`mtplib serve`'s edges (issue 30 item 4) over a fake backend and a real uvicorn on
loopback: header and body deadlines close idle and slow connections, a client that leaves
mid-body is one log line, SIGTERM answers the waiting and the cut requests 503 in OpenAI's
shape, an empty $MTPLIB_API_KEY is refused. The process-level SIGTERM test with a model is
tests/test_serve.py's."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
import threading
import time

import pytest

pytest.importorskip("fastapi")
uvicorn = pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

from test_serve_http import FakeBackend, _cfg  # noqa: E402

from mtplib.cli import main  # noqa: E402
from mtplib.serve import app as serve_app  # noqa: E402
from mtplib.serve.app import create_app  # noqa: E402
from mtplib.serve.deadlines import deadline_protocol  # noqa: E402
from mtplib.serve.edges import CutAtShutdown  # noqa: E402
from mtplib.serve.logs import LimitedLog  # noqa: E402
from mtplib.serve.worker import GenerationWorker  # noqa: E402

HEADER_S, BODY_S = 1.0, 1.5


class Live:
    """A uvicorn server in a thread on 127.0.0.1 (a free port) over a fake backend."""

    def __init__(self, **cfg) -> None:
        self.be = FakeBackend()
        self.worker = GenerationWorker(self.be, _cfg(**cfg))
        app = create_app(self.worker, on_shutdown=lambda: self.worker.stop(5))
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(
            app, log_level="warning", lifespan="on", timeout_graceful_shutdown=2,
            http=deadline_protocol(HEADER_S, BODY_S)))
        self.thread = threading.Thread(target=self.server.run,
                                       kwargs={"sockets": [self.sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "did not start"
            time.sleep(0.01)

    def connect(self) -> socket.socket:
        s = socket.create_connection(("127.0.0.1", self.port), timeout=10)
        return s

    def close(self) -> None:
        self.be.gate.set()
        self.server.should_exit = True
        self.thread.join(15)
        self.sock.close()
        assert not self.thread.is_alive()


@pytest.fixture
def live():
    srv = Live()
    yield srv
    srv.close()


def _read_until_closed(s: socket.socket, limit_s: float) -> tuple[bytes, float]:
    """Everything the server sends until it closes (bounded), and when it closed."""
    t0, out = time.monotonic(), b""
    s.settimeout(0.1)
    while time.monotonic() - t0 < limit_s:
        try:
            data = s.recv(65536)
        except TimeoutError:
            continue
        except ConnectionResetError:
            break
        if not data:
            break
        out += data
    else:
        pytest.fail(f"still open after {limit_s} s")
    return out, time.monotonic() - t0


def test_an_idle_connection_is_closed_at_the_header_deadline(live):
    with live.connect() as s:
        out, t = _read_until_closed(s, 10)
    assert out == b"" and HEADER_S - 0.2 < t < HEADER_S + 1.5


def _trickle(s: socket.socket, data: bytes, every_s: float, stop: threading.Event) -> None:
    for b in data:
        if stop.wait(every_s):
            return
        try:
            s.sendall(bytes([b]))
        except OSError:
            return


def test_slow_headers_get_408_and_are_closed(live):
    req = b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-length: 2\r\n\r\n{}"
    stop = threading.Event()
    with live.connect() as s:
        t = threading.Thread(target=_trickle, args=(s, req, 0.1, stop), daemon=True)
        t.start()
        out, dt = _read_until_closed(s, 10)
        stop.set()
    assert out.startswith(b"HTTP/1.1 408 "), out
    body = json.loads(out.split(b"\r\n\r\n", 1)[1])
    assert "no complete request headers within 1 s" in body["error"]["message"]
    assert dt < HEADER_S + 1.5


def test_a_slow_body_gets_408_and_one_log_line(live, monkeypatch, caplog):
    lines: list[str] = []
    monkeypatch.setattr(serve_app, "limited_log", lines.append)
    stop = threading.Event()
    with live.connect() as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: "
                  b"application/json\r\ncontent-length: 200\r\n\r\n")
        t = threading.Thread(target=_trickle, args=(s, b'{"prompt": "' + b"x" * 190, 0.2,
                                                    stop), daemon=True)
        t.start()
        out, dt = _read_until_closed(s, 10)
        stop.set()
    assert out.startswith(b"HTTP/1.1 408 ") and b"the body did not arrive within 1.5 s" in out
    assert dt < BODY_S + 1.5
    deadline = time.monotonic() + 5
    while not lines and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(lines) == 1 and "the body did not arrive within 1.5 s" in lines[0], lines
    assert "Traceback" not in caplog.text and "Exception in ASGI" not in caplog.text


def test_a_client_that_leaves_mid_body_is_one_log_line(live, monkeypatch, caplog):
    lines: list[str] = []
    monkeypatch.setattr(serve_app, "limited_log", lines.append)
    with caplog.at_level(logging.INFO):
        for _ in range(3):
            with live.connect() as s:
                s.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-length: "
                          b"1000\r\n\r\n" + b"x" * 10)
                time.sleep(0.2)
        deadline = time.monotonic() + 5
        while len(lines) < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
    assert len(lines) == 3, lines
    assert all("POST /v1/completions: closed after 10 bytes of the body" in x for x in lines)
    assert "Traceback" not in caplog.text and "Exception in ASGI" not in caplog.text
    r = httpx.post(live.url + "/v1/completions", json={"prompt": "ok", "max_tokens": 2},
                   timeout=10)
    assert r.status_code == 200  # still serving


def test_a_client_that_leaves_while_waiting_is_one_log_line(live, monkeypatch, caplog):
    lines: list[str] = []
    monkeypatch.setattr(serve_app, "limited_log", lines.append)
    live.be.gate.clear()  # the generation does not move
    body = b'{"prompt": "x", "max_tokens": 3}'
    with live.connect() as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: "
                  b"application/json\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body))
        deadline = time.monotonic() + 5
        while not live.worker.busy.is_set():
            assert time.monotonic() < deadline
            time.sleep(0.01)
    deadline = time.monotonic() + 5  # the handler looks at the connection every second
    while not lines and time.monotonic() < deadline:
        time.sleep(0.05)
    live.be.gate.set()
    assert len(lines) == 1 and "left while its request waited or ran" in lines[0], lines
    assert "Traceback" not in caplog.text and "Exception in ASGI" not in caplog.text


def test_keep_alive_requests_are_served_and_the_next_headers_have_their_deadline(live):
    with httpx.Client(base_url=live.url, timeout=10) as c:
        for _ in range(3):  # one connection, several requests
            assert c.post("/v1/completions", json={"prompt": "a", "max_tokens": 2}
                          ).status_code == 200
    with live.connect() as s:
        s.sendall(b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n")
        time.sleep(0.3)
        s.sendall(b"GET /hea")  # the next request's headers stall
        out, t = _read_until_closed(s, 10)
    assert out.startswith(b"HTTP/1.1 200 ") and b"HTTP/1.1 408 " in out
    assert t < HEADER_S + 1.5


def test_shutdown_answers_waiting_and_cut_requests_503(live):
    live.be.gate.clear()  # the running generation blocks at its first step
    results: dict[str, httpx.Response] = {}

    def ask(name: str, **body) -> None:
        results[name] = httpx.post(live.url + "/v1/completions", timeout=20,
                                   json={"prompt": name, "max_tokens": 3, **body})

    running = threading.Thread(target=ask, args=("run",))
    running.start()
    deadline = time.monotonic() + 5
    while not live.worker.busy.is_set():
        assert time.monotonic() < deadline
        time.sleep(0.01)
    waiting = threading.Thread(target=ask, args=("wait",))
    waiting.start()
    while live.worker.jobs.qsize() < 1:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert live.worker.begin_shutdown() == 1
    waiting.join(10)
    r = results["wait"]
    assert r.status_code == 503 and r.headers["content-type"] == "application/json"
    err = r.json()["error"]
    assert err["type"] == "unavailable_error" and "was waiting" in err["message"]
    live.worker.cut()
    live.be.gate.set()
    running.join(10)
    r = results["run"]
    assert r.status_code == 503 and "cut after --shutdown-timeout" in r.json()["error"][
        "message"]
    r = httpx.post(live.url + "/v1/completions", json={"prompt": "x"}, timeout=10)
    assert r.status_code == 503 and r.json()["error"]["message"] == (
        "the server is shutting down")


def test_a_cut_stream_ends_with_an_error_event(live):
    live.be.step_s = 0.05
    with httpx.stream("POST", live.url + "/v1/completions", timeout=20, json={
            "prompt": "s", "max_tokens": 100, "stream": True}) as r:
        it = r.iter_lines()
        first = next(line for line in it if line)
        assert first.startswith("data: ")
        live.worker.cut()
        rest = [line for line in it if line]
    last = json.loads(rest[-1][len("data: "):])
    assert last["error"]["code"] == 503 and "cut" in last["error"]["message"]


def _asgi_run(app, stopping: threading.Event, cancel_after: float = 0.1) -> list[dict]:
    """Run ``CutAtShutdown(app)`` on one request, cancel it as uvicorn does at its
    deadline, and return what it sent."""
    sent: list[dict] = []

    async def receive():
        await asyncio.sleep(3600)

    async def send(msg):
        sent.append(msg)

    async def go():
        task = asyncio.ensure_future(CutAtShutdown(app, stopping)(
            {"type": "http", "path": "/v1/completions", "headers": []}, receive, send))
        await asyncio.sleep(cancel_after)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        return task

    task = asyncio.run(go())
    return sent if not task.cancelled() else [{"cancelled": True}, *sent]


def test_uvicorns_cancel_at_shutdown_becomes_a_json_503():
    async def hangs(scope, receive, send):
        await asyncio.sleep(3600)

    stopping = threading.Event()
    assert _asgi_run(hangs, stopping)[0] == {"cancelled": True}  # not shutting down: passes
    stopping.set()
    sent = _asgi_run(hangs, stopping)
    assert sent[0]["status"] == 503
    assert json.loads(sent[1]["body"])["error"]["type"] == "unavailable_error"

    async def streams(scope, receive, send):
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream")]})
        await send({"type": "http.response.body", "body": b"data: {}\n\n", "more_body": True})
        await asyncio.sleep(3600)

    sent = _asgi_run(streams, stopping)
    assert sent[-1]["more_body"] is False and b'"code": 503' in sent[-1]["body"]


def test_the_log_limit_says_how_many_lines_it_dropped():
    out: list[str] = []
    log = LimitedLog(out.append, lines=3, window_s=0.2)
    for i in range(10):
        log(f"line {i}")
    time.sleep(0.25)
    log("after")
    assert out == ["line 0", "line 1", "line 2", "(7 similar lines dropped in 0.2 s)",
                   "after"]


@pytest.mark.parametrize("env,flag,says", [
    ({"MTPLIB_API_KEY": ""}, [], "$MTPLIB_API_KEY is empty"),
    ({"MTPLIB_API_KEY": "  "}, [], "$MTPLIB_API_KEY is empty"),
    ({}, ["--api-key", ""], "--api-key is empty"),
])
def test_an_empty_api_key_is_refused_from_the_flag_and_the_environment(
        monkeypatch, capsys, env, flag, says):
    monkeypatch.delenv("MTPLIB_API_KEY", raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert main(["serve", "-m", "no-such.gguf", *flag]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and says in lines[0], lines


@pytest.mark.parametrize("opt", ["--header-timeout", "--body-timeout"])
@pytest.mark.parametrize("value", ["0", "-1", "nan"])
def test_deadlines_must_be_positive(capsys, opt, value):
    assert main(["serve", "-m", "no-such.gguf", opt, value]) == 2
    assert f"{opt} must be a finite number of seconds > 0" in capsys.readouterr().err
