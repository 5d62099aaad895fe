"""Ranged MTP over an emulated WAN (issue 14): the runner, its summaries and the contract
check on the wire."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest

from mtplib.distributed.relay import WanLink
from mtplib.errors import InputError
from mtplib.lab.wan import measure as wan_measure
from mtplib.lab.wan.cells import cell_of, cells
from mtplib.lab.wan.cold import cli_generate
from mtplib.lab.wan.config import WanConfig, with_upstream
from mtplib.lab.wan.files import PARTIAL_JSON, WAN_JSON, finish, save
from mtplib.lab.wan.inputs import links_for, trained_prompts, wan_arg
from mtplib.lab.wan.measure import run_wan
from mtplib.lab.wan.resume import RunProgress
from mtplib.lab.wan.runs import WanRun
from mtplib.lab.wan.summary import bytes_by_class, fit_cost_model, has_bandwidth, summarize, targets
from mtplib.model.trained import trained_paths

PAIR = trained_paths()
needs_pair = pytest.mark.skipif(not PAIR.exists(), reason="evidence/trained-v4 not present")


def test_config_validation():
    for bad, msg in [({"topologies": ["moon"]}, "unknown topology"), ({"ks": [9]}, "0..8"),
                     ({"rtts_ms": [-1]}, "0..10000"), ({"n_new": 0}, "n_new"),
                     ({"prompt_len": 300, "n_ctx": 256}, "do not fit"),
                     ({"colour": 1}, "unknown keys"), ({"mbits": [0]}, "mbits"),
                     ({"mbits": [-20]}, "mbits"), ({"mbits": []}, "mbits"),
                     ({"mbits": ["fast"]}, "mbits"), ({"mbits": [20, 20.0]}, "twice"),
                     ({"cold_shards": "moon"}, "cold_shards"),
                     ({"seam": "mesh"}, "^wan: seam must be one of auto, star, ring")]:
        with pytest.raises(InputError, match=msg):
            WanConfig.from_dict(bad)
    assert WanConfig.from_dict({"mbits": [20, 100, None]}).mbits == [20, 100, None]


def test_links_per_topology():
    assert links_for("remote", 3, 50) == [WanLink(50)] * 3
    assert links_for("tail_local", 3, 50) == [WanLink(50), WanLink(50), WanLink()]
    # a bandwidth caps every WAN link, never the co-located tail's loopback
    assert links_for("tail_local", 2, 100, 20) == [WanLink(100, 20), WanLink()]
    assert wan_arg("remote", 2, 100, 20) == "100:20,100:20"
    assert wan_arg("tail_local", 2, 100) == "100,0"  # the value it always had


def test_cli_generate_with_endpoints_gives_them_and_nothing_else():
    cmd = cli_generate("t.gguf", "m.gguf", plan="0-1,2-3", k=2, tokens=[1, 2], n_new=4,
                         wan="100:20,100:20", endpoints=["127.0.0.1:5", "127.0.0.1:6"])
    assert cmd[cmd.index("--endpoints") + 1] == "127.0.0.1:5,127.0.0.1:6"
    assert cmd[cmd.index("--wan") + 1] == "100:20,100:20"
    assert "--threads" not in cmd and "--shard-threads" not in cmd  # the CLI's defaults
    assert "--endpoints" not in cli_generate("t", None, plan="0-1,2-3", k=0, tokens=[1],
                                               n_new=4, wan="0")
    assert "--seam" not in cmd  # the CLI's default (auto) is left to it
    for seam in ("ring", "star"):
        given = cli_generate("t", None, plan="0-1,2-3", k=0, tokens=[1], n_new=4, wan="0",
                               seam=seam)
        assert given[given.index("--seam") + 1] == seam


def test_seam_run_names_the_command_and_the_error_when_the_cli_fails(monkeypatch):
    """A failed CLI generation (ring_tokens.py, ring_rtt.py) is an InputError naming the
    command, the seam and the CLI's own message, not a KeyError on missing metrics."""
    from mtplib.lab.wan import cold as wan_cold

    seen = []

    def fake(cmd):
        seen.append(cmd)
        return 2, {"error": "shard 1 lost"}, 0.1

    monkeypatch.setattr(wan_cold, "run_cli_json", fake)
    with pytest.raises(InputError, match=r"generate .*--seam ring failed \(exit 2\): shard 1 lost"):
        wan_cold.seam_run("t", "m", plan="0-1,2-3", k=2, prompt=[1, 2], n=4, wan="25",
                          seam="ring")
    cmd = seen[0]
    assert cmd[cmd.index("--seam") + 1] == "ring" and cmd[cmd.index("--wan") + 1] == "25"
    assert cmd[cmd.index("--draft") + 1] == "2"


