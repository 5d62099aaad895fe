"""llama-server's native shapes (tools/server/README.md of the pinned llama.cpp): the
per-response ``timings``, generation_settings, /completion's body, /props, /slots, /metrics
(Prometheus text) and its log-probabilities.

Why here: people who reach for this service come from llama-server, and their tools read
these objects; pure functions of the config, the typed results and the counters, no I/O
(the routes serve them)."""

from __future__ import annotations

import math
from typing import Any

from mtplib.serve.config import ServeConfig
from mtplib.serve.events import End, RunMetrics, TokenProb
from mtplib.serve.stats import SlotState, SlotTable

#: the order `Sampler` applies its options in, as llama-server names them
SAMPLERS = ["penalties", "temperature", "top_k", "top_p", "min_p"]


def timings(m: RunMetrics, n_prompt: int, n_out: int) -> dict:
    """llama-server's per-response `timings` from the generation's figures (the same
    definitions: predicted_per_second = (n - 1) / the time after the first token)."""
    prompt_ms = 1000.0 * (m.ttft_s or 0.0)
    pred_ms = 1000.0 * (m.decode_s or 0.0)
    steps = max(n_out - 1, 0)
    t = {"cache_n": 0,
         "prompt_n": n_prompt, "prompt_ms": prompt_ms,
         "prompt_per_token_ms": prompt_ms / n_prompt if n_prompt else 0.0,
         "prompt_per_second": 1000.0 * n_prompt / prompt_ms if prompt_ms > 0 else 0.0,
         "predicted_n": n_out, "predicted_ms": pred_ms,
         "predicted_per_token_ms": pred_ms / steps if steps else 0.0,
         "predicted_per_second": 1000.0 * steps / pred_ms if pred_ms > 0 else 0.0}
    if m.drafted:
        t["draft_n"] = m.drafted
        t["draft_n_accepted"] = m.accepted
    return t


def generation_settings(cfg: ServeConfig, sampler: Any, *, n_predict: int, stop: list[str],
                        ignore_eos: bool, stream: bool, n_probs: int,
                        timings_per_token: bool = False,
                        post_sampling_probs: bool = False) -> dict:
    """A request's settings as llama-server reports them; the options mtplib does not
    implement are reported at their off values (a request setting them was refused)."""
    return {
        "n_ctx": cfg.n_ctx, "model": cfg.model_id, "n_predict": n_predict,
        "max_tokens": n_predict, "seed": sampler.seed, "temperature": sampler.temperature,
        "dynatemp_range": 0.0, "dynatemp_exponent": 1.0, "top_k": sampler.top_k,
        "top_p": sampler.top_p, "min_p": sampler.min_p, "xtc_probability": 0.0,
        "xtc_threshold": 0.1, "typical_p": 1.0, "repeat_last_n": sampler.repeat_last_n,
        "repeat_penalty": sampler.repeat_penalty,
        "presence_penalty": sampler.presence_penalty,
        "frequency_penalty": sampler.frequency_penalty, "dry_multiplier": 0.0,
        "mirostat": 0, "stop": list(stop), "n_keep": 0, "n_discard": 0,
        "ignore_eos": ignore_eos, "stream": stream,
        "logit_bias": bias_setting(sampler.logit_bias),
        "n_probs": n_probs, "min_keep": 0,
        "grammar": "" if getattr(sampler, "grammar", None) is None else sampler.grammar.gbnf,
        "samplers": list(SAMPLERS),
        "speculative": cfg.k > 0, "speculative.n_max": cfg.k, "speculative.n_min": cfg.k,
        "speculative.type": "mtp" if cfg.k else "none",
        "timings_per_token": timings_per_token,
        "post_sampling_probs": post_sampling_probs, "lora": [],
    }


def bias_setting(logit_bias: Any) -> list:
    """generation_settings' logit_bias: [[id, bias | false], ...] (false: banned)."""
    return [[t, b if b != float("-inf") else False] for t, b in logit_bias]


def slot(cfg: ServeConfig, defaults: dict, running: SlotState | None, id_slot: int = 0
         ) -> dict:
    """Slot ``id_slot`` in /slots' and /props' shape."""
    n_decoded = running.n_decoded if running else 0
    return {"id": id_slot, "id_task": running.id_task if running else -1, "n_ctx": cfg.n_ctx,
            "speculative": cfg.k > 0, "is_processing": running is not None,
            "params": (running.params if running else None) or defaults,
            "next_token": {"has_next_token": running is not None, "has_new_line": False,
                           "n_remain": running.n_new - n_decoded if running else -1,
                           "n_decoded": n_decoded, "stopping_word": ""}}


def props(cfg: ServeConfig, defaults: dict, running: SlotState | None, total_slots: int = 1
          ) -> dict:
    """GET /props."""
    return {"default_generation_settings": {**slot(cfg, defaults, None), "prompt": ""},
            "total_slots": total_slots, "model_path": cfg.model_path or cfg.model_id,
            "model_alias": cfg.model_id,
            "chat_template": cfg.chat_template if cfg.chat_template is not None
            else "chatml (the model has no template)",
            "chat_template_caps": {}, "modalities": {"vision": False, "audio": False},
            "bos_token": cfg.bos_token, "eos_token": cfg.eos_token,
            "build_info": cfg.fingerprint, "is_sleeping": False,
            "is_processing": running is not None}


