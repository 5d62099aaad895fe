"""llama-server's native shapes for `mtplib serve` (tools/server/README.md of the pinned
llama.cpp): /completion's body and stream events, generation_settings, /props, /slots,
/metrics (Prometheus text), and log-probabilities in its and OpenAI's shapes.

Why here: people who reach for this service come from llama-server, and their tools read
these objects; pure functions of the config and counters, no I/O (serve_app serves them).
"""

from __future__ import annotations

from typing import Any

#: the order `Sampler` applies its options in, as llama-server names them
SAMPLERS = ["penalties", "temperature", "top_k", "top_p", "min_p"]


def generation_settings(cfg: Any, sampler: Any, *, n_predict: int, stop: list[str],
                        ignore_eos: bool, stream: bool, n_probs: int) -> dict:
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
        "logit_bias": [[t, b if b != float("-inf") else False]
                       for t, b in sampler.logit_bias],
        "n_probs": n_probs, "min_keep": 0, "grammar": "", "samplers": list(SAMPLERS),
        "speculative": cfg.k > 0, "speculative.n_max": cfg.k, "speculative.n_min": cfg.k,
        "speculative.type": "mtp" if cfg.k else "none", "timings_per_token": False,
        "post_sampling_probs": False, "lora": [],
    }


def slot(cfg: Any, defaults: dict, running: dict | None, id_slot: int = 0) -> dict:
    """Slot ``id_slot`` in /slots' and /props' shape."""
    r = running or {}
    n_new = r.get("n_new", -1)
    return {"id": id_slot, "id_task": r.get("id_task", -1), "n_ctx": cfg.n_ctx,
            "speculative": cfg.k > 0, "is_processing": running is not None,
            "params": r.get("params") or defaults,
            "next_token": {"has_next_token": running is not None, "has_new_line": False,
                           "n_remain": n_new - r.get("n_decoded", 0) if running else -1,
                           "n_decoded": r.get("n_decoded", 0), "stopping_word": ""}}


def props(cfg: Any, defaults: dict, running: dict | None, total_slots: int = 1) -> dict:
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


def metrics_text(stats: Any, queued: int, busy: int, n_slots: int = 1) -> str:
    """GET /metrics: llama-server's llamacpp:* names, and mtplib's own (requests by
    outcome, waits on the shard connections per step kind)."""
    with stats.lock:
        rows = [
            ("prompt_tokens_total", "counter", "Number of prompt tokens processed.",
             stats.prompt_tokens),
            ("prompt_seconds_total", "counter", "Prompt process time", stats.prompt_s),
            ("prompt_tokens_seconds", "gauge", "Average prompt throughput in tokens/s.",
             stats.prompt_tokens / stats.prompt_s if stats.prompt_s else 0.0),
            ("tokens_predicted_total", "counter", "Number of generation tokens processed.",
             stats.predicted),
            ("tokens_predicted_seconds_total", "counter", "Predict process time",
             stats.predicted_s),
            ("predicted_tokens_seconds", "gauge", "Average generation throughput in "
             "tokens/s.", stats.predicted / stats.predicted_s if stats.predicted_s else 0.0),
            ("requests_processing", "gauge", "Number of requests processing.", int(busy)),
            ("requests_deferred", "gauge", "Number of requests deferred (queued).", queued),
            ("n_tokens_max", "counter", "High watermark of the context size observed.",
             stats.n_tokens_max),
            ("n_decode_total", "counter", "Total number of target decode steps.",
             stats.decode_steps),
            ("n_busy_slots_per_decode", "gauge", "Busy slots per decode.",
             getattr(stats, "slots_per_decode", None) or (1.0 if stats.decode_steps else 0.0)),
            ("spec_decode_num_draft_tokens_total", "counter", "Draft tokens generated.",
             stats.drafted),
            ("spec_decode_num_accepted_tokens_total", "counter", "Draft tokens accepted.",
             stats.accepted),
            ("spec_decode_num_drafts_total", "counter", "Speculative verification steps.",
             stats.verify_steps),
        ]
        lines = []
        for name, kind, help_, v in rows:
            lines += [f"# HELP llamacpp:{name} {help_}", f"# TYPE llamacpp:{name} {kind}",
                      f"llamacpp:{name} {v}"]
        lines += ["# HELP mtplib:requests_total Requests answered, by outcome.",
                  "# TYPE mtplib:requests_total counter"]
        lines += [f'mtplib:requests_total{{outcome="{k}"}} {v}'
                  for k, v in stats.requests.items()]
        lines += [f"# HELP mtplib:slots_busy Slots running a generation (of {n_slots}).",
                  "# TYPE mtplib:slots_busy gauge", f"mtplib:slots_busy {int(busy)}",
                  "# HELP mtplib:waits_per_step Waits on the shard connections per step "
                  "(the last ranged request), by step kind.",
                  "# TYPE mtplib:waits_per_step gauge"]
        lines += [f'mtplib:waits_per_step{{kind="{k}"}} {v}'
                  for k, v in sorted(stats.waits_per_step.items())]
    return "\n".join(lines) + "\n"


def _bytes(token: str) -> list[int]:
    return list(token.encode("utf-8", "replace"))


def native_probs(entries: list[dict]) -> list[dict]:
    """/completion's completion_probabilities."""
    return [{"id": e["id"], "token": e["token"], "logprob": e["logprob"],
             "bytes": _bytes(e["token"]),
             "top_logprobs": [{"id": t["id"], "token": t["token"], "logprob": t["logprob"],
                               "bytes": _bytes(t["token"])} for t in e["top"]]}
            for e in entries]


def chat_logprobs(entries: list[dict]) -> dict:
    """OpenAI's chat choice.logprobs."""
    return {"content": [{"token": e["token"], "logprob": e["logprob"],
                         "bytes": _bytes(e["token"]),
                         "top_logprobs": [{"token": t["token"], "logprob": t["logprob"],
                                           "bytes": _bytes(t["token"])} for t in e["top"]]}
                        for e in entries], "refusal": None}


def completion_logprobs(entries: list[dict], offset: int = 0) -> dict:
    """OpenAI's (legacy) completions choice.logprobs; offsets count from ``offset``."""
    offsets, at = [], offset
    for e in entries:
        offsets.append(at)
        at += len(e["token"])
    return {"tokens": [e["token"] for e in entries],
            "token_logprobs": [e["logprob"] for e in entries],
            "top_logprobs": [{t["token"]: t["logprob"] for t in e["top"]} for e in entries],
            "text_offset": offsets}