def _row(k, rtt, tok_s, tps, waits, *, topo="remote", place="client", tokens=(1, 2),
         **more):
    return {"plan": "0-1,2-3", "topology": topo, "placement": place if k else "-", "k": k,
            "rtt_ms": rtt, **more, "prompt": 0, "rep": 0, "decode_tok_s": tok_s,
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
    s = summarize(rows)
    on = {r["rtt_ms"]: r for r in s if r["k"] == 2}
    assert on[100]["speedup"] == pytest.approx((0.01 + 0.3) / (0.01 + 0.3 / 1.8))
    assert on[100]["identical_to_off"] is True
    fit = fit_cost_model(s, [0, 10, 25, 50])
    assert {f["rtt_ms"] for f in fit} == {100}
    assert all(f["rel_error"] < 1e-9 for f in fit)
    off_fit = next(f for f in fit if f["k"] == 0)
    assert off_fit["fitted_waits_per_token"] == pytest.approx(3.0)
    t = targets(s)
    assert len(t) == 1 and t[0]["goal"] == 0.70 and t[0]["met"] is True
    assert t[0]["extra_waits_per_verify"] == 0.0


def test_summary_cost_model_and_targets_per_bandwidth():
    """Rows that record their bandwidth: every summary, fit and target row names it, and
    the speed-up of a cell is over MTP off at the same RTT and bandwidth."""
    rows = []
    for mbit, extra in ((20, 0.05), (None, 0.0)):  # the capped link adds 50 ms per token
        for rtt in (0, 10, 25, 50, 100):
            rows.append(_row(0, rtt, 1 / (0.01 + extra + rtt / 1000 * 3), 1.0, 3.0,
                             mbit=mbit))
            rows.append(_row(2, rtt, 1 / (0.01 + extra / 1.8 + rtt / 1000 * 3 / 1.8), 1.8,
                             3.0, mbit=mbit))
    s = summarize(rows)
    assert [list(r)[5:7] for r in s[:1]] == [["rtt_ms", "mbit"]]
    assert [r["mbit"] for r in s if r["k"] == 2 and r["rtt_ms"] == 100] == [20, None]
    on = {r["mbit"]: r for r in s if r["k"] == 2 and r["rtt_ms"] == 100}
    assert on[20]["speedup"] == pytest.approx((0.06 + 0.3) / (0.01 + 0.05 / 1.8 + 0.3 / 1.8))
    assert on[None]["speedup"] == pytest.approx((0.01 + 0.3) / (0.01 + 0.3 / 1.8))
    fit = fit_cost_model(s, [0, 10, 25, 50])
    assert sorted((f["mbit"] or 0, f["k"]) for f in fit) == [(0, 0), (0, 2), (20, 0), (20, 2)]
    assert all(f["rel_error"] < 1e-9 for f in fit)
    t = targets(s)
    assert [x["mbit"] for x in t] == [20, None] and all(x["met"] for x in t)
    # rows older than the field: no bandwidth column anywhere
    old = summarize([{k: v for k, v in r.items() if k != "mbit"} for r in rows
                       if r["mbit"] is None])
    assert all("mbit" not in r for r in old)
    assert [{k: v for k, v in r.items() if k != "mbit"} for r in s if r["mbit"] is None] == old


#: committed results whose derived sections the current code writes as they are (the
#: upstream-patches/wan/ ones were written by an older summary)
SAME_SUMMARY = sorted(p for p in (Path(__file__).resolve().parent.parent / "evidence")
                      .rglob("wan.json") if "upstream-patches/wan/" not in p.as_posix())


@pytest.mark.parametrize("path", SAME_SUMMARY, ids=lambda p: p.parent.as_posix()[-40:])
def test_committed_rows_summarize_to_the_committed_summary(path):
    """Rows without ``mbit`` summarize, fit and target to exactly what the files hold (no
    bandwidth column appears in an old results file)."""
    d = json.loads(path.read_text())
    s = summarize(d["rows"])
    assert s == d["summary"]
    if not has_bandwidth(d["rows"]):  # a file from before the bandwidth axis
        assert not any("mbit" in r for r in s)
    assert bytes_by_class(d["rows"]) == d["bytes_by_class"]
    assert targets(s) == d["targets"]
    assert fit_cost_model(s, d["config"]["fit_rtts_ms"]) == d["cost_model"]


def test_cells_cross_rtts_bandwidths_and_ks_in_both_modes():
    cfg = WanConfig(modes=["warm", "cold"], rtts_ms=[0, 100], cold_rtts_ms=[100],
                      mbits=[20, None], ks=[0, 2], cold_ks=[0, 2], plans=["0-1,2-3"],
                      topologies=["remote"], placements=["client", "tail"], upstream="patched")
    c = cells(cfg)
    assert len(c) == len(set(c)) == 2 * 2 * (1 + 2) + 2 * 2
    assert ("warm", "0-1,2-3", "remote", "-", 100.0, 20.0, 0) in c
    assert ("cold", "0-1,2-3", "remote", "*", 100.0, None, 2) in c
    stock = cells(replace(cfg, upstream="stock"))  # the CLI refuses MTP there by default
    assert not any(x[0] == "cold" and x[6] for x in stock)


class _FakeRanged:
    """RangedMTP's surface `_run_warm` uses, counting generations."""

    calls: list = []

    def __init__(self, request, **kw):  # the RunRequest `_run_warm` built
        self.rt = SimpleNamespace(relays=SimpleNamespace(relays=[
            SimpleNamespace(set_link=lambda link: None)
            for _ in range(request.plan.n_shards)]))

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return None

    def generate(self, prompt, n, opts):
        _FakeRanged.calls.append((tuple(prompt), opts.k))
        return [7] * n, SimpleNamespace(k=opts.k, t=len(_FakeRanged.calls))


def _fake_row(m, toks, **kw):
    return WanRun(**kw, build="patched", patches=["p"], setup_s=None,
                    decode_tok_s=10.0 + m.t, ttft_s=None, n_generated=len(toks), drafted=0,
                    accepted=0, steps=1, tokens_per_step=1.0, hidden_rows=None,
                    waits_per_step={}, steps_by_label={}, wire_bytes_by_class={},
                    seam_bytes_per_token={}, cache_bytes_crossing=0, wire_violations=[],
                    waits_decode_phase=None, tokens=toks).to_dict()


class _Stop(KeyboardInterrupt):
    pass


@needs_pair
def test_a_stopped_run_resumes_keeping_its_finished_cells(tmp_path, monkeypatch):
    """Ctrl-C after the first cell, then the same run into the same folder: the first
    cell's rows are kept byte for byte and not measured again; only the rest is."""
    import mtplib.distributed.ranged_mtp as R

    monkeypatch.setattr(R, "RangedMTP", _FakeRanged)
    monkeypatch.setattr(wan_measure, "run_row", _fake_row)
    _FakeRanged.calls = []
    cfg = WanConfig(rtts_ms=[0], mbits=[None, 20], ks=[0, 2], plans=["0-1,2-3"],
                      topologies=["remote"], placements=["client"], n_prompts=2,
                      prompt_len=8, n_new=4, fit_rtts_ms=[0])
    prompts = [[1, 2], [3, 4]]
    up = {"build": "patched", "patches": ["p"]}

    def stop_after_first_cell(done, total):
        if done == 2:  # both prompts of the first cell: its checkpoint is written next
            monkeypatch.setattr(RunProgress, "tick", _raise)

    def _raise(self):
        raise _Stop

    with pytest.raises(_Stop):
        run_wan(str(PAIR.trunk), None, cfg, prompts, out_dir=tmp_path, upstream=up,
                  progress=stop_after_first_cell)
    monkeypatch.undo()
    monkeypatch.setattr(R, "RangedMTP", _FakeRanged)
    monkeypatch.setattr(wan_measure, "run_row", _fake_row)
    part = json.loads((tmp_path / PARTIAL_JSON).read_text())
    first = cells(with_upstream(cfg))[0]
    assert {cell_of(r) for r in part["rows"]} == {first} and len(part["rows"]) == 2
    assert len(_FakeRanged.calls) == 3  # the interrupted generation of the second cell
    _FakeRanged.calls = []
    res = run_wan(str(PAIR.trunk), None, cfg, prompts, out_dir=tmp_path, upstream=up)
    assert len(_FakeRanged.calls) == 3 * 2  # the three cells left, 2 prompts each
    assert json.dumps(res["rows"][:2]) == json.dumps(part["rows"])  # kept byte for byte
    assert len(res["rows"]) == 2 * 4 and {cell_of(r) for r in res["rows"]} == set(
        cells(with_upstream(cfg)))
    assert [s["cells_kept"] for s in res["sessions"]] == [0, 1]
    finish(res, tmp_path)
    assert not (tmp_path / PARTIAL_JSON).exists()
    # a finished folder resumes too (nothing left to measure); a changed config is refused
    _FakeRanged.calls = []
    again = run_wan(str(PAIR.trunk), None, cfg, prompts, out_dir=tmp_path, upstream=up)
    assert _FakeRanged.calls == [] and again["rows"] == res["rows"]
    for bad, msg in [({"n_new": 5}, "n_new: 4 there, 5 now"),
                     ({"seam": "ring"}, "seam: 'auto' there, 'ring' now"),
                     ({"rtts_ms": [25]}, "holds cells this config does not list")]:
        with pytest.raises(InputError, match=msg):
            run_wan(str(PAIR.trunk), None, replace(cfg, **bad), prompts, out_dir=tmp_path,
                      upstream=up)
    with pytest.raises(InputError, match="upstream patches"):
        run_wan(str(PAIR.trunk), None, cfg, prompts, out_dir=tmp_path,
                  upstream={"build": "patched", "patches": ["p", "q"]})
    assert _FakeRanged.calls == []
    # a folder whose config names no seam predates the choice: it ran the star, so the
    # default (auto) does not resume into it and an asked star does
    done = json.loads((tmp_path / WAN_JSON).read_text())
    del done["config"]["seam"]
    (tmp_path / WAN_JSON).write_text(json.dumps(done))
    with pytest.raises(InputError, match="seam: 'star' there, 'auto' now"):
        run_wan(str(PAIR.trunk), None, cfg, prompts, out_dir=tmp_path, upstream=up)
    star = run_wan(str(PAIR.trunk), None, replace(cfg, seam="star"), prompts,
                     out_dir=tmp_path, upstream=up)
    assert _FakeRanged.calls == [] and star["rows"] == res["rows"]


@needs_pair
@pytest.mark.slow
def test_a_real_stopped_run_resumes_without_measuring_its_first_cell_again(tmp_path):
    """The tiniest real run (1 prompt, 4 tokens, RTT 0, MTP off then k=2), stopped by
    Ctrl-C in its second cell: the rerun measures only that cell and keeps the first
    cell's row byte for byte."""
    from mtplib.runtime.lib import upstream_info

    cfg = WanConfig(rtts_ms=[0], ks=[0, 2], plans=["0-1,2-3"], topologies=["remote"],
                      placements=["client"], n_prompts=1, prompt_len=8, n_new=4,
                      fit_rtts_ms=[0])
    prompts = trained_prompts(1, 8)
    up = upstream_info()

    def stop(done, total):
        if done == 2:  # the second cell's generation: the first cell is written
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run_wan(str(PAIR.trunk), str(PAIR.sidecar), cfg, prompts, out_dir=tmp_path,
                  upstream=up, progress=stop)
    part = json.loads((tmp_path / PARTIAL_JSON).read_text())
    assert [r["k"] for r in part["rows"]] == [0]
    seen = []
    res = run_wan(str(PAIR.trunk), str(PAIR.sidecar), cfg, prompts, out_dir=tmp_path,
                    upstream=up, progress=lambda d, t: seen.append((d, t)))
    assert seen == [(1, 1)]  # one generation: the k=2 cell's
    assert json.dumps(res["rows"][0]) == json.dumps(part["rows"][0])
    assert [r["k"] for r in res["rows"]] == [0, 2]
    assert summarize(res["rows"])[1]["identical_to_off"] is True


@needs_pair
@pytest.mark.slow
def test_cold_cells_on_external_shards_stop_them_also_on_ctrl_c(tmp_path, monkeypatch):
    """``cold_shards: endpoints``: the shard processes start once, every CLI run is given
    them (its metrics say it did not start its own), the capped link is in --wan, and the
    shards are stopped at the end and when the run is interrupted."""
    from mtplib.distributed import processes

    made = []

    class Recorded(processes.LocalShards):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            made.append(self)

    monkeypatch.setattr(processes, "LocalShards", Recorded)
    cfg = WanConfig(modes=["cold"], cold_rtts_ms=[0], mbits=[20], cold_ks=[0, 2],
                      cold_shards="endpoints", plans=["0-1,2-3"], topologies=["remote"],
                      n_prompts=1, prompt_len=8, n_new=4, fit_rtts_ms=[0])
    prompts = trained_prompts(1, 8)
    res = run_wan(str(PAIR.trunk), str(PAIR.sidecar), cfg, prompts)
    assert len(made) == 1 and not any(made[0].alive())
    ks = [0, 2] if with_upstream(cfg).upstream != "stock" else [0]
    assert [(r["k"], r["shards"], r["mbit"]) for r in res["rows"]] == [(k, "endpoints", 20)
                                                                        for k in ks]

    def stop(done, total):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run_wan(str(PAIR.trunk), str(PAIR.sidecar), cfg, prompts, progress=stop)
    assert len(made) == 2 and not any(made[1].alive())


@needs_pair
@pytest.mark.slow
def test_short_wan_run_over_the_relays():
    """Two RTTs, MTP off and k=2 with the drafter and the head in the client: identical
    tokens; drafts cost no shard round trip; a plain step costs 3 waits on stock (2 seam
    tensors on shard 0, the hidden rows from the tail), 2 on 0002-0004's star (one per
    shard), 1 over the ring (the default seam, auto, where 0007 is in: `decode_waits`);
    the RTT shows up in the time per token."""
    from conftest import decode_waits

    cfg = WanConfig(rtts_ms=[0, 40], ks=[0, 2], plans=["0-1,2-3"], topologies=["remote"],
                      placements=["client"], n_prompts=1, prompt_len=32, n_new=10,
                      fit_rtts_ms=[0])
    res = run_wan(str(PAIR.trunk), str(PAIR.sidecar), cfg, trained_prompts(1, 32))
    s = {(r["k"], r["rtt_ms"]): r for r in summarize(res["rows"])}
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
    cfg = WanConfig(rtts_ms=[0, 10, 25, 50, 100], ks=[0, 2], plans=["0-1,2-3"],
                      topologies=["remote"], placements=["client"], fit_rtts_ms=[0, 10, 25, 50])
    from dataclasses import asdict

    save({"config": asdict(cfg), "rows": rows, "wall_s": 12.5,
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


def test_the_runner_names_a_bad_config_in_one_line(tmp_path):
    import subprocess
    import sys

    p = subprocess.run([sys.executable, "-m", "mtplib.lab.wan", "--config", '{"mbits": [0]}',
                        "--out", str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and p.stdout == ""
    assert p.stderr.strip().splitlines() == [
        "python -m mtplib.lab.wan: error: wan: mbits must be a non-empty list of Mbit/s > 0 "
        "or None (unlimited), got [0]"]
