"""Session state machine: table-driven transitions, epochs and message freshness."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mtplib.contract import (
    TRANSITIONS,
    ClosedSessionError,
    ContractError,
    Event,
    ForeignSessionError,
    IllegalTransition,
    Session,
    StaleEpochError,
    State,
)


def decoding(position: int = 10) -> Session:
    return Session("s").prefill_start().prefill_done(position)


def test_happy_path_and_positions():
    s = decoding(10)
    assert (s.state, s.epoch, s.position) == (State.DECODING, 0, 10)
    s = s.decode()
    assert s.position == 11
    s = s.draft().verify().accept(3, 3)
    assert (s.state, s.epoch, s.position) == (State.DECODING, 0, 15)
    s = s.draft().verify().accept(1, 3)  # rejecting drafts is a rollback
    assert (s.state, s.epoch, s.position) == (State.DECODING, 1, 17)
    s = s.draft().rollback("tail")
    assert (s.state, s.epoch, s.position) == (State.DECODING, 2, 17)
    s = s.truncate(12)
    assert (s.epoch, s.position) == (3, 12)
    s = s.prefill_start().prefill_done(5)
    assert (s.state, s.position) == (State.DECODING, 17)
    assert s.close().state is State.CLOSED


def test_sessions_are_immutable():
    s = decoding()
    s.decode()
    assert s.position == 10


@pytest.mark.parametrize(
    "call",
    [
        lambda s: s.draft(),
        lambda s: s.accept(0, 1),
        lambda s: s.verify(),
        lambda s: s.truncate(0),
        lambda s: s.prefill_done(1),
    ],
)
def test_illegal_transitions_from_new(call):
    with pytest.raises(IllegalTransition, match="illegal transition: event '.*' in state 'new'"):
        call(Session("s"))


@pytest.mark.parametrize("end", [lambda s: s.close(), lambda s: s.fail("oom")])
def test_terminal_states(end):
    s = end(decoding())
    for event, args in [(Event.CLOSE, ()), (Event.FAIL, ("x",)), (Event.PREFILL_START, ())]:
        with pytest.raises(IllegalTransition):
            s.apply(event, *args)
    assert all(st_ not in (State.FAILED, State.CLOSED) for st_, _ in TRANSITIONS)


def test_fail_records_reason():
    assert decoding().draft().fail("seam timeout").failure == "seam timeout"
    with pytest.raises(ContractError, match="^reason"):
        decoding().fail("")


def test_argument_rules():
    s = decoding(10)
    with pytest.raises(ContractError, match="^n_accepted: expected <= n_drafted=2"):
        s.draft().verify().accept(3, 2)
    with pytest.raises(ContractError, match="^n_drafted"):
        s.draft().verify().accept(0, 0)
    with pytest.raises(ContractError, match="^to_position: expected <= position=10"):
        s.truncate(11)
    with pytest.raises(ContractError, match="^kind"):
        s.draft().rollback("none")
    with pytest.raises(ContractError, match="^n_tokens"):
        Session("s").prefill_start().prefill_done(0)
    with pytest.raises(ContractError, match="^session_id"):
        Session("")


def test_check_message():
    s = decoding().truncate(5).truncate(5)
    assert s.epoch == 2
    s.check_message("s", 2)
    with pytest.raises(StaleEpochError, match=r"^epoch: expected 2, got 1 \(stale\)"):
        s.check_message("s", 1)
    with pytest.raises(StaleEpochError, match=r"\(future\)"):
        s.check_message("s", 3)
    with pytest.raises(ForeignSessionError, match="^session_id: expected 's', got 't'"):
        s.check_message("t", 2)
    with pytest.raises(ClosedSessionError):
        s.close().check_message("s", 2)
    assert issubclass(StaleEpochError, ContractError)
    assert issubclass(ForeignSessionError, ContractError)
    assert issubclass(IllegalTransition, ContractError)


EVENTS = st.one_of(
    st.tuples(st.just(Event.PREFILL_START)),
    st.tuples(st.just(Event.PREFILL_DONE), st.integers(-1, 20)),
    st.tuples(st.just(Event.DECODE), st.integers(-1, 3)),
    st.tuples(st.just(Event.DRAFT)),
    st.tuples(st.just(Event.VERIFY)),
    st.tuples(st.just(Event.ACCEPT), st.integers(-1, 4), st.integers(0, 4)),
    st.tuples(st.just(Event.ROLLBACK), st.sampled_from(["tail", "checkpoint_replay", "none"])),
    st.tuples(st.just(Event.TRUNCATE), st.integers(-1, 40)),
    st.tuples(st.just(Event.FAIL), st.sampled_from(["", "boom"])),
    st.tuples(st.just(Event.CLOSE)),
)


@given(events=st.lists(EVENTS, max_size=40), lag=st.integers(1, 5))
@settings(max_examples=200, deadline=None)
def test_random_event_sequences(events, lag):
    s = Session("s")
    for event, *args in events:
        before = s
        try:
            s = s.apply(event, *args)
        except IllegalTransition:
            assert (before.state, event) not in TRANSITIONS
            continue
        except ContractError:
            continue
        assert s.state is TRANSITIONS[(before.state, event)]
        assert s.state in State
        assert s.epoch in (before.epoch, before.epoch + 1)
        assert s.position >= 0
        if event in (Event.ROLLBACK, Event.TRUNCATE):
            assert s.epoch == before.epoch + 1
        if event is Event.ACCEPT:
            n_acc, n_dr = args
            assert s.epoch == before.epoch + (n_acc < n_dr)
            assert s.position == before.position + n_acc + 1
        if s.epoch > 0:
            with pytest.raises((StaleEpochError, ClosedSessionError)):
                s.check_message("s", max(0, s.epoch - lag))
        if not s.terminal:
            s.check_message("s", s.epoch)
