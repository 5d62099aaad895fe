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
import sys
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from mtplib.errors import InputError, MtplibError

#: ChatML, llama-server's template for a model whose GGUF has none (the trained pair)
CHATML = "<|im_start|>{role}\n{content}<|im_end|>\n"
#: OpenAI's bound on stop sequences per request, and ours on their length
MAX_STOPS, MAX_STOP_CHARS = 4, 256
#: a stream sends what the steps emitted at most this often (the first step at once):
#: each event wakes the event loop, which then competes with the generation for the GIL
STREAM_EVERY_S = 0.025


class ApiError(Exception):
    """A refusal with its HTTP status, in OpenAI's error shape."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | int | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param = status, message, type, param
        self.code = status if code is None else code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}

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


# -- requests ---------------------------------------------------------------------------
class _Request(BaseModel):
    """Fields both endpoints take. Unknown fields are ignored (clients send their own
    extras); known ones mtplib cannot honour are refused rather than silently dropped."""

    model_config = ConfigDict(extra="ignore", strict=True)

    model: str | None = None
    max_tokens: int | None = Field(None, ge=0)
    n_predict: int | None = Field(None, ge=0)  # llama-server's name
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    seed: int | None = Field(None, ge=0)
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    n: int = 1
    stop: str | list[str] | None = None
    ignore_eos: bool = False  # llama-server's: generate exactly max_tokens
    return_tokens: bool = False  # llama-server's: add the generated token ids
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logprobs: bool | int | None = None
    logit_bias: dict[str, float] | None = None

    def unsupported(self) -> tuple[str, str] | None:
        """(param, why) for a known option set to something mtplib does not do."""
        if self.n != 1:
            return "n", "n must be 1 (one choice per request)"
        stops = self.stop_list()
        if len(stops) > MAX_STOPS or any(not x or len(x) > MAX_STOP_CHARS for x in stops):
            return "stop", (f"stop takes up to {MAX_STOPS} non-empty strings of at most "
                            f"{MAX_STOP_CHARS} characters")
        for name in ("frequency_penalty", "presence_penalty"):
            v = getattr(self, name)
            if v not in (None, 0, 0.0):
                return name, f"{name} is not supported (only 0)"
        if self.logprobs not in (None, False, 0):
            return "logprobs", "logprobs are not supported"
        if self.logit_bias:
            return "logit_bias", "logit_bias is not supported"
        return None

    def stop_list(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def n_new(self, default: int) -> int:
        for v in (self.max_tokens, self.n_predict):
            if v is not None:
                return v
        return default

    def include_usage(self) -> bool:
        return bool((self.stream_options or {}).get("include_usage"))


class CompletionRequest(_Request):
    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    def unsupported(self) -> tuple[str, str] | None:
        if self.echo:
            return "echo", "echo is not supported"
        if self.best_of not in (None, 1):
            return "best_of", "best_of must be 1"
        if self.suffix:
            return "suffix", "suffix (insertion) is not supported"
        return super().unsupported()

    def one_prompt(self) -> str | list[int]:
        """The prompt as text or token ids; a batch of more than one is refused."""
        p = self.prompt
        if isinstance(p, list) and p and not isinstance(p[0], int):
            if len(p) != 1:
                raise ApiError(400, f"prompt holds {len(p)} prompts; send one per request",
                               param="prompt")
            p = p[0]
        if isinstance(p, list) and not p:
            raise ApiError(400, "prompt is empty", param="prompt")
        return p


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart] | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""


class ChatRequest(_Request):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=0)

    def n_new(self, default: int) -> int:
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return super().n_new(default)


def _validation_error(e: ValidationError) -> ApiError:
    first = e.errors()[0]
    loc = ".".join(str(x) for x in first["loc"])
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


@dataclass
class Job:
    """One request's generation: posted to the worker, events come back on ``events``."""

    prompt: str | list[int]
    n_new: int
    sampler: Any
    ignore_eos: bool
    loop: asyncio.AbstractEventLoop
    stop: list[str] = field(default_factory=list)
    #: post each step's text as it comes (a stream); else once, with the result
    stream: bool = False
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancel: threading.Event = field(default_factory=threading.Event)

    def post(self, kind: str, *payload: Any) -> None:
        with contextlib.suppress(RuntimeError):  # the loop is gone: nobody listens
            self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, *payload))


