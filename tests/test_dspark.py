"""DSpark drafting on the whole model: the tiny trunk with its random-weight DSpark draft.

Random weights accept almost nothing, so exactness is the point here: greedy output with
DSpark equals drafting off token for token (any draft length, with and without the
confidence cut), alone and in a batch; the draft cache holds committed positions only, so
a sequence that drafted and rolled back drafts next as one that never drafted; and an
oracle proposer on the same injection path proves the acceptance accounting.
"""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from mtplib.model.dspark.fixture import dspark_name, write_dspark, write_dspark_fixture
from mtplib.runtime.dspark.drafter import DSparkDrafter
from mtplib.runtime.model import RuntimeInputError
from mtplib.runtime.speculative import MTPRuntime
from mtplib.stamps import sha256_file

PROMPTS = [[1, 5, 9, 33, 7, 2, 100, 3], [200, 17], [42] * 12, [7]]
N_NEW = 20
OPTS = dict(n_ctx=256, n_threads=1)


@pytest.fixture(scope="module")
def plain(dspark):
    """Drafting off: each prompt's greedy continuation."""
    pair, _ = dspark
    with MTPRuntime(str(pair.trunk), None, **OPTS) as rt:
        return [rt.generate(p, N_NEW)[0] for p in PROMPTS]


def test_fixture_same_seed_same_bytes_other_seed_other_bytes(tmp_path, dspark):
    _, path = dspark
    again = write_dspark_fixture(tmp_path / "a", seed=0)
    assert again.name == path.name == dspark_name("tiny", 0) == "dspark-v4-tiny-s0.gguf"
    assert sha256_file(again) == sha256_file(path)
    other = write_dspark_fixture(tmp_path / "b", seed=1)
    assert sha256_file(other) != sha256_file(path)
    assert write_dspark_fixture(tmp_path / "a", seed=0) == again  # identical: reused


