"""A request's JSON body, read with a byte limit (`read_json`) and checked for what
Python's json accepts but no later step can use (`decode_body`, `lone_surrogate`).

Why here and not in pydantic: the limit must hold while reading (a client may send more
than it announced), and a lone UTF-16 surrogate would reach the tokenizer or a response as
a str that no UTF-8 step can encode (a 500), so every endpoint refuses it as a 400."""

from __future__ import annotations

import json
import re
from typing import Any

from starlette.requests import ClientDisconnect, Request

from mtplib.serve.deadlines import DEADLINE_KEY
from mtplib.serve.errors import ApiError, ClientGone

SURROGATE = re.compile("[\ud800-\udfff]")


async def read_json(request: Request, limit: int) -> dict:
    """The body as a JSON object: 413 past ``limit`` bytes, 400 when it is not one; a
    client that leaves mid-body (or a body deadline) is `ClientGone`."""
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
    return decode_body(bytes(buf))


def decode_body(buf: bytes) -> dict:
    """``buf`` as a JSON object, or the 400 saying why not."""
    try:
        data = json.loads(buf)
    except (ValueError, RecursionError) as e:
        raise ApiError(400, f"the request body is not valid JSON ({type(e).__name__}: "
                       f"{str(e)[:200]})") from None
    if not isinstance(data, dict):
        raise ApiError(400, "the request body must be a JSON object")
    if b"\\u" in buf or not buf.isascii():  # else it cannot hold a surrogate
        where = lone_surrogate(data)
        if where is not None:
            raise ApiError(400, f"the request body is not valid JSON text: {where} holds an "
                           "unpaired UTF-16 surrogate (\\ud800-\\udfff), which is no "
                           "Unicode character", param=where)
    return data


def lone_surrogate(data: dict) -> str | None:
    """Where parsed JSON holds a lone surrogate ("messages.0.content"), or None. Python's
    json reads "\\ud800" (or its raw bytes) into a str that no UTF-8 step can encode, so
    every endpoint refuses such a body, as llama-server's parser does; keys are shown
    escaped (the answer is UTF-8)."""
    todo: list[tuple[str, Any]] = [("", data)]
    while todo:
        path, v = todo.pop()
        if isinstance(v, str):
            if not v.isascii() and SURROGATE.search(v):
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
            if isinstance(k, str) and SURROGATE.search(k):
                return f"{path}.{name}" if path else name
            kids.append((f"{path}.{name}" if path else name, x))
        todo += reversed(kids)  # depth first, in the body's order
    return None
