"""Typed MTP inputs and outputs for DeepSeek-V4 speculative decoding.

Why: the trunk shards, the MTP block, the coordinator and the evidence tools must agree on
what one MTP step consumes and produces, down to which hidden row pairs with which token.
Every rule lives here once so a disagreement is a ContractError, not a silent off-by-one.
Two drafters share the recipes' grammar ``<drafter>.v4.draft<k>``: the NextN MTP block
(``mtp``) and a DSpark draft (``dspark``, its own values in `mtplib.contract.dspark`).
"""

from __future__ import annotations

import enum
import re
from collections.abc import Sequence
from dataclasses import dataclass

from mtplib.errors import InputError

CONTRACT_VERSION = "mtp-contract/3"
"""Shards that advertise any other string cannot be negotiated with (fail closed).

mtp-contract/3: DSpark recipes dspark.v4.draft1..8 beside MTP's, the DSpark draft's SWA K
caches shard-local, its seam values (docs/contract.md, "Contract versions"); /2: the
recipes are mtp.v4.draft1..8 (the draft lengths the engines, the CLI and the llama adapter
run), one bound for parsing and advertising; /1 defined recipes draft1..3 but parsed
draft1..8."""

V4_HC = 4
"""DeepSeek-V4 hyper-connection streams: a hidden row is hc * n_embd values wide."""

MTP_OFF = "mtp.off"
"""No drafter at all: plain decoding (the off recipe of both drafters)."""
MTP_DRAFTER = "mtp"
DSPARK_DRAFTER = "dspark"
DRAFTERS: tuple[str, ...] = (MTP_DRAFTER, DSPARK_DRAFTER)
"""The drafters a recipe may name: the NextN MTP block, a DSpark draft (GGUF `dflash`)."""
DRAFTER_LABELS = {MTP_DRAFTER: "MTP", DSPARK_DRAFTER: "DSpark"}
MIN_DRAFT = 1
MAX_DRAFT = 8
"""Draft lengths the contract defines recipes for: mtp.v4.draft1..8, and no other."""
DRAFT_RANGE = range(MIN_DRAFT, MAX_DRAFT + 1)
DRAFT_BOUNDS = f"{MIN_DRAFT}..{MAX_DRAFT}"
"""The draft-length bound as error messages spell it."""
DEFAULT_DRAFT = 3
"""The draft length of a run that turns MTP on and names none (CLI, lanes, runtimes)."""

_DRAFT_RE = re.compile(r"(mtp|dspark)\.v4\.draft([0-9]+)")


class ContractError(InputError):
    """A value breaks the MTP contract; the message names field, expected and got."""


def fail(field: str, expected: str, got: object) -> ContractError:
    """Build the one error shape used everywhere: 'field: expected X, got Y'."""
    return ContractError(f"{field}: expected {expected}, got {got!r}")


