"""The honest API (issue 30 item 3) over the fake backend of tests/test_serve_http.py:
every field of OpenAI's completion and chat schemas and of llama-server's /completion is
honoured or refused with a 400 naming it, and llama-server's native endpoints answer in
the shapes of its README (tools/server/README.md of the pinned llama.cpp)."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("fastapi")
from fastapi.testclient import TestClient  # noqa: E402
from test_serve_http import EOG, FakeBackend, _cfg, _events, _expected  # noqa: E402

from mtplib.serve.app import create_app  # noqa: E402
from mtplib.serve.fields import HONOURED  # noqa: E402
from mtplib.serve.worker import GenerationWorker  # noqa: E402

# each field with a value that would do something (not its default), from OpenAI's API
# reference (completions; chat completions) and llama-server's README (/completion)
OPENAI_COMPLETIONS = {
    "model": "any-name", "prompt": "abc", "best_of": 2, "echo": True,
    "frequency_penalty": 0.5, "logit_bias": {"5": 2.0}, "logprobs": 2, "max_tokens": 3,
    "n": 2, "presence_penalty": 0.5, "seed": 3, "stop": ["zz"], "stream": True,
    "stream_options": {"include_usage": True}, "suffix": "tail", "temperature": 0.7,
    "top_p": 0.9, "user": "u1"}
OPENAI_CHAT = {
    "messages": [{"role": "user", "content": "x"}], "model": "any-name",
    "audio": {"voice": "alloy", "format": "wav"}, "frequency_penalty": 0.5,
    "function_call": "auto", "functions": [{"name": "f"}], "logit_bias": {"5": 2.0},
    "logprobs": True, "max_completion_tokens": 3, "max_tokens": 3, "metadata": {"a": "b"},
    "modalities": ["text", "audio"], "n": 2, "parallel_tool_calls": True,
    "prediction": {"type": "content", "content": "x"}, "presence_penalty": 0.5,
    "prompt_cache_key": "k", "reasoning_effort": "low",
    "response_format": {"type": "json_object"}, "safety_identifier": "s", "seed": 3,
    "service_tier": "flex", "stop": "zz", "store": True, "stream": True,
    "stream_options": {"include_usage": True}, "temperature": 0.7, "tool_choice": "auto",
    "tools": [{"type": "function", "function": {"name": "f"}}], "top_logprobs": 2,
    "top_p": 0.9, "user": "u1", "verbosity": "low", "web_search_options": {}}
LLAMA_COMPLETION = {
    "prompt": "abc", "temperature": 0.7, "dynatemp_range": 0.5, "dynatemp_exponent": 2.0,
    "top_k": 5, "top_p": 0.9, "min_p": 0.1, "n_predict": 3, "n_indent": 2, "n_keep": 4,
    "n_cmpl": 2, "n_cache_reuse": 8, "stream": True, "stop": ["zz"], "typical_p": 0.5,
    "repeat_penalty": 1.2, "repeat_last_n": 16, "presence_penalty": 0.5,
    "frequency_penalty": 0.5, "dry_multiplier": 0.8, "dry_base": 2.0,
    "dry_allowed_length": 3, "dry_penalty_last_n": 32, "dry_sequence_breakers": ["\n"],
    "xtc_probability": 0.5, "xtc_threshold": 0.2, "mirostat": 2, "mirostat_tau": 4.0,
    "mirostat_eta": 0.2, "grammar": "root ::= \"a\"", "json_schema": {}, "seed": 3,
    "ignore_eos": True, "logit_bias": [[5, 2.0]], "n_probs": 2, "min_keep": 2,
    "t_max_predict_ms": 100, "id_slot": 1, "cache_prompt": False, "return_tokens": True,
    "samplers": ["top_k"], "timings_per_token": True, "return_progress": True,
    "sse_ping_interval": 5, "post_sampling_probs": True,
    "response_fields": ["content"], "lora": [{"id": 0, "scale": 0.5}]}
#: accepted at any value because they cannot change the output (identifiers, cache hints)
NO_EFFECT = {"user", "safety_identifier", "prompt_cache_key", "cache_prompt", "n_keep"}
#: parameters of a feature that is off unless its switch is set (the switch is refused):
#: alone they change nothing, in llama-server too
OF_AN_OFF_FEATURE = {"dynatemp_exponent", "dry_base", "dry_allowed_length",
                     "dry_penalty_last_n", "dry_sequence_breakers", "xtc_threshold",
                     "mirostat_tau", "mirostat_eta"}
REQUIRED = {"prompt", "messages"}
ENDPOINTS = [("/v1/completions", OPENAI_COMPLETIONS, "completions", {"prompt": "abc"}),
             ("/v1/chat/completions", OPENAI_CHAT, "chat",
              {"messages": [{"role": "user", "content": "x"}]}),
             ("/completion", LLAMA_COMPLETION, "completion", {"prompt": "abc"})]


@pytest.fixture
def served():
    be = FakeBackend()
    worker = GenerationWorker(be, _cfg(bos_id=None))
    with TestClient(create_app(worker, on_shutdown=lambda: worker.stop(5))) as c:
        yield c, be, worker


@pytest.mark.parametrize("path,fields,kind,base", ENDPOINTS, ids=[e[2] for e in ENDPOINTS])
def test_every_schema_field_is_honoured_or_refused_naming_it(served, path, fields, kind,
                                                             base):
    c, _, _ = served
    honoured, refused = set(), set()
    for name, value in fields.items():
        body = {**base, "max_tokens" if kind != "completion" else "n_predict": 2,
                name: value}
        r = c.post(path, json=body)
        if r.status_code == 200:
            honoured.add(name)
            continue
        assert r.status_code == 400, (name, r.text)
        err = r.json()["error"]
        assert err["param"] == name and name in err["message"], (name, err)
        refused.add(name)
    assert honoured | refused == set(fields)
    # what was accepted is exactly what is implemented (or cannot change the output):
    # a field accepted and not implemented would land outside this set and fail here
    allowed = HONOURED[kind] | NO_EFFECT | OF_AN_OFF_FEATURE
    assert honoured - REQUIRED <= allowed, honoured - allowed
    assert "grammar" in honoured or kind != "completion"  # structured output (issue 43)
    assert {"n", "response_format"} & set(fields) <= honoured
    for name in ("tools", "tool_choice", "functions"):
        assert name in refused or name not in fields


def test_inert_fields_pass_at_their_off_values(served):
    c, _, _ = served
    r = c.post("/completion", json={
        "prompt": "abc", "n_predict": 2, "grammar": "", "mirostat": 0, "mirostat_tau": 9.0,
        "typical_p": 1.0, "dry_multiplier": 0, "dry_base": 3.0, "samplers": None,
        "id_slot": -1, "lora": []})
    assert r.status_code == 200, r.text
    r = c.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "x"}], "max_tokens": 2,
        "response_format": {"type": "text"}, "tools": [], "tool_choice": "none", "n": 1})
    assert r.status_code == 200, r.text
    r = c.post("/completion", json={"prompt": "a", "mirostat": 2, "mirostat_tau": 9.0})
    assert r.status_code == 400 and r.json()["error"]["param"] == "mirostat"


def test_unknown_fields_and_message_fields_are_refused(served):
    c, _, _ = served
    r = c.post("/v1/completions", json={"prompt": "a", "max_tokens": 1, "tempreature": 1})
    assert r.status_code == 400 and "tempreature" in r.json()["error"]["message"]
    r = c.post("/v1/completions", json={"prompt": "a", "n_probs": 2})
    assert r.status_code == 400 and "logprobs" in r.json()["error"]["message"]
    r = c.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "x", "name": "bob"}]})
    assert r.status_code == 400 and "name" in r.json()["error"]["message"]
    r = c.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]})
    assert r.status_code == 400


def test_native_completion_shape(served):
    c, be, _ = served
    r = c.post("/completion", json={"prompt": "abc", "n_predict": 4, "return_tokens": True,
                                    "seed": 5, "top_k": 3})
    assert r.status_code == 200, r.text
    b = r.json()
    want = _expected(be, "abc", 4, seed=5)
    assert b["content"] == be.detokenize(want) and b["tokens"] == want
    assert b["stop"] is True and b["truncated"] is False and b["stop_type"] == "limit"
    assert b["tokens_predicted"] == 4 and b["tokens_evaluated"] == 3
    assert b["tokens_cached"] == 0 and b["id_slot"] == 0 and b["model"] == "fake.gguf"
    g = b["generation_settings"]
    assert g["n_ctx"] == 128 and g["seed"] == 5 and g["top_k"] == 3 and g["n_predict"] == 4
    assert b["timings"]["predicted_n"] == 4 and b["prompt"] == be.detokenize(
        be.tokenize("abc"))
    # /completions without /v1 is the same native endpoint
    assert "content" in c.post("/completions", json={"prompt": "abc", "n_predict": 1}).json()
    r = c.post("/completion", json={"prompt": "abc", "n_predict": 4,
                                    "response_fields": ["content", "generation_settings/seed",
                                                        "nope"]})
    assert set(r.json()) == {"content", "generation_settings/seed"}


def test_native_stop_types_and_stream(served):
    c, be, _ = served
    be.eog_at = 2
    b = c.post("/completion", json={"prompt": "a", "n_predict": 6}).json()
    assert b["stop_type"] == "eos" and b["tokens_predicted"] == 2
    be.eog_at = None
    text = be.detokenize(_expected(be, "a", 6))
    b = c.post("/completion", json={"prompt": "a", "n_predict": 6, "stop": [text[3:5]]}).json()
    assert b["stop_type"] == "word" and b["stopping_word"] == text[3:5]
    assert b["content"] == text[:3]
    with c.stream("POST", "/completion", json={"prompt": "a", "n_predict": 3,
                                               "stream": True}) as r:
        ev = _events(r.read().decode())
    assert ev[-1]["stop"] is True and "[DONE]" not in ev
    assert all(e["stop"] is False and "content" in e and "tokens" in e for e in ev[:-1])
    assert "".join(e["content"] for e in ev) == be.detokenize(_expected(be, "a", 3))
    assert ev[-1]["timings"]["predicted_n"] == 3


def test_context_end_truncates_and_a_full_prompt_is_refused_with_counts(served):
    c, _, _ = served
    prompt = "x" * 120
    for field, path in (("n_predict", "/completion"), ("max_tokens", "/v1/completions")):
        for n in (-1, 50):
            b = c.post(path, json={"prompt": prompt, field: n}).json()
            if path == "/completion":
                assert b["tokens_predicted"] == 8 and b["truncated"] is True, b
            else:
                assert b["usage"]["completion_tokens"] == 8 and b["truncated"] is True
                assert b["choices"][0]["finish_reason"] == "length"
    b = c.post("/completion", json={"prompt": prompt, "n_predict": 8}).json()
    assert b["truncated"] is False  # it asked for exactly what fit
    r = c.post("/completion", json={"prompt": "x" * 128, "n_predict": 1})
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["type"] == "exceed_context_size_error"
    assert err["n_prompt_tokens"] == 128 and err["n_ctx"] == 128


def test_seed_minus_one_is_random_and_reported(served):
    c, _, _ = served
    seeds = {c.post("/completion", json={"prompt": "a", "n_predict": 1, "seed": -1,
                                         "temperature": 1.0}).json()
             ["generation_settings"]["seed"] for _ in range(4)}
    assert len(seeds) > 1 and all(0 <= s < 2**32 for s in seeds)


def test_any_model_name_and_fingerprint(served):
    c, _, _ = served
    b = c.post("/v1/completions", json={"prompt": "a", "max_tokens": 1,
                                        "model": "gpt-4o"}).json()
    assert b["model"] == "fake.gguf" and b["system_fingerprint"] == "mtplib"


def test_logprobs_in_each_shape(served):
    c, be, _ = served
    want = _expected(be, "abc", 3)
    b = c.post("/v1/completions", json={"prompt": "abc", "max_tokens": 3,
                                        "logprobs": 2}).json()
    lp = b["choices"][0]["logprobs"]
    assert lp["tokens"] == [be.detokenize([t]) for t in want]
    assert len(lp["top_logprobs"]) == 3 and all(len(x) <= 2 for x in lp["top_logprobs"])
    # the fake's logits put the emitted token on top
    assert [max(x, key=x.get) for x in lp["top_logprobs"]] == lp["tokens"]
    assert all(v < 0 for v in lp["token_logprobs"]) and lp["text_offset"][0] == 0
    b = c.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "x"}], "max_tokens": 2, "logprobs": True,
        "top_logprobs": 1}).json()
    content = b["choices"][0]["logprobs"]["content"]
    assert len(content) == 2 and all(len(e["top_logprobs"]) == 1 for e in content)
    b = c.post("/completion", json={"prompt": "abc", "n_predict": 3, "n_probs": 2}).json()
    probs = b["completion_probabilities"]
    assert [p["id"] for p in probs] == want
    assert all(p["top_logprobs"][0]["id"] == p["id"] for p in probs)
    r = c.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "x"}], "top_logprobs": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "top_logprobs"


def test_tokenize_detokenize_apply_template(served):
    c, be, _ = served
    assert c.post("/tokenize", json={"content": "ab"}).json() == {"tokens": be.tokenize("ab")}
    pieces = c.post("/tokenize", json={"content": "ab", "with_pieces": True}).json()
    assert pieces["tokens"][0] == {"id": be.tokenize("ab")[0],
                                   "piece": be.detokenize(be.tokenize("ab")[:1])}
    assert c.post("/detokenize", json={"tokens": [1, 2]}).json() == {
        "content": be.detokenize([1, 2])}
    assert c.post("/detokenize", json={"tokens": [99]}).status_code == 400
    assert c.post("/tokenize", json={"text": "ab"}).status_code == 400
    p = c.post("/apply-template", json={"messages": [{"role": "user", "content": "hi"}]})
    assert p.json() == {"prompt": "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"}


def test_props_slots_and_metrics(served):
    c, _, _ = served
    p = c.get("/props").json()
    assert p["total_slots"] == 1 and p["default_generation_settings"]["n_ctx"] == 128
    assert p["default_generation_settings"]["params"]["n_predict"] == 8
    assert p["modalities"]["vision"] is False and "build_info" in p
    s = c.get("/slots").json()
    assert len(s) == 1 and s[0]["id"] == 0 and s[0]["is_processing"] is False
    c.post("/v1/completions", json={"prompt": "abc", "max_tokens": 4})
    m = c.get("/metrics")
    assert m.headers["content-type"].startswith("text/plain")
    vals = dict(line.rsplit(" ", 1) for line in m.text.splitlines()
                if line and not line.startswith("#"))
    assert float(vals["llamacpp:tokens_predicted_total"]) == 4
    assert float(vals["llamacpp:prompt_tokens_total"]) == 3
    assert float(vals["llamacpp:spec_decode_num_draft_tokens_total"]) == 6
    assert float(vals["llamacpp:spec_decode_num_accepted_tokens_total"]) == 4
    assert vals['mtplib:requests_total{outcome="ok"}'] == "1"
    assert "llamacpp:requests_deferred" in vals and "mtplib:slots_busy" in vals


def test_a_bad_query_parameter_is_a_400_in_the_services_shape(served):
    c, _, _ = served
    for q in ("abc", "1.5", ""):
        r = c.get(f"/slots?fail_on_no_slot={q}")
        assert r.status_code == 400, r.text
        body = r.json()
        assert "detail" not in body and set(body["error"]) >= {"code", "message", "type",
                                                              "param"}, body
        err = body["error"]
        assert err["param"] == "fail_on_no_slot" and err["code"] == 400
        assert err["type"] == "invalid_request_error" and "fail_on_no_slot" in err["message"]
    assert c.get("/slots?fail_on_no_slot=0").status_code == 200


def test_id_slot_of_the_one_slot_service(served):
    c, _, _ = served
    for v in (0, -1, None):
        r = c.post("/completion", json={"prompt": "abc", "n_predict": 1, "id_slot": v})
        assert r.status_code == 200, (v, r.text)
    for v, says in ((1, "0..0"), (-2, "id_slot"), (True, "id_slot"), ("0", "id_slot")):
        r = c.post("/completion", json={"prompt": "abc", "n_predict": 1, "id_slot": v})
        assert r.status_code == 400, (v, r.text)
        err = r.json()["error"]
        assert err["param"] == "id_slot" and says in err["message"], (v, err)


@pytest.mark.parametrize("field,body", [
    ("logit_bias", b'{"prompt": "x", "logit_bias": {"3": NaN}}'),
    ("logit_bias", b'{"prompt": "x", "logit_bias": [[3, Infinity]]}'),
    ("repeat_penalty", b'{"prompt": "x", "repeat_penalty": Infinity}'),
    ("temperature", b'{"prompt": "x", "temperature": Infinity}'),
    ("top_p", b'{"prompt": "x", "top_p": NaN}'),
    ("seed", b'{"prompt": "x", "seed": -2}'),
])
def test_a_sampler_refusal_names_its_parameter(served, field, body):
    c, _, _ = served
    r = c.post("/v1/completions", content=body, headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == field and field in err["message"], err


def test_every_sampler_error_names_a_field_cleanly():
    """What the HTTP layer cannot send (its own bounds refuse first) still maps cleanly:
    each `Sampler` refusal's param is the field, never a piece of the sentence."""
    import math

    from mtplib.errors import InputError
    from mtplib.runtime.sampling import Sampler
    from mtplib.serve.intake import sampler_param as _sampler_param

    cases = {"temperature": {"temperature": math.nan}, "top_p": {"top_p": 2.0},
             "seed": {"seed": -1}, "top_k": {"top_k": -1}, "min_p": {"min_p": 2.0},
             "repeat_penalty": {"repeat_penalty": 0.0}, "repeat_last_n": {"repeat_last_n": -2},
             "frequency_penalty": {"frequency_penalty": 3.0},
             "presence_penalty": {"presence_penalty": -3.0},
             "logit_bias": {"logit_bias": ((0, math.inf),)}}
    for field, kw in cases.items():
        with pytest.raises(InputError) as e:
            Sampler(**kw)
        assert _sampler_param(e.value) == field, (field, str(e.value))
    bad = {"logit_bias": ((-1, 0.0),)}
    with pytest.raises(InputError) as e:
        Sampler(**bad)
    assert _sampler_param(e.value) == "logit_bias"
    assert _sampler_param(InputError("repetition penalties need the history")) is None


