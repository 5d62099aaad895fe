"""Issue 23 item 2 (the lab's other rows): the side-by-side, acceptance-sweep and TLS-overhead
runs are typed (`SideRun`, `SweepRun`, `TlsRun`) and become dicts only at the file edge, with
the keys and values (and key order) of the committed files; their summaries recompute the
committed numbers from the rows read back typed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mtplib.errors import InputError
from mtplib.lab import tls_overhead as T
from mtplib.lab import upstream_tools as U
from mtplib.lab.common.acceptance_sweep import SweepConfig
from mtplib.lab.sidebyside.cases import ENGINES, Case, SideBySideConfig
from mtplib.lab.sidebyside.measure import _MtplibSide, _UpstreamSide
from mtplib.lab.sidebyside.runs import SideRun, summarize
from mtplib.lab.sidebyside.sweep import SweepRun, acceptance_sweep, break_even, sweep_summary
from mtplib.runtime.results import GenerationMetrics
from mtplib.runtime.settings import DecodeSettings

REPO = Path(__file__).resolve().parent.parent
#: every JSON of these kinds under evidence/ (side-by-side runs and sweeps; the TLS results
#: in evidence/tls are mtplib.lab.tls_overhead's, another kind, and a WAN run's wan.json,
#: e.g. evidence/wan/target/sweep/, is mtplib.lab.wan's)
COMMITTED = sorted(
    p for p in (REPO / "evidence").rglob("*.json")
    if any(w in str(p.relative_to(REPO)).lower() for w in ("side", "sweep"))
    and p.name not in ("run_record.json", "wan.json"))


def _kind(p: Path) -> str | None:
    d = json.loads(p.read_text())
    return d.get("kind") if isinstance(d, dict) else None


SIDE = [p for p in COMMITTED if _kind(p) == "side-by-side"]
SWEEP = [p for p in COMMITTED if _kind(p) == "acceptance-sweep"]
#: the other committed JSONs there hold no runs of these kinds (cost ratios, profiles)
OTHER = [p for p in COMMITTED if p not in SIDE + SWEEP]


def _id(p: Path) -> str:
    return p.name


def test_the_committed_files_are_found_and_the_rest_are_other_kinds():
    assert len(SIDE) >= 9 and len(SWEEP) >= 2
    for p in OTHER:
        d = json.loads(p.read_text())
        assert d.get("kind") in (None, "cost-ratio") and "summary" not in d, p


@pytest.mark.parametrize("path", SIDE, ids=_id)
def test_committed_side_by_side_rows_round_trip_and_recompute(path):
    d = json.loads(path.read_text())
    typed = [SideRun.from_dict(r) for r in d["rows"]]
    back = [t.to_dict() for t in typed]
    assert back == d["rows"]
    assert [list(b) for b in back] == [list(r) for r in d["rows"]]  # the order too
    assert {t.engine for t in typed} == set(ENGINES)
    assert summarize(typed) == summarize(d["rows"]) == d["summary"]


@pytest.mark.parametrize("path", SWEEP, ids=_id)
def test_committed_sweep_rows_round_trip_and_recompute(path):
    d = json.loads(path.read_text())
    typed = [SweepRun.from_dict(r) for r in d["rows"]]
    back = [t.to_dict() for t in typed]
    assert back == d["rows"] and [list(b) for b in back] == [list(r) for r in d["rows"]]
    assert {t.mode for t in typed} == {"off", "synthetic"}
    s = sweep_summary(typed)
    assert s == sweep_summary(d["rows"]) == d["summary"]
    # break_even's note names how the crossing was found since after these files were
    # written (it was ""); the numbers are the committed ones
    be = break_even(s)
    assert [{**b, "note": ""} for b in be] == d["break_even"]
    assert {b["note"] for b in be} == {"interpolated"}


def test_a_row_missing_a_field_or_its_engines_keys_is_named():
    d = json.loads(SIDE[0].read_text())
    up = next(r for r in d["rows"] if r["engine"] == "upstream")
    mt = next(r for r in d["rows"] if r["engine"] == "mtplib")
    with pytest.raises(InputError, match="upstream row lacks argv"):
        SideRun.from_dict({k: v for k, v in up.items() if k != "argv"})
    with pytest.raises(InputError, match="mtplib row lacks time_s"):
        SideRun.from_dict({k: v for k, v in mt.items() if k != "time_s"})
    with pytest.raises(InputError, match="lacks decode_tok_s"):
        SideRun.from_dict({k: v for k, v in mt.items() if k != "decode_tok_s"})
    with pytest.raises(InputError, match="engine must be one of"):
        SideRun.from_dict({**mt, "engine": "vllm"})
    with pytest.raises(InputError, match="sweep row lacks .*sweep_k"):
        SweepRun.from_dict({"decode_tok_s": 1.0, "k": 0})
    with pytest.raises(InputError, match="TLS-overhead row lacks"):
        T.TlsRun.from_dict({"transport": "tls"})


#: a /completion response of llama-server (test_sidebyside's recorded one, trimmed)
SERVER_RESPONSE = {
    "timings": {"prompt_n": 32, "prompt_ms": 24285.631, "prompt_per_second": 1.3176515775933513,
                "predicted_n": 64, "predicted_ms": 40951.698,
                "predicted_per_second": 1.538397748488964, "draft_n": 58,
                "draft_n_accepted": 33},
    "tokens": [363, 384, 106, 288, 479, 68, 272, 9]}


def _context(engine: str) -> dict:
    return dict(case="plain", k=0, rates=None, synthetic=False, engine=engine, rep=0,
                warmup=False, loadavg_before=[1.0, 1.0, 1.0], quality_valid=True)


def test_each_side_builds_its_run_typed_with_the_committed_keys(pair):
    """Both engines' runs as run_side_by_side builds them: mtplib's through MTPRuntime on
    the fixture, upstream's from the recorded server response (no server is built here)."""
    committed = json.loads(SIDE[0].read_text())["rows"]
    want = {e: list(next(r for r in committed if r["engine"] == e)) for e in ENGINES}
    cfg = SideBySideConfig(n_new=6, settings=DecodeSettings(n_ctx=256, n_threads=1))
    side = _MtplibSide(str(pair.trunk), str(pair.sidecar), Case(0), cfg)
    try:
        m = side.run([1, 2, 3, 4], None, **_context("mtplib"))
    finally:
        side.close()

    class FakeServer:
        def complete(self, prompt, n_new):
            return SERVER_RESPONSE

    up = object.__new__(_UpstreamSide)
    up.server, up.argv, up.n_new = FakeServer(), ["llama-server", "-m", "t.gguf"], 64
    u = up.run([1, 2, 3, 4], None, **_context("upstream"))
    for run, engine in ((m, "mtplib"), (u, "upstream")):
        assert isinstance(run, SideRun)
        d = run.to_dict()
        assert list(d) == want[engine]
        assert json.loads(json.dumps(d)) == d and SideRun.from_dict(d) == run
    assert m.n_generated == 6 and len(m.tokens) == 6 and m.time_s and m.argv is None
    assert u.drafted == 58 and u.accepted == 33 and u.argv[0] == "llama-server"
    assert u.time_s is None and u.decode_ms == SERVER_RESPONSE["timings"]["predicted_ms"]
    s = summarize([u, m])[0]
    assert s["upstream_tok_s"] == u.decode_tok_s and s["mtplib_tok_s"] == m.decode_tok_s


