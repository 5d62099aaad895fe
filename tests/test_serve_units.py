"""`mtplib.serve`'s request logic without HTTP: a parsed body to a typed request, its
sampler and context budget, the chat prompt, the slot table's figures, and whole requests
through `Generations` and `Tokenizer` on a worker over the fake backend of
tests/test_serve_http.py (no server, no client, no model)."""

from __future__ import annotations

import asyncio
import math

import pytest

pytest.importorskip("fastapi")
from test_serve_batch_http import FakeBatch  # noqa: E402
from test_serve_http import EOG, FakeBackend, _cfg, _expected  # noqa: E402

from mtplib.runtime.results import GenerationMetrics  # noqa: E402
from mtplib.serve import status  # noqa: E402
from mtplib.serve.chat import render_chat  # noqa: E402
from mtplib.serve.errors import ApiError  # noqa: E402
from mtplib.serve.events import RunMetrics  # noqa: E402
from mtplib.serve.intake import parse_request, sampler_of  # noqa: E402
from mtplib.serve.native import timings  # noqa: E402
from mtplib.serve.openai import Shape  # noqa: E402
from mtplib.serve.protocol import (  # noqa: E402
    ChatMessage,
    ChatRequest,
    CompletionRequest,
    NativeRequest,
    TokenizeRequest,
)
from mtplib.serve.serving import Generations, Outcome  # noqa: E402
from mtplib.serve.stats import SlotTable  # noqa: E402
from mtplib.serve.tokenizing import Tokenizer  # noqa: E402
from mtplib.serve.tokens import budget, prompt_tokens  # noqa: E402
from mtplib.serve.worker import BatchWorker, GenerationWorker  # noqa: E402


def _refused(fn, *args) -> ApiError:
    with pytest.raises(ApiError) as e:
        fn(*args)
    return e.value


# -- a body to a request ----------------------------------------------------------------
def test_a_body_becomes_a_typed_request_or_a_400_naming_the_field():
    req = parse_request({"prompt": "hi", "max_tokens": 3, "stop": "x", "cache_prompt": True},
                        CompletionRequest, "completions", 1)
    assert isinstance(req, CompletionRequest)
    assert (req.n_new(8), req.stop_list(), req.n_logprobs()) == (3, ["x"], None)
    for body, kind, endpoint, param in [
            ({"prompt": "hi", "best_of": 2}, CompletionRequest, "completions", "best_of"),
            ({"prompt": "hi", "wat": 1}, CompletionRequest, "completions", "wat"),
            ({"prompt": "hi", "n_probs": 2}, CompletionRequest, "completions", "n_probs"),
            ({"prompt": "hi", "id_slot": 1}, NativeRequest, "completion", "id_slot"),
            ({"prompt": "hi", "top_p": 0}, NativeRequest, "completion", "top_p"),
            ({"prompt": "hi", "stop": ["a"] * 5}, NativeRequest, "completion", "stop"),
            ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2},
             ChatRequest, "chat", "top_logprobs")]:
        e = _refused(parse_request, dict(body), kind, endpoint, 1)
        assert e.status == 400 and e.param == param, (body, e.param, e.message)
    # id_slot within the service's slots is taken (the request runs in any free one)
    assert parse_request({"prompt": "hi", "id_slot": 3}, NativeRequest, "completion", 4)


def test_the_sampler_takes_the_request_over_the_defaults():
    cfg = _cfg(default_temperature=0.5, default_top_p=0.9, default_seed=7)
    s = sampler_of(cfg, parse_request({"prompt": "a"}, CompletionRequest, "completions", 1))
    assert (s.temperature, s.top_p, s.seed) == (0.5, 0.9, 7)
    s = sampler_of(cfg, parse_request({"prompt": "a", "temperature": 0.0, "top_k": 3,
                                       "logit_bias": [[5, False]]},
                                      NativeRequest, "completion", 1))
    assert (s.temperature, s.top_k, s.logit_bias) == (0.0, 3, ((5, -math.inf),))
    drawn = {sampler_of(cfg, parse_request({"prompt": "a", "seed": -1}, CompletionRequest,
                                           "completions", 1)).seed for _ in range(4)}
    assert -1 not in drawn and len(drawn) > 1  # llama-server's -1: a random seed each
    bad = parse_request({"prompt": "a", "logit_bias": {"99": 1.0}}, CompletionRequest,
                        "completions", 1)
    assert _refused(sampler_of, cfg, bad).param == "logit_bias"  # 99 >= n_vocab 64


