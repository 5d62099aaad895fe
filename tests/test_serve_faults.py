"""Issue 30 item 2: `mtplib serve` survives its shards. A shard killed (or stopped)
mid-request fails that request within the deadline with an OpenAI-shaped JSON 503 naming
the shard; /health is 503 naming it until the shards are whole again; the service restarts
its local shards itself and waits (re-probing with backoff) for external ones, plaintext
or TLS, to come back on their port; the first request after that is answered with the
tokens it gave before the fault (greedy), within 30 s of the shard's return.

The serving layer's part (503s, refusals while degraded, /health, the recovery loop) runs
first over a fake backend in milliseconds; the rest runs the real service."""

from __future__ import annotations

import json
import os
import signal
import socket
import threading
import time

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
from fastapi.testclient import TestClient  # noqa: E402
from test_serve import _cache_args, start, stop  # noqa: E402
from test_serve_http import FakeBackend, _cfg  # noqa: E402

import mtplib.serve.faults as serve_faults  # noqa: E402
from mtplib.distributed.client import ShardLostError  # noqa: E402
from mtplib.distributed.processes import LocalShards  # noqa: E402
from mtplib.distributed.tls import TlsConfig, init_pki  # noqa: E402
from mtplib.runtime.rpc import ShardError  # noqa: E402
from mtplib.serve.app import create_app  # noqa: E402
from mtplib.serve.worker import GenerationWorker  # noqa: E402

EP = "127.0.0.1:50999"
SHARD = {"shard": 1, "endpoint": EP, "layers": "2-3", "cause": "gone"}
#: the running request's deadline: the shard silence limit the services below run with
SILENCE_S = 3
RECOVER_S = 30  # the target: the first request after the shard's return, within 30 s


