"""One request's generation as the worker thread takes it (`Job`): what to generate, and
the queue its events come back on, in the event loop that waits for them.

Why a queue of the loop's: the worker thread must never block on the event loop, and the
loop never on upstream; `Job.post` hands each event over thread-safely. The jobs of one
request (several prompts, ``n`` choices) share one queue: each event comes tagged with its
job's ``index``, the choice it answers."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from dataclasses import dataclass, field
from typing import Any

from mtplib.serve.events import Event


@dataclass
class Job:
    """One request's generation: posted to the worker, events come back on ``events``."""

    prompt: str | list[int | str]
    #: tokens asked for; -1: as many as the context holds (llama-server's n_predict -1)
    n_new: int
    sampler: Any
    ignore_eos: bool
    loop: asyncio.AbstractEventLoop
    stop: list[str] = field(default_factory=list)
    #: post each step's text as it comes (a stream); else once, with the result
    stream: bool = False
    #: top alternatives per token to report (None: no log-probabilities)
    n_logprobs: int | None = None
    #: the request's settings as llama-server reports them (/slots)
    settings: dict = field(default_factory=dict)
    #: also post the prompt's text (llama-server's /completion answers it)
    want_prompt_text: bool = False
    #: the choice this job answers among its request's (prompt-major: prompt i's choice j
    #: is i * n + j, as llama-server numbers them)
    index: int = 0
    #: logit_bias keyed by text: (text, bias), tokenized where the backend is
    bias_texts: tuple[tuple[str, float], ...] = ()
    #: stream events carry the timings so far (llama-server's timings_per_token)
    timings_per_token: bool = False
    #: post `Progress` when the prompt is processed (llama-server's return_progress)
    return_progress: bool = False
    #: (index, event) of every job of the request
    events: asyncio.Queue[tuple[int, Event]] = field(default_factory=asyncio.Queue)
    cancel: threading.Event = field(default_factory=threading.Event)

    def post(self, event: Event) -> None:
        with contextlib.suppress(RuntimeError):  # the loop is gone: nobody listens
            self.loop.call_soon_threadsafe(self.events.put_nowait, (self.index, event))
