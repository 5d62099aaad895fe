"""What a request body becomes before it reaches the worker: the validated request
(`parse_request`), its sampler (`sampler_of`), its settings as llama-server reports them,
and the `Job` (`job_of`). Plain functions of a dict and the config: no HTTP.

Why each refusal names its field: a client moving from OpenAI or llama-server must see
which of its fields this service does not take, never a silently different output."""

from __future__ import annotations

import asyncio
import math
import re
import secrets
from dataclasses import fields

from mtplib.errors import InputError
from mtplib.runtime.sampling import Sampler
from mtplib.runtime.structured import GrammarSpec
from mtplib.serve.config import ServeConfig
from mtplib.serve.errors import ApiError
from mtplib.serve.fields import refusal, slot_refusal
from mtplib.serve.job import Job
from mtplib.serve.native import generation_settings
from mtplib.serve.protocol import BaseRequest, validate

#: the request fields a sampler takes as they are, when given
SAMPLER_FIELDS = ("top_k", "min_p", "repeat_penalty", "repeat_last_n", "frequency_penalty",
                  "presence_penalty")


def parse_request(data: dict, kind: type[BaseRequest], endpoint: str, n_slots: int
                  ) -> BaseRequest:
    """``data`` (a body) as ``kind``, for ``endpoint`` ("completion", "completions",
    "chat") of a service with ``n_slots`` slots; else the 400 naming the field. Any model
    name is accepted, as llama-server does with one model: the response names the served
    one."""
    bad = (slot_refusal(data, n_slots)  # id_slot past --parallel
           or refusal(data, endpoint))  # unknown fields, inert ones at a live value
    if bad:
        raise ApiError(400, bad[1], param=bad[0])
    req = validate(kind, data)
    bad = req.unsupported()
    if bad:
        raise ApiError(400, bad[1], param=bad[0])
    return req


def sampler_param(e: InputError) -> str | None:
    """The request field a `Sampler` refusal is about: its message starts with the field's
    name ("top_p must ...", "logit_bias: bias of ..."); None when it names no field, so
    ``param`` is never a piece of the sentence ("logit_bias:")."""
    m = re.match(r"[a-z_]+", str(e))
    name = m.group(0) if m else None
    return name if name in {f.name for f in fields(Sampler)} else None


def sampler_of(cfg: ServeConfig, req: BaseRequest, *, choice: int = 0,
               grammar: GrammarSpec | None = None) -> Sampler:
    """The request's sampler: its fields over the service's defaults; seed -1 (llama-
    server's) draws a random seed, reported in generation_settings. Choice j > 0 of a
    prompt (``n``) draws with seed + j, as llama-server seeds its child tasks (a random
    seed: another random one)."""
    s = cfg.default_seed if req.seed is None else req.seed
    if s == -1:
        s = secrets.randbits(32)
    else:
        s += choice
    opts = {"temperature": cfg.default_temperature if req.temperature is None
            else req.temperature,
            "top_p": cfg.default_top_p if req.top_p is None else req.top_p, "seed": s}
    for name in SAMPLER_FIELDS:
        if getattr(req, name) is not None:
            opts[name] = getattr(req, name)
    if not math.isfinite(opts["temperature"]):
        raise ApiError(400, f"temperature must be finite, got {opts['temperature']}",
                       param="temperature")
    try:
        return Sampler(**opts, logit_bias=req.bias(cfg.n_vocab), grammar=grammar,
                       post_sampling_probs=post_sampling(req))
    except InputError as e:
        raise ApiError(400, str(e), param=sampler_param(e)) from None


def settings_of(cfg: ServeConfig, req: BaseRequest, sampler: Sampler) -> dict:
    return generation_settings(cfg, sampler, n_predict=req.n_new(cfg.default_n),
                               stop=req.stop_list(), ignore_eos=req.ignore_eos,
                               stream=req.stream, n_probs=req.n_logprobs() or 0,
                               timings_per_token=req.timings_per_token,
                               post_sampling_probs=post_sampling(req))


def post_sampling(req: BaseRequest) -> bool:
    return bool(getattr(req, "post_sampling_probs", False))


def default_settings(cfg: ServeConfig) -> dict:
    """The settings of a request that gives none (/props, an idle slot)."""
    return generation_settings(
        cfg, Sampler(cfg.default_temperature, cfg.default_top_p, cfg.default_seed),
        n_predict=cfg.default_n, stop=[], ignore_eos=False, stream=False, n_probs=0)


def jobs_of(cfg: ServeConfig, req: BaseRequest, prompts: list[str | list[int | str]],
            loop: asyncio.AbstractEventLoop, *, native: bool = False) -> list[Job]:
    """The worker's jobs for ``req``: ``n`` per prompt, numbered prompt-major, sharing one
    event queue; ``native``: /completion, which answers the prompt's text too. At most
    the queue's length per request (they are queued together: `JobQueue.submit_all`)."""
    n = req.n_choices()
    if len(prompts) * n > cfg.queue_max:
        raise ApiError(400, f"{len(prompts)} prompt(s) x n={n} is {len(prompts) * n} "
                       f"completions; this service takes at most {cfg.queue_max} per "
                       "request (--queue)", param="n" if n > 1 else "prompt")
    grammar = req.constraint()  # parsed once, for every choice
    events: asyncio.Queue = asyncio.Queue()
    jobs = []
    for i, prompt in enumerate(prompts):
        for j in range(n):
            sampler = sampler_of(cfg, req, choice=j, grammar=grammar)
            jobs.append(Job(
                prompt=prompt, n_new=req.n_new(cfg.default_n), sampler=sampler,
                ignore_eos=req.ignore_eos, loop=loop, stop=req.stop_list(),
                stream=req.stream, n_logprobs=req.n_logprobs(),
                settings=settings_of(cfg, req, sampler), want_prompt_text=native,
                index=i * n + j, bias_texts=req.bias_texts(),
                timings_per_token=req.timings_per_token,
                return_progress=req.return_progress and req.stream, events=events))
    return jobs
