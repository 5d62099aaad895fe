"""The engine: a target context, a drafter, and one `SpecSession` per sequence id.

A step is: propose (DraftProposal) -> verify in one batched target decode (VerifyResult)
-> commit: roll back the rejected tail of the target's caches (tail removal within
n_rs_seq, else checkpoint restore + replay), feed the drafter the target's rows for what
was accepted. With k = 0 drafts a step is a plain one-token decode, so MTP off and on run
the same code. (Split from `mtplib.runtime.speculative`, which still exports every name.)
"""

from __future__ import annotations

import contextlib
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from typing import SupportsIndex, overload

import numpy as np

from mtplib.contract.labels import StepKind
from mtplib.contract.session import Event, IllegalTransition, Session, State
from mtplib.contract.types import (
    ContractError,
    DraftLength,
    DraftProposal,
    DraftSpec,
    VerifyResult,
    checked_draft,
    plan_rollback,
)
from mtplib.runtime.drafters import Drafter
from mtplib.runtime.grammar import Grammar, SessionGrammar, open_session_grammar
from mtplib.runtime.model import Context, RuntimeInputError
from mtplib.runtime.sampling import Sampler, TokenLogprob, token_logprob
from mtplib.runtime.spec_metrics import Metrics

RowFn = Callable[[Context, int], np.ndarray]
#: hidden rows (n, hc*n_embd) -> logits (n, n_vocab): the trunk's output head run here
HeadFn = Callable[[np.ndarray], np.ndarray]
CHECKPOINTS = ("state", "replay")
#: ``phase(label, n_tokens)`` -> context manager around each step kind (prefill, draft,
#: verify, decode, rollback, feed); ranged runs count seam bytes per label with it.
PhaseFn = Callable[[str, int], contextlib.AbstractContextManager]


def no_phase(label: str, n_tokens: int) -> contextlib.AbstractContextManager:
    return contextlib.nullcontext()


def top2_margin(logits: np.ndarray) -> float:
    a, b = np.partition(logits, -2)[-2:]
    return float(abs(b - a))


class Emitted(list[int]):
    """One step's emitted token ids (a list), with each one's `TokenLogprob` when the
    session's sampler asks for them (``Sampler.logprobs``; else ``logprobs`` is None).

    Why on the list: the records go wherever the step's tokens go (back over a ranged
    worker's pipe, into a batch slot's stream) with nothing else to carry, on the whole
    model and on shards alike; a slice keeps its tokens' records."""

    def __init__(self, tokens: Iterable[int] = (),
                 logprobs: Iterable[TokenLogprob] | None = None) -> None:
        super().__init__(tokens)
        self.logprobs: list[TokenLogprob] | None = None if logprobs is None \
            else list(logprobs)

    @overload
    def __getitem__(self, i: SupportsIndex) -> int: ...

    @overload
    def __getitem__(self, i: slice) -> Emitted: ...

    def __getitem__(self, i: SupportsIndex | slice) -> int | Emitted:
        if isinstance(i, slice):
            lp = self.logprobs
            return Emitted(super().__getitem__(i), None if lp is None else lp[i])
        return super().__getitem__(i)


