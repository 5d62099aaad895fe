"""Fail-closed capability negotiation: which recipe a multi-shard session may route.

Why: MTP only pays off if every shard agrees on the contract, the exact model build and the
recipe, and the tail shard actually holds the MTP block. Any doubt routes mtp.off, which is
always correct (just slower), and the reason names the first failing cause. DSpark recipes
(dspark.v4.draft<k>) negotiate by the same checks: the tail must hold a DSpark draft whose
block size covers k, and a policy that disables MTP disables them too.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType

from mtplib.contract.types import (
    CONTRACT_VERSION,
    DRAFTER_LABELS,
    DSPARK_DRAFTER,
    DSPARK_RECIPES,
    MAX_DRAFT,
    MIN_DRAFT,
    MTP_DRAFTER,
    MTP_OFF,
    MTP_RECIPES,
    RECIPES,
    ContractError,
    check_str,
    fail,
    recipe_draft_k,
    recipe_drafter,
)

__all__ = [
    "ALPHA_POLICY",
    "BETA_POLICY",
    "Capability",
    "DSPARK_RECIPES",
    "POLICIES",
    "MAX_DRAFT",
    "MIN_DRAFT",
    "MTP_OFF",
    "MTP_RECIPES",
    "RECIPES",
    "Decision",
    "Policy",
    "RouteRefused",
    "ShardAdvert",
    "ShardVerdict",
    "Status",
    "build_advert",
    "negotiate",
    "parse_recipe",
    "policy_named",
    "policy_statuses",
    "require_route",
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
    """What one shard claims: contract version, model/build pin, drafters held (the MTP
    sidecar, a DSpark draft), recipe statuses."""

    shard_index: int
    contract_version: str
    pin: str
    has_mtp_sidecar: bool
    recipes: Mapping[str, Status]
    has_dspark_draft: bool = False


@dataclass(frozen=True)
class Policy:
    """Deployment policy: whether drafting may route at all (``allow_mtp``: MTP and
    DSpark alike; the name predates DSpark), and the least status every shard must
    advertise for a recipe before it does.

    Fields are checked at construction (a truthy string is not a bool: `allow_mtp='false'`
    is refused, not read as "allow"), so a policy that exists is one negotiate can trust.
    The name 'alpha' is reserved for the policy that disables MTP.
    """

    name: str
    allow_mtp: bool
    min_status: Status = Status.CERTIFIED

    def __post_init__(self) -> None:
        check_str("policy.name", self.name)
        if not isinstance(self.allow_mtp, bool):
            raise fail("policy.allow_mtp", "a bool", self.allow_mtp)
        if not isinstance(self.min_status, Status) or self.min_status < Status.IMPLEMENTED:
            raise fail("policy.min_status", "Status.IMPLEMENTED or Status.CERTIFIED",
                       self.min_status)
        if self.name == "alpha" and self.allow_mtp:
            raise fail("policy.allow_mtp", "False for 'alpha' (alpha disables MTP)",
                       self.allow_mtp)


ALPHA_POLICY = Policy("alpha", allow_mtp=False)
BETA_POLICY = Policy("beta", allow_mtp=True, min_status=Status.IMPLEMENTED)
"""Beta routes a recipe every shard implements; a stricter policy (min_status CERTIFIED,
the default of `Policy`) also wants a passing certification run on each shard."""

POLICIES: Mapping[str, Policy] = MappingProxyType({p.name: p for p in (ALPHA_POLICY,
                                                                       BETA_POLICY)})
"""The named policies a user picks from (`--policy`, a lane's `policy:`)."""


def policy_named(name: object) -> Policy:
    """The named policy; ContractError for any other name (or a non-string)."""
    if isinstance(name, Policy):
        return name
    if not isinstance(name, str) or name not in POLICIES:
        raise fail("policy", f"one of {', '.join(POLICIES)}", name)
    return POLICIES[name]


def policy_statuses(recipes: Mapping[str, Status], policy: Policy) -> dict[str, Status]:
    """Recipe statuses as advertised under `policy`: an MTP or DSpark recipe the policy
    disables is DISABLED where it would otherwise run (an unsupported one stays
    UNSUPPORTED: that says more); mtp.off is never disabled."""
    out = dict(recipes)
    if not policy.allow_mtp:
        for r, s in out.items():
            if r != MTP_OFF and s >= Status.DISABLED:
                out[r] = Status.DISABLED
    return out


NOT_CERTIFIED = "implemented; no passing certification run for this model hash"
NO_DSPARK = "no DSpark draft"


def drafter_label(recipe: object) -> str:
    """"MTP" or "DSpark": the drafter a recipe names, as messages spell it (by its first
    word, so an out-of-range dspark.v4.draft9 reads DSpark too; MTP for mtp.off and for
    names of no drafter)."""
    head = recipe.split(".", 1)[0] if isinstance(recipe, str) else ""
    return DRAFTER_LABELS[DSPARK_DRAFTER if head == DSPARK_DRAFTER else MTP_DRAFTER]


def disabled_reason(policy: Policy, recipe: object) -> str:
    """Why ``policy`` disables ``recipe``: one spelling for adverts and decisions."""
    return f"{policy.name} policy: {drafter_label(recipe)} disabled"


@dataclass(frozen=True)
class Capability:
    """One shard's advert and, per recipe short of certified, why."""

    advert: ShardAdvert
    reasons: dict[str, str]  # recipe -> why it is not certified

    def to_dict(self) -> dict:
        return {"contract_version": self.advert.contract_version, "pin": self.advert.pin,
                "has_mtp_sidecar": self.advert.has_mtp_sidecar,
                "has_dspark_draft": self.advert.has_dspark_draft,
                "recipes": {r: s.label for r, s in self.advert.recipes.items()},
                "reasons": self.reasons}


def _dspark_problem(k: int, block: int, problem: str) -> str:
    if problem:
        return problem
    if block < 1:
        return NO_DSPARK
    if k > block:  # upstream skips the Markov head past it (dflash.cpp:324-327)
        return (f"the DSpark draft's block size is {block}: a {k}-token block would skip "
                "its Markov head")
    return ""


def build_advert(shard_index: int, *, pin: str, policy: Policy, has_mtp_sidecar: bool,
                 mtp_problem: str = "", build_problem: str = "",
                 certified: Collection[str] = (),
                 contract_version: str = CONTRACT_VERSION, has_dspark_draft: bool = False,
                 dspark_block: int = 0, dspark_problem: str = "") -> Capability:
    """The one advert builder: every recipe of the contract (mtp.off, mtp.v4.draft1..8,
    dspark.v4.draft1..8) with its status and reason, from what the shard found out.

    ``build_problem``: the shard cannot run anything (wrong upstream build): every recipe
    unsupported. ``mtp_problem``: why the MTP recipes do not run here (no sidecar, a pair
    that does not belong together, a context upstream refused): unsupported. Otherwise a
    recipe is implemented, certified if in ``certified`` (a passing certification run for
    this exact pair), and DISABLED where ``policy`` disables MTP. DSpark recipes are
    unsupported (fail closed) unless the run's DSpark draft has a block size
    ``dspark_block`` >= k and ``dspark_problem`` is empty; ``has_dspark_draft``: this
    shard holds it (the tail's advert: the draft sits next to the sampler, as
    ``has_mtp_sidecar`` says of the MTP block). `advertise()` and the
    adverts every run routes on (`mtplib.runtime.routing`, and from the shards' own
    reports `mtplib.distributed.shard_report`) are built here, so all offer the same
    recipes with the same statuses. ``contract_version``: the one the shard reported
    (default: this process's)."""
    status: dict[str, Status] = {}
    reasons: dict[str, str] = {}
    for r in RECIPES:
        if build_problem or r == MTP_OFF:
            problem = build_problem
        elif recipe_drafter(r) == DSPARK_DRAFTER:
            problem = _dspark_problem(recipe_draft_k(r), dspark_block, dspark_problem)
        else:
            problem = mtp_problem
        if problem:
            status[r], reasons[r] = Status.UNSUPPORTED, problem
        elif r in certified:
            status[r] = Status.CERTIFIED
        else:
            status[r], reasons[r] = Status.IMPLEMENTED, NOT_CERTIFIED
    status = policy_statuses(status, policy)
    for r, st in status.items():
        if st == Status.DISABLED:
            reasons[r] = disabled_reason(policy, r)
    advert = ShardAdvert(shard_index, contract_version, pin, has_mtp_sidecar, status,
                         has_dspark_draft=has_dspark_draft)
    return Capability(advert, reasons)


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
        """A drafter routes (MTP or DSpark): anything but mtp.off."""
        return self.recipe_routed != MTP_OFF

    @property
    def drafter(self) -> str | None:
        """The routed recipe's drafter ("mtp", "dspark"), None for mtp.off."""
        return recipe_drafter(self.recipe_routed)


class RouteRefused(ContractError):
    """A run asked for a recipe that negotiation does not route; the message names the
    policy and the first failing cause."""


@dataclass(frozen=True)
class _PinRef:
    """The pin every shard must advertise, and whose it is (shard 0's, or the client's)."""

    pin: str
    source: str


_Check = Callable[[str, ShardAdvert, int, _PinRef, Policy], str]


def _version(recipe: str, a: ShardAdvert, tail: int, ref: _PinRef, policy: Policy) -> str:
    if a.contract_version == CONTRACT_VERSION:
        return ""
    return f"contract_version expected {CONTRACT_VERSION!r}, got {a.contract_version!r}"


def _pin(recipe: str, a: ShardAdvert, tail: int, ref: _PinRef, policy: Policy) -> str:
    if not isinstance(a.pin, str) or not a.pin:
        return f"pin expected non-empty str, got {a.pin!r}"
    return "" if a.pin == ref.pin else f"pin expected {ref.pin!r} ({ref.source}), got {a.pin!r}"


def _sidecar(recipe: str, a: ShardAdvert, tail: int, ref: _PinRef, policy: Policy) -> str:
    if a.shard_index != tail:
        return ""
    if recipe_drafter(recipe) == DSPARK_DRAFTER:
        return "" if a.has_dspark_draft is True else "tail shard has no DSpark draft"
    return "" if a.has_mtp_sidecar is True else "tail shard has no MTP sidecar"


def _advertised(recipe: str, a: ShardAdvert, tail: int, ref: _PinRef, policy: Policy) -> str:
    return "" if recipe in a.recipes else f"recipe {recipe!r} not advertised"


def _status(recipe: str, a: ShardAdvert, tail: int, ref: _PinRef, policy: Policy) -> str:
    status = a.recipes.get(recipe)
    if isinstance(status, Status) and status >= policy.min_status:
        return ""
    label = status.label if isinstance(status, Status) else repr(status)
    return f"recipe {recipe!r} is {label}, need {policy.min_status.label}"


CHECKS: tuple[_Check, ...] = (_version, _pin, _sidecar, _advertised, _status)
"""Causes in the order they are reported: the first failing cause names the decision."""


def negotiate(requested: str, adverts: Sequence[ShardAdvert], policy: Policy, *,
              pin: str | None = None) -> Decision:
    """Route `requested` only if policy and every shard allow it; otherwise mtp.off.

    ``pin``: the build every shard must advertise (a ranged client gives its own, so a
    shard that reports another build is refused even when all shards agree); None: shard
    0's pin is the reference."""
    if not isinstance(policy, Policy):
        raise fail("policy", "a Policy", policy)
    if not policy.allow_mtp:
        return Decision(requested, MTP_OFF, disabled_reason(policy, requested), ())
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
    tail = ordered[-1].shard_index
    ref = _PinRef(ordered[0].pin, "as shard 0") if pin is None else _PinRef(pin, "as the client")
    found = [[check(requested, a, tail, ref, policy) for check in CHECKS] for a in ordered]
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
    verb = "certify" if policy.min_status >= Status.CERTIFIED else "implement"
    reason = f"all {len(ordered)} shards {verb} {requested}"
    return Decision(requested, requested, reason, per_shard)


def require_route(requested: str, adverts: Sequence[ShardAdvert], policy: Policy, *,
                  pin: str | None = None) -> Decision:
    """`negotiate`, for a run that must get what it asked for: RouteRefused (naming the
    policy and the cause) unless `requested` is routed. mtp.off always is."""
    d = negotiate(requested, adverts, policy, pin=pin)
    if d.recipe_routed != requested:
        raise RouteRefused(f"{requested} refused under policy {policy.name!r}: {d.reason} "
                           f"(plain decoding, {MTP_OFF}, is always allowed)")
    return d
