"""Fail-closed negotiation: alpha never routes MTP; beta routes a recipe every shard
implements; a certified-only policy also wants every shard's certification; policies are
typed and checked at construction."""

from __future__ import annotations

import contextlib
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mtplib.contract import (
    ALPHA_POLICY,
    BETA_POLICY,
    CONTRACT_VERSION,
    MTP_RECIPES,
    POLICIES,
    ContractError,
    Policy,
    RouteRefused,
    ShardAdvert,
    Status,
    negotiate,
    parse_recipe,
    policy_named,
    policy_statuses,
    require_route,
)
from mtplib.errors import InputError

PIN = "v4flash@abc"
ALL_CERT = {r: Status.CERTIFIED for r in MTP_RECIPES}


def adv(i, **kw) -> ShardAdvert:
    base = dict(
        shard_index=i,
        contract_version=CONTRACT_VERSION,
        pin=PIN,
        has_mtp_sidecar=True,
        recipes=dict(ALL_CERT),
    )
    base.update(kw)
    return ShardAdvert(**base)


GOOD = [adv(0), adv(1), adv(2)]
STRICT = Policy("strict", allow_mtp=True, min_status=Status.CERTIFIED)


def test_status_is_ordered():
    assert Status.UNSUPPORTED < Status.DISABLED < Status.IMPLEMENTED < Status.CERTIFIED


def test_parse_recipe():
    assert parse_recipe("mtp.v4.draft2") == 2


def test_beta_routes_certified():
    d = negotiate("mtp.v4.draft2", GOOD, BETA_POLICY)
    assert d.recipe_routed == "mtp.v4.draft2" and d.mtp
    assert [v.ok for v in d.per_shard] == [True, True, True]


def test_alpha_never_routes():
    for req in ("mtp.v4.draft1", "mtp.off", "bogus"):
        d = negotiate(req, GOOD, ALPHA_POLICY)
        assert (d.recipe_routed, d.reason) == ("mtp.off", "alpha policy: MTP disabled")


def test_mtp_off_always_routable():
    for adverts in ([], GOOD, [adv(0, contract_version="x")]):
        assert negotiate("mtp.off", adverts, BETA_POLICY).recipe_routed == "mtp.off"


@pytest.mark.parametrize(
    "requested, adverts, reason",
    [
        ("mtp.v4.draft9", GOOD, "^unknown recipe: recipe: expected"),
        ("mtp.v4.draft0", GOOD, "^unknown recipe"),
        ("eagle3", GOOD, "^unknown recipe"),
        ("mtp.v4.draft1", [], "^no shard adverts$"),
        ("mtp.v4.draft1", [adv(0), adv(2)], "^shard indices: expected 0..1 each once"),
        ("mtp.v4.draft1", [adv(0), adv(0)], "^shard indices"),
        (
            "mtp.v4.draft1",
            [adv(0), adv(1, contract_version="mtp-contract/1")],
            "^shard 1: contract_version expected 'mtp-contract/3', got 'mtp-contract/1'",
        ),
        ("mtp.v4.draft1", [adv(0), adv(1, pin="other")], "^shard 1: pin expected 'v4flash@abc'"),
        ("mtp.v4.draft1", [adv(0, pin=""), adv(1, pin="")], "^shard 0: pin expected non-empty"),
        (
            "mtp.v4.draft1",
            [adv(0), adv(1, has_mtp_sidecar=False)],
            "^shard 1: tail shard has no MTP sidecar",
        ),
        (
            "mtp.v4.draft1",
            [adv(0), adv(1, recipes={})],
            "^shard 1: recipe 'mtp.v4.draft1' not advertised",
        ),
        (
            "mtp.v4.draft1",
            [adv(0), adv(1, recipes={"mtp.v4.draft1": Status.IMPLEMENTED})],
            "^shard 1: recipe 'mtp.v4.draft1' is implemented, need certified",
        ),
        (
            "mtp.v4.draft5",
            [adv(0, recipes={r: s for r, s in ALL_CERT.items() if r != "mtp.v4.draft5"})],
            "^shard 0: recipe 'mtp.v4.draft5' not advertised",
        ),
    ],
)
def test_fail_closed_causes(requested, adverts, reason):
    d = negotiate(requested, adverts, STRICT)
    assert d.recipe_routed == "mtp.off"
    assert re.search(reason, d.reason), d.reason
    if "need certified" not in reason:  # every other cause fails beta the same way
        assert negotiate(requested, adverts, BETA_POLICY).reason == d.reason


