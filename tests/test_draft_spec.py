"""One draft spec (k, its bounds, the recipe id, MTP on) and one advert builder: the CLI,
the engines, advertise(), certify, routing and the golden fixtures agree on draft1..8."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mtplib.commands.generate import draft_spec
from mtplib.contract.capabilities import (
    ALPHA_POLICY,
    BETA_POLICY,
    Policy,
    RouteRefused,
    Status,
    build_advert,
    negotiate,
)
from mtplib.contract.types import (
    DEFAULT_DRAFT,
    DRAFT_RANGE,
    DSPARK_RECIPES,
    MAX_DRAFT,
    MTP_OFF,
    MTP_RECIPES,
    RECIPES,
    ContractError,
    DraftSpec,
    draft_problem,
)
from mtplib.runtime.capability import advertise
from mtplib.runtime.engine_options import EngineOptions
from mtplib.runtime.model import RuntimeInputError
from mtplib.runtime.routing import PIN, POLICY_ENV, local_advert, route

GOLDEN = Path(__file__).parent / "golden" / "contract"
STRICT = Policy("strict", allow_mtp=True, min_status=Status.CERTIFIED)


@pytest.fixture(autouse=True)
def _no_policy_env(monkeypatch):
    monkeypatch.delenv(POLICY_ENV, raising=False)


def test_one_range_one_recipe_spelling():
    assert list(DRAFT_RANGE) == list(range(1, MAX_DRAFT + 1)) and MAX_DRAFT == 8
    assert MTP_RECIPES == tuple(f"mtp.v4.draft{k}" for k in DRAFT_RANGE)
    assert RECIPES == (MTP_OFF, *MTP_RECIPES, *DSPARK_RECIPES)
    for r in RECIPES:
        assert DraftSpec.from_recipe(r).recipe == r
    assert DraftSpec(0).recipe == MTP_OFF and not DraftSpec(0).mtp and DraftSpec(5).mtp
    for bad in (-1, 9, True, 2.0):
        assert draft_problem("k", bad)
        with pytest.raises(ContractError, match="must be in 1..8"):
            DraftSpec(bad)
        with pytest.raises(RuntimeInputError, match="must be in 1..8"):
            EngineOptions(k=bad)
    assert DraftSpec.requested(None, mtp=True).k == DEFAULT_DRAFT
    assert DraftSpec.requested(5, mtp=True).k == 5
    assert DraftSpec.requested(5, mtp=False).k == 0
    assert EngineOptions().k == DEFAULT_DRAFT


def test_cli_draft_follows_the_spec():
    from argparse import Namespace

    assert draft_spec(Namespace(mtp="s.gguf", draft=None)) == DraftSpec(DEFAULT_DRAFT)
    assert draft_spec(Namespace(mtp="s.gguf", draft=8)).recipe == "mtp.v4.draft8"
    assert draft_spec(Namespace(mtp=None, draft=None)) == DraftSpec(0)


def test_advertise_and_local_advert_are_one_builder(pair, tmp_path):
    """advertise() and the advert a one-process run routes on list the same recipes, same
    statuses; draft5 (which the engines run) routes against either under beta."""
    for policy in (BETA_POLICY, ALPHA_POLICY):
        cap = advertise(pair.trunk, pair.sidecar, cert_dir=tmp_path, probe=False,
                        policy=policy)
        run = local_advert(has_sidecar=True, policy=policy)
        assert list(cap.advert.recipes) == list(RECIPES) == list(run.recipes)
        assert cap.advert == run
        for k in (*DRAFT_RANGE, 0):
            r = DraftSpec(k).recipe
            want = policy.allow_mtp or k == 0
            assert negotiate(r, [cap.advert], policy).mtp == (want and k > 0)
            if want:
                d = route(k, policy=policy, adverts=[cap.advert])
                assert d.recipe_routed == r
                assert d.reason == route(k, policy=policy).reason
            else:
                with pytest.raises(RouteRefused, match="alpha policy: MTP disabled"):
                    route(k, policy=policy, adverts=[cap.advert])
    none = advertise(pair.trunk, None, cert_dir=tmp_path, probe=False)
    assert {none.advert.recipes[r] for r in MTP_RECIPES} == {Status.UNSUPPORTED}
    bare = local_advert(has_sidecar=False, policy=BETA_POLICY)
    assert {bare.recipes[r] for r in MTP_RECIPES} == {Status.UNSUPPORTED}


def test_every_status_reaches_the_routing_decision():
    """unsupported, disabled, implemented and certified come from the builder and decide."""
    cert = {"mtp.v4.draft2"}
    assert route(2, policy=STRICT, certified=cert).per_shard[0].status == Status.CERTIFIED
    with pytest.raises(RouteRefused, match="'mtp.v4.draft3' is implemented, need certified"):
        route(3, policy=STRICT, certified=cert)
    with pytest.raises(RouteRefused, match="tail shard has no MTP sidecar"):
        route(3, has_sidecar=False)
    off = build_advert(0, pin=PIN, policy=ALPHA_POLICY, has_mtp_sidecar=True).advert
    with pytest.raises(RouteRefused, match="'mtp.v4.draft1' is disabled, need implemented"):
        route(1, policy=BETA_POLICY, adverts=[off])
    broken = build_advert(0, pin="unknown", policy=BETA_POLICY, has_mtp_sidecar=False,
                          build_problem="wrong upstream build").advert
    assert set(broken.recipes.values()) == {Status.UNSUPPORTED}
    with pytest.raises(RouteRefused, match="draft length 9 refused under policy 'beta'"):
        route(9)


def test_alpha_fails_closed_for_every_recipe():
    for k in DRAFT_RANGE:
        with pytest.raises(RouteRefused, match="policy 'alpha'"):
            route(k, policy="alpha")
    advert = local_advert(has_sidecar=True, policy=ALPHA_POLICY)
    assert {advert.recipes[r] for r in MTP_RECIPES} == {Status.DISABLED}
    assert route(0, policy="alpha").recipe_routed == MTP_OFF


def test_golden_matrix_routes_what_the_engines_run():
    rows = json.loads((GOLDEN / "negotiation_matrix.json").read_text())["matrix"]
    by = {(r["adverts"], r["policy"], r["requested"]): r["routed"] for r in rows}
    assert by[("all_certified_2", "beta", "mtp.v4.draft5")] == "mtp.v4.draft5"
    assert by[("all_certified_2", "beta", "mtp.v4.draft9")] == MTP_OFF
    assert by[("all_certified_2", "alpha", "mtp.v4.draft5")] == MTP_OFF
    version = json.loads((GOLDEN / "contract_version.json").read_text())
    assert version["contract_version"] == "mtp-contract/3"
    assert version["recipes"] == list(RECIPES) and version["max_draft"] == MAX_DRAFT


def test_a_certification_record_reaches_the_runtimes_routing(pair, tmp_path, monkeypatch):
    """MTPRuntime routes on the advert the one builder makes, certification included: a
    passing record for this pair's hash makes its recipe certified (found in the cwd's
    certifications/, as advertise() looks), so a certified-only policy routes it."""
    from mtplib.runtime.capability import model_key
    from mtplib.runtime.speculative import MTPRuntime

    monkeypatch.chdir(tmp_path)
    key = model_key(pair.trunk, pair.sidecar)
    (tmp_path / "certifications").mkdir()
    (tmp_path / "certifications" / f"{key}.json").write_text(json.dumps(
        {"model_key": key, "pin": PIN, "recipes": {"mtp.v4.draft2": {"passed": True}}}))
    kw = dict(n_ctx=256, n_threads=1, policy=STRICT)
    with MTPRuntime(str(pair.trunk), str(pair.sidecar), k=2, **kw) as rt:
        assert rt.routing["reason"] == "all 1 shards certify mtp.v4.draft2"
    with pytest.raises(RouteRefused, match="'mtp.v4.draft3' is implemented, need certified"):
        MTPRuntime(str(pair.trunk), str(pair.sidecar), k=3, **kw)
