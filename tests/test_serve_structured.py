"""Structured output over HTTP (issue 43, point 1, the service half): `mtplib serve` takes
llama-server's ``grammar`` and ``json_schema`` and ``response_format`` (``json_object``
with a schema, OpenAI's ``json_schema`` with ``strict``) on /completion, /v1/completions
and /v1/chat/completions, streamed and not, with MTP drafting, under ``--parallel``: on
the 16 held-out prompts of tests/test_grammar.py every response parses and validates
against the schema, the streamed text is the non-streamed one, and two local shards
(``--plan 0-1,2-3``) answer the whole model's text. The whole model's server also answers
llama-server's other request fields on the real model: logit_bias keyed by text bans that
text's tokens, post_sampling_probs of a greedy pick is certainty.

Two servers in all (the trained pair): the whole model at ``--parallel 4`` and the shards
at ``--parallel 2``; the requests to each go four at a time."""

from __future__ import annotations

import json
import threading

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("openai")  # test_serve's helpers need it
jsonschema = pytest.importorskip("jsonschema")

from test_grammar import N_JSON, SCHEMA, WORDS  # noqa: E402
from test_serve import REQ_S, TRAINED, _cache_args, start, stop  # noqa: E402

N_PROMPTS, PROMPT_LEN = 16, 32
COMMON = ("-m", str(TRAINED.trunk), "-md", str(TRAINED.sidecar), "--draft", "2", "-t", "1")
needs_trained = pytest.mark.skipif(not TRAINED.exists(), reason="evidence/trained-v4 missing")


def _forms(i: int, ids: list[int], text: str) -> tuple[str, dict]:
    """Prompt ``i``'s request, the three endpoints and four request forms in turn."""
    kind = i % 4
    if kind == 0:  # llama-server's native endpoint, its top-level json_schema
        return "/completion", {"prompt": ids, "json_schema": SCHEMA, "n_predict": N_JSON}
    if kind == 1:  # OpenAI's completions, llama-server's json_object with a schema
        return "/v1/completions", {"prompt": ids, "max_tokens": N_JSON, "response_format": {
            "type": "json_object", "schema": SCHEMA}}
    if kind == 2:  # OpenAI's chat, its json_schema form with strict
        return "/v1/chat/completions", {
            "messages": [{"role": "user", "content": text}], "max_tokens": N_JSON,
            "response_format": {"type": "json_schema", "json_schema": {
                "name": "item", "schema": SCHEMA, "strict": True}}}
    # the schema as GBNF text (what llama-server's "grammar" takes), on /completion
    from mtplib.runtime.structured import schema_spec

    return "/completion", {"prompt": ids, "grammar": schema_spec(SCHEMA).gbnf,
                           "n_predict": N_JSON}


def _text(path: str, body: dict) -> tuple[str, str]:
    """(text, why it ended) of a non-streaming response of any endpoint."""
    if path == "/completion":
        return body["content"], body["stop_type"]
    ch = body["choices"][0]
    return (ch["message"]["content"] if "message" in ch else ch["text"]), ch["finish_reason"]


def _streamed(url: str, path: str, body: dict) -> tuple[str, dict]:
    """(text, last event) of a streamed request."""
    with httpx.stream("POST", url + path, json={**body, "stream": True},
                      timeout=REQ_S) as r:
        assert r.status_code == 200, r.read()
        events = [json.loads(line[len("data: "):]) for line in r.iter_lines()
                  if line.startswith("data: {")]
    if path == "/completion":
        return "".join(e["content"] for e in events), events[-1]
    parts = [e["choices"][0].get("delta", {}).get("content") or e["choices"][0].get("text")
             or "" for e in events if e.get("choices")]
    return "".join(parts), events[-1]


def _ask_all(url: str, prompts: list[list[int]]) -> list[dict]:
    """Each prompt's constrained request, non-streamed and streamed, four prompts at once:
    [{"path", "text", "end", "stream_text", "timings"}] in prompt order."""
    texts = [httpx.post(url + "/detokenize", json={"tokens": p}, timeout=REQ_S).json()["content"]
             for p in prompts]
    out: list[dict | None] = [None] * len(prompts)

    def ask(i: int) -> None:
        path, body = _forms(i, prompts[i], texts[i])
        r = httpx.post(url + path, json=body, timeout=REQ_S)
        assert r.status_code == 200, r.text
        text, end = _text(path, r.json())
        stext, last = _streamed(url, path, body)
        out[i] = {"path": path, "text": text, "end": end, "stream_text": stext,
                  "timings": r.json()["timings"], "last": last}

    for a in range(0, len(prompts), 4):
        ts = [threading.Thread(target=ask, args=(i,)) for i in range(a, min(a + 4, len(prompts)))]
        for t in ts:
            t.start()
        for t in ts:
            t.join(REQ_S * 2)
    assert all(o is not None for o in out), "a request thread failed (see its assertion)"
    return out  # type: ignore[return-value]


