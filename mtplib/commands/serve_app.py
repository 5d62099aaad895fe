"""The HTTP side of `mtplib serve`: an OpenAI-compatible API over one loaded backend.

One thread (`GenerationWorker`) owns the backend (an `MTPRuntime` or a `RangedMTP`) and runs
one request at a time: tokenizing, checking against the context, generating, detokenizing.
Requests wait in a bounded queue in front of it (503 when full), so a generation is never
interleaved with another on the same object and the event loop never blocks on upstream
(health checks answer while a generation runs). Every request is read with a byte limit and
validated by pydantic before it reaches the queue; each refusal is a 4xx JSON error in
OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}``, and the service keeps
serving. Responses carry llama-server's ``timings`` (prompt_n, prompt_ms, predicted_n,
predicted_ms, predicted_per_second, draft_n, draft_n_accepted, ...).

Edges, with hostile or careless peers in mind: each connection has a header and a body
deadline (`deadline_protocol`: an idle or trickling peer gets 408 and is closed); a client
that leaves mid-body or while waiting is one log line (`ClientGone`, rate-limited by
`LimitedLog`); at SIGTERM the waiting requests get a 503 at once, the running one is cut
with a 503 after the grace period (`GenerationWorker.begin_shutdown` / `cut`), and
whatever uvicorn still cancels is answered 503 too (`CutAtShutdown`), never its
plain-text 500 and a traceback.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import math
import queue
import re
import secrets
import sys
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field, fields, replace
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from mtplib.commands.serve_faults import RECHECK_S, BackendHealth
from mtplib.commands.serve_fields import refusal, slot_refusal
from mtplib.commands.serve_native import (
    chat_logprobs,
    completion_logprobs,
    generation_settings,
    metrics_text,
    native_probs,
    props,
    slot,
)
from mtplib.errors import InputError, MtplibError
from mtplib.runtime.backend import Backend

#: ChatML, llama-server's template for a model whose GGUF has none (the trained pair)
CHATML = "<|im_start|>{role}\n{content}<|im_end|>\n"
#: OpenAI's bound on stop sequences per request, and ours on their length
MAX_STOPS, MAX_STOP_CHARS = 4, 256
#: /tokenize and /detokenize calls that may wait at once for the backend (each holds a
#: thread while a generation runs)
CALLS_MAX = 4
#: the most alternatives per token a response lists (OpenAI's top_logprobs bound)
MAX_LOGPROBS = 20
#: a stream sends what the steps emitted at most this often (the first step at once):
#: each event wakes the event loop, which then competes with the generation for the GIL
STREAM_EVERY_S = 0.025


class ApiError(Exception):
    """A refusal with its HTTP status, in OpenAI's error shape."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | int | None = None,
                 extra: dict | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param = status, message, type, param
        self.code = status if code is None else code
        self.extra = extra or {}  # e.g. llama-server's n_prompt_tokens and n_ctx

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code, **self.extra}}

    def response(self) -> JSONResponse:
        headers = {"WWW-Authenticate": "Bearer"} if self.status == 401 else None
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


def shutting_down(what: str = "") -> ApiError:
    """The 503 of a request the shutdown (SIGTERM) refuses or cuts."""
    return ApiError(503, "the server is shutting down" + (f": {what}" if what else ""),
                    type="unavailable_error")


class ClientGone(Exception):
    """The client closed its connection before its request was answered (mid-body, or
    while waiting): logged in one line, nothing to answer."""


def _error_of(e: BaseException) -> ApiError:
    """What a failure inside a generation becomes: bad input 400, a fault upstream or on
    a shard 500 (named), anything else 500 without internals."""
    if isinstance(e, ApiError):
        return e
    if isinstance(e, InputError):
        return ApiError(400, str(e))
    if isinstance(e, MtplibError):
        return ApiError(500, str(e), type="server_error")
    return ApiError(500, f"internal error ({type(e).__name__}); see the server's log",
                    type="server_error")


def _sampler_param(e: InputError) -> str | None:
    """The request field a `Sampler` refusal is about: its message starts with the field's
    name ("top_p must ...", "logit_bias: bias of ..."); None when it names no field, so
    ``param`` is never a piece of the sentence ("logit_bias:")."""
    from mtplib.runtime.sampling import Sampler

    m = re.match(r"[a-z_]+", str(e))
    name = m.group(0) if m else None
    return name if name in {f.name for f in fields(Sampler)} else None


# -- requests ---------------------------------------------------------------------------
class _Request(BaseModel):
    """Fields every endpoint takes (`serve_fields.HONOURED`). A field in no list, or an
    inert one at a value that would do something, was refused before this model
    (`serve_fields.refusal`); extra="forbid" is the net under that."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model: str | None = None
    #: -1 (llama-server's): until the end of generation or the context
    max_tokens: int | None = Field(None, ge=-1)
    n_predict: int | None = Field(None, ge=-1)  # llama-server's name
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0)
    min_p: float | None = Field(None, ge=0, le=1)
    #: -1 (llama-server's): a random seed, drawn per request and reported
    seed: int | None = Field(None, ge=-1)
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    stop: str | list[str] | None = None
    ignore_eos: bool = False  # llama-server's: generate exactly max_tokens
    return_tokens: bool = False  # llama-server's: add the generated token ids
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    repeat_penalty: float | None = Field(None, gt=0)
    repeat_last_n: int | None = Field(None, ge=-1)
    #: OpenAI's {"id": bias}; llama-server's [[id, bias | false], ...] too
    logit_bias: dict[str, float] | list[list[int | float | bool]] | None = None

    def unsupported(self) -> tuple[str, str] | None:
        """(param, why) for a value mtplib does not do."""
        stops = self.stop_list()
        if len(stops) > MAX_STOPS or any(not x or len(x) > MAX_STOP_CHARS for x in stops):
            return "stop", (f"stop takes up to {MAX_STOPS} non-empty strings of at most "
                            f"{MAX_STOP_CHARS} characters")
        opts = set(self.stream_options or {}) - {"include_usage"}
        if opts:
            return "stream_options", f"stream_options.{sorted(opts)[0]} is not supported"
        return None

    def stop_list(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def n_new(self, default: int) -> int:
        """The tokens asked for (-1: as many as the context holds)."""
        for v in (self.max_tokens, self.n_predict):
            if v is not None:
                return v
        return default

    def include_usage(self) -> bool:
        return bool((self.stream_options or {}).get("include_usage"))

    def bias(self, n_vocab: int) -> tuple[tuple[int, float], ...]:
        """logit_bias as (token id, bias); false (llama-server's) bans a token (-inf)."""
        if not self.logit_bias:
            return ()
        items = (list(self.logit_bias.items()) if isinstance(self.logit_bias, dict)
                 else [tuple(x) for x in self.logit_bias])
        out = []
        for item in items:
            if len(item) != 2:
                raise ApiError(400, "logit_bias entries are [token id, bias]",
                               param="logit_bias")
            tok, b = item
            if isinstance(tok, str):
                if not tok.isdigit():
                    raise ApiError(400, f"logit_bias key {tok!r}: only token ids (strings "
                                   "are not supported)", param="logit_bias")
                tok = int(tok)
            if isinstance(tok, bool) or not isinstance(tok, int) or not 0 <= tok < n_vocab:
                raise ApiError(400, f"logit_bias token {tok!r} is not an id in [0, "
                               f"{n_vocab})", param="logit_bias")
            if b is True:
                raise ApiError(400, "logit_bias bias true is not a number (false bans)",
                               param="logit_bias")
            out.append((tok, -math.inf if b is False else float(b)))
        return tuple(out)

    def n_logprobs(self) -> int | None:
        """How many top alternatives per token the response carries (None: no logprobs)."""
        return None


PROMPT_SHAPE = str | list[int | str] | list[list[int | str]]


class NativeRequest(_Request):
    """llama-server's ``/completion``."""

    prompt: PROMPT_SHAPE
    n_probs: int = Field(0, ge=0, le=MAX_LOGPROBS)
    response_fields: list[str] | None = None

    def n_logprobs(self) -> int | None:
        return self.n_probs or None


class CompletionRequest(_Request):
    """OpenAI's ``/v1/completions``."""

    prompt: PROMPT_SHAPE
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)

    def n_logprobs(self) -> int | None:
        return self.logprobs