def test_fixture_cli_writes_the_draft_beside_the_pair(tmp_path):
    from mtplib.errors import InputError

    r = subprocess.run([sys.executable, "-m", "mtplib.cli", "fixture", "--out", str(tmp_path),
                        "--dspark", "--json"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)["dspark"]
    assert d["path"].endswith("dspark-v4-tiny-s0.gguf") and len(d["sha256"]) == 64
    with pytest.raises(InputError, match="weight-less or converter-typed"):
        write_dspark_fixture(tmp_path, preset="v4-flash")


def test_loads_and_drafts(dspark):
    pair, path = dspark
    with MTPRuntime(str(pair.trunk), str(path), k=5, p_min=0.0, **OPTS) as rt:
        assert rt.request.sidecar_kind == "dspark" and rt.opts.k == 5
        d = rt.engine.drafter
        assert isinstance(d, DSparkDrafter) and rt.engine.hidden_rows == "layer_inp"
        assert rt.sidecar.layer_ids == (2, 3, 4) and d.mask == 255 and d.block_size == 5
        s = rt.engine.open(PROMPTS[0])
        assert d.n_fed[s.seq] == len(PROMPTS[0])
        assert d.ctx.seq_pos_max(s.seq) == len(PROMPTS[0]) - 1  # every prompt row injected
        drafts = d.propose(s.seq, s.last, s.base, 5)
        assert len(drafts) == 5 and all(0 <= t < 256 for t in drafts)
        conf = d.ctx.confidences(5)  # the last block's confidence head
        assert ((conf > 0) & (conf < 1)).all()
        assert d.ctx.seq_pos_max(s.seq) == s.base - 1  # the block's K is gone again
        mem = rt.memory(s.seq)
        assert mem["dspark_weights_bytes"] > 0 and mem["dspark_seq_state_bytes"] > 0
        rt.engine.close(s)
        assert d.ctx.seq_pos_max(s.seq) == -1


@pytest.mark.parametrize("k,p_min", [(1, 0.0), (2, 0.0), (3, 0.0), (5, 0.0), (3, 0.5),
                                     (5, 0.45)])
def test_greedy_output_equals_drafting_off(dspark, plain, k, p_min):
    pair, path = dspark
    drafted = 0
    with MTPRuntime(str(pair.trunk), str(path), k=k, p_min=p_min, **OPTS) as rt:
        for prompt, ref in zip(PROMPTS, plain, strict=True):
            out, m = rt.generate(prompt, N_NEW)
            assert out == ref, (k, p_min, prompt)
            assert m.hidden_rows == "layer_inp"
            assert m.verify_steps + m.plain_steps == m.n_generated - 1 - m.accepted
            drafted += m.drafted
        counts = rt.engine.drafter.counts
        assert counts["blocks"] > 0 and counts["drafted"] == drafted > 0
        if p_min:  # the confidence head cut some drafts (and not all of them)
            assert 0 < counts["cut"] < counts["blocks"] * k
        else:
            assert counts["cut"] == 0


def test_draft_length_defaults_to_the_block_and_is_clamped(dspark):
    from mtplib.runtime.request import build_request

    pair, path = dspark
    assert build_request(pair.trunk, sidecar=path).draft.k == 5
    assert build_request(pair.trunk, sidecar=path, draft=8).draft.k == 5
    assert build_request(pair.trunk, sidecar=path, draft=2).draft.k == 2


def test_sampled_output_equals_drafting_off(dspark):
    """temperature > 0: position-keyed randomness, so the same tokens for one seed."""
    from mtplib.runtime.sampling import Sampler

    pair, path = dspark
    sm = Sampler(temperature=0.9, top_p=0.95, seed=7)
    with MTPRuntime(str(pair.trunk), None, sampler=sm, **OPTS) as rt:
        ref = rt.generate(PROMPTS[0], N_NEW)[0]
    with MTPRuntime(str(pair.trunk), str(path), k=3, sampler=sm, **OPTS) as rt:
        assert rt.generate(PROMPTS[0], N_NEW)[0] == ref


def test_batch_gives_each_sequence_its_tokens_alone(dspark, plain):
    pair, path = dspark
    with MTPRuntime(str(pair.trunk), str(path), k=3, n_seq_max=4, **OPTS) as rt:
        b = rt.batch()
        firsts = {b.join(p, N_NEW)[0]: i for i, p in enumerate(PROMPTS)}
        while b.active():
            b.step()
        for seq, i in firsts.items():
            tokens, m = b.leave(seq)
            assert tokens == plain[i], i
            assert m.drafted > 0
        d = rt.engine.drafter
        assert d.pad_single  # set by the batch: lone rows are injected padded
        assert d.counts["passes"] < d.counts["blocks"]  # several blocks in one pass
        assert all(d.ctx.seq_pos_max(q) == -1 for q in range(4))  # all freed


def _step_invariant(rt, s) -> None:
    """After a step the draft cache holds exactly the committed, decoded positions."""
    d = rt.engine.drafter
    assert d.n_fed[s.seq] == s.base
    assert d.ctx.seq_pos_max(s.seq) == s.base - 1


def test_rollback_leaves_the_cache_of_a_run_that_never_drafted(dspark):
    """Drafting every step (rejections, tail seq_rm) and then drafting once more gives,
    bitwise, the draft of a fresh run that prefilled the same committed tokens and never
    drafted: the draft cache holds the committed positions' K and nothing else. (Lone rows
    are injected padded in the drafting run, `pad_single`: a one-row decode gives other
    floats than a longer one on CPU, as for the target.)"""
    pair, path = dspark
    prompt, n = PROMPTS[0], 12
    with MTPRuntime(str(pair.trunk), str(path), k=4, **OPTS) as rt:
        d = rt.engine.drafter
        d.pad_single = True
        s = rt.engine.open(prompt)
        while s.metrics.n_generated < n:
            s.step(4)
            _step_invariant(rt, s)
        assert s.metrics.drafted > s.metrics.accepted  # it did roll drafts back
        drafted = d.propose(s.seq, s.last, s.base, 4)
        lg_drafted = d.ctx.logits_all(4)
        tokens = list(s.tokens)
    with MTPRuntime(str(pair.trunk), str(path), k=4, **OPTS) as rt:
        d = rt.engine.drafter
        s = rt.engine.open(tokens[:-1])  # one prefill: every committed row at once
        assert s.last == tokens[-1] and s.metrics.drafted == 0
        _step_invariant(rt, s)
        never = d.propose(s.seq, s.last, s.base, 4)
        lg_never = d.ctx.logits_all(4)
    assert drafted == never
    assert np.array_equal(lg_drafted, lg_never)


class OracleDSpark(DSparkDrafter):
    """Runs DSpark's block (and its removal) every step, then proposes the known greedy
    continuation instead of the block's picks: every draft is accepted."""

    reference: list[int] = []
    n_prompt = 0

    def propose_many(self, asks):
        real = super().propose_many(asks)
        out = []
        for (_seq, _last, base, k), r in zip(asks, real, strict=True):
            i = base + 1 - self.n_prompt
            out.append(self.reference[i:i + len(r)] if k else [])
        return out


def test_acceptance_accounting_with_an_oracle_on_the_injection_path(dspark, plain):
    pair, path = dspark
    prompt, ref = PROMPTS[0], plain[0]
    with MTPRuntime(str(pair.trunk), str(path), k=3, **OPTS) as rt:
        d = rt.engine.drafter
        d.__class__ = OracleDSpark
        d.reference, d.n_prompt = ref, len(prompt)
        s = rt.engine.open(prompt)
        while s.metrics.n_generated < N_NEW - 4:
            s.step(3)
            _step_invariant(rt, s)  # k+1 committed rows injected per step
        m = s.metrics
        assert s.tokens[len(prompt):] == ref[:m.n_generated]
        assert m.drafted == 3 * m.verify_steps and m.accepted == m.drafted > 0
        assert m.accept_len_hist[3] == m.verify_steps
        rt.engine.close(s)


def test_p_min_needs_the_confidence_head(tmp_path, dspark):
    from dataclasses import replace

    from mtplib.model.dspark.spec import dspark_config_for
    from mtplib.model.presets import TINY

    pair, _ = dspark
    path = write_dspark(tmp_path / "noconf.gguf", replace(dspark_config_for(TINY),
                                                          confidence_head=False))
    with pytest.raises(RuntimeInputError, match="no confidence head"):
        MTPRuntime(str(pair.trunk), str(path), k=3, p_min=0.5, **OPTS)
    with MTPRuntime(str(pair.trunk), str(path), k=3, **OPTS) as rt:  # p_min 0: runs
        assert len(rt.generate(PROMPTS[1], 6)[0]) == 6


def test_refusals_name_the_option(dspark):
    from mtplib.errors import InputError
    from mtplib.model.fixture import write_fixture
    from mtplib.runtime.request import build_request

    pair, path = dspark
    with pytest.raises(InputError, match="DSpark on the tail shard is not built yet"):
        build_request(pair.trunk, sidecar=path, plan="0-1,2-3", mtp_placement="tail")
    with pytest.raises(InputError, match=r"p_min"):
        build_request(pair.trunk, p_min=0.3)
    with pytest.raises(RuntimeInputError, match=r"p_min \(--draft-p-min\) must be in \[0, 1\]"):
        build_request(pair.trunk, sidecar=path, p_min=1.5)
    mtp = write_fixture(path.parent / "mtp", seed=0).sidecar
    with pytest.raises(InputError, match="DSpark drafting only"):
        build_request(pair.trunk, sidecar=mtp, p_min=0.3)


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "mtplib.cli", *map(str, args)],
                          capture_output=True, text=True, timeout=300)