def _valid(results: list[dict]) -> None:
    """Every response, streamed and not, parses and validates, and ended where the grammar
    did (not at the token limit)."""
    for i, o in enumerate(results):
        assert o["end"] in ("eos", "stop"), (i, o)
        jsonschema.validate(json.loads(o["text"]), SCHEMA)
        assert o["stream_text"] == o["text"], (i, o)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    if not TRAINED.exists():
        pytest.skip("evidence/trained-v4 missing")
    from mtplib.lab.trained_eval import heldout_modules, heldout_tokens, prompts_from

    docs = heldout_tokens(TRAINED.trunk, heldout_modules(TRAINED.trunk.parent / "split.json"))
    return prompts_from(docs, n=N_PROMPTS, length=PROMPT_LEN, seed=0)


@pytest.fixture(scope="module")
def whole(prompts):
    """The whole model's server (--parallel 4) and its answers to every prompt."""
    s = start(*COMMON, "-c", "1024", "--parallel", "4")
    try:
        yield s, _ask_all(s.url, prompts)
    finally:
        assert stop(s.proc) == 0, s.log()


@pytest.mark.slow
@needs_trained
def test_whole_model_structured_output_parses_and_validates(whole):
    _, results = whole
    assert len(results) == N_PROMPTS
    _valid(results)
    assert sum(o["timings"].get("draft_n", 0) for o in results) > 0  # MTP drafted
    assert {o["path"] for o in results} == {"/completion", "/v1/completions",
                                            "/v1/chat/completions"}


@pytest.mark.slow
@needs_trained
def test_a_gbnf_grammar_gives_its_language_and_a_bad_one_is_a_400(whole):
    s, _ = whole
    gbnf = 'root ::= ("yes" | "no" | "maybe" | "true" | "false")'
    for p in ("def main(", "import os\n", "class A:"):
        b = httpx.post(s.url + "/completion", json={"prompt": p, "n_predict": 12,
                                                    "grammar": gbnf}, timeout=REQ_S).json()
        assert b["content"] in WORDS and b["stop_type"] == "eos", b
    r = httpx.post(s.url + "/completion", json={"prompt": "x", "grammar": "root ::= foo"},
                   timeout=REQ_S)
    assert r.status_code == 400 and r.json()["error"]["param"] == "grammar"
    assert "Undefined rule identifier 'foo'" in r.json()["error"]["message"]
    assert httpx.get(s.url + "/health", timeout=REQ_S).status_code == 200


@pytest.mark.slow
@needs_trained
def test_text_logit_bias_and_post_sampling_probs_on_the_model(whole):
    s, _ = whole
    body = {"prompt": "def main(", "n_predict": 24, "return_tokens": True, "ignore_eos": True}
    plain = httpx.post(s.url + "/completion", json=body, timeout=REQ_S).json()["tokens"]
    word = httpx.post(s.url + "/detokenize", json={"tokens": [plain[0]]},
                      timeout=REQ_S).json()["content"]
    b = httpx.post(s.url + "/completion", json={**body, "logit_bias": {word: False}},
                   timeout=REQ_S).json()
    banned = [t for t, v in b["generation_settings"]["logit_bias"] if v is False]
    assert banned and not set(banned) & set(b["tokens"])  # none of the text's tokens
    assert b["tokens"] != plain
    b = httpx.post(s.url + "/completion", json={**body, "n_predict": 6, "n_probs": 3,
                                                "post_sampling_probs": True},
                   timeout=REQ_S).json()
    for tok, p in zip(b["tokens"], b["completion_probabilities"], strict=True):
        assert p["id"] == tok and p["prob"] == 1.0  # greedy: one candidate left
        assert [(t["id"], t["prob"]) for t in p["top_probs"]] == [(tok, 1.0)]


@pytest.mark.slow
@needs_trained
def test_ranged_structured_output_equals_the_whole_models(whole, prompts):
    """On two local shards (the worker builds the grammar from its own vocabulary), two
    slots: every response validates and is the whole model's text (greedy)."""
    _, want = whole
    s = start(*COMMON, "-c", "512", "--parallel", "2", "--plan", "0-1,2-3", *_cache_args())
    try:
        got = _ask_all(s.url, prompts)
    finally:
        assert stop(s.proc) == 0, s.log()
    _valid(got)
    assert [o["text"] for o in got] == [o["text"] for o in want]


def test_the_committed_measurement_reads_back_whole_and_ranged():
    """evidence/serve/structured.json (docs/serve.md cites it) through the frames reader:
    both backends, 16 of 16 constrained responses valid streamed and not, both speeds."""
    from pathlib import Path

    from mtplib.records import load

    folder = Path(__file__).resolve().parent.parent / "evidence" / "serve"
    if not (folder / "structured.json").is_file():
        pytest.skip("evidence/serve/structured.json not written")
    f = load(folder)
    runs = f["serve_structured_runs"].set_index("name")
    assert sorted(runs.index) == ["ranged", "whole"]
    for col in ("summary_valid", "summary_stream_valid", "summary_stream_equal",
                "summary_ended_at_eos"):
        assert (runs[col] == runs["summary_of"]).all() and (runs["summary_of"] == 16).all()
    rows = f["serve_structured"]
    assert len(rows) == 32 and rows["valid"].all() and (rows["constrained_draft_n"] > 0).all()
    assert (rows["unconstrained_decode_tok_s"] > 0).all()
    assert (rows["constrained_n"] == rows["unconstrained_n"]).all()  # the same lengths
