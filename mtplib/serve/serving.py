"""A generating request from a parsed body to its typed results, without HTTP
(`Generations`): parse, queue its jobs (one per choice: several prompts, ``n``), wait for
a start, collect their events into `Outcome`s (or leave them to a stream). The routes only
read the body and shape the result.

Why a callable for the client: the event loop side must stop waiting (and cancel the
generation) when the client has gone; over HTTP that is ``request.is_disconnected``, in a
test any coroutine."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from mtplib.serve.errors import ClientGone
from mtplib.serve.events import Done, End, Event, Failed, RunMetrics, Started, TokenProb, Tokens
from mtplib.serve.intake import jobs_of, parse_request
from mtplib.serve.job import Job
from mtplib.serve.protocol import BaseRequest
from mtplib.serve.worker import GenerationWorker

#: whether the client has gone (`starlette.requests.Request.is_disconnected`)
Gone = Callable[[], Awaitable[bool]]


async def never_gone() -> bool:
    return False


@dataclass
class Running:
    """A request the worker has started: its jobs (one per choice: prompts x n, sharing
    one queue of (index, event)) and each one's `Started` seen so far (the first came
    before any byte of the response)."""

    jobs: list[Job]
    started: dict[int, Started] = field(default_factory=dict)

    @property
    def job(self) -> Job:
        return self.jobs[0]

    @property
    def n_prompt(self) -> int:
        """The first started choice's prompt tokens (a one-choice request's)."""
        return next(iter(self.started.values())).n_prompt

    @property
    def prompt_text(self) -> str | None:
        return next(iter(self.started.values())).prompt_text

    def cancel(self) -> None:
        """Every choice stops at its next step (a no-op for the finished ones)."""
        for job in self.jobs:
            job.cancel.set()


@dataclass(frozen=True)
class Outcome:
    """A finished non-streaming choice: its text and tokens, why it ended, the figures,
    its log-probabilities (None: not asked), and which choice it is with its prompt."""

    text: str
    finish: str
    tokens: list[int]
    metrics: RunMetrics
    end: End
    probs: list[TokenProb] | None
    index: int = 0
    n_prompt: int = 0
    prompt_text: str | None = None


async def next_event(running: Running, gone: Gone = never_gone) -> tuple[int, Event]:
    """The request's next (choice index, event); gives up (cancelling every choice) when
    the client has gone."""
    while True:
        try:
            return await asyncio.wait_for(running.job.events.get(), timeout=1.0)
        except TimeoutError:
            if await gone():
                running.cancel()
                raise ClientGone("left while its request waited or ran; its generation "
                                 "is cancelled") from None


class Generations:
    """The generating endpoints' logic over a worker."""

    def __init__(self, worker: GenerationWorker) -> None:
        self.worker, self.cfg = worker, worker.cfg

    def parse(self, data: dict, kind: type[BaseRequest], endpoint: str) -> BaseRequest:
        return parse_request(data, kind, endpoint, len(self.worker.slot_states()))

    async def start(self, req: BaseRequest, prompt: str | list[int | str],
                    gone: Gone = never_gone, *, native: bool = False) -> Running:
        """`start_all` with one prompt."""
        return await self.start_all(req, [prompt], gone, native=native)

    async def start_all(self, req: BaseRequest, prompts: list[str | list[int | str]],
                        gone: Gone = never_gone, *, native: bool = False) -> Running:
        """Queue the request's choices (``n`` per prompt, all or none) and wait until the
        worker has accepted a prompt: a refusal (4xx or 503) that comes first is raised
        here, before any byte of a response, as llama-server treats its first result."""
        jobs = jobs_of(self.cfg, req, prompts, asyncio.get_running_loop(), native=native)
        self.worker.submit_all(jobs)
        running = Running(jobs)
        try:
            index, ev = await next_event(running, gone)
        except BaseException:
            running.cancel()
            raise
        if isinstance(ev, Failed):
            running.cancel()
            raise ev.error
        assert isinstance(ev, Started), ev
        running.started[index] = ev
        return running

    async def collect(self, running: Running, gone: Gone = never_gone) -> Outcome:
        """A one-choice non-streaming request's outcome."""
        return (await self.collect_all(running, gone))[0]

    async def collect_all(self, running: Running, gone: Gone = never_gone
                          ) -> list[Outcome]:
        """Every choice's text, tokens, log-probabilities and end, by index; the first
        failure of any choice is the request's (the rest are cancelled)."""
        text: dict[int, list[str]] = {j.index: [] for j in running.jobs}
        probs: dict[int, list[TokenProb]] = {j.index: [] for j in running.jobs}
        done: dict[int, Outcome] = {}
        want_lp = running.job.n_logprobs is not None
        try:
            while len(done) < len(running.jobs):
                i, ev = await next_event(running, gone)
                if isinstance(ev, Started):
                    running.started[i] = ev
                elif isinstance(ev, Tokens):
                    text[i].append(ev.text)
                    probs[i] += ev.probs
                elif isinstance(ev, Failed):
                    raise ev.error
                elif isinstance(ev, Done):
                    st = running.started[i]
                    done[i] = Outcome("".join(text[i]), ev.finish, ev.tokens, ev.metrics,
                                      ev.end, probs[i] if want_lp else None, i, st.n_prompt,
                                      st.prompt_text)
        finally:
            running.cancel()  # a no-op when done; stops generations nobody waits for
        return [done[i] for i in sorted(done)]