def api_rows(ctx: Context, n: int) -> np.ndarray:
    """The target's h_nextn rows as upstream's API returns them (see mtplib.runtime.rows)."""
    return ctx.nextn_rows(n)


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
        #: this session's sampler (None: the engine's) and its random stream id (None: the
        #: seq id); a batch slot sets both, so a request samples as it would alone
        self.own_sampler: Sampler | None = None
        self.stream: int | None = None
        #: a drafter feed `commit` left to the caller (`commit(defer_feed=True)`): the
        #: batch step feeds every session's in one drafter decode
        self.pending_feed: tuple | None = None
        #: while the sampler asks for log-probabilities: the logits of this step's picks by
        #: position (a position picked again is replaced); `_emit` reads the emitted ones
        self._picked: dict[int, np.ndarray] = {}
        #: the last tokens emitted (the prefill's first one after `prefill`)
        self.emitted = Emitted()
        #: structured output: this sequence's grammar state (`Engine.open` builds it from
        #: the sampler's grammar; None: unconstrained)
        self.grammar: SessionGrammar | None = None

    # -- helpers ------------------------------------------------------------------------
    @property
    def id(self) -> str:
        return self.session.session_id

    @property
    def sampler(self) -> Sampler:
        return self.own_sampler or self.engine.sampler

    @property
    def sample_stream(self) -> int:
        return self.seq if self.stream is None else self.stream

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

    def _pick(self, logits: np.ndarray, position: int,
              history: Sequence[int] | None, constraint: Grammar | None = None) -> int:
        """The sampler's pick at ``position``; its logits are kept while it asks for
        log-probabilities (the last pick at a position is the emitted token's)."""
        sampler = self.sampler
        if constraint is None:  # the one-keyword-less call a Sampler subclass may define
            tok = sampler.pick(logits, stream=self.sample_stream, position=position,
                               history=history)
        else:
            tok = sampler.pick(logits, stream=self.sample_stream, position=position,
                               history=history, constraint=constraint)
        if sampler.logprobs is not None:  # post-sampling: the distribution drawn from
            self._picked[position] = sampler.post_logprobs(
                logits, tok, history, constraint) if sampler.post_sampling_probs else logits
        return tok

    def _emit(self, toks: Sequence[int]) -> Emitted:
        n, start = self.sampler.logprobs, len(self.tokens)
        probs = None
        if n is not None:  # every emitted position was picked in this step
            missing = [start + i for i in range(len(toks)) if start + i not in self._picked]
            if missing:
                raise RuntimeInputError(f"no pick was made at positions {missing}")
            probs = [token_logprob(self._picked[start + i], t, n) for i, t in enumerate(toks)]
            self._picked.clear()  # the rest were rejected: picked again before emitted
        self.tokens.extend(int(t) for t in toks)
        self.metrics.n_generated += len(toks)
        if self.metrics.t_first is None:
            self.metrics.t_first = time.perf_counter()
        self.emitted = Emitted((int(t) for t in toks), probs)
        return self.emitted

    # -- lifecycle ----------------------------------------------------------------------
    def prefill(self, prompt: Sequence[int]) -> int:
        """Decode the prompt (chunked), checkpoint it, emit the first token (TTFT)."""
        e = self.engine
        tokens = self.prefill_begin(prompt)
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
        return self.prefill_end(logits, np.concatenate(rows) if rows else None,
                                len(tokens) - a)

    def prefill_begin(self, prompt: Sequence[int]) -> list[int]:
        """Start the prefill's clock and state; the prompt's tokens, for the caller to
        decode (`prefill`, or a batch of several sessions' prompts)."""
        m = self.metrics
        m.t_start = time.perf_counter()
        self.session = self.session.prefill_start()
        tokens = [int(t) for t in prompt]
        m.n_prompt = len(tokens)
        self.tokens = tokens  # committed so far: the prompt (nothing emitted yet)
        return tokens

    def prefill_end(self, logits: np.ndarray, all_rows: np.ndarray | None,
                    last_decode_len: int) -> int:
        """After the prompt was decoded (its last logits, every row): checkpoint, feed the
        drafter, emit the first token."""
        e, m = self.engine, self.metrics
        tokens = self.tokens
        if self.margins is not None:
            self.margins[len(tokens)] = top2_margin(logits)
        self.n_cached, self.last_decode_len = len(tokens), last_decode_len
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
        first = self._pick(logits, len(tokens),
                           tokens if self.sampler.penalized else None,
                           None if self.grammar is None else self.grammar.committed)
        self._emit([first])
        if self.grammar is not None:
            self.grammar.commit([first])
        self.session = self.session.decode(1)
        return first

    def propose(self, k: int | None = None) -> DraftProposal | None:
        """Draft up to k tokens after the last one; None when none fit (a plain step)."""
        e = self.engine
        k = self.draft_room(k)
        if k == 0:
            return None
        self.session = self.session.draft()
        t0 = time.perf_counter()
        with e.phase(StepKind.DRAFT, k):
            drafts = e.drafter.propose(self.seq, self.last, self.base, k)
        self.metrics.t_draft += time.perf_counter() - t0
        return self.proposal(drafts, k)

    def draft_room(self, k: int | None = None) -> int:
        """The draft length a step may use: k (default the engine's) within the context."""
        e = self.engine
        k = e.k if k is None else k
        room = max(0, min(k, e.target.n_ctx - 1 - self.base))
        # a length within the engine's checked one (cut to the context, or to the tokens
        # left) is in bounds: carried as checked, not checked again at every step
        if isinstance(room, int) and (isinstance(k, DraftLength) or room <= e.k):
            return DraftLength(room)
        return room

    def proposal(self, drafts: Sequence[int], k: int) -> DraftProposal | None:
        """The contract message of ``drafts`` (drafted by the caller after draft()). Under
        a grammar the drafts end before the first one it forbids (no verify row for it);
        none left: the drafts are abandoned and the step is a plain one (None)."""
        if len(drafts) != k and not (self.engine.drafter.may_stop_early and len(drafts) < k):
            raise RuntimeInputError(f"drafter {self.engine.drafter.name} returned "
                                    f"{len(drafts)} of {k}")
        if self.grammar is not None:
            drafts = self.grammar.cut(drafts)
        if not drafts:  # the drafter's chain is gone already: nothing to remove
            self.session = self.session.rollback("tail")
            return None
        n = k if len(drafts) == k else len(drafts)  # k is checked already (DraftLength)
        return DraftProposal(self.id, self.session.epoch, self.base, tuple(drafts), 0,
                             DraftSpec(n).recipe)

    def verify(self, proposal: DraftProposal | None) -> VerifyResult | None:
        """Decode [last, drafts...] in one target batch; accept while the target agrees.

        Refuses a proposal from another session or a stale epoch. Returns None for a
        plain step (no proposal); the picks and rows wait in the session for commit().
        """
        e = self.engine
        window = self.verify_window(proposal)
        k = len(window) - 1
        t0 = time.perf_counter()
        with e.phase(StepKind.VERIFY if k else StepKind.DECODE, k + 1):
            e.target.decode(window, range(self.base, self.base + k + 1), seq_id=self.seq,
                            logits=e.head is None)
            rows = e.rows(e.target, k + 1) if e.needs_rows else None
            # one copy of the k+1 rows: upstream's logits, or the head run on the rows here
            lg_all = e.target.logits_all(k + 1) if e.head is None else e.head(rows)
            result = self.verified(proposal, lg_all, rows)
        self.metrics.t_verify += time.perf_counter() - t0
        return result

    def verify_window(self, proposal: DraftProposal | None) -> list[int]:
        """Check ``proposal`` and checkpoint if its rollback may pass n_rs_seq; the tokens
        the target decodes at base.. for it: [last, *drafts]."""
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
        return [self.last, *drafts]

    def verified(self, proposal: DraftProposal | None, lg_all: np.ndarray,
                 rows: np.ndarray | None) -> VerifyResult | None:
        """The picks and acceptance of a decoded window (its k+1 logits and rows)."""
        e = self.engine
        drafts = list(proposal.drafts) if proposal else []
        k, base = len(drafts), self.base
        self._rows = rows
        picks = []
        # a penalized pick's history: the committed tokens, then the drafts before it
        # (its history exactly when this pick is the one emitted there)
        hist = self.tokens + drafts if self.sampler.penalized else None
        # the grammar state of each pick: the committed one, then after each draft
        states = None if self.grammar is None else self.grammar.window(drafts)
        # synthetic acceptance (upstream's --spec-synth-rates), or the warm-up's forced one
        decide = e.forced_accept or getattr(e.drafter, "accept_len", None)
        for i in range(k + 1):
            lg = lg_all[i]
            picks.append(self._pick(lg, base + 1 + i,
                                    None if hist is None else hist[:base + 1 + i],
                                    None if states is None else states[i]))
            if self.margins is not None:
                self.margins[base + 1 + i] = top2_margin(lg)
            # under a grammar a pick may cost a vocabulary-wide check: none is made past
            # the first rejected draft (those picks are never emitted)
            if states is not None and decide is None and i < k and picks[i] != drafts[i]:
                break
        self.n_cached, self.last_decode_len = base + k + 1, k + 1
        self._picks, self._drafts = picks, drafts
        if proposal is None:
            return None
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

    def commit(self, result: VerifyResult | None, *, defer_feed: bool = False) -> Emitted:
        """Apply a verify outcome: roll back rejected drafts, feed the drafter, emit (the
        tokens, with their log-probabilities when the sampler asks: `Emitted`).

        Refuses, before anything changes, a result of another session, epoch or base, or
        one with no verify of this session pending (e.g. the same result twice).
        ``defer_feed``: leave the drafter's feed in ``pending_feed`` (seq, base, tokens,
        rows) for the caller, who feeds several sessions in one drafter decode."""
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
        # replay after a checkpoint restore reads the accepted tokens
        out = self._emit(emitted)
        if self.grammar is not None:  # advanced by the accepted tokens only
            self.grammar.commit(emitted)
        keep = base + n_acc + 1
        if self.n_cached > keep:  # rejected drafts are cached: a rollback step (timed)
            t0 = time.perf_counter()
            with e.phase(StepKind.ROLLBACK, 0):
                m.rollbacks[self._rollback_target(keep)] += 1
            m.t_rollback += time.perf_counter() - t0
        if rows is not None:
            rows = rows[: n_acc + 1]
            self._keep_rows(base, rows)
        feed = (self.seq, base, [last, *emitted[:n_acc]], rows)
        if defer_feed:
            self.pending_feed = feed
        else:
            t0 = time.perf_counter()
            with e.feed_phase(n_acc + 1):
                e.drafter.commit(*feed)
            m.t_feed += time.perf_counter() - t0
        self.session = self.session.accept(n_acc, k) if k else self.session.decode(1)
        if self.trace is not None:
            self.trace.append({"pos": base, "drafts": list(self._drafts), "accepted": n_acc})
        return out

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

    def step(self, k: int | None = None) -> Emitted:
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
        if self.grammar is not None:
            self.grammar.reset(self.tokens[self.metrics.n_prompt:])
        self.session = self.session.truncate(keep)
        last_row = self.rows.get(keep - 2)
        if e.drafter.needs_rows and e.drafter.target_rows is None and keep >= 2 \
                and last_row is None:
            raise RuntimeInputError(f"no target row kept for position {keep - 2}")
        e.drafter.truncate(self.seq, keep, last_row)