def check_int(field: str, value: object, minimum: int | None = None) -> int:
    """Reject non-ints (bool included: True is not a position) and values below minimum."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise fail(field, "int", value)
    if minimum is not None and value < minimum:
        raise fail(field, f"int >= {minimum}", value)
    return value


def check_str(field: str, value: object) -> str:
    """Reject empty or non-string identifiers."""
    if not isinstance(value, str) or not value:
        raise fail(field, "non-empty str", value)
    return value


def check_identity(session_id: object, epoch: object) -> None:
    """Every message names its session and epoch so stale work can be refused."""
    check_str("session_id", session_id)
    check_int("epoch", epoch, minimum=0)


def check_positions(field: str, positions: object) -> tuple[int, ...]:
    """Positions must be a non-empty tuple of ints >= 0, each exactly one past the previous."""
    if not isinstance(positions, tuple) or not positions:
        raise fail(field, "non-empty tuple of ints", positions)
    for i, p in enumerate(positions):
        check_int(f"{field}[{i}]", p, minimum=0)
        if i and p != positions[i - 1] + 1:
            raise fail(f"{field}[{i}]", f"{positions[i - 1] + 1} (contiguous, increasing)", p)
    return positions


def _parse_recipe(recipe: object) -> tuple[str | None, int]:
    """(drafter, k) of a recipe: (None, 0) for mtp.off; ContractError for anything else."""
    if recipe == MTP_OFF:
        return None, 0
    m = _DRAFT_RE.fullmatch(recipe) if isinstance(recipe, str) else None
    # Leading zeros are refused so every recipe has exactly one spelling.
    if m is None or str(int(m.group(2))) != m.group(2):
        raise fail("recipe", f"{MTP_OFF}, mtp.v4.draft<{MIN_DRAFT}..{MAX_DRAFT}> or "
                   f"dspark.v4.draft<{MIN_DRAFT}..{MAX_DRAFT}>", recipe)
    k = int(m.group(2))
    if not MIN_DRAFT <= k <= MAX_DRAFT:
        raise fail("recipe", f"{m.group(1)}.v4.draft<k> with {MIN_DRAFT} <= k <= {MAX_DRAFT}",
                   recipe)
    return m.group(1), k


def recipe_draft_k(recipe: object) -> int:
    """Return k for mtp.v4.draft<k> or dspark.v4.draft<k>, 0 for mtp.off; refuse anything
    else as unknown."""
    return _parse_recipe(recipe)[1]


def recipe_drafter(recipe: object) -> str | None:
    """The drafter a recipe names (`DRAFTERS`), None for mtp.off; ContractError for an
    unknown recipe."""
    return _parse_recipe(recipe)[0]


def check_drafter(drafter: object) -> str:
    """``drafter`` if it is one of `DRAFTERS`; ContractError otherwise."""
    if drafter not in DRAFTERS:
        raise fail("drafter", " or ".join(DRAFTERS), drafter)
    return drafter  # type: ignore[return-value]


def draft_problem(name: str, k: object) -> str | None:
    """Why ``k`` is no draft length (message naming ``name``), or None: 0 (MTP off) or
    MIN_DRAFT..MAX_DRAFT. The one bound the CLI, lanes, engines and adapter check."""
    if isinstance(k, bool) or not isinstance(k, int) or not (k == 0 or k in DRAFT_RANGE):
        return f"{name} must be in {DRAFT_BOUNDS} (0: MTP off), got {k!r}"
    return None


class DraftLength(int):
    """A draft length `checked_draft` accepted (0 = MTP off). Why a type: the bound is
    checked once, where a run's request is built, and every floor after it (options, spec,
    routing, engine, the pickled worker options) carries the checked value instead of
    checking it again; a plain int entering at any floor is still checked there."""

    __slots__ = ()


NO_DRAFT = DraftLength(0)
"""MTP off: the draft length of a run without a sidecar (`draft_with`)."""


def checked_draft(k: object, name: str = "draft length k") -> DraftLength:
    """``k`` as a checked `DraftLength`: the one place a draft length is validated
    (`draft_problem`); ContractError naming ``name`` otherwise. Already checked: as is."""
    if isinstance(k, DraftLength):
        return k
    if problem := draft_problem(name, k):
        raise ContractError(problem)
    return DraftLength(k)


@dataclass(frozen=True)
class DraftRule:
    """The one rule "no sidecar means k=0", decided for a run: ``has_sidecar`` is fixed
    where the run's request is built (`draft_with`, once) and the rule is carried on the
    request, so a generation's own draft length is held to it without deciding again."""

    has_sidecar: bool

    def __call__(self, k: object, name: str = "draft length k") -> DraftLength:
        """``k`` (checked, errors naming ``name``) where the MTP block is there to draft,
        else `NO_DRAFT` (``k`` unread: there is nothing to draft with)."""
        return checked_draft(k, name) if self.has_sidecar else NO_DRAFT


