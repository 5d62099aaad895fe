"""Side-by-side with upstream (issue 7): CI-safe parts only (nothing builds upstream).

Parsers against recorded upstream outputs, the A/B order, the upstream flags, the
synthetic-acceptance semantics (upstream's --spec-synth-rates) and the v4-ratio-cpu preset.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from mtplib.lab import upstream_tools as U
from mtplib.lab.sidebyside.cases import (
    SideBySideConfig,
    ab_order,
    make_cases,
    parse_rates,
    rates_for_k,
)
from mtplib.lab.sidebyside.cost import cost_ratio_table
from mtplib.lab.sidebyside.measure import EVIDENCE_DIR, evidence_dir, save
from mtplib.lab.sidebyside.runs import SideRun, summarize, table
from mtplib.lab.sidebyside.sweep import break_even
from mtplib.model.arch import sidecar_tensors, trunk_tensors
from mtplib.model.presets import V4_FLASH, V4_FLASH_RATIOS, get_preset
from mtplib.runtime.drafters import SyntheticDrafter
from mtplib.runtime.settings import DecodeSettings

# -- recorded upstream outputs (llama-server at the pinned commit, v4-ratio-cpu seed 0) --
#: /completion response of a k=2 run with --spec-synth-rates 0.77,0.37, seed 0, 64 tokens,
#: 32-token prompt (threads 2 on a loaded machine: hence the low tok/s); keys and tokens
#: trimmed
SERVER_RESPONSE = {
    'timings': {
        'cache_n': 0, 'prompt_n': 32,
        'prompt_ms': 24285.631, 'prompt_per_token_ms': 758.92596875,
        'prompt_per_second': 1.3176515775933513,
        'predicted_n': 64, 'predicted_ms': 40951.698, 'predicted_per_token_ms': 650.0269523809524,
        'predicted_per_second': 1.538397748488964,
        'draft_n': 58, 'draft_n_accepted': 33},
    'tokens_predicted': 64,
    'tokens_evaluated': 32,
    'stop_type': 'limit',
    'truncated': False,
    'tokens': [363, 384, 106, 288, 479, 68, 272, 9],
}
#: llama-server's print_timings block for the same request (its log), line-wrapped
SERVER_LOG = (
    '0.00.228.701 W spec common_specu: synthetic speculative acceptance is enabled for '
    'benchmarking; generated output is not valid\n'
    '0.00.228.720 I spec common_specu: synthetic acceptance: n_max = 2, mean length = 2.140000,'
    ' rates = [0.77, 0.37]\n'
    '0.15.353.535 I slot print_timing: id  0 | task 0 | prompt processing, n_tokens =     28, '
    'progress = 0.88, t =  13.86 s / 2.02 tokens per second\n'
    '1.06.020.769 I slot print_timing: id  0 | task 0 | prompt eval time =   24285.63 ms /    '
    '32 tokens (  758.93 ms per token,     1.32 tokens per second)\n'
    '1.06.020.780 I slot print_timing: id  0 | task 0 |        eval time =   40951.70 ms /    '
    '64 tokens (  650.03 ms per token,     1.54 tokens per second)\n'
    '1.06.020.781 I slot print_timing: id  0 | task 0 |       total time =   65237.33 ms /    '
    '96 tokens\n'
    '1.06.020.783 I slot print_timing: id  0 | task 0 |    graphs reused =         28\n'
    '1.06.020.787 I slot print_timing: id  0 | task 0 | draft acceptance = 0.56897 (   33 '
    'accepted /    58 generated), mean len =  2.14\n'
)
CLI_LINE = "\n[ Prompt: 1234.5 t/s | Generation: 87.6 t/s ]\n"


def test_parse_completion_recorded():
    r = U.parse_completion(SERVER_RESPONSE)
    t = SERVER_RESPONSE["timings"]
    assert isinstance(r, U.Completion)
    assert r.decode_tok_s == pytest.approx(t["predicted_per_second"])
    assert r.n_generated == t["predicted_n"] and r.prompt_n == t["prompt_n"]
    assert r.drafted == t["draft_n"] and r.accepted == t["draft_n_accepted"]
    assert r.acceptance_rate == pytest.approx(t["draft_n_accepted"] / t["draft_n"])
    assert r.tokens == SERVER_RESPONSE["tokens"] and r.decode_ms == t["predicted_ms"]
    # upstream's decode tok/s is (n - 1) steps over the decode time: mtplib's definition
    assert r.decode_tok_s == pytest.approx((t["predicted_n"] - 1) / t["predicted_ms"] * 1e3,
                                           rel=1e-6)


def test_parse_completion_plain_and_missing_timings():
    r = U.parse_completion({"timings": {"predicted_per_second": 50.0, "predicted_n": 8},
                            "tokens": [1, 2]})
    assert r.drafted == 0 and r.acceptance_rate is None and r.tokens == [1, 2]
    with pytest.raises(U.UpstreamToolError):
        U.parse_completion({"content": "x"})


def _simulate_counts(rates, k, n_new, seed=0):
    """Upstream's synthetic loop, counts only: draft min(k, n_remaining - 1) tokens per step
    (server get_n_draft_max), accept by the drawn length, emit accepted + 1."""
    d = SyntheticDrafter([0], 1, rates, n_vocab=4, seed=seed)
    n, drafted, accepted = 1, 0, 0  # the first token comes from the prefill
    while n < n_new:
        kk = min(k, n_new - n - 1)
        if kk == 0:
            n += 1
            continue
        acc = d.draw_accept_len(kk)
        drafted, accepted, n = drafted + kk, accepted + acc, n + acc + 1
    return drafted, accepted


def test_synthetic_counts_equal_upstreams_recorded_run():
    # the recorded upstream run above: same seed, same rates -> the same acceptance pattern
    t = SERVER_RESPONSE["timings"]
    assert _simulate_counts([0.77, 0.37], 2, 64) == (t["draft_n"], t["draft_n_accepted"])
    # llama-server, k=3, --spec-synth-rates 0.77,0.37,0.37, seed 0, 64 tokens: 37 / 75
    assert _simulate_counts([0.77, 0.37, 0.37], 3, 64) == (75, 37)


def test_parse_server_log_and_cli_line():
    rows = U.parse_server_log(SERVER_LOG)
    assert len(rows) == 1
    t = SERVER_RESPONSE["timings"]
    assert rows[0].decode_tok_s == pytest.approx(t["predicted_per_second"], abs=0.006)
    assert rows[0].drafted == t["draft_n"] and rows[0].accepted == t["draft_n_accepted"]
    assert rows[0].n_generated == t["predicted_n"] and rows[0].acceptance_rate == 0.56897
    # MTP off: no draft acceptance line, the counts are None
    plain = U.parse_server_log(SERVER_LOG.rsplit("\n", 2)[0] + "\n")
    assert len(plain) == 1 and plain[0].drafted is None and plain[0].acceptance_rate is None
    assert U.parse_cli_timings(CLI_LINE) == U.CliTimings(prompt_tok_s=1234.5,
                                                          decode_tok_s=87.6)
    assert U.parse_cli_timings("no timings here") is None


def test_upstream_flags_and_sidecar_as_draft_model():
    assert U.spec_args(None, 0, None) == []
    a = U.spec_args("mtp-x.gguf", 2, [0.77, 0.37])
    assert a == ["--spec-type", "draft-mtp", "-md", "mtp-x.gguf", "--spec-draft-n-max", "2",
                 "--spec-synth-rates", "0.77,0.37"]
    with pytest.raises(U.UpstreamToolError, match="needs 3 values"):
        U.spec_args("mtp-x.gguf", 3, [0.77, 0.37])
    with pytest.raises(U.UpstreamToolError):
        U.spec_args(None, 0, [1.0])
    argv = U.ServerConfig(model="t.gguf", mtp="mtp-t.gguf", k=1,
                          settings=DecodeSettings(n_threads=2, n_ctx=1024)) \
        .argv(U.tool_path("llama-server"), 8080)
    for flag, val in (("-t", "2"), ("-tb", "2"), ("-c", "1024"), ("-np", "1"),
                      ("-md", "mtp-t.gguf")):
        assert argv[argv.index(flag) + 1] == val
    body = U.completion_body([5, 6, 7], 16, seed=3)
    assert body["prompt"] == [5, 6, 7] and body["n_predict"] == 16
    assert body["cache_prompt"] is False and body["temperature"] == 0.0 and body["seed"] == 3


def test_ab_order_interleaves_and_warms_up_first():
    order = ab_order(5, warmup=1)
    assert order[:2] == [(None, "upstream"), (None, "mtplib")]
    measured = order[2:]
    assert Counter(e for _, e in measured) == {"upstream": 5, "mtplib": 5}
    firsts = [measured[2 * i][1] for i in range(5)]
    assert firsts == ["upstream", "mtplib", "upstream", "mtplib", "upstream"]
    for i in range(5):  # each repetition is one pair, back to back
        assert {measured[2 * i][0], measured[2 * i + 1][0]} == {i}
    with pytest.raises(ValueError):
        ab_order(0)


def test_cases_and_rates():
    assert parse_rates("0.77, 0.37") == [0.77, 0.37]
    for bad in ("1.5", "0.3,0.5", "x", ""):
        with pytest.raises(ValueError):
            parse_rates(bad)
    assert rates_for_k([0.77, 0.37], 1) == [0.77]
    assert rates_for_k([0.77, 0.37], 3) == [0.77, 0.37, 0.37]
    cases = make_cases([1, 2], [(0.0,), (0.77, 0.37)])
    assert [c.label for c in cases] == ["plain", "k=1 mtp", "k=1 synth 0", "k=1 synth 0.77",
                                        "k=2 mtp", "k=2 synth 0,0", "k=2 synth 0.77,0.37"]
    assert not cases[1].synthetic and cases[2].synthetic


# -- synthetic acceptance: upstream's semantics ------------------------------------------
def test_synthetic_rng_is_upstreams_mt19937_uniform():
    # std::mt19937 g; g.seed(0); std::uniform_real_distribution<double> d(0, 1): first four
    # values of d(g) with libstdc++ (g++ 12), recorded
    d = SyntheticDrafter([0], 1, [1.0], n_vocab=4, seed=0)
    got = [d._uniform() for _ in range(4)]
    assert got == [0.59284461651668263, 0.84426574425659828, 0.85794561998982988,
                   0.84725173738433124]


def test_synthetic_conditional_probabilities():
    d = SyntheticDrafter([0], 1, [0.77, 0.37], n_vocab=4)
    assert d.conditional(2) == pytest.approx([0.77, 0.37 / 0.77])
    assert d.conditional(3) == pytest.approx([0.77, 0.37 / 0.77, 1.0])  # padded with 0.37
    assert SyntheticDrafter([0], 1, [0.0, 0.0], n_vocab=4).conditional(2) == [0.0, 0.0]
    with pytest.raises(ValueError, match="non-increasing"):
        SyntheticDrafter([0], 1, [0.3, 0.5], n_vocab=4)
    with pytest.raises(ValueError):
        SyntheticDrafter([0], 1, [1.2], n_vocab=4)


def test_synthetic_rates_are_unconditional_per_position():
    d = SyntheticDrafter([0], 1, [0.77, 0.37, 0.2], n_vocab=4, seed=7)
    n = 20000
    lens = [d.draw_accept_len(3) for _ in range(n)]
    for i, rate in enumerate([0.77, 0.37, 0.2]):  # P(position i accepted) = rates[i]
        assert sum(L > i for L in lens) / n == pytest.approx(rate, abs=0.015)


def test_synthetic_proposals_and_accept_len():
    ref = [10, 11, 12, 13, 14, 15]
    d = SyntheticDrafter(ref, 2, [1.0, 1.0], n_vocab=100)
    assert d.propose(0, last=9, base=2, k=2) == [11, 12]  # position 3 -> ref[1]
    assert d.accept_len([11, 12, 5], [11, 12]) == 2
    d0 = SyntheticDrafter(ref, 2, [0.0], n_vocab=100)
    assert d0.propose(0, last=9, base=2, k=2) == [12, 13]  # wrong from position 0 on
    assert d0.accept_len([11, 12, 5], [12, 13]) == 0

    class Inner:
        name, needs_rows = "mtp", True
        calls: list = []

        def propose(self, seq, last, base, k):
            self.calls.append(("propose", base, k))
            return [1] * k

        def prefill(self, *a):
            self.calls.append(("prefill",))

        def commit(self, *a):
            self.calls.append(("commit",))

        def truncate(self, *a):
            self.calls.append(("truncate",))

    inner = Inner()
    di = SyntheticDrafter(ref, 2, [1.0], n_vocab=100, inner=inner)
    assert di.needs_rows and di.name == "synthetic+mtp" and di.synthetic
    di.prefill(0, [1, 2], None)
    assert di.propose(0, 9, 2, 3) == [1, 1, 1]  # the inner drafter's tokens, as upstream
    assert di.accept_len([7, 7, 7, 7], [1, 1, 1]) == 3  # accepted whatever the target says
    di.commit(0, 2, [9, 1, 1, 1], None)
    assert [c[0] for c in inner.calls] == ["prefill", "propose", "commit"]


# -- summaries and tables ----------------------------------------------------------------
def _rows() -> list[SideRun]:
    rows = []
    for case, k, synth in (("plain", 0, False), ("k=2 synth 1,1", 2, True)):
        for rep, engine in ab_order(3):
            tps = (100.0 if engine == "upstream" else 90.0) + (rep or 0)
            own = ({"decode_ms": 20.0, "prompt_n": 3, "prompt_tok_s": 50.0, "argv": ["x"]}
                   if engine == "upstream" else {"time_s": {"decode": 0.1},
                                                 "hidden_rows": "all"})
            rows.append(SideRun(
                case=case, k=k, rates=[1.0, 1.0] if synth else None, synthetic=synth,
                engine=engine, rep=rep, warmup=rep is None,
                decode_tok_s=tps if rep is not None else 1.0, n_generated=3,
                drafted=10 if k else 0, accepted=10 if k else 0,
                acceptance_rate=1.0 if k else None, tokens=[1, 2, 3],
                loadavg_before=[2.0, 0, 0], loadavg_after=[2.5, 0, 0],
                quality_valid=not synth, **own))
    return rows


def test_summarize_ratio_excludes_warmup(tmp_path):
    s = summarize(_rows())
    assert summarize([r.to_dict() for r in _rows()]) == s  # rows read back from a file
    assert [r["case"] for r in s] == ["plain", "k=2 synth 1,1"]
    assert s[0]["upstream_tok_s"] == 101.0 and s[0]["mtplib_tok_s"] == 91.0
    assert s[0]["ratio"] == pytest.approx(91 / 101) and s[0]["runs"] == 3
    assert s[0]["tokens_equal"] is True and s[1]["mtplib_acceptance"] == 1.0
    assert s[0]["loadavg_1m_min_max"] == [2.0, 2.5]
    p = save({"summary": s, "rows": [r.to_dict() for r in _rows()]}, tmp_path / "r.json")
    df = table(p)
    assert list(df["case"]) == ["plain", "k=2 synth 1,1"] and "ratio" in df


def test_break_even_interpolates():
    summ = [{"k": 1, "rate": r, "speedup": sp} for r, sp in
            ((0.0, 0.8), (0.5, 0.9), (1.0, 1.3))]
    be = break_even(summ)[0]
    assert be["break_even_rate"] == pytest.approx(0.5 + 0.1 / 0.4 * 0.5)
    assert be["max_speedup"] == 1.3
    never = break_even([{"k": 2, "rate": r, "speedup": 0.5} for r in (0.0, 1.0)])[0]
    assert never["break_even_rate"] is None and "not reached" in never["note"]


# -- the v4-ratio-cpu preset ---------------------------------------------------------------
def test_v4_ratio_cpu_preset_structure():
    c = get_preset("v4-ratio-cpu").validate()
    assert c.n_layer == 43 and c.n_mtp == 1 and c.n_blocks == V4_FLASH.n_blocks
    assert c.compress_ratios == V4_FLASH_RATIOS == V4_FLASH.compress_ratios
    r = c.compress_ratios
    assert r[:2] == (0, 0) and r[43] == 0  # two SWA-only layers; the MTP block
    assert all(r[i] == (4 if i % 2 == 0 else 128) for i in range(2, 43))  # CSA/HCA alternate
    assert c.n_hash_layers == 3 == V4_FLASH.n_hash_layers
    assert c.indexer_dim != c.head_dim  # equal crashes MTP context creation upstream
    assert c.sliding_window == V4_FLASH.sliding_window
    assert c.indexer_top_k == V4_FLASH.indexer_top_k
    assert not c.extra.get("weightless")
    trunk_mb = sum(t.nbytes for t in trunk_tensors(c)) / 1e6
    side_mb = sum(t.nbytes for t in sidecar_tensors(c)) / 1e6
    assert trunk_mb + side_mb < 100


def test_v4_ratio_cpu_measured_ratio_recorded():
    from mtplib.model.presets import V4_RATIO_CPU_MEASURED as m

    assert 1 / 60 < m["ratio_mtp_over_trunk"] < 1 / 30
    assert m["command"] and m["loadavg"]


# -- the committed results, as notebook 04 shows them ---------------------------------------
def test_evidence_dir_resolves_from_repo_root(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # a notebook's working directory is not the repo root
    assert evidence_dir("evidence/side-by-side") == EVIDENCE_DIR
    assert evidence_dir(tmp_path) == tmp_path
    assert (EVIDENCE_DIR / "README.md").is_file()


def test_cost_ratio_table_matches_the_preset_record():
    from mtplib.model.presets import V4_RATIO_CPU_MEASURED as m

    t = cost_ratio_table([EVIDENCE_DIR / "cost-ratio-v4-ratio-cpu-t2.json",
                          EVIDENCE_DIR / "cost-ratio-tiny-t2.json"])
    ratio = t.set_index("file")["ratio_mtp_over_trunk"]
    assert ratio["cost-ratio-v4-ratio-cpu-t2.json"] == pytest.approx(
        m["ratio_mtp_over_trunk"], abs=1e-4)
    assert ratio["cost-ratio-tiny-t2.json"] > 0.15  # the tiny fixture: MTP ~ 1/5 of a step
    assert list(t["threads"]) == [2, 2]


def test_committed_side_by_side_tables_load():
    files = sorted(EVIDENCE_DIR.glob("sbs-*.json"))
    assert files
    for p in files:
        t = table(p)
        assert "plain" in set(t["case"])
        assert t["ratio"].notna().all()


def test_swa_full_is_the_same_on_both_sides():
    cfg = SideBySideConfig()
    assert cfg.settings.swa_full is False and cfg.to_dict()["swa_full"] is False  # server's
    assert U.ServerConfig(model="m.gguf").settings.swa_full is False
    off = U.ServerConfig(model="m.gguf").argv(Path("llama-server"), 1)
    on = U.ServerConfig(model="m.gguf", settings=DecodeSettings(swa_full=True)) \
        .argv(Path("llama-server"), 1)
    assert "--swa-full" not in off and "--swa-full" in on


def test_config_records_the_committed_keys_and_one_settings_reach_both_sides():
    """The recorded config keeps the keys (and order) of the committed results, and the
    one DecodeSettings is what llama-server's argv is built from."""
    import json

    committed = json.loads((EVIDENCE_DIR / "sbs-v4-ratio-cpu-t2-run4-swaoff.json")
                           .read_text())["config"]
    cfg = SideBySideConfig(ks=(1, 2, 3), runs=7)
    assert cfg.to_dict() == committed
    assert list(cfg.to_dict()) == list(committed)
    s = DecodeSettings(n_ctx=512, n_batch=64, n_ubatch=32, n_threads=3, kv_type="q8_0",
                       flash_attn="on", swa_full=True)
    d = SideBySideConfig(settings=s).to_dict()
    assert (d["threads"], d["n_ctx"], d["n_batch"], d["n_ubatch"], d["kv_type"],
            d["flash_attn"], d["swa_full"]) == (3, 512, 64, 32, "q8_0", "on", True)
    argv = U.ServerConfig(model="m.gguf", settings=s).argv(Path("llama-server"), 1)
    for flag, val in (("-t", "3"), ("-tb", "3"), ("-c", "512"), ("-b", "64"), ("-ub", "32"),
                      ("-ctk", "q8_0"), ("-ctv", "q8_0"), ("-fa", "on")):
        assert argv[argv.index(flag) + 1] == val
    assert "--swa-full" in argv