def test_beta_routes_implemented_not_disabled():
    impl = {r: Status.IMPLEMENTED for r in MTP_RECIPES}
    d = negotiate("mtp.v4.draft1", [adv(0, recipes=impl), adv(1, recipes=impl)], BETA_POLICY)
    assert d.recipe_routed == "mtp.v4.draft1"
    assert not negotiate("mtp.v4.draft1", [adv(0, recipes=impl)], STRICT).mtp
    off = {r: Status.DISABLED for r in MTP_RECIPES}
    d = negotiate("mtp.v4.draft1", [adv(0), adv(1, recipes=off)], BETA_POLICY)
    assert d.reason == "shard 1: recipe 'mtp.v4.draft1' is disabled, need implemented"


def test_first_cause_wins_across_shards():
    # shard 0 lacks the recipe, shard 1 has the wrong version: version is reported first.
    d = negotiate("mtp.v4.draft1", [adv(0, recipes={}), adv(1, contract_version="z")], BETA_POLICY)
    assert d.reason.startswith("shard 1: contract_version")
    assert [v.ok for v in d.per_shard] == [False, False]


def test_non_tail_sidecar_not_required():
    d = negotiate("mtp.v4.draft1", [adv(0, has_mtp_sidecar=False), adv(1)], BETA_POLICY)
    assert d.recipe_routed == "mtp.v4.draft1"


statuses = st.sampled_from(list(Status))
versions = st.sampled_from([CONTRACT_VERSION, "mtp-contract/1", "mtp-contract/2"])
pins = st.sampled_from(["p1", "p2"])


@st.composite
def advert_lists(draw):
    """Half the lists start clean and get each field spoiled with p=0.1, so routing happens."""
    n = draw(st.integers(1, 4))
    clean = draw(st.booleans())

    def pick(good, strategy):
        return good if clean and draw(st.integers(0, 9)) else draw(strategy)

    recipes = st.dictionaries(st.sampled_from(MTP_RECIPES), statuses)
    return [
        ShardAdvert(
            shard_index=i,
            contract_version=pick(CONTRACT_VERSION, versions),
            pin=pick("p1", pins),
            has_mtp_sidecar=pick(True, st.booleans()),
            recipes=pick(dict(ALL_CERT), recipes),
        )
        for i in range(n)
    ]


requests = st.sampled_from([*MTP_RECIPES, "mtp.v4.draft8", "mtp.off", "x"])


@given(requested=requests, adverts=advert_lists(), name=st.text(min_size=1, max_size=5))
@settings(max_examples=200, deadline=None)
def test_alpha_never_routes_property(requested, adverts, name):
    assert negotiate(requested, adverts, ALPHA_POLICY).recipe_routed == "mtp.off"
    assert negotiate(requested, adverts, Policy(name, allow_mtp=False)).recipe_routed == "mtp.off"
    with pytest.raises(RouteRefused, match="policy 'alpha'") if requested != "mtp.off" \
            else contextlib.nullcontext():
        require_route(requested, adverts, ALPHA_POLICY)


@given(requested=st.sampled_from(MTP_RECIPES), adverts=advert_lists(),
       policy=st.sampled_from([BETA_POLICY, STRICT]))
