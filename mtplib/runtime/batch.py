"""Continuous batching over one `Engine`: several sessions (one sequence id each) stepped
together, each step one target decode and one drafter decode per draft depth for all.

`batch_step` takes every active session's work, a verify window [last, *drafts] or a plain
token, decodes all windows in ONE llama_batch on the target (one seq id per token), then
does each session's accept/reject and rollback with the one-session code (`SpecSession`:
tail removal by llama_memory_seq_rm per sequence within n_rs_seq, else checkpoint +
replay), then feeds every session's accepted entries to the drafter in one decode and
drafts the next windows with one drafter decode per depth. Upstream's V4 cache keeps a
rollback plane and a pending-rollback index per sequence (src/llama-kv-cache-dsv4.cpp
``rs_idx``, ``split_equal`` keeps each sequence's trailing 1 + n_rs_seq tokens in one
ubatch), so a removal in one sequence leaves the others as they are.

`BatchRun` holds the slots: a request joins (its prefill runs alone, between steps) and
leaves between steps; `step` advances every unfinished slot once. A slot samples with its
own sampler on random stream 0, so a request draws the same tokens in any slot as alone.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from mtplib.contract.labels import StepKind
from mtplib.contract.session import State
from mtplib.runtime.engine import Engine, SpecSession, api_rows, no_phase
from mtplib.runtime.generation import (
    check_request,
    empty_metrics,
    session_metrics,
    unconstrained,
)
from mtplib.runtime.grammar import grammar_end
from mtplib.runtime.model import RuntimeInputError
from mtplib.runtime.results import GenerationMetrics
from mtplib.runtime.sampling import Sampler


def check_batchable(engine: Engine) -> None:
    """Refuse an engine whose parts read one sequence's state: captured rows (an eval
    callback sees ubatches, not the batch's order) and a drafter-decided acceptance (a
    synthetic drafter keeps one pending draw)."""
    if engine.needs_rows and engine.rows is not api_rows \
            and engine.hidden_rows != "layer_inp":  # DSpark's features: in batch order
        raise RuntimeInputError(f"batched steps need the target's rows from upstream's API "
                                f"(hidden rows {engine.hidden_rows!r} cannot be split by "
                                "sequence); use --parallel 1")
    if getattr(engine.drafter, "accept_len", None) is not None:
        raise RuntimeInputError(f"drafter {engine.drafter.name} decides acceptance for one "
                                "sequence at a time: it cannot be batched")


def _groups(windows: Sequence[Sequence[int]], n_batch: int) -> list[list[int]]:
    """Indices of windows packed in order into batches of at most n_batch tokens."""
    out: list[list[int]] = [[]]
    used = 0
    for i, w in enumerate(windows):
        if used + len(w) > n_batch and out[-1]:
            out.append([])
            used = 0
        out[-1].append(i)
        used += len(w)
    return out


def batch_step(engine: Engine, sessions: Sequence[SpecSession],
               ks: Sequence[int | None]) -> list[list[int]]:
    """One propose -> verify -> commit round for every session together; returns each
    session's emitted tokens (in order). ``ks``: each session's draft length (None: the
    engine's k), clipped to its context as `SpecSession.step` does. The batch holds the
    windows in the sessions' order: give them by seq id, since upstream's split puts only
    consecutive seq ids, in batch order, in one ubatch."""
    e = engine
    if len(ks) != len(sessions):
        raise RuntimeInputError(f"{len(sessions)} sessions but {len(ks)} draft lengths")
    if len({s.seq for s in sessions}) != len(sessions):
        raise RuntimeInputError("a batch step holds each sequence once")
    for s in sessions:
        if e.sessions.get(s.seq) is not s:
            raise RuntimeInputError(f"session {s.id} is not open in this engine")
    room = [s.draft_room(k) for s, k in zip(sessions, ks, strict=True)]
    # 1. draft every window (one drafter decode per depth for all sessions)
    asks = [(s.seq, s.last, s.base, k) for s, k in zip(sessions, room, strict=True) if k]
    drafted: list[list[int]] = []
    if asks:
        for s, k in zip(sessions, room, strict=True):
            if k:
                s.session = s.session.draft()
        t0 = time.perf_counter()
        with e.phase(StepKind.DRAFT, sum(a[3] for a in asks)):
            drafted = e.drafter.propose_many(asks)
        dt = time.perf_counter() - t0
        for s, k in zip(sessions, room, strict=True):
            if k:
                s.metrics.t_draft += dt
    it = iter(drafted)
    proposals = [s.proposal(next(it), k) if k else None
                 for s, k in zip(sessions, room, strict=True)]
    # 2. verify every window in one target batch (more only past n_batch)
    windows = [s.verify_window(p) for s, p in zip(sessions, proposals, strict=True)]
    results: list = [None] * len(sessions)
    for group in _groups(windows, e.target.n_batch):
        toks = [t for i in group for t in windows[i]]
        pos = [sessions[i].base + j for i in group for j in range(len(windows[i]))]
        seqs = [sessions[i].seq for i in group for _ in windows[i]]
        n = len(toks)
        kind = StepKind.VERIFY if any(proposals[i] for i in group) else StepKind.DECODE
        # a lone one-token step (MTP off, one slot live) decodes as two, as beside others
        pad = e.pad_single and n == 1 and e.target.n_rs_seq >= 1 \
            and pos[0] + 1 < e.target.n_ctx
        t0 = time.perf_counter()
        with e.phase(kind, n + pad):
            e.target.decode(toks * (1 + pad), [*pos, pos[0] + 1][:n + pad],
                            seq_id=seqs * (1 + pad), logits=e.head is None)
            rows = e.rows(e.target, n + pad)[:n] if e.needs_rows else None
            lg = e.target.logits_all(n + pad)[:n] if e.head is None else e.head(rows)
            if pad and not e.target.seq_rm(seqs[0], pos[0] + 1, -1):
                raise RuntimeInputError(f"removing the pad of sequence {seqs[0]} failed")
            a = 0
            for i in group:
                b = a + len(windows[i])
                results[i] = sessions[i].verified(proposals[i], lg[a:b],
                                                  None if rows is None else rows[a:b])
                a = b
        dt = time.perf_counter() - t0
        for i in group:
            sessions[i].metrics.t_verify += dt
    # 3. commit: each session's rollback alone, the drafter's feeds in one decode
    emitted = _commit_all(e, sessions, results)
    feeds = []
    for s in sessions:
        feeds.append(s.pending_feed)
        s.pending_feed = None
    t0 = time.perf_counter()
    with e.feed_phase(sum(len(f[2]) for f in feeds)):
        e.drafter.commit_many(feeds)
    dt = time.perf_counter() - t0
    for s in sessions:
        s.metrics.t_feed += dt
    return emitted


def _commit_all(e: Engine, sessions: Sequence[SpecSession], results: list) -> list[list[int]]:
    """Every session's commit (feeds deferred), their rollbacks under ONE rollback phase:
    a phase is a labelled step (in the ranged worker two pipe round trips to the parent,
    which switches the relays' label), so one phase per rolling-back session made a step
    of N slots pay up to N of them; each rollback is still timed per session."""
    rolls = any(s.n_cached > s.base + (r.n_accepted if r is not None else 0) + 1
                for s, r in zip(sessions, results, strict=True))
    if not rolls:
        return [s.commit(r, defer_feed=True) for s, r in zip(sessions, results, strict=True)]
    phase = e.phase
    with phase(StepKind.ROLLBACK, 0):
        e.phase = no_phase  # the sessions' own rollback phases are this one
        try:
            return [s.commit(r, defer_feed=True)
                    for s, r in zip(sessions, results, strict=True)]
        finally:
            e.phase = phase


def batch_prefill(engine: Engine, sessions: Sequence[SpecSession],
                  prompts: Sequence[Sequence[int]]) -> list[int]:
    """Prefill several just-opened sessions (``Engine.open(prefill=False)``) with their
    prompts in one target batch (the prompt's last token of each flagged for logits);
    each session's first token. Prompts that do not fit one n_batch together are
    prefilled one by one."""
    e = engine
    if sum(len(p) for p in prompts) > e.target.n_batch or len(sessions) == 1:
        return [s.prefill(p) for s, p in zip(sessions, prompts, strict=True)]
    if any(len(p) == 1 for p in prompts):
        # a one-token prompt decodes alone as one token, and upstream's kernels give a
        # one-token decode other floats than a longer one: prefilled alone here too, so
        # its answer is the one it gets alone (`Engine.pad_single`)
        lone = [i for i, p in enumerate(prompts) if len(p) == 1]
        rest = [i for i in range(len(prompts)) if i not in lone]
        firsts = dict(zip(rest, batch_prefill(e, [sessions[i] for i in rest],
                                              [prompts[i] for i in rest]), strict=True)
                      ) if rest else {}
        firsts.update({i: sessions[i].prefill(prompts[i]) for i in lone})
        return [firsts[i] for i in range(len(prompts))]
    toks = [s.prefill_begin(p) for s, p in zip(sessions, prompts, strict=True)]
    flat = [t for ts in toks for t in ts]
    pos = [i for ts in toks for i in range(len(ts))]
    seqs = [s.seq for s, ts in zip(sessions, toks, strict=True) for _ in ts]
    ends = np.cumsum([len(ts) for ts in toks]) - 1  # batch index of each prompt's last
    flags = [False] * len(flat)
    for i in ends:
        flags[int(i)] = e.head is None
    with e.phase(StepKind.PREFILL, len(flat)):
        e.target.decode(flat, pos, seq_id=seqs, logits=flags)
        rows = e.rows(e.target, len(flat)) if e.needs_rows else None
        if e.head is None:
            logits = [e.target.logits(int(i)) for i in ends]
        else:
            logits = list(e.head(rows[ends]))
    firsts, a = [], 0
    for s, ts, lg in zip(sessions, toks, logits, strict=True):
        b = a + len(ts)
        firsts.append(s.prefill_end(lg, None if rows is None else rows[a:b], len(ts)))
        a = b
    return firsts


def warm_batch(engine: Engine, n: int) -> dict:
    """Run each batch shape a step of up to ``n`` slots decodes once, on throwaway
    sequences: j sequences x a window of w tokens for j = 1..n, w = 1..k+1 (upstream's RPC
    client asks a shard once per new shape, a blocking round trip; see `warm_up`).
    Returns {"setup_s", "shapes"}."""
    t0 = time.perf_counter()
    e = engine
    n = min(n, e.target.n_seq_max)
    free = [q for q in range(e.target.n_seq_max) if q not in e.sessions][:n]
    prompt = [1 % e.target.n_vocab] * 4
    sessions = []
    shapes = []
    try:
        for q in free:  # no grammar: it would cut the drafts of the shapes
            sessions.append(e.open(prompt, seq_id=q, sampler=unconstrained(e.sampler)))
        for j in range(len(sessions), 0, -1):
            for kk in range(e.k, -1, -1):
                if any(s.base + kk + 1 >= e.target.n_ctx for s in sessions[:j]):
                    continue
                batch_step(e, sessions[:j], [kk] * j)
                shapes.append((j, kk + 1))
    finally:
        for s in sessions:
            e.close(s)
    return {"setup_s": time.perf_counter() - t0, "shapes": shapes}


@dataclass
class Slot:
    """One request's sequence in a `BatchRun`."""

    seq: int
    n_new: int
    n_prompt: int
    session: SpecSession | None  # None: n_new 0, nothing decoded
    tokens: list[int] = field(default_factory=list)
    metrics: GenerationMetrics | None = None  # set once finished

    @property
    def done(self) -> bool:
        return self.metrics is not None


class BatchRun:
    """Slots over one engine: `join` (prefill alone, returns the first token), `step`
    (every unfinished slot once, together), `leave` (frees the sequence; its tokens and
    metrics when it finished). ``lock``: held around every call into upstream (the
    owner's, e.g. MTPRuntime's). ``memory``: a seq id -> memory report, as generations
    report it. Not thread-safe by itself: one scheduler drives it.

    ``fill_gaps`` (default: when the trunk is on shards): upstream's split keeps a ubatch
    to consecutive sequence ids (src/llama-batch.cpp ``split_equal``, sequential), so
    slots 0, 1, 3 cost two passes over the shards per step. A slot that leaves between
    others then keeps decoding (its tokens discarded) while it fills such a gap, until
    the gap closes, its context ends, or a join needs its sequence id."""

    def __init__(self, engine: Engine, *, lock: contextlib.AbstractContextManager | None = None,
                 memory: Callable[[int], dict] | None = None, warm: bool = False,
                 fill_gaps: bool | None = None) -> None:
        check_batchable(engine)
        self.engine = engine
        # every slot decodes as it would alone: no lone one-token decode (`Engine.pad_single`)
        engine.pad_single = engine.drafter.pad_single = True
        self.lock = lock or contextlib.nullcontext()
        self.memory = memory
        self.slots: dict[int, Slot] = {}
        #: sessions of slots that left, decoding on to fill a gap (seq -> session)
        self.fillers: dict[int, SpecSession] = {}
        self.fill_gaps = bool(engine.target.model.endpoints) if fill_gaps is None \
            else fill_gaps
        self.closed = False
        #: `warm_batch`'s report when ``warm`` (every step shape run once, at open)
        self.setup: dict | None = None
        if warm and engine.target.n_seq_max > 1:
            with self.lock:
                self.setup = warm_batch(engine, engine.target.n_seq_max)

    @property
    def capacity(self) -> int:
        return self.engine.target.n_seq_max

    @property
    def n_ctx(self) -> int:
        """Positions one slot may use (its share of the context)."""
        return self.engine.target.n_ctx

    def free(self) -> int:
        """Sequences no slot holds (and no other session of the engine)."""
        return self.capacity - len(set(self.slots) | set(self.engine.sessions))

    def _live(self) -> None:
        if self.closed:
            raise RuntimeInputError("this batch is closed")

    def join(self, prompt: Sequence[int], n_new: int, *, sampler: Sampler | None = None
             ) -> tuple[int, list[int]]:
        """A new slot for ``prompt``: its prefill runs now (alone); returns (slot id = its
        seq id, the first tokens: [first], or [] when n_new is 0)."""
        return self.join_many([(prompt, n_new, sampler)])[0]

    def join_many(self, asks: Sequence[tuple[Sequence[int], int, Sampler | None]]
                  ) -> list[tuple[int, list[int]] | BaseException]:
        """A slot for each (prompt, n_new, sampler), their prefills in one batch; per
        ask, (slot id, first tokens) or the error that refused it (checked before any
        decode: a refused ask takes no slot). With one ask, its error is raised."""
        self._live()
        e = self.engine
        free = [q for q in range(self.capacity)
                if q not in self.slots and (q not in e.sessions or q in self.fillers)]
        out: list = []
        todo: list = []
        for prompt, n_new, sampler in asks:
            try:
                prompt = self._check(prompt, n_new)
                if not free:
                    raise RuntimeInputError(f"all {self.capacity} slots are in use")
            except RuntimeInputError as err:
                if len(asks) == 1:
                    raise
                out.append(err)
                continue
            seq = free.pop(0)
            if n_new == 0:
                self.slots[seq] = Slot(seq, 0, len(prompt), None,
                                       metrics=empty_metrics(e, len(prompt), self.memory, seq))
                out.append((seq, []))
                continue
            out.append(seq)
            todo.append((seq, prompt, n_new, sampler))
        if todo:
            with self.lock:
                for q, *_ in todo:
                    self._drop_filler(q)
                ss = [e.open(p, seq_id=q, sampler=sm, stream=0, prefill=False)
                      for q, p, _, sm in todo]
                try:
                    batch_prefill(e, ss, [p for _, p, _, _ in todo])
                except BaseException:
                    for s in ss:
                        e.close(s)
                    raise
            for s, (q, p, n_new, _) in zip(ss, todo, strict=True):
                slot = self.slots[q] = Slot(q, n_new, len(p), s, [s.last])
                self._finish_if_done(slot)
        return [(x, self._first(x)) if isinstance(x, int) else x for x in out]

    def _first(self, seq: int) -> list[int]:
        """A joined slot's first token as its prefill emitted it (`Emitted`: with its
        log-probability when the slot's sampler asks)."""
        s = self.slots[seq].session
        return list(self.slots[seq].tokens) if s is None else s.emitted[:]

    def _check(self, prompt: Sequence[int], n_new: int) -> list[int]:
        return check_request(self.engine, prompt, n_new, per=" per slot")[0]

    def _finish_if_done(self, slot: Slot) -> None:
        s = slot.session
        end = None if s is None else grammar_end(s)  # a constrained response's EOG
        if s is not None and not slot.done and (s.metrics.n_generated >= slot.n_new
                                                or end is not None):
            # a slot drafts k to its end (every window the same length: upstream's split
            # then keeps the step in one ubatch); the tokens past n_new are dropped here
            n = slot.n_new if end is None else min(end, slot.n_new)
            del slot.tokens[n:]
            s.metrics.n_generated = n
            slot.metrics = session_metrics(self.engine, s, self.memory)

    def active(self) -> list[int]:
        """Slots that still generate."""
        return [q for q, sl in self.slots.items() if not sl.done]

    def step(self) -> dict[int, list[int]]:
        """Every unfinished slot one round, in one batch; each slot's emitted tokens (none
        past its n_new).

        Every slot drafts the engine's k (within its context), also in its last step:
        upstream splits a batch whose sequences have windows of different lengths into
        several ubatches (src/llama-batch.cpp ``split_equal``), each a pass over the
        shards; tokens drafted past a slot's n_new are verified and dropped."""
        self._live()
        live = [self.slots[q] for q in sorted(self.active())]
        with self.lock:
            fill = self._fill(live)
            if not live:
                return {}
            # in seq id order: upstream's split takes consecutive ids in batch order
            ss = sorted([sl.session for sl in live] + fill, key=lambda x: x.seq)
            emitted = dict(zip([x.seq for x in ss],
                               batch_step(self.engine, ss, [None] * len(ss)), strict=True))
            out = [emitted[sl.seq] for sl in live]
        got = {}
        for sl, toks in zip(live, out, strict=True):
            before = len(sl.tokens)
            sl.tokens += toks
            self._finish_if_done(sl)  # cuts at n_new, or after a grammar's EOG
            got[sl.seq] = toks[:max(0, len(sl.tokens) - before)]
        return got

    def leave(self, seq: int) -> tuple[list[int], GenerationMetrics] | None:
        """Free slot ``seq`` (finished or not); its (tokens, metrics) if it finished."""
        slot = self.slots.pop(seq, None)
        if slot is None:
            raise RuntimeInputError(f"no slot {seq}")
        if slot.session is not None and not self.closed:
            live = self.active()
            between = any(q < seq for q in live) and any(q > seq for q in live)
            with self.lock:
                if self.fill_gaps and between and slot.session.session.state is State.DECODING:
                    self.fillers[seq] = slot.session  # closed by `_fill` once not needed
                else:
                    self.engine.close(slot.session)
                self._fill([self.slots[q] for q in live if q in self.slots])
        return (slot.tokens, slot.metrics) if slot.done else None

    def _fill(self, live: list[Slot]) -> list[SpecSession]:
        """The fillers this step needs (seq ids between two live slots, with room left in
        their context); the others are closed."""
        seqs = [sl.seq for sl in live if not sl.done]
        lo, hi = (min(seqs), max(seqs)) if seqs else (0, 0)
        keep = []
        for q in sorted(self.fillers):
            s = self.fillers[q]
            if lo < q < hi and s.draft_room() == self.engine.k:  # a full window still fits
                keep.append(s)
            else:
                self._drop_filler(q)
        return keep

    def _drop_filler(self, seq: int) -> None:
        s = self.fillers.pop(seq, None)
        if s is not None:
            self.engine.close(s)

    def close(self) -> None:
        """Free every slot; idempotent."""
        for q in list(self.slots):
            self.leave(q)
        with self.lock:
            for q in list(self.fillers):
                self._drop_filler(q)
        self.closed = True
