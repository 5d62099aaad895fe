"""`mtplib serve --parallel N`: continuous batching, N slots stepped together
(`BatchScheduler`).

One scheduler thread owns the backend's batch (`MTPRuntime.batch` or `RangedMTP.batch`): it
admits waiting requests into free slots, joins each (its prefill, between steps), steps
every active slot in one batch and hands each slot its tokens. Each admitted request runs in
a thread of its own the very code a one-slot service runs (`RequestRunner`: tokens, context
budget, end of generation, stop strings, streaming, log-probabilities, figures), over its
slot's stream (`mtplib.serve.slots.SlotStream`) instead of a generation of its own; a
request that ends early (stop, client gone, shutdown) leaves its slot between two steps.
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from typing import Any

from mtplib.runtime.model import RuntimeInputError
from mtplib.serve.job import Job
from mtplib.serve.scheduler import Parts, recover
from mtplib.serve.slots import Control, Exit, Join, Leave, SlotBackend, SlotStream

#: a ranged service's join gathering window (`BatchScheduler.gather_s`), seconds: small
#: beside a prefill pass over shards (at least one round trip per shard)
GATHER_S = 0.02
#: the longest a gathering join waits, seconds, for requests the service already holds
#: (queued with a slot free, or admitted and not joined yet): measured, four requests sent
#: together often reached the scheduler more than GATHER_S apart and joined as 2 + 2 (two
#: prefill passes, and a 2-prompt prefill shape the warm-up had not decoded)
GATHER_MAX_S = 0.25


class BatchScheduler:
    """``n_slots`` requests generating at once, stepped together.

    ``batch``: the backend's open batch (`BatchRun` or `RangedBatch`, capacity >= n_slots).
    Requests wait in the worker's bounded queue until a slot is free. ``gather_s``: when
    no slot is generating, how long the first join waits for others to arrive (their
    prompts then prefill in one batch; on, up to GATHER_MAX_S, while requests the service
    holds have not joined: `gather`); serve gives ranged backends GATHER_S, whole ones 0."""

    def __init__(self, parts: Parts, batch: Any, n_slots: int, gather_s: float = 0.0
                 ) -> None:
        if batch.capacity < n_slots:
            raise RuntimeInputError(f"the batch holds {batch.capacity} sequences, not "
                                    f"{n_slots}")
        self.parts, self.batch, self.n_slots, self.gather_s = parts, batch, n_slots, gather_s
        self._ctl: queue.Queue[Control] = queue.Queue()
        self._wake = threading.Event()
        self._threads: dict[threading.Thread, int] = {}  # request thread -> slot index
        self._streams: dict[int, SlotStream] = {}  # seq -> its stream
        self._free = list(range(n_slots))
        self._pieces: dict[int, str] = {}
        self._end_seen = False  # `gather` admitted the queue's end (the service stops)

    def piece(self, token: int) -> str:
        """One token's text, asked of the backend once: the backends' detokenize is the
        concatenation of each token's piece (`Model.detokenize`), and asking it takes the
        lock a step holds, which a request thread would wait for at every step."""
        text = self._pieces.get(token)
        if text is None:
            text = self._pieces[token] = self.parts.backend.detokenize([token])
        return text

    def n_busy(self) -> int:
        return len(self._threads)

    def wake(self) -> None:
        self._wake.set()

    def control(self, msg: Control) -> None:
        """A request thread's message to the scheduler (join, leave, exit)."""
        self._ctl.put(msg)
        self._wake.set()

    # -- the loop -------------------------------------------------------------------------
    def loop(self) -> None:
        p = self.parts
        draining = False
        try:
            while True:
                self._wake.clear()
                self._handle_control()
                if not draining and (p.health.fault is None or p.jobs.stopping.is_set()):
                    draining = self._end_seen or self._admit()  # (degraded: they wait)
                if (draining or p.jobs.stopping.is_set()) and not self._threads:
                    return
                if self.batch.active():
                    self.step()
                elif not self._threads and p.health.check() is not None:
                    self._recover_batch()  # a shard fault, and every slot has ended
                else:
                    self._wake.wait(0.5)
        finally:
            self._fail_all(RuntimeInputError("the service stopped"))
            with contextlib.suppress(Exception):
                self.batch.close()

    def _recover_batch(self) -> None:
        """Degraded (`mtplib.serve.faults`): the old session's batch is dropped, the shards
        are reconnected as with one slot, and a new batch opened on the new session (every
        step shape run once again)."""
        p = self.parts
        with contextlib.suppress(Exception):
            self.batch.close()
        recover(p)
        if p.jobs.stopping.is_set() or p.health.fault is not None:
            return
        try:
            self.batch = p.backend.batch(warm=True)
        except Exception as e:  # noqa: BLE001 - degraded again: the next pass reconnects
            p.health.mark(f"reopening the batch failed: {type(e).__name__}: {e}", [])

    def _admit(self) -> bool:
        """Start a request thread per free slot while requests wait; True once the queue
        says the service stops (None)."""
        while self._free:
            try:
                job = self.parts.jobs.get_nowait()
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
            self.parts.busy.set()
            t.start()
        return False

    def _request(self, job: Job, index: int) -> None:
        try:
            self.parts.runner.serve(job, SlotBackend(self, self.parts.backend), slot=index)
        finally:
            self.control(Exit(threading.current_thread()))

    def _handle_control(self) -> None:
        joins = self._drain_control()
        if joins and self.gather_s and not self.batch.active():
            joins = self.gather(joins)
        if joins:
            self.join(joins)

    def gather(self, joins: list[SlotStream]) -> list[SlotStream]:
        """Idle: requests sent together arrive some ms apart; wait ``gather_s`` for them,
        and on (up to GATHER_MAX_S) while the service holds requests that will join (queued
        with a slot free: admitted here; admitted and not joined yet), so their prompts
        share one prefill pass (over a WAN each pass costs round trips)."""
        p = self.parts
        t0 = time.monotonic()
        while True:
            now = time.monotonic()
            if not self._end_seen and self._free and not p.jobs.empty() \
                    and p.health.fault is None:
                self._end_seen = self._admit()
            joins += self._drain_control()
            pending = len(self._threads) - len(self._streams) - len(joins)
            if now - t0 >= GATHER_MAX_S or (now - t0 >= self.gather_s and pending <= 0):
                return joins
            time.sleep(0.002)

    def _drain_control(self) -> list[SlotStream]:
        """Handle the waiting control messages; the joins among them, for `join`."""
        joins: list[SlotStream] = []
        while True:
            try:
                msg = self._ctl.get_nowait()
            except queue.Empty:
                break
            if isinstance(msg, Join):
                joins.append(msg.stream)  # all waiting joins prefill in one batch, below
            elif isinstance(msg, Leave):
                st = msg.stream
                if st.seq is not None and self._streams.get(st.seq) is st:
                    del self._streams[st.seq]
                    try:
                        self.batch.leave(st.seq)
                    except Exception as e:  # noqa: BLE001 - logged; the service goes on
                        self.parts.log(f"leaving slot {st.seq} failed: "
                                       f"{type(e).__name__}: {e}")
            elif isinstance(msg, Exit):  # a request thread ended
                self._free.append(self._threads.pop(msg.thread))
                self._free.sort()
                if not self._threads:
                    self.parts.busy.clear()
        return joins

    def join(self, sts: list[SlotStream]) -> None:
        """Join every waiting request: the prompts prefilled together."""
        try:
            got = self.batch.join_many([(st.tokens, st.n_new, st.sampler) for st in sts])
        except BaseException as e:  # noqa: BLE001 - the requests' error, not the service's
            for st in sts:
                st.fail(e)
            return
        active = set(self.batch.active())
        for st, g in zip(sts, got, strict=True):
            if isinstance(g, BaseException):
                st.fail(g)
                continue
            seq, first = g
            st.seq = seq
            self._streams[seq] = st
            if first:
                st.give(first)
            if seq not in active:
                self._finish(seq)

    def _finish(self, seq: int) -> None:
        st = self._streams.pop(seq)
        try:
            res = self.batch.leave(seq)
        except Exception as e:  # noqa: BLE001 - the request's error, not the service's
            st.fail(e)
            return
        st.end(None if res is None else res[1])

    def step(self) -> None:
        """One step of every active slot, each slot's tokens handed to its stream."""
        live = self.batch.active()
        try:
            out = self.batch.step()
        except BaseException as e:  # noqa: BLE001 - every slot in the step fails with it
            self.parts.log(f"batch step failed: {type(e).__name__}: {e}")
            self._fail_all(e)
            return
        self.parts.runner.stats.stepped(len(live))
        active = set(self.batch.active())
        for seq, toks in out.items():
            st = self._streams.get(seq)
            if st is None:
                continue
            if toks:
                st.give(toks)
            if seq not in active:
                self._finish(seq)

    def _fail_all(self, e: BaseException) -> None:
        """Answer every joined slot with ``e`` and free them."""
        for seq, st in list(self._streams.items()):
            st.fail(e)
            del self._streams[seq]
            with contextlib.suppress(Exception):
                self.batch.leave(seq)
