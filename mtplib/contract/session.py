"""Session and epoch lifecycle as an explicit, table-driven state machine.

Why: speculative decoding rewinds caches, so work computed before a rollback must never be
applied after it. Every rollback or truncation advances the epoch by exactly one, and every
message carries (session_id, epoch), so a shard can refuse stale work without guessing.
Sessions are immutable: each event returns a new Session, so no one holds a half-updated one.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, replace
from types import MappingProxyType

from mtplib.contract.types import ContractError, check_int, check_str, fail


class State(enum.Enum):
    NEW = "new"
    PREFILLING = "prefilling"
    DECODING = "decoding"
    DRAFTING = "drafting"
    VERIFYING = "verifying"
    FAILED = "failed"
    CLOSED = "closed"


class Event(enum.Enum):
    """Event values double as the Session method names (see Session.apply)."""

    PREFILL_START = "prefill_start"
    PREFILL_DONE = "prefill_done"
    DECODE = "decode"
    DRAFT = "draft"
    VERIFY = "verify"
    ACCEPT = "accept"
    ROLLBACK = "rollback"
    TRUNCATE = "truncate"
    FAIL = "fail"
    CLOSE = "close"


S, E = State, Event
_LIVE = (S.NEW, S.PREFILLING, S.DECODING, S.DRAFTING, S.VERIFYING)

TRANSITIONS: Mapping[tuple[State, Event], State] = MappingProxyType(
    {
        (S.NEW, E.PREFILL_START): S.PREFILLING,
        (S.DECODING, E.PREFILL_START): S.PREFILLING,  # a later prompt chunk (next turn)
        (S.PREFILLING, E.PREFILL_DONE): S.DECODING,
        (S.DECODING, E.DECODE): S.DECODING,  # plain decode, e.g. under mtp.off
        (S.DECODING, E.DRAFT): S.DRAFTING,
        (S.DRAFTING, E.VERIFY): S.VERIFYING,
        (S.VERIFYING, E.ACCEPT): S.DECODING,
        (S.DRAFTING, E.ROLLBACK): S.DECODING,  # abandon drafts before verify
        (S.VERIFYING, E.ROLLBACK): S.DECODING,  # abandon a verify batch
        (S.DECODING, E.TRUNCATE): S.DECODING,
        **{(s, E.FAIL): S.FAILED for s in _LIVE},
        **{(s, E.CLOSE): S.CLOSED for s in _LIVE},
    }
)
"""The whole lifecycle as data: (state, event) -> next state; anything absent is illegal."""

TERMINAL: frozenset[State] = frozenset({S.FAILED, S.CLOSED})
SESSION_ROLLBACK_KINDS = ("tail", "checkpoint_replay")


class IllegalTransition(ContractError):
    def __init__(self, state: State, event: Event) -> None:
        super().__init__(f"illegal transition: event {event.value!r} in state {state.value!r}")
        self.state = state
        self.event = event


class ForeignSessionError(ContractError):
    """A message addressed to another session."""


class StaleEpochError(ContractError):
    """A message from an older (stale) or newer (future) epoch than the session's."""


class ClosedSessionError(ContractError):
    """A message for a session that is FAILED or CLOSED."""


@dataclass(frozen=True)
class Session:
    session_id: str
    state: State = State.NEW
    epoch: int = 0
    position: int = 0
    """Number of committed tokens (the next token goes at this position)."""
    failure: str | None = None

    def __post_init__(self) -> None:
        check_str("session_id", self.session_id)
        if not isinstance(self.state, State):
            raise fail("state", "a State", self.state)
        check_int("epoch", self.epoch, minimum=0)
        check_int("position", self.position, minimum=0)

    @property
    def terminal(self) -> bool:
        return self.state in TERMINAL

    def _step(self, event: Event, *, bump: bool = False, **changes: object) -> Session:
        nxt = TRANSITIONS.get((self.state, event))
        if nxt is None:
            raise IllegalTransition(self.state, event)
        return replace(self, state=nxt, epoch=self.epoch + int(bump), **changes)  # type: ignore[arg-type]

    def _legal(self, event: Event) -> None:
        # Legality is checked before arguments so a wrong-state call names the state.
        if (self.state, event) not in TRANSITIONS:
            raise IllegalTransition(self.state, event)

    def apply(self, event: Event, *args: object) -> Session:
        """Dispatch an Event to the method of the same name (for tables and fuzzing)."""
        return getattr(self, event.value)(*args)

    def prefill_start(self) -> Session:
        return self._step(E.PREFILL_START)

    def prefill_done(self, n_tokens: int) -> Session:
        self._legal(E.PREFILL_DONE)
        check_int("n_tokens", n_tokens, minimum=1)
        return self._step(E.PREFILL_DONE, position=self.position + n_tokens)

    def decode(self, n_tokens: int = 1) -> Session:
        self._legal(E.DECODE)
        check_int("n_tokens", n_tokens, minimum=1)
        return self._step(E.DECODE, position=self.position + n_tokens)

    def draft(self) -> Session:
        return self._step(E.DRAFT)

    def verify(self) -> Session:
        return self._step(E.VERIFY)

    def accept(self, n_accepted: int, n_drafted: int) -> Session:
        """Commit accepted drafts plus the correction; rejecting any draft is a rollback."""
        self._legal(E.ACCEPT)
        check_int("n_drafted", n_drafted, minimum=1)
        check_int("n_accepted", n_accepted, minimum=0)
        if n_accepted > n_drafted:
            raise fail("n_accepted", f"<= n_drafted={n_drafted}", n_accepted)
        return self._step(
            E.ACCEPT, bump=n_accepted < n_drafted, position=self.position + n_accepted + 1
        )

    def rollback(self, kind: str) -> Session:
        self._legal(E.ROLLBACK)
        if kind not in SESSION_ROLLBACK_KINDS:
            raise fail("kind", " or ".join(SESSION_ROLLBACK_KINDS), kind)
        return self._step(E.ROLLBACK, bump=True)

    def truncate(self, to_position: int) -> Session:
        self._legal(E.TRUNCATE)
        check_int("to_position", to_position, minimum=0)
        if to_position > self.position:
            raise fail("to_position", f"<= position={self.position}", to_position)
        return self._step(E.TRUNCATE, bump=True, position=to_position)

    def fail(self, reason: str) -> Session:
        self._legal(E.FAIL)
        check_str("reason", reason)
        return self._step(E.FAIL, failure=reason)

    def close(self) -> Session:
        return self._step(E.CLOSE)

    def check_message(self, session_id: str, epoch: int) -> None:
        """Refuse a message from another session, a finished session, or another epoch."""
        if session_id != self.session_id:
            raise ForeignSessionError(
                f"session_id: expected {self.session_id!r}, got {session_id!r}"
            )
        if self.terminal:
            raise ClosedSessionError(f"state: expected a live session, got {self.state.value!r}")
        check_int("epoch", epoch, minimum=0)
        if epoch != self.epoch:
            age = "stale" if epoch < self.epoch else "future"
            raise StaleEpochError(f"epoch: expected {self.epoch}, got {epoch} ({age})")
