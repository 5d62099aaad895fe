"""Unit tests for mtplib.contract.types: each validation rule has a test that can fail."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mtplib.contract import (
    CONTRACT_VERSION,
    SHARD_LOCAL,
    TINY_DIMS,
    V4_FLASH_DIMS,
    CacheKind,
    ContractError,
    DraftProposal,
    DType,
    HiddenRows,
    ModelDims,
    MTPInput,
    RollbackPlan,
    TokenIds,
    VerifyResult,
    plan_rollback,
    recipe_draft_k,
    verify_greedy,
)

DIMS = TINY_DIMS
W = DIMS.hidden_width


def _pos(positions):
    """Ranges become tuples; anything else is passed through so bad shapes stay bad."""
    return tuple(positions) if isinstance(positions, range) else positions


def rows(positions=(4, 5), dtype=DType.F32, **kw) -> HiddenRows:
    base = dict(
        session_id="s",
        epoch=0,
        positions=_pos(positions),
        width=W,
        dtype=dtype,
        nbytes=len(positions) * W * dtype.itemsize,
    )
    base.update(kw)
    return HiddenRows(**base)


def toks(positions=(5, 6), tokens=(1, 2), **kw) -> TokenIds:
    base = dict(session_id="s", epoch=0, positions=_pos(positions), tokens=tuple(tokens))
    base.update(kw)
    return TokenIds(**base)


def prop(drafts=(7, 8), recipe="mtp.v4.draft2", **kw) -> DraftProposal:
    base = dict(
        session_id="s", epoch=0, base_position=9, drafts=tuple(drafts), head_index=0, recipe=recipe
    )
    base.update(kw)
    return DraftProposal(**base)


def test_constants():
    assert CONTRACT_VERSION == "mtp-contract/3"
    assert V4_FLASH_DIMS.hidden_width == 16384
    assert TINY_DIMS.hidden_width == 256
    assert [d.itemsize for d in (DType.F32, DType.F16, DType.BF16)] == [4, 2, 2]


@pytest.mark.parametrize(
    "kw, field",
    [
        (dict(n_embd=0, n_vocab=10), "n_embd"),
        (dict(n_embd=8, n_vocab=0), "n_vocab"),
        (dict(n_embd=8, n_vocab=10, hc=2), "hc"),
        (dict(n_embd=True, n_vocab=10), "n_embd"),
        (dict(n_embd=8.0, n_vocab=10), "n_embd"),
    ],
)
def test_model_dims_refuses(kw, field):
    with pytest.raises(ContractError, match=f"^{field}:"):
        ModelDims(**kw)


def test_hidden_rows_ok_with_payload():
    rows(payload=bytes(2 * W * 4)).validate(DIMS)
    rows(dtype=DType.BF16).validate(DIMS)


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(session_id=""), "session_id"),
        (dict(epoch=-1), "epoch"),
        (dict(positions=()), "positions"),
        (dict(positions=(4, 6)), r"positions\[1\]"),
        (dict(positions=(5, 4)), r"positions\[1\]"),
        (dict(positions=(-1, 0)), r"positions\[0\]"),
        (dict(positions=[4, 5]), "positions"),
        (dict(width=W + 1, nbytes=2 * (W + 1) * 4), "width"),
        (dict(dtype=DType.I32), "dtype"),
        (dict(nbytes=2 * W * 2), "nbytes"),
        (dict(payload=bytes(5)), "payload"),
    ],
)
def test_hidden_rows_refuses(kw, match):
    with pytest.raises(ContractError, match=f"^{match}"):
        rows(**kw).validate(DIMS)


def test_token_ids_rules():
    toks().validate(DIMS)
    with pytest.raises(ContractError, match=r"^tokens\[1\]: expected token id < n_vocab=256"):
        toks(tokens=(1, 256)).validate(DIMS)
    with pytest.raises(ContractError, match=r"^tokens\[0\]"):
        toks(tokens=(-1, 2)).validate(DIMS)
    with pytest.raises(ContractError, match="^tokens:"):
        toks(tokens=(1,)).validate(DIMS)


def test_mtp_input_position_rule():
    MTPInput(rows(), toks()).validate(DIMS)
    with pytest.raises(ContractError, match=r"hidden.positions\[0\]: expected tokens"):
        MTPInput(rows(positions=(5, 6)), toks()).validate(DIMS)
    with pytest.raises(ContractError, match="hidden.positions: expected 2 rows"):
        MTPInput(rows(positions=(4,)), toks()).validate(DIMS)
    with pytest.raises(ContractError, match="hidden.epoch"):
        MTPInput(rows(epoch=1), toks()).validate(DIMS)
    with pytest.raises(ContractError, match="hidden.session_id"):
        MTPInput(rows(session_id="t"), toks()).validate(DIMS)


@given(p=st.integers(0, 1000), n=st.integers(1, 8))
@settings(max_examples=200, deadline=None)
def test_mtp_input_position_rule_property(p, n):
    tokens = toks(positions=range(p + 1, p + 1 + n), tokens=(0,) * n)
    MTPInput(rows(positions=range(p, p + n)), tokens).validate(DIMS)
    with pytest.raises(ContractError):
        MTPInput(rows(positions=range(p + 1, p + 1 + n)), tokens).validate(DIMS)


@pytest.mark.parametrize(
    "recipe, k",
    [("mtp.off", 0), ("mtp.v4.draft1", 1), ("mtp.v4.draft3", 3), ("mtp.v4.draft8", 8)],
)
def test_recipe_parse(recipe, k):
    assert recipe_draft_k(recipe) == k


@pytest.mark.parametrize(
    "recipe",
    [
        "mtp.v4.draft0",
        "mtp.v4.draft9",
        "mtp.v4.draft02",
        "mtp.v4.draft",
        "eagle",
        "MTP.V4.DRAFT1",
        "mtp.v4.draft1 ",
        "mtp.v4.draft\u0661",
        None,
    ],
)
def test_recipe_unknown(recipe):
    with pytest.raises(ContractError, match="^recipe:"):
        recipe_draft_k(recipe)


def test_draft_proposal_rules():
    prop().validate(DIMS)
    with pytest.raises(ContractError, match="^drafts: expected 3 tokens for mtp.v4.draft3"):
        prop(recipe="mtp.v4.draft3").validate()
    with pytest.raises(ContractError, match="^recipe: expected an MTP recipe"):
        prop(recipe="mtp.off").validate()
    with pytest.raises(ContractError, match="^head_index"):
        prop(head_index=1).validate()
    with pytest.raises(ContractError, match="^drafts:"):
        prop(drafts=(), recipe="mtp.v4.draft1").validate()
    with pytest.raises(ContractError, match=r"^drafts\[1\]"):
        prop(drafts=(1, 999)).validate(DIMS)
    with pytest.raises(ContractError, match="^base_position"):
        prop(base_position=-1).validate()


def test_verify_greedy_cases():
    p = prop(drafts=(5, 6, 7), recipe="mtp.v4.draft3")
    full = verify_greedy(p, [5, 6, 7, 8])
    assert (full.n_accepted, full.correction_token, full.emitted) == (3, 8, (5, 6, 7, 8))
    assert full.next_position == 9 + 3 + 1
    part = verify_greedy(p, [5, 1, 7, 8])
    assert (part.n_accepted, part.emitted, part.rejected) == (1, (5, 1), 2)
    none = verify_greedy(p, [2, 6, 7, 8])
    assert (none.n_accepted, none.emitted, none.next_position) == (0, (2,), 10)
    with pytest.raises(ContractError, match="^target_argmax: expected 4 tokens"):
        verify_greedy(p, [5, 6, 7])


@given(
    drafts=st.lists(st.integers(0, 3), min_size=1, max_size=8),
    target=st.lists(st.integers(0, 3), min_size=9, max_size=9),
)
@settings(max_examples=200, deadline=None)
def test_verify_greedy_property(drafts, target):
    k = len(drafts)
    p = prop(drafts=drafts, recipe=f"mtp.v4.draft{k}")
    r = verify_greedy(p, target[: k + 1])
    r.validate(DIMS, proposal=p)
    n = r.n_accepted
    assert list(drafts[:n]) == target[:n]
    assert n == k or drafts[n] != target[n]
    assert r.emitted[-1] == target[n]


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(n_accepted=3), "^n_accepted: expected <= n_drafted=2"),
        (dict(emitted=(5, 6)), "^emitted: expected tuple of n_accepted"),
        (dict(emitted=(9,)), r"^emitted\[-1\]: expected correction_token=6"),
        (dict(n_drafted=0), "^n_drafted"),
        (dict(correction_token=-1, emitted=(-1,)), "^correction_token"),
    ],
)
def test_verify_result_refuses(kw, match):
    base = dict(
        session_id="s",
        epoch=0,
        base_position=9,
        n_drafted=2,
        n_accepted=0,
        correction_token=6,
        emitted=(6,),
    )
    base.update(kw)
    with pytest.raises(ContractError, match=match):
        VerifyResult(**base).validate(DIMS)


def test_verify_result_against_proposal():
    p = prop()
    r = VerifyResult("s", 0, 9, 2, 1, 3, (8, 3))
    with pytest.raises(ContractError, match="^emitted: expected accepted prefix"):
        r.validate(proposal=p)
    with pytest.raises(ContractError, match="^epoch: expected proposal.epoch"):
        VerifyResult("s", 1, 9, 2, 1, 3, (7, 3)).validate(proposal=p)


@pytest.mark.parametrize(
    "args, plan",
    [
        ((10, 10, 4, 3), RollbackPlan("none", 0, 10, None)),
        ((10, 8, 4, 3), RollbackPlan("tail", 2, 8, None)),
        ((10, 7, 4, 3), RollbackPlan("tail", 3, 7, None)),
        ((10, 6, 4, 3), RollbackPlan("checkpoint_replay", 4, 6, 0)),  # beyond last decode
        ((10, 8, 1, 3), RollbackPlan("checkpoint_replay", 2, 8, 7)),  # beyond n_rs_seq
        ((10, 9, 0, 3), RollbackPlan("checkpoint_replay", 1, 9, 7)),
        ((10, 9, 4, 0), RollbackPlan("checkpoint_replay", 1, 9, 0)),
    ],
)
def test_plan_rollback(args, plan):
    assert plan_rollback(*args) == plan


def test_plan_rollback_refuses():
    with pytest.raises(ContractError, match="^keep_until: expected <= n_cached=5"):
        plan_rollback(5, 6, 4, 1)
    with pytest.raises(ContractError, match="^keep_until: expected int >= 0"):
        plan_rollback(5, -1, 4, 1)
    with pytest.raises(ContractError, match="^checkpoint_at"):
        plan_rollback(10, 5, 1, 1, checkpoint_at=6)
    assert plan_rollback(10, 5, 1, 1, checkpoint_at=4).replay_from == 4


@given(n=st.integers(0, 50), keep=st.integers(0, 50), rs=st.integers(0, 8), last=st.integers(0, 50))
@settings(max_examples=200, deadline=None)
def test_plan_rollback_property(n, keep, rs, last):
    if keep > n or last > n:
        with pytest.raises(ContractError):
            plan_rollback(n, keep, rs, last)
        return
    p = plan_rollback(n, keep, rs, last)
    d = n - keep
    assert p.drop == d and p.keep_until == keep
    assert p.kind == (
        "none" if d == 0 else "tail" if d <= rs and d <= last else "checkpoint_replay"
    )
    assert (p.replay_from is None) == (p.kind != "checkpoint_replay")
    if p.replay_from is not None:
        assert 0 <= p.replay_from <= keep


def test_cache_kinds_all_shard_local():
    assert SHARD_LOCAL == frozenset(CacheKind)
    assert {k.value for k in CacheKind} == {
        "raw_swa_k",
        "csa_compressed_k",
        "hca_compressed_k",
        "indexer_k",
        "compressor_state",
        "mtp_swa_k",
        "dspark_swa_k",
    }
    assert "never serialized across a seam" in " ".join(CacheKind.__doc__.split())
