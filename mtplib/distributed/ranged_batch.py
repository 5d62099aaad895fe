"""Continuous batching for ranged MTP: the slots live in the client worker (next to its
engine, `mtplib.runtime.batch.BatchRun`), and each call here is one local pipe round trip.

A step of N slots decodes every slot's window in one target batch, so it costs the shards
the round trips of one step whatever N is (over a WAN the waits, not the compute, are the
step's time): that is the gain. A slot's prefill runs alone when it joins. The per-request
seam bytes of the one-request path are not split by slot: a slot's metrics are the
engine's (tokens, acceptance, timings) without seam counts.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

from mtplib.distributed.worker_engine import engine_for, engine_key, worker_memory
from mtplib.runtime.engine_options import EngineOptions
from mtplib.runtime.model import RuntimeInputError
from mtplib.runtime.results import GenerationMetrics
from mtplib.runtime.sampling import Sampler


# -- the worker side (run through RangedRuntime.call) -----------------------------------
def _worker_batch_open(models, opts: EngineOptions, warm: bool) -> dict:
    """A BatchRun over the worker's engine for ``opts`` (built if needed), replacing any
    earlier one; its capacity and context per slot."""
    from mtplib.runtime.batch import BatchRun

    _worker_batch_close(models)
    engine_for(models, opts, warm)
    engine, owned, _ = models.engines[engine_key(opts)]
    engine.trace = opts.trace
    from mtplib.distributed.worker import worker_step
    from mtplib.runtime.engine import no_phase

    phase, engine.phase = engine.phase, no_phase  # all of the warm-up counts as setup
    try:
        with worker_step("setup"):
            models.batch = BatchRun(engine, memory=worker_memory(models, engine, owned),
                                    warm=warm)
    finally:
        engine.phase = phase
    return {"capacity": models.batch.capacity, "n_ctx": engine.target.n_ctx,
            "setup": models.batch.setup}


def _batch(models):
    b = getattr(models, "batch", None)
    if b is None:
        raise RuntimeInputError("no batch is open in the worker")
    return b


def _worker_batch_join(models, asks: list[tuple]) -> list:
    return _batch(models).join_many(asks)


def _worker_batch_step(models) -> tuple[dict[int, list[int]], list[int]]:
    """One step of every slot: (each slot's tokens, the slots it finished)."""
    b = _batch(models)
    out = b.step()
    return out, [q for q in out if b.slots[q].done]


def _worker_batch_leave(models, seq: int) -> tuple[list[int], GenerationMetrics] | None:
    return _batch(models).leave(seq)


def _worker_batch_close(models) -> None:
    b = models.__dict__.pop("batch", None)
    if b is not None:
        b.close()


# -- the caller's side -------------------------------------------------------------------
class RangedBatch:
    """`BatchRun`'s interface (join, step, leave, active, free, close) over the worker's
    for ``owner``, a `RangedMTP`; every call holds its lock (one caller at a time on the
    worker pipe)."""

    def __init__(self, owner: Any, opts: EngineOptions, *, warm: bool = True) -> None:
        self.owner, self.opts = owner, opts
        with owner._lock:
            owner._live()
            owner._build(opts)  # routed (policy) and warmed like a generation's engine
            info = owner.rt.call(_worker_batch_open, opts, warm)
        self.capacity, self.n_ctx = int(info["capacity"]), int(info["n_ctx"])
        self.setup = info["setup"]
        self.slots: dict[int, bool] = {}  # seq -> finished
        self.closed = False

    def _call(self, fn, *args):
        with self.owner._lock:
            if self.closed:
                raise RuntimeInputError("this batch is closed")
            self.owner._live()
            return self.owner.rt.call(fn, *args)

    def free(self) -> int:
        return self.capacity - len(self.slots)

    def active(self) -> list[int]:
        return [q for q, done in self.slots.items() if not done]

    def join(self, prompt: Sequence[int], n_new: int, *, sampler: Sampler | None = None
             ) -> tuple[int, list[int]]:
        got = self.join_many([(prompt, n_new, sampler)])[0]
        if isinstance(got, BaseException):
            raise got
        return got

    def join_many(self, asks: Sequence[tuple]) -> list:
        """`BatchRun.join_many` in the worker: the prompts prefilled in one batch (one
        pass over the shards when they fit n_batch together)."""
        out = self._call(_worker_batch_join, [(list(p), n, sm) for p, n, sm in asks])
        for (_, n_new, _), got in zip(asks, out, strict=True):
            if not isinstance(got, BaseException):
                seq, first = got
                self.slots[seq] = n_new <= len(first)
        return out

    def step(self) -> dict[int, list[int]]:
        out, finished = self._call(_worker_batch_step)
        for q in finished:
            self.slots[q] = True
        return out

    def leave(self, seq: int) -> tuple[list[int], GenerationMetrics] | None:
        if seq not in self.slots:
            raise RuntimeInputError(f"no slot {seq}")
        del self.slots[seq]
        return self._call(_worker_batch_leave, seq)

    def close(self) -> None:
        if self.closed:
            return
        with contextlib.suppress(Exception):  # a failed worker has nothing to free
            self._call(_worker_batch_close)
        self.slots.clear()
        self.closed = True
