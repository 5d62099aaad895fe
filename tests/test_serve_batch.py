"""`mtplib serve --parallel N` as a user runs it (a subprocess, the `openai` client): N
requests at once are stepped together, each answered with the tokens it gets alone;
/slots, /props and /metrics show N slots; a request that stops early frees its slot; a
prompt past a slot's share of the context is refused with the slot's n_ctx; ranged
(local shards) too; SIGTERM exits 0."""

from __future__ import annotations

import signal
import threading
import time

import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from test_serve import REQ_S, TRAINED, _cache_args, stop  # noqa: E402

PROMPTS = ["def main(", "import os\n", "class Config:\n    def __init__(self",
           "for i in range("]
BODY = {"return_tokens": True, "ignore_eos": True}


def _concurrent(c, model: str, prompts: list, n: int, watch: str | None = None
                ) -> tuple[list[list[int]], int]:
    """Each prompt from its own thread at once; (tokens per prompt, the most slots /slots
    showed busy meanwhile, when ``watch`` is the service's URL)."""
    got: list = [None] * len(prompts)
    errors: list[BaseException] = []
    busiest = [0]

    def ask(i: int) -> None:
        try:
            r = c.completions.create(model=model, prompt=prompts[i], max_tokens=n,
                                     temperature=0, extra_body=BODY)
            got[i] = r.model_extra["tokens"]
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    ts = [threading.Thread(target=ask, args=(i,)) for i in range(len(prompts))]
    for t in ts:
        t.start()
    while watch and any(t.is_alive() for t in ts):
        slots = httpx.get(watch + "/slots", timeout=10).json()
        busiest[0] = max(busiest[0], sum(s["is_processing"] for s in slots))
        time.sleep(0.01)
    for t in ts:
        t.join(REQ_S)
    assert not errors, errors
    return got, busiest[0]


@pytest.mark.skipif(not TRAINED.exists(), reason="evidence/trained-v4 missing")
def test_parallel_4_answers_each_request_as_alone(server_factory):
    s = server_factory("-m", str(TRAINED.trunk), "-md", str(TRAINED.sidecar), "--draft",
                       "2", "-c", "1024", "--parallel", "4")
    assert s.ready["parallel"] == 4 and s.ready["n_ctx"] == 256  # each slot: 1024 / 4
    c = s.client()
    model = c.models.list().data[0].id
    alone, text = [], []
    for p in PROMPTS:
        r = c.completions.create(model=model, prompt=p, max_tokens=40, temperature=0,
                                 extra_body=BODY)
        alone.append(r.model_extra["tokens"])
        text.append(r.choices[0].text)
        assert r.model_extra["timings"]["draft_n"] > 0
    got, busiest = _concurrent(c, model, PROMPTS, 40, watch=s.url)
    assert got == alone
    assert busiest >= 2  # stepped together, not one after another
    slots = httpx.get(s.url + "/slots", timeout=10).json()
    assert [x["id"] for x in slots] == [0, 1, 2, 3]
    assert not any(x["is_processing"] for x in slots)
    assert httpx.get(s.url + "/props", timeout=10).json()["total_slots"] == 4
    assert "(of 4)" in httpx.get(s.url + "/metrics", timeout=10).text
    # a stop string ends one request early (its slot leaves mid-run); the slots serve on
    word = text[0][12:15]
    r = c.completions.create(model=model, prompt=PROMPTS[0], max_tokens=40, temperature=0,
                             stop=[word], extra_body=BODY)
    assert r.choices[0].finish_reason == "stop"
    assert text[0].startswith(r.choices[0].text) and len(r.choices[0].text) < len(text[0])
    got, _ = _concurrent(c, model, PROMPTS[::-1], 40)
    assert got == alone[::-1]
    # past a slot's share: refused with the slot's n_ctx; max_tokens -1 stops at its end
    with pytest.raises(openai.BadRequestError, match="256"):
        c.completions.create(model=model, prompt=list(range(1, 300)), max_tokens=4)
    r = c.completions.create(model=model, prompt=PROMPTS[1], max_tokens=-1, extra_body=BODY)
    assert r.usage.prompt_tokens + r.usage.completion_tokens == 256
    assert stop(s.proc) == 0, s.log()


@pytest.mark.slow
def test_parallel_ranged_answers_each_request_as_alone(pair, server_factory):
    s = server_factory("-m", str(pair.trunk), "-md", str(pair.sidecar), "--draft", "2",
                       "-c", "512", "-t", "1", "--parallel", "2", "--plan", "0-1,2-3",
                       *_cache_args())
    c = s.client()
    model = c.models.list().data[0].id
    prompts = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16]]
    alone = [c.completions.create(model=model, prompt=p, max_tokens=16,
                                  extra_body=BODY).model_extra["tokens"] for p in prompts]
    got, _ = _concurrent(c, model, prompts, 16)  # 3 requests on 2 slots: one waits
    assert got == alone
    assert stop(s.proc, signal.SIGTERM) == 0, s.log()


@pytest.fixture
def server_factory():
    from test_serve import start

    started = []

    def make(*args: str, **kw):
        s = start(*args, **kw)
        started.append(s)
        return s

    yield make
    for s in started:
        stop(s.proc)