def draft_with(k: object, *, has_sidecar: bool, name: str = "draft length k") -> DraftLength:
    """`DraftRule` applied where a run decides it, once, where its request is built
    (`mtplib.runtime.request.build_request`); a run's later floors use the carried rule."""
    return DraftRule(has_sidecar)(k, name)


@dataclass(frozen=True)
class DraftSpec:
    """The one description of a run's drafting: k drafts per step, 0 = MTP off, and the
    drafter that proposes them (``mtp``: the NextN block; ``dspark``: a DSpark draft, one
    block of k tokens per step, anchor + k-1 noise tokens).

    Why: the draft length, its bounds, the recipe id and "is MTP on" were decided in many
    places; every entry point builds this (validated here) and reads them from it."""

    k: int = 0
    drafter: str = MTP_DRAFTER

    def __post_init__(self) -> None:
        object.__setattr__(self, "k", checked_draft(self.k))
        check_drafter(self.drafter)

    @classmethod
    def requested(cls, draft: int | None, *, mtp: bool) -> DraftSpec:
        """What a user's options ask for: MTP off without a sidecar (`draft_with`), else
        ``draft`` (DEFAULT_DRAFT when not given)."""
        return cls(draft_with(DEFAULT_DRAFT if draft is None else draft, has_sidecar=mtp))

    @classmethod
    def from_recipe(cls, recipe: object) -> DraftSpec:
        """The spec of a recipe id; ContractError for an unknown recipe."""
        drafter, k = _parse_recipe(recipe)
        return cls(k, drafter or MTP_DRAFTER)

    @property
    def mtp(self) -> bool:
        """Drafting is on (either drafter): it proposes k >= 1 tokens per step."""
        return self.k > 0

    @property
    def recipe(self) -> str:
        """The contract's recipe id: mtp.off, or <drafter>.v4.draft<k>."""
        return f"{self.drafter}.v4.draft{self.k}" if self.k else MTP_OFF


MTP_RECIPES: tuple[str, ...] = tuple(DraftSpec(k).recipe for k in DRAFT_RANGE)
DSPARK_RECIPES: tuple[str, ...] = tuple(DraftSpec(k, DSPARK_DRAFTER).recipe
                                        for k in DRAFT_RANGE)
"""dspark.v4.draft<k>: one block pass of k tokens (the anchor and k-1 noise tokens) gives k
drafts; k is what the verifier sees, as for MTP. A draft file's block size bounds the k a
shard advertises (past it upstream skips the Markov head, dflash.cpp:324-327)."""
RECIPES: tuple[str, ...] = (MTP_OFF, *MTP_RECIPES, *DSPARK_RECIPES)


class DType(enum.Enum):
    """Element types on the wire; i32 is for token ids, positions and small records."""

    F32 = "f32"
    F16 = "f16"
    BF16 = "bf16"
    I32 = "i32"

    @property
    def itemsize(self) -> int:
        return _ITEMSIZE[self]

    @property
    def is_float(self) -> bool:
        return self in FLOAT_DTYPES


_ITEMSIZE = {DType.F32: 4, DType.F16: 2, DType.BF16: 2, DType.I32: 4}
FLOAT_DTYPES = frozenset({DType.F32, DType.F16, DType.BF16})


V4_DSPARK_LAYERS = 3
"""Target layers a V4 DSpark draft reads (V4-Flash: the outputs of layers 40-42)."""


@dataclass(frozen=True, kw_only=True)
class ModelDims:
    """The few model sizes the contract needs; validated at construction.
    ``n_target_layers``: the trunk layers a DSpark draft reads features of (L)."""

    n_embd: int
    hc: int = V4_HC
    n_vocab: int
    n_target_layers: int = V4_DSPARK_LAYERS

    def __post_init__(self) -> None:
        check_int("n_embd", self.n_embd, minimum=1)
        check_int("hc", self.hc, minimum=1)
        if self.hc != V4_HC:
            raise fail("hc", str(V4_HC), self.hc)
        check_int("n_vocab", self.n_vocab, minimum=1)
        check_int("n_target_layers", self.n_target_layers, minimum=1)

    @property
    def hidden_width(self) -> int:
        """Values per hidden row: the hc residual streams side by side."""
        return self.hc * self.n_embd

    @property
    def feature_width(self) -> int:
        """Values per token a DSpark draft reads: one n_embd hc-mean row per target layer."""
        return self.n_target_layers * self.n_embd