class GenerationWorker:
    """The one thread that touches the backend: a bounded FIFO of jobs, one at a time."""

    def __init__(self, backend: Any, cfg: ServeConfig,
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
        self.thread = threading.Thread(target=self._loop, name="mtplib-serve-worker",
                                       daemon=True)
        self.thread.start()

    def submit(self, job: Job) -> None:
        with self._gate:
            if self.stopping.is_set():
                raise shutting_down()
            try:
                self.jobs.put_nowait(job)
            except queue.Full:
                raise ApiError(503, f"the server is busy: {self.cfg.queue_max} requests "
                               "already wait for the running one; retry later",
                               type="unavailable_error") from None

    def pending(self) -> int:
        return self.jobs.qsize() + int(self.busy.is_set())

    def begin_shutdown(self) -> int:
        """SIGTERM: refuse new jobs and answer the waiting ones 503 now (the running one
        may finish until `cut`); how many were waiting."""
        n = 0
        with self._gate:
            self.stopping.set()
            while True:
                try:
                    job = self.jobs.get_nowait()
                except queue.Empty:
                    break
                if job is not None:
                    n += 1
                    job.post("error", shutting_down("the request was waiting"))
            with contextlib.suppress(queue.Full):
                self.jobs.put_nowait(None)  # wakes the loop, which then ends
        return n

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
            job = self.jobs.get()
            if job is None:
                return
            if job.cancel.is_set():
                continue
            self.busy.set()
            try:
                self._run(job)
            except BaseException as e:  # noqa: BLE001 - reported to the request, never fatal
                if not isinstance(e, MtplibError | ApiError):
                    self.log(f"generation failed: {type(e).__name__}: {e}")
                job.post("error", _error_of(e))
            finally:
                self.busy.clear()
                self.served += 1

    def _check_prompt(self, toks: list[int], n_new: int) -> None:
        c = self.cfg
        if not toks:
            raise ApiError(400, "the prompt has no tokens", param="prompt")
        bad = next((t for t in toks if not 0 <= t < c.n_vocab), None)
        if bad is not None:
            raise ApiError(400, f"token id {bad} out of range [0, {c.n_vocab})", param="prompt")
        if len(toks) + n_new > c.n_ctx:
            raise ApiError(400, f"the prompt ({len(toks)} tokens) + max_tokens {n_new} exceed "
                           f"the context of {c.n_ctx} tokens; shorten the prompt or lower "
                           "max_tokens", type="exceed_context_size_error")

    def _run(self, job: Job) -> None:
        be = self.backend
        toks = list(job.prompt) if isinstance(job.prompt, list) else be.tokenize(job.prompt)
        self._check_prompt(toks, job.n_new)
        job.post("start", len(toks))
        finish, out, pieces, pend = "length", [], [], []
        text = StopText(job.stop)
        t0 = time.perf_counter()
        t_post = 0.0
        t_first = t_last = None
        with be.stream(toks, job.n_new, sampler=job.sampler) as gen:
            for chunk in gen:
                chunk = list(chunk)
                if job.cancel.is_set() or self.cutting.is_set():
                    finish = "abort"
                    break
                if not job.ignore_eos:
                    cut = next((i for i, t in enumerate(chunk) if t in self.cfg.eog), None)
                    if cut is not None:
                        chunk, finish = chunk[:cut], "stop"
                t_last = time.perf_counter()
                t_first = t_first or t_last
                out += chunk
                piece, hit = text.feed(be.detokenize(chunk) if chunk else "")
                pend += chunk
                pieces.append(piece)
                if job.stream and t_last - t_post >= STREAM_EVERY_S and (pend or piece):
                    job.post("tokens", pend, "".join(pieces))
                    pend, pieces, t_post = [], [], t_last
                if hit:
                    finish = "stop"
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
            job.post("tokens", pend, rest)
        if not metrics:  # stopped early: the timings from this side's clock
            metrics = {"n_prompt": len(toks), "n_generated": len(out),
                       "ttft_s": (t_first - t0) if t_first else None,
                       "decode_s": (t_last - t_first) if t_first else 0.0}
        for v in metrics.get("wire_violations") or []:  # only with --allow-cache-crossing
            self.log(f"contract violation in this request: {v}")
        job.post("done", finish, out, metrics)


class StopText:
    """The text a generation may show, with stop sequences: text that could still grow into
    a stop sequence is held back; at a stop sequence the text ends before it."""

    def __init__(self, stops: list[str]) -> None:
        self.stops, self.held, self.done = stops, "", False

    def feed(self, piece: str) -> tuple[str, bool]:
        """(text to show now, whether a stop sequence was reached)."""
        if self.done:
            return "", True
        buf = self.held + piece
        hits = [i for i in (buf.find(s) for s in self.stops) if i >= 0]
        if hits:
            self.held, self.done = "", True
            return buf[:min(hits)], True
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
    return data


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
    app.add_middleware(CutAtShutdown, stopping=worker.stopping)  # outermost

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok", "model": cfg.model_id, "pending": worker.pending()}

    def model_card() -> dict:
        return {"id": cfg.model_id, "object": "model", "created": int(time.time()),
                "owned_by": "mtplib", "meta": {"n_ctx": cfg.n_ctx, "n_vocab": cfg.n_vocab,
                                               "draft": cfg.k, **cfg.meta}}

    @app.get("/v1/models")
    @app.get("/models")
    async def models() -> dict:
        return {"object": "list", "data": [model_card()]}

    async def parse(request: Request, kind: type[_Request]) -> _Request:
        data = await _read_json(request, cfg.max_body_bytes)
        try:
            req = kind.model_validate(data)
        except ValidationError as e:
            raise _validation_error(e) from None
        if req.model is not None and req.model != cfg.model_id:
            raise ApiError(404, f"model {req.model!r} is not served here; this server "
                           f"serves {cfg.model_id!r} (GET /v1/models)", param="model",
                           code="model_not_found")
        bad = req.unsupported()
        if bad:
            raise ApiError(400, bad[1], param=bad[0])
        n = req.n_new(cfg.default_n)
        if n > cfg.n_ctx:
            raise ApiError(400, f"max_tokens {n} exceeds the context of {cfg.n_ctx} tokens",
                           param="max_tokens")
        return req

    def sampler_of(req: _Request):
        from mtplib.runtime.sampling import Sampler

        t = cfg.default_temperature if req.temperature is None else req.temperature
        p = cfg.default_top_p if req.top_p is None else req.top_p
        s = cfg.default_seed if req.seed is None else req.seed
        if not math.isfinite(t):
            raise ApiError(400, f"temperature must be finite, got {t}", param="temperature")
        try:
            return Sampler(temperature=t, top_p=p, seed=s)
        except InputError as e:
            raise ApiError(400, str(e)) from None

    async def start(request: Request, req: _Request, prompt: str | list[int]) -> tuple:
        job = Job(prompt=prompt, n_new=req.n_new(cfg.default_n), sampler=sampler_of(req),
                  ignore_eos=req.ignore_eos, loop=asyncio.get_running_loop(),
                  stop=req.stop_list(), stream=req.stream)
        worker.submit(job)
        try:
            ev = await _next_event(request, job)
        except BaseException:
            job.cancel.set()
            raise
        if ev[0] == "error":
            raise ev[1]
        return job, ev[1]

    async def complete(request: Request, req: _Request, prompt, shape: Shape) -> Response:
        job, n_prompt = await start(request, req, prompt)
        if req.stream:
            return StreamingResponse(
                _sse(request, job, req, shape, n_prompt), media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        text, toks = [], []
        try:
            while True:
                ev = await _next_event(request, job)
                if ev[0] == "tokens":
                    toks += ev[1]
                    text.append(ev[2])
                elif ev[0] == "error":
                    raise ev[1]
                else:
                    _, finish, out, metrics = ev
                    break
        finally:
            job.cancel.set()  # a no-op when done; stops a generation nobody waits for
        body = shape.whole("".join(text), finish, n_prompt, out, metrics)
        if req.return_tokens:
            body["tokens"] = out
        return JSONResponse(body)

    @app.post("/v1/completions")
    @app.post("/completions")
    async def completions(request: Request) -> Response:
        req = await parse(request, CompletionRequest)
        assert isinstance(req, CompletionRequest)
        return await complete(request, req, req.one_prompt(), Shape(cfg.model_id, chat=False))

    @app.post("/v1/chat/completions")
    @app.post("/chat/completions")
    async def chat(request: Request) -> Response:
        req = await parse(request, ChatRequest)
        assert isinstance(req, ChatRequest)
        prompt = _render_chat(cfg, req.messages)
        return await complete(request, req, prompt, Shape(cfg.model_id, chat=True))

    return app


class BearerAuth:
    """``Authorization: Bearer KEY`` on every path but /health, compared in constant time.
    Pure ASGI (not BaseHTTPMiddleware, which would pass every streamed chunk through an
    extra task)."""

    def __init__(self, app, key: str) -> None:
        self.app, self.key = app, key.encode()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"] != "/health":
            got = dict(scope["headers"]).get(b"authorization", b"")
            scheme, _, token = got.partition(b" ")
            if not (scheme.lower() == b"bearer"
                    and hmac.compare_digest(token.strip(), self.key)):
                resp = ApiError(401, "missing or wrong API key (Authorization: Bearer KEY)",
                                type="authentication_error").response()
                await resp(scope, receive, send)
                return
        await self.app(scope, receive, send)


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
    id: str = field(default_factory=lambda: uuid.uuid4().hex[:24])
    created: int = field(default_factory=lambda: int(time.time()))

    def _head(self, stream: bool) -> dict:
        if self.chat:
            obj = "chat.completion.chunk" if stream else "chat.completion"
            return {"id": f"chatcmpl-{self.id}", "object": obj, "created": self.created,
                    "model": self.model}
        return {"id": f"cmpl-{self.id}", "object": "text_completion", "created": self.created,
                "model": self.model}

    @staticmethod
    def usage(n_prompt: int, n_out: int) -> dict:
        return {"prompt_tokens": n_prompt, "completion_tokens": n_out,
                "total_tokens": n_prompt + n_out}

    def whole(self, text: str, finish: str, n_prompt: int, out: list[int], metrics: dict
              ) -> dict:
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text},
                      "logprobs": None, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
        return {**self._head(False), "choices": [choice],
                "usage": self.usage(n_prompt, len(out)),
                "timings": timings(metrics, n_prompt, len(out))}

    def chunk(self, text: str | None, finish: str | None = None, *, first: bool = False
              ) -> dict:
        if self.chat:
            delta: dict = {"role": "assistant", "content": ""} if first else {}
            if text is not None:
                delta["content"] = text
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": text or "", "logprobs": None,
                      "finish_reason": finish}
        return {**self._head(True), "choices": [choice]}


def _sse_line(obj: dict | str) -> bytes:
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj)}\n\n".encode()


async def _sse(request: Request, job: Job, req: _Request, shape: Shape, n_prompt: int
               ) -> AsyncIterator[bytes]:
    """Server-sent events: one chunk per step's tokens, the last with finish_reason and
    timings (and usage when stream_options.include_usage), then ``[DONE]``. An error after
    the first byte is sent as an event with an "error" object (the status is already 200)."""
    try:
        if shape.chat:
            yield _sse_line(shape.chunk(None, first=True))
        while True:  # a client that leaves cancels this generator (Starlette watches)
            ev = await job.events.get()
            if ev[0] == "tokens":
                if ev[2]:
                    yield _sse_line(shape.chunk(ev[2]))
            elif ev[0] == "error":
                yield _sse_line(_error_of(ev[1]).body())
                return
            else:
                _, finish, out, metrics = ev
                last = shape.chunk(None if shape.chat else "", finish)
                last["timings"] = timings(metrics, n_prompt, len(out))
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
