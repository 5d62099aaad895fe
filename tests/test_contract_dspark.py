"""The DSpark contract beside MTP's: recipes, typed values, rollback of both contexts, what
stays shard-local and what crosses per placement, capability adverts (negotiated fail
closed, disabled and unroutable under alpha as MTP's are) and the golden fixture."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mtplib.contract import (
    DSPARK_RECIPES,
    FORBIDDEN_KINDS,
    MTP_RECIPES,
    RECIPES,
    SHARD_LOCAL,
    TINY_DIMS,
    V4_FLASH_DIMS,
    BoundaryMessage,
    CacheKind,
    ContractError,
    DraftProposal,
    DraftSpec,
    DType,
    SeamViolation,
    Session,
    StaleEpochError,
    State,
    VerifyResult,
    recipe_draft_k,
    recipe_drafter,
    seam_bytes_per_token,
    validate_boundary,
)
from mtplib.contract.capabilities import (
    ALPHA_POLICY,
    BETA_POLICY,
    CONTRACT_VERSION,
    Policy,
    RouteRefused,
    ShardAdvert,
    Status,
    build_advert,
    negotiate,
    require_route,
)
from mtplib.contract.dspark import (
    DSPARK_OPTIONS,
    DSPARK_SHARD_LOCAL,
    DSparkBlock,
    DSparkConfidences,
    DSparkFeatures,
    DSparkProposal,
    check_for_session,
    dspark_crossings,
    dspark_step_bytes,
    plan_draft_rollback,
    plan_dspark_step,
    plan_dspark_truncate,
)
from mtplib.contract.golden import advert_sets
from mtplib.contract.labels import Placement

GOLDEN = Path(__file__).parent / "golden" / "contract"
D = TINY_DIMS
F = D.feature_width


def feats(**kw) -> DSparkFeatures:
    base = dict(session_id="s", epoch=1, positions=(4, 5), target_layers=(2, 3, 4),
                n_embd=D.n_embd, dtype=DType.F32, nbytes=2 * F * 4)
    base.update(kw)
    return DSparkFeatures(**base)


def block(**kw) -> DSparkBlock:
    base = dict(session_id="s", epoch=1, base_position=6, anchor=7, mask_token=255, k=5)
    base.update(kw)
    return DSparkBlock(**base)


def conf(values=(0.9, 0.6, 0.3, 0.8, 0.1), **kw) -> DSparkConfidences:
    base = dict(session_id="s", epoch=1, base_position=6, values=values)
    base.update(kw)
    return DSparkConfidences(**base)


def prop(drafts, recipe=None, **kw) -> DraftProposal:
    base = dict(session_id="s", epoch=1, base_position=6, drafts=tuple(drafts), head_index=0,
                recipe=recipe or f"dspark.v4.draft{len(drafts)}")
    base.update(kw)
    return DraftProposal(**base)


# -- recipes ------------------------------------------------------------------------------
def test_dspark_recipes_beside_mtp_one_grammar():
    assert DSPARK_RECIPES == tuple(f"dspark.v4.draft{k}" for k in range(1, 9))
    assert RECIPES == ("mtp.off", *MTP_RECIPES, *DSPARK_RECIPES)
    for r in DSPARK_RECIPES:
        spec = DraftSpec.from_recipe(r)
        assert spec.drafter == "dspark" and spec.recipe == r and spec.mtp
        assert recipe_drafter(r) == "dspark" and recipe_draft_k(r) == spec.k
    assert recipe_drafter("mtp.v4.draft3") == "mtp" and recipe_drafter("mtp.off") is None
    assert DraftSpec(0, "dspark").recipe == "mtp.off"  # off is off, whatever the drafter
    assert DraftSpec(5) != DraftSpec(5, "dspark")
    for bad in ("dspark.v4.draft0", "dspark.v4.draft9", "dspark.v4.draft05", "dspark.v3.draft2",
                "eagle3.v4.draft1"):
        with pytest.raises(ContractError, match="^recipe: expected"):
            recipe_draft_k(bad)
    with pytest.raises(ContractError, match="^drafter: expected mtp or dspark, got 'eagle3'"):
        DraftSpec(3, "eagle3")


# -- typed values -------------------------------------------------------------------------
def test_features_one_row_per_target_layer_f32_only():
    f = feats()
    f.validate(D, n_layer=4)
    assert f.width == 3 * D.n_embd == D.feature_width
    validate_boundary(f.message(seq_step=2), D, Session("s", State.DECODING, epoch=1))
    assert V4_FLASH_DIMS.feature_width * 4 == 49152  # v4-dspark.md §0: 48 KiB per token
    cases = [
        (dict(dtype=DType.BF16, nbytes=2 * F * 2),
         "^dtype: expected f32 .bf16 features are an option"),
        (dict(target_layers=(3, 4)), r"^target_layers: expected 3 layers"),
        (dict(target_layers=(2, 2, 4)), "^target_layers: expected distinct"),
        (dict(target_layers=(2, 3, 5)), r"^target_layers\[2\]: expected <= n_layer=4"),
        (dict(n_embd=2 * D.n_embd), "^n_embd: expected the trunk's n_embd=64"),
        (dict(nbytes=F * 4), "^nbytes: expected len.positions.\\*L\\*n_embd\\*4=1536"),
        (dict(positions=(4, 6)), r"^positions\[1\]: expected 5"),
        (dict(payload=b"\0"), "^payload: expected 1536 bytes"),
        (dict(epoch=-1), "^epoch"),
    ]
    for kw, match in cases:
        with pytest.raises(ContractError, match=match):
            feats(**kw).validate(D, n_layer=4)
    # the bf16 option is refused at the seam too (fail closed), as is a K-row message
    with pytest.raises(SeamViolation, match="^dtype: expected f32 for dspark_features"):
        validate_boundary(feats(dtype=DType.BF16, nbytes=2 * F * 2).message(0), D)
    k_rows = BoundaryMessage("s", 1, 0, "dspark_k_rows", (4,), 192, DType.F32, 768)
    with pytest.raises(SeamViolation, match="^kind: expected one of"):
        validate_boundary(k_rows, D)
    assert set(DSPARK_OPTIONS) == {"bf16 features", "K rows"}


def test_block_is_anchor_then_noise_within_block_size():
    b = block()
    b.validate(D, block_size=5)
    assert b.tokens == (7, 255, 255, 255, 255) and b.positions == (6, 7, 8, 9, 10)
    assert b.recipe == "dspark.v4.draft5"
    with pytest.raises(ContractError, match="^k: expected <= the draft's block size 5"):
        block(k=6).validate(D, block_size=5)
    with pytest.raises(ContractError, match="^k: expected <= 8"):
        block(k=9).validate(D)
    with pytest.raises(ContractError, match="^mask_token: expected token id < n_vocab"):
        block(mask_token=256).validate(D)


def test_confidences_cut_where_upstream_does():
    c = conf()
    c.validate()
    assert [c.kept(p) for p in (0.0, 0.2, 0.5, 0.7, 0.95)] == [5, 4, 2, 1, 0]
    for bad in ((), (0.5, 1.01), (0.5, float("inf")), (True,), tuple([0.5] * 9)):
        with pytest.raises(ContractError, match="^values"):
            conf(bad).validate()
    with pytest.raises(ContractError, match="^p_min"):
        c.kept(1.5)


def test_proposal_carries_a_dspark_recipe_and_the_cut():
    DSparkProposal(block(), prop((1, 2, 3, 4, 5))).validate(D, block_size=5)
    DSparkProposal(block(), prop((1, 2)), conf(), p_min=0.5).validate(D)
    DSparkProposal(block(), prop((1, 2, 3, 4, 5)), conf()).validate(D)  # p_min 0: all kept
    bad = [
        (DSparkProposal(block(), prop((1, 2, 3, 4, 5), "mtp.v4.draft5")),
         "^proposal.recipe: expected a dspark recipe"),
        (DSparkProposal(block(), prop((1, 2, 3)), conf(), p_min=0.5),
         r"^proposal.drafts: expected 2 \(cut"),
        (DSparkProposal(block(), prop((1, 2))), r"^proposal.drafts: expected 5 \(no confidence"),
        (DSparkProposal(block(), prop((1,)), None, p_min=0.5), "^confidences: expected"),
        (DSparkProposal(block(epoch=2), prop((1, 2, 3, 4, 5))), "^proposal.epoch"),
        (DSparkProposal(block(), prop((1, 2, 3, 4, 5)), conf(base_position=7)),
         "^confidences.base_position"),
        (DSparkProposal(block(k=3), prop((1, 2, 3, 4, 5))), "^proposal.drafts: expected <= "),
    ]
    for p, match in bad:
        with pytest.raises(ContractError, match=match):
            p.validate(D)


# -- both contexts: accept, reject, rollback, truncation ----------------------------------
@pytest.mark.parametrize("n", range(6))
def test_step_plan_injects_committed_rows_only_and_trims_both(n):
    k, base = 5, 12
    r = VerifyResult("s", 3, base, k, n, 9, (*range(1, n + 1), 9))
    p = plan_dspark_step(r, n_rs_seq=k + 1)
    assert p.inject == tuple(range(base, base + n + 1))  # the last token + accepted drafts
    assert p.upstream_inject == tuple(range(base, base + k + 1))  # upstream: all k+1 rows
    assert p.next_base == r.next_position == p.upstream_draft_seq_rm_from == base + n + 1
    assert p.draft.kind == ("none" if n == k else "tail") and p.draft.keep_until == base + n + 1
    assert p.target.kind == p.draft.kind and p.target.drop == k - n
    # the epoch moves as the session's does
    s = Session("s", State.VERIFYING, epoch=3, position=base).accept(n, k)
    assert p.epoch == s.epoch and s.position == p.next_base


def test_target_needs_a_checkpoint_where_the_draft_does_not():
    r = VerifyResult("s", 3, 12, 5, 1, 9, (1, 9))
    p = plan_dspark_step(r, n_rs_seq=0)
    assert p.target.kind == "checkpoint_replay" and p.draft.kind == "tail"
    assert plan_draft_rollback(10, 10).kind == "none"
    with pytest.raises(ContractError, match="^keep_until: expected <= n_fed=10"):
        plan_draft_rollback(10, 11)


def test_truncation_trims_both_and_bumps_the_epoch():
    s = Session("s", State.DECODING, epoch=3, position=20)
    t = plan_dspark_truncate(s, 16, n_fed=19, n_rs_seq=6, last_decode_len=6)
    assert t.session.epoch == 4 and t.session.position == 16
    assert (t.target.kind, t.target.keep_until) == ("tail", 16)
    assert (t.draft.kind, t.draft.drop, t.draft.keep_until) == ("tail", 3, 16)
    with pytest.raises(ContractError, match="^to_position"):
        plan_dspark_truncate(s, 21, n_fed=19, n_rs_seq=6, last_decode_len=6)


def test_values_carry_session_and_epoch():
    live = Session("s", State.DECODING, epoch=1, position=6)
    for v in (feats(), block(), conf()):
        check_for_session(v, live)
    with pytest.raises(StaleEpochError):
        check_for_session(feats(epoch=0), live)


# -- shard-local state and what crosses -----------------------------------------------------
def test_draft_caches_are_shard_local_and_refused_at_a_seam():
    assert DSPARK_SHARD_LOCAL == {CacheKind.DSPARK_SWA_K} and DSPARK_SHARD_LOCAL <= SHARD_LOCAL
    assert "dspark_swa_k" in FORBIDDEN_KINDS
    m = BoundaryMessage("s", 1, 0, "dspark_swa_k", (4,), 64, DType.F16, 128)
    with pytest.raises(SeamViolation, match="is forbidden"):
        validate_boundary(m, D)
    ok = BoundaryMessage("s", 1, 0, "dspark_confidences", (4,), 1, DType.F32, 4,
                         extra={"meta": {"dspark_swa_k": 1}})
    with pytest.raises(SeamViolation, match="names cache state"):
        validate_boundary(ok, D)


def test_client_placement_sends_features_once_per_committed_token():
    rows = dspark_crossings(V4_FLASH_DIMS, "client")
    base = [c for c in rows if not c.option]
    assert [(c.value, c.per, c.bytes) for c in base] == [
        ("dspark_features", "committed token", 3 * 4096 * 4)]
    opts = {c.value: c.bytes for c in rows if c.option}
    assert opts == {"dspark_features (bf16)": 24576, "dspark K rows (f32)": 6144,
                    "dspark K rows (f16)": 3072}  # v4-dspark.md §3.1
    # n accepted of 5: n+1 committed rows, the rejected ones never
    assert [dspark_step_bytes(V4_FLASH_DIMS, "client", 5, n) for n in (0, 2, 5)] == \
        [49152, 3 * 49152, 6 * 49152]
    # less than MTP's row per committed token (hc * n_embd f32)
    assert base[0].bytes < seam_bytes_per_token(V4_FLASH_DIMS, DType.F32)["mtp_hidden_remote"]


def test_tail_placement_sends_ids_in_and_drafts_out():
    rows = dspark_crossings(V4_FLASH_DIMS, Placement.TAIL)
    assert [(c.value, c.direction, c.per, c.bytes) for c in rows] == [
        ("token_ids", "to the draft", "step", 4),
        ("verify_result", "to the draft", "step", 16),
        ("draft_tokens", "from the draft", "draft position", 4),
        ("dspark_confidences", "from the draft", "draft position", 4)]
    assert dspark_step_bytes(V4_FLASH_DIMS, "tail", 5, 2) == 4 + 16 + 5 * 8
    # a tail shard starting past a target layer gets that layer's row from the shard before
    one = dspark_step_bytes(V4_FLASH_DIMS, "tail", 5, 2, remote_layers=1)
    assert one - (4 + 16 + 5 * 8) == 3 * 4096 * 4
    with pytest.raises(ContractError, match="^remote_layers"):
        dspark_crossings(V4_FLASH_DIMS, "tail", remote_layers=4)
    with pytest.raises(ValueError):
        dspark_crossings(V4_FLASH_DIMS, "elsewhere")


def test_every_crossing_value_is_a_seam_value_or_an_option():
    from mtplib.contract.seam import SEAM_VALUES

    for placement in ("client", "tail"):
        for c in dspark_crossings(D, placement, remote_layers=1):
            assert c.option or c.value in SEAM_VALUES, c


# -- capabilities -------------------------------------------------------------------------
def test_advert_lists_dspark_recipes_fail_closed():
    mtp_run = build_advert(0, pin="p", policy=BETA_POLICY, has_mtp_sidecar=True)
    assert not mtp_run.advert.has_dspark_draft
    assert {mtp_run.advert.recipes[r] for r in DSPARK_RECIPES} == {Status.UNSUPPORTED}
    assert mtp_run.reasons["dspark.v4.draft1"] == "no DSpark draft"
    d = build_advert(0, pin="p", policy=BETA_POLICY, has_mtp_sidecar=False,
                     mtp_problem="no MTP sidecar", has_dspark_draft=True, dspark_block=5)
    rec = d.advert.recipes
    assert [rec[f"dspark.v4.draft{k}"] for k in range(1, 9)] == [Status.IMPLEMENTED] * 5 + \
        [Status.UNSUPPORTED] * 3
    assert "block size is 5" in d.reasons["dspark.v4.draft6"]
    assert {rec[r] for r in MTP_RECIPES} == {Status.UNSUPPORTED}
    assert d.to_dict()["has_dspark_draft"] is True
    assert negotiate("dspark.v4.draft5", [d.advert], BETA_POLICY).drafter == "dspark"
    assert not negotiate("dspark.v4.draft6", [d.advert], BETA_POLICY).mtp
    assert not negotiate("mtp.v4.draft1", [d.advert], BETA_POLICY).mtp
    broken = build_advert(0, pin="p", policy=BETA_POLICY, has_mtp_sidecar=False,
                          has_dspark_draft=True, dspark_block=5, build_problem="wrong build")
    assert {broken.advert.recipes[r] for r in DSPARK_RECIPES} == {Status.UNSUPPORTED}


def test_alpha_disables_dspark_exactly_as_mtp():
    a = build_advert(0, pin="p", policy=ALPHA_POLICY, has_mtp_sidecar=True,
                     has_dspark_draft=True, dspark_block=5)
    for r in (*MTP_RECIPES, *DSPARK_RECIPES[:5]):
        assert a.advert.recipes[r] == Status.DISABLED, r
    assert a.reasons["dspark.v4.draft3"] == "alpha policy: DSpark disabled"
    assert a.reasons["mtp.v4.draft3"] == "alpha policy: MTP disabled"
    assert a.advert.recipes["dspark.v4.draft6"] == Status.UNSUPPORTED  # says more
    assert a.advert.recipes["mtp.off"] == Status.IMPLEMENTED
    d = negotiate("dspark.v4.draft3", [a.advert], ALPHA_POLICY)
    assert d.recipe_routed == "mtp.off" and d.reason == "alpha policy: DSpark disabled"
    with pytest.raises(RouteRefused, match="^dspark.v4.draft3 refused under policy 'alpha'"):
        require_route("dspark.v4.draft3", [a.advert], ALPHA_POLICY)
    # even a policy allowing drafting does not route what an advert says is disabled
    assert "is disabled, need implemented" in negotiate("dspark.v4.draft3", [a.advert],
                                                        BETA_POLICY).reason


def test_tail_must_hold_the_dspark_draft():
    sets = advert_sets()
    d = negotiate("dspark.v4.draft3", sets["tail_without_dspark_draft"], BETA_POLICY)
    assert d.reason == "shard 1: tail shard has no DSpark draft"
    assert negotiate("dspark.v4.draft3", sets["all_certified_2"], BETA_POLICY).mtp
    # the MTP sidecar is not what a DSpark recipe needs, nor the reverse
    assert negotiate("dspark.v4.draft3", sets["tail_without_sidecar"], BETA_POLICY).mtp
    assert not negotiate("mtp.v4.draft3", sets["tail_without_sidecar"], BETA_POLICY).mtp
    ranged = sets["ranged_no_dspark_draft"]
    assert all(not negotiate(r, ranged, BETA_POLICY).mtp for r in DSPARK_RECIPES)
    assert negotiate("mtp.v4.draft3", ranged, BETA_POLICY).mtp


def test_shard_adverts_route_no_dspark_recipe_without_a_draft_placed():
    from mtplib import pins
    from mtplib.distributed.shard_report import ProbedShard, ShardReport, shard_adverts
    from mtplib.runtime.routing import PIN

    rep = ShardReport(CONTRACT_VERSION, pins.LLAMA_CPP_PYTHON_VERSION, pins.LLAMA_CPP_COMMIT,
                      "stock")
    shards = [ProbedShard(version=(3, 0, 0), n_devices=1, alignment=32, max_size=1 << 40,
                          memory_free=1, memory_total=2, endpoint=f"h:{i}", report=rep)
              for i in range(2)]
    ads = shard_adverts(shards, mtp_placed=True, policy=BETA_POLICY)
    assert [a.has_dspark_draft for a in ads] == [False, False]
    for r in DSPARK_RECIPES:
        assert not negotiate(r, ads, BETA_POLICY, pin=PIN).mtp
    assert negotiate("mtp.v4.draft3", ads, BETA_POLICY, pin=PIN).mtp
    placed = shard_adverts(shards, mtp_placed=False, policy=BETA_POLICY, dspark_block=5)
    assert [a.has_dspark_draft for a in placed] == [False, True]
    assert negotiate("dspark.v4.draft5", placed, BETA_POLICY, pin=PIN).mtp
    assert not negotiate("mtp.v4.draft5", placed, BETA_POLICY, pin=PIN).mtp
    alpha = shard_adverts(shards, mtp_placed=False, policy=ALPHA_POLICY, dspark_block=5)
    assert {a.recipes["dspark.v4.draft2"] for a in alpha} == {Status.DISABLED}
    assert not negotiate("dspark.v4.draft5", alpha, BETA_POLICY, pin=PIN).mtp


statuses = st.sampled_from(list(Status))


@st.composite
def dspark_adverts(draw):
    n = draw(st.integers(1, 4))
    return [ShardAdvert(shard_index=i, contract_version=CONTRACT_VERSION, pin="p",
                        has_mtp_sidecar=draw(st.booleans()),
                        recipes=draw(st.dictionaries(st.sampled_from(RECIPES), statuses)),
                        has_dspark_draft=draw(st.booleans()))
            for i in range(n)]


@given(requested=st.sampled_from([*DSPARK_RECIPES, "dspark.v4.draft9"]),
       adverts=dspark_adverts(), name=st.text(min_size=1, max_size=5))
@settings(max_examples=200, deadline=None)
def test_alpha_never_routes_dspark_property(requested, adverts, name):
    assert negotiate(requested, adverts, ALPHA_POLICY).recipe_routed == "mtp.off"
    assert negotiate(requested, adverts, Policy(name, allow_mtp=False)).recipe_routed == \
        "mtp.off"
    with pytest.raises(RouteRefused, match="alpha policy: DSpark disabled"):
        require_route(requested, adverts, ALPHA_POLICY)


@given(requested=st.sampled_from(DSPARK_RECIPES), adverts=dspark_adverts())
@settings(max_examples=200, deadline=None)
def test_dspark_routes_iff_tail_holds_it_and_every_shard_implements(requested, adverts):
    expect = adverts[-1].has_dspark_draft and all(
        a.recipes.get(requested, Status.UNSUPPORTED) >= Status.IMPLEMENTED for a in adverts)
    d = negotiate(requested, adverts, BETA_POLICY)
    assert d.recipe_routed == (requested if expect else "mtp.off"), d.reason
    with contextlib.suppress(RouteRefused):
        assert require_route(requested, adverts, BETA_POLICY).drafter == "dspark"


# -- routing of a run (no model loaded) ---------------------------------------------------
def test_route_a_dspark_run_by_its_block():
    from mtplib.runtime.routing import local_advert, route

    d = route(DraftSpec(5, "dspark"), policy="beta", dspark_block=5)
    assert d.recipe_routed == "dspark.v4.draft5"
    assert route(2, policy="beta", drafter="dspark", dspark_block=5).drafter == "dspark"
    with pytest.raises(RouteRefused, match="'dspark.v4.draft5' is unsupported"):
        route(DraftSpec(5, "dspark"), policy="beta", dspark_block=3)
    with pytest.raises(RouteRefused, match="tail shard has no DSpark draft"):
        route(DraftSpec(2, "dspark"), policy="beta", has_sidecar=False)
    with pytest.raises(RouteRefused,
                       match="^dspark.v4.draft5 refused under policy 'alpha': alpha policy: "
                             "DSpark disabled"):
        route(DraftSpec(5, "dspark"), policy="alpha", dspark_block=5)
    adv = local_advert(has_sidecar=True, policy=BETA_POLICY, drafter="dspark", dspark_block=5)
    assert adv.has_dspark_draft and not adv.has_mtp_sidecar
    assert {adv.recipes[r] for r in MTP_RECIPES} == {Status.UNSUPPORTED}


# -- golden -------------------------------------------------------------------------------
def test_golden_fixture_records_the_dspark_contract():
    doc = json.loads((GOLDEN / "dspark_values.json").read_text())
    cases = {c["name"]: c for c in doc["value_cases"]}
    assert all(c["verdict"] == "accepted" for n, c in cases.items() if n.startswith("ok_"))
    assert all(c["verdict"] == "refused" for n, c in cases.items() if not n.startswith("ok_"))
    assert doc["shard_local_caches"] == {"dspark_swa_k": FORBIDDEN_KINDS["dspark_swa_k"]}
    flash = {(c["placement"], c["remote_layers"]): c for c in doc["crossings"]
             if c["dims"] == "v4_flash"}
    assert flash[("client", 0)]["step_bytes_k5"]["0"] == 49152
    assert flash[("tail", 0)]["step_bytes_k5"]["5"] == 60
    version = json.loads((GOLDEN / "contract_version.json").read_text())
    assert version["drafters"] == ["mtp", "dspark"]
    assert version["dspark_shard_local_caches"] == ["dspark_swa_k"]
    assert set(DSPARK_RECIPES) <= set(version["recipes"])
    rows = json.loads((GOLDEN / "negotiation_matrix.json").read_text())["matrix"]
    by = {(r["adverts"], r["policy"], r["requested"]): r for r in rows}
    assert all(r["routed"] == "mtp.off" for r in rows if r["policy"] == "alpha")
    assert by[("all_certified_2", "beta", "dspark.v4.draft5")]["routed"] == "dspark.v4.draft5"
    assert by[("ranged_dspark_block3", "beta", "dspark.v4.draft5")]["routed"] == "mtp.off"
    assert by[("ranged_no_dspark_draft", "beta", "dspark.v4.draft1")]["reason"] == \
        "shard 1: tail shard has no DSpark draft"
    msgs = {c["name"]: c for c in json.loads(
        (GOLDEN / "boundary_messages.json").read_text())["cases"]}
    assert msgs["ok_dspark_features"]["verdict"] == "accepted"
    assert msgs["forbidden_kind_dspark_swa_k"]["verdict"] == "refused"
    assert msgs["dspark_features_bf16_option_not_built"]["verdict"] == "refused"


# -- a whole-model run with a DSpark draft (the tiny fixture) -----------------------------
def test_a_whole_model_dspark_run_routes_its_own_recipe(dspark, tmp_path):
    from mtplib.runtime.capability import advertise
    from mtplib.runtime.request import build_request
    from mtplib.runtime.speculative import MTPRuntime

    pair, path = dspark
    req = build_request(pair.trunk, sidecar=path, draft=3, policy="beta")
    assert req.draft == DraftSpec(3, "dspark") and req.sidecar_kind == "dspark"
    assert build_request(pair.trunk, sidecar=path, policy="beta").draft.recipe == \
        "dspark.v4.draft5"  # the block size by default
    assert build_request(pair.trunk, policy="beta").draft == DraftSpec(0)  # no drafter
    with pytest.raises(RouteRefused, match="^dspark.v4.draft5 refused under policy 'alpha': "
                                           "alpha policy: DSpark disabled"):
        build_request(pair.trunk, sidecar=path, policy="alpha")
    with MTPRuntime(str(pair.trunk), str(path), k=4, n_ctx=256, n_threads=1,
                    policy="beta") as rt:
        assert rt.routing["recipe"] == "dspark.v4.draft4"
        assert rt.routing["reason"] == "all 1 shards implement dspark.v4.draft4"
    cap = advertise(pair.trunk, path, cert_dir=tmp_path, policy="beta")
    rec = cap.advert.recipes
    assert cap.advert.has_dspark_draft and not cap.advert.has_mtp_sidecar
    assert [rec[f"dspark.v4.draft{k}"] for k in (1, 5, 6)] == \
        [Status.IMPLEMENTED, Status.IMPLEMENTED, Status.UNSUPPORTED]
    assert {rec[r] for r in MTP_RECIPES} == {Status.UNSUPPORTED}
    alpha = advertise(pair.trunk, path, cert_dir=tmp_path, policy="alpha")
    assert alpha.advert.recipes["dspark.v4.draft5"] == Status.DISABLED
    assert alpha.reasons["dspark.v4.draft5"] == "alpha policy: DSpark disabled"