TINY_DIMS = ModelDims(n_embd=64, n_vocab=256)
V4_FLASH_DIMS = ModelDims(n_embd=4096, n_vocab=129280)


def _check_token(field: str, token: object, dims: ModelDims | None) -> None:
    check_int(field, token, minimum=0)
    if dims is not None and token >= dims.n_vocab:  # type: ignore[operator]
        raise fail(field, f"token id < n_vocab={dims.n_vocab}", token)


@dataclass(frozen=True)
class HiddenRows:
    """The trunk's last hidden state h (hc*E stream before the output hc head, not normed).

    Payload bytes are optional so descriptors can be checked without moving data.
    """

    session_id: str
    epoch: int
    positions: tuple[int, ...]
    width: int
    dtype: DType
    nbytes: int
    payload: bytes | None = None

    def validate(self, dims: ModelDims) -> None:
        check_identity(self.session_id, self.epoch)
        check_positions("positions", self.positions)
        if not isinstance(self.dtype, DType) or not self.dtype.is_float:
            raise fail("dtype", "one of f32/f16/bf16", getattr(self.dtype, "value", self.dtype))
        check_int("width", self.width)
        if self.width != dims.hidden_width:
            raise fail("width", f"hc*n_embd={dims.hidden_width}", self.width)
        want = len(self.positions) * self.width * self.dtype.itemsize
        check_int("nbytes", self.nbytes)
        if self.nbytes != want:
            raise fail("nbytes", f"len(positions)*width*itemsize={want}", self.nbytes)
        if self.payload is not None and len(self.payload) != self.nbytes:
            raise fail("payload", f"{self.nbytes} bytes", len(self.payload))


@dataclass(frozen=True)
class TokenIds:
    """Token ids with the positions they occupy."""

    session_id: str
    epoch: int
    positions: tuple[int, ...]
    tokens: tuple[int, ...]

    def validate(self, dims: ModelDims) -> None:
        check_identity(self.session_id, self.epoch)
        check_positions("positions", self.positions)
        if not isinstance(self.tokens, tuple) or len(self.tokens) != len(self.positions):
            raise fail("tokens", f"tuple of len(positions)={len(self.positions)}", self.tokens)
        for i, t in enumerate(self.tokens):
            _check_token(f"tokens[{i}]", t, dims)


@dataclass(frozen=True)
class MTPInput:
    """One MTP-block step. POSITION RULE: the row at position p pairs x_p with h_{p-1}."""

    hidden: HiddenRows
    tokens: TokenIds

    def validate(self, dims: ModelDims) -> None:
        self.hidden.validate(dims)
        self.tokens.validate(dims)
        h, t = self.hidden, self.tokens
        if h.session_id != t.session_id:
            raise fail("hidden.session_id", f"tokens.session_id={t.session_id!r}", h.session_id)
        if h.epoch != t.epoch:
            raise fail("hidden.epoch", f"tokens.epoch={t.epoch}", h.epoch)
        if len(h.positions) != len(t.positions):
            raise fail("hidden.positions", f"{len(t.positions)} rows", len(h.positions))
        for i, (hp, tp) in enumerate(zip(h.positions, t.positions, strict=True)):
            if hp != tp - 1:
                raise fail(f"hidden.positions[{i}]", f"tokens.positions[{i}]-1={tp - 1}", hp)


