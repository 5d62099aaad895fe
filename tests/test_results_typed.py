"""Issue 23 item 2 (results half): a generation's metrics and the bench's rows are typed
(`GenerationMetrics`, `BenchRun`) and become dicts only at the file edge, with the same keys
and values as before: the committed evidence round-trips and its summaries recompute."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mtplib.contract.labels import TIME_PARTS
from mtplib.lab.bench import config as BC
from mtplib.lab.bench import measure as B
from mtplib.lab.bench import runs as BR
from mtplib.lab.bench import summary as BS
from mtplib.lab.correctness import seeded_prompt
from mtplib.runtime.results import GenerationMetrics
from mtplib.runtime.speculative import MTPRuntime

BENCH = Path(__file__).resolve().parent.parent / "evidence" / "DGR-066" / "bench" / "bench.json"


@pytest.fixture(scope="module")
def committed() -> dict:
    return json.loads(BENCH.read_text())


def test_committed_rows_round_trip_exactly(committed):
    rows = committed["runs"] + committed["sweep_runs"]
    typed = [BR.BenchRun.from_dict(r) for r in rows]
    assert [t.to_dict() for t in typed] == rows
    kinds = {(t.mode, t.quality is not None, t.ranged is not None, t.sweep is not None)
             for t in typed}
    assert kinds == {("off", True, False, False), ("mtp", True, False, False),
                     ("off", True, True, False), ("mtp", True, True, False),
                     ("synthetic", False, False, True)}


def test_summaries_recompute_the_committed_numbers(committed):
    assert BS.summarize(committed["runs"], committed["sampling"]) == committed["summary"]
    assert BS.sweep_summary(committed["sweep_runs"], committed["runs"]) == committed["sweep"]
    typed = [BR.BenchRun.from_dict(r) for r in committed["runs"]]
    assert BS.summarize(typed, committed["sampling"]) == committed["summary"]


def test_a_generation_is_typed_and_its_dict_round_trips(pair):
    with MTPRuntime(str(pair.trunk), str(pair.sidecar), k=2) as rt:
        _, g = rt.generate(seeded_prompt(1, 6), 8)
    assert isinstance(g, GenerationMetrics) and g.n_generated == 8 and g.drafted > 0
    assert list(g.time_s) == list(TIME_PARTS) and g.memory["trunk_weights_bytes"] > 0
    assert g.routing["recipe"] == "mtp.v4.draft2" and g.upstream["build"]
    d = g.to_dict()
    assert json.loads(json.dumps(d)) == d  # the JSON edge: plain data only
    assert {"decode_tok_s", "memory", "routing", "upstream", "hidden_rows"} <= set(d)
    assert "setup" not in d and "synthetic" not in d  # absent, as in every earlier file
    assert GenerationMetrics.from_dict(d) == g
    broken = dict(d)
    del broken["decode_tok_s"]
    with pytest.raises(KeyError, match="decode_tok_s"):
        GenerationMetrics.from_dict(broken)


def test_a_bench_run_is_typed_until_it_is_written(pair, committed):
    cfg = BC.BenchConfig.from_dict({"ks": [1], "n_new": 4, "reps": 1, "warmup": 1,
                                   "threads": 1, "prompts": [{"seed": 0, "len": 6}],
                                   "sweep": {"rates": [1.0], "ks": [1], "reps": 1,
                                             "warmup": 0}})
    res = B.run_bench(str(pair.trunk), str(pair.sidecar), cfg)
    assert all(isinstance(r, BR.BenchRun) for r in res.runs + res.sweep_runs)
    assert all(isinstance(r.metrics, GenerationMetrics) for r in res.runs)
    data = res.to_json()
    want = {(r["mode"], tuple(sorted(r))) for r in committed["runs"] + committed["sweep_runs"]
            if r["plan"] == "whole"}
    got = {(r["mode"], tuple(sorted(r))) for r in data["runs"] + data["sweep_runs"]}
    assert got == want  # the same keys as the committed whole-model rows, per kind
    assert json.loads(json.dumps(data)) == data


WAN = sorted((BENCH.parents[2] / "wan").glob("wan*/*/wan.json"))


@pytest.mark.parametrize("path", WAN, ids=lambda p: "/".join(p.parts[-3:-1]))
def test_committed_wan_rows_round_trip_and_recompute(path):
    from mtplib.lab.wan.runs import WanRun
    from mtplib.lab.wan.summary import bytes_by_class, summarize

    d = json.loads(path.read_text())
    typed = [WanRun.from_dict(r) for r in d["rows"]]
    assert [t.to_dict() for t in typed] == d["rows"]
    assert summarize(typed) == summarize(d["rows"]) == d["summary"]
    assert bytes_by_class(d["rows"]) == d["bytes_by_class"]


def test_the_oldest_wan_rows_still_read():
    """Rows written before runs recorded their mode and build read as warm, build unknown."""
    from mtplib.lab.wan.runs import WanRun
    from mtplib.lab.wan.summary import summarize

    old = BENCH.parents[2] / "upstream-patches" / "wan" / "stock" / "wan.json"
    rows = json.loads(old.read_text())["rows"]
    assert "mode" not in rows[0]
    typed = [WanRun.from_dict(r) for r in rows]
    assert {t.mode for t in typed} == {"warm"} and {t.build for t in typed} == {None}
    assert len(summarize(rows)) > 0


def test_a_wan_row_missing_a_field_is_named():
    from mtplib.errors import InputError
    from mtplib.lab.wan.runs import WanRun

    with pytest.raises(InputError, match="lacks .*decode_tok_s"):
        WanRun.from_dict({"plan": "0-1,2-3", "k": 0})


#: the keys `mtplib generate --plan ... --json` printed before its metrics were typed
RANGED_KEYS = {
    "k", "n_prompt", "n_generated", "drafted", "accepted", "acceptance_rate",
    "accepted_per_position", "accepted_per_position_counts", "drafted_per_position",
    "accept_len_hist", "verify_steps", "plain_steps", "rollbacks", "ttft_s", "decode_s",
    "decode_tok_s", "time_s", "hidden_rows", "memory", "seam_bytes", "seam_bytes_per_token",
    "seam_data_bytes_per_token", "seam_contract_min_per_token", "seam_ratio",
    "waits_per_step", "wire_bytes_by_class", "seam_bytes_by_value", "steps_by_label",
    "cache_bytes_crossing", "wire_violations", "wan", "seam_report", "plan", "endpoints",
    "local_shards", "routing", "placement", "transport", "head", "upstream", "setup"}


@pytest.mark.parametrize("k", [0, 2])
def test_a_ranged_generation_is_typed_with_the_keys_it_always_had(pair, k):
    from mtplib.distributed.ranged_mtp import RangedMTP
    from mtplib.distributed.results import RangedMetrics
    from mtplib.runtime.engine_options import EngineOptions

    with RangedMTP(str(pair.trunk), plan="0-1,2-3", sidecar=str(pair.sidecar),
                   opts=EngineOptions(k=k)) as r:
        _, m = r.generate(seeded_prompt(1, 6), 6)
    assert isinstance(m, RangedMetrics) and m.plan == "0-1,2-3"
    assert m.cache_bytes_crossing == 0 and m.waits_per_step and m.seam_bytes > 0
    d = m.to_dict()
    # the sidecar is loaded; "seam" (patches/0007): which seam ran, per shard pair
    want = RANGED_KEYS | {"mtp_placement", "mtp_endpoints", "seam"}
    assert set(d) == want
    # the default seam, auto: the ring where this build speaks RPC 7.2 (its local shards
    # then do too), else the star; either way each shard pair says which ran and why
    from mtplib.runtime.rpc import client_proto_minor

    ring = client_proto_minor() >= 2
    assert d["seam"]["requested"] == "auto"
    assert d["seam"]["seam"] == ("ring" if ring else "star")
    assert [(p["from"], p["to"], p["seam"]) for p in d["seam"]["pairs"]] == [
        (*m.endpoints, "ring" if ring else "star")]
    assert json.loads(json.dumps(d)) == d
    assert RangedMetrics.from_dict(d) == m
    assert RangedMetrics.from_dict(json.loads(json.dumps(d))).to_dict() == d
