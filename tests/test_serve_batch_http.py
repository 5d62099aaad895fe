"""`serve --parallel`'s scheduler (`mtplib.serve.batch`) over a fake batch (no model,
milliseconds): more requests than slots all come back right, at most N generate at once
and more than one do; /slots lists N; a failing step answers each of its requests with a
JSON error and the service serves on; shutdown ends the scheduler."""

from __future__ import annotations

import threading
import time

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("httpx")
from fastapi.testclient import TestClient  # noqa: E402
from test_serve_http import FakeBackend, FakeGeneration, _cfg, _expected  # noqa: E402

from mtplib.errors import MtplibError  # noqa: E402
from mtplib.serve.app import create_app  # noqa: E402
from mtplib.serve.worker import BatchWorker  # noqa: E402


class FakeBatch:
    """`BatchRun`'s interface, one token per slot per step (FakeBackend's tokens)."""

    capacity = 4
    n_ctx = FakeBackend.n_ctx

    def __init__(self, be: FakeBackend) -> None:
        self.be = be
        self.slots: dict[int, list] = {}  # seq -> [prompt, n_new, tokens, seed]
        self.max_live = 0
        self.fail_next: BaseException | None = None

    def join_many(self, asks):
        out = []
        for prompt, n, sampler in asks:
            q = min(set(range(self.capacity)) - set(self.slots))
            first = [self.be.next_token(list(prompt), 0, sampler.seed)] if n else []
            self.slots[q] = [list(prompt), n, first, sampler.seed]
            out.append((q, list(first)))
        return out

    def active(self) -> list[int]:
        return [q for q, (_, n, toks, _) in self.slots.items() if len(toks) < n]

    def step(self) -> dict[int, list[int]]:
        if self.fail_next is not None:
            e, self.fail_next = self.fail_next, None
            raise e
        live = self.active()
        self.max_live = max(self.max_live, len(live))
        time.sleep(0.005)
        out = {}
        for q in live:
            prompt, _, toks, seed = self.slots[q]
            toks.append(self.be.next_token(prompt, len(toks), seed))
            out[q] = toks[-1:]
        return out

    def leave(self, q: int):
        prompt, n, toks, _ = self.slots.pop(q)
        if len(toks) < n:
            return None
        gen = FakeGeneration(self.be, prompt, n, None)
        gen.sampler = type("S", (), {"seed": 0, "logprobs": None})()
        list(gen)  # its metrics (the same counts the one-slot fake reports)
        return toks, gen.metrics

    def close(self) -> None:
        self.slots.clear()


@pytest.fixture
def served_batch():
    be = FakeBackend()
    batch = FakeBatch(be)
    # queue 8: 6 requests may all wait before the scheduler admits any (a busy host)
    worker = BatchWorker(be, _cfg(queue_max=8), batch, 4)
    with TestClient(create_app(worker, on_shutdown=lambda: worker.stop(5))) as c:
        yield c, be, batch, worker
    assert not worker.thread.is_alive()


def _ask(c, prompt: str, n: int) -> dict:
    r = c.post("/v1/completions", json={"prompt": prompt, "max_tokens": n,
                                         "return_tokens": True, "ignore_eos": True})
    return {"status": r.status_code, **r.json()}


def test_more_requests_than_slots_all_come_back_right(served_batch):
    c, be, batch, worker = served_batch
    prompts = [f"prompt {i}" for i in range(6)]
    got: dict[str, dict] = {}

    def run(p: str) -> None:
        got[p] = _ask(c, p, 40)  # 40 steps of 5 ms: the requests overlap even on a busy host

    ts = [threading.Thread(target=run, args=(p,)) for p in prompts]
    for t in ts:
        t.start()
    for t in ts:
        t.join(30)
    for p in prompts:
        assert got[p]["status"] == 200, got[p]
        assert got[p]["tokens"] == _expected(be, p, 40)
    assert 2 <= batch.max_live <= 4  # stepped together, never more than the slots
    t0 = time.monotonic()  # a slot is freed when its request thread's exit is handled
    while any(s["is_processing"] for s in c.get("/slots").json()):
        assert time.monotonic() - t0 < 5, c.get("/slots").json()
        time.sleep(0.02)
    assert [s["id"] for s in c.get("/slots").json()] == [0, 1, 2, 3]
    assert c.get("/props").json()["total_slots"] == 4
    assert "(of 4)" in c.get("/metrics").text


