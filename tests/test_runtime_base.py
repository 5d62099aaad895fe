"""The fixture runs in upstream; bad inputs give clear errors and never kill the process."""

import numpy as np
import pytest

from mtplib.model.gguf_header import ModelFileError
from mtplib.runtime.generate import greedy, run_greedy
from mtplib.runtime.model import (
    Context,
    ContextConfig,
    Model,
    RuntimeInputError,
    check_pair,
)

PROMPT = [1, 2, 3, 4, 5, 6, 7, 8]


@pytest.fixture(scope="module")
def trunk(pair):
    with Model(pair.trunk) as m:
        yield m


@pytest.fixture(scope="module")
def sidecar(pair):
    with Model(pair.sidecar, load_mtp=True) as m:
        yield m


def test_trunk_loads_without_mtp_and_decodes_deterministically(pair, trunk):
    assert (trunk.n_vocab, trunk.n_embd, trunk.n_embd_out) == (256, 128, 512)
    a = run_greedy(str(pair.trunk), PROMPT, 24)
    b = run_greedy(str(pair.trunk), PROMPT, 24)
    assert a.tokens == b.tokens and len(a.tokens) == 24
    assert a.metrics.ttft_s > 0 and a.metrics.decode_tok_s > 0


def test_chunked_prefill_matches_one_batch(trunk):
    with Context(trunk, ContextConfig(n_ctx=256, n_batch=512)) as c1:
        one = greedy(c1, list(range(40)), 8).tokens
    with Context(trunk, ContextConfig(n_ctx=256, n_batch=16, n_ubatch=16)) as c2:
        chunked = greedy(c2, list(range(40)), 8).tokens
    assert one == chunked


def test_mtp_context_on_sidecar_drafts(trunk, sidecar):
    with Context(trunk, ContextConfig(n_ctx=256, nextn_rows="all")) as tc, \
         Context(sidecar, ContextConfig(n_ctx=256, mtp=True, nextn_rows="masked")) as mc:
        tc.decode(PROMPT, range(8), logits=True)
        rows = tc.nextn_rows(8)
        assert rows.shape == (8, 512) and np.isfinite(rows).all()
        # position rule: token x_p goes with the trunk's h_{p-1}
        mc.decode(PROMPT[1:], range(1, 8), logits=[False] * 6 + [True], rows=rows[:7])
        draft = int(np.argmax(mc.logits(-1)))
        assert 0 <= draft < 256
        assert mc.nextn_rows(1).shape == (1, 512)


def test_missing_file(tmp_path):
    with pytest.raises(ModelFileError, match="not found"):
        Model(tmp_path / "nope.gguf")


def test_not_a_gguf(tmp_path):
    p = tmp_path / "x.gguf"
    p.write_bytes(b"hello world, not a model")
    with pytest.raises(ModelFileError, match="not a GGUF"):
        Model(p)


def test_truncated_gguf(tmp_path, pair):
    p = tmp_path / "cut.gguf"
    p.write_bytes(pair.trunk.read_bytes()[:300])
    with pytest.raises(ModelFileError, match="cannot parse"):
        Model(p)


def test_wrong_architecture(tmp_path):
    import gguf

    p = tmp_path / "llama.gguf"
    w = gguf.GGUFWriter(str(p), arch="llama")
    w.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ModelFileError, match="'llama', mtplib needs 'deepseek4'"):
        Model(p)


def test_sidecar_as_trunk_and_trunk_as_sidecar(pair):
    with pytest.raises(ModelFileError, match="is an MTP sidecar"):
        Model(pair.sidecar)
    with pytest.raises(ModelFileError, match="needs an MTP sidecar"):
        Model(pair.trunk, load_mtp=True)


def test_pair_from_different_fixtures_is_refused(pair, other_pair):
    from mtplib.model.gguf_header import read_header

    check_pair(read_header(pair.trunk), read_header(pair.sidecar))  # the right pair passes
    with pytest.raises(ModelFileError, match="token_embd data differs"):
        check_pair(read_header(pair.trunk), read_header(other_pair.sidecar))
    with pytest.raises(ModelFileError, match="not an MTP sidecar"):
        check_pair(read_header(pair.trunk), read_header(other_pair.trunk))