# -- tokens and the context ---------------------------------------------------------------
def test_prompt_tokens_and_the_context_budget():
    be, cfg = FakeBackend(), _cfg(bos_id=1)
    assert prompt_tokens(be, cfg, [5, 6]) == [5, 6]
    # llama-server's mix: the strings after the first lose the BOS their tokenize adds
    be.tokenize = lambda text: [1] + [2 + ord(c) % 40 for c in text]
    assert prompt_tokens(be, cfg, ["a", 9, "b"]) == [1, 2 + ord("a") % 40, 9, 2 + ord("b") % 40]
    assert budget(cfg, [3] * 100, 8) == (8, False)
    assert budget(cfg, [3] * 100, 50) == (28, True)  # n_ctx 128: to the context's end
    assert budget(cfg, [3] * 100, -1) == (28, True)
    e = _refused(budget, cfg, [3] * 128, 1)
    assert e.type == "exceed_context_size_error" and e.extra == {"n_prompt_tokens": 128,
                                                                  "n_ctx": 128}
    assert _refused(budget, cfg, [3, 64], 1).param == "prompt"  # 64: past n_vocab
    assert _refused(budget, cfg, [], 1).message == "the prompt has no tokens"


def test_chat_prompts_chatml_and_a_template_that_refuses():
    msgs = [ChatMessage(role="system", content="s"), ChatMessage(role="user", content="u")]
    assert render_chat(_cfg(), msgs) == ("<|im_start|>system\ns<|im_end|>\n<|im_start|>user"
                                         "\nu<|im_end|>\n<|im_start|>assistant\n")
    tpl = "{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}" \
          "{% if add_generation_prompt %}[assistant]{% endif %}"
    assert render_chat(_cfg(chat_template=tpl), msgs) == "[system]s[user]u[assistant]"
    refusing = "{{ raise_exception('no system role') }}"
    e = _refused(render_chat, _cfg(chat_template=refusing), msgs)
    assert e.status == 400 and e.param == "messages" and "no system role" in e.message


# -- figures ------------------------------------------------------------------------------
def _metrics(**kw) -> GenerationMetrics:
    base = dict(k=2, n_prompt=5, n_generated=6, drafted=6, accepted=4, acceptance_rate=4 / 6,
                accepted_per_position=[1.0, 1 / 3], accepted_per_position_counts=[3, 1],
                drafted_per_position=[3, 3], accept_len_hist={}, verify_steps=3,
                plain_steps=1, rollbacks={}, ttft_s=0.01, decode_s=0.05, decode_tok_s=100.0,
                time_s={})
    return GenerationMetrics(**{**base, **kw})


def test_the_slot_table_keeps_typed_figures_for_one_slot_or_many():
    one = SlotTable()
    one.begin(0, {}, n_prompt=5, n_new=6)
    one.step(0, 2)
    assert one.states()[0].n_decoded == 2 and one.states()[0].id_task == 1
    m = RunMetrics.of(_metrics())
    assert (m.drafted, m.verify_steps, m.waits_per_step) == (6, 3, None)  # whole model
    one.done(0, m, 5, 6)
    t = one.totals
    assert one.states() == [None] and t.requests == {"ok": 1, "error": 0}
    assert (t.prompt_tokens, t.predicted, t.decode_steps, t.drafted) == (5, 6, 4, 6)
    assert t.slots_per_decode == 1.0  # not batched: one slot per step
    many = SlotTable(4)
    many.begin(2, {"n_predict": 3}, 1, 3)
    assert [s is not None for s in many.states()] == [False, False, True, False]
    many.stepped(3)
    many.stepped(1)
    many.failed(2)
    assert many.totals.slots_per_decode == 2.0 and many.totals.requests["error"] == 1
    assert many.states() == [None] * 4