def one_prompt(p: str | list) -> str | list[int | str]:
    """The prompt as text, token ids, or llama-server's mix of ids and strings; a batch
    of more than one is refused."""
    if isinstance(p, list) and p and isinstance(p[0], list) or (
            isinstance(p, list) and len(p) > 1 and all(isinstance(x, str) for x in p)):
        if len(p) != 1:
            raise ApiError(400, f"prompt holds {len(p)} prompts; send one per request",
                           param="prompt")
        p = p[0]
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], str):
        p = p[0]
    if isinstance(p, list) and not p:
        raise ApiError(400, "prompt is empty", param="prompt")
    return p


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart] | None = None
    #: OpenAI's other message fields: refused unless empty (no tools, no names)
    name: None = None
    tool_calls: list[None] | None = Field(None, max_length=0)
    function_call: None = None
    refusal: None = None
    audio: None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""


class ChatRequest(_Request):
    """OpenAI's ``/v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=-1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)

    def n_new(self, default: int) -> int:
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return super().n_new(default)

    def unsupported(self) -> tuple[str, str] | None:
        if self.top_logprobs is not None and not self.logprobs:
            return "top_logprobs", "top_logprobs needs logprobs: true"
        return super().unsupported()

    def n_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


def _validation_error(e: ValidationError | RequestValidationError) -> ApiError:
    """The first error, named by its field; FastAPI's (a query parameter) start their loc
    with where the field was ("query", "path"), which is no part of its name."""
    first = e.errors()[0]
    where = first["loc"][1:] if isinstance(e, RequestValidationError) else first["loc"]
    loc = ".".join(str(x) for x in where)
    return ApiError(400, f"{loc}: {first['msg']}" if loc else first["msg"], param=loc or None)


# -- the worker -------------------------------------------------------------------------
@dataclass
class ServeConfig:
    """What the HTTP layer knows of the loaded model and its own limits."""

    model_id: str
    n_ctx: int
    n_vocab: int
    #: end-of-generation token ids (from the GGUF): a generation stops at one
    eog: frozenset[int] = frozenset()
    k: int = 0
    default_n: int = 32
    default_temperature: float = 0.0
    default_top_p: float = 1.0
    default_seed: int = 0
    #: requests that may wait behind the running one; more are answered 503
    queue_max: int = 8
    max_body_bytes: int = 1 << 20
    api_key: str | None = None
    #: the GGUF's tokenizer.chat_template (None: ChatML, as llama-server)
    chat_template: str | None = None
    bos_token: str = ""
    eos_token: str = ""
    meta: dict = field(default_factory=dict)
    #: the trunk's path (/props' model_path; default: model_id)
    model_path: str = ""
    #: system_fingerprint and /props' build_info: mtplib's and upstream's builds
    fingerprint: str = "mtplib"
    #: the BOS id the tokenizer adds (None: it adds none)
    bos_id: int | None = None
    #: CORS: origins a browser page may call from ("*": any; empty: no CORS headers)
    cors_origins: tuple[str, ...] = ("*",)


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
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancel: threading.Event = field(default_factory=threading.Event)

    def post(self, kind: str, *payload: Any) -> None:
        with contextlib.suppress(RuntimeError):  # the loop is gone: nobody listens
            self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, *payload))


class ServeStats:
    """What /metrics and /slots report: totals since the start (Prometheus counters) and
    the running request's state; written by the worker thread, read by the event loop."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.requests = {"ok": 0, "error": 0}
        self.prompt_tokens = self.predicted = self.decode_steps = 0
        self.drafted = self.accepted = self.verify_steps = 0
        self.prompt_s = self.predicted_s = 0.0
        self.n_tokens_max = 0
        self.waits_per_step: dict[str, float] = {}
        self.task = 0
        self.running: dict | None = None  # id_task, params, n_decoded, n_remain

    def begin(self, job: Job, n_prompt: int, n_new: int) -> None:
        with self.lock:
            self.task += 1
            self.running = {"id_task": self.task, "params": job.settings, "n_decoded": 0,
                            "n_new": n_new, "n_prompt": n_prompt}

    def step(self, n_out: int) -> None:
        with self.lock:
            if self.running is not None:
                self.running["n_decoded"] = n_out

    def done(self, metrics: dict, n_prompt: int, n_out: int) -> None:
        with self.lock:
            self.requests["ok"] += 1
            self.running = None
            self.prompt_tokens += n_prompt
            self.predicted += n_out
            self.prompt_s += metrics.get("ttft_s") or 0.0
            self.predicted_s += metrics.get("decode_s") or 0.0
            self.n_tokens_max = max(self.n_tokens_max, n_prompt + n_out)
            self.drafted += int(metrics.get("drafted") or 0)
            self.accepted += int(metrics.get("accepted") or 0)
            steps = int(metrics.get("verify_steps") or 0)
            self.verify_steps += steps
            self.decode_steps += steps + int(metrics.get("plain_steps") or 0)
            if metrics.get("waits_per_step"):
                self.waits_per_step = dict(metrics["waits_per_step"])

    def failed(self) -> None:
        with self.lock:
            self.requests["error"] += 1
            self.running = None


