"""`mtplib serve --parallel N`: continuous batching, N slots stepped together.

One scheduler thread (`BatchWorker`, in place of `GenerationWorker`'s loop) owns the
backend's batch (`MTPRuntime.batch` or `RangedMTP.batch`): it admits waiting requests into
free slots, joins each (its prefill, alone, between steps), steps every active slot in one
batch and hands each slot its tokens. Each admitted request runs in a thread of its own
the very code a one-slot service runs (`GenerationWorker._run`: tokens, context budget,
end of generation, stop strings, streaming, log-probabilities, timings), over its slot's
stream (`SlotStream`) instead of a generation of its own; a request that ends early
(stop, client gone, shutdown) leaves its slot between two steps. /slots shows each slot.
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from collections.abc import Iterator
from typing import Any

from mtplib.commands.serve_app import GenerationWorker, Job, ServeConfig, ServeStats
from mtplib.runtime.backend import Backend
from mtplib.runtime.model import RuntimeInputError

#: a ranged service's join gathering window (`BatchWorker.gather_s`), seconds: small
#: beside a prefill pass over shards (at least one round trip per shard)
GATHER_S = 0.02
#: the longest a gathering join waits, seconds, for requests the service already holds
#: (queued with a slot free, or admitted and not joined yet): measured, four requests sent
#: together often reached the scheduler more than GATHER_S apart and joined as 2 + 2 (two
#: prefill passes, and a 2-prompt prefill shape the warm-up had not decoded)
GATHER_MAX_S = 0.25


class SlotStats(ServeStats):
    """`ServeStats` with one running entry per slot (the request thread's own)."""

    def __init__(self, n_slots: int) -> None:
        self.slots: list[dict | None] = [None] * n_slots
        self._slot_of: dict[int, int] = {}  # request thread -> slot index
        self.slot_steps = 0  # sum over steps of the slots each step carried
        self.batch_steps = 0
        super().__init__()

    @property
    def running(self) -> dict | None:  # type: ignore[override]
        """The first busy slot's entry (what /props' is_processing reads)."""
        return next((r for r in self.slots if r is not None), None)

    @running.setter
    def running(self, value: dict | None) -> None:
        pass  # the base class's one-slot bookkeeping; per-slot entries are set below

    @property
    def slots_per_decode(self) -> float:
        return self.slot_steps / self.batch_steps if self.batch_steps else 0.0

    def bind(self, index: int) -> None:
        self._slot_of[threading.get_ident()] = index

    def _mine(self) -> int:
        return self._slot_of[threading.get_ident()]

    def begin(self, job: Job, n_prompt: int, n_new: int) -> None:
        with self.lock:
            self.task += 1
            self.slots[self._mine()] = {"id_task": self.task, "params": job.settings,
                                        "n_decoded": 0, "n_new": n_new,
                                        "n_prompt": n_prompt}

    def step(self, n_out: int) -> None:
        with self.lock:
            r = self.slots[self._mine()]
            if r is not None:
                r["n_decoded"] = n_out

    def done(self, metrics: dict, n_prompt: int, n_out: int) -> None:
        super().done(metrics, n_prompt, n_out)
        with self.lock:
            self.slots[self._mine()] = None

    def failed(self) -> None:
        super().failed()
        with self.lock:
            self.slots[self._mine()] = None


class SlotStream:
    """One request's generation in a slot, shaped as the backend's `Generation` (iterate
    for each step's tokens, then ``metrics``; ``close`` leaves the slot). The scheduler
    joins it at the first iteration and puts its tokens on ``q``."""

    def __init__(self, worker: BatchWorker, tokens: list[int], n_new: int, sampler: Any
                 ) -> None:
        self.worker, self.tokens, self.n_new, self.sampler = worker, tokens, n_new, sampler
        self.q: queue.Queue = queue.Queue()
        self.seq: int | None = None
        self.ended = False
        self._metrics = None

    def __iter__(self) -> Iterator[list[int]]:
        self.worker.control(("join", self))
        while True:
            kind, payload = self.q.get()
            if kind == "tokens":
                yield payload
            elif kind == "end":
                self.ended, self._metrics = True, payload
                return
            else:  # "error": the join or a step failed
                self.ended = True
                raise payload

    @property
    def metrics(self):
        if self._metrics is None:
            raise RuntimeInputError("the generation has not finished")
        return self._metrics

    def close(self) -> None:
        if not self.ended:
            self.ended = True
            self.worker.control(("leave", self))

    def __enter__(self) -> SlotStream:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class _SlotBackend:
    """What a request's `GenerationWorker._run` streams from: its slot; text calls go to
    the backend itself, but each token's text is asked once (`BatchWorker.piece`)."""

    def __init__(self, worker: BatchWorker) -> None:
        self.worker = worker

    def stream(self, tokens: list[int], n_new: int, *, sampler: Any = None) -> SlotStream:
        return SlotStream(self.worker, list(tokens), n_new, sampler)

    def detokenize(self, tokens: list[int]) -> str:
        return "".join(self.worker.piece(t) for t in tokens)

    def tokenize(self, text: str) -> list[int]:
        return self.worker.backend.tokenize(text)


class BatchWorker(GenerationWorker):
    """`GenerationWorker` with ``n_slots`` requests generating at once, stepped together.

    ``batch``: the backend's open batch (`BatchRun` or `RangedBatch`, capacity >= n_slots).
    Requests wait in the same bounded queue (``cfg.queue_max``) until a slot is free.
    ``gather_s``: when no slot is generating, how long the first join waits for others
    to arrive (their prompts then prefill in one batch; on, up to GATHER_MAX_S, while
    requests the service holds have not joined: `_gather`); serve gives ranged backends
    GATHER_S, whole ones 0."""

    def __init__(self, backend: Backend, cfg: ServeConfig, batch: Any, n_slots: int,
                 log=lambda s: None, gather_s: float = 0.0) -> None:
        if batch.capacity < n_slots:
            raise RuntimeInputError(f"the batch holds {batch.capacity} sequences, not "
                                    f"{n_slots}")
        self.batch, self.n_slots, self.gather_s = batch, n_slots, gather_s
        self._ctl: queue.Queue = queue.Queue()
        self._wake = threading.Event()
        self._threads: dict[threading.Thread, int] = {}  # request thread -> slot index
        self._streams: dict[int, SlotStream] = {}  # seq -> its stream
        self._free = list(range(n_slots))
        self._pieces: dict[int, str] = {}
        self._end_seen = False  # `_gather` admitted the queue's end (the service stops)
        super().__init__(backend, cfg, log)
        self.stats = SlotStats(n_slots)

    def piece(self, token: int) -> str:
        """One token's text, asked of the backend once: the backends' detokenize is the
        concatenation of each token's piece (`Model.detokenize`), and asking it takes the
        lock a step holds, which a request thread would wait for at every step."""
        text = self._pieces.get(token)
        if text is None:
            text = self._pieces[token] = self.backend.detokenize([token])
        return text

    # -- the HTTP side's view -------------------------------------------------------------
    def n_busy(self) -> int:
        return len(self._threads)

    def slot_states(self) -> list[dict | None]:
        with self.stats.lock:
            return list(self.stats.slots)

    def submit(self, job: Job) -> None:
        super().submit(job)
        self._wake.set()

    def begin_shutdown(self) -> int:
        n = super().begin_shutdown()
        self._wake.set()
        return n

    def control(self, msg: tuple) -> None:
        """A request thread's message to the scheduler (join, leave, exit)."""
        self._ctl.put(msg)
        self._wake.set()

    # -- the scheduler --------------------------------------------------------------------
    def _loop(self) -> None:
        draining = False
        try:
            while True:
                self._wake.clear()
                self._handle_control()
                if not draining and (self.health.fault is None or self.stopping.is_set()):
                    draining = self._end_seen or self._admit()  # (degraded: they wait)
                if (draining or self.stopping.is_set()) and not self._threads:
                    return
                if self.batch.active():
                    self._step()
                elif not self._threads and self.health.check() is not None:
                    self._recover_batch()  # a shard fault, and every slot has ended
                else:
                    self._wake.wait(0.5)
        finally:
            self._fail_all(RuntimeInputError("the service stopped"))
            with contextlib.suppress(Exception):
                self.batch.close()

    def _recover_batch(self) -> None:
        """Degraded (`serve_faults`): the old session's batch is dropped, the shards are
        reconnected as with one slot, and a new batch opened on the new session (every step
        shape run once again)."""
        with contextlib.suppress(Exception):
            self.batch.close()
        self._recover()
        if self.stopping.is_set() or self.health.fault is not None:
            return
        try:
            self.batch = self.backend.batch(warm=True)
        except Exception as e:  # noqa: BLE001 - degraded again: the next pass reconnects
            self.health.mark(f"reopening the batch failed: {type(e).__name__}: {e}", [])

    def _admit(self) -> bool:
        """Start a request thread per free slot while requests wait; True once the queue
        says the service stops (None)."""
        while self._free:
            try:
                job = self.jobs.get_nowait()
            except queue.Empty:
                return False
            if job is None:
                return True
            if job.cancel.is_set():
                continue
            index = self._free.pop(0)
            t = threading.Thread(target=self._request, args=(job, index), daemon=True,
                                 name=f"mtplib-serve-slot-{index}")
            self._threads[t] = index
            self.busy.set()
            t.start()
        return False

    def _request(self, job: Job, index: int) -> None:
        self.stats.bind(index)
        try:
            self._serve_one(job, _SlotBackend(self))
        finally:
            self.control(("exit", threading.current_thread()))

    def _handle_control(self) -> None:
        joins = self._drain_control()
        if joins and self.gather_s and not self.batch.active():
            joins = self._gather(joins)
        if joins:
            self._join(joins)

    def _gather(self, joins: list[SlotStream]) -> list[SlotStream]:
        """Idle: requests sent together arrive some ms apart; wait ``gather_s`` for them,
        and on (up to GATHER_MAX_S) while the service holds requests that will join (queued
        with a slot free: admitted here; admitted and not joined yet), so their prompts
        share one prefill pass (over a WAN each pass costs round trips)."""
        t0 = time.monotonic()
        while True:
            now = time.monotonic()
            if not self._end_seen and self._free and not self.jobs.empty() \
                    and self.health.fault is None:
                self._end_seen = self._admit()
            joins += self._drain_control()
            pending = len(self._threads) - len(self._streams) - len(joins)
            if now - t0 >= GATHER_MAX_S or (now - t0 >= self.gather_s and pending <= 0):
                return joins
            time.sleep(0.002)

    def _drain_control(self) -> list[SlotStream]:
        """Handle the waiting control messages; the joins among them, for `_join`."""
        joins: list[SlotStream] = []
        while True:
            try:
                kind, obj = self._ctl.get_nowait()
            except queue.Empty:
                break
            if kind == "join":
                joins.append(obj)  # all waiting joins prefill in one batch, below
            elif kind == "leave":
                if obj.seq is not None and self._streams.get(obj.seq) is obj:
                    del self._streams[obj.seq]
                    try:
                        self.batch.leave(obj.seq)
                    except Exception as e:  # noqa: BLE001 - logged; the service goes on
                        self.log(f"leaving slot {obj.seq} failed: {type(e).__name__}: {e}")
            else:  # "exit": a request thread ended
                self._free.append(self._threads.pop(obj))
                self._free.sort()
                if not self._threads:
                    self.busy.clear()
        return joins

    def _join(self, sts: list[SlotStream]) -> None:
        """Join every waiting request: the prompts prefilled together."""
        try:
            got = self.batch.join_many([(st.tokens, st.n_new, st.sampler) for st in sts])
        except BaseException as e:  # noqa: BLE001 - the requests' error, not the service's
            for st in sts:
                st.q.put(("error", e))
            return
        active = set(self.batch.active())
        for st, g in zip(sts, got, strict=True):
            if isinstance(g, BaseException):
                st.q.put(("error", g))
                continue
            seq, first = g
            st.seq = seq
            self._streams[seq] = st
            if first:
                st.q.put(("tokens", first))
            if seq not in active:
                self._finish(seq)

    def _finish(self, seq: int) -> None:
        st = self._streams.pop(seq)
        try:
            res = self.batch.leave(seq)
        except Exception as e:  # noqa: BLE001 - the request's error, not the service's
            st.q.put(("error", e))
            return
        st.q.put(("end", None if res is None else res[1]))

    def _step(self) -> None:
        live = self.batch.active()
        try:
            out = self.batch.step()
        except BaseException as e:  # noqa: BLE001 - every slot in the step fails with it
            self.log(f"batch step failed: {type(e).__name__}: {e}")
            self._fail_all(e)
            return
        with self.stats.lock:
            self.stats.batch_steps += 1
            self.stats.slot_steps += len(live)
        active = set(self.batch.active())
        for seq, toks in out.items():
            st = self._streams.get(seq)
            if st is None:
                continue
            if toks:
                st.q.put(("tokens", toks))
            if seq not in active:
                self._finish(seq)

    def _fail_all(self, e: BaseException) -> None:
        """Answer every joined slot with ``e`` and free them."""
        for seq, st in list(self._streams.items()):
            st.q.put(("error", e))
            del self._streams[seq]
            with contextlib.suppress(Exception):
                self.batch.leave(seq)
