"""Each raw metrics file of a run is written and read by `mtplib.records.raw_metrics`: the
reader gives back what the writer was given, the committed evidence files are exactly what
the writers write, and the record builders give the files the evidence writers read."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest

from mtplib.lab.bench import summary as BS
from mtplib.lab.contract_checks import golden_check, policy_check
from mtplib.model.fixture import write_fixture
from mtplib.ownership import report as rep
from mtplib.ownership.derivation import CacheParams, derive, inventory_from_paths
from mtplib.records import ownership_report
from mtplib.records import raw_metrics as RM
from mtplib.records.readme import Links, numbers_trace

REPO = Path(__file__).resolve().parent.parent
DGR065 = REPO / "evidence" / "DGR-065"
DGR066 = REPO / "evidence" / "DGR-066"

#: (committed file, its writer, its reader)
FILES = [
    (DGR065 / RM.OWNERSHIP_JSON, RM.write_ownership, RM.read_ownership),
    (DGR065 / RM.STATE_JSON, RM.write_state, RM.read_state),
    (DGR066 / RM.SEAM_BYTES_JSON, RM.write_seam_bytes, RM.read_seam_bytes),
    (DGR066 / RM.CORRECTNESS_JSON, RM.write_correctness, RM.read_correctness),
]


@pytest.mark.parametrize("path, write, read", FILES, ids=[p.name for p, _, _ in FILES])
def test_committed_file_round_trips_byte_for_byte(path, write, read, tmp_path):
    if not path.exists():
        pytest.skip(f"{path} not committed")
    data = read(path.parent)
    assert data == json.loads(path.read_text())
    out = write(tmp_path, data)
    assert out == tmp_path / path.name
    assert out.read_bytes() == path.read_bytes()  # the writer wrote the committed file
    assert read(tmp_path) == data


def test_writers_convert_tables_and_what_json_lacks(tmp_path):
    df = pd.DataFrame([{"k": 1, "equal": True, "x": 0.5}, {"k": 2, "equal": False, "x": 1.5}])
    RM.write_seam_bytes(tmp_path, df)
    assert RM.read_seam_bytes(tmp_path) == df.to_dict("records")
    rec = RM.correctness_record(equality=df, forced=df, rollback=df, sessions=df,
                                sampling={"seeds": 2, "path": tmp_path}, whole_vs_ranged=df)
    RM.write_correctness(tmp_path, rec)
    back = RM.read_correctness(tmp_path)
    assert back["sampling"] == {"seeds": 2, "path": str(tmp_path)}  # default=str
    assert {k: v for k, v in back.items() if k != "sampling"} == \
           {k: df.to_dict("records") for k in rec if k != "sampling"}
    assert list(back) == ["equality", "forced", "rollback", "sessions", "sampling",
                          "whole_vs_ranged"]


@pytest.mark.parametrize("write", [RM.write_ownership, RM.write_state, RM.write_correctness,
                                   RM.write_seam_bytes])
def test_writers_make_a_run_dir_that_does_not_exist_yet(write, tmp_path):
    """``papermill 03_correctness.ipynb OUT -p run_dir NEW`` failed in its last cell (after
    every measurement) with FileNotFoundError: nothing had made NEW."""
    run = tmp_path / "new" / "run"
    path = write(run, [{"a": 1}] if write is RM.write_seam_bytes else {"a": 1})
    assert path.parent == run and json.loads(path.read_text()) in ({"a": 1}, [{"a": 1}])


def test_absent_seam_bytes_read_as_none(tmp_path):
    assert RM.read_seam_bytes(tmp_path) is None
    with pytest.raises(FileNotFoundError):
        RM.read_ownership(tmp_path)


def test_bench_round_trips_through_lab_bench(tmp_path):
    path = DGR066 / RM.BENCH_JSON
    if not path.exists():
        pytest.skip(f"{path} not committed")
    data = RM.read_bench(DGR066)
    assert data == json.loads(path.read_text())
    fields = ("config", "runs", "sweep_runs", "sampling", "backend", "wall_s", "prompts",
              "model")  # model: written only when known (absent from older files)
    paths = RM.write_bench(tmp_path, BS.BenchResult(**{k: data[k] for k in fields if k in data}),
                           plots=False)
    assert paths["json"] == tmp_path / RM.BENCH_JSON
    again = RM.read_bench(tmp_path)  # summaries recomputed from the rows
    # the committed file predates issue 15: it wrote unmeasured memory (ranged peak RSS,
    # MTP off's MTP weights and state) as 0.0, the writer now writes None; nothing else moves
    memory = ("rss_peak_mib", "trunk_weights_mib", "mtp_weights_mib", "target_seq_state_kib",
              "mtp_seq_state_kib")
    for new, old in zip(again["summary"], data["summary"], strict=True):
        for key in memory:
            assert new[key] == old[key] or (new[key] is None and old[key] == 0.0), (key, new)
    strip = [{k: v for k, v in s.items() if k not in memory} for s in data["summary"]]
    assert [{k: v for k, v in s.items() if k not in memory} for s in again["summary"]] == strip
    assert {**again, "summary": None} == {**data, "summary": None}


# -- the builders ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def flash(tmp_path_factory):
    """Weight-less V4-Flash pair and a small set of its derivations."""
    pair = write_fixture(tmp_path_factory.mktemp("flash"), preset="v4-flash")
    owns, secs = rep.flash_ownerships(str(pair.trunk), str(pair.sidecar), shards=(2, 4),
                                      ctxs=(8192, 131072), swa_full=(True, False))
    return pair, owns, secs


def _reads(own) -> dict:
    """A `check_pair` result that found what the derivation says (upstream not called)."""
    return {"reads_equal": True,
            "reads": [{"graph": "main", "file": "trunk", "derived": 3, "observed": 3,
                       "missing_in_upstream": [], "unexpected_in_upstream": [],
                       "equal": True}]}


def _caches(p: CacheParams) -> dict:
    return {"params": {"n_ctx": p.n_ctx, "n_seq": p.n_seq, "n_ubatch": p.n_ubatch,
                       "type_k": p.type_k, "swa_full": p.swa_full, "n_rs_seq": p.n_rs_seq},
            "caches_equal": True,
            "caches": [{"graph": g, "tensors_equal": True,
                        "buffers": [{"cache": "kv", "tensors": 2, "derived_bytes": 1024,
                                     "upstream_bytes": 1024, "equal": True}]}
                       for g in ("main", "mtp")]}


def _dspark_check() -> dict:
    return {"reads": [{"graph": g, "derived": 1, "observed": 1, "missing_in_upstream": [],
                       "unexpected_in_upstream": [], "equal": True}
                      for g in ("inject", "block")],
            "reads_equal": True, "parts_consistent": True, "part_contradictions": []}


def _dspark_caches(p: CacheParams) -> dict:
    c = _caches(p)
    return {**c, "caches": {**c["caches"][0], "graph": "dspark"}}


def test_builders_write_what_the_dgr065_readme_reads(pair, combined, flash, dspark,
                                                     tmp_path):
    from mtplib.model.dspark.spec import dspark_config_for
    from mtplib.ownership.dspark import crossing_table, derive_dspark_from_paths, tail_features
    from mtplib.ownership.plan import even_plan

    fpair, owns, secs = flash
    dpair, dpath = dspark
    dsp = derive_dspark_from_paths(str(dpath), str(dpair.trunk), "0-1,2-3")
    inv = inventory_from_paths(pair.trunk, pair.sidecar)
    own = derive(inv, "0-1,2-3", CacheParams(n_ctx=4096))
    finv = next(iter(owns.values())).inventory
    plans = pd.DataFrame([{"shards": 2, "plan": "even", "ranges": "0-21,22-42",
                           "largest shard GiB": 1.0}])
    tc = pd.DataFrame([{"file": "trunk", "load_mtp": False, "model_size": 1,
                        "derived_bytes": 1, "n_params": 1, "equal": True,
                        "n_layer": finv.config.n_layer}])
    own_rec = RM.ownership_record(
        fixture=own, combined=combined, ctx=4096, reads={"pair": _reads(own),
                                                         "combined": _reads(own)},
        flash=owns, flash_files=fpair.summary(), flash_ctx=131072, flash_shards=[2, 4],
        seconds=secs, limit_s=5, table_check=tc, plans=plans, dspark=dsp,
        dspark_check=_dspark_check())
    variants = [CacheParams(n_ctx=4096), CacheParams(n_ctx=1024, type_k="f32")]
    fcfg = dspark_config_for(finv.config)
    st_rec = RM.state_record(
        checks=[_caches(p) for p in variants], variants=variants, flash=owns, seconds=secs,
        limit_s=5, flash_shards=[2, 4], flash_ctxs=[8192, 131072],
        golden=golden_check(), policies=policy_check(),
        dspark=RM.dspark_state(checks=[_dspark_caches(p) for p in variants],
                               variants=variants, crossings=crossing_table(fcfg),
                               feature_plans=tail_features(fcfg, [even_plan(43, 2)])))
    RM.write_ownership(tmp_path, own_rec)
    RM.write_state(tmp_path, st_rec)
    # the same layout as the committed files, and JSON round trip
    assert RM.read_ownership(tmp_path) == json.loads(json.dumps(own_rec, default=str))
    assert RM.read_state(tmp_path) == json.loads(json.dumps(st_rec, default=str))
    if (DGR065 / RM.OWNERSHIP_JSON).exists():
        assert set(own_rec) == set(RM.read_ownership(DGR065))
        assert set(own_rec["fixture"]) == set(RM.read_ownership(DGR065)["fixture"])
        assert set(st_rec) == set(RM.read_state(DGR065))
        assert set(own_rec["dspark"]) == set(RM.read_ownership(DGR065)["dspark"])
        assert set(st_rec["dspark"]) == set(RM.read_state(DGR065)["dspark"])
    assert own_rec["mtp_block_bytes"] == owns[(2, 131072, True)].mtp_block_bytes > 0
    assert sorted(own_rec["flash_shards"]) == ["2", "4"]
    assert st_rec["seam_bytes_per_token"]["n_seams"] == 3  # 4 shards
    assert st_rec["golden"]["identical"] and st_rec["policies"]["alpha"]["routed_mtp"] == 0
    # and the DGR-065 README renders from them, every number traced
    (tmp_path / "run_record.json").write_text(json.dumps(
        {"run_dir": str(tmp_path), "command": "test", "models": {}}))
    raw = {"run_record": json.loads((tmp_path / "run_record.json").read_text()),
           "ownership": RM.read_ownership(tmp_path), "state": RM.read_state(tmp_path)}
    text = ownership_report.render(tmp_path, raw, Links(tmp_path, tmp_path / "README.md"))
    assert "2/4 shards" in text and numbers_trace(text, raw) == []
    assert "## DSpark beside MTP" in text and "| inject | 1 | 1 | none | none | yes |" in text
