"""Placement by cost (issue 29 item 4): the decision for given costs and RTT
(`mtplib.runtime.placement`), and ``auto`` on a ranged run: the decision and its inputs in
``routing["placement"]``, the client chosen where it drafts cheaply, the tail where the
client is (forced) slow, tokens identical either way."""

import pytest

from mtplib.distributed.ranged_mtp import RangedMTP
from mtplib.errors import InputError
from mtplib.lab.correctness import seeded_prompt
from mtplib.model.trained import trained_paths
from mtplib.runtime.engine_options import EngineOptions
from mtplib.runtime.placement import (
    DRAFT_WAITS_PER_TOKEN,
    PlacementInputs,
    break_even_rtt_s,
    choose_head,
    choose_placement,
)
from mtplib.runtime.settings import DecodeSettings

MS = 1e-3


def _inp(**kw) -> PlacementInputs:
    base = {"k": 2, "rtt_s": 0.0, "client_draft_s": 1 * MS, "tail_draft_s": 1 * MS,
            "client_head_s": 1 * MS, "tail_head_s": 1 * MS, "row_bytes": 2048,
            "logits_bytes": 8192}
    return PlacementInputs(**{**base, **kw})


def test_equal_compute_keeps_the_drafter_in_the_client_at_any_rtt():
    for rtt in (0.0, 0.1 * MS, 100 * MS):
        c = choose_placement(_inp(rtt_s=rtt))
        assert c.chosen == "client", (rtt, c)
    # at RTT 0 the tail costs its compute only: a tie, and ties keep the client
    assert choose_placement(_inp()).cost_s == {"client": 2 * MS, "tail": 2 * MS}


def test_a_slow_client_loses_to_a_fast_tail_below_the_break_even_rtt():
    client, tail = 120 * MS, 5 * MS  # V4-Flash's CPU draft (layer-cost) vs a fast tail
    be = break_even_rtt_s(client, tail)
    assert be == pytest.approx((client - tail) / DRAFT_WAITS_PER_TOKEN["client"])
    slow = {"client_draft_s": client, "tail_draft_s": tail}
    below = choose_placement(_inp(rtt_s=be * 0.9, **slow))
    above = choose_placement(_inp(rtt_s=be * 1.1, **slow))
    assert below.chosen == "tail" and above.chosen == "client"
    assert below.cost_s["tail"] < below.cost_s["client"] < above.cost_s["tail"]
    assert "tail drafts" in below.reason and "RTT" in below.reason
    assert break_even_rtt_s(tail, client) is None  # a slower tail never wins


def test_unknown_costs_and_no_drafts_decide_for_the_default():
    c = choose_placement(_inp(tail_draft_s=None, client_draft_s=10.0))
    assert c.chosen == "client" and "unknown" in c.reason
    assert choose_placement(_inp(k=0, client_draft_s=10.0)).chosen == "client"
    assert choose_head(_inp(client_head_s=None)).chosen == "client"
    assert choose_head(_inp(k=0, client_head_s=None)).chosen == "upstream"


def test_head_decision_by_compute_waits_and_known_bandwidth():
    # equal compute: today's defaults (client with MTP, upstream without)
    assert choose_head(_inp()).chosen == "client"
    assert choose_head(_inp(k=0)).chosen == "upstream"
    # a slow client head loses to the tail's
    assert choose_head(_inp(client_head_s=50 * MS)).chosen == "upstream"
    # a known 20 Mbit/s link, the drafter in the client: upstream's head sends the logits
    # besides the rows the drafter needs, which outweighs a slightly slower client head
    h = choose_head(_inp(client_head_s=1.01 * MS, bandwidth_bps=20e6))
    assert h.chosen == "client" and h.cost_s["upstream"] > h.cost_s["client"]
    assert choose_head(_inp(client_head_s=1.01 * MS)).chosen == "upstream"  # no bandwidth
    # MTP off with a known (capped) link: the client's head moves rows, not logits
    assert choose_head(_inp(k=0, bandwidth_bps=20e6)).chosen == "client"