def test_x_api_key_cors_preflight_and_public_health():
    be = FakeBackend()
    worker = GenerationWorker(be, _cfg(api_key="sekrit"))
    with TestClient(create_app(worker, on_shutdown=lambda: worker.stop(5))) as c:
        body = {"prompt": "a", "max_tokens": 1}
        assert c.post("/v1/completions", json=body).status_code == 401
        assert c.post("/v1/completions", json=body,
                      headers={"X-Api-Key": "wrong"}).status_code == 401
        assert c.post("/v1/completions", json=body,
                      headers={"X-Api-Key": "sekrit"}).status_code == 200
        assert c.post("/v1/completions", json=body,
                      headers={"Authorization": "Bearer sekrit"}).status_code == 200
        pre = c.options("/v1/chat/completions", headers={
            "Origin": "http://page.example", "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization,content-type"})
        assert pre.status_code == 200 and pre.text == ""  # llama-server's 200, empty body
        assert pre.headers["access-control-allow-origin"] == "*"
        assert "Authorization" in pre.headers["access-control-allow-headers"]
        assert "POST" in pre.headers["access-control-allow-methods"]
        r = c.post("/v1/completions", json=body, headers={
            "Origin": "http://page.example", "X-Api-Key": "sekrit"})
        assert r.headers["access-control-allow-origin"] == "*"
        assert c.get("/health").status_code == 200 and c.get("/v1/health").status_code == 200


def test_mixed_prompt_of_ids_and_text(served):
    c, be, _ = served
    b = c.post("/completion", json={"prompt": [5, "ab", 7], "n_predict": 1}).json()
    assert b["tokens_evaluated"] == 2 + len(be.tokenize("ab"))
    assert json.dumps(b)
    assert EOG not in b["tokens"]
