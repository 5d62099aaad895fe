"""One request's generation, start to end, in the worker's thread (`RequestRunner`):
tokens, context budget, text-keyed logit_bias, end of generation (a grammar's too), stop
strings, streaming, log-probabilities, the prompt's progress and figures (at the end, or
so far with timings_per_token), posted to the request as typed events.

Why one runner for every scheduler: a one-slot service streams from the backend itself, a
batched one from its slot (`mtplib.serve.batch.SlotStream`); the request's rules are the
same code in both, and a failure is answered to the request, never fatal to the thread."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import Any

from mtplib.errors import MtplibError
from mtplib.serve.config import ServeConfig
from mtplib.serve.errors import ApiError, shutting_down
from mtplib.serve.events import (
    Alternative,
    Done,
    End,
    Failed,
    Progress,
    RunMetrics,
    Started,
    TokenProb,
    Tokens,
)
from mtplib.serve.faults import BackendHealth, answer
from mtplib.serve.job import Job
from mtplib.serve.native import bias_setting
from mtplib.serve.stats import SlotTable
from mtplib.serve.stops import StopText
from mtplib.serve.tokens import budget, prompt_tokens, strip_bos

#: a stream sends what the steps emitted at most this often (the first step at once):
#: each event wakes the event loop, which then competes with the generation for the GIL
STREAM_EVERY_S = 0.025


class RequestRunner:
    """Runs a `Job` on a backend (or a slot of one) and posts its events; ``cutting`` set
    (the shutdown's grace is over) ends the running generation at its next step."""

    def __init__(self, cfg: ServeConfig, stats: SlotTable, health: BackendHealth,
                 cutting: threading.Event, log: Callable[[str], None] = lambda s: None
                 ) -> None:
        self.cfg, self.stats, self.health, self.cutting, self.log = (
            cfg, stats, health, cutting, log)

    def serve(self, job: Job, backend: Any, slot: int = 0) -> None:
        """Run one request in ``slot``; any failure is answered to it."""
        try:
            self.run(job, backend, slot)
        except BaseException as e:  # noqa: BLE001 - reported to the request, never fatal
            if not isinstance(e, MtplibError | ApiError):
                self.log(f"generation failed: {type(e).__name__}: {e}")
            self.stats.failed(slot)
            job.post(Failed(answer(self.health, e)))  # a shard fault: a 503 naming them

    def run(self, job: Job, be: Any, slot: int = 0) -> None:
        """One request, start to end, streaming from ``be``."""
        toks = prompt_tokens(be, self.cfg, job.prompt)
        n_new, at_end = budget(self.cfg, toks, job.n_new)
        sampler = with_text_bias(job, be, self.cfg)
        job.post(Started(len(toks), be.detokenize(toks) if job.want_prompt_text else None))
        self.stats.begin(slot, job.settings, len(toks), n_new)
        finish, out, pieces, pend = "length", [], [], []
        probs: list[TokenProb] = []
        stop_type = "limit"
        text = StopText(job.stop)
        if job.n_logprobs is not None:  # each step's tokens then come with their records
            sampler = replace(sampler, logprobs=job.n_logprobs)
        t0 = time.perf_counter()
        t_post = 0.0
        t_first = t_last = None
        with be.stream(toks, n_new, sampler=sampler) as gen:
            steps = iter(gen)
            for step in steps:
                chunk = list(step)
                if job.cancel.is_set() or self.cutting.is_set():
                    finish = "abort"
                    break
                if not job.ignore_eos:
                    cut = next((i for i, t in enumerate(chunk) if t in self.cfg.eog), None)
                    if cut is not None:
                        chunk, finish, stop_type = chunk[:cut], "stop", "eos"
                t_last = time.perf_counter()
                if t_first is None:
                    t_first = t_last
                    if job.return_progress:  # the prefill is done (its first token)
                        job.post(Progress(len(toks), 1000.0 * (t_first - t0)))
                if job.n_logprobs is not None:
                    probs += token_probs(chunk, getattr(step, "logprobs", None), be)
                out += chunk
                self.stats.step(slot, len(out))
                piece, hit = text.feed(be.detokenize(chunk) if chunk else "")
                pend += chunk
                pieces.append(piece)
                if job.stream and t_last - t_post >= STREAM_EVERY_S and (pend or piece):
                    job.post(Tokens(pend, "".join(pieces), probs,
                                    *self._so_far(job, t0, t_first, t_last, len(out))))
                    pend, pieces, t_post, probs = [], [], t_last, []
                if hit:
                    finish, stop_type = "stop", "word"
                if finish == "stop":
                    break
            metrics = None
            # exhausted, or ended by the runtime at the grammar's EOG (nothing follows it):
            # the library's own metrics are the response's figures
            if finish == "length" or stop_type == "eos" and sampler.grammar is not None \
                    and ended(steps):
                with contextlib.suppress(MtplibError):
                    metrics = RunMetrics.of(gen.metrics)
        if finish == "abort":
            if not job.cancel.is_set():  # cut by the shutdown: its client still waits
                job.post(Failed(shutting_down("the generation was cut after "
                                              "--shutdown-timeout")))
            return
        pieces.append(text.flush())
        rest = "".join(pieces)
        if pend or rest:  # a stream's last text, or all of a non-streaming request's
            job.post(Tokens(pend, rest, probs,
                            *self._so_far(job, t0, t_first, t_last, len(out))))
        if metrics is None:  # stopped early: the timings from this side's clock
            metrics = RunMetrics.clock((t_first - t0) if t_first else None,
                                       (t_last - t_first) if t_first and t_last else 0.0)
        for v in metrics.wire_violations:  # only with --allow-cache-crossing
            self.log(f"contract violation in this request: {v}")
        end = End(truncated=at_end and finish == "length" and len(out) == n_new,
                  stop_type=stop_type, stopping_word=text.word or "")
        self.stats.done(slot, metrics, len(toks), len(out))
        job.post(Done(finish, out, metrics, end))

    @staticmethod
    def _so_far(job: Job, t0: float, t_first: float | None, t_last: float | None,
                n_out: int) -> tuple[RunMetrics | None, int]:
        """(figures so far, tokens so far) for timings_per_token; (None, 0) without it."""
        if not job.timings_per_token:
            return None, 0
        return RunMetrics.clock((t_first - t0) if t_first else None,
                                (t_last - t_first) if t_first and t_last else 0.0), n_out


def ended(steps: Iterator) -> bool:
    """Whether a generation has no step left (reading the next one ends it, closing its
    session); a failure there is no answer to a response already complete: False."""
    try:
        return next(steps, None) is None
    except MtplibError:
        return False


def with_text_bias(job: Job, be: Any, cfg: ServeConfig) -> Any:
    """The job's sampler with its text-keyed logit_bias as token ids: each text tokenized
    without BOS, every token biased (llama-server's rule); the settings report them."""
    if not job.bias_texts:
        return job.sampler
    extra = tuple((t, b) for text, b in job.bias_texts
                  for t in strip_bos(cfg, be.tokenize(text)))
    sampler = replace(job.sampler, logit_bias=job.sampler.logit_bias + extra)
    job.settings = {**job.settings, "logit_bias": bias_setting(sampler.logit_bias)}
    return sampler


def token_probs(chunk: list[int], records: list | None, be: Any) -> list[TokenProb]:
    """Per emitted token, its log-probability and the most probable tokens: the records
    the engine computed with the step (`Sampler.logprobs`, `Emitted`; in the ranged
    worker too), given their text here."""
    if records is None or len(records) < len(chunk) or any(
            r.token != t for r, t in zip(records, chunk, strict=False)):
        raise MtplibError("the backend's tokens came without their log-probabilities")
    piece = be.detokenize
    return [TokenProb(int(t), piece([t]), r.logprob,
                      tuple(Alternative(x, piece([x]), lp) for x, lp in r.top))
            for t, r in zip(chunk, records, strict=False)]