class GenerationWorker:
    """The one thread that touches the backend: a bounded FIFO of jobs, one at a time."""

    def __init__(self, backend: Backend, cfg: ServeConfig,
                 log: Callable[[str], None] = lambda s: None) -> None:
        self.backend, self.cfg, self.log = backend, cfg, log
        self.jobs: queue.Queue[Job | None] = queue.Queue(maxsize=cfg.queue_max)
        #: set at SIGTERM: no new job, the waiting ones are answered 503
        self.stopping = threading.Event()
        #: set when the grace period is over: the running generation is cut (503)
        self.cutting = threading.Event()
        self._gate = threading.Lock()  # submit vs. the shutdown's drain of the queue
        self.busy = threading.Event()
        self.served = 0
        self.stats = ServeStats()
        #: shard faults: /health's state, and the recovery run by this thread
        self.health = BackendHealth(backend, log)
        self._calls = asyncio.Semaphore(CALLS_MAX)
        self.thread = threading.Thread(target=self._loop, name="mtplib-serve-worker",
                                       daemon=True)
        self.thread.start()

    def submit(self, job: Job) -> None:
        with self._gate:
            if self.stopping.is_set():
                raise shutting_down()
            try:
                self.jobs.put_nowait(job)  # degraded: it waits for a reconnect attempt
                if self.health.fault is not None:
                    self.health.wake.set()
            except queue.Full:
                raise ApiError(503, f"the server is busy: {self.cfg.queue_max} requests "
                               "already wait for the running one; retry later",
                               type="unavailable_error") from None

    def pending(self) -> int:
        return self.jobs.qsize() + self.n_busy()

    def n_busy(self) -> int:
        """Slots running a generation (`serve_batch.BatchWorker`: of --parallel)."""
        return int(self.busy.is_set())

    def slot_states(self) -> list[dict | None]:
        """Each slot's running request as /slots shows it (None: idle); here one slot."""
        return [self.stats.running]

    async def call(self, fn: Callable[[Any], Any]) -> Any:
        """``fn(backend)`` in a thread (the backend serializes it with a running
        generation): /tokenize and /detokenize; at most ``CALLS_MAX`` at once, more 503."""
        if self._calls.locked():
            raise ApiError(503, f"the server is busy: {CALLS_MAX} tokenizer calls already "
                           "wait for the running generation; retry later",
                           type="unavailable_error")
        if self.health.fault is not None:
            raise ApiError(503, self.health.refusal(), type="unavailable_error")
        async with self._calls:
            try:
                return await asyncio.to_thread(fn, self.backend)
            except InputError as e:
                raise ApiError(400, str(e)) from None
            except MtplibError as e:
                raise self._error(e) from None

    def begin_shutdown(self) -> int:
        """SIGTERM: refuse new jobs and answer the waiting ones 503 now (the running one
        may finish until `cut`); how many were waiting."""
        with self._gate:
            self.stopping.set()
            self.health.wake.set()  # a recovery's backoff ends too
            n = self._drain(shutting_down("the request was waiting"))
            with contextlib.suppress(queue.Full):
                self.jobs.put_nowait(None)  # wakes the loop, which then ends
        return n

    def _drain(self, error: ApiError) -> int:
        """Answer every waiting job ``error``; how many there were."""
        n = 0
        while True:
            try:
                job = self.jobs.get_nowait()
            except queue.Empty:
                return n
            if job is not None:
                n += 1
                job.post("error", error)

    def _error(self, e: BaseException) -> ApiError:
        """A failure as its response: a shard fault is a 503 naming the shards (and the
        service degraded until `_recover`), the rest as `_error_of`."""
        shard = self.health.failure(e)
        if shard is None:
            return _error_of(e)
        return ApiError(503, shard[0], type="unavailable_error", extra=shard[1])

    def _recover(self) -> None:
        """Degraded: reconnect the shards (backoff, or at once for a waiting request) until
        whole or stopping; the requests that waited for a failed attempt get the 503."""

        def failed() -> None:  # the requests that waited for this attempt
            with self._gate:
                self._drain(ApiError(503, self.health.refusal(), type="unavailable_error"))

        self.health.recover(self.stopping, failed)

    def cut(self) -> None:
        """The grace period is over: the running generation ends at its next step and its
        request is answered 503."""
        self.cutting.set()

    def stop(self, timeout: float) -> bool:
        """Cut the running generation at its next step, refuse the waiting ones, and join
        the thread; False when it did not stop in time (upstream still busy)."""
        self.begin_shutdown()
        self.cut()
        self.thread.join(timeout)
        return not self.thread.is_alive()

    def _loop(self) -> None:
        while not self.stopping.is_set():
            if self.health.check() is not None:  # a fault: seen idle, or by the last job
                self._recover()
                continue
            try:
                job = self.jobs.get(timeout=RECHECK_S)
            except queue.Empty:
                continue
            if job is None:
                return
            if job.cancel.is_set():
                continue
            self.busy.set()
            try:
                self._serve_one(job)
            finally:
                self.busy.clear()

    def _serve_one(self, job: Job, backend: Any = None) -> None:
        """Run one request; any failure is answered to it, never fatal to the worker."""
        try:
            self._run(job, backend)
        except BaseException as e:  # noqa: BLE001 - reported to the request, never fatal
            if not isinstance(e, MtplibError | ApiError):
                self.log(f"generation failed: {type(e).__name__}: {e}")
            self.stats.failed()
            job.post("error", self._error(e))  # a shard fault: a 503 naming the shards
        finally:
            self.served += 1

    def _tokens(self, prompt: str | list[int | str]) -> list[int]:
        """Token ids of text, of ids, or of llama-server's mix of ids and strings."""
        if isinstance(prompt, str):
            return self.backend.tokenize(prompt)
        if all(isinstance(x, int) for x in prompt):
            return list(prompt)  # type: ignore[arg-type]
        out: list[int] = []
        for i, x in enumerate(prompt):  # later strings without BOS, as llama-server
            out += [x] if isinstance(x, int) else (
                self.backend.tokenize(x) if i == 0
                else _strip_bos(self.cfg, self.backend.tokenize(x)))
        return out

    def _budget(self, toks: list[int], n_new: int) -> tuple[int, bool]:
        """(tokens to generate, whether that is the context's end rather than the
        request's n): llama-server stops at the end of the context (truncated) instead
        of refusing a request that asks for more; a prompt that fills it is refused."""
        c = self.cfg
        if not toks:
            raise ApiError(400, "the prompt has no tokens", param="prompt")
        bad = next((t for t in toks if not 0 <= t < c.n_vocab), None)
        if bad is not None:
            raise ApiError(400, f"token id {bad} out of range [0, {c.n_vocab})", param="prompt")
        room = c.n_ctx - len(toks)
        if room < 1 and n_new != 0 or room < 0:
            raise ApiError(400, f"the prompt ({len(toks)} tokens) leaves no room in the "
                           f"context of {c.n_ctx} tokens; shorten the prompt",
                           type="exceed_context_size_error",
                           extra={"n_prompt_tokens": len(toks), "n_ctx": c.n_ctx})
        if n_new == -1 or n_new > room:
            return room, True
        return n_new, False

    def _run(self, job: Job, backend: Any = None) -> None:
        """One request, start to end; ``backend``: what it streams from (default the
        worker's; `serve_batch` gives each request its slot)."""
        be = backend or self.backend
        toks = self._tokens(job.prompt)
        n_new, at_end = self._budget(toks, job.n_new)
        job.post("start", len(toks), be.detokenize(toks) if job.want_prompt_text else None)
        self.stats.begin(job, len(toks), n_new)
        finish, out, pieces, pend, probs = "length", [], [], [], []
        stop_type = "limit"
        text = StopText(job.stop)
        sampler = job.sampler
        if job.n_logprobs is not None:  # each step's tokens then come with their records
            sampler = replace(sampler, logprobs=job.n_logprobs)
        t0 = time.perf_counter()
        t_post = 0.0
        t_first = t_last = None
        with be.stream(toks, n_new, sampler=sampler) as gen:
            for step in gen:
                chunk = list(step)
                if job.cancel.is_set() or self.cutting.is_set():
                    finish = "abort"
                    break
                if not job.ignore_eos:
                    cut = next((i for i, t in enumerate(chunk) if t in self.cfg.eog), None)
                    if cut is not None:
                        chunk, finish, stop_type = chunk[:cut], "stop", "eos"
                t_last = time.perf_counter()
                t_first = t_first or t_last
                if job.n_logprobs is not None:
                    probs += self._logprobs(chunk, getattr(step, "logprobs", None), be)
                out += chunk
                self.stats.step(len(out))
                piece, hit = text.feed(be.detokenize(chunk) if chunk else "")
                pend += chunk
                pieces.append(piece)
                if job.stream and t_last - t_post >= STREAM_EVERY_S and (pend or piece):
                    job.post("tokens", pend, "".join(pieces), probs)
                    pend, pieces, t_post, probs = [], [], t_last, []
                if hit:
                    finish, stop_type = "stop", "word"
                if finish == "stop":
                    break
            metrics = None
            if finish == "length":  # exhausted: the library's own metrics
                with contextlib.suppress(MtplibError):
                    metrics = gen.metrics.to_dict()  # the response's figures
        if finish == "abort":
            if not job.cancel.is_set():  # cut by the shutdown: its client still waits
                job.post("error", shutting_down("the generation was cut after "
                                                "--shutdown-timeout"))
            return
        pieces.append(text.flush())
        rest = "".join(pieces)
        if pend or rest:  # a stream's last text, or all of a non-streaming request's
            job.post("tokens", pend, rest, probs)
        if not metrics:  # stopped early: the timings from this side's clock
            metrics = {"n_prompt": len(toks), "n_generated": len(out),
                       "ttft_s": (t_first - t0) if t_first else None,
                       "decode_s": (t_last - t_first) if t_first else 0.0}
        for v in metrics.get("wire_violations") or []:  # only with --allow-cache-crossing
            self.log(f"contract violation in this request: {v}")
        end = {"truncated": at_end and finish == "length" and len(out) == n_new,
               "stop_type": stop_type, "stopping_word": text.word or ""}
        self.stats.done(metrics, len(toks), len(out))
        job.post("done", finish, out, metrics, end)

    def _logprobs(self, chunk: list[int], records: list | None, be: Any) -> list[dict]:
        """Per emitted token, its log-probability and the most probable tokens: the
        records the engine computed with the step (`Sampler.logprobs`, `Emitted`; in the
        ranged worker too), given their text here."""
        if records is None or len(records) < len(chunk) or any(
                r.token != t for r, t in zip(records, chunk, strict=False)):
            raise MtplibError("the backend's tokens came without their log-probabilities")
        piece = be.detokenize
        return [{"id": int(t), "token": piece([t]), "logprob": r.logprob,
                 "top": [{"id": x, "token": piece([x]), "logprob": lp} for x, lp in r.top]}
                for t, r in zip(chunk, records, strict=False)]


