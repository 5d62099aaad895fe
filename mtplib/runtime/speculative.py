"""MTP speculative decoding around upstream llama.cpp, implementing mtplib.contract.

One `Engine` owns a target context (and a drafter, e.g. the MTP block in its own context);
each `SpecSession` is one sequence id in them, with its own contract `Session` (state,
epoch, position). A step is: propose (DraftProposal) -> verify in one batched target
decode (VerifyResult) -> commit: roll back the rejected tail of the target's caches (tail
removal within n_rs_seq, else checkpoint restore + replay), feed the drafter the target's
rows for what was accepted. With k = 0 drafts a step is a plain one-token decode, so MTP
off and on run the same code.
"""

from __future__ import annotations

import contextlib
import math
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, fields, replace

import numpy as np

from mtplib.contract.capabilities import Policy
from mtplib.contract.labels import TIME_PARTS, StepKind
from mtplib.contract.session import Event, IllegalTransition, Session, State
from mtplib.contract.types import (
    DEFAULT_DRAFT,
    DraftProposal,
    DraftSpec,
    VerifyResult,
    draft_problem,
    plan_rollback,
)
from mtplib.runtime import build_info
from mtplib.runtime.drafters import Drafter
from mtplib.runtime.model import (
    Context,
    RuntimeInputError,
    check_n_ctx,
    check_n_new,
    check_tokens,
)
from mtplib.runtime.results import GenerationMetrics
from mtplib.runtime.sampling import Sampler
from mtplib.runtime.settings import DecodeSettings, RowSource

RowFn = Callable[[Context, int], np.ndarray]
#: hidden rows (n, hc*n_embd) -> logits (n, n_vocab): the trunk's output head run here
HeadFn = Callable[[np.ndarray], np.ndarray]
CHECKPOINTS = ("state", "replay")
#: where the output head runs; "auto" is resolved by the entry point (`resolve_head`)
HEADS = ("auto", "upstream", "client")
#: ``phase(label, n_tokens)`` -> context manager around each step kind (prefill, draft,
#: verify, decode, rollback, feed); ranged runs count seam bytes per label with it.
PhaseFn = Callable[[str, int], contextlib.AbstractContextManager]


def no_phase(label: str, n_tokens: int) -> contextlib.AbstractContextManager:
    return contextlib.nullcontext()


def top2_margin(logits: np.ndarray) -> float:
    a, b = np.partition(logits, -2)[-2:]
    return float(abs(b - a))


def api_rows(ctx: Context, n: int) -> np.ndarray:
    """The target's h_nextn rows as upstream's API returns them (see mtplib.runtime.rows)."""
    return ctx.nextn_rows(n)


@dataclass
class DraftCounts:
    """Drafted / accepted counts of one run, per draft position and by accepted length:
    counted in one place for every loop that verifies drafts (the engine's `Metrics`, the
    llama_cpp adapter's `DraftStats`)."""

    k: int
    drafted: int = 0
    accepted: int = 0
    drafted_per_position: list[int] = field(default_factory=list)
    accepted_per_position_n: list[int] = field(default_factory=list)
    accept_len_hist: Counter = field(default_factory=Counter)

    def __post_init__(self) -> None:
        self.drafted_per_position = [0] * self.k
        self.accepted_per_position_n = [0] * self.k

    def count(self, n_drafted: int, n_accepted: int) -> None:
        """One verification: ``n_accepted`` of ``n_drafted`` drafts kept (a prefix)."""
        self.drafted += n_drafted
        self.accepted += n_accepted
        self.accept_len_hist[n_accepted] += 1
        for i in range(n_drafted):
            self.drafted_per_position[i] += 1
            self.accepted_per_position_n[i] += i < n_accepted

    @property
    def acceptance_rate(self) -> float | None:
        return self.accepted / self.drafted if self.drafted else None

    @property
    def accepted_per_position(self) -> list[float | None]:
        """P(draft i accepted) per draft position i."""
        return [a / d if d else None for a, d in
                zip(self.accepted_per_position_n, self.drafted_per_position, strict=True)]

    def counts_dict(self) -> dict:
        return {
            "drafted": self.drafted,
            "accepted": self.accepted,
            "acceptance_rate": self.acceptance_rate,
            "accepted_per_position": self.accepted_per_position,
            "accepted_per_position_counts": list(self.accepted_per_position_n),
            "drafted_per_position": list(self.drafted_per_position),
            "accept_len_hist": {str(i): self.accept_len_hist.get(i, 0)
                                for i in range(self.k + 1)},
        }


@dataclass
class Metrics(DraftCounts):
    verify_steps: int = 0
    plain_steps: int = 0
    rollbacks: Counter = field(default_factory=Counter)
    t_prefill: float = 0.0
    t_draft: float = 0.0
    t_verify: float = 0.0
    t_feed: float = 0.0
    t_rollback: float = 0.0
    t_start: float = 0.0
    t_first: float | None = None
    t_end: float = 0.0
    n_prompt: int = 0
    n_generated: int = 0

    def result(self, **extra) -> GenerationMetrics:
        """What the generation measured, typed; ``extra``: what the caller adds (the row
        source, memory, the trace)."""
        dec = self.t_end - self.t_first if self.t_first else 0.0
        n_dec = max(self.n_generated - 1, 0)
        return GenerationMetrics(
            k=self.k, n_prompt=self.n_prompt, n_generated=self.n_generated,
            **self.counts_dict(), verify_steps=self.verify_steps, plain_steps=self.plain_steps,
            rollbacks=dict(self.rollbacks),
            ttft_s=(self.t_first - self.t_start) if self.t_first else None,
            decode_s=dec, decode_tok_s=n_dec / dec if dec > 0 else None,
            time_s=dict(zip(TIME_PARTS, (self.t_prefill, self.t_draft, self.t_verify,
                                         self.t_feed, self.t_rollback), strict=True)),
            **extra)


