"""The DSpark part of the contract's golden fixtures (`dspark_values.json`): its typed values
accepted and refused, the step plans of both contexts, and what crosses per placement.

Why a fixture: a change to any DSpark rule (a position, a byte count, a refusal) shows up
as a diff of the committed file, as the MTP rules do (`mtplib.contract.golden`).
"""

from __future__ import annotations

from collections.abc import Callable

from mtplib.contract.dspark import (
    DSPARK_OPTIONS,
    DSPARK_SHARD_LOCAL,
    FEATURE_DTYPE,
    DSparkBlock,
    DSparkConfidences,
    DSparkFeatures,
    DSparkProposal,
    dspark_crossings,
    dspark_step_bytes,
    plan_dspark_step,
    plan_dspark_truncate,
)
from mtplib.contract.labels import PLACEMENTS, Placement
from mtplib.contract.seam import FORBIDDEN_KINDS, seam_bytes_per_token
from mtplib.contract.session import Session, State
from mtplib.contract.types import (
    TINY_DIMS,
    V4_FLASH_DIMS,
    ContractError,
    DraftProposal,
    DType,
    ModelDims,
    RollbackPlan,
    VerifyResult,
)

Doc = dict[str, object]
LAYERS = (2, 3, 4)  # the tiny fixture's draft: the outputs of trunk layers 1-3 (4 layers)
SESSION = ("s1", 3)


def _features(dims: ModelDims = TINY_DIMS, **kw: object) -> DSparkFeatures:
    base: dict[str, object] = dict(session_id="s1", epoch=3, positions=(10, 11, 12),
                                   target_layers=LAYERS, n_embd=dims.n_embd,
                                   dtype=FEATURE_DTYPE, nbytes=3 * dims.feature_width * 4)
    base.update(kw)
    return DSparkFeatures(**base)  # type: ignore[arg-type]


def _block(**kw: object) -> DSparkBlock:
    base: dict[str, object] = dict(session_id="s1", epoch=3, base_position=12, anchor=7,
                                   mask_token=255, k=5)
    base.update(kw)
    return DSparkBlock(**base)  # type: ignore[arg-type]


def _conf(values: tuple[float, ...] = (0.9, 0.8, 0.4, 0.7, 0.2), **kw: object
          ) -> DSparkConfidences:
    base: dict[str, object] = dict(session_id="s1", epoch=3, base_position=12, values=values)
    base.update(kw)
    return DSparkConfidences(**base)  # type: ignore[arg-type]


def _proposal(drafts: tuple[int, ...], recipe: str) -> DraftProposal:
    return DraftProposal("s1", 3, 12, drafts, 0, recipe)


def value_cases() -> list[tuple[str, Callable[[], None]]]:
    """Named checks of the typed DSpark values (on the tiny dims, block size 5)."""
    d = TINY_DIMS
    return [
        ("ok_features", lambda: _features().validate(d, n_layer=4)),
        ("features_bf16_option_not_built", lambda: _features(
            dtype=DType.BF16, nbytes=3 * d.feature_width * 2).validate(d)),
        ("features_two_layers", lambda: _features(
            target_layers=(3, 4), nbytes=3 * 2 * d.n_embd * 4).validate(d)),
        ("features_layer_past_the_trunk", lambda: _features(
            target_layers=(3, 4, 5)).validate(d, n_layer=4)),
        ("features_repeated_layer", lambda: _features(target_layers=(3, 3, 4)).validate(d)),
        ("features_positions_gap", lambda: _features(positions=(10, 12, 13)).validate(d)),
        ("features_nbytes_mismatch", lambda: _features(nbytes=1).validate(d)),
        ("features_other_n_embd", lambda: _features(
            n_embd=2 * d.n_embd, nbytes=3 * 3 * 2 * d.n_embd * 4).validate(d)),
        ("ok_block", lambda: _block().validate(d, block_size=5)),
        ("block_past_block_size", lambda: _block(k=6).validate(d, block_size=5)),
        ("block_past_contract_bound", lambda: _block(k=9).validate(d)),
        ("block_anchor_outside_vocab", lambda: _block(anchor=256).validate(d)),
        ("ok_confidences", lambda: _conf().validate()),
        ("confidence_above_one", lambda: _conf((0.5, 1.5)).validate()),
        ("confidence_nan", lambda: _conf((0.5, float("nan"))).validate()),
        ("ok_proposal_full_block", lambda: DSparkProposal(
            _block(), _proposal((1, 2, 3, 4, 5), "dspark.v4.draft5")).validate(d,
                                                                                block_size=5)),
        ("ok_proposal_cut_at_p_min_0.5", lambda: DSparkProposal(
            _block(), _proposal((1, 2), "dspark.v4.draft2"), _conf(),
            p_min=0.5).validate(d)),
        ("proposal_not_cut_where_p_min_says", lambda: DSparkProposal(
            _block(), _proposal((1, 2, 3), "dspark.v4.draft3"), _conf(),
            p_min=0.5).validate(d)),
        ("proposal_with_an_mtp_recipe", lambda: DSparkProposal(
            _block(), _proposal((1, 2, 3, 4, 5), "mtp.v4.draft5")).validate(d)),
        ("proposal_of_another_epoch", lambda: DSparkProposal(
            _block(epoch=2), _proposal((1, 2, 3, 4, 5), "dspark.v4.draft5")).validate(d)),
        ("stale_features_for_the_session", lambda: Session(
            "s1", State.DECODING, epoch=4, position=13).check_message(
                _features().session_id, _features().epoch)),
    ]