class StopText:
    """The text a generation may show, with stop sequences: text that could still grow into
    a stop sequence is held back; at a stop sequence the text ends before it."""

    def __init__(self, stops: list[str]) -> None:
        self.stops, self.held, self.done = stops, "", False
        self.word: str | None = None  # the stop sequence reached

    def feed(self, piece: str) -> tuple[str, bool]:
        """(text to show now, whether a stop sequence was reached)."""
        if self.done:
            return "", True
        buf = self.held + piece
        hits = [(i, s) for i, s in ((buf.find(s), s) for s in self.stops) if i >= 0]
        if hits:
            at, self.word = min(hits)
            self.held, self.done = "", True
            return buf[:at], True
        keep = max((n for s in self.stops for n in range(min(len(s) - 1, len(buf)), 0, -1)
                    if buf.endswith(s[:n])), default=0)
        self.held = buf[len(buf) - keep:] if keep else ""
        return buf[:len(buf) - keep], False

    def flush(self) -> str:
        rest, self.held = ("" if self.done else self.held), ""
        return rest


def timings(metrics: dict, n_prompt: int, n_out: int) -> dict:
    """llama-server's per-response `timings` from the library's metrics (the same
    definitions: predicted_per_second = (n - 1) / the time after the first token)."""
    prompt_ms = 1000.0 * (metrics.get("ttft_s") or 0.0)
    pred_ms = 1000.0 * (metrics.get("decode_s") or 0.0)
    steps = max(n_out - 1, 0)
    t = {"cache_n": 0,
         "prompt_n": n_prompt, "prompt_ms": prompt_ms,
         "prompt_per_token_ms": prompt_ms / n_prompt if n_prompt else 0.0,
         "prompt_per_second": 1000.0 * n_prompt / prompt_ms if prompt_ms > 0 else 0.0,
         "predicted_n": n_out, "predicted_ms": pred_ms,
         "predicted_per_token_ms": pred_ms / steps if steps else 0.0,
         "predicted_per_second": 1000.0 * steps / pred_ms if pred_ms > 0 else 0.0}
    if metrics.get("drafted"):
        t["draft_n"] = int(metrics["drafted"])
        t["draft_n_accepted"] = int(metrics.get("accepted") or 0)
    return t


# -- the app ----------------------------------------------------------------------------
async def _read_json(request: Request, limit: int) -> dict:
    cl = request.headers.get("content-length", "")
    if cl.isdigit() and int(cl) > limit:
        raise ApiError(413, f"the request body ({cl} bytes) exceeds the limit of {limit} bytes")
    buf = bytearray()
    try:
        async for part in request.stream():
            buf += part
            if len(buf) > limit:
                raise ApiError(413, f"the request body exceeds the limit of {limit} bytes")
    except ClientDisconnect:
        why = request.scope.get(DEADLINE_KEY)
        raise ClientGone(f"closed after {len(buf)} bytes of the body" if why is None
                         else why) from None
    try:
        data = json.loads(bytes(buf))
    except (ValueError, RecursionError) as e:
        raise ApiError(400, f"the request body is not valid JSON ({type(e).__name__}: "
                       f"{str(e)[:200]})") from None
    if not isinstance(data, dict):
        raise ApiError(400, "the request body must be a JSON object")
    if b"\\u" in buf or not buf.isascii():  # else it cannot hold a surrogate
        where = _lone_surrogate(data)
        if where is not None:
            raise ApiError(400, f"the request body is not valid JSON text: {where} holds an "
                           "unpaired UTF-16 surrogate (\\ud800-\\udfff), which is no "
                           "Unicode character", param=where)
    return data


