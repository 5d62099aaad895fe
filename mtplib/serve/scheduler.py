"""How the worker thread takes requests to the backend: the `Scheduler` interface, what
every scheduler works with (`Parts`), and the one-slot scheduler (`SingleScheduler`: one
request at a time, in arrival order). The batched one is `mtplib.serve.batch`.

Why an interface: the worker (queue, shutdown, health, the HTTP side's view) is the same
for one slot and for N; only the loop that admits and steps requests differs, and each
implementation is whole on its own rather than a subclass that silences its parent."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from mtplib.runtime.backend import Backend
from mtplib.serve.errors import unavailable
from mtplib.serve.faults import RECHECK_S, BackendHealth
from mtplib.serve.generation import RequestRunner
from mtplib.serve.jobs import JobQueue


class Scheduler(Protocol):
    """The worker thread's loop over the queue, and how many slots it keeps busy."""

    def loop(self) -> None:
        """Serve until the queue ends (None) or the service stops; in the worker thread."""
        ...

    def n_busy(self) -> int:
        """Slots running a generation now."""
        ...

    def wake(self) -> None:
        """Something changed for the loop (a job queued, the shutdown began)."""
        ...


@dataclass
class Parts:
    """What a scheduler works with, owned by the worker."""

    backend: Backend
    jobs: JobQueue
    health: BackendHealth
    runner: RequestRunner
    #: set while a generation runs (in any slot)
    busy: threading.Event
    log: Callable[[str], None]


def recover(p: Parts) -> None:
    """Degraded: reconnect the shards (backoff, or at once for a waiting request) until
    whole or stopping; the requests that waited for a failed attempt get the 503."""

    def failed() -> None:  # the requests that waited for this attempt
        p.jobs.refuse_waiting(unavailable(p.health.refusal()))

    p.health.recover(p.jobs.stopping, failed)


class SingleScheduler:
    """One request at a time, streaming from the backend itself."""

    def __init__(self, parts: Parts) -> None:
        self.parts = parts

    def loop(self) -> None:
        p = self.parts
        while not p.jobs.stopping.is_set():
            if p.health.check() is not None:  # a fault: seen idle, or by the last job
                recover(p)
                continue
            try:
                job = p.jobs.get(timeout=RECHECK_S)
            except queue.Empty:
                continue
            if job is None:
                return
            if job.cancel.is_set():
                continue
            p.busy.set()
            try:
                p.runner.serve(job, p.backend)
            finally:
                p.busy.clear()

    def n_busy(self) -> int:
        return int(self.parts.busy.is_set())

    def wake(self) -> None:
        """Nothing to do: the loop waits on the queue itself."""