class SpecSession:
    """One sequence: its tokens, its contract Session, its checkpoints."""

    def __init__(self, engine: Engine, seq_id: int, session_id: str) -> None:
        self.engine, self.seq = engine, seq_id
        self.session = Session(session_id)
        self.tokens: list[int] = []  # committed: prompt + emitted
        self.rows: dict[int, np.ndarray] = {}  # recent target rows by position
        self.checkpoints: dict[int, bytes] = {}  # position -> target seq state (cached < pos)
        self.metrics = Metrics(k=engine.k)
        self._rows: np.ndarray | None = None
        self._picks: list[int] = []
        self._drafts: list[int] = []
        self.trace: list[dict] | None = [] if engine.trace else None
        #: position -> top-1 minus top-2 logit of the target's choice there (near-tie audit)
        self.margins: dict[int, float] | None = {} if engine.trace else None
        self.n_cached = 0  # target cache holds positions [0, n_cached)
        self.last_decode_len = 0

    # -- helpers ------------------------------------------------------------------------
    @property
    def id(self) -> str:
        return self.session.session_id

    @property
    def last(self) -> int:
        return self.tokens[-1]

    @property
    def base(self) -> int:
        """Position of the last emitted token (not yet decoded by the target)."""
        return len(self.tokens) - 1

    def _keep_rows(self, start: int, rows: np.ndarray | None) -> None:
        if rows is None:
            return
        for i, r in enumerate(rows):
            self.rows[start + i] = r
        horizon = start + len(rows) - self.engine.row_horizon
        for p in [p for p in self.rows if p < horizon]:
            del self.rows[p]

    def _emit(self, toks: Sequence[int]) -> None:
        self.tokens.extend(int(t) for t in toks)
        self.metrics.n_generated += len(toks)
        if self.metrics.t_first is None:
            self.metrics.t_first = time.perf_counter()

    # -- lifecycle ----------------------------------------------------------------------
    def prefill(self, prompt: Sequence[int]) -> int:
        """Decode the prompt (chunked), checkpoint it, emit the first token (TTFT)."""
        e, m = self.engine, self.metrics
        m.t_start = time.perf_counter()
        self.session = self.session.prefill_start()
        tokens = [int(t) for t in prompt]
        m.n_prompt = len(tokens)
        rows = []
        with e.phase(StepKind.PREFILL, len(tokens)):
            for a in range(0, len(tokens), e.target.n_batch):
                chunk = tokens[a : a + e.target.n_batch]
                last = a + len(chunk) == len(tokens) and e.head is None
                e.target.decode(chunk, range(a, a + len(chunk)), seq_id=self.seq,
                                logits=[False] * (len(chunk) - 1) + [last])
                if e.needs_rows:
                    rows.append(e.rows(e.target, len(chunk)))
            logits = e.target.logits(-1) if e.head is None else e.head(rows[-1][-1:])[0]
        if self.margins is not None:
            self.margins[len(tokens)] = top2_margin(logits)
        all_rows = np.concatenate(rows) if rows else None
        self.n_cached, self.last_decode_len = len(tokens), len(tokens) - a
        self.tokens = tokens
        self._keep_rows(0, all_rows)
        m.t_prefill = time.perf_counter() - m.t_start
        if e.checkpoints == "state":
            with e.phase(StepKind.ROLLBACK, 0):
                self._checkpoint(len(tokens))
        t0 = time.perf_counter()
        with e.feed_phase(len(tokens)):
            e.drafter.prefill(self.seq, tokens, all_rows if e.drafter.needs_rows else None)
        m.t_feed += time.perf_counter() - t0
        self.session = self.session.prefill_done(len(tokens))
        first = e.sampler.pick(logits, stream=self.seq, position=len(tokens),
                               history=tokens if e.sampler.penalized else None)
        self._emit([first])
        self.session = self.session.decode(1)
        return first

    def propose(self, k: int | None = None) -> DraftProposal | None:
        """Draft up to k tokens after the last one; None when none fit (a plain step)."""
        e = self.engine
        k = e.k if k is None else k
        k = max(0, min(k, e.target.n_ctx - 1 - self.base))
        if k == 0:
            return None
        self.session = self.session.draft()
        t0 = time.perf_counter()
        with e.phase(StepKind.DRAFT, k):
            drafts = e.drafter.propose(self.seq, self.last, self.base, k)
        self.metrics.t_draft += time.perf_counter() - t0
        if len(drafts) != k:
            raise RuntimeInputError(f"drafter {e.drafter.name} returned {len(drafts)} of {k}")
        return DraftProposal(self.id, self.session.epoch, self.base, tuple(drafts), 0,
                             DraftSpec(k).recipe)

    def verify(self, proposal: DraftProposal | None) -> VerifyResult | None:
        """Decode [last, drafts...] in one target batch; accept while the target agrees.

        Refuses a proposal from another session or a stale epoch. Returns None for a
        plain step (no proposal); the picks and rows wait in the session for commit().
        """
        e, m = self.engine, self.metrics
        if proposal is not None:
            self.session.check_message(proposal.session_id, proposal.epoch)
            if proposal.base_position != self.base:
                raise RuntimeInputError(
                    f"proposal for base {proposal.base_position}, session is at {self.base}")
            self.session = self.session.verify()
        drafts = list(proposal.drafts) if proposal else []
        k, base = len(drafts), self.base
        if base + k >= e.target.n_ctx:
            raise RuntimeInputError(f"context full: {base + k + 1} > n_ctx {e.target.n_ctx}")
        if k > e.target.n_rs_seq and e.checkpoints == "state":  # beyond tail removal
            t0 = time.perf_counter()
            with e.phase(StepKind.ROLLBACK, 0):
                self._checkpoint(base)
            m.t_rollback += time.perf_counter() - t0
        t0 = time.perf_counter()
        with e.phase(StepKind.VERIFY if k else StepKind.DECODE, k + 1):
            e.target.decode([self.last, *drafts], range(base, base + k + 1), seq_id=self.seq,
                            logits=e.head is None)
            self._rows = e.rows(e.target, k + 1) if e.needs_rows else None
            picks = []
            # one copy of the k+1 rows: upstream's logits, or the head run on the rows here
            lg_all = e.target.logits_all(k + 1) if e.head is None else e.head(self._rows)
            # a penalized pick's history: the committed tokens, then the drafts before it
            # (its history exactly when this pick is the one emitted there)
            hist = self.tokens + drafts if e.sampler.penalized else None
            for i in range(k + 1):
                lg = lg_all[i]
                picks.append(e.sampler.pick(lg, stream=self.seq, position=base + 1 + i,
                                            history=None if hist is None
                                            else hist[:base + 1 + i]))
                if self.margins is not None:
                    self.margins[base + 1 + i] = top2_margin(lg)
        m.t_verify += time.perf_counter() - t0
        self.n_cached, self.last_decode_len = base + k + 1, k + 1
        self._picks, self._drafts = picks, drafts
        if proposal is None:
            return None
        # synthetic acceptance (upstream's --spec-synth-rates), or the warm-up's forced one
        decide = e.forced_accept or getattr(e.drafter, "accept_len", None)
        if decide is not None:
            n_acc = decide(picks, drafts)
        else:
            n_acc = 0
            while n_acc < k and picks[n_acc] == drafts[n_acc]:
                n_acc += 1
        return VerifyResult(self.id, proposal.epoch, base, k, n_acc, picks[n_acc],
                            (*drafts[:n_acc], picks[n_acc]))

    def _checkpoint(self, pos: int) -> None:
        """Save the target's state for this sequence (positions < pos); keep the prefill
        checkpoint and the newest one only."""
        keep = {self.metrics.n_prompt}
        for p in [p for p in self.checkpoints if p not in keep]:
            del self.checkpoints[p]
        self.checkpoints[pos] = self.engine.target.state_get(self.seq)

    def _rollback_target(self, keep_until: int) -> str:
        """Drop target positions >= keep_until: tail removal, else checkpoint + replay."""
        e = self.engine
        plan = plan_rollback(self.n_cached, keep_until, e.target.n_rs_seq, self.last_decode_len,
                             checkpoint_at=self._checkpoint_at(keep_until))
        if plan.kind == "none":
            return "none"
        if plan.kind == "tail" and e.target.seq_rm(self.seq, keep_until, -1):
            self.n_cached = keep_until
            return "tail"
        ckpt = plan.replay_from if plan.kind == "checkpoint_replay" else \
            self._checkpoint_at(keep_until)
        self._restore(ckpt)
        replay = self.tokens[ckpt:keep_until]
        for a in range(0, len(replay), e.target.n_batch):
            chunk = replay[a : a + e.target.n_batch]
            e.target.decode(chunk, range(ckpt + a, ckpt + a + len(chunk)), seq_id=self.seq)
            if e.needs_rows:
                self._keep_rows(ckpt + a, e.rows(e.target, len(chunk)))
        self.n_cached = keep_until
        self.last_decode_len = len(replay)
        return "checkpoint_replay"

    def _checkpoint_at(self, pos: int) -> int:
        if self.engine.checkpoints == "replay":
            return 0  # no state was saved: replay from the start
        ok = [p for p in self.checkpoints if p <= pos]
        return max(ok) if ok else 0

    def _restore(self, ckpt: int) -> None:
        e = self.engine
        e.target.seq_rm(self.seq, 0, -1)
        if ckpt > 0:
            e.target.state_set(self.seq, self.checkpoints[ckpt])
        for p in [p for p in self.checkpoints if p > ckpt]:
            del self.checkpoints[p]

    def commit(self, result: VerifyResult | None) -> list[int]:
        """Apply a verify outcome: roll back rejected drafts, feed the drafter, emit.

        Refuses, before anything changes, a result of another session, epoch or base, or
        one with no verify of this session pending (e.g. the same result twice)."""
        e, m = self.engine, self.metrics
        self._check_commit(result)
        base, rows = self.base, self._rows
        if result is None:  # plain step
            emitted, n_acc, k = self._picks[:1], 0, 0
            m.plain_steps += 1
        else:
            emitted, n_acc, k = list(result.emitted), result.n_accepted, result.n_drafted
            m.verify_steps += 1
            m.count(k, n_acc)
        last = self.last
        self._emit(emitted)  # replay after a checkpoint restore reads the accepted tokens
        keep = base + n_acc + 1
        if self.n_cached > keep:  # rejected drafts are cached: a rollback step (timed)
            t0 = time.perf_counter()
            with e.phase(StepKind.ROLLBACK, 0):
                m.rollbacks[self._rollback_target(keep)] += 1
            m.t_rollback += time.perf_counter() - t0
        if rows is not None:
            rows = rows[: n_acc + 1]
            self._keep_rows(base, rows)
        t0 = time.perf_counter()
        with e.feed_phase(n_acc + 1):
            e.drafter.commit(self.seq, base, [last, *emitted[:n_acc]], rows)
        m.t_feed += time.perf_counter() - t0
        self.session = self.session.accept(n_acc, k) if k else self.session.decode(1)
        if self.trace is not None:
            self.trace.append({"pos": base, "drafts": list(self._drafts), "accepted": n_acc})
        return emitted

    def _check_commit(self, result: VerifyResult | None) -> None:
        if result is None:  # a plain step: nothing was proposed
            if self.session.state is not State.DECODING:
                raise IllegalTransition(self.session.state, Event.DECODE)
            return
        self.session.check_message(result.session_id, result.epoch)
        if self.session.state is not State.VERIFYING:
            raise IllegalTransition(self.session.state, Event.ACCEPT)
        if result.base_position != self.base:
            raise RuntimeInputError(f"verify result for base {result.base_position}, "
                                    f"session is at {self.base}")

    def step(self, k: int | None = None) -> list[int]:
        """One propose -> verify -> commit round; returns the emitted tokens."""
        return self.commit(self.verify(self.propose(k)))

    def generate(self, n_new: int) -> list[int]:
        """Emit tokens until ``n_new`` have been generated since the prompt."""
        while self.metrics.n_generated < n_new:
            self.step(min(self.engine.k, n_new - self.metrics.n_generated - 1))
        self.metrics.t_end = time.perf_counter()
        return self.tokens[self.metrics.n_prompt :]

    def truncate(self, keep: int) -> None:
        """Keep tokens [0, keep): token keep-1 becomes the last (undecoded) one."""
        if not 1 <= keep <= len(self.tokens):
            raise RuntimeInputError(f"truncate keep={keep} outside [1, {len(self.tokens)}]")
        e = self.engine
        if self.n_cached > keep - 1:  # cached positions to drop: a rollback (timed)
            t0 = time.perf_counter()
            self.metrics.rollbacks["truncate_" + self._rollback_target(keep - 1)] += 1
            self.metrics.t_rollback += time.perf_counter() - t0
        del self.tokens[keep:]
        self.session = self.session.truncate(keep)
        last_row = self.rows.get(keep - 2)
        if e.drafter.needs_rows and keep >= 2 and last_row is None:
            raise RuntimeInputError(f"no target row kept for position {keep - 2}")
        e.drafter.truncate(self.seq, keep, last_row)