class Engine:
    """A target context, a drafter and the sessions sharing them (one seq id each)."""

    def __init__(self, target: Context, drafter: Drafter, *, k: int,
                 sampler: Sampler | None = None, rows: RowFn = api_rows,
                 trace: bool = False, phase: PhaseFn = no_phase,
                 head: HeadFn | None = None, checkpoints: str = "state") -> None:
        try:  # checked once per run: a k from EngineOptions is a DraftLength already
            k = checked_draft(k)
        except ContractError as e:
            raise RuntimeInputError(str(e)) from None
        if k + 1 > target.n_batch:
            raise RuntimeInputError(f"k+1={k + 1} exceeds the target's n_batch {target.n_batch}")
        own_rows = drafter.target_rows if drafter.needs_rows else None
        if own_rows is not None and head is not None:
            raise RuntimeInputError(f"drafter {drafter.name} reads the target's own rows: "
                                    "a client-side head (h_nextn rows) cannot run beside it")
        if ((drafter.needs_rows and own_rows is None) or head is not None) \
                and target.cfg.nextn_rows != "all":
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
        self.rows = own_rows or rows  # a drafter's own rows (DSpark) replace h_nextn
        self.row_horizon = max(k, target.n_rs_seq) + 4
        self.trace = trace
        self.phase = phase
        self.hidden_rows = "off" if not drafter.needs_rows else \
            "api" if own_rows is None else "layer_inp"
        self.sessions: dict[int, SpecSession] = {}
        #: sessions opened so far per seq id: a reused seq id gets a new session id
        self._opened: Counter = Counter()
        #: decode no lone token as one (`BatchRun` sets it): upstream's CPU kernels give a
        #: one-token decode other floats than a decode of two or more, while a token's
        #: floats in any decode of two or more are the same whatever its neighbours; a lone
        #: one-token step then decodes with a copy of its token one position on, removed at
        #: once by tail removal (needs n_rs_seq >= 1), so a slot steps alone as beside others
        self.pad_single = False
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
             session_id: str | None = None, sampler: Sampler | None = None,
             stream: int | None = None, prefill: bool = True) -> SpecSession:
        """A session on ``seq_id`` (default: the first free one), prefilled with
        ``prompt``; ``sampler``/``stream``: its own sampler and random stream id (default:
        the engine's sampler, the seq id). ``prefill=False``: the caller prefills it
        (`mtplib.runtime.batch.batch_prefill`, several prompts in one batch)."""
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
        s.own_sampler, s.stream = sampler, stream
        s.grammar = open_session_grammar(s.sampler.grammar, self.target)
        self.sessions[seq_id] = s
        if prefill:
            s.prefill(prompt)
        return s

    def close(self, s: SpecSession) -> None:
        """Free the session's sequence in every context; its caches are dropped."""
        self.target.seq_rm(s.seq, 0, -1)
        self.drafter.truncate(s.seq, 1, None)
        s.session = s.session.close()
        if s.grammar is not None:
            s.grammar.close()
        del self.sessions[s.seq]