_SURROGATE = re.compile("[\ud800-\udfff]")


def _lone_surrogate(data: dict) -> str | None:
    """Where parsed JSON holds a lone surrogate ("messages.0.content"), or None. Python's
    json reads "\\ud800" (or its raw bytes) into a str that no UTF-8 step can encode (the
    tokenizer, a response that echoes it: a 500), so every endpoint refuses such a body
    here, as llama-server's parser does; keys are shown escaped (the answer is UTF-8)."""
    todo: list[tuple[str, Any]] = [("", data)]
    while todo:
        path, v = todo.pop()
        if isinstance(v, str):
            if not v.isascii() and _SURROGATE.search(v):
                return path or "the body"
            continue
        if isinstance(v, dict):
            items: list[tuple[Any, Any]] = list(v.items())
        elif isinstance(v, list):
            items = list(enumerate(v))
        else:
            continue
        kids = []
        for k, x in items:
            name = str(k).encode("utf-8", "backslashreplace").decode()
            if isinstance(k, str) and _SURROGATE.search(k):
                return f"{path}.{name}" if path else name
            kids.append((f"{path}.{name}" if path else name, x))
        todo += reversed(kids)  # depth first, in the body's order
    return None


def _render_chat(cfg: ServeConfig, messages: list[ChatMessage]) -> str:
    """The prompt text of a conversation: the model's own template (Jinja in a sandbox,
    as llama-cpp-python renders it), else ChatML; the assistant's turn is opened."""
    msgs = [{"role": m.role, "content": m.text()} for m in messages]
    if cfg.chat_template is None:
        return "".join(CHATML.format(**m) for m in msgs) + "<|im_start|>assistant\n"
    from jinja2 import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def refuse(msg: str):
        raise ApiError(400, f"the model's chat template refused the messages: {msg}",
                       param="messages")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    try:
        return env.from_string(cfg.chat_template).render(
            messages=msgs, add_generation_prompt=True, bos_token=cfg.bos_token,
            eos_token=cfg.eos_token, raise_exception=refuse)
    except TemplateError as e:
        raise ApiError(400, f"the model's chat template failed on the messages: {e}",
                       param="messages") from None


