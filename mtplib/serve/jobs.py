"""The bounded queue of requests waiting for the worker (`JobQueue`), and its shutdown.

Why its own gate: a submit and the shutdown's drain of the queue must not interleave (a
request queued after the drain would wait for a worker that has ended); full is a 503 at
once, never a wait on the event loop."""

from __future__ import annotations

import contextlib
import queue
import threading

from mtplib.serve.errors import ApiError, shutting_down, unavailable
from mtplib.serve.events import Failed
from mtplib.serve.job import Job


class JobQueue:
    """FIFO of `Job`s, at most ``maxsize`` waiting; ``None`` in it ends the worker."""

    def __init__(self, maxsize: int) -> None:
        self.maxsize = maxsize
        self._q: queue.Queue[Job | None] = queue.Queue(maxsize=maxsize)
        #: set at SIGTERM: no new job, the waiting ones are answered 503
        self.stopping = threading.Event()
        self._gate = threading.Lock()  # submit vs. the shutdown's drain of the queue

    def submit(self, job: Job) -> None:
        """Queue ``job``, or refuse it: 503 when full or shutting down."""
        with self._gate:
            if self.stopping.is_set():
                raise shutting_down()
            try:
                self._q.put_nowait(job)
            except queue.Full:
                raise unavailable(f"the server is busy: {self.maxsize} requests already "
                                  "wait for the running one; retry later") from None

    def submit_all(self, jobs: list[Job]) -> None:
        """Queue every one of ``jobs`` (one request's choices), or none: 503 when they do
        not all fit now (the worker only ever makes room while this waits)."""
        with self._gate:
            if self.stopping.is_set():
                raise shutting_down()
            free = self.maxsize - self._q.qsize()
            if len(jobs) > free:
                raise unavailable(f"the server is busy: this request's {len(jobs)} "
                                  f"completions do not fit in the queue ({free} of "
                                  f"{self.maxsize} free); retry later")
            for job in jobs:
                self._q.put_nowait(job)

    def get(self, timeout: float) -> Job | None:
        """The next job (None: the service stops); raises queue.Empty after ``timeout``."""
        return self._q.get(timeout=timeout)

    def get_nowait(self) -> Job | None:
        return self._q.get_nowait()

    def empty(self) -> bool:
        return self._q.empty()

    def qsize(self) -> int:
        return self._q.qsize()

    def refuse_waiting(self, error: ApiError) -> int:
        """Answer every waiting job ``error``; how many there were."""
        with self._gate:
            return self._drain(error)

    def shut(self) -> int:
        """SIGTERM: refuse new jobs, answer the waiting ones 503 now, and end the worker's
        wait; how many were waiting."""
        with self._gate:
            self.stopping.set()
            n = self._drain(shutting_down("the request was waiting"))
            with contextlib.suppress(queue.Full):
                self._q.put_nowait(None)  # wakes the loop, which then ends
        return n

    def _drain(self, error: ApiError) -> int:
        n = 0
        while True:
            try:
                job = self._q.get_nowait()
            except queue.Empty:
                return n
            if job is not None:
                n += 1
                job.post(Failed(error))