def test_cli_generate_with_dspark_end_to_end(dspark, plain):
    pair, path = dspark
    toks = ",".join(map(str, PROMPTS[0]))
    r = _cli("generate", "-m", pair.trunk, "-md", path, "--tokens", toks, "-n", N_NEW,
             "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["tokens"] == plain[0]
    m = out["metrics"]
    assert m["hidden_rows"] == "layer_inp" and m["drafted"] > 0
    assert len(m["accepted_per_position"]) == 5  # default draft: the block size
    r = _cli("generate", "-m", pair.trunk, "-md", path, "--tokens", toks, "-n", 4,
             "--spec-type", "draft-dspark", "--spec-draft-p-min", "0.5", "--draft-max", 2,
             "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["tokens"] == plain[0][:4]
    r = _cli("generate", "-m", pair.trunk, "-md", path, "--tokens", toks, "-n", 4,
             "--spec-type", "draft-mtp")
    assert r.returncode == 2
    assert r.stderr.strip().count("\n") == 0 and "give --spec-type draft-dspark" in r.stderr


def test_a_libllama_without_the_four_calls_is_one_clear_error(monkeypatch):
    import types

    from mtplib.runtime.dspark import ext as dspark_ext
    from mtplib.runtime.lib import UpstreamError

    monkeypatch.setattr(dspark_ext, "_cache", {})
    fake = types.SimpleNamespace(_lib=types.SimpleNamespace())  # no symbol at all
    monkeypatch.setattr(dspark_ext, "load", lambda: (fake, None))
    with pytest.raises(UpstreamError, match="lacks llama_set_embeddings_layer_inp"):
        dspark_ext.dspark_ext()


def test_features_are_enabled_before_the_first_decode_only(dspark):
    from mtplib.runtime.dspark.context import TargetFeatures
    from mtplib.runtime.model import Context, ContextConfig, Model

    pair, _ = dspark
    with Model(pair.trunk) as m, Context(m, ContextConfig(n_ctx=256, n_threads=1)) as ctx:
        with pytest.raises(RuntimeInputError, match="outside 0..4"):
            TargetFeatures(ctx, (2, 5), m.n_embd)
        f = TargetFeatures(ctx, (2, 3, 4), m.n_embd)
        with pytest.raises(RuntimeInputError, match="last decode had 0"):
            f.rows(ctx, 1)
        ctx.decode([1, 2, 3], [0, 1, 2])
        rows = f.rows(ctx, 3)
        assert rows.shape == (3, 3 * m.n_embd) and np.isfinite(rows).all()
        with pytest.raises(RuntimeInputError, match="before the target's first decode"):
            TargetFeatures(ctx, (2,), m.n_embd)
