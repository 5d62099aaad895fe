"""DSpark ownership from the draft's GGUF (pure), checked against the graphs upstream builds
on the tiny fixture: the embd batch (feature injection) and the token batch (noise block),
with cb_eval recording every weight read and every cache touched, and the draft context's
cache buffer sizes."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from mtplib.contract.capabilities import RouteRefused
from mtplib.model.dspark.fixture import write_dspark
from mtplib.model.dspark.spec import dspark_config_for
from mtplib.model.gguf_header import read_header
from mtplib.model.presets import get_preset
from mtplib.ownership.derivation import CacheParams
from mtplib.ownership.dspark import (
    PART_GRAPHS,
    PARTS,
    DSparkOwnershipError,
    derive_dspark,
    derive_dspark_from_paths,
    draft_tensors,
    dspark_cache_tensors,
    part_contradictions,
)
from mtplib.ownership.plan import parse_plan
from mtplib.runtime.dspark.graph_reads import check_dspark, check_dspark_reads, observe_dspark

PARAMS = [
    CacheParams(n_ctx=512),
    CacheParams(n_ctx=2048, n_seq=2, n_ubatch=64, swa_full=False),  # window-sized caches
    CacheParams(n_ctx=1024, type_k="f32"),
]


@pytest.fixture(scope="module")
def own(dspark):
    pair, draft = dspark
    return derive_dspark_from_paths(str(draft), str(pair.trunk), "0-1,2-3")


def _cfg():
    return dspark_config_for(get_preset("tiny").validate())


# -- derived, pure --------------------------------------------------------------------------
def test_every_draft_tensor_has_a_part_and_readers(own):
    cfg = own.config
    draft = [t for t in own.tensors if t.file == "dspark"]
    # 10 roots (no fc.scale, markov_w2.scale, token_embd, output in the fixture) + stages
    assert len(draft) == 10 + 24 * cfg.n_stages
    assert {t.part for t in own.tensors} <= set(PARTS)
    assert all(t.read_by for t in own.tensors)  # nothing held but unread
    by = {t.name: t for t in draft}
    assert by["fc.weight"].read_by == ("inject",) and by["fc.weight"].part == "feature_fusion"
    assert by["enc.output_norm.weight"].read_by == ("inject",)
    assert by["markov_w1.weight"].part == "markov_head"
    assert by["conf_proj.weight"].part == "confidence_head"
    assert by["output_hc_fn.weight"].part == by["output_norm.weight"].part == "draft_head"
    for i in range(cfg.n_stages):
        assert by[f"blk.{i}.attn_kv.weight"].read_by == ("inject", "block")
        assert by[f"blk.{i}.attn_kv_a_norm.weight"].read_by == ("inject", "block")
        assert by[f"blk.{i}.attn_q_a.weight"].read_by == ("block",)
        assert by[f"blk.{i}.ffn_up_exps.weight"].stage == i
    for t in own.tensors:
        assert set(t.read_by) <= PART_GRAPHS[t.part], t
    # the shared embedding and head are the trunk's, read through ctx_other
    shared = {t.name: t for t in own.tensors if t.file == "trunk"}
    assert set(shared) == {"token_embd.weight", "output.weight"}
    assert shared["token_embd.weight"].part == "shared_embedding"
    assert shared["output.weight"].part == "shared_output_head"


def test_trunk_layers_feeding_it_and_where_they_are_made(own, dspark):
    pair, draft = dspark
    assert own.config.target_layers == (2, 3, 4)  # upstream's ids: layer ids + 1
    f = {x.target_layer: x for x in own.features}
    assert [f[t].trunk_layer for t in (2, 3, 4)] == [1, 2, 3]
    assert (f[2].made_on, f[2].seen_on) == (0, (0, 1))  # layer 1's output reaches shard 1
    assert (f[4].made_on, f[4].seen_on) == (1, (1,))  # the last output: the tail only
    late = derive_dspark_from_paths(str(draft), str(pair.trunk), "0-2,3-3")
    tail = {p.placement: p for p in late.placements}["tail"]
    assert tail.remote_features == (2,) and tail.feature_bytes_per_token == 128 * 4
    one = derive_dspark_from_paths(str(draft), str(pair.trunk))
    assert {p.placement: p.replica_bytes for p in one.placements}["tail"] == 0


def test_placements_hold_what_the_draft_reads(own):
    p = {x.placement: x for x in own.placements}
    embd = next(t.bytes for t in own.tensors if t.name == "token_embd.weight")
    head = next(t.bytes for t in own.tensors if t.name == "output.weight")
    assert p["client"].replica_bytes == embd + head and p["tail"].replica_bytes == embd
    assert p["client"].remote_features == (2, 3, 4)
    assert p["client"].feature_bytes_per_token == 3 * 128 * 4
    assert p["tail"].remote_features == () and p["tail"].feature_bytes_per_token == 0
    assert p["tail"].holder == "shard 1" and p["client"].draft_bytes == p["tail"].draft_bytes
    assert p["tail"].caches["dspark_swa_k"] == p["tail"].caches["dspark_swa_v_unread"] > 0


def test_caches_swa_full_and_window():
    cfg = _cfg()
    full = dspark_cache_tensors(cfg, CacheParams(n_ctx=1024))
    assert len(full) == 2 * cfg.n_stages and all(c.shape[1] == 1024 for c in full)
    assert [c.read for c in full[:2]] == [True, False]  # K read, V allocated unread
    win = dspark_cache_tensors(cfg, CacheParams(n_ctx=8192, n_ubatch=64, swa_full=False))
    assert {c.shape[1] for c in win} == {256}  # PAD(min(8192, 32 + 64), 256)


def test_an_unknown_tensor_belongs_to_no_part(tmp_path, dspark):
    pair, _ = dspark
    bad = write_dspark(tmp_path / "d.gguf", _cfg(),
                       extra={"bogus.weight": np.zeros(4, np.float32)})
    with pytest.raises(DSparkOwnershipError, match="'bogus.weight' belongs to no part"):
        draft_tensors(read_header(bad), read_header(pair.trunk))
    with pytest.raises(Exception, match="bogus"):  # the validator refuses it first
        derive_dspark(read_header(bad), read_header(pair.trunk))


def test_plan_must_fit_the_trunk(own, dspark):
    pair, draft = dspark
    with pytest.raises(DSparkOwnershipError, match="plan is for 3 layers"):
        derive_dspark(read_header(draft), read_header(pair.trunk), parse_plan("0-2", 3))


# -- checked against upstream's graphs --------------------------------------------------------
@pytest.mark.parametrize("params", PARAMS, ids=["n512", "seq2-swa", "f32"])
def test_reads_and_caches_equal_upstream(own, params):
    r = check_dspark(own, params)
    assert r["reads_equal"], r["reads"]
    assert r["caches_equal"], r["caches"]
    assert r["parts_consistent"], r["part_contradictions"]
    inject, block = r["reads"]
    assert inject["observed"] == 2 + 2 * own.config.n_stages  # fc, enc norm, wkv, kv_norm
    assert "trunk:token_embd.weight" not in inject["missing_in_upstream"]
    assert block["observed"] == len([t for t in own.tensors if "block" in t.read_by])
    (buf,) = r["caches"]["buffers"]
    assert buf["tensors"] == own.config.n_stages  # K only is touched; V is allocated


def test_a_wrong_rule_is_caught(own):
    """A derivation off by one tensor, a part upstream contradicts, or a cache that leaves
    out the unread V fails the comparison."""
    obs = observe_dspark(own.paths["trunk"], own.paths["dspark"], CacheParams(n_ctx=512))
    assert check_dspark_reads(own, obs["block"])["equal"]
    assert "trunk:output.weight" in obs["block"].weights  # the target's head, not a copy
    assert "dspark:output_norm.weight" in obs["block"].weights  # the draft's own norm
    # fc read by the block graph too: missing in upstream
    wrong = replace(own, tensors=tuple(replace(t, read_by=("inject", "block"))
                                       if t.name == "fc.weight" else t for t in own.tensors))
    bad = check_dspark_reads(wrong, obs["block"])
    assert not bad["equal"] and bad["missing_in_upstream"] == ["dspark:fc.weight"]
    # the shared head assigned to the feature fusion: upstream's block graph contradicts it
    moved = replace(own, tensors=tuple(replace(t, part="feature_fusion")
                                       if t.name == "output.weight" else t
                                       for t in own.tensors))
    seen = {g: obs[g].weights for g in ("inject", "block")}
    assert part_contradictions(own, seen) == []
    assert part_contradictions(moved, seen) == [
        "block read trunk:output.weight, of part feature_fusion (read by inject only)"]
    # an unassigned tensor: upstream read what no part holds
    dropped = replace(own, tensors=tuple(t for t in own.tensors
                                         if t.name != "markov_w2.weight"))
    assert part_contradictions(dropped, seen) == [
        "block read dspark:markov_w2.weight, which no part holds"]
    from mtplib.runtime.graph_reads import check_caches

    k_only = [c for c in dspark_cache_tensors(own.config, CacheParams(n_ctx=512))
              if c.part == "k"]
    c = check_caches(k_only, obs["caches"])
    assert c["tensors_equal"] and not c["equal"]


def test_a_draft_with_its_own_embedding_reads_no_trunk_tensor(tmp_path, dspark):
    """token_embd in the draft, no output: upstream reads that token_embd as the head too
    (TENSOR_DUPLICATED), and nothing of the trunk."""
    pair, _ = dspark
    cfg = _cfg()
    embd = np.random.default_rng(0).standard_normal((cfg.n_vocab, cfg.n_embd)).astype(
        np.float32)
    path = write_dspark(tmp_path / "dspark-own.gguf", cfg, extra={"token_embd.weight": embd})
    own = derive_dspark_from_paths(str(path), str(pair.trunk))
    assert not [t for t in own.tensors if t.file == "trunk"]
    t = next(t for t in own.tensors if t.name == "token_embd.weight")
    assert (t.file, t.part, t.read_by) == ("dspark", "shared_embedding", ("block",))
    r = check_dspark(own, CacheParams(n_ctx=512))
    assert r["reads_equal"] and r["parts_consistent"], (r["reads"], r["part_contradictions"])


def test_the_graph_check_asks_the_policy_first(own, monkeypatch):
    import mtplib.runtime.dspark.context as rd

    def boom(*a, **k):
        raise AssertionError("loaded under alpha")

    monkeypatch.setattr(rd, "DSparkModel", boom)
    with pytest.raises(RouteRefused, match="the DSpark graph check: dspark.v4.draft5 refused "
                                           "under policy 'alpha': alpha policy: DSpark"):
        observe_dspark(own.paths["trunk"], own.paths["dspark"], CacheParams(n_ctx=512),
                       policy="alpha")


def test_v4_flash_features_reach_the_tail_unless_it_starts_past_them():
    from mtplib.model.presets import get_preset as preset
    from mtplib.ownership.dspark import crossing_table, tail_features
    from mtplib.ownership.plan import even_plan

    cfg = dspark_config_for(preset("v4-flash").validate())
    assert cfg.target_layers == (41, 42, 43)  # the outputs of layers 40-42
    rows = tail_features(cfg, [even_plan(43, 8), parse_plan("0-40,41-42", 43),
                               parse_plan("0-41,42-42", 43)])
    assert [r["remote_layers"] for r in rows] == [[], [], [41]]  # tail from 42: one row
    assert rows[-1]["tail_feature_bytes_per_token"] == 4096 * 4
    t = crossing_table(cfg)
    assert t["k"] == 5 and t["mtp_row_bytes"] == 4 * 4096 * 4
    client = {r["value"]: r["bytes"] for r in t["placements"]["client"]["rows"]}
    assert client["dspark_features"] == 3 * 4096 * 4
    assert client["dspark K rows (f16)"] == cfg.n_stages * cfg.head_dim * 2
    assert t["placements"]["tail"]["step_bytes"]["5"] == 4 + 16 + 5 * 8