def test_timings_and_shapes_read_the_typed_figures():
    m = RunMetrics.of(_metrics())
    t = timings(m, 5, 6)
    assert (t["draft_n"], t["draft_n_accepted"]) == (6, 4)
    assert t["predicted_per_second"] == pytest.approx(5 / 0.05)
    early = RunMetrics.clock(ttft_s=None, decode_s=0.0)  # stopped before any token
    assert "draft_n" not in timings(early, 5, 0) and timings(early, 5, 0)["prompt_ms"] == 0.0
    body = Shape("m", chat=True).whole("hi", "stop", 5, [1, 2], m)
    assert body["object"] == "chat.completion" and body["usage"]["total_tokens"] == 7
    assert body["timings"] == timings(m, 5, 2)


# -- whole requests, no HTTP --------------------------------------------------------------
def _run(worker: GenerationWorker, coro_fn):
    try:
        return asyncio.run(coro_fn(Generations(worker)))
    finally:
        assert worker.stop(5)


def test_a_request_through_generations_is_a_typed_outcome():
    be = FakeBackend()
    worker = GenerationWorker(be, _cfg())

    async def go(gens: Generations):
        req = gens.parse({"prompt": "hello", "max_tokens": 5, "n_probs": 2}, NativeRequest,
                         "completion")
        running = await gens.start(req, "hello", native=True)
        assert running.n_prompt == 5 and running.prompt_text == be.detokenize(
            be.tokenize("hello"))
        return await gens.collect(running)

    out = _run(worker, go)
    assert isinstance(out, Outcome) and out.finish == "length"
    assert out.tokens == _expected(be, "hello", 5) and out.text == be.detokenize(out.tokens)
    assert out.end.truncated is False and out.end.stop_type == "limit"
    assert out.metrics.drafted == 6  # the fake's GenerationMetrics, typed to the end
    assert [p.id for p in out.probs] == out.tokens and all(len(p.top) == 2 for p in out.probs)
    assert worker.stats.totals.requests == {"ok": 1, "error": 0}


def test_an_end_of_generation_stops_early_with_this_sides_clock():
    be = FakeBackend()
    be.eog_at = 2
    worker = GenerationWorker(be, _cfg())

    async def go(gens: Generations):
        req = gens.parse({"prompt": "ab", "max_tokens": 6}, CompletionRequest, "completions")
        return await gens.collect(await gens.start(req, "ab"))

    out = _run(worker, go)
    assert out.finish == "stop" and out.end.stop_type == "eos" and EOG not in out.tokens
    assert len(out.tokens) == 2 and out.metrics.drafted == 0 and out.probs is None


def test_a_refusal_comes_from_start_before_any_generation():
    worker = GenerationWorker(FakeBackend(), _cfg())

    async def go(gens: Generations):
        req = gens.parse({"prompt": [70]}, CompletionRequest, "completions")
        with pytest.raises(ApiError) as e:
            await gens.start(req, [70])
        return e.value

    e = _run(worker, go)
    assert e.status == 400 and "out of range" in e.message
    assert worker.stats.totals.requests == {"ok": 0, "error": 1}


def test_batched_requests_through_generations_share_steps():
    be = FakeBackend()
    batch = FakeBatch(be)
    worker = BatchWorker(be, _cfg(queue_max=4), batch, 4)

    async def go(gens: Generations):
        async def one(p: str) -> Outcome:
            req = gens.parse({"prompt": p, "max_tokens": 20, "ignore_eos": True},
                             CompletionRequest, "completions")
            return await gens.collect(await gens.start(req, p))

        return await asyncio.gather(*(one(f"p{i}") for i in range(3)))

    outs = _run(worker, go)
    assert [o.tokens for o in outs] == [_expected(be, f"p{i}", 20) for i in range(3)]
    assert batch.max_live >= 2 and worker.stats.totals.slots_per_decode > 1.0
    assert len(status.slots_of(worker)) == 4
    assert "mtplib:slots_busy Slots running a generation (of 4)" in status.metrics_of(worker)


def test_the_tokenizer_without_http():
    be = FakeBackend()
    worker = GenerationWorker(be, _cfg(bos_id=None))
    tok = Tokenizer(be, worker.cfg, worker.health)
    try:
        got = asyncio.run(tok.tokenize(TokenizeRequest(content="ab", with_pieces=True)))
        assert got.tokens == be.tokenize("ab") and got.pieces == [
            be.detokenize([t]) for t in got.tokens]
        e = _refused(lambda: asyncio.run(tok.tokenize(TokenizeRequest(
            content="a", parse_special=False))))
        assert e.param == "parse_special"
    finally:
        assert worker.stop(5)
