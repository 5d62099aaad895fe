"""Which recipe a run may use: the policy and the adverts of the run's shards, through
`negotiate()`.

Why: the contract's negotiation is the one place that decides whether MTP routes. Every
path that runs MTP (MTPRuntime, ranged MTP, the CLI, the bench, lanes) asks it here before
it loads or runs anything MTP, so a policy that disables MTP (alpha) is refused the same
way everywhere, with a message naming the policy. Plain decoding (mtp.off) always routes.

Where the adverts come from: a ranged run's come from its shards, each built from what
that shard reported about itself at probe time (its contract version, llama-cpp-python /
llama.cpp pin, build and patch set: `mtplib.distributed.shard_report`), and are
negotiated against this process's own pin (`route(..., adverts=..., pin=PIN)`), so a
shard running another contract or pin refuses MTP. A run in one process (MTPRuntime, the
graph checks) is its own only shard: `local_advert` is what this process checked (the
pair, the sidecar, the policy, certification records: `certified_recipes`). Both are built
by the contract's one builder (`build_advert`, as `advertise()` builds them). Beta, the
default, asks for `implemented`, so a run without certification records routes too.
"""

from __future__ import annotations

import json
from collections.abc import Collection, Iterable, Sequence
from pathlib import Path

from mtplib import envs, pins
from mtplib.contract.capabilities import (
    Decision,
    Policy,
    RouteRefused,
    ShardAdvert,
    build_advert,
    policy_named,
    require_route,
)
from mtplib.contract.types import (
    DSPARK_DRAFTER,
    MTP_DRAFTER,
    MTP_OFF,
    ContractError,
    DraftLength,
    DraftSpec,
)
from mtplib.stamps import sha256_file

PIN = f"llama-cpp-python=={pins.LLAMA_CPP_PYTHON_VERSION}@{pins.LLAMA_CPP_COMMIT_SHORT}"
"""The build every shard of a run shares (the adverts' pin)."""

POLICY_ENV = envs.POLICY
"""Names the policy when a caller gives none (a lane sets it for its notebooks)."""

DEFAULT_POLICY = "beta"


def resolve_policy(policy: Policy | str | None = None) -> Policy:
    """A Policy from a Policy, a name, or None ($MTPLIB_POLICY, else beta); ContractError
    (an InputError) for an unknown name."""
    if policy is None:
        policy = envs.policy() or DEFAULT_POLICY
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


def local_advert(*, has_sidecar: bool, policy: Policy, certified: Collection[str] = (),
                 drafter: str = MTP_DRAFTER, dspark_block: int = 0) -> ShardAdvert:
    """The advert of a run in this one process (its own only shard, on this process's
    pin), whose pair check passed (`build_advert`): every recipe of the contract
    implemented (certified where ``certified`` says), DISABLED where the policy disables
    MTP, the MTP recipes unsupported without the sidecar. With ``drafter`` "dspark" the
    sidecar is a DSpark draft of block size ``dspark_block``: its recipes up to that size
    are the implemented ones, MTP's unsupported. Never a ranged run's: its shards report
    their own (`mtplib.distributed.shard_report.shard_adverts`)."""
    if drafter == DSPARK_DRAFTER and has_sidecar:
        return build_advert(0, pin=PIN, policy=policy, has_mtp_sidecar=False,
                            mtp_problem="no MTP sidecar (the draft is a DSpark draft)",
                            certified=certified, has_dspark_draft=True,
                            dspark_block=dspark_block).advert
    return build_advert(0, pin=PIN, policy=policy, has_mtp_sidecar=has_sidecar,
                        mtp_problem="" if has_sidecar else "no MTP sidecar",
                        certified=certified).advert


def route(k: int | DraftSpec, *, policy: Policy | str | None = None,
          has_sidecar: bool = True, certified: Collection[str] = (),
          adverts: Sequence[ShardAdvert] | None = None, pin: str | None = None,
          drafter: str = MTP_DRAFTER, dspark_block: int = 0) -> Decision:
    """The decision for a run drafting k tokens per step (k = 0: plain decoding) with
    ``drafter`` (a `DraftSpec` names its own), negotiated against ``adverts`` (default:
    this process's `local_advert`, for a DSpark draft of block size ``dspark_block``) and
    ``pin`` (the build every advert must name; a ranged run gives `PIN`); raises
    RouteRefused, naming the policy, unless the requested recipe is routed."""
    pol = resolve_policy(policy)
    try:
        spec = k if isinstance(k, DraftSpec) else DraftSpec(k, drafter)
    except ContractError as e:  # no recipe of the contract: refused like an unknown one
        raise RouteRefused(f"draft length {k!r} refused under policy {pol.name!r}: unknown "
                           f"recipe: {e} (plain decoding, {MTP_OFF}, is always allowed)"
                           ) from None
    if adverts is None:
        adverts = [local_advert(has_sidecar=has_sidecar, policy=pol, certified=certified,
                                drafter=spec.drafter, dspark_block=dspark_block)]
    return require_route(spec.recipe, adverts, pol, pin=pin)


def policy_gate(k: int | DraftSpec, policy: Policy | str | None = None) -> Policy:
    """The policy alone, before anything loads or starts: RouteRefused (the message `route`
    gives) for MTP under a policy that disables it (alpha). Not a routing decision: a
    ranged run negotiates once its shards are up, with their real adverts. Returns the
    resolved policy: the verdict a run keeps (`mtplib.runtime.request.build_request` asks
    this once per run; a later generation applies it with `check_policy`)."""
    pol = resolve_policy(policy)
    check_policy(k if isinstance(k, DraftSpec) else DraftSpec(k), pol)
    return pol


def check_policy(spec: DraftSpec, policy: Policy) -> None:
    """A generation's drafting under the policy its run resolved (`policy_gate`, once):
    RouteRefused, with policy_gate's message, for MTP under a policy that disables it;
    nothing resolved or asked again."""
    if spec.mtp and not policy.allow_mtp:
        require_route(spec.recipe, (), policy)  # raises, naming the policy


def require_mtp(what: str, ks: Iterable[int] = (1,), *, policy: Policy | str | None = None,
                has_sidecar: bool = True, drafter: str = MTP_DRAFTER,
                dspark_block: int = 0) -> Policy:
    """The gate of a path that runs MTP outside MTPRuntime and RangedMTP (its own MTP
    context, upstream's C++ loop, a graph check): `route` every draft length it will run,
    before it loads or starts anything. Returns the resolved policy, for the path to hand
    on to the runtimes it builds; RouteRefused (an InputError) names ``what`` and the
    policy. ``ks`` of 1 means "the MTP block runs" (one MTP step is drafting one token);
    ``drafter`` "dspark": a DSpark draft of block size ``dspark_block`` runs instead."""
    pol = resolve_policy(policy)
    for k in ks:
        try:
            route(k if isinstance(k, DraftLength) else int(k), policy=pol,
                  has_sidecar=has_sidecar, drafter=drafter, dspark_block=dspark_block)
        except RouteRefused as e:
            raise RouteRefused(f"{what}: {e}") from None
    return pol


def routing_metrics(decision: Decision, policy: Policy) -> dict:
    """What a run's metrics record about the decision."""
    return {"policy": policy.name, "recipe": decision.recipe_routed,
            "reason": decision.reason}