class Engine:
    """A target context, a drafter and the sessions sharing them (one seq id each)."""

    def __init__(self, target: Context, drafter: Drafter, *, k: int,
                 sampler: Sampler | None = None, rows: RowFn = api_rows,
                 trace: bool = False, phase: PhaseFn = no_phase,
                 head: HeadFn | None = None, checkpoints: str = "state") -> None:
        if problem := draft_problem("draft length k", k):
            raise RuntimeInputError(problem)
        if k + 1 > target.n_batch:
            raise RuntimeInputError(f"k+1={k + 1} exceeds the target's n_batch {target.n_batch}")
        if (drafter.needs_rows or head is not None) and target.cfg.nextn_rows != "all":
            raise RuntimeInputError("MTP drafting and a client-side head need the target "
                                    "created with nextn_rows='all'")
        if checkpoints not in CHECKPOINTS:
            raise RuntimeInputError(f"checkpoints must be one of {CHECKPOINTS}, got "
                                    f"{checkpoints!r}")
        self.target, self.drafter, self.k = target, drafter, k
        #: logits from hidden rows in this process (the target then decodes rows only)
        self.head = head
        #: "state": llama_state_seq checkpoints for deep rollback; "replay": never move a
        #: sequence's state (ranged: caches are shard-local), re-decode from position 0
        self.checkpoints = checkpoints
        self.sampler = sampler or Sampler()
        self.rows = rows
        self.row_horizon = max(k, target.n_rs_seq) + 4
        self.trace = trace
        self.phase = phase
        self.hidden_rows = "api" if drafter.needs_rows else "off"
        self.sessions: dict[int, SpecSession] = {}
        #: sessions opened so far per seq id: a reused seq id gets a new session id
        self._opened: Counter = Counter()
        #: (picks, drafts) -> accepted length, overriding the match (`warm_up` only)
        self.forced_accept: Callable[[Sequence[int], Sequence[int]], int] | None = None

    @property
    def needs_rows(self) -> bool:
        """The target's hidden rows are read after every decode (for the drafter, or for a
        head that runs here)."""
        return self.drafter.needs_rows or self.head is not None

    def feed_phase(self, n_tokens: int) -> contextlib.AbstractContextManager:
        """Feeding the drafter is a step kind only when there is a drafter to feed."""
        if self.drafter.needs_rows:
            return self.phase(StepKind.FEED, n_tokens)
        return contextlib.nullcontext()

    def open(self, prompt: Sequence[int], *, seq_id: int | None = None,
             session_id: str | None = None) -> SpecSession:
        if seq_id is None:
            free = [s for s in range(self.target.n_seq_max) if s not in self.sessions]
            if not free:
                raise RuntimeInputError(f"all {self.target.n_seq_max} sequences are in use")
            seq_id = free[0]
        if seq_id in self.sessions:
            raise RuntimeInputError(f"sequence {seq_id} already has a session")
        if not prompt:
            raise RuntimeInputError("the prompt is empty: give at least one token")
        # a new identity each time (s0, then s0.2, ...): a message of a closed session
        # must not reach the next session on the same seq id (same epoch 0, same base)
        if session_id is not None and any(o.id == session_id for o in self.sessions.values()):
            raise RuntimeInputError(f"session id {session_id!r} is already open")
        self._opened[seq_id] += 1
        n = self._opened[seq_id]
        s = SpecSession(self, seq_id, session_id or (f"s{seq_id}" if n == 1 else
                                                     f"s{seq_id}.{n}"))
        self.sessions[seq_id] = s
        s.prefill(prompt)
        return s

    def close(self, s: SpecSession) -> None:
        """Free the session's sequence in every context; its caches are dropped."""
        self.target.seq_rm(s.seq, 0, -1)
        self.drafter.truncate(s.seq, 1, None)
        s.session = s.session.close()
        del self.sessions[s.seq]