# -- the serving layer over a fake ranged backend ------------------------------------------
class FaultyBackend(FakeBackend):
    """FakeBackend with RangedMTP's fault interface: ``seen`` is what `faults()` reports,
    ``down`` makes `reconnect()` fail as an unreachable shard does."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[dict] = []
        self.down = False
        self.reconnects = 0

    def faults(self) -> list[dict]:
        return list(self.seen)

    def describe(self, i: int | None, cause: str = "") -> dict:
        return {**SHARD, "shard": i, "cause": cause}

    def reconnect(self) -> None:
        self.reconnects += 1
        if self.down:
            raise ShardError(f"shard {EP} unreachable: Connection refused")
        self.seen, self.fail, self.lose_after = [], None, None

    lose_after: int | None = None  # steps before the shard is lost mid-generation

    def stream(self, prompt, n, *, sampler=None):
        gen = super().stream(prompt, n, sampler=sampler)
        return gen if self.lose_after is None else _Lossy(self, gen)


class _Lossy:
    """A generation that loses shard 1 after ``be.lose_after`` steps."""

    def __init__(self, be: FaultyBackend, gen) -> None:
        self.be, self.gen, self.metrics = be, gen, None

    def __iter__(self):
        for i, chunk in enumerate(self.gen):
            if i == self.be.lose_after:
                self.be.seen = [SHARD]
                raise ShardLostError(f"shard 1 ({EP}) lost during call", (1,))
            yield chunk

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.gen.close()


@pytest.fixture
def faulty(monkeypatch):
    monkeypatch.setattr(serve_faults, "BACKOFF_S", 0.02)
    monkeypatch.setattr(serve_faults, "MAX_BACKOFF_S", 0.05)
    be = FaultyBackend()
    worker = GenerationWorker(be, _cfg())
    with TestClient(create_app(worker, on_shutdown=lambda: worker.stop(5))) as c:
        yield c, be, worker


def _until(cond, timeout: float, what: str) -> float:
    t0 = time.monotonic()
    while not cond():
        assert time.monotonic() - t0 < timeout, what
        time.sleep(0.02)
    return time.monotonic() - t0


def test_a_shard_fault_is_a_503_naming_it_then_degraded_until_reconnected(faulty):
    c, be, _worker = faulty
    req = {"prompt": "hello", "max_tokens": 5, "return_tokens": True}
    want = c.post("/v1/completions", json=req).json()["tokens"]
    h = c.get("/health")
    assert h.status_code == 200 and h.json()["status"] == "ok"
    be.down, be.seen = True, [SHARD]
    be.fail = ShardLostError(f"shard 1 ({EP}) of plan 0-1,2-3 lost during call", (1,))
    r = c.post("/v1/completions", json=req)
    assert r.status_code == 503, r.text
    err = r.json()["error"]
    assert err["type"] == "unavailable_error" and err["code"] == 503 and EP in err["message"]
    assert err["shards"] == [SHARD]
    h = c.get("/health")
    assert h.status_code == 503 and h.json()["status"] == "degraded"
    assert h.json()["shards"] == [SHARD] and h.json()["error"]["code"] == 503
    # while degraded: a request waits for an attempt made for it, and is answered 503
    # naming the shard when that attempt fails; the tokenizer is refused at once
    for path, body in (("/v1/completions", req), ("/tokenize", {"content": "x"})):
        n = be.reconnects
        r = c.post(path, json=body)
        assert r.status_code == 503 and EP in r.json()["error"]["message"], (path, r.text)
        assert (be.reconnects > n) == (path == "/v1/completions"), (path, be.reconnects, n)
    _until(lambda: be.reconnects >= 3, 10, "no retries with backoff")
    assert c.get("/health").status_code == 503
    be.down = False  # the shard is back: the next attempt succeeds
    _until(lambda: c.get("/health").status_code == 200, 10, "not whole again")
    assert c.get("/health").json()["recoveries"] == 1
    assert c.post("/v1/completions", json=req).json()["tokens"] == want


def test_the_first_request_after_the_shards_return_is_served_not_refused(faulty, monkeypatch):
    """Between attempts (a long backoff here) a request does not get a 503 for a shard that
    is back: it wakes an attempt at once and is answered by it."""
    c, be, _worker = faulty
    monkeypatch.setattr(serve_faults, "BACKOFF_S", 60)
    monkeypatch.setattr(serve_faults, "MAX_BACKOFF_S", 60)
    req = {"prompt": "hello", "max_tokens": 5, "return_tokens": True}
    want = c.post("/v1/completions", json=req).json()["tokens"]
    be.down, be.seen = True, [SHARD]
    be.fail = ShardLostError(f"shard 1 ({EP}) of plan 0-1,2-3 lost during call", (1,))
    assert c.post("/v1/completions", json=req).status_code == 503
    _until(lambda: be.reconnects >= 1, 10, "no first attempt")
    time.sleep(0.3)
    assert be.reconnects == 1 and c.get("/health").status_code == 503  # in the backoff
    be.down = False  # the shard is back
    t0 = time.monotonic()
    r = c.post("/v1/completions", json=req)
    assert r.status_code == 200 and r.json()["tokens"] == want, r.text
    assert time.monotonic() - t0 < 5 and be.reconnects == 2
    assert c.get("/health").status_code == 200


def test_a_fault_seen_between_requests_is_recovered_without_one(faulty):
    c, be, _worker = faulty
    be.seen = [{**SHARD, "cause": "stopped (SIGSTOP?)"}]
    h = c.get("/health")  # looks afresh: no request had to fail first
    assert h.status_code == 503 and "stopped" in h.json()["error"]["message"]
    _until(lambda: c.get("/health").status_code == 200, 10, "not recovered")
    assert be.reconnects == 1


def test_a_shard_lost_mid_stream_ends_it_with_a_503_event(faulty):
    c, be, _worker = faulty
    be.lose_after, be.down = 2, True
    with c.stream("POST", "/v1/completions", json={"prompt": "hi", "max_tokens": 8,
                                                   "stream": True}) as r:
        assert r.status_code == 200  # the first bytes were sent before the fault
        events = [x for x in r.iter_lines() if x.startswith("data: ")]
    last = json.loads(events[-1][len("data: "):])
    assert last["error"]["code"] == 503 and last["error"]["shards"] == [SHARD], last
    assert c.get("/health").status_code == 503
    be.down = False
    _until(lambda: c.get("/health").status_code == 200, 10, "not recovered")


def test_stopping_while_degraded_ends_the_recovery(faulty):
    c, be, worker = faulty
    be.down, be.seen = True, [SHARD]
    assert c.get("/health").status_code == 503
    _until(lambda: be.reconnects >= 2, 10, "no retries")
    t0 = time.monotonic()
    assert worker.stop(5) and time.monotonic() - t0 < 1


def test_a_whole_model_backend_is_always_whole(faulty):
    worker = GenerationWorker(FakeBackend(), _cfg())  # no faults(): nothing to recover
    try:
        assert worker.health.check() is None and worker.health.status()[0] == 200
    finally:
        assert worker.stop(5)


# -- the real service ----------------------------------------------------------------------
@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> TlsConfig:
    d = tmp_path_factory.mktemp("pki")
    init_pki(d, ["127.0.0.1"])
    return TlsConfig.load(d)


def _serve(pair, *extra: str):
    return start("-m", str(pair.trunk), "-md", str(pair.sidecar), "--draft", "2", "-c",
                 "512", "-t", "1", "--plan", "0-1,2-3", "--wan", "20", *_cache_args(),
                 *extra, env={"MTPLIB_SHARD_SILENCE_S": str(SILENCE_S)})


BODY = {"prompt": [5, 6, 7, 8], "max_tokens": 16, "return_tokens": True, "ignore_eos": True}


def _ask(url: str, **kw) -> httpx.Response:
    return httpx.post(url + "/v1/completions", json={**BODY, **kw}, timeout=120)


def _shard_pids(parent: int) -> dict[str, int]:
    """endpoint -> pid of the `shard serve` processes ``parent`` started."""
    found = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/cmdline", "rb") as f:
                argv = [a.decode() for a in f.read().split(b"\0") if a]
        except (OSError, UnicodeDecodeError):
            continue
        if "--parent-pid" in argv and argv[argv.index("--parent-pid") + 1] == str(parent):
            found[argv[argv.index("--endpoint") + 1]] = int(d)
    return found


def _fault_mid_request(url: str, fault) -> tuple[httpx.Response, float]:
    """A long request; ``fault()`` once it runs; (its response, seconds from the fault)."""
    got: dict = {}
    t = threading.Thread(target=lambda: got.setdefault("r", _ask(url, max_tokens=400)))
    t.start()
    _until(lambda: httpx.get(url + "/health", timeout=10).json()["pending"] >= 1, 60,
           "the request did not start")
    time.sleep(0.5)  # generating (20 ms per shard round trip)
    t0 = time.monotonic()
    fault()
    t.join(120)
    return got["r"], time.monotonic() - t0


def _check_503(r: httpx.Response, took: float, ep: str, deadline: float) -> None:
    assert r.status_code == 503, r.text
    err = r.json()["error"]
    assert err["type"] == "unavailable_error" and ep in err["message"], err
    assert ep in [s["endpoint"] for s in err["shards"]], err
    assert took < deadline, took


def _degraded(url: str, ep: str) -> dict:
    h = httpx.get(url + "/health", timeout=10)
    assert h.status_code == 503, h.text
    assert ep in [s["endpoint"] for s in h.json()["shards"]], h.text
    return h.json()


def _whole_within(url: str, timeout: float) -> float:
    return _until(lambda: httpx.get(url + "/health", timeout=10).status_code == 200,
                  timeout, f"/health not 200 within {timeout} s")


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSTOP], ids=["kill-9", "sigstop"])
def test_a_local_shard_killed_or_stopped_mid_request_is_restarted(pair, sig):
    s = _serve(pair)
    try:
        want = _ask(s.url).json()["tokens"]
        assert httpx.get(s.url + "/health", timeout=10).status_code == 200
        pids = _shard_pids(s.proc.pid)
        ep = sorted(pids)[1]
        r, took = _fault_mid_request(s.url, lambda: os.kill(pids[ep], sig))
        # kill -9: at once; a stopped shard: after the silence limit
        _check_503(r, took, ep, 10 if sig == signal.SIGKILL else SILENCE_S + 10)
        if sig == signal.SIGKILL:  # restarting a shard takes seconds: still degraded
            _degraded(s.url, ep)
        back = _whole_within(s.url, RECOVER_S)
        print(f"{sig.name}: 503 after {took:.1f} s, whole {back:.1f} s later")
        assert _shard_pids(s.proc.pid)[ep] != pids[ep]  # restarted, on its endpoint
        assert _ask(s.url).json()["tokens"] == want
        assert stop(s.proc) == 0, s.log()
    finally:
        if sig == signal.SIGSTOP:
            with __import__("contextlib").suppress(ProcessLookupError):
                os.kill(pids[ep], signal.SIGCONT)
        stop(s.proc)
    log = "".join(s.stderr)
    assert "degraded:" in log and "whole again" in log and "Traceback" not in log, log


@pytest.mark.slow
@pytest.mark.parametrize("tls", [False, True], ids=["plaintext", "tls"])
def test_an_external_shard_killed_and_restarted_on_its_port(pair, pki, tls):
    with LocalShards(2, tls=pki if tls else None) as sh:
        s = _serve(pair, "--endpoints", ",".join(sh.endpoints),
                   *(["--tls", str(pki.dir)] if tls else []))
        try:
            want = _ask(s.url).json()["tokens"]
            ep = sh.endpoints[1]
            r, took = _fault_mid_request(s.url, lambda: sh.kill(1))
            _check_503(r, took, ep, 10)
            time.sleep(2)  # nothing restarts an external shard: degraded until it is back
            body = _degraded(s.url, ep)
            assert body["degraded_s"] >= 2
            assert _ask(s.url).status_code == 503
            sh.restart(1)  # the operator brings it back on the same port
            t0 = time.monotonic()
            r = _ask(s.url)  # the first request after its return: served, not refused
            back = time.monotonic() - t0
            assert r.status_code == 200 and r.json()["tokens"] == want, r.text
            assert back < RECOVER_S
            assert _ask(s.url).json()["tokens"] == want
            print(f"tls={tls}: 503 after {took:.1f} s, the first request answered "
                  f"{back:.1f} s after the shard's return")
            assert stop(s.proc) == 0, s.log()
        finally:
            stop(s.proc)
    assert "Traceback" not in "".join(s.stderr), s.log()


@pytest.mark.slow
@pytest.mark.parametrize("parallel", [1, 4], ids=["one-slot", "parallel-4"])
def test_a_short_stall_of_a_shard_keeps_the_service_healthy(pair, parallel):
    """Issue 39 item 6: a shard stopped for 1.5 s (under the 3 s silence limit) while
    requests run (as many as slots) and /health is polled: /health stays 200, nothing
    reconnects (``recoveries`` stays 0, no "degraded" in the log, no shard restarted) and
    the requests are answered with the tokens they give without the stall. It used to be
    503 at the first poll, and every shard reloaded its weights (with --parallel 4, 503 for
    10 s while the waiting requests waited 12 s more)."""
    s = _serve(pair, "--parallel", str(parallel))
    pids: dict[str, int] = {}
    try:
        want = _ask(s.url, max_tokens=96).json()["tokens"]
        pids = _shard_pids(s.proc.pid)
        ep = sorted(pids)[1]
        got: list = []
        ts = [threading.Thread(target=lambda: got.append(_ask(s.url, max_tokens=96)))
              for _ in range(parallel)]
        for t in ts:
            t.start()
        _until(lambda: httpx.get(s.url + "/health", timeout=10).json()["pending"] >= 1, 60,
               "no request started")
        codes = []
        os.kill(pids[ep], signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            while time.monotonic() - t0 < 1.5:
                codes.append(httpx.get(s.url + "/health", timeout=10).status_code)
                time.sleep(0.1)
        finally:
            os.kill(pids[ep], signal.SIGCONT)
        for _ in range(10):  # and after it
            codes.append(httpx.get(s.url + "/health", timeout=10).status_code)
            time.sleep(0.1)
        for t in ts:
            t.join(120)
        assert set(codes) == {200}, codes
        assert len(got) == parallel
        for r in got:
            assert r.status_code == 200 and r.json()["tokens"] == want, r.text
        h = httpx.get(s.url + "/health", timeout=10).json()
        assert h["status"] == "ok" and h["recoveries"] == 0, h
        assert _shard_pids(s.proc.pid) == pids  # nothing restarted
        assert stop(s.proc) == 0, s.log()
    finally:
        for pid in pids.values():
            with __import__("contextlib").suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        stop(s.proc)
    assert "degraded" not in "".join(s.stderr), s.log()


def _gone(pid: int) -> bool:
    """True once ``pid`` has ended (a zombie waiting for its new parent counts)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in "ZX"
    except OSError:
        return True