def test_an_acceptance_sweep_is_typed_until_it_is_written(pair):
    sw = SweepConfig(ks=[1], rates=[1.0], reps=1, warmup=0)
    cfg = SideBySideConfig(n_new=6, n_prompt=6,
                           settings=DecodeSettings(n_ctx=256, n_threads=1))
    res = acceptance_sweep(str(pair.trunk), str(pair.sidecar), sw, cfg)
    committed = json.loads(SWEEP[0].read_text())["rows"]
    assert {tuple(r) for r in res["rows"]} == {tuple(r) for r in committed}  # keys, order
    assert [r["mode"] for r in res["rows"]] == ["off", "synthetic"]
    assert json.loads(json.dumps(res["rows"])) == res["rows"]
    assert sweep_summary(res["rows"]) == res["summary"]
    assert res["summary"][0]["acceptance"] == 1.0  # rate 1: every draft accepted


def test_a_sweep_run_takes_its_numbers_from_the_metrics():
    g = GenerationMetrics.from_dict(json.loads(json.dumps({
        "k": 1, "n_prompt": 4, "n_generated": 5, "drafted": 4, "accepted": 2,
        "acceptance_rate": 0.5, "accepted_per_position": [0.5],
        "accepted_per_position_counts": [2], "drafted_per_position": [4],
        "accept_len_hist": [2, 2], "verify_steps": 4, "plain_steps": 0, "rollbacks": {},
        "ttft_s": 0.1, "decode_s": 0.4, "decode_tok_s": 10.0,
        "time_s": {"prefill": 0.1, "decode": 0.0, "draft": 0.1, "verify": 0.2,
                   "feed": 0.0, "rollback": 0.0, "other": 0.0}})))
    r = SweepRun.of(g, k=1, rate=0.5, sweep_k=1, rep=0, warmup=False, mode="synthetic",
                    quality_valid=False)
    assert (r.decode_tok_s, r.drafted, r.accepted, r.accepted_per_position) == \
        (10.0, 4, 2, [0.5])
    assert len(r.loadavg) == 3 and SweepRun.from_dict(r.to_dict()) == r


def test_a_tls_overhead_run_is_typed_until_it_is_written():
    """A short real comparison (local shards, plain and behind TLS gateways): rows typed,
    the file's rows round-trip, the summary recomputes from them."""
    res = T.run([0.0], reps=1, n_prompts=2, n_new=6, prompt_len=16, log=lambda s: None)
    data = json.loads(json.dumps(res))  # as tls_overhead.json holds it
    assert [list(r) for r in data["rows"]] == [[
        "transport", "rtt_ms", "prompt", "rep", "tokens", "decode_tok_s", "waits_per_step",
        "seam_bytes", "transport_metric"]] * 4
    typed = [T.TlsRun.from_dict(r) for r in data["rows"]]
    assert [t.to_dict() for t in typed] == data["rows"]
    assert sorted(t.transport for t in typed) == ["plaintext", "plaintext", "tls", "tls"]
    assert {t.transport_metric for t in typed if t.transport == "tls"} == {"tls"}
    assert json.loads(json.dumps(T.summarize(typed))) == data["summary"]
    s = data["summary"][0]
    assert s["tokens_identical"] and s["waits_per_step_identical"]
    assert s["plaintext"]["n"] == s["tls"]["n"] == 2 and s["paired_ratio"]["n"] == 2
    assert T.summary_line(data["rows"], 0.0).startswith("plaintext median")


def test_upstream_completion_is_the_upstream_rows_measured_part():
    c = U.parse_completion(SERVER_RESPONSE)
    up = next(r for r in json.loads(SIDE[0].read_text())["rows"] if r["engine"] == "upstream")
    assert set(vars(c)) == set(list(up)[:9])  # the committed row's first nine keys
