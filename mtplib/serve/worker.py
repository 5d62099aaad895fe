"""The thread that owns the backend (`GenerationWorker`), as the HTTP side sees it: submit
a job, the queue's and the slots' state, shard health, and the shutdown (refuse, cut,
stop).

One thread touches the backend (an `MTPRuntime` or a `RangedMTP`), so a generation is
never interleaved with another on the same object and the event loop never blocks on
upstream (health checks answer while a generation runs). What that thread does with the
queue is its scheduler's (`mtplib.serve.scheduler`): one request at a time, or
``--parallel N`` slots stepped together (`BatchWorker`: `mtplib.serve.batch`)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from mtplib.runtime.backend import Backend
from mtplib.serve.batch import BatchScheduler
from mtplib.serve.config import ServeConfig
from mtplib.serve.faults import BackendHealth
from mtplib.serve.generation import RequestRunner
from mtplib.serve.job import Job
from mtplib.serve.jobs import JobQueue
from mtplib.serve.scheduler import Parts, Scheduler, SingleScheduler
from mtplib.serve.stats import SlotState, SlotTable


class GenerationWorker:
    """The one thread that touches the backend: a bounded FIFO of jobs, served by its
    scheduler (default one at a time)."""

    def __init__(self, backend: Backend, cfg: ServeConfig,
                 log: Callable[[str], None] = lambda s: None, *, n_slots: int = 1,
                 scheduler: Callable[[Parts], Scheduler] = SingleScheduler) -> None:
        self.backend, self.cfg, self.log = backend, cfg, log
        self.jobs = JobQueue(cfg.queue_max)
        #: set when the grace period is over: the running generation is cut (503)
        self.cutting = threading.Event()
        self.busy = threading.Event()
        #: when the service started (Unix seconds): /metrics' Process-Start-Time-Unix
        self.started_unix = int(time.time())
        self.stats = SlotTable(n_slots)
        #: shard faults: /health's state, and the recovery run by this thread
        self.health = BackendHealth(backend, log)
        runner = RequestRunner(cfg, self.stats, self.health, self.cutting, log)
        self.scheduler = scheduler(Parts(backend, self.jobs, self.health, runner, self.busy,
                                         log))
        self.thread = threading.Thread(target=self.scheduler.loop,
                                       name="mtplib-serve-worker", daemon=True)
        self.thread.start()

    @property
    def stopping(self) -> threading.Event:
        """Set at SIGTERM: no new job, the waiting ones are answered 503."""
        return self.jobs.stopping

    def submit(self, job: Job) -> None:
        self.submit_all([job])

    def submit_all(self, jobs: list[Job]) -> None:
        """Queue one request's jobs, all or none (503)."""
        self.jobs.submit_all(jobs)  # degraded: they wait for a reconnect attempt
        if self.health.fault is not None:
            self.health.wake.set()
        self.scheduler.wake()

    def pending(self) -> int:
        return self.jobs.qsize() + self.n_busy()

    def n_busy(self) -> int:
        """Slots running a generation (of --parallel)."""
        return self.scheduler.n_busy()

    def slot_states(self) -> list[SlotState | None]:
        """Each slot's running request as /slots shows it (None: idle)."""
        return self.stats.states()

    def begin_shutdown(self) -> int:
        """SIGTERM: refuse new jobs and answer the waiting ones 503 now (the running ones
        may finish until `cut`); how many were waiting."""
        n = self.jobs.shut()
        self.health.wake.set()  # a recovery's backoff ends too
        self.scheduler.wake()
        return n

    def cut(self) -> None:
        """The grace period is over: the running generations end at their next step and
        their requests are answered 503."""
        self.cutting.set()

    def stop(self, timeout: float) -> bool:
        """Cut the running generation at its next step, refuse the waiting ones, and join
        the thread; False when it did not stop in time (upstream still busy)."""
        self.begin_shutdown()
        self.cut()
        self.thread.join(timeout)
        return not self.thread.is_alive()


class BatchWorker(GenerationWorker):
    """A `GenerationWorker` whose scheduler steps ``n_slots`` requests together
    (`BatchScheduler` over ``batch``, the backend's open batch); ``gather_s`` as there."""

    def __init__(self, backend: Backend, cfg: ServeConfig, batch: Any, n_slots: int,
                 log: Callable[[str], None] = lambda s: None, gather_s: float = 0.0
                 ) -> None:
        super().__init__(backend, cfg, log, n_slots=n_slots,
                         scheduler=lambda p: BatchScheduler(p, batch, n_slots, gather_s))