def expected_verify_steps(n_new: int, k: int) -> int:
    """With 100% acceptance: the first token comes from the prefill, then k+1 per step."""
    return math.ceil((n_new - 1) / (k + 1)) if n_new > 1 else 0


@dataclass
class EngineOptions:
    """Everything an Engine is built with, besides the models (picklable: it crosses into
    the ranged worker process)."""

    k: int = DEFAULT_DRAFT
    #: context and decoding settings (the same type upstream's side of a comparison takes)
    settings: DecodeSettings = DecodeSettings()
    n_seq_max: int = 1
    n_rs_seq: int | None = None  # default: k (tail rollback always suffices)
    sampler: Sampler | None = None
    trace: bool = False
    #: "upstream": logits from the target's graph; "client": the target decodes hidden rows
    #: only and the output head (hc head, norm, output) runs here, so a ranged tail sends
    #: hc*n_embd floats per row instead of n_vocab logits, in the same wait as the rows;
    #: "auto" (`resolve_head`): client for ranged MTP, upstream otherwise
    head: str = "auto"
    #: "state": llama_state_seq checkpoints for rollback beyond n_rs_seq; "replay": never
    #: move a sequence's state (ranged runs: caches stay on their shards), replay from 0
    checkpoints: str = "state"
    #: make upstream reserve its graph again once the target reads hidden rows
    #: (rows.force_reserve), and decide the row source with that fix applied: the API rows
    #: are then right where the check proves them right, with no graph split for a capture
    reserve: bool = True

    @classmethod
    def build(cls, base: EngineOptions | None = None, /, **fields_: object) -> EngineOptions:
        """The one request object from keywords: any EngineOptions field, and any
        DecodeSettings field (replaced into ``settings``), on top of ``base`` (default:
        the defaults), e.g. ``EngineOptions.build(k=2, n_ctx=512)``. Validated here."""
        own = {f.name for f in fields(cls)}
        setting_names = {f.name for f in fields(DecodeSettings)}
        unknown = set(fields_) - own - setting_names
        if unknown:
            raise TypeError(f"got unexpected keyword arguments {sorted(unknown)}")
        opts = base or cls()
        mine = {k: v for k, v in fields_.items() if k in own}
        settings = mine.pop("settings", None) or opts.settings
        overrides = {k: v for k, v in fields_.items() if k in setting_names}
        return replace(opts, settings=replace(settings, **overrides), **mine)

    @property
    def draft(self) -> DraftSpec:
        """The contract's draft spec of these options (k, recipe, MTP on)."""
        return DraftSpec(self.k)

    def resolved(self, *, ranged: bool) -> EngineOptions:
        """These options with ``head="auto"`` made concrete (`resolve_head`)."""
        return replace(self, head=resolve_head(self.head, ranged=ranged, mtp=self.draft.mtp))

    def __post_init__(self) -> None:
        if problem := draft_problem("draft length k", self.k):
            raise RuntimeInputError(problem)
        if self.head not in HEADS:
            raise RuntimeInputError(f"head must be one of {HEADS}, got {self.head!r}")
        if self.checkpoints not in CHECKPOINTS:
            raise RuntimeInputError(f"checkpoints must be one of {CHECKPOINTS}, got "
                                    f"{self.checkpoints!r}")


