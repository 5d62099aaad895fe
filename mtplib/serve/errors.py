"""The service's refusals and failures as responses: `ApiError` (OpenAI's error shape,
``{"error": {"message", "type", "param", "code"}}``), the shutdown's 503, a client that left.

Why one place: every layer (request models, the worker thread, the ASGI edges) refuses in
the same shape, and a failure inside a generation maps to one status by one rule
(`error_of`)."""

from __future__ import annotations

from fastapi.responses import JSONResponse

from mtplib.errors import InputError, MtplibError


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


def unavailable(message: str, extra: dict | None = None) -> ApiError:
    """A 503: busy, degraded, or a shard that failed the request."""
    return ApiError(503, message, type="unavailable_error", extra=extra)


def shutting_down(what: str = "") -> ApiError:
    """The 503 of a request the shutdown (SIGTERM) refuses or cuts."""
    return unavailable("the server is shutting down" + (f": {what}" if what else ""))


class ClientGone(Exception):
    """The client closed its connection before its request was answered (mid-body, or
    while waiting): logged in one line, nothing to answer."""


def error_of(e: BaseException) -> ApiError:
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