def create_app(worker: GenerationWorker, *, on_shutdown: Callable[[], None] = lambda: None
               ) -> FastAPI:
    """The FastAPI app over a running worker. ``on_shutdown`` runs in the lifespan's end
    (after uvicorn finished or cancelled the in-flight requests)."""
    cfg = worker.cfg

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        yield
        on_shutdown()

    app = FastAPI(title="mtplib serve", docs_url=None, redoc_url=None, openapi_url=None,
                  lifespan=lifespan)

    @app.exception_handler(ApiError)
    async def _api_error(_req: Request, e: ApiError) -> JSONResponse:
        return e.response()

    @app.exception_handler(RequestValidationError)
    async def _bad_param(_req: Request, e: RequestValidationError) -> JSONResponse:
        # a query parameter of the wrong type (/slots?fail_on_no_slot=abc): 400 in this
        # service's shape, as llama-server answers bad input, not FastAPI's {"detail"} 422
        return _validation_error(e).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_req: Request, e: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return ApiError(e.status_code, str(e.detail), type=kind).response()

    @app.exception_handler(ClientGone)
    async def _gone(req: Request, e: ClientGone) -> Response:
        peer = "{}:{}".format(*req.client) if req.client else "a client"
        limited_log(f"{peer} {req.method} {req.url.path}: {e}")
        return Response(status_code=499)  # never read: the connection is gone

    @app.exception_handler(Exception)
    async def _bug(_req: Request, e: Exception) -> JSONResponse:
        log_line(f"internal error: {type(e).__name__}: {e}")
        return _error_of(e).response()

    if cfg.api_key is not None:
        app.add_middleware(BearerAuth, key=cfg.api_key)
    if cfg.cors_origins:
        app.add_middleware(Cors, origins=cfg.cors_origins)  # a preflight needs no key
    app.add_middleware(CutAtShutdown, stopping=worker.stopping)  # outermost

    @app.get("/health")
    @app.get("/v1/health")
    async def health() -> JSONResponse:
        code, body = worker.health.status()  # 503 naming the shards while degraded
        return JSONResponse({**body, "model": cfg.model_id, "pending": worker.pending()},
                            status_code=code)

    def model_card() -> dict:
        return {"id": cfg.model_id, "object": "model", "created": int(time.time()),
                "owned_by": "mtplib", "meta": {"n_ctx": cfg.n_ctx, "n_vocab": cfg.n_vocab,
                                               "draft": cfg.k, **cfg.meta}}

    @app.get("/v1/models")
    @app.get("/models")
    async def models() -> dict:
        return {"object": "list", "data": [model_card()]}

    async def parse(request: Request, kind: type[_Request], endpoint: str) -> _Request:
        data = await _read_json(request, cfg.max_body_bytes)
        bad = (slot_refusal(data, len(worker.slot_states()))  # id_slot past --parallel
               or refusal(data, endpoint))  # unknown fields, inert ones at a live value
        if bad:
            raise ApiError(400, bad[1], param=bad[0])
        try:
            req = kind.model_validate(data)
        except ValidationError as e:
            raise _validation_error(e) from None
        # any model name is accepted, as llama-server does with one model: the response
        # names the served one
        bad = req.unsupported()
        if bad:
            raise ApiError(400, bad[1], param=bad[0])
        return req

    def sampler_of(req: _Request):
        from mtplib.runtime.sampling import Sampler

        s = cfg.default_seed if req.seed is None else req.seed
        if s == -1:  # llama-server's: a random seed (reported in generation_settings)
            s = secrets.randbits(32)
        opts = {"temperature": cfg.default_temperature if req.temperature is None
                else req.temperature,
                "top_p": cfg.default_top_p if req.top_p is None else req.top_p, "seed": s}
        for name in ("top_k", "min_p", "repeat_penalty", "repeat_last_n",
                     "frequency_penalty", "presence_penalty"):
            if getattr(req, name) is not None:
                opts[name] = getattr(req, name)
        if not math.isfinite(opts["temperature"]):
            raise ApiError(400, f"temperature must be finite, got {opts['temperature']}",
                           param="temperature")
        try:
            return Sampler(**opts, logit_bias=req.bias(cfg.n_vocab))
        except InputError as e:
            raise ApiError(400, str(e), param=_sampler_param(e)) from None

    def settings_of(req: _Request, sampler) -> dict:
        return generation_settings(cfg, sampler, n_predict=req.n_new(cfg.default_n),
                                   stop=req.stop_list(), ignore_eos=req.ignore_eos,
                                   stream=req.stream, n_probs=req.n_logprobs() or 0)

    async def start(request: Request, req: _Request, prompt, *, native: bool = False
                    ) -> tuple:
        sampler = sampler_of(req)
        job = Job(prompt=prompt, n_new=req.n_new(cfg.default_n), sampler=sampler,
                  ignore_eos=req.ignore_eos, loop=asyncio.get_running_loop(),
                  stop=req.stop_list(), stream=req.stream, n_logprobs=req.n_logprobs(),
                  settings=settings_of(req, sampler), want_prompt_text=native)
        worker.submit(job)
        try:
            ev = await _next_event(request, job)
        except BaseException:
            job.cancel.set()
            raise
        if ev[0] == "error":
            raise ev[1]
        return job, ev[1], ev[2]

    async def collect(request: Request, job: Job) -> tuple:
        """A non-streaming job's text, tokens, log-probabilities and its end."""
        text, toks, probs = [], [], []
        try:
            while True:
                ev = await _next_event(request, job)
                if ev[0] == "tokens":
                    toks += ev[1]
                    text.append(ev[2])
                    probs += ev[3]
                elif ev[0] == "error":
                    raise ev[1]
                else:
                    _, finish, out, metrics, end = ev
                    return "".join(text), finish, out, metrics, end, probs
        finally:
            job.cancel.set()  # a no-op when done; stops a generation nobody waits for

    async def complete(request: Request, req: _Request, prompt, shape: Shape) -> Response:
        job, n_prompt, _ = await start(request, req, prompt)
        if req.stream:
            return StreamingResponse(
                _sse(request, job, req, shape, n_prompt), media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        text, finish, out, metrics, end, probs = await collect(request, job)
        body = shape.whole(text, finish, n_prompt, out, metrics,
                           probs if job.n_logprobs is not None else None, end)
        if req.return_tokens:
            body["tokens"] = out
        return JSONResponse(body)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        req = await parse(request, CompletionRequest, "completions")
        assert isinstance(req, CompletionRequest)
        return await complete(request, req, one_prompt(req.prompt),
                              Shape(cfg.model_id, chat=False, fingerprint=cfg.fingerprint))

    @app.post("/v1/chat/completions")
    @app.post("/chat/completions")
    async def chat(request: Request) -> Response:
        req = await parse(request, ChatRequest, "chat")
        assert isinstance(req, ChatRequest)
        prompt = _render_chat(cfg, req.messages)
        return await complete(request, req, prompt,
                              Shape(cfg.model_id, chat=True, fingerprint=cfg.fingerprint))

    # -- llama-server's native endpoints -------------------------------------------------
    @app.post("/completion")
    @app.post("/completions")
    async def native_completion(request: Request) -> Response:
        req = await parse(request, NativeRequest, "completion")
        assert isinstance(req, NativeRequest)
        job, n_prompt, prompt_text = await start(request, req, one_prompt(req.prompt),
                                                 native=True)
        if req.stream:
            return StreamingResponse(
                _native_sse(request, job, req, n_prompt, prompt_text),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        text, finish, out, metrics, end, probs = await collect(request, job)
        body = _native_body(cfg, job, req, text, out, metrics, end, n_prompt, prompt_text,
                            probs)
        return JSONResponse(_pick_fields(body, req.response_fields))

    async def _native_sse(request: Request, job: Job, req: NativeRequest, n_prompt: int,
                          prompt_text: str) -> AsyncIterator[bytes]:
        """llama-server's /completion stream: content, tokens and stop per event, the
        last with everything (no [DONE])."""
        n = 0
        try:
            while True:
                ev = await job.events.get()
                if ev[0] == "tokens":
                    n += len(ev[1])
                    ch = {"index": 0, "content": ev[2], "tokens": ev[1], "stop": False,
                          "id_slot": 0, "tokens_predicted": n, "tokens_evaluated": n_prompt}
                    if job.n_logprobs is not None:
                        ch["completion_probabilities"] = native_probs(ev[3])
                    yield _sse_line(ch)
                elif ev[0] == "error":
                    yield _sse_line(_error_of(ev[1]).body())
                    return
                else:
                    _, _finish, out, metrics, end = ev
                    body = _native_body(cfg, job, req, "", out, metrics, end, n_prompt,
                                        prompt_text, None)
                    body["tokens"] = []
                    yield _sse_line(_pick_fields(body, req.response_fields))
                    return
        finally:
            job.cancel.set()

    @app.post("/tokenize")
    async def tokenize(request: Request) -> dict:
        data = await _read_json(request, cfg.max_body_bytes)
        req = _small(TokenizeRequest, data)
        if not req.parse_special:
            # the backend's tokenize parses special tokens; plain text is not reachable
            raise ApiError(400, "parse_special false is not supported (special tokens "
                           "are always parsed)", param="parse_special")
        toks = await worker.call(lambda be: be.tokenize(req.content))
        if not req.add_special:
            toks = _strip_bos(cfg, toks)
        if not req.with_pieces:
            return {"tokens": toks}
        pieces = await worker.call(lambda be: [be.detokenize([t]) for t in toks])
        return {"tokens": [{"id": t, "piece": p} for t, p in zip(toks, pieces, strict=True)]}

    @app.post("/detokenize")
    async def detokenize(request: Request) -> dict:
        data = await _read_json(request, cfg.max_body_bytes)
        req = _small(DetokenizeRequest, data)
        bad = next((t for t in req.tokens if not 0 <= t < cfg.n_vocab), None)
        if bad is not None:
            raise ApiError(400, f"token id {bad} out of range [0, {cfg.n_vocab})",
                           param="tokens")
        return {"content": await worker.call(lambda be: be.detokenize(req.tokens))}

    @app.post("/apply-template")
    async def apply_template(request: Request) -> dict:
        data = await _read_json(request, cfg.max_body_bytes)
        req = _small(TemplateRequest, data)
        return {"prompt": _render_chat(cfg, req.messages)}

    def defaults() -> dict:
        from mtplib.runtime.sampling import Sampler

        return generation_settings(
            cfg, Sampler(cfg.default_temperature, cfg.default_top_p, cfg.default_seed),
            n_predict=cfg.default_n, stop=[], ignore_eos=False, stream=False, n_probs=0)

    @app.get("/props")
    async def get_props() -> dict:
        states = worker.slot_states()
        return props(cfg, defaults(), next((r for r in states if r), None),
                     total_slots=len(states))

    @app.get("/slots")
    async def get_slots(fail_on_no_slot: int = 0) -> list:
        states = worker.slot_states()
        if fail_on_no_slot and worker.pending() >= len(states):
            raise ApiError(503, "no available slots", type="unavailable_error")
        return [slot(cfg, defaults(), r, i) for i, r in enumerate(states)]

    @app.get("/metrics")
    async def get_metrics() -> Response:
        return Response(metrics_text(worker.stats, worker.jobs.qsize(), worker.n_busy(),
                                     len(worker.slot_states())),
                        media_type="text/plain; version=0.0.4")

    return app


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    content: str
    add_special: bool = False
    parse_special: bool = True
    with_pieces: bool = False


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    tokens: list[int]


class TemplateRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    messages: list[ChatMessage] = Field(min_length=1)


def _small(kind: type[BaseModel], data: dict) -> Any:
    try:
        return kind.model_validate(data)
    except ValidationError as e:
        raise _validation_error(e) from None


def _strip_bos(cfg: ServeConfig, toks: list[int]) -> list[int]:
    """Without the BOS the backend's tokenize adds (where the model asks for one)."""
    return toks[1:] if toks and cfg.bos_id is not None and toks[0] == cfg.bos_id else toks


def _native_body(cfg: ServeConfig, job: Job, req: NativeRequest, text: str, out: list[int],
                 metrics: dict, end: dict, n_prompt: int, prompt_text: str,
                 probs: list | None) -> dict:
    """/completion's response object (and a stream's last event)."""
    body = {"index": 0, "content": text, "tokens": out if req.return_tokens else [],
            "id_slot": 0, "stop": True, "model": cfg.model_id,
            "tokens_predicted": len(out), "tokens_evaluated": n_prompt,
            "generation_settings": job.settings, "prompt": prompt_text,
            "has_new_line": "\n" in text, "truncated": end["truncated"],
            "stop_type": end["stop_type"], "stopping_word": end["stopping_word"],
            "tokens_cached": 0, "timings": timings(metrics, n_prompt, len(out))}
    if probs is not None and job.n_logprobs is not None:
        body["completion_probabilities"] = native_probs(probs)
    return body


def _pick_fields(body: dict, fields: list[str] | None) -> dict:
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


#: the paths llama-server serves without a key
PUBLIC_PATHS = frozenset({"/health", "/v1/health"})


class BearerAuth:
    """``Authorization: Bearer KEY`` or llama-server's ``X-Api-Key: KEY`` on every path but
    /health, compared in constant time; a CORS preflight (OPTIONS) never carries a key and
    is answered by `Cors` before this. Pure ASGI (not BaseHTTPMiddleware, which would pass
    every streamed chunk through an extra task)."""

    def __init__(self, app, key: str) -> None:
        self.app, self.key = app, key.encode()

    def _ok(self, headers: dict) -> bool:
        scheme, _, token = headers.get(b"authorization", b"").partition(b" ")
        bearer = scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.key)
        xkey = hmac.compare_digest(headers.get(b"x-api-key", b"").strip(), self.key)
        return bearer or xkey

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"] not in PUBLIC_PATHS \
                and not self._ok(dict(scope["headers"])):
            resp = ApiError(401, "missing or wrong API key (Authorization: Bearer KEY, or "
                            "X-Api-Key: KEY)", type="authentication_error").response()
            await resp(scope, receive, send)
            return
        await self.app(scope, receive, send)


class Cors:
    """CORS for browser pages: a preflight (OPTIONS with Origin and
    Access-Control-Request-Method) is answered 204 without a key, as llama-server does;
    other responses to an allowed Origin carry Access-Control-Allow-Origin. No
    credentials are allowed (the key travels in a header, never a cookie)."""

    METHODS, HEADERS = b"GET, POST, OPTIONS", b"Authorization, Content-Type, X-Api-Key"

    def __init__(self, app, origins: tuple[str, ...]) -> None:
        self.app, self.origins = app, origins

    def _allow(self, origin: bytes) -> bytes | None:
        if "*" in self.origins:
            return b"*"
        return origin if origin.decode("latin-1") in self.origins else None

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        origin = headers.get(b"origin")
        allow = self._allow(origin) if origin else None
        if scope["method"] == "OPTIONS" and b"access-control-request-method" in headers:
            out = [(b"vary", b"Origin"), (b"content-length", b"0")]
            if allow is not None:
                out += [(b"access-control-allow-origin", allow),
                        (b"access-control-allow-methods", self.METHODS),
                        (b"access-control-allow-headers", self.HEADERS),
                        (b"access-control-max-age", b"600")]
            await send({"type": "http.response.start", "status": 204 if allow else 403,
                        "headers": out})
            await send({"type": "http.response.body", "body": b""})
            return
        if allow is None:
            await self.app(scope, receive, send)
            return

        async def add(msg) -> None:
            if msg["type"] == "http.response.start":
                msg = {**msg, "headers": [*msg.get("headers", []),
                                          (b"access-control-allow-origin", allow),
                                          (b"vary", b"Origin")]}
            await send(msg)

        await self.app(scope, receive, add)


async def _next_event(request: Request, job: Job) -> tuple:
    """The job's next event; gives up (cancelling the job) when the client has gone."""
    while True:
        try:
            return await asyncio.wait_for(job.events.get(), timeout=1.0)
        except TimeoutError:
            if await request.is_disconnected():
                job.cancel.set()
                raise ClientGone("left while its request waited or ran; its generation "
                                 "is cancelled") from None


@dataclass
class Shape:
    """OpenAI's response and chunk objects for /v1/completions or /v1/chat/completions."""

    model: str
    chat: bool
    fingerprint: str = "mtplib"
    id: str = field(default_factory=lambda: uuid.uuid4().hex[:24])
    created: int = field(default_factory=lambda: int(time.time()))

    def _head(self, stream: bool) -> dict:
        if self.chat:
            obj = "chat.completion.chunk" if stream else "chat.completion"
            return {"id": f"chatcmpl-{self.id}", "object": obj, "created": self.created,
                    "model": self.model, "system_fingerprint": self.fingerprint}
        return {"id": f"cmpl-{self.id}", "object": "text_completion", "created": self.created,
                "model": self.model, "system_fingerprint": self.fingerprint}

    @staticmethod
    def usage(n_prompt: int, n_out: int) -> dict:
        return {"prompt_tokens": n_prompt, "completion_tokens": n_out,
                "total_tokens": n_prompt + n_out}

    def logprobs(self, probs: list[dict] | None, offset: int = 0) -> dict | None:
        if probs is None:
            return None
        return chat_logprobs(probs) if self.chat else completion_logprobs(probs, offset)

    def whole(self, text: str, finish: str, n_prompt: int, out: list[int], metrics: dict,
              probs: list[dict] | None = None, end: dict | None = None) -> dict:
        lp = self.logprobs(probs)
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text},
                      "logprobs": lp, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": text, "logprobs": lp, "finish_reason": finish}
        body = {**self._head(False), "choices": [choice],
                "usage": self.usage(n_prompt, len(out)),
                "timings": timings(metrics, n_prompt, len(out))}
        if end is not None:  # llama-server's: the generation reached the context's end
            body["truncated"] = end["truncated"]
        return body

    def chunk(self, text: str | None, finish: str | None = None, *, first: bool = False,
              probs: list[dict] | None = None, offset: int = 0) -> dict:
        lp = self.logprobs(probs, offset)
        if self.chat:
            # the first chunk: the role, content null (as OpenAI and llama-server send it)
            delta: dict = {"role": "assistant", "content": None} if first else {}
            if text is not None:
                delta["content"] = text
            choice = {"index": 0, "delta": delta, "logprobs": lp, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": text or "", "logprobs": lp,
                      "finish_reason": finish}
        return {**self._head(True), "choices": [choice]}