def resolve_head(head: str, *, ranged: bool, mtp: bool) -> str:
    """``auto``: the client's head for ranged MTP (the tail then sends hc*n_embd hidden rows,
    which the drafter needs anyway, in the same wait as the logits it replaces: a verify step
    waits as often as a plain one), upstream's everywhere else."""
    if head != "auto":
        return head
    return "client" if ranged and mtp else "upstream"


def build_engine(trunk, sidecar, opts: EngineOptions, *, drafter: Drafter | None = None,
                 rows: RowFn | None = None, phase: PhaseFn = no_phase) -> tuple[Engine, list]:
    """Contexts and an Engine over already-loaded models; returns (engine, contexts to
    close). MTP drafts when a sidecar is given and k > 0 (unless a drafter is given)."""
    from mtplib.runtime.drafters import MTPDrafter
    from mtplib.runtime.model import ContextConfig, context_threads

    use_mtp = sidecar is not None and opts.draft.mtp and drafter is None
    if opts.head == "auto":
        raise RuntimeInputError("head='auto' must be resolved by the entry point "
                                "(EngineOptions.resolved) before the engine is built")
    client_head = opts.head == "client"
    needs_rows = use_mtp or (drafter is not None and drafter.needs_rows) or client_head
    s = opts.settings
    owned: list = []
    tcfg = ContextConfig.from_settings(
        s, n_seq_max=opts.n_seq_max, n_rs_seq=opts.k if opts.n_rs_seq is None else opts.n_rs_seq,
        nextn_rows="all" if needs_rows else "off")
    if trunk.endpoints:  # ranged: the client computes only the token lookup (context_threads)
        tcfg = replace(tcfg, n_threads=context_threads(trunk, s.n_threads))
    mode, capture = "off", None
    if needs_rows and rows is None:
        mode, capture = _row_source(trunk, tcfg, s.hidden_rows, reserve=opts.reserve)
        if mode == "captured":
            rows = lambda _ctx, n: capture.take(n)  # noqa: E731
    try:
        target = Context(trunk, tcfg, cb_eval=capture.callback if capture else None)
        owned.append(target)
        if needs_rows and opts.reserve:
            from mtplib.runtime.rows import force_reserve

            force_reserve(target)
        head = None
        if client_head:
            from mtplib.runtime.rows import client_head as head_of

            head = head_of(trunk.path).logits
        if use_mtp:
            # masked: the MTP graph's h_nextn has output rows only (unmasked aborts upstream)
            mtp_ctx = Context(sidecar, ContextConfig.from_settings(
                s, n_seq_max=opts.n_seq_max, mtp=True, nextn_rows="masked",
                n_threads=context_threads(sidecar, s.n_threads)))
            owned.append(mtp_ctx)
            drafter = MTPDrafter(mtp_ctx)
        engine = Engine(target, drafter or Drafter(), k=opts.k if drafter else 0,
                        sampler=opts.sampler, rows=rows or api_rows, trace=opts.trace,
                        phase=phase, head=head, checkpoints=opts.checkpoints)
        engine.hidden_rows = mode if needs_rows else "off"
    except BaseException:
        for c in reversed(owned):
            c.close()
        raise
    return engine, owned


