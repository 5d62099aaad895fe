"""Every request field `mtplib serve` knows, and what it does with each: honoured, or
accepted only at a value where it does nothing (any other value is a 400 naming it).

Why a table: a client moving from OpenAI or llama-server sends fields mtplib may not
implement; a field dropped silently gives wrong output with no sign (``top_k=1`` sampled
anyway), so each one is listed here with the reason, and a field in no list is refused
as unknown. The lists are OpenAI's completion and chat schemas and llama-server's
``/completion`` options (tools/server/README.md of the pinned llama.cpp); llama-server
takes its ``/completion`` options on the OpenAI endpoints too, and so does mtplib.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

#: fields mtplib implements, per endpoint kind (validated by the request models)
HONOURED_COMMON = frozenset({
    "model", "max_tokens", "n_predict", "temperature", "top_p", "top_k", "min_p", "seed",
    "stream", "stream_options", "stop", "ignore_eos", "return_tokens", "frequency_penalty",
    "presence_penalty", "repeat_penalty", "repeat_last_n", "logit_bias",
    # structured output (llama-server takes each on every endpoint)
    "grammar", "json_schema", "response_format",
    # choices per prompt; a stream's timings and prompt progress
    "n", "n_cmpl", "timings_per_token", "return_progress"})
HONOURED = {
    # llama-server's native /completion
    "completion": HONOURED_COMMON | {"prompt", "n_probs", "response_fields",
                                     "post_sampling_probs"},
    "completions": HONOURED_COMMON | {"prompt", "logprobs"},  # OpenAI's /v1/completions
    "chat": HONOURED_COMMON | {"messages", "max_completion_tokens", "logprobs",
                               "top_logprobs"},
}


@dataclass(frozen=True)
class Inert:
    """A field accepted only where it changes nothing: ``ok(value, body)``; else 400."""

    ok: Callable[[Any, dict], bool]
    why: str


def _is(*values: Any) -> Callable[[Any, dict], bool]:
    # bool is an int in Python: True must not pass for 1, nor False for 0
    return lambda v, _b: any(v == x and type(v) is type(x) or v is x for x in values)


def _off_while(switch: str, off: Any) -> Callable[[Any, dict], bool]:
    """Inert while another field keeps its feature off (absent or at ``off``)."""
    return lambda _v, b: b.get(switch, off) in (off, None)


def _any_str_or_none(v: Any, _b: dict) -> bool:
    return v is None or isinstance(v, str)


def _any_bool(v: Any, _b: dict) -> bool:
    return isinstance(v, bool)


def _any_int(v: Any, _b: dict) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


NO_TOOLS = "tools / function calling are not implemented"
NO_AUDIO = "mtplib serves text only"
NOT_BUILT = "is not implemented in mtplib"

INERT: dict[str, Inert] = {
    # -- OpenAI, both endpoints
    "user": Inert(_any_str_or_none, "an end-user identifier: accepted, changes nothing"),
    "safety_identifier": Inert(_any_str_or_none, "an identifier: accepted, changes nothing"),
    "prompt_cache_key": Inert(_any_str_or_none,
                              "a cache-routing key: accepted; mtplib keeps no prompt cache"),
    "service_tier": Inert(_is(None, "auto", "default"), "one tier: 'auto' or 'default'"),
    "store": Inert(_is(None, False), "stored completions are not implemented"),
    "metadata": Inert(lambda v, _b: v in (None, {}), "metadata is for stored completions, "
                      "which are not implemented"),
    # -- OpenAI completions
    "echo": Inert(_is(None, False), "echo is not supported"),
    "best_of": Inert(_is(None, 1), "best_of must be 1"),
    "suffix": Inert(_is(None, ""), "suffix (insertion) is not supported"),
    # -- OpenAI chat
    "tools": Inert(lambda v, _b: v in (None, []), NO_TOOLS),
    "tool_choice": Inert(_is(None, "none"), NO_TOOLS),
    "parallel_tool_calls": Inert(_is(None), NO_TOOLS),
    "functions": Inert(lambda v, _b: v in (None, []), NO_TOOLS),
    "function_call": Inert(_is(None, "none"), NO_TOOLS),
    "parse_tool_calls": Inert(_is(None, False), NO_TOOLS),
    "audio": Inert(_is(None), NO_AUDIO),
    "modalities": Inert(lambda v, _b: v in (None, ["text"]), NO_AUDIO),
    "prediction": Inert(_is(None), f"predicted outputs {NOT_BUILT}"),
    "reasoning_effort": Inert(_is(None), "the served model has no reasoning control"),
    "reasoning_format": Inert(_is(None, "none"), "no reasoning parsing: only 'none'"),
    "reasoning_control": Inert(_is(None, False), "no reasoning control"),
    "verbosity": Inert(_is(None), f"verbosity {NOT_BUILT}"),
    "web_search_options": Inert(_is(None), f"web search {NOT_BUILT}"),
    "chat_template_kwargs": Inert(lambda v, _b: v in (None, {}),
                                  f"chat_template_kwargs {NOT_BUILT}"),
    # -- llama-server's /completion options
    "cache_prompt": Inert(_any_bool, "accepted: mtplib keeps no prompt cache (every prompt "
                          "is evaluated; tokens_cached is 0), the output is the same"),
    "n_keep": Inert(lambda v, b: _any_int(v, b) and v >= -1,
                    "accepted: mtplib never shifts the context (a generation stops at its "
                    "end, truncated), so no token is discarded"),
    # any slot: each runs the same code on the same weights (no per-slot prompt cache), so
    # the output is the same in any; `slot_refusal` bounds it by the service's slots
    "id_slot": Inert(lambda v, b: v is None or _any_int(v, b) and v >= -1,
                     "a slot id: -1 (any) or 0..N-1 under --parallel N"),
    "n_indent": Inert(_is(None, 0), f"n_indent {NOT_BUILT}"),
    "n_cache_reuse": Inert(_is(None, 0), "no prompt cache: n_cache_reuse must be 0"),
    "typical_p": Inert(_is(None, 1, 1.0), f"typical sampling {NOT_BUILT} (only 1.0)"),
    "dynatemp_range": Inert(_is(None, 0, 0.0), f"dynamic temperature {NOT_BUILT} (only 0)"),
    "dynatemp_exponent": Inert(_off_while("dynatemp_range", 0),
                               "only while dynatemp_range is 0 (dynamic temperature off)"),
    "dry_multiplier": Inert(_is(None, 0, 0.0), f"DRY sampling {NOT_BUILT} (only 0)"),
    "dry_base": Inert(_off_while("dry_multiplier", 0), "only while dry_multiplier is 0"),
    "dry_allowed_length": Inert(_off_while("dry_multiplier", 0),
                                "only while dry_multiplier is 0"),
    "dry_penalty_last_n": Inert(_off_while("dry_multiplier", 0),
                                "only while dry_multiplier is 0"),
    "dry_sequence_breakers": Inert(_off_while("dry_multiplier", 0),
                                   "only while dry_multiplier is 0"),
    "xtc_probability": Inert(_is(None, 0, 0.0), f"XTC sampling {NOT_BUILT} (only 0)"),
    "xtc_threshold": Inert(_off_while("xtc_probability", 0),
                           "only while xtc_probability is 0"),
    "mirostat": Inert(_is(None, 0), f"mirostat {NOT_BUILT} (only 0)"),
    "mirostat_tau": Inert(_off_while("mirostat", 0), "only while mirostat is 0"),
    "mirostat_eta": Inert(_off_while("mirostat", 0), "only while mirostat is 0"),
    "min_keep": Inert(_is(None, 0), f"min_keep {NOT_BUILT} (only 0)"),
    "t_max_predict_ms": Inert(_is(None, 0), f"t_max_predict_ms {NOT_BUILT} (only 0)"),
    "samplers": Inert(_is(None), "the sampler order is fixed: penalties, temperature, "
                      "top_k, top_p, min_p"),
    "sse_ping_interval": Inert(_is(None, -1), "mtplib sends no SSE pings: only -1"),
    "post_sampling_probs": Inert(_is(None, False), "post_sampling_probs is /completion's "
                                 "(with n_probs); the OpenAI endpoints report the model's "
                                 "log-probabilities"),
    "lora": Inert(lambda v, _b: v in (None, []), f"LoRA adapters {NOT_BUILT}"),
    "multimodal_data": Inert(lambda v, _b: v in (None, []), NO_AUDIO),
    "image_data": Inert(lambda v, _b: v in (None, []), NO_AUDIO),
}

#: honoured by another endpoint: where to send it instead
ELSEWHERE = {
    "n_probs": "the OpenAI endpoints take logprobs (and top_logprobs); n_probs is "
               "/completion's",
    "response_fields": "/completion's (llama-server's native endpoint)",
    "logprobs": "/completion takes n_probs",
    "top_logprobs": "/v1/chat/completions' (with logprobs: true)",
    "prompt": "/v1/chat/completions takes messages",
    "messages": "a prompt endpoint takes prompt (/v1/chat/completions takes messages)",
    "max_completion_tokens": "/v1/chat/completions' (here: max_tokens or n_predict)",
}

#: every field name some endpoint knows (the full audit list of the tests)
KNOWN = frozenset().union(*HONOURED.values()) | frozenset(INERT)


def slot_refusal(body: dict, n_slots: int) -> tuple[str, str] | None:
    """("id_slot", why) when the body asks for a slot past the service's (0..n_slots-1,
    llama-server's ids); the request then runs in whichever slot is free (docs/serve.md)."""
    v = body.get("id_slot")
    if _any_int(v, body) and v >= n_slots:
        return "id_slot", (f"id_slot={v} is refused: this service has {n_slots} slot"
                           f"{'s' if n_slots > 1 else ''}, ids 0..{n_slots - 1} (-1: any)")
    return None


def refusal(body: dict, kind: str) -> tuple[str, str] | None:
    """(field, why) for the first field of ``body`` that ``kind``'s endpoint neither
    honours nor accepts at that value; the inert fields are removed from ``body``."""
    for name in list(body):
        if name in HONOURED[kind]:
            continue
        rule = INERT.get(name)
        if rule is None:
            if name in ELSEWHERE:
                return name, f"{name} is not taken by this endpoint: {ELSEWHERE[name]}"
            return name, (f"unknown field {name!r}: not in OpenAI's or llama-server's "
                          "schema for this endpoint; mtplib refuses fields it does not "
                          "implement rather than ignore them")
        if not rule.ok(body[name], body):
            return name, f"{name}={body[name]!r} is refused: {rule.why}"
    for name in [n for n in body if n in INERT and n not in HONOURED[kind]]:
        del body[name]
    return None
