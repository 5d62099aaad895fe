"""DSpark's typed values: what one DSpark step consumes and produces, how it rolls back in
both contexts, and what crosses which seam per placement of the draft.

Why beside MTP's (`mtplib.contract.types`): a DSpark draft (GGUF `dflash` + `markov_w1`,
upstream's `draft-dspark`) reads other values than the MTP block. Its input is not the
trunk's last hidden row but, per committed token, one n_embd row per target layer (the
mean of the 4 hc streams entering that layer: src/models/deepseek4.cpp:269-277), injected
as K into its stages' SWA caches at the token's own position. It drafts from token ids
alone: one pass over a block ``[anchor, mask x (k-1)]`` gives k drafts, and its confidence
head one sigmoid per draft. Its state is its stages' K caches, shard-local like every
cache (`CacheKind.DSPARK_SWA_K`); it has no recurrent or compressor state and keeps no
Markov state across steps. Reference: v4-dspark.md §2-§3 (upstream's
common/speculative.cpp, src/models/dflash.cpp, tools/server/server-context.cpp).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

from mtplib.contract.labels import Placement
from mtplib.contract.seam import INT_BYTES, SEAM_VALUES, VERIFY_RESULT_WIDTH, BoundaryMessage
from mtplib.contract.session import Session
from mtplib.contract.types import (
    DSPARK_DRAFTER,
    MAX_DRAFT,
    MIN_DRAFT,
    CacheKind,
    ContractError,
    DraftProposal,
    DraftSpec,
    DType,
    ModelDims,
    RollbackPlan,
    VerifyResult,
    check_identity,
    check_int,
    check_positions,
    fail,
    plan_rollback,
    recipe_drafter,
)

DSPARK_SHARD_LOCAL: frozenset[CacheKind] = frozenset({CacheKind.DSPARK_SWA_K})
"""The draft's own state: its stages' SWA K caches, on whichever side runs it; never sent."""

FEATURE_DTYPE = DType.F32
"""What upstream hands out (llama_get_embeddings_layer_inp: F32 rows) and the contract
carries; BF16 features are an option (`DSPARK_OPTIONS`), not built, refused at a seam."""

DSPARK_OPTIONS: Mapping[str, str] = MappingProxyType({
    "bf16 features": "the feature rows as bf16 (half the bytes); upstream hands out f32",
    "K rows": "the post-fc K row of each stage (n_stages x head_dim, f32 or f16) instead of "
              "the features: needs fc and each stage's wkv where the features are made",
})
"""Ways to send less for DSpark (v4-dspark.md §3.1), not built and not the default: the
seam validator refuses them today (fail closed); `dspark_crossings` lists their bytes."""

DSPARK_CONTEXTS = ("target", "draft")
"""The two contexts a DSpark step touches; a rollback or truncation trims both."""


def _check_layers(target_layers: object, dims: ModelDims, n_layer: int | None) -> None:
    if not isinstance(target_layers, tuple) or not target_layers:
        raise fail("target_layers", "non-empty tuple of layer ids", target_layers)
    for i, t in enumerate(target_layers):
        check_int(f"target_layers[{i}]", t, minimum=0)
        if n_layer is not None and t > n_layer:
            raise fail(f"target_layers[{i}]", f"<= n_layer={n_layer} (n_layer: the last "
                       "layer's output)", t)
    if len(set(target_layers)) != len(target_layers):
        raise fail("target_layers", "distinct layer ids", target_layers)
    if len(target_layers) != dims.n_target_layers:
        raise fail("target_layers", f"{dims.n_target_layers} layers (n_target_layers)",
                   len(target_layers))


@dataclass(frozen=True)
class DSparkFeatures:
    """The target's features for a DSpark draft, per committed token: one row of n_embd
    floats per target layer, side by side in ``target_layers`` order (upstream's ids: t is
    the input of trunk layer t, the output of layer t-1; n_layer is the last layer's).

    POSITION RULE: the row at position p is made by the target's own decode of token x_p
    and is injected as the draft's K at p (MTP's row at p is h_{p-1}). Only committed
    tokens' rows are needed: a rejected position's row is never sent (upstream injects it
    and removes it again with seq_rm, ending in the same cache)."""

    session_id: str
    epoch: int
    positions: tuple[int, ...]
    target_layers: tuple[int, ...]
    n_embd: int
    dtype: DType
    nbytes: int
    payload: bytes | None = None

    @property
    def width(self) -> int:
        """Floats per token: L * n_embd."""
        return len(self.target_layers) * self.n_embd

    def validate(self, dims: ModelDims, *, n_layer: int | None = None) -> None:
        check_identity(self.session_id, self.epoch)
        check_positions("positions", self.positions)
        _check_layers(self.target_layers, dims, n_layer)
        check_int("n_embd", self.n_embd, minimum=1)
        if self.n_embd != dims.n_embd:
            raise fail("n_embd", f"the trunk's n_embd={dims.n_embd}", self.n_embd)
        if self.dtype != FEATURE_DTYPE:
            got = self.dtype.value if isinstance(self.dtype, DType) else self.dtype
            raise fail("dtype", "f32 (bf16 features are an option, not built: "
                       "DSPARK_OPTIONS)", got)
        want = len(self.positions) * self.width * self.dtype.itemsize
        check_int("nbytes", self.nbytes)
        if self.nbytes != want:
            raise fail("nbytes", f"len(positions)*L*n_embd*4={want}", self.nbytes)
        if self.payload is not None and len(self.payload) != self.nbytes:
            raise fail("payload", f"{self.nbytes} bytes", len(self.payload))

    def message(self, seq_step: int) -> BoundaryMessage:
        """The features as the seam message ``dspark_features`` (client placement)."""
        return BoundaryMessage(self.session_id, self.epoch, seq_step, "dspark_features",
                               self.positions, self.width, self.dtype, self.nbytes,
                               self.payload)


def _check_token(field: str, token: object, dims: ModelDims | None) -> None:
    check_int(field, token, minimum=0)
    if dims is not None and token >= dims.n_vocab:  # type: ignore[operator]
        raise fail(field, f"token id < n_vocab={dims.n_vocab}", token)


@dataclass(frozen=True)
class DSparkBlock:
    """One noise block: ``[anchor, mask x (k-1)]`` at positions base..base+k-1, decoded in
    one non-causal pass; slot i's pick is the draft for base+i+1 (anchor-first). The anchor
    is the last committed token, whose features are not injected yet (its row comes with
    the verify that follows)."""

    session_id: str
    epoch: int
    base_position: int
    anchor: int
    mask_token: int
    k: int

    @property
    def tokens(self) -> tuple[int, ...]:
        return (self.anchor, *([self.mask_token] * (self.k - 1)))

    @property
    def positions(self) -> tuple[int, ...]:
        return tuple(range(self.base_position, self.base_position + self.k))

    @property
    def recipe(self) -> str:
        return DraftSpec(self.k, DSPARK_DRAFTER).recipe

    def validate(self, dims: ModelDims | None = None, *, block_size: int | None = None) -> None:
        check_identity(self.session_id, self.epoch)
        check_int("base_position", self.base_position, minimum=0)
        _check_token("anchor", self.anchor, dims)
        _check_token("mask_token", self.mask_token, dims)
        check_int("k", self.k, minimum=MIN_DRAFT)
        if self.k > MAX_DRAFT:
            raise fail("k", f"<= {MAX_DRAFT} (the contract's draft bound)", self.k)
        if block_size is not None and self.k > block_size:
            # past it upstream silently skips the Markov head (dflash.cpp:324-327)
            raise fail("k", f"<= the draft's block size {block_size}", self.k)


@dataclass(frozen=True)
class DSparkConfidences:
    """The confidence head's sigmoid per block slot (upstream broadcasts each E-wide into
    the h_nextn rows, dflash.cpp:394-403); slot i scores the draft for base+i+1."""

    session_id: str
    epoch: int
    base_position: int
    values: tuple[float, ...]

    def validate(self) -> None:
        check_identity(self.session_id, self.epoch)
        check_int("base_position", self.base_position, minimum=0)
        if not isinstance(self.values, tuple) or not MIN_DRAFT <= len(self.values) <= MAX_DRAFT:
            raise fail("values", f"tuple of {MIN_DRAFT}..{MAX_DRAFT} confidences", self.values)
        for i, v in enumerate(self.values):
            if isinstance(v, bool) or not isinstance(v, int | float) or \
                    not (math.isfinite(v) and 0.0 <= v <= 1.0):
                raise fail(f"values[{i}]", "a float in [0, 1]", v)

    def kept(self, p_min: float) -> int:
        """Drafts kept under ``p_min``: up to the first slot whose confidence is below it
        (upstream's loop, common/speculative.cpp:1269-1277); p_min 0 keeps them all."""
        if isinstance(p_min, bool) or not isinstance(p_min, int | float) or \
                not (math.isfinite(p_min) and 0.0 <= p_min <= 1.0):
            raise fail("p_min", "a float in [0, 1]", p_min)
        return next((i for i, v in enumerate(self.values) if v < p_min), len(self.values))


@dataclass(frozen=True)
class DSparkProposal:
    """A DSpark step's output: the block's drafts as a `DraftProposal` with a dspark
    recipe (cut by the confidence head where ``p_min`` > 0) and the block's confidences
    (None when the run does not read them)."""

    block: DSparkBlock
    proposal: DraftProposal
    confidences: DSparkConfidences | None = None
    p_min: float = 0.0

    def validate(self, dims: ModelDims | None = None, *, block_size: int | None = None) -> None:
        b, p, c = self.block, self.proposal, self.confidences
        b.validate(dims, block_size=block_size)
        p.validate(dims)
        if recipe_drafter(p.recipe) != DSPARK_DRAFTER:
            raise fail("proposal.recipe", "a dspark recipe", p.recipe)
        for name in ("session_id", "epoch", "base_position"):
            if getattr(p, name) != getattr(b, name):
                raise fail(f"proposal.{name}", f"block.{name}={getattr(b, name)!r}",
                           getattr(p, name))
        if p.k > b.k:
            raise fail("proposal.drafts", f"<= the block's {b.k} slots", p.k)
        if c is None:
            if self.p_min:
                raise fail("confidences", "the block's confidences (p_min > 0)", None)
            if p.k != b.k:
                raise fail("proposal.drafts", f"{b.k} (no confidence cut)", p.k)
            return
        c.validate()
        for name in ("session_id", "epoch", "base_position"):
            if getattr(c, name) != getattr(b, name):
                raise fail(f"confidences.{name}", f"block.{name}={getattr(b, name)!r}",
                           getattr(c, name))
        if len(c.values) != b.k:
            raise fail("confidences.values", f"{b.k} (one per block slot)", len(c.values))
        kept = c.kept(self.p_min)
        if p.k != kept:
            raise fail("proposal.drafts", f"{kept} (cut at the first confidence below "
                       f"p_min={self.p_min})", p.k)


def plan_draft_rollback(n_fed: int, keep_until: int) -> RollbackPlan:
    """The draft context's rollback: its caches are plain SWA K (no recurrent state), so
    dropping any tail is one seq_rm (run: v4-dspark.md §2.5), never a checkpoint."""
    check_int("n_fed", n_fed, minimum=0)
    check_int("keep_until", keep_until, minimum=0)
    if keep_until > n_fed:
        raise fail("keep_until", f"<= n_fed={n_fed}", keep_until)
    drop = n_fed - keep_until
    return RollbackPlan("tail" if drop else "none", drop, keep_until, None)


@dataclass(frozen=True)
class DSparkStepPlan:
    """What a verified DSpark step does to both contexts.

    ``inject``: the committed positions whose feature rows the draft receives (the last
    token and the accepted drafts, base..base+n); rejected positions' rows never (the
    contract's minimum; upstream injects all k+1 and removes the rejected with seq_rm,
    ``upstream_inject`` / ``upstream_draft_seq_rm_from``). ``target``: the target's
    rollback of the rejected rows (`plan_rollback`, V4's rule); ``draft``: the draft's
    (always a tail seq_rm). The noise block's own K was removed right after its pass
    (seq_rm from the base), so the draft holds positions < base before the injection and
    < ``next_base`` after it. ``epoch``: the session's epoch after the step (+1 when a
    draft was rejected)."""

    session_id: str
    epoch: int
    inject: tuple[int, ...]
    upstream_inject: tuple[int, ...]
    upstream_draft_seq_rm_from: int
    target: RollbackPlan
    draft: RollbackPlan
    next_base: int


def plan_dspark_step(result: VerifyResult, *, n_rs_seq: int,
                     checkpoint_at: int | None = None) -> DSparkStepPlan:
    """The plan of both contexts after ``result`` (a verify of [last, d1..dk] at positions
    base..base+k, k = n_drafted): the target decoded k+1 rows; n were accepted."""
    result.validate()
    base, k, n = result.base_position, result.n_drafted, result.n_accepted
    keep = base + n + 1
    target = plan_rollback(base + k + 1, keep, n_rs_seq, k + 1, checkpoint_at=checkpoint_at)
    upstream = tuple(range(base, base + k + 1))
    return DSparkStepPlan(
        session_id=result.session_id, epoch=result.epoch + int(n < k),
        inject=tuple(range(base, keep)), upstream_inject=upstream,
        upstream_draft_seq_rm_from=keep, target=target,
        draft=plan_draft_rollback(base + k + 1, keep), next_base=keep)


@dataclass(frozen=True)
class DSparkTruncation:
    """A truncation to ``to_position`` (the session's `truncate`, epoch +1) trims both
    contexts: the target by `plan_rollback`, the draft by a tail seq_rm."""

    session: Session
    target: RollbackPlan
    draft: RollbackPlan


def plan_dspark_truncate(session: Session, to_position: int, *, n_fed: int, n_rs_seq: int,
                         last_decode_len: int, checkpoint_at: int | None = None
                         ) -> DSparkTruncation:
    """``session`` truncated to ``to_position`` (its epoch bumped), with the target's plan
    (its cache holds session.position tokens) and the draft's (it holds ``n_fed``)."""
    after = session.truncate(to_position)
    target = plan_rollback(session.position, to_position, n_rs_seq, last_decode_len,
                           checkpoint_at=checkpoint_at)
    return DSparkTruncation(after, target, plan_draft_rollback(n_fed, min(to_position, n_fed)))


def check_for_session(value: DSparkFeatures | DSparkBlock | DSparkConfidences,
                      session: Session) -> None:
    """Refuse a DSpark value from another session, a finished one or another epoch (every
    DSpark value carries its session and epoch, as MTP's do)."""
    session.check_message(value.session_id, value.epoch)


# -- what crosses which seam, per placement ---------------------------------------------
@dataclass(frozen=True)
class Crossing:
    """One value that crosses between the trunk's shards and the draft for a placement.

    ``per``: "committed token", "step" or "draft position"; ``bytes``: per unit;
    ``option``: not built (the seam validator refuses it today), listed with its bytes."""

    value: str
    direction: str  # "to the draft" or "from the draft"
    per: str
    bytes: int
    note: str
    option: bool = False

    def to_json(self) -> dict:
        return {"value": self.value, "direction": self.direction, "per": self.per,
                "bytes": self.bytes, "note": self.note, "option": self.option}


def _f32(kind: str, dims: ModelDims) -> int:
    return SEAM_VALUES[kind].bytes_per_row(dims, DType.F32)


def dspark_crossings(dims: ModelDims, placement: Placement | str, *, remote_layers: int = 0,
                     n_stages: int = 3, head_dim: int = 512) -> tuple[Crossing, ...]:
    """What crosses for DSpark (beyond a plain step's boundary values) with the draft in
    ``placement``: the contract's minimum, then the options of v4-dspark.md §3.1.

    ``client``: the committed tokens' features, once each (L x n_embd x 4 bytes f32);
    nothing per draft. ``tail``: the anchor id and the verify record in, the draft ids
    and confidences out; the features of the ``remote_layers`` target layers whose
    residual the tail shard does not see (its first layer is past them) come from the
    shard before (n_embd x 4 bytes each per committed token, `mtplib.ownership.dspark`).
    Options (not built, not the default): bf16 features (half the bytes), or the post-fc
    per-stage K rows (``n_stages`` x ``head_dim``, f32 or f16), which need ``fc`` and each
    stage's ``wkv`` where the features are made."""
    placement = Placement(placement)
    check_int("remote_layers", remote_layers, minimum=0)
    if remote_layers > dims.n_target_layers:
        raise fail("remote_layers", f"<= n_target_layers={dims.n_target_layers}",
                   remote_layers)
    check_int("n_stages", n_stages, minimum=1)
    check_int("head_dim", head_dim, minimum=1)
    feat = _f32("dspark_features", dims)
    krow = n_stages * head_dim
    if placement == Placement.CLIENT:
        base = (Crossing("dspark_features", "to the draft", "committed token", feat,
                         "every prompt token once at prefill, then the n_accepted+1 "
                         "committed tokens of each step; rejected positions never"),)
        opts = (Crossing("dspark_features (bf16)", "to the draft", "committed token",
                         feat // 2, "the same rows as bf16", option=True),
                Crossing("dspark K rows (f32)", "to the draft", "committed token",
                         krow * 4, "post-fc per-stage K rows: fc and wkv run where the "
                         "features are made", option=True),
                Crossing("dspark K rows (f16)", "to the draft", "committed token",
                         krow * 2, "as above, f16 (the draft cache's type)", option=True))
        return base + opts
    rows = (Crossing("dspark_features", "to the draft", "committed token",
                     remote_layers * dims.n_embd * FEATURE_DTYPE.itemsize,
                     f"{remote_layers} target layer(s) made on an earlier shard; the tail "
                     "computes the others from the residual it holds"),) \
        if remote_layers else ()
    return rows + (
        Crossing("token_ids", "to the draft", "step", INT_BYTES,
                 "the anchor (last committed token)"),
        Crossing("verify_result", "to the draft", "step",
                 VERIFY_RESULT_WIDTH * INT_BYTES, "how many drafts were accepted"),
        Crossing("draft_tokens", "from the draft", "draft position", INT_BYTES,
                 "one id per draft"),
        Crossing("dspark_confidences", "from the draft", "draft position",
                 _f32("dspark_confidences", dims), "one f32 per draft (p_min cut)"))


def dspark_step_bytes(dims: ModelDims, placement: Placement | str, k: int, n_accepted: int,
                      *, remote_layers: int = 0) -> int:
    """Bytes one verified DSpark step of ``k`` drafts with ``n_accepted`` accepted adds to
    a plain step's traffic, by the contract's minimum (no option)."""
    check_int("k", k, minimum=MIN_DRAFT)
    check_int("n_accepted", n_accepted, minimum=0)
    if k > MAX_DRAFT or n_accepted > k:
        raise ContractError(f"k: expected {MIN_DRAFT}..{MAX_DRAFT} with n_accepted <= k, "
                            f"got k={k}, n_accepted={n_accepted}")
    units = {"committed token": n_accepted + 1, "step": 1, "draft position": k}
    return sum(c.bytes * units[c.per]
               for c in dspark_crossings(dims, placement, remote_layers=remote_layers)
               if not c.option)