def test_token_out_of_range(trunk):
    with Context(trunk, ContextConfig(n_ctx=64)) as c:
        with pytest.raises(RuntimeInputError, match="token id 256 out of range"):
            c.decode([1, 256], [0, 1])
        with pytest.raises(RuntimeInputError, match="token id -1"):
            c.decode([-1], [0])


def test_prompt_longer_than_context(trunk):
    with Context(trunk, ContextConfig(n_ctx=256)) as c:
        n = c.n_ctx  # upstream may pad the requested size; the real one counts
        with pytest.raises(RuntimeInputError, match="exceed the context"):
            greedy(c, [1] * (n - 4), 8)
        with pytest.raises(RuntimeInputError, match="outside the context"):
            c.decode([1], [n])


def test_batch_larger_than_n_batch_and_bad_rows(trunk, sidecar):
    with Context(trunk, ContextConfig(n_ctx=64, n_batch=8, n_ubatch=8)) as c:
        with pytest.raises(RuntimeInputError, match="exceeds n_batch 8"):
            c.decode(list(range(9)), range(9))
        with pytest.raises(RuntimeInputError, match="only accepted by an MTP context"):
            c.decode([1], [0], rows=np.zeros((1, 512), np.float32))
    with Context(sidecar, ContextConfig(n_ctx=64, mtp=True)) as m:
        with pytest.raises(RuntimeInputError, match="needs one hidden row"):
            m.decode([1], [0])
        with pytest.raises(RuntimeInputError, match=r"shape \(1, 128\), expected \(1, 512\)"):
            m.decode([1], [0], rows=np.zeros((1, 128), np.float32))
        with pytest.raises(RuntimeInputError, match="NaN"):
            m.decode([1], [0], rows=np.full((1, 512), np.nan, np.float32))


def test_context_larger_than_trained_and_bad_config(trunk):
    with pytest.raises(RuntimeInputError, match="exceeds the model's context_length"):
        Context(trunk, ContextConfig(n_ctx=1 << 20))
    with pytest.raises(RuntimeInputError, match="kv_type"):
        Context(trunk, ContextConfig(kv_type="f8"))
    with pytest.raises(RuntimeInputError, match="load_mtp"):
        Context(trunk, ContextConfig(mtp=True))


def test_process_still_alive_after_bad_calls(trunk):
    # every refusal above happened before upstream: the same model still decodes
    with Context(trunk, ContextConfig(n_ctx=64)) as c:
        assert len(greedy(c, PROMPT, 4).tokens) == 4


def test_plain_decoding_is_the_engine_loop(pair, trunk, monkeypatch):
    """greedy() runs the engine's loop with k = 0 (plain decoding is written once): the same
    tokens as the old one-decode-per-token loop (spelled out here) and as MTPRuntime k=0."""
    from mtplib.runtime import generation
    from mtplib.runtime.generate import prefill
    from mtplib.runtime.speculative import MTPRuntime

    calls = []
    real = generation.run_generation
    monkeypatch.setattr(generation, "run_generation",
                        lambda *a, **kw: calls.append(1) or real(*a, **kw))
    cfg = ContextConfig(n_ctx=256, n_batch=16, n_ubatch=16, n_threads=1)
    for prompt, n in ((PROMPT, 12), (list(range(40)), 9)):
        with Context(trunk, cfg) as c:
            g = greedy(c, prompt, n)
            assert c.seq_pos_max(0) == -1  # the session's sequence was freed
            logits, _ = prefill(c, prompt)
            want, pos = [], len(prompt)
            while True:
                want.append(int(np.argmax(logits)))
                if len(want) == n:
                    break
                c.decode([want[-1]], [pos], logits=True)
                pos, logits = pos + 1, c.logits(-1)
        assert g.tokens == want
        assert g.target_decodes == n - 1 + -(-len(prompt) // 16)
        assert (g.metrics.k, g.metrics.n_generated, g.metrics.drafted) == (0, n, 0)
        assert set(g.summary()) == {"n_prompt", "n_generated", "ttft_s", "decode_s",
                                    "decode_tok_s", "target_decodes"}
    assert calls == [1, 1]
    with MTPRuntime(str(pair.trunk), None, k=0, n_ctx=256, n_threads=1) as rt, \
            Context(trunk, cfg) as c:
        assert rt.generate(PROMPT, 12)[0] == greedy(c, PROMPT, 12).tokens