def _row_source(trunk, tcfg, want: RowSource, *, reserve: bool):
    """(mode, CapturedRows or None) for the target's rows; fail-closed on "unsupported".
    ``want`` was checked with the rest of the DecodeSettings."""
    from mtplib.runtime.row_source import choose_row_source
    from mtplib.runtime.rows import CapturedRows

    check_n_ctx(trunk, tcfg.n_ctx)  # the real reason, not "MTP is unsupported"
    mode = want
    if want == "auto":
        d = choose_row_source(trunk, tcfg, reserve=reserve)
        if d.mode == "unsupported":
            raise RuntimeInputError(f"MTP is unsupported for this context configuration: "
                                    f"{d.reason}")
        mode = d.mode
    return mode, (CapturedRows(trunk.n_embd_out) if mode == "captured" else None)


def generation_steps(engine: Engine, prompt: Sequence[int], n_new: int, *,
                     seq_id: int | None = None, memory: Callable[[int], dict] | None = None,
                     result: dict | None = None) -> Iterator[list[int]]:
    """The one generation loop: open a session, yield the tokens each step emits (the first
    from the prefill), then put ``"tokens"`` and ``"metrics"`` (and the trace) into
    ``result`` and close the session. Closing the iterator early closes the session too.
    ``n_new`` 0 generates nothing (no decode at all)."""
    n_new = check_n_new(n_new)
    prompt = check_tokens(prompt, engine.target.n_vocab)
    if not prompt:
        raise RuntimeInputError("the prompt is empty: give at least one token")
    if len(prompt) + n_new > engine.target.n_ctx:
        raise RuntimeInputError(
            f"prompt ({len(prompt)} tokens) + {n_new} new tokens exceed the context "
            f"of {engine.target.n_ctx} tokens; shorten the prompt or lower --n")
    if n_new == 0:  # the prefill would emit a first token: decode nothing instead
        m = Metrics(k=engine.k)
        m.n_prompt = len(prompt)
        metrics = m.result(hidden_rows=engine.hidden_rows,
                           memory=None if memory is None else
                           memory(0 if seq_id is None else seq_id))
        if result is not None:
            result["tokens"], result["metrics"] = [], metrics
        return
    s = engine.open(prompt, seq_id=seq_id)
    try:
        yield [s.last]
        while s.metrics.n_generated < n_new:
            yield s.step(min(engine.k, n_new - s.metrics.n_generated - 1))
        s.metrics.t_end = time.perf_counter()
        traced = s.trace is not None
        metrics = s.metrics.result(
            hidden_rows=engine.hidden_rows,
            # forced acceptance: the speed counts, the tokens do not
            synthetic=bool(getattr(engine.drafter, "synthetic", False)),
            memory=None if memory is None else memory(s.seq),
            steps=s.trace if traced else None,
            margins={str(p): m for p, m in sorted(s.margins.items()) if p >= len(prompt)}
            if traced else None)
        if result is not None:
            result["tokens"] = s.tokens[s.metrics.n_prompt:]
            result["metrics"] = metrics
    finally:
        engine.close(s)


