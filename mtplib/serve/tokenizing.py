"""llama-server's /tokenize, /detokenize and /apply-template without HTTP (`Tokenizer`):
the backend's tokenizer, called from the event loop in a thread.

Why bounded: each call holds a thread while a generation runs (the backend serializes its
tokenizer with the running step), so at most `CALLS_MAX` wait at once; more are a 503, as
is any call while the shards are being reconnected."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from mtplib.errors import InputError, MtplibError
from mtplib.runtime.backend import Backend
from mtplib.serve.chat import render_chat
from mtplib.serve.config import ServeConfig
from mtplib.serve.errors import ApiError, unavailable
from mtplib.serve.faults import BackendHealth, answer
from mtplib.serve.protocol import DetokenizeRequest, TemplateRequest, TokenizeRequest
from mtplib.serve.tokens import check_ids, strip_bos

#: /tokenize and /detokenize calls that may wait at once for the backend (each holds a
#: thread while a generation runs)
CALLS_MAX = 4


@dataclass(frozen=True)
class Tokenized:
    """/tokenize's result: the ids, and each one's text when asked (with_pieces)."""

    tokens: list[int]
    pieces: list[str] | None = None


class Tokenizer:
    """The tokenizer endpoints' logic over a backend and its health."""

    def __init__(self, backend: Backend, cfg: ServeConfig, health: BackendHealth) -> None:
        self.backend, self.cfg, self.health = backend, cfg, health
        self._calls = asyncio.Semaphore(CALLS_MAX)

    async def call(self, fn: Callable[[Backend], Any]) -> Any:
        """``fn(backend)`` in a thread; at most ``CALLS_MAX`` at once, more 503."""
        if self._calls.locked():
            raise unavailable(f"the server is busy: {CALLS_MAX} tokenizer calls already "
                              "wait for the running generation; retry later")
        if self.health.fault is not None:
            raise unavailable(self.health.refusal())
        async with self._calls:
            try:
                return await asyncio.to_thread(fn, self.backend)
            except InputError as e:
                raise ApiError(400, str(e)) from None
            except MtplibError as e:
                raise answer(self.health, e) from None

    async def tokenize(self, req: TokenizeRequest) -> Tokenized:
        if not req.parse_special:
            # the backend's tokenize parses special tokens; plain text is not reachable
            raise ApiError(400, "parse_special false is not supported (special tokens "
                           "are always parsed)", param="parse_special")
        toks = await self.call(lambda be: be.tokenize(req.content))
        if not req.add_special:
            toks = strip_bos(self.cfg, toks)
        if not req.with_pieces:
            return Tokenized(toks)
        pieces = await self.call(lambda be: [be.detokenize([t]) for t in toks])
        return Tokenized(toks, pieces)

    async def detokenize(self, req: DetokenizeRequest) -> str:
        check_ids(self.cfg, req.tokens, "tokens")
        return await self.call(lambda be: be.detokenize(req.tokens))

    def apply_template(self, req: TemplateRequest) -> str:
        return render_chat(self.cfg, req.messages)