@pytest.mark.slow
def test_a_restarted_local_shard_dies_with_a_killed_service_even_stopped(pair):
    """Issue 39 item 5: a local shard the recovery restarted (in the service's worker
    thread) gets the parent-death SIGKILL as the first ones do: stopped (SIGSTOP), then the
    service killed with -9, it ends and frees its port instead of staying behind, stopped,
    holding it."""
    s = _serve(pair)
    pids: dict[str, int] = {}
    try:
        pids = _shard_pids(s.proc.pid)
        ep = sorted(pids)[1]
        os.kill(pids[ep], signal.SIGKILL)
        _until(lambda: httpx.get(s.url + "/health", timeout=10).json()["recoveries"] == 1,
               RECOVER_S, "the killed shard was not restarted")
        pids = _shard_pids(s.proc.pid)
        time.sleep(1.5)  # the restart's thread may end meanwhile: the shard must live on
        assert not _gone(pids[ep]) and _shard_pids(s.proc.pid) == pids
        os.kill(pids[ep], signal.SIGSTOP)
        s.proc.kill()
        s.proc.wait(10)
        t0 = time.monotonic()
        while not all(_gone(p) for p in pids.values()):
            assert time.monotonic() - t0 < 5, {p: _gone(p) for p in pids.values()}
            time.sleep(0.05)
        host, port = ep.split(":")
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection((host, int(port)), timeout=2).close()
    finally:
        for pid in pids.values():
            with __import__("contextlib").suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
                os.kill(pid, signal.SIGKILL)
        stop(s.proc)