def _sse_line(obj: dict | str) -> bytes:
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj)}\n\n".encode()


async def _sse(request: Request, job: Job, req: _Request, shape: Shape, n_prompt: int
               ) -> AsyncIterator[bytes]:
    """Server-sent events: one chunk per step's tokens, the last with finish_reason and
    timings (and usage when stream_options.include_usage), then ``[DONE]``. An error after
    the first byte is sent as an event with an "error" object (the status is already 200)."""
    want_lp = job.n_logprobs is not None
    offset = 0
    try:
        if shape.chat:
            yield _sse_line(shape.chunk(None, first=True))
        while True:  # a client that leaves cancels this generator (Starlette watches)
            ev = await job.events.get()
            if ev[0] == "tokens":
                if ev[2] or (want_lp and ev[3]):
                    yield _sse_line(shape.chunk(ev[2], probs=ev[3] if want_lp else None,
                                                offset=offset))
                    offset += len(ev[2])
            elif ev[0] == "error":
                yield _sse_line(_error_of(ev[1]).body())
                return
            else:
                _, finish, out, metrics, end = ev
                last = shape.chunk(None if shape.chat else "", finish)
                last["timings"] = timings(metrics, n_prompt, len(out))
                last["truncated"] = end["truncated"]
                if req.return_tokens:
                    last["tokens"] = out
                yield _sse_line(last)
                if req.include_usage():
                    yield _sse_line({**shape._head(True), "choices": [],
                                     "usage": shape.usage(n_prompt, len(out))})
                yield _sse_line("[DONE]")
                return
    finally:
        job.cancel.set()  # the client left (or we are done): stop at the next step