def test_bad_inputs_are_one_line_errors():
    with pytest.raises(InputError, match="rtt_s"):
        _inp(rtt_s=-1.0)
    with pytest.raises(InputError, match="client_draft_s"):
        _inp(client_draft_s=float("nan"))
    with pytest.raises(InputError, match="k must be"):
        _inp(k=True)
    with pytest.raises(InputError, match="unknown placement costs"):
        _inp().forced({"gpu_s": 1.0})
    f = _inp().forced({"client_draft_s": 2.0})
    assert f.client_draft_s == 2.0 and f.sources["client_draft_s"] == "given"


# -- on a ranged run ---------------------------------------------------------------------
PROMPT = seeded_prompt(7, 10)
OPTS = EngineOptions(k=2, settings=DecodeSettings(n_ctx=256, n_threads=1))


def _run(trunk, sidecar, **kw):
    with RangedMTP(str(trunk), plan="0-1,2-3", sidecar=str(sidecar), opts=OPTS, **kw) as r:
        toks, m = r.generate(PROMPT, 8)
        return toks, m, r.rt.endpoints[-1]


def _check_record(m, want: str) -> dict:
    rec = m.routing["placement"]
    assert rec["requested"] == {"mtp_placement": "auto", "head": "auto"}
    d = rec["decisions"]
    assert d["mtp_placement"]["chosen"] == want == m.mtp_placement
    assert d["head"]["chosen"] == m.head == "client"
    inp = rec["inputs"]
    assert inp["k"] == 2 and inp["rtt_s"] > 0 and inp["client_draft_s"] > 0
    assert rec["sources"]["rtt_s"].startswith("measured")
    assert rec["timings"]["draft_s"]["where"] == "client" and rec["timings"]["reps"] == 5
    return rec


@pytest.mark.parametrize("which", ["trained", "tiny"])
def test_auto_keeps_the_cheap_drafter_in_the_client(which, pair):
    p = trained_paths() if which == "trained" else pair
    _, m, _ = _run(p.trunk, p.sidecar)
    rec = _check_record(m, "client")
    assert rec["sources"]["client_draft_s"].startswith("measured")
    assert rec["sources"]["tail_draft_s"].startswith("estimated")
    assert rec["moved_sidecar"] is False and m.mtp_endpoints == []


def test_auto_moves_the_drafter_to_the_tail_when_the_client_is_slow(pair):
    base, _, _ = _run(pair.trunk, pair.sidecar, mtp_placement="client")
    toks, m, tail = _run(pair.trunk, pair.sidecar, placement_costs={"client_draft_s": 1.0})
    rec = _check_record(m, "tail")
    assert rec["sources"]["client_draft_s"] == "given" and rec["moved_sidecar"] is True
    assert m.mtp_endpoints == [tail] and m.drafted > 0
    assert m.cache_bytes_crossing == 0
    assert toks == base


def test_the_wait_counts_are_the_committed_measurement():
    """The cost model's waits are evidence/placement/waits.json's (placement_table.py)."""
    import json
    from pathlib import Path

    from mtplib.runtime.placement import FEED_WAITS_PER_STEP, HEAD_EXTRA_WAITS

    d = json.loads((Path(__file__).resolve().parents[1] / "evidence/placement/waits.json")
                   .read_text())
    w = {(r["mtp_placement"], r["head"]): r["waits_per_step"] for r in d["rows"]}
    assert d["k"] == 2 and len({tuple(r["tokens"]) for r in d["rows"]}) == 1
    for head in ("upstream", "client"):
        assert DRAFT_WAITS_PER_TOKEN[head] == pytest.approx(w["tail", head]["draft"] / d["k"])
        assert FEED_WAITS_PER_STEP == w["tail", head]["feed"]
    for place in ("client", "tail"):
        assert HEAD_EXTRA_WAITS[place] == pytest.approx(
            w[place, "upstream"]["verify"] - w[place, "client"]["verify"])
