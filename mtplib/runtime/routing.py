"""Which recipe a run may use: the policy and the adverts of the run's shards, through
`negotiate()`.

Why: the contract's negotiation is the one place that decides whether MTP routes. Every
path that runs MTP (MTPRuntime, ranged MTP, the CLI, the bench, lanes) asks it here before
it loads or runs anything MTP, so a policy that disables MTP (alpha) is refused the same
way everywhere, with a message naming the policy. Plain decoding (mtp.off) always routes.

The adverts are built by the contract's one builder (`build_advert`, as `advertise()`
builds them) from what this process checked about the shards it is about to use: every
shard runs every recipe of the contract (mtp.v4.draft1..8) once the pair check passed; the
tail's MTP recipes are unsupported without the sidecar; DISABLED where the policy disables
MTP; certified where the caller looked up a passing certification run (`certified`:
`certified_recipes`, which MTPRuntime and RangedMTP do). The per-shard verdicts carry
those statuses. Beta, the default, asks for `implemented`, so a run without certification
records routes too.
"""

from __future__ import annotations

import json
import os
from collections.abc import Collection, Iterable, Sequence
from pathlib import Path

from mtplib import pins
from mtplib.contract.capabilities import (
    Decision,
    Policy,
    RouteRefused,
    ShardAdvert,
    build_advert,
    policy_named,
    require_route,
)
from mtplib.contract.types import MTP_OFF, ContractError, DraftSpec
from mtplib.stamps import sha256_file

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


def model_key(trunk: str | Path, sidecar: str | Path | None) -> str:
    """Identity of a model pair for certification records: both files' sha256."""
    t = sha256_file(Path(trunk))
    s = sha256_file(Path(sidecar)) if sidecar else "none"
    return f"{t[:16]}-{s[:16]}"


def _load_cert(cert_dir: Path, key: str) -> dict:
    p = cert_dir / f"{key}.json"
    if not p.exists():
        return {}
    try:
        rec = json.loads(p.read_text())
    except (OSError, json.JSONDecodeError):
        return {}
    if rec.get("pin") != PIN or rec.get("model_key") != key:
        return {}
    return {r: v for r, v in rec.get("recipes", {}).items() if v.get("passed") is True}


def certified_recipes(trunk: str | Path, sidecar: str | Path | None,
                      cert_dir: str | Path = "certifications") -> frozenset[str]:
    """Recipes with a passing certification record for this exact pair on this build. The
    files are hashed only where ``cert_dir`` holds records at all (a whole V4 GGUF takes
    minutes to hash), so a run without certifications pays nothing."""
    d = Path(cert_dir)
    if not d.is_dir() or not any(d.glob("*.json")):
        return frozenset()
    return frozenset(_load_cert(d, model_key(trunk, sidecar)))


def recipe_for(k: int) -> str:
    """The recipe a draft length asks for: mtp.off for k = 0 (`DraftSpec.recipe`)."""
    return DraftSpec(k).recipe


def run_adverts(n_shards: int, *, tail_has_sidecar: bool, policy: Policy,
                certified: Collection[str] = ()) -> list[ShardAdvert]:
    """Adverts of the n shards of a run whose pair check passed (`build_advert`): every
    recipe of the contract implemented (certified where ``certified`` says), DISABLED where
    the policy disables MTP; only the tail holds the sidecar, and without it the tail's MTP
    recipes are unsupported."""
    tail = n_shards - 1
    return [build_advert(i, pin=PIN, policy=policy,
                         has_mtp_sidecar=tail_has_sidecar and i == tail,
                         mtp_problem="" if tail_has_sidecar or i != tail else "no MTP sidecar",
                         certified=certified).advert
            for i in range(n_shards)]


def route(k: int | DraftSpec, *, policy: Policy | str | None = None, n_shards: int = 1,
          has_sidecar: bool = True, certified: Collection[str] = (),
          adverts: Sequence[ShardAdvert] | None = None) -> Decision:
    """The decision for a run drafting k tokens per step (k = 0: plain decoding), negotiated
    against ``adverts`` (default: `run_adverts` of this run); raises RouteRefused, naming
    the policy, unless the requested recipe is routed."""
    pol = resolve_policy(policy)
    try:
        spec = k if isinstance(k, DraftSpec) else DraftSpec(k)
    except ContractError as e:  # no recipe of the contract: refused like an unknown one
        raise RouteRefused(f"draft length {k!r} refused under policy {pol.name!r}: unknown "
                           f"recipe: {e} (plain decoding, {MTP_OFF}, is always allowed)"
                           ) from None
    if adverts is None:
        adverts = run_adverts(n_shards, tail_has_sidecar=has_sidecar, policy=pol,
                              certified=certified)
    return require_route(spec.recipe, adverts, pol)


def policy_gate(k: int | DraftSpec, policy: Policy | str | None = None) -> Policy:
    """The policy alone, before anything loads or starts: RouteRefused (the message `route`
    gives) for MTP under a policy that disables it (alpha). Not a routing decision: a
    ranged run negotiates once its shards are up, with their real adverts. Returns the
    resolved policy."""
    pol = resolve_policy(policy)
    spec = k if isinstance(k, DraftSpec) else DraftSpec(k)
    if spec.mtp and not pol.allow_mtp:
        require_route(spec.recipe, (), pol)  # raises, naming the policy
    return pol


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
