"""Fail-closed negotiation: alpha never routes MTP; beta routes only fully certified shards."""

from __future__ import annotations

import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mtplib.contract import (
    ALPHA_POLICY,
    BETA_POLICY,
    CONTRACT_VERSION,
    MTP_RECIPES,
    Policy,
    ShardAdvert,
    Status,
    negotiate,
    parse_recipe,
)

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
            [adv(0), adv(1, contract_version="mtp-contract/2")],
            "^shard 1: contract_version expected 'mtp-contract/1', got 'mtp-contract/2'",
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
        ("mtp.v4.draft5", GOOD, "^shard 0: recipe 'mtp.v4.draft5' not advertised"),
    ],
)
def test_fail_closed_causes(requested, adverts, reason):
    d = negotiate(requested, adverts, BETA_POLICY)
    assert d.recipe_routed == "mtp.off"
    assert re.search(reason, d.reason), d.reason


def test_first_cause_wins_across_shards():
    # shard 0 lacks the recipe, shard 1 has the wrong version: version is reported first.
    d = negotiate("mtp.v4.draft1", [adv(0, recipes={}), adv(1, contract_version="z")], BETA_POLICY)
    assert d.reason.startswith("shard 1: contract_version")
    assert [v.ok for v in d.per_shard] == [False, False]


def test_non_tail_sidecar_not_required():
    d = negotiate("mtp.v4.draft1", [adv(0, has_mtp_sidecar=False), adv(1)], BETA_POLICY)
    assert d.recipe_routed == "mtp.v4.draft1"


statuses = st.sampled_from(list(Status))
versions = st.sampled_from([CONTRACT_VERSION, "mtp-contract/0", "mtp-contract/2"])
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


@given(requested=requests, adverts=advert_lists(), name=st.text(max_size=5))
@settings(max_examples=200, deadline=None)
def test_alpha_never_routes_property(requested, adverts, name):
    assert negotiate(requested, adverts, ALPHA_POLICY).recipe_routed == "mtp.off"
    assert negotiate(requested, adverts, Policy(name, allow_mtp=False)).recipe_routed == "mtp.off"


@given(requested=st.sampled_from(MTP_RECIPES), adverts=advert_lists())
@settings(max_examples=200, deadline=None)
def test_beta_routes_iff_all_certified_property(requested, adverts):
    expect = (
        all(a.contract_version == CONTRACT_VERSION for a in adverts)
        and len({a.pin for a in adverts}) == 1
        and adverts[-1].has_mtp_sidecar
        and all(a.recipes.get(requested) == Status.CERTIFIED for a in adverts)
    )
    d = negotiate(requested, adverts, BETA_POLICY)
    assert d.recipe_routed == (requested if expect else "mtp.off"), d.reason
    assert d.mtp == expect
