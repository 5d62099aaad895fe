"""Hidden-state integrity: upstream's h_nextn rows checked against the captured tensor.

Observed on the tiny fixture (preset tiny, seed 0, E=128) with the pinned upstream: the
API rows are wrong with n_ubatch 7 in every kv/flash-attention combination, with masked
rows at the default n_ctx 2048, and in many other configurations; the default
configuration with unmasked rows is right (evidence/upstream-bugs/hidden-matrix.json).
A re-reserve of the scheduler (`force_reserve`) repairs them. These tests pin those
observations, which are the stock build's: with the full patch set (patches/0004 copies the
residual stream onto each device, changing the graph) the API rows come out right in the
failing configurations too, so the module runs on stock (`.ci/run` runs it a second time
with MTPLIB_UPSTREAM=stock) and is skipped on the patched default.
"""

import json
import subprocess
import sys

import numpy as np
import pytest

from mtplib.runtime import build_info
from mtplib.runtime.hidden_check import check_hidden, decide, hidden_matrix, logits_consistent
from mtplib.runtime.model import Context, ContextConfig, Model
from mtplib.runtime.row_source import choose_row_source, clear_cache
from mtplib.runtime.rows import CapturedRows, CaptureError, HeadWeights, read_rows

pytestmark = pytest.mark.skipif(
    build_info()["build"] != "stock",
    reason="pins the stock build's wrong-row observations; .ci/run runs it with "
           "MTPLIB_UPSTREAM=stock")

# one thread: the outcome is the same with 1 and 2 (hidden-matrix runs), and ggml's spinning
# workers make 2 threads many times slower when other processes share the 2 cores
BAD = {"kv_type": "f32", "flash_attn": "off", "n_ubatch": 7, "n_ctx": 512, "n_threads": 1}
GOOD = {"n_threads": 1}  # else the defaults: n_ctx 2048, n_batch = n_ubatch = 512, f16, FA auto


@pytest.fixture(scope="module")
def trunk(pair):
    with Model(pair.trunk) as m:
        yield m


@pytest.fixture(scope="module")
def head(pair):
    return HeadWeights(pair.trunk)


def test_known_failing_config_is_reported(trunk, head):
    r = check_hidden(trunk, BAD, 7, False, head=head)
    assert r["capture_ok"], r["capture_problems"]
    assert r["api_rows_ok"] is False
    prompt = r["decodes"][0]
    assert (prompt["n_rows"], prompt["bad_rows"]) == (7, 7)  # every row of the 7-token decode
    assert all(d["bad_rows"] > 0 for d in r["decodes"])  # and in every follow-up decode
    assert r["max_abs_diff"] > 1.0
    # the captured rows give upstream's logits through the head; the API rows do not
    assert r["capture_logits_max_diff"] < 1e-4
    assert r["api_logits_max_diff"] > 1.0
    assert r["config"]["n_ubatch"] == 7 and r["config"]["kv_type"] == "f32"


def test_default_config_passes(trunk, head):
    for n in (7, 300):
        r = check_hidden(trunk, GOOD, n, False, head=head, probe_fix=False)
        assert r["capture_ok"] and r["api_rows_ok"], r
        assert r["bad_rows"] == 0 and r["max_abs_diff"] == 0.0
        assert r["n_rows"] == n + 18  # prompt + follow-ups of 1, 2, 3, 4 and 8 tokens
        assert r["config"]["n_ctx"] == 2048 and r["config"]["n_ubatch"] == 512


def test_masked_rows_fail_at_the_default_config_but_not_at_n_ctx_512(trunk, head):
    r = check_hidden(trunk, GOOD, 7, True, head=head, probe_fix=False)
    assert r["capture_ok"] and not r["api_rows_ok"] and r["bad_rows"] > 0
    r = check_hidden(trunk, {"n_ctx": 512, "n_threads": 1}, 7, True, head=head, probe_fix=False)
    assert r["capture_ok"] and r["api_rows_ok"] and r["n_rows"] == 14


def test_reserve_workaround_repairs_the_api_rows(trunk, head):
    r = check_hidden(trunk, BAD, 7, False, head=head, probe_fix=True)
    assert not r["api_rows_ok"] and r["reserve_fix_ok"] is True
    r = check_hidden(trunk, BAD, 7, False, head=head, reserve=True)
    assert r["api_rows_ok"] and r["capture_ok"] and r["config"]["reserve"]