def metrics_text(stats: SlotTable, queued: int, busy: int, n_slots: int = 1) -> str:
    """GET /metrics: llama-server's llamacpp:* names, and mtplib's own (requests by
    outcome, waits on the shard connections per step kind)."""
    with stats.lock:
        s = stats.totals
        rows = [
            ("prompt_tokens_total", "counter", "Number of prompt tokens processed.",
             s.prompt_tokens),
            ("prompt_tokens_cached_total", "counter", "Number of prompt tokens reused from "
             "the cache (mtplib keeps no prompt cache).", 0),
            ("prompt_seconds_total", "counter", "Prompt process time", s.prompt_s),
            ("prompt_tokens_seconds", "gauge", "Average prompt throughput in tokens/s.",
             s.prompt_tokens / s.prompt_s if s.prompt_s else 0.0),
            ("tokens_predicted_total", "counter", "Number of generation tokens processed.",
             s.predicted),
            ("tokens_predicted_seconds_total", "counter", "Predict process time",
             s.predicted_s),
            ("predicted_tokens_seconds", "gauge", "Average generation throughput in "
             "tokens/s.", s.predicted / s.predicted_s if s.predicted_s else 0.0),
            ("requests_processing", "gauge", "Number of requests processing.", int(busy)),
            ("requests_deferred", "gauge", "Number of requests deferred (queued).", queued),
            ("n_tokens_max", "counter", "High watermark of the context size observed.",
             s.n_tokens_max),
            ("n_decode_total", "counter", "Total number of target decode steps.",
             s.decode_steps),
            ("n_busy_slots_per_decode", "gauge", "Busy slots per decode.",
             s.slots_per_decode),
            ("spec_decode_num_draft_tokens_total", "counter", "Draft tokens generated.",
             s.drafted),
            ("spec_decode_num_accepted_tokens_total", "counter", "Draft tokens accepted.",
             s.accepted),
            ("spec_decode_num_drafts_total", "counter", "Speculative verification steps.",
             s.verify_steps),
        ]
        lines = []
        for name, kind, help_, v in rows:
            lines += [f"# HELP llamacpp:{name} {help_}", f"# TYPE llamacpp:{name} {kind}",
                      f"llamacpp:{name} {v}"]
        lines += ["# HELP mtplib:requests_total Requests answered, by outcome.",
                  "# TYPE mtplib:requests_total counter"]
        lines += [f'mtplib:requests_total{{outcome="{k}"}} {v}'
                  for k, v in s.requests.items()]
        lines += [f"# HELP mtplib:slots_busy Slots running a generation (of {n_slots}).",
                  "# TYPE mtplib:slots_busy gauge", f"mtplib:slots_busy {int(busy)}",
                  "# HELP mtplib:waits_per_step Waits on the shard connections per step "
                  "(the last ranged request), by step kind.",
                  "# TYPE mtplib:waits_per_step gauge"]
        lines += [f'mtplib:waits_per_step{{kind="{k}"}} {v}'
                  for k, v in sorted(s.waits_per_step.items())]
    return "\n".join(lines) + "\n"


def token_bytes(token: str) -> list[int]:
    return list(token.encode("utf-8", "replace"))


def native_probs(entries: list[TokenProb], post_sampling: bool = False) -> list[dict]:
    """/completion's completion_probabilities; ``post_sampling`` (post_sampling_probs):
    probabilities after the sampling chain, as ``prob`` and ``top_probs`` (the tokens the
    chain left: llama-server drops those at probability 0)."""
    if post_sampling:
        return [{"id": e.id, "token": e.token, "bytes": token_bytes(e.token),
                 "prob": math.exp(e.logprob),
                 "top_probs": [{"id": t.id, "token": t.token, "bytes": token_bytes(t.token),
                                "prob": math.exp(t.logprob)}
                               for t in e.top if t.logprob > -math.inf]}
                for e in entries]
    return [{"id": e.id, "token": e.token, "logprob": e.logprob,
             "bytes": token_bytes(e.token),
             "top_logprobs": [{"id": t.id, "token": t.token, "logprob": t.logprob,
                               "bytes": token_bytes(t.token)} for t in e.top]}
            for e in entries]


def native_body(cfg: ServeConfig, settings: dict, return_tokens: bool, text: str,
                out: list[int], metrics: RunMetrics, end: End, n_prompt: int,
                prompt_text: str | None, probs: list[TokenProb] | None,
                index: int = 0) -> dict:
    """/completion's response object (and a stream's last event); ``probs`` None: no
    completion_probabilities; ``index``: the choice it answers (several prompts, n)."""
    body = {"index": index, "content": text, "tokens": out if return_tokens else [],
            "id_slot": 0, "stop": True, "model": cfg.model_id,
            "tokens_predicted": len(out), "tokens_evaluated": n_prompt,
            "generation_settings": settings, "prompt": prompt_text,
            "has_new_line": "\n" in text, "truncated": end.truncated,
            "stop_type": end.stop_type, "stopping_word": end.stopping_word,
            "tokens_cached": 0, "timings": timings(metrics, n_prompt, len(out))}
    if probs is not None:
        body["completion_probabilities"] = native_probs(
            probs, bool(settings.get("post_sampling_probs")))
    return body


def progress(n_prompt: int, time_ms: float, done: bool) -> dict:
    """llama-server's prompt_progress (no prompt cache: ``cache`` is 0)."""
    return {"total": n_prompt, "cache": 0, "processed": n_prompt if done else 0,
            "time_ms": int(time_ms)}


def pick_fields(body: dict, fields: list[str] | None) -> dict:
    """llama-server's response_fields: only those (a missing one is left out); "a/b"
    moves b out of a to the top level, named "a/b"."""
    if fields is None:
        return body
    out = {}
    for f in fields:
        v: Any = body
        for part in f.split("/"):
            if not isinstance(v, dict) or part not in v:
                break
            v = v[part]
        else:
            out[f] = v
    return out