@dataclass(frozen=True)
class DraftProposal:
    """k draft tokens for positions base+1..base+k, following the last accepted token."""

    session_id: str
    epoch: int
    base_position: int
    drafts: tuple[int, ...]
    head_index: int
    recipe: str

    @property
    def k(self) -> int:
        return len(self.drafts)

    def validate(self, dims: ModelDims | None = None) -> None:
        check_identity(self.session_id, self.epoch)
        check_int("base_position", self.base_position, minimum=0)
        if not isinstance(self.drafts, tuple) or not self.drafts:
            raise fail("drafts", "non-empty tuple of token ids", self.drafts)
        for i, t in enumerate(self.drafts):
            _check_token(f"drafts[{i}]", t, dims)
        # V4 has a single MTP block, so every v4 recipe drafts from head 0.
        check_int("head_index", self.head_index)
        if self.head_index != 0:
            raise fail("head_index", "0 (V4 has one MTP block)", self.head_index)
        k = recipe_draft_k(self.recipe)
        if k == 0:
            raise fail("recipe", "an MTP recipe or a DSpark one (mtp.off drafts nothing)",
                       self.recipe)
        if k != len(self.drafts):
            raise fail("drafts", f"{k} tokens for {self.recipe}", len(self.drafts))


@dataclass(frozen=True)
class VerifyResult:
    """Outcome of verifying a proposal: accepted drafts plus the target's own next token."""

    session_id: str
    epoch: int
    base_position: int
    n_drafted: int
    n_accepted: int
    correction_token: int
    emitted: tuple[int, ...]

    @property
    def next_position(self) -> int:
        """Position of the last emitted token: the next proposal's base_position."""
        return self.base_position + self.n_accepted + 1

    @property
    def rejected(self) -> int:
        """Drafts that must be rolled back out of every shard's caches."""
        return self.n_drafted - self.n_accepted

    def validate(
        self, dims: ModelDims | None = None, proposal: DraftProposal | None = None
    ) -> None:
        check_identity(self.session_id, self.epoch)
        check_int("base_position", self.base_position, minimum=0)
        check_int("n_drafted", self.n_drafted, minimum=1)
        check_int("n_accepted", self.n_accepted, minimum=0)
        if self.n_accepted > self.n_drafted:
            raise fail("n_accepted", f"<= n_drafted={self.n_drafted}", self.n_accepted)
        _check_token("correction_token", self.correction_token, dims)
        n = self.n_accepted + 1
        if not isinstance(self.emitted, tuple) or len(self.emitted) != n:
            raise fail("emitted", f"tuple of n_accepted+1={n} tokens", self.emitted)
        for i, t in enumerate(self.emitted):
            _check_token(f"emitted[{i}]", t, dims)
        if self.emitted[-1] != self.correction_token:
            raise fail("emitted[-1]", f"correction_token={self.correction_token}", self.emitted[-1])
        if proposal is not None:
            self._check_against(proposal)

    def _check_against(self, p: DraftProposal) -> None:
        for name in ("session_id", "epoch", "base_position"):
            if getattr(self, name) != getattr(p, name):
                raise fail(name, f"proposal.{name}={getattr(p, name)!r}", getattr(self, name))
        if self.n_drafted != p.k:
            raise fail("n_drafted", f"proposal k={p.k}", self.n_drafted)
        accepted = self.emitted[: self.n_accepted]
        if accepted != p.drafts[: self.n_accepted]:
            raise fail("emitted", f"accepted prefix {p.drafts[: self.n_accepted]}", accepted)


