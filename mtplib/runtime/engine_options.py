"""What an Engine is built with (`EngineOptions`, picklable: it crosses into the ranged
worker) and where the output head runs (`resolve_head`). Split from
`mtplib.runtime.speculative`, which still exports both.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

from mtplib.contract.types import (
    DEFAULT_DRAFT,
    ContractError,
    DraftRule,
    DraftSpec,
    checked_draft,
)
from mtplib.runtime.engine import CHECKPOINTS
from mtplib.runtime.model import RuntimeInputError
from mtplib.runtime.sampling import Sampler
from mtplib.runtime.settings import DecodeSettings

#: where the output head runs; "auto" is resolved by the entry point (`resolve_head`)
HEADS = ("auto", "upstream", "client")


@dataclass(frozen=True)
class EngineOptions:
    """Everything an Engine is built with, besides the models (picklable: it crosses into
    the ranged worker process; frozen: a run's request holds its default options, and a
    generation's own are a `dataclasses.replace` of them)."""

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
    #: DSpark only (llama.cpp's --spec-draft-p-min): a draft stops at the first block slot
    #: whose confidence is below it; 0 leaves the confidence head unused (upstream's default)
    p_min: float = 0.0

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

    def under(self, rule: DraftRule) -> EngineOptions:
        """These options as a run's backend runs them: k held to the run's `DraftRule`
        ("no sidecar means k=0", decided once where the request was built and carried)."""
        k = rule(self.k)
        return self if k == self.k else replace(self, k=k)

    def resolved(self, *, ranged: bool) -> EngineOptions:
        """These options with ``head="auto"`` made concrete (`resolve_head`)."""
        return replace(self, head=resolve_head(self.head, ranged=ranged, mtp=self.draft.mtp))

    def __post_init__(self) -> None:
        try:  # a k carried from the run's request is already checked (`DraftLength`)
            object.__setattr__(self, "k", checked_draft(self.k))
        except ContractError as e:
            raise RuntimeInputError(str(e)) from None
        p = self.p_min
        if isinstance(p, bool) or not isinstance(p, int | float) or not 0.0 <= p <= 1.0:
            raise RuntimeInputError(f"p_min (--draft-p-min) must be in [0, 1], got {p!r}")
        if self.head not in HEADS:
            raise RuntimeInputError(f"head must be one of {HEADS}, got {self.head!r}")
        if self.checkpoints not in CHECKPOINTS:
            raise RuntimeInputError(f"checkpoints must be one of {CHECKPOINTS}, got "
                                    f"{self.checkpoints!r}")


def resolve_head(head: str, *, ranged: bool, mtp: bool) -> str:
    """``auto``: the client's head for ranged MTP (the tail then sends hc*n_embd hidden rows,
    which the drafter needs anyway, in the same wait as the logits it replaces: a verify step
    waits as often as a plain one), upstream's everywhere else. A ranged run with costs
    measured at load decides ``auto`` from them before this default applies
    (`mtplib.runtime.placement.choose_head`, through `RangedMTP`)."""
    if head != "auto":
        return head
    return "client" if ranged and mtp else "upstream"
