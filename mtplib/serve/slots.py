"""A request's view of its batch slot: `SlotStream` (shaped as the backend's
`Generation`) and `SlotBackend` (what `RequestRunner` streams from), and the messages a
request thread sends the scheduler (`Join`, `Leave`, `Exit`).

Why shaped as a generation: the request's code is the one-slot service's, unchanged; only
where its tokens come from differs (the scheduler's steps, through a queue)."""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Protocol

from mtplib.runtime.model import RuntimeInputError


@dataclass(frozen=True)
class Join:
    """A request's first iteration: prefill its prompt in a slot."""

    stream: SlotStream


@dataclass(frozen=True)
class Leave:
    """A request that ends before its slot's generation does (stop, client gone, cut)."""

    stream: SlotStream


@dataclass(frozen=True)
class Exit:
    """A request thread ended: its slot is free."""

    thread: threading.Thread


Control = Join | Leave | Exit


@dataclass(frozen=True)
class SlotEnd:
    """The slot's generation ended: its metrics (None: the batch reported none)."""

    metrics: Any


class Slots(Protocol):
    """What a slot's stream needs of the scheduler."""

    def control(self, msg: Control) -> None: ...

    def piece(self, token: int) -> str: ...


class SlotStream:
    """One request's generation in a slot, shaped as the backend's `Generation` (iterate
    for each step's tokens, then ``metrics``; ``close`` leaves the slot). The scheduler
    joins it at the first iteration and hands it tokens (`give`), its end or a failure."""

    def __init__(self, slots: Slots, tokens: list[int], n_new: int, sampler: Any) -> None:
        self.slots, self.tokens, self.n_new, self.sampler = slots, tokens, n_new, sampler
        self._q: queue.Queue[list[int] | SlotEnd | BaseException] = queue.Queue()
        self.seq: int | None = None
        self.ended = False
        self._metrics = None

    # -- the scheduler's side -----------------------------------------------------------
    def give(self, tokens: list[int]) -> None:
        self._q.put(tokens)

    def end(self, metrics: Any) -> None:
        self._q.put(SlotEnd(metrics))

    def fail(self, e: BaseException) -> None:
        self._q.put(e)

    # -- the request's side -------------------------------------------------------------
    def __iter__(self) -> Iterator[list[int]]:
        self.slots.control(Join(self))
        while True:
            item = self._q.get()
            if isinstance(item, SlotEnd):
                self.ended, self._metrics = True, item.metrics
                return
            if isinstance(item, BaseException):  # the join or a step failed
                self.ended = True
                raise item
            yield item

    @property
    def metrics(self):
        if self._metrics is None:
            raise RuntimeInputError("the generation has not finished")
        return self._metrics

    def close(self) -> None:
        if not self.ended:
            self.ended = True
            self.slots.control(Leave(self))

    def __enter__(self) -> SlotStream:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class SlotBackend:
    """What a request's `RequestRunner` streams from: its slot; text calls go to the
    backend itself, but each token's text is asked once (`Slots.piece`)."""

    def __init__(self, slots: Slots, backend: Any) -> None:
        self.slots, self.backend = slots, backend

    def stream(self, tokens: list[int], n_new: int, *, sampler: Any = None) -> SlotStream:
        return SlotStream(self.slots, list(tokens), n_new, sampler)

    def detokenize(self, tokens: list[int]) -> str:
        return "".join(self.slots.piece(t) for t in tokens)

    def tokenize(self, text: str) -> list[int]:
        return self.backend.tokenize(text)