def test_id_slot_takes_every_slot_of_parallel_n(served_batch):
    """llama-server's id_slot under --parallel 4: 0..3 and -1 (any) are taken (the request
    runs in a free slot: docs/serve.md), 4 and up are refused naming the range."""
    c, be, _, _ = served_batch
    assert len(c.get("/slots").json()) == 4
    for v in (0, 1, 2, 3, -1):
        for path, n in (("/completion", "n_predict"), ("/v1/completions", "max_tokens")):
            r = c.post(path, json={"prompt": "ab", n: 2, "id_slot": v, "ignore_eos": True,
                                   "return_tokens": True})
            assert r.status_code == 200, (v, path, r.text)
            assert r.json()["tokens"] == _expected(be, "ab", 2)
    for v in (4, 99):
        r = c.post("/completion", json={"prompt": "ab", "n_predict": 1, "id_slot": v})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == "id_slot" and "0..3" in err["message"], err


def test_a_failing_step_answers_its_requests_and_the_service_goes_on(served_batch):
    c, be, batch, worker = served_batch
    batch.fail_next = MtplibError("shard 1 lost")
    r = _ask(c, "abc", 8)
    assert r["status"] >= 400 and "shard 1 lost" in r["error"]["message"]
    assert not batch.slots  # its slot was freed
    r = _ask(c, "abc", 8)
    assert r["status"] == 200 and r["tokens"] == _expected(be, "abc", 8)


def test_a_stop_string_frees_the_slot_early(served_batch):
    c, be, batch, worker = served_batch
    full = _ask(c, "hello", 20)
    word = full["choices"][0]["text"][4:6]
    r = c.post("/v1/completions", json={"prompt": "hello", "max_tokens": 20, "stop": [word],
                                         "ignore_eos": True}).json()
    assert r["choices"][0]["finish_reason"] == "stop"
    deadline = time.monotonic() + 5
    while batch.slots and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not batch.slots


def test_a_shard_fault_under_parallel_slots_is_recovered_with_a_new_batch(monkeypatch):
    """--parallel N on a ranged backend: a step that loses a shard answers its requests
    with the 503 naming it, the service reconnects and opens a new batch on the new
    session, and serves the same tokens again."""
    from test_serve_faults import EP, SHARD, FaultyBackend

    from mtplib.distributed.client import ShardLostError
    from mtplib.serve import faults as serve_faults

    monkeypatch.setattr(serve_faults, "BACKOFF_S", 0.02)
    monkeypatch.setattr(serve_faults, "MAX_BACKOFF_S", 0.05)
    be = FaultyBackend()
    batches: list[FakeBatch] = []

    def batch(warm: bool = True) -> FakeBatch:
        batches.append(FakeBatch(be))
        return batches[-1]

    be.batch = batch
    worker = BatchWorker(be, _cfg(queue_max=4), batch(), 4)
    req = {"prompt": "hello", "max_tokens": 5, "return_tokens": True}
    with TestClient(create_app(worker, on_shutdown=lambda: worker.stop(5))) as c:
        want = c.post("/v1/completions", json=req).json()["tokens"]
        be.down, be.seen = True, [SHARD]
        batches[-1].fail_next = ShardLostError(f"shard 1 ({EP}) lost during call", (1,))
        r = c.post("/v1/completions", json=req)
        assert r.status_code == 503 and EP in r.json()["error"]["message"], r.text
        assert c.get("/health").status_code == 503
        be.down = False
        t0 = time.monotonic()
        while c.get("/health").status_code != 200:
            assert time.monotonic() - t0 < 10, "not whole again"
            time.sleep(0.02)
        assert len(batches) == 2  # a new batch on the new session
        got = [c.post("/v1/completions", json=req).json()["tokens"] for _ in range(3)]
        assert got == [want] * 3


def test_requests_held_by_the_service_join_in_one_prefill():
    """A gathering join (ranged: ``gather_s``) waits for requests already admitted that
    have not joined yet: four whose prompts take 50-170 ms each to tokenize (so they
    reach the scheduler further apart than ``gather_s``) share one prefill batch."""

    class SlowTokens(FakeBackend):
        def tokenize(self, text: str) -> list[int]:
            time.sleep(0.05 + 0.04 * int(text[-1]))
            return super().tokenize(text)

    class Joins(FakeBatch):
        sizes: list[int] = []

        def join_many(self, asks):
            self.sizes.append(len(asks))
            return super().join_many(asks)

    be = SlowTokens()
    batch = Joins(be)
    batch.sizes = []
    worker = BatchWorker(be, _cfg(queue_max=4), batch, 4, gather_s=0.02)
    got: dict[str, dict] = {}
    with TestClient(create_app(worker, on_shutdown=lambda: worker.stop(5))) as c:
        def run(p: str) -> None:
            got[p] = _ask(c, p, 6)

        ts = [threading.Thread(target=run, args=(f"p{i}",)) for i in range(4)]
        for t in ts:
            t.start()
        for t in ts:
            t.join(30)
    assert all(got[f"p{i}"]["status"] == 200 for i in range(4)), got
    assert batch.sizes == [4]
