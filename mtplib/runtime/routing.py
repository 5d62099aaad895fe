"""Which recipe a run may use: the policy and this process's shard adverts, through
`negotiate()`.

Why: the contract's negotiation is the one place that decides whether MTP routes. Every
path that runs MTP (MTPRuntime, ranged MTP, the CLI, the bench, lanes) asks it here before
it loads or runs anything MTP, so a policy that disables MTP (alpha) is refused the same
way everywhere, with a message naming the policy. Plain decoding (mtp.off) always routes.

The adverts are those of the shards this run is about to use, as far as this process has
checked them (the pair check): every shard implements the recipe, the tail holds the MTP
sidecar. They are not looked up in certification records (that hashes whole GGUFs; see
`mtplib.runtime.capability.advertise`), which is why beta, the default, asks for
`implemented` and not `certified`.
"""

from __future__ import annotations

import os
from collections.abc import Iterable

from mtplib import pins
from mtplib.contract.capabilities import (
    Decision,
    Policy,
    RouteRefused,
    ShardAdvert,
    Status,
    policy_named,
    policy_statuses,
    require_route,
)
from mtplib.contract.types import CONTRACT_VERSION, MAX_PARSED_DRAFT, MTP_OFF

PIN = f"llama-cpp-python=={pins.LLAMA_CPP_PYTHON_VERSION}@{pins.LLAMA_CPP_COMMIT_SHORT}"
"""The build every shard of a run shares (the adverts' pin)."""

POLICY_ENV = "MTPLIB_POLICY"
"""Names the policy when a caller gives none (a lane sets it for its notebooks)."""

DEFAULT_POLICY = "beta"


def resolve_policy(policy: Policy | str | None = None) -> Policy:
    """A Policy from a Policy, a name, or None ($MTPLIB_POLICY, else beta); ContractError
    (an InputError) for an unknown name."""
    if policy is None:
        policy = os.environ.get(POLICY_ENV) or DEFAULT_POLICY
    return policy_named(policy)


def recipe_for(k: int) -> str:
    """The recipe a draft length asks for: mtp.off for k = 0."""
    return MTP_OFF if k == 0 else f"mtp.v4.draft{k}"


def run_adverts(n_shards: int, *, tail_has_sidecar: bool, policy: Policy
                ) -> list[ShardAdvert]:
    """Adverts of the n shards of a run whose pair check passed: mtp.off and every draft
    length the engine runs (1..MAX_PARSED_DRAFT) implemented, DISABLED where the policy
    disables MTP; only the tail holds the sidecar."""
    recipes = {recipe_for(k): Status.IMPLEMENTED for k in range(MAX_PARSED_DRAFT + 1)}
    recipes = policy_statuses(recipes, policy)
    return [ShardAdvert(i, CONTRACT_VERSION, PIN, tail_has_sidecar and i == n_shards - 1,
                        dict(recipes)) for i in range(n_shards)]


def route(k: int, *, policy: Policy | str | None = None, n_shards: int = 1,
          has_sidecar: bool = True) -> Decision:
    """The decision for a run drafting k tokens per step (k = 0: plain decoding); raises
    RouteRefused, naming the policy, unless the requested recipe is routed."""
    pol = resolve_policy(policy)
    adverts = run_adverts(n_shards, tail_has_sidecar=has_sidecar, policy=pol)
    return require_route(recipe_for(k), adverts, pol)


def require_mtp(what: str, ks: Iterable[int] = (1,), *, policy: Policy | str | None = None,
                n_shards: int = 1, has_sidecar: bool = True) -> Policy:
    """The gate of a path that runs MTP outside MTPRuntime and RangedMTP (its own MTP
    context, upstream's C++ loop, a graph check): `route` every draft length it will run,
    before it loads or starts anything. Returns the resolved policy, for the path to hand
    on to the runtimes it builds; RouteRefused (an InputError) names ``what`` and the
    policy. ``ks`` of 1 means "the MTP block runs" (one MTP step is drafting one token)."""
    pol = resolve_policy(policy)
    for k in ks:
        try:
            route(int(k), policy=pol, n_shards=n_shards, has_sidecar=has_sidecar)
        except RouteRefused as e:
            raise RouteRefused(f"{what}: {e}") from None
    return pol


def routing_metrics(decision: Decision, policy: Policy) -> dict:
    """What a run's metrics record about the decision."""
    return {"policy": policy.name, "recipe": decision.recipe_routed,
            "reason": decision.reason}
