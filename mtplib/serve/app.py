"""The FastAPI app over a running worker (`create_app`): the error handlers (every refusal
in OpenAI's shape, never FastAPI's ``{"detail"}``), the ASGI edges, and the OpenAI and
llama-server routes."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator, Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from mtplib.serve.edges import BearerAuth, Cors, CutAtShutdown
from mtplib.serve.errors import ApiError, ClientGone, error_of
from mtplib.serve.logs import LimitedLog, log_line
from mtplib.serve.protocol import validation_error
from mtplib.serve.routes_native import native_router
from mtplib.serve.routes_openai import openai_router
from mtplib.serve.serving import Generations
from mtplib.serve.tokenizing import Tokenizer
from mtplib.serve.worker import GenerationWorker

#: the log of clients that left (one line each, rate-limited)
limited_log = LimitedLog()


def create_app(worker: GenerationWorker, *, on_shutdown: Callable[[], None] = lambda: None
               ) -> FastAPI:
    """The app over a running worker. ``on_shutdown`` runs in the lifespan's end (after
    uvicorn finished or cancelled the in-flight requests)."""

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        yield
        on_shutdown()

    app = FastAPI(title="mtplib serve", docs_url=None, redoc_url=None, openapi_url=None,
                  lifespan=lifespan)
    add_error_handlers(app)
    cfg = worker.cfg
    if cfg.api_key is not None:
        app.add_middleware(BearerAuth, key=cfg.api_key)
    if cfg.cors_origins:
        app.add_middleware(Cors, origins=cfg.cors_origins)  # a preflight needs no key
    app.add_middleware(CutAtShutdown, stopping=worker.stopping)  # outermost
    gens = Generations(worker)
    app.include_router(openai_router(gens))
    app.include_router(native_router(gens, Tokenizer(worker.backend, cfg, worker.health)))
    return app


def add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def api_error(_req: Request, e: ApiError) -> JSONResponse:
        return e.response()

    @app.exception_handler(RequestValidationError)
    async def bad_param(_req: Request, e: RequestValidationError) -> JSONResponse:
        # a query parameter of the wrong type (/slots?fail_on_no_slot=abc): 400 in this
        # service's shape, as llama-server answers bad input, not FastAPI's {"detail"} 422
        return validation_error(e).response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_req: Request, e: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return ApiError(e.status_code, str(e.detail), type=kind).response()

    @app.exception_handler(ClientGone)
    async def gone(req: Request, e: ClientGone) -> Response:
        peer = "{}:{}".format(*req.client) if req.client else "a client"
        limited_log(f"{peer} {req.method} {req.url.path}: {e}")
        return Response(status_code=499)  # never read: the connection is gone

    @app.exception_handler(Exception)
    async def bug(_req: Request, e: Exception) -> JSONResponse:
        log_line(f"internal error: {type(e).__name__}: {e}", logging.ERROR)
        return error_of(e).response()