def test_choose_row_source_captured_on_failing_api_on_default(pair):
    clear_cache()
    bad = choose_row_source(pair.trunk, ContextConfig(**BAD, nextn_rows="all"))
    assert bad.mode == "captured", bad.reason
    assert bad.report["config"]["n_tokens"] > 2 * 7  # the prompt spans several ubatches
    fixed = choose_row_source(pair.trunk, ContextConfig(**BAD, nextn_rows="all"), reserve=True)
    assert fixed.mode == "api", fixed.reason
    good = choose_row_source(pair.trunk, ContextConfig(**GOOD, nextn_rows="all"))
    assert good.mode == "api", good.reason
    assert good.report["config"]["n_tokens"] == 2 * 512 + 3
    # once per configuration: the second call is answered from the cache
    assert choose_row_source(pair.trunk, ContextConfig(**GOOD, nextn_rows="all")) is good


def test_row_source_key_is_complete_and_kept_on_disk(pair, monkeypatch):
    """swa_full and n_seq_max are part of the key (a check made with one setting says
    nothing about the other), and a decision made once is read back from disk by a new
    process instead of being checked again."""
    from mtplib.runtime import hidden_check, row_source

    clear_cache(disk=True)
    calls = []
    real = hidden_check.check_hidden

    def counting(*a, **kw):
        calls.append(a[1])
        return real(*a, **kw)

    monkeypatch.setattr(hidden_check, "check_hidden", counting)
    base = dict(GOOD, nextn_rows="all")
    d1 = choose_row_source(pair.trunk, ContextConfig(**base))
    assert len(calls) == 1
    choose_row_source(pair.trunk, ContextConfig(**base, swa_full=False))
    choose_row_source(pair.trunk, ContextConfig(**base, n_seq_max=2))
    assert len(calls) == 3 and not calls[1].swa_full and calls[2].n_seq_max == 2
    clear_cache()  # a new process: nothing in memory
    d2 = choose_row_source(pair.trunk, ContextConfig(**base))
    assert len(calls) == 3 and (d2.mode, d2.reason) == (d1.mode, d1.reason)
    assert len(list(row_source._cache_dir().glob("*.json"))) == 3
    # the rows-only decodes of a client-side head are part of the unmasked check
    assert [3, "none"] in d1.report["config"]["followups"]


def test_choose_row_source_fails_closed(pair):
    # a context too small for the check: the check raises, the decision is unsupported
    d = choose_row_source(pair.trunk, ContextConfig(n_ctx=8, n_threads=1, nextn_rows="all"),
                          use_cache=False)
    assert d.mode == "unsupported" and "n_ctx" in d.reason
    assert decide({"capture_ok": False, "capture_problems": ["x"], "api_rows_ok": True,
                   "n_rows": 5})[0] == "unsupported"
    assert decide({"capture_ok": True, "api_rows_ok": False, "n_rows": 0})[0] == "unsupported"


def test_captured_rows_equal_api_rows_on_good_config(trunk):
    cap = CapturedRows(trunk.n_embd_out)
    cfg = ContextConfig(n_ctx=512, n_ubatch=64, n_threads=1, nextn_rows="all")
    toks = [int(x) for x in np.random.default_rng(1).integers(0, 256, 150)]
    with cap.open(trunk, cfg) as ctx:
        ctx.decode(toks, range(150), logits=[False] * 149 + [True])
        assert cap.n_fired == 3  # one firing per ubatch (64 + 64 + 22), in order
        got = cap.take(150)
        api = ctx.nextn_rows(150)
        assert got.shape == (150, 512) and got.dtype == np.float32
        np.testing.assert_allclose(got, api, atol=1e-5, rtol=0)
        ctx.decode([5], [150], logits=True)
        np.testing.assert_allclose(read_rows("captured", ctx, cap, 1),
                                   read_rows("api", ctx, None, 1), atol=1e-5, rtol=0)


def test_captured_masked_rows_are_output_rows(trunk):
    cap = CapturedRows(trunk.n_embd_out)
    cfg = ContextConfig(n_ctx=512, n_threads=1, nextn_rows="masked")  # a good config
    with cap.open(trunk, cfg) as ctx:
        ctx.decode(list(range(10)), range(10), logits=[i in (3, 9) for i in range(10)])
        got = cap.take(2)
        assert got.shape == (2, 512)
        np.testing.assert_allclose(got, ctx.nextn_rows(2), atol=1e-5, rtol=0)


