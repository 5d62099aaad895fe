"""Ranged MTP over an emulated WAN (issue 14): the runner, its summaries and the contract
check on the wire."""

from __future__ import annotations

import pytest

from mtplib.distributed.relay import WanLink
from mtplib.errors import InputError
from mtplib.lab import wan as W
from mtplib.model.trained import trained_paths

PAIR = trained_paths()
needs_pair = pytest.mark.skipif(not PAIR.exists(), reason="evidence/trained-v4 not present")


def test_config_validation():
    for bad, msg in [({"topologies": ["moon"]}, "unknown topology"), ({"ks": [9]}, "0..8"),
                     ({"rtts_ms": [-1]}, "0..10000"), ({"n_new": 0}, "n_new"),
                     ({"prompt_len": 300, "n_ctx": 256}, "do not fit"),
                     ({"colour": 1}, "unknown keys")]:
        with pytest.raises(InputError, match=msg):
            W.WanConfig.from_dict(bad)


def test_links_per_topology():
    assert W.links_for("remote", 3, 50) == [WanLink(50)] * 3
    assert W.links_for("tail_local", 3, 50) == [WanLink(50), WanLink(50), WanLink()]


def _row(k, rtt, tok_s, tps, waits, *, topo="remote", place="client", tokens=(1, 2)):
    return {"plan": "0-1,2-3", "topology": topo, "placement": place if k else "-", "k": k,
            "rtt_ms": rtt, "prompt": 0, "rep": 0, "decode_tok_s": tok_s,
            "tokens_per_step": tps, "accepted": 2 * k, "drafted": 3 * k, "n_generated": 12,
            "waits_per_step": {"verify": waits, "decode": 3.0} if k else {"decode": waits},
            "waits_decode_phase": waits / tps, "cache_bytes_crossing": 0,
            "tokens": list(tokens), "wire_bytes_by_class": {}, "ttft_s": 0.1, "steps": 11,
            "hidden_rows": "api", "steps_by_label": {}, "seam_bytes_per_token": {},
            "wire_violations": []}


def test_summary_cost_model_and_targets():
    # s/token = 0.01 + RTT x waits/token exactly: the fit must recover it
    rows = []
    for rtt in (0, 10, 25, 50, 100):
        rows.append(_row(0, rtt, 1 / (0.01 + rtt / 1000 * 3), 1.0, 3.0))
        rows.append(_row(2, rtt, 1 / (0.01 + rtt / 1000 * 3 / 1.8), 1.8, 3.0))
    s = W.summarize(rows)
    on = {r["rtt_ms"]: r for r in s if r["k"] == 2}
    assert on[100]["speedup"] == pytest.approx((0.01 + 0.3) / (0.01 + 0.3 / 1.8))
    assert on[100]["identical_to_off"] is True
    fit = W.fit_cost_model(s, [0, 10, 25, 50])
    assert {f["rtt_ms"] for f in fit} == {100}
    assert all(f["rel_error"] < 1e-9 for f in fit)
    off_fit = next(f for f in fit if f["k"] == 0)
    assert off_fit["fitted_waits_per_token"] == pytest.approx(3.0)
    t = W.targets(s)
    assert len(t) == 1 and t[0]["goal"] == 0.70 and t[0]["met"] is True
    assert t[0]["extra_waits_per_verify"] == 0.0


@needs_pair
@pytest.mark.slow
def test_short_wan_run_over_the_relays():
    """Two RTTs, MTP off and k=2 with the drafter and the head in the client: identical
    tokens; drafts cost no shard round trip; a plain step costs 3 waits on stock (2 seam
    tensors on shard 0, the hidden rows from the tail), 2 on the full patch set (one per
    shard); the RTT shows up in the time per token."""
    from conftest import decode_waits

    cfg = W.WanConfig(rtts_ms=[0, 40], ks=[0, 2], plans=["0-1,2-3"], topologies=["remote"],
                      placements=["client"], n_prompts=1, prompt_len=32, n_new=10,
                      fit_rtts_ms=[0])
    res = W.run_wan(str(PAIR.trunk), str(PAIR.sidecar), cfg, W.trained_prompts(1, 32))
    s = {(r["k"], r["rtt_ms"]): r for r in W.summarize(res["rows"])}
    assert s[(2, 0)]["identical_to_off"] and s[(2, 40)]["identical_to_off"]
    waits = decode_waits(2)
    assert s[(0, 40)]["waits_per_plain"] == waits
    assert s[(2, 40)]["waits_per_verify"] == waits  # the head in the client: no extra wait
    assert s[(2, 40)]["waits_per_draft"] == 0.0
    assert s[(0, 40)]["tok_s"] < s[(0, 0)]["tok_s"]
    assert 1 / s[(0, 40)]["tok_s"] > waits * 0.040  # at least that many round trips a token
    rows = [r for r in res["rows"] if r["k"] == 0]
    per_class = rows[0]["wire_bytes_by_class"]["decode"]
    assert per_class["cache"] == 0 and per_class["outputs"] > 0
    # the K-rotation matrix is re-sent every step on stock; once per context with 0003
    from mtplib.runtime import build_info

    once = any("0003" in p for p in build_info()["patches"])
    assert (per_class["constants"] == 0) if once else (per_class["constants"] > 0)


def test_wan_readme_renders_from_saved_results_and_every_number_traces(tmp_path):
    import json

    from mtplib.records.evidence import copy_run, render_readme

    rows = []
    for rtt in (0, 10, 25, 50, 100):
        for k, tps in ((0, 1.0), (2, 1.8)):
            r = _row(k, rtt, 1 / (0.01 + rtt / 1000 * 3 / tps), tps, 3.0)
            r["wire_bytes_by_class"] = {"verify" if k else "decode": {
                "seam": 8192, "outputs": 2048, "inputs": 3748, "constants": 65536, "cache": 0}}
            rows.append(r)
    cfg = W.WanConfig(rtts_ms=[0, 10, 25, 50, 100], ks=[0, 2], plans=["0-1,2-3"],
                      topologies=["remote"], placements=["client"], fit_rtts_ms=[0, 10, 25, 50])
    from dataclasses import asdict

    W.save({"config": asdict(cfg), "rows": rows, "wall_s": 12.5,
            "upstream": {"build": "patched", "patches": ["patches/0001.patch"]}},
           tmp_path / "wan" / "patched")
    (tmp_path / "run_record.json").write_text(json.dumps({
        "command": "mtplib run --params params/wan-cpu.yaml", "lane": "wan-cpu",
        "git": {"commit": "abc", "dirty": False}, "pins": {}, "cpu": {"model": "x"},
        "status": "ok"}))  # copy_run takes completed runs only
    text = render_readme(tmp_path, "wan", tmp_path / "README.md")
    assert "## Build: patched" in text and "Targets at 100 ms" in text
    assert "| 100 |" in text  # the RTT table reaches 100 ms
    readme = copy_run(tmp_path, "wan", tmp_path / "evidence")
    assert (readme.parent / "wan" / "patched" / "wan.json").is_file()