def verify_greedy(proposal: DraftProposal, target_argmax: Sequence[int]) -> VerifyResult:
    """Greedy acceptance: target_argmax[i] is the target's pick after [last, d1..di].

    Accept drafts while they match; the target's pick at the first mismatch (or the bonus
    pick after full acceptance) is always emitted, so every verify makes progress.
    """
    proposal.validate()
    k = proposal.k
    if isinstance(target_argmax, str | bytes) or len(target_argmax) != k + 1:
        raise fail("target_argmax", f"{k + 1} tokens (k+1)", target_argmax)
    for i, t in enumerate(target_argmax):
        check_int(f"target_argmax[{i}]", t, minimum=0)
    n = 0
    while n < k and target_argmax[n] == proposal.drafts[n]:
        n += 1
    correction = target_argmax[n]
    result = VerifyResult(
        session_id=proposal.session_id,
        epoch=proposal.epoch,
        base_position=proposal.base_position,
        n_drafted=k,
        n_accepted=n,
        correction_token=correction,
        emitted=(*proposal.drafts[:n], correction),
    )
    result.validate(proposal=proposal)
    return result


ROLLBACK_KINDS = ("none", "tail", "checkpoint_replay")


@dataclass(frozen=True)
class RollbackPlan:
    """How a shard drops the tail of a sequence; keep_until is the first dropped position.

    For checkpoint_replay: restore the sequence-state checkpoint saved at replay_from, then
    re-decode the accepted tokens at positions replay_from..keep_until-1.
    """

    kind: str
    drop: int
    keep_until: int
    replay_from: int | None


def plan_rollback(
    n_cached: int,
    keep_until: int,
    n_rs_seq: int,
    last_decode_len: int,
    *,
    checkpoint_at: int | None = None,
) -> RollbackPlan:
    """Apply the V4 rollback rule to dropping n_cached-keep_until tokens from the tail.

    V4's compressor state can only step back a few tokens (n_rs_seq) and only inside the
    most recent decode; anything deeper needs a saved state plus re-decode. checkpoint_at
    defaults to the checkpoint taken before the most recent decode (n_cached -
    last_decode_len) when that is at or before keep_until, else 0 (full re-prefill).
    """
    check_int("n_cached", n_cached, minimum=0)
    check_int("keep_until", keep_until, minimum=0)
    check_int("n_rs_seq", n_rs_seq, minimum=0)
    check_int("last_decode_len", last_decode_len, minimum=0)
    if last_decode_len > n_cached:
        raise fail("last_decode_len", f"<= n_cached={n_cached}", last_decode_len)
    drop = n_cached - keep_until
    if drop < 0:
        raise fail("keep_until", f"<= n_cached={n_cached}", keep_until)
    if drop == 0:
        return RollbackPlan("none", 0, keep_until, None)
    if drop <= n_rs_seq and drop <= last_decode_len:
        return RollbackPlan("tail", drop, keep_until, None)
    if checkpoint_at is None:
        pre_decode = n_cached - last_decode_len
        checkpoint_at = pre_decode if pre_decode <= keep_until else 0
    check_int("checkpoint_at", checkpoint_at, minimum=0)
    if checkpoint_at > keep_until:
        raise fail("checkpoint_at", f"<= keep_until={keep_until}", checkpoint_at)
    return RollbackPlan("checkpoint_replay", drop, keep_until, checkpoint_at)


class CacheKind(enum.Enum):
    """Per-shard V4 caches. Lifecycle, identical for every kind:

    created with the shard's context; grows with every decode (prefill, verify batch or MTP
    step) on the layers that shard owns; truncated on rollback, either by tail removal or by
    restoring a sequence-state checkpoint; cleared when the session closes. A cache is never
    serialized across a seam: each shard rebuilds its own from the boundary values it sees.
    """

    RAW_SWA_K = "raw_swa_k"
    CSA_COMPRESSED_K = "csa_compressed_k"
    HCA_COMPRESSED_K = "hca_compressed_k"
    INDEXER_K = "indexer_k"
    COMPRESSOR_STATE = "compressor_state"
    MTP_SWA_K = "mtp_swa_k"
    #: a DSpark draft's per-stage SWA K (one shared KV head per stage; V is allocated but
    #: never read); no recurrent or compressor state, no Markov state across steps
    DSPARK_SWA_K = "dspark_swa_k"


SHARD_LOCAL: frozenset[CacheKind] = frozenset(CacheKind)
