"""The ASGI edges around the app, pure ASGI (not BaseHTTPMiddleware, which would pass
every streamed chunk through an extra task): the API key (`BearerAuth`), CORS for browser
pages (`Cors`), and the shutdown's last word on a request uvicorn cancels
(`CutAtShutdown`)."""

from __future__ import annotations

import asyncio
import hmac
import threading

from mtplib.serve.errors import ApiError, shutting_down
from mtplib.serve.sse import sse_line

#: the paths llama-server serves without a key
PUBLIC_PATHS = frozenset({"/health", "/v1/health"})


class BearerAuth:
    """``Authorization: Bearer KEY`` or llama-server's ``X-Api-Key: KEY`` on every path but
    /health, compared in constant time; a CORS preflight (OPTIONS) never carries a key and
    is answered by `Cors` before this."""

    def __init__(self, app, key: str) -> None:
        self.app, self.key = app, key.encode()

    def ok(self, headers: dict) -> bool:
        scheme, _, token = headers.get(b"authorization", b"").partition(b" ")
        bearer = scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.key)
        xkey = hmac.compare_digest(headers.get(b"x-api-key", b"").strip(), self.key)
        return bearer or xkey

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"] not in PUBLIC_PATHS \
                and not self.ok(dict(scope["headers"])):
            resp = ApiError(401, "missing or wrong API key (Authorization: Bearer KEY, or "
                            "X-Api-Key: KEY)", type="authentication_error").response()
            await resp(scope, receive, send)
            return
        await self.app(scope, receive, send)


class Cors:
    """CORS for browser pages, as llama-server answers it: any OPTIONS request (a
    preflight) gets 200 with an empty body and no key needed, naming the methods and the
    headers the page asked for (the API key's among them); an Origin that is not allowed
    gets no Access-Control-Allow-Origin (the browser then refuses). Other responses to an
    allowed Origin carry Access-Control-Allow-Origin. No credentials are allowed (the key
    travels in a header, never a cookie)."""

    METHODS, HEADERS = b"GET, POST, OPTIONS", b"Authorization, Content-Type, X-Api-Key"

    def __init__(self, app, origins: tuple[str, ...]) -> None:
        self.app, self.origins = app, origins

    def allow(self, origin: bytes) -> bytes | None:
        if "*" in self.origins:
            return b"*"
        return origin if origin.decode("latin-1") in self.origins else None

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        origin = headers.get(b"origin")
        allow = self.allow(origin) if origin else None
        if scope["method"] == "OPTIONS":
            out = [(b"vary", b"Origin"), (b"content-length", b"0"),
                   (b"content-type", b"text/html")]
            if allow is not None:
                asked = headers.get(b"access-control-request-headers")
                out += [(b"access-control-allow-origin", allow),
                        (b"access-control-allow-methods", self.METHODS),
                        (b"access-control-allow-headers",
                         self.HEADERS + b", " + asked if asked else self.HEADERS),
                        (b"access-control-max-age", b"600")]
            await send({"type": "http.response.start", "status": 200, "headers": out})
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


class CutAtShutdown:
    """Outermost: a request uvicorn cancels at the end of its graceful shutdown (the worker
    did not answer it in time, e.g. a step that hangs) is answered 503 in OpenAI's shape
    instead of uvicorn's plain-text 500 and a traceback; a stream that already started gets
    the error as its last event. Any other cancellation passes."""

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
                tail = sse_line(err.body()) if state["sse"] else b""
                await send({"type": "http.response.body", "body": tail, "more_body": False})