def log_line(msg: str) -> None:
    print(f"mtplib serve: {msg}", file=sys.stderr, flush=True)


class LimitedLog:
    """At most ``lines`` lines per ``window_s`` (peers that leave or stall must not fill
    the log), then one line saying how many were dropped."""

    def __init__(self, write: Callable[[str], None] = log_line, lines: int = 20,
                 window_s: float = 10.0) -> None:
        self.write, self.lines, self.window_s = write, lines, window_s
        self.t0, self.n, self.dropped = -math.inf, 0, 0
        self.lock = threading.Lock()

    def __call__(self, msg: str) -> None:
        now = time.monotonic()
        with self.lock:
            dropped = 0
            if now - self.t0 > self.window_s:
                dropped, self.dropped, self.t0, self.n = self.dropped, 0, now, 0
            self.n += 1
            if self.n > self.lines:
                self.dropped += 1
                return
        if dropped:
            self.write(f"({dropped} similar lines dropped in {self.window_s:g} s)")
        self.write(msg)


limited_log = LimitedLog()

#: the scope key a connection deadline sets before it closes a request's connection (read
#: by the body reader, which then names the deadline instead of a client that left)
DEADLINE_KEY = "mtplib.deadline"


def deadline_protocol(header_s: float, body_s: float, base: type | None = None) -> type:
    """uvicorn's HTTP protocol class (``base``, default its auto choice) with two deadlines
    per request, which uvicorn lacks (an idle or 1-byte/s peer held a connection for ever):
    the request line and headers within ``header_s`` of the connection or of the previous
    response, the body within ``body_s`` of the headers. A connection past one is answered
    408 (when it sent part of a request) and closed; the time after the body (the
    generation) is not bounded here."""
    if base is None:
        from uvicorn.protocols.http.auto import AutoHTTPProtocol as base  # noqa: N813

    class DeadlineProtocol(base):  # type: ignore[misc, valid-type]
        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._seen, self._timer, self._phase, self._bytes = None, None, None, 0
            self._arm("headers")

        def data_received(self, data: bytes) -> None:
            self._bytes += len(data)
            super().data_received(data)
            self._follow()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing():
                self._arm("headers")
                self._follow()  # a pipelined request may have started in there

        def connection_lost(self, exc) -> None:
            self._arm(None)
            super().connection_lost(exc)

        def _follow(self) -> None:
            """Move to the body's deadline when a request's headers are in, and off it
            when its body is."""
            c = self.cycle
            if c is not None and c is not self._seen:
                self._seen = c
                self._arm("body" if c.more_body else None)
            elif c is not None and self._phase == "body" and not c.more_body:
                self._arm(None)

        def _arm(self, phase: str | None) -> None:
            if self._timer is not None:
                self._timer.cancel()
            self._phase, self._timer, self._bytes = phase, None, 0
            if phase is not None:
                t = header_s if phase == "headers" else body_s
                self._timer = self.loop.call_later(t, self._expired, phase, t)

        def _expired(self, phase: str, t: float) -> None:
            self._timer = None
            if self.transport.is_closing():
                return
            what = (f"no complete request headers within {t:g} s" if phase == "headers"
                    else f"the body did not arrive within {t:g} s of the headers")
            if phase == "body" and self.cycle is not None:
                self.cycle.scope[DEADLINE_KEY] = f"closed: {what}"  # the reader logs it
            if phase == "body" or self._bytes:
                body = json.dumps(ApiError(408, f"request timeout: {what}",
                                           type="timeout_error").body()).encode()
                self.transport.write(b"HTTP/1.1 408 Request Timeout\r\n"
                                     b"content-type: application/json\r\n"
                                     b"connection: close\r\n"
                                     b"content-length: %d\r\n\r\n%s" % (len(body), body))
            self.transport.close()

    return DeadlineProtocol


class CutAtShutdown:
    """Pure ASGI, outermost: a request uvicorn cancels at the end of its graceful shutdown
    (the worker did not answer it in time, e.g. a step that hangs) is answered 503 in
    OpenAI's shape instead of uvicorn's plain-text 500 and a traceback; a stream that
    already started gets the error as its last event. Any other cancellation passes."""

    def __init__(self, app, stopping: threading.Event) -> None:
        self.app, self.stopping = app, stopping

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        state = {"started": False, "ended": False, "sse": False}

        async def watch(msg) -> None:
            if msg["type"] == "http.response.start":
                state["started"] = True
                ctype = dict(msg.get("headers") or []).get(b"content-type", b"")
                state["sse"] = ctype.startswith(b"text/event-stream")
            elif msg["type"] == "http.response.body" and not msg.get("more_body"):
                state["ended"] = True
            await send(msg)

        try:
            await self.app(scope, receive, watch)
        except asyncio.CancelledError:
            if not self.stopping.is_set() or state["ended"]:
                raise
            err = shutting_down("the request was cut after --shutdown-timeout")
            if not state["started"]:
                await err.response()(scope, receive, send)
            else:
                tail = _sse_line(err.body()) if state["sse"] else b""
                await send({"type": "http.response.body", "body": tail, "more_body": False})