def _verdict(fn: Callable[[], None]) -> Doc:
    try:
        fn()
    except ContractError as exc:
        return {"verdict": "refused", "error": type(exc).__name__, "reason": str(exc)}
    return {"verdict": "accepted"}


def _plan(p: RollbackPlan) -> Doc:
    return {"kind": p.kind, "drop": p.drop, "keep_until": p.keep_until,
            "replay_from": p.replay_from}


def _steps() -> list[Doc]:
    rows = []
    for n, n_rs in ((5, 6), (2, 6), (0, 6), (2, 0)):
        drafts = (1, 2, 3, 4, 5)
        emitted = (*drafts[:n], 9)
        r = VerifyResult("s1", 3, 12, 5, n, 9, emitted)
        plan = plan_dspark_step(r, n_rs_seq=n_rs)
        rows.append({"base_position": 12, "n_drafted": 5, "n_accepted": n, "n_rs_seq": n_rs,
                     "epoch_after": plan.epoch, "inject": list(plan.inject),
                     "upstream_inject": list(plan.upstream_inject),
                     "upstream_draft_seq_rm_from": plan.upstream_draft_seq_rm_from,
                     "target": _plan(plan.target), "draft": _plan(plan.draft),
                     "next_base": plan.next_base})
    return rows


def _truncation() -> Doc:
    sess = Session("s1", State.DECODING, epoch=3, position=20)
    t = plan_dspark_truncate(sess, 16, n_fed=19, n_rs_seq=6, last_decode_len=6)
    return {"position": 20, "to_position": 16, "n_fed": 19, "epoch_after": t.session.epoch,
            "target": _plan(t.target), "draft": _plan(t.draft)}


def _crossings() -> list[Doc]:
    out = []
    # head_dim of the K-row option: the tiny preset's 64, V4-Flash's 512
    for name, dims, head_dim in (("tiny", TINY_DIMS, 64), ("v4_flash", V4_FLASH_DIMS, 512)):
        mtp_row = seam_bytes_per_token(dims, DType.F32)["mtp_hidden_remote"]
        for placement, remote in ((Placement.CLIENT, 0), (Placement.TAIL, 0),
                                  (Placement.TAIL, 1)):
            out.append({
                "dims": name, "placement": placement.value, "remote_layers": remote,
                "head_dim": head_dim,
                "crossings": [c.to_json() for c in dspark_crossings(
                    dims, placement, remote_layers=remote, head_dim=head_dim)],
                "step_bytes_k5": {str(n): dspark_step_bytes(dims, placement, 5, n,
                                                            remote_layers=remote)
                                  for n in range(6)},
                "mtp_row_bytes_per_committed_token_f32": mtp_row})
    return out


def dspark_doc() -> Doc:
    """The fixture's content."""
    return {
        "position_rule": "DSpark feature row at position p is the target's row of token x_p, "
                         "injected as the draft's K at p (MTP pairs x_p with h_{p-1})",
        "placements": list(PLACEMENTS),
        "options_not_built": dict(DSPARK_OPTIONS),
        "shard_local_caches": {k.value: FORBIDDEN_KINDS[k.value]
                               for k in sorted(DSPARK_SHARD_LOCAL, key=lambda k: k.value)},
        "value_cases": [{"name": n, **_verdict(fn)} for n, fn in value_cases()],
        "step_plans": _steps(),
        "truncation": _truncation(),
        "crossings": _crossings(),
    }