def run_generation(engine: Engine, prompt: Sequence[int], n_new: int, *,
                   seq_id: int | None = None, memory: Callable[[int], dict] | None = None
                   ) -> tuple[list[int], GenerationMetrics]:
    """Open a session, generate, report metrics (and the trace), close the session."""
    out: dict = {}
    for _ in generation_steps(engine, prompt, n_new, seq_id=seq_id, memory=memory, result=out):
        pass
    return out["tokens"], out["metrics"]


class Generation:
    """One generation as it happens: iterating yields the tokens each step emits (the first
    one from the prefill); afterwards ``tokens`` and ``metrics`` hold what `generate` would
    have returned. `close` (or leaving a ``with`` block) ends it early and frees its
    sequence; the object that made it serves the next generation only after that."""

    def __init__(self, steps: Iterator[list[int]], result: dict) -> None:
        self._steps, self._result = steps, result
        self.done = False

    def __iter__(self) -> Iterator[list[int]]:
        try:
            yield from self._steps
            self.done = True
        finally:
            self.close()

    @property
    def tokens(self) -> list[int]:
        return self._require("tokens")

    @property
    def metrics(self) -> GenerationMetrics:
        return self._require("metrics")

    def _require(self, key: str):
        if key not in self._result:
            raise RuntimeInputError(f"the generation has not finished: {key} is known once "
                                    "every step has been read")
        return self._result[key]

    def close(self) -> None:
        close = getattr(self._steps, "close", None)
        if close is not None:
            close()

    def __enter__(self) -> Generation:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def warm_up(engine: Engine, *, n_prompt: int = 8) -> dict:
    """Run every graph shape a generation decodes once, on a throwaway sequence: the plain
    step (1 token), each verify width 2..k+1, each feed width 1..k+1, the drafts, rollbacks.

    Why: upstream's RPC client asks a shard for the allocation size of every new matmul /
    attention shape (a blocking round trip each, cached process-wide) and its scheduler
    reallocates compute buffers on first use; a fresh process paid that inside its first
    verify steps (up to 8.5 waits per verify step instead of 3 over a WAN). Paid here, at
    load, it is setup time apart from TTFT. Returns {"setup_s", "widths"}."""
    t0 = time.perf_counter()
    k, target = engine.k, engine.target
    n_prompt = max(1, min(n_prompt, target.n_ctx - (k + 2) * (k + 3)))
    prompt = [1 % target.n_vocab] * n_prompt
    widths: list[int] = []
    s = engine.open(prompt)
    try:
        plan = [(k, n) for n in range(k + 1)]  # verify k+1, feed n+1 for every n accepted
        plan += [(kk, 0) for kk in range(1, k)] + [(0, 0)]  # verify widths 2..k, plain
        for kk, n_acc in plan:
            if s.base + kk + 1 >= target.n_ctx:
                break
            engine.forced_accept = (lambda _p, d, n=n_acc: min(n, len(d))) if kk else None
            s.step(kk)
            widths.append(kk + 1)
    finally:
        engine.forced_accept = None
        engine.close(s)
    return {"setup_s": time.perf_counter() - t0, "widths": sorted(set(widths))}