def test_take_refuses_a_wrong_count(trunk):
    cap = CapturedRows(trunk.n_embd_out)
    with cap.open(trunk, ContextConfig(n_ctx=256, n_threads=1, nextn_rows="all")) as ctx:
        ctx.decode([1, 2, 3], range(3), logits=True)
        with pytest.raises(CaptureError, match="captured 3 h_nextn rows, expected 4"):
            cap.take(4)
    # without nextn rows upstream has no h_nextn node: nothing is captured
    cap2 = CapturedRows(trunk.n_embd_out)
    with Context(trunk, ContextConfig(n_ctx=256, n_threads=1), cb_eval=cap2.callback) as ctx:
        ctx.decode([1, 2, 3], range(3), logits=True)
        with pytest.raises(CaptureError, match="captured 0"):
            cap2.take(3)


def test_head_recompute_tells_right_rows_from_wrong(trunk, head):
    cap = CapturedRows(trunk.n_embd_out)
    with cap.open(trunk, ContextConfig(n_ctx=256, n_threads=1, nextn_rows="all")) as ctx:
        ctx.decode(list(range(6)), range(6), logits=True)
        rows = cap.take(6)
        logits = np.stack([ctx.logits(i) for i in range(6)])
    diff, scale = head.compare(rows, logits)
    assert logits_consistent(diff, scale) and diff < 1e-4
    shifted, _ = head.compare(np.roll(rows, 1, axis=0), logits)  # rows one position off
    assert not logits_consistent(shifted, scale)
    noisy, _ = head.compare(rows + 0.5 * np.random.default_rng(0).standard_normal(rows.shape),
                            logits)
    assert not logits_consistent(noisy, scale)


def test_matrix_subset(trunk):
    rows = hidden_matrix(trunk, kv_types=("f32",), flash_attn=("off",), ubatches=(7, 512),
                         masked=(False,), prompt_lengths=(7,), n_ctxs=(512,), n_threads=1,
                         probe_fix=False)
    assert [(r["n_ubatch"], r["api_rows_ok"], r["mode"]) for r in rows] == [
        (7, False, "captured"), (512, True, "api")]
    assert rows[0]["bad_rows_prompt"] == rows[0]["n_rows_prompt"] == 7


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "mtplib.cli", "check-hidden", *map(str, args)],
                          capture_output=True, text=True, timeout=120)


def test_cli_check_hidden(pair, tmp_path):
    r = _cli(pair.trunk, "--kv-type", "f32", "--flash-attn", "off", "--ubatch", 7,
             "--tokens", 7, "--threads", 1, "--json")
    assert r.returncode == 1, r.stderr
    rep = json.loads(r.stdout)
    assert {"api_rows_ok", "bad_rows", "max_abs_diff", "capture_ok", "config"} <= set(rep)
    assert rep["api_rows_ok"] is False and rep["capture_ok"] is True
    ok = _cli(pair.trunk, "--threads", 1, "--json")
    assert ok.returncode == 0 and json.loads(ok.stdout)["api_rows_ok"] is True
    out = tmp_path / "m.json"
    m = _cli(pair.trunk, "--matrix", "--matrix-kv", "f16", "--matrix-fa", "on",
             "--matrix-ubatch", "7", "--matrix-masked", "unmasked", "--matrix-tokens", 7,
             "--matrix-ctx", 512, "--out", out)
    assert m.returncode == 0, m.stderr
    saved = json.loads(out.read_text())
    assert saved["n_configs"] == 1 and saved["n_affected"] == 1
    assert saved["rows"][0]["bad_rows_prompt"] == 7
    bad = _cli(tmp_path / "none.gguf")
    assert bad.returncode == 2 and "not found" in bad.stderr


def test_head_weights_find_root_tensors_in_split_files(tmp_path):
    from mtplib.runtime.rows import _split_siblings

    for i in (1, 2, 3):
        (tmp_path / f"m-{i:05d}-of-00003.gguf").touch()
    assert [p.name for p in _split_siblings(tmp_path / "m-00002-of-00003.gguf")] == [
        "m-00001-of-00003.gguf", "m-00003-of-00003.gguf"]
    assert _split_siblings(tmp_path / "m.gguf") == []
