"""DSpark drafting on shards, the client placement (issue 40 point 3): the tiny trunk on
local RPC shards with its random-weight DSpark draft in the client.

Exactness first (greedy tokens equal drafting off), then the bytes: the pin reads every
verify row's features to the client (rejected rows too), once, and never writes them back;
no cache byte crosses; the tail placement is refused in one line until it is built.
"""

from __future__ import annotations

import pytest

from mtplib.errors import InputError
from mtplib.lab.correctness import seeded_prompt
from mtplib.runtime.dspark.ranged import (
    TAIL_NOT_BUILT,
    choose_dspark_placement,
    feature_bytes,
    feature_row_bytes,
)
from mtplib.runtime.engine_options import EngineOptions
from mtplib.runtime.request import build_request
from mtplib.runtime.settings import DecodeSettings
from mtplib.runtime.speculative import MTPRuntime

PROMPT = seeded_prompt(7, 8)
N_NEW = 12
ONE = DecodeSettings(n_ctx=256, n_threads=1)
#: the tiny fixture: target layers (2, 3, 4), n_embd 128, F32 rows
ROW = 3 * 128 * 4


@pytest.fixture(scope="module")
def plain(dspark):
    pair, _ = dspark
    with MTPRuntime(str(pair.trunk), None, n_ctx=256, n_threads=1) as rt:
        return rt.generate(PROMPT, N_NEW)[0]


def _ranged(dspark, plan: str, seam: str):
    from mtplib.distributed.ranged_mtp import RangedMTP

    pair, path = dspark
    return RangedMTP(str(pair.trunk), plan=plan, sidecar=str(path), seam=seam,
                     opts=EngineOptions(k=3, settings=ONE))


def test_tail_placement_refused_in_one_line_client_and_auto_build(dspark):
    pair, path = dspark
    with pytest.raises(InputError, match="DSpark on the tail shard is not built yet"):
        build_request(pair.trunk, sidecar=path, plan="0-1,2-3", mtp_placement="tail")
    for placement in ("auto", "client"):
        req = build_request(pair.trunk, sidecar=path, plan="0-1,2-3",
                            mtp_placement=placement)
        assert req.sidecar_kind == "dspark" and req.ranged
    assert "\n" not in TAIL_NOT_BUILT


def test_placement_decision_is_the_client_while_the_tail_is_not_built():
    c = choose_dspark_placement(k=3, n_layers=3, n_embd=4096, n_vocab=129280, rtt_s=0.05,
                                bandwidth_bps=1e8)
    assert c.chosen == "client" and c.cost_s["tail"] is None
    assert "not built" in c.reason and "49152 B of features per row" in c.reason
    # were it built, the tail (ids only) would win on any link with these widths
    built = choose_dspark_placement(k=3, n_layers=3, n_embd=4096, n_vocab=129280,
                                    rtt_s=0.05, bandwidth_bps=1e8, tail_built=True)
    assert built.chosen == "tail" and built.cost_s["tail"] < built.cost_s["client"]
    assert feature_row_bytes(3, 4096) == 49152 and feature_row_bytes(3, 4096, 2) == 24576


def test_feature_bytes_counts_layer_inputs_only():
    per_relay = [{("down", "layer_inp-2"): 512, ("down", "result_output"): 1024,
                  ("up", "RPC0[x]#embd (reshaped)#0"): 99},
                 {("down", "layer_inp-3"): 512, ("up", "RPC0[y]#layer_inp-4#0"): 7}]
    assert feature_bytes(per_relay) == {"down": 1024, "up": 7}
    assert feature_bytes(per_relay, layer_ids={3}) == {"down": 512, "up": 0}


@pytest.mark.parametrize("plan,seam", [("0-1,2-3", "ring"), ("0-0,1-2,3-3", "star")])
def test_client_placement_exact_features_cross_once_no_cache(dspark, plain, plan, seam):
    with _ranged(dspark, plan, seam) as r:
        toks, m = r.generate(PROMPT, N_NEW)
        off, m0 = r.generate(PROMPT, N_NEW, EngineOptions(k=0, settings=ONE))
        tail_idx = len(r.rt.endpoints) - 1
    assert toks == plain == off  # greedy: drafting changes no token, on shards too
    assert m.drafted > 0 and m.mtp_placement == "client" and m.mtp_endpoints == []
    assert m.seam["seam"] == seam
    for mm in (m, m0):
        assert mm.cache_bytes_crossing == 0 and mm.wire_violations == []
    steps = m.seam_report["steps"]
    # every decoded row's features are read once, rejected verify rows included
    # (the pin's GET copies the whole layer-input tensor of the batch)
    for label in ("prefill", "verify"):
        f = steps[label]["features"]
        assert f["down"] == steps[label]["tokens"] * ROW, label
        assert f["up"] == 0 and f["peer"] == 0  # never written back to a shard
    assert steps["prefill"]["tokens"] == len(PROMPT)
    committed = m.verify_steps + m.accepted  # tokens the verify steps kept
    assert steps["verify"]["steps"] == m.verify_steps
    # rejected rows crossed too: a step reads its k+1 rows, at most committed ones are needed
    assert steps["verify"]["tokens"] == m.verify_steps + m.drafted > committed
    # injection runs in the client: feeding the drafter moves nothing
    assert steps["feed"]["bytes"] == 0
    # a block pass: its head matmul on the tail (the target's output), nothing elsewhere
    assert steps["draft"]["bytes"] > 0 and steps["draft"]["features"]["down"] == 0
    assert all(b == 0 for i, b in enumerate(steps["draft"]["per_shard"]) if i != tail_idx)
    # drafting off reads no features
    assert all(row["features"] == {"down": 0, "up": 0, "peer": 0}
               for row in m0.seam_report["steps"].values())
    dec = m.routing["placement"]["decisions"]["dspark_placement"]
    assert dec["chosen"] == "client" and "not built" in dec["reason"]
    assert m.routing["placement"]["inputs"]["feature_row_bytes"] == ROW
