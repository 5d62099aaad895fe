"""Fail-closed capability negotiation: which recipe a multi-shard session may route.

Why: MTP only pays off if every shard agrees on the contract, the exact model build and the
recipe, and the tail shard actually holds the MTP block. Any doubt routes mtp.off, which is
always correct (just slower), and the reason names the first failing cause.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from mtplib.contract.types import (
    CONTRACT_VERSION,
    MAX_DRAFT,
    MAX_PARSED_DRAFT,
    MTP_OFF,
    MTP_RECIPES,
    RECIPES,
    ContractError,
    recipe_draft_k,
)

__all__ = [
    "ALPHA_POLICY",
    "BETA_POLICY",
    "MAX_DRAFT",
    "MAX_PARSED_DRAFT",
    "MTP_OFF",
    "MTP_RECIPES",
    "RECIPES",
    "Decision",
    "Policy",
    "ShardAdvert",
    "ShardVerdict",
    "Status",
    "negotiate",
    "parse_recipe",
]


class Status(enum.IntEnum):
    """How far a shard vouches for a recipe; ordered so 'short of certified' is a compare."""

    UNSUPPORTED = 0
    DISABLED = 1
    IMPLEMENTED = 2
    CERTIFIED = 3

    @property
    def label(self) -> str:
        return self.name.lower()


def parse_recipe(recipe: str) -> int:
    """Draft length k of a recipe (0 for mtp.off); ContractError for an unknown recipe."""
    return recipe_draft_k(recipe)


@dataclass(frozen=True)
class ShardAdvert:
    """What one shard claims: contract version, model/build pin, sidecar, recipe statuses."""

    shard_index: int
    contract_version: str
    pin: str
    has_mtp_sidecar: bool
    recipes: Mapping[str, Status]


@dataclass(frozen=True)
class Policy:
    """Deployment policy; allow_mtp=False makes every MTP recipe unroutable."""

    name: str
    allow_mtp: bool


ALPHA_POLICY = Policy("alpha", allow_mtp=False)
BETA_POLICY = Policy("beta", allow_mtp=True)


@dataclass(frozen=True)
class ShardVerdict:
    """Per-shard view of the requested recipe; reason is '' when this shard is fine."""

    shard_index: int
    status: Status
    ok: bool
    reason: str


@dataclass(frozen=True)
class Decision:
    recipe_requested: str
    recipe_routed: str
    reason: str
    per_shard: tuple[ShardVerdict, ...]

    @property
    def mtp(self) -> bool:
        return self.recipe_routed != MTP_OFF


_Check = Callable[[str, ShardAdvert, int, str], str]


def _version(recipe: str, a: ShardAdvert, tail: int, pin0: str) -> str:
    if a.contract_version == CONTRACT_VERSION:
        return ""
    return f"contract_version expected {CONTRACT_VERSION!r}, got {a.contract_version!r}"


def _pin(recipe: str, a: ShardAdvert, tail: int, pin0: str) -> str:
    if not isinstance(a.pin, str) or not a.pin:
        return f"pin expected non-empty str, got {a.pin!r}"
    return "" if a.pin == pin0 else f"pin expected {pin0!r} (as shard 0), got {a.pin!r}"


def _sidecar(recipe: str, a: ShardAdvert, tail: int, pin0: str) -> str:
    if a.shard_index != tail or a.has_mtp_sidecar is True:
        return ""
    return "tail shard has no MTP sidecar"


def _advertised(recipe: str, a: ShardAdvert, tail: int, pin0: str) -> str:
    return "" if recipe in a.recipes else f"recipe {recipe!r} not advertised"


def _certified(recipe: str, a: ShardAdvert, tail: int, pin0: str) -> str:
    status = a.recipes.get(recipe)
    if isinstance(status, Status) and status >= Status.CERTIFIED:
        return ""
    label = status.label if isinstance(status, Status) else repr(status)
    return f"recipe {recipe!r} is {label}, need certified"


CHECKS: tuple[_Check, ...] = (_version, _pin, _sidecar, _advertised, _certified)
"""Causes in the order they are reported: the first failing cause names the decision."""


def negotiate(requested: str, adverts: Sequence[ShardAdvert], policy: Policy) -> Decision:
    """Route `requested` only if policy and every shard allow it; otherwise mtp.off."""
    if not policy.allow_mtp:
        return Decision(requested, MTP_OFF, f"{policy.name} policy: MTP disabled", ())
    if requested == MTP_OFF:
        return Decision(requested, MTP_OFF, "mtp.off requested", ())
    try:
        recipe_draft_k(requested)
    except ContractError as exc:
        return Decision(requested, MTP_OFF, f"unknown recipe: {exc}", ())
    if not adverts:
        return Decision(requested, MTP_OFF, "no shard adverts", ())
    indices = sorted(a.shard_index for a in adverts)
    if indices != list(range(len(adverts))):
        reason = f"shard indices: expected 0..{len(adverts) - 1} each once, got {indices}"
        return Decision(requested, MTP_OFF, reason, ())
    ordered = sorted(adverts, key=lambda a: a.shard_index)
    tail, pin0 = ordered[-1].shard_index, ordered[0].pin
    found = [[check(requested, a, tail, pin0) for check in CHECKS] for a in ordered]
    per_shard = tuple(
        ShardVerdict(
            a.shard_index,
            s if isinstance(s := a.recipes.get(requested), Status) else Status.UNSUPPORTED,
            not any(reasons),
            next((r for r in reasons if r), ""),
        )
        for a, reasons in zip(ordered, found, strict=True)
    )
    for c in range(len(CHECKS)):
        for a, reasons in zip(ordered, found, strict=True):
            if reasons[c]:
                reason = f"shard {a.shard_index}: {reasons[c]}"
                return Decision(requested, MTP_OFF, reason, per_shard)
    reason = f"all {len(ordered)} shards certify {requested}"
    return Decision(requested, requested, reason, per_shard)