class MTPRuntime:
    """Load a trunk (+ optional `mtp-` sidecar), create the contexts, build the Engine.

    Without a sidecar (or k = 0) it decodes plainly through the same loop, so MTP off and
    on share every line of code except the drafter.

    ``policy`` (a Policy or its name; default $MTPLIB_POLICY, else beta) is negotiated
    before any model is loaded: with a sidecar and k > 0 a policy that disables MTP
    (alpha) raises RouteRefused naming it. Plain decoding is always allowed.

    Thread-safe by serializing: every method takes one lock while it calls upstream
    (`generate`, `stream` from its first step until it is exhausted or closed, the
    tokenizer, `memory`, `close`), so concurrent callers run one after another: upstream's
    context is not safe for concurrent decodes, even on different sequences (that crashed
    the process). ``engine`` and ``target`` used directly are not locked. After ``close()``
    every method raises RuntimeInputError. ``warm=True`` runs `warm_up` at load (``setup``
    in `generate`'s metrics), so no generation pays first-use graph allocation.
    """

    def __init__(self, trunk: str, sidecar: str | None = None, *,
                 opts: EngineOptions | None = None, rows: RowFn | None = None,
                 drafter: Drafter | None = None, trunk_kwargs: dict | None = None,
                 sidecar_kwargs: dict | None = None, policy: Policy | str | None = None,
                 warm: bool = False, **options) -> None:
        """``opts``: the request (`EngineOptions`); any of its fields, or of DecodeSettings',
        given as keywords replace those (`EngineOptions.build`), e.g. ``MTPRuntime(t, s,
        k=2, n_ctx=512, kv_type="f32")``. Validated and routed once, here."""
        from mtplib.model.gguf_header import read_header
        from mtplib.runtime.model import Model, check_pair
        from mtplib.runtime.routing import (
            certified_recipes,
            resolve_policy,
            route,
            routing_metrics,
        )

        try:
            opts = EngineOptions.build(opts, **options)
        except TypeError as e:
            raise TypeError(f"MTPRuntime {e}") from None
        self.opts = opts.resolved(ranged=False)
        self._owned: list = []
        self._lock = threading.RLock()  # serializes every call into upstream (class doc)
        self.closed = False
        self.setup: dict | None = None
        spec = DraftSpec(opts.k if sidecar is not None else 0)  # what is negotiated
        use_mtp = spec.mtp and drafter is None
        # each header is read and validated once: the pair check validates both, and the
        # Model takes the checked header
        trunk_kwargs, sidecar_kwargs = dict(trunk_kwargs or {}), dict(sidecar_kwargs or {})
        if sidecar is not None:
            trunk_kwargs.setdefault("header", read_header(trunk))
            sidecar_kwargs.setdefault("header", read_header(sidecar))
            check_pair(trunk_kwargs["header"], sidecar_kwargs["header"])
            trunk_kwargs["validated"] = sidecar_kwargs["validated"] = True
        self.policy = resolve_policy(policy)
        # a passing certification run for this exact pair (if recorded) makes the advert's
        # recipe certified, so a policy that wants certified can route it
        certified = certified_recipes(trunk, sidecar) if spec.mtp else frozenset()
        self.routing = routing_metrics(route(spec, policy=self.policy, certified=certified),
                                       self.policy)
        try:
            self.trunk = Model(trunk, **trunk_kwargs)
            self._owned.append(self.trunk)
            self.sidecar = None
            if use_mtp:
                self.sidecar = Model(sidecar, load_mtp=True, **sidecar_kwargs)
                self._owned.append(self.sidecar)
            self.engine, ctxs = build_engine(self.trunk, self.sidecar, self.opts,
                                             drafter=drafter, rows=rows)
            self._owned += ctxs
            self.target = self.engine.target
            self.mtp_ctx = ctxs[1] if len(ctxs) > 1 else None
            if warm:
                self.setup = warm_up(self.engine)
        except BaseException:
            self.close()
            raise

    @property
    def n_ctx(self) -> int:
        return self.target.n_ctx

    def stream(self, prompt: Sequence[int], n_new: int, *, seq_id: int | None = None,
               sampler: Sampler | None = None) -> Generation:
        """`generate` step by step: a `Generation` yielding each step's tokens; the lock is
        held from the first step until it is exhausted or closed. ``sampler`` replaces the
        runtime's for this generation only."""
        result: dict = {}
        return Generation(self._steps(list(prompt), n_new, seq_id, sampler, result), result)

    def _steps(self, prompt, n_new, seq_id, sampler, result) -> Iterator[list[int]]:
        with self._lock:
            self._live()
            e = self.engine
            saved = e.sampler
            e.sampler = sampler or saved
            try:
                yield from generation_steps(e, prompt, n_new, seq_id=seq_id,
                                            memory=self.memory, result=result)
            finally:
                e.sampler = saved
            result["metrics"] = replace(
                result["metrics"], routing=dict(self.routing), upstream=build_info(),
                setup=None if self.setup is None else dict(self.setup))

    def generate(self, prompt: Sequence[int], n_new: int, *, seq_id: int | None = None,
                 sampler: Sampler | None = None) -> tuple[list[int], GenerationMetrics]:
        g = self.stream(prompt, n_new, seq_id=seq_id, sampler=sampler)
        for _ in g:
            pass
        return g.tokens, g.metrics

    def _live(self) -> None:
        if self.closed:
            raise RuntimeInputError("this MTPRuntime is closed: create a new one")

    def tokenize(self, text: str) -> list[int]:
        with self._lock:
            self._live()
            return self.trunk.tokenize(text)

    def detokenize(self, tokens: Sequence[int]) -> str:
        with self._lock:
            self._live()
            return self.trunk.detokenize(tokens)

    def memory(self, seq: int = 0) -> dict:
        """Process peak RSS and upstream's own sizes: weights and per-sequence cache state."""
        import resource

        with self._lock:
            self._live()
            mem = {"rss_peak_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                   "trunk_weights_bytes": self.trunk.size_bytes,
                   "target_seq_state_bytes": self.target.state_size(seq)}
            if self.mtp_ctx is not None:
                mem["mtp_weights_bytes"] = self.sidecar.size_bytes
                mem["mtp_seq_state_bytes"] = self.mtp_ctx.state_size(seq)
        return mem

    def close(self) -> None:
        """Free the contexts and models (waits for a generation in progress); idempotent."""
        with self._lock:
            self.closed = True
            for obj in reversed(self._owned):
                obj.close()
            self._owned.clear()

    def __enter__(self) -> MTPRuntime:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