@settings(max_examples=300, deadline=None)
def test_routes_iff_every_shard_reaches_min_status_property(requested, adverts, policy):
    expect = (
        all(a.contract_version == CONTRACT_VERSION for a in adverts)
        and len({a.pin for a in adverts}) == 1
        and adverts[-1].has_mtp_sidecar
        and all(a.recipes.get(requested, Status.UNSUPPORTED) >= policy.min_status
                for a in adverts)
    )
    d = negotiate(requested, adverts, policy)
    assert d.recipe_routed == (requested if expect else "mtp.off"), d.reason
    assert d.mtp == expect


@pytest.mark.parametrize(
    "args, kw, match",
    [
        (("alpha",), dict(allow_mtp="false"), r"^policy.allow_mtp: expected a bool, got 'false'"),
        (("beta",), dict(allow_mtp="true"), "^policy.allow_mtp: expected a bool"),
        (("beta",), dict(allow_mtp=1), "^policy.allow_mtp: expected a bool, got 1"),
        (("beta",), dict(allow_mtp=None), "^policy.allow_mtp"),
        (("",), dict(allow_mtp=False), "^policy.name: expected non-empty str"),
        ((None,), dict(allow_mtp=False), "^policy.name"),
        (("x",), dict(allow_mtp=True, min_status=Status.DISABLED), "^policy.min_status"),
        (("x",), dict(allow_mtp=True, min_status=3), "^policy.min_status"),
        (("x",), dict(allow_mtp=True, min_status="certified"), "^policy.min_status"),
        (("alpha",), dict(allow_mtp=True), r"^policy.allow_mtp: expected False for 'alpha'"),
    ],
)
def test_policy_fields_are_typed(args, kw, match):
    with pytest.raises(ContractError, match=match) as e:
        Policy(*args, **kw)
    assert isinstance(e.value, InputError)  # the CLI's one-line, exit-2 error


def test_negotiate_refuses_a_non_policy():
    class Fake:
        name, allow_mtp, min_status = "alpha", "false", Status.IMPLEMENTED

    with pytest.raises(ContractError, match="^policy: expected a Policy"):
        negotiate("mtp.v4.draft1", GOOD, Fake())  # type: ignore[arg-type]


def test_named_policies():
    assert dict(POLICIES) == {"alpha": ALPHA_POLICY, "beta": BETA_POLICY}
    assert not ALPHA_POLICY.allow_mtp and BETA_POLICY.allow_mtp
    assert BETA_POLICY.min_status == Status.IMPLEMENTED
    assert policy_named("alpha") is ALPHA_POLICY and policy_named(STRICT) is STRICT
    for bad in ("gamma", "Alpha", "", None, 1):
        with pytest.raises(ContractError, match="^policy: expected one of alpha, beta"):
            policy_named(bad)


def test_policy_statuses_disable_what_would_run():
    recipes = {"mtp.off": Status.IMPLEMENTED, "mtp.v4.draft1": Status.CERTIFIED,
               "mtp.v4.draft2": Status.IMPLEMENTED, "mtp.v4.draft3": Status.UNSUPPORTED}
    assert policy_statuses(recipes, BETA_POLICY) == recipes
    assert policy_statuses(recipes, ALPHA_POLICY) == {
        "mtp.off": Status.IMPLEMENTED, "mtp.v4.draft1": Status.DISABLED,
        "mtp.v4.draft2": Status.DISABLED, "mtp.v4.draft3": Status.UNSUPPORTED}


def test_require_route():
    d = require_route("mtp.v4.draft2", GOOD, BETA_POLICY)
    assert d.recipe_routed == "mtp.v4.draft2"
    assert require_route("mtp.off", GOOD, ALPHA_POLICY).recipe_routed == "mtp.off"
    with pytest.raises(RouteRefused, match=r"^mtp.v4.draft2 refused under policy 'alpha': "
                       "alpha policy: MTP disabled"):
        require_route("mtp.v4.draft2", GOOD, ALPHA_POLICY)
    with pytest.raises(RouteRefused, match="policy 'beta': shard 1: tail shard has no MTP"):
        require_route("mtp.v4.draft1", [adv(0), adv(1, has_mtp_sidecar=False)], BETA_POLICY)
