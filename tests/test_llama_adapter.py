"""`mtplib.llama`: MTP speculative decoding through `llama_cpp.Llama(draft_model=...)`.

On the committed trained pair (real acceptance): greedy text equals plain `Llama`'s with
drafts accepted, through create_completion, create_chat_completion and streaming; the
drafts are the runtime's own (same proposals, same acceptance as `MTPRuntime`). On the
random fixture (whose API rows are proven right at n_ubatch 512) the "api" row source.
Bad input is refused before upstream runs. One thread: the CI machine is shared.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from mtplib.errors import InputError
from mtplib.model.trained import trained_paths

llama_cpp = pytest.importorskip("llama_cpp")

from mtplib.llama import MTPDraftModel, mtp_llama  # noqa: E402
from mtplib.runtime.row_source import RowSourceDecision  # noqa: E402

PAIR = trained_paths()
needs_pair = pytest.mark.skipif(not PAIR.exists(), reason="trained pair not committed")
KW = {"n_ctx": 512, "n_threads": 1, "n_threads_batch": 1}
PROMPTS = ["def main(", "import os\nimport sys\n\n\nclass ", "    def __init__(self"]
N = 24


@pytest.fixture(scope="module")
def plain():
    llm = llama_cpp.Llama(str(PAIR.trunk), verbose=False, **KW)
    yield llm
    llm.close()


@pytest.fixture(scope="module")
def mtp():
    llm = mtp_llama(PAIR.trunk, PAIR.sidecar, draft=3, **KW)
    yield llm
    llm.close()


def _text(out) -> str:
    return out["choices"][0]["text"]


@needs_pair
def test_greedy_completion_equals_plain_with_accepted_drafts(plain, mtp):
    s = mtp.draft_model.stats
    before = s.accepted
    for p in PROMPTS:
        want = _text(plain.create_completion(p, max_tokens=N, temperature=0))
        assert _text(mtp.create_completion(p, max_tokens=N, temperature=0)) == want, p
    assert s.accepted > before
    assert s.hidden_rows == mtp.draft_model.row_source.mode == "captured"  # API rows wrong
    assert 0 < s.accepted <= s.drafted
    assert s.drafted == sum(s.drafted_per_position) and len(s.drafted_per_position) == 3
    assert s.accepted == sum(s.accepted_per_position_n)
    assert s.accepted == sum(int(n) * c for n, c in s.accept_len_hist.items())
    assert not s.skipped, s.skipped
    d = json.loads(json.dumps(s.to_dict()))
    assert d["drafted"] == s.drafted and d["acceptance_rate"] == s.accepted / s.drafted
    assert mtp.context_params.n_rs_seq >= 3
    assert int(llama_cpp.llama_n_rs_seq(mtp.ctx)) >= 3


@needs_pair
def test_streaming_equals_plain(plain, mtp):
    p = PROMPTS[1]
    want = _text(plain.create_completion(p, max_tokens=N, temperature=0))
    chunks = list(mtp.create_completion(p, max_tokens=N, temperature=0, stream=True))
    assert len(chunks) > 1
    assert "".join(_text(c) for c in chunks) == want


@needs_pair
def test_chat_completion_and_chat_streaming(plain, mtp):
    # the trained pair has no chat template: Llama falls back to its llama-2 format
    assert "tokenizer.chat_template" not in mtp.metadata and mtp.chat_format == "llama-2"
    msgs = [{"role": "user", "content": "def fib(n):"}]
    ref = plain.create_chat_completion(msgs, max_tokens=N, temperature=0)
    got = mtp.create_chat_completion(msgs, max_tokens=N, temperature=0)
    want = ref["choices"][0]["message"]["content"]
    assert got["choices"][0]["message"]["content"] == want
    parts = [c["choices"][0]["delta"].get("content") or "" for c in
             mtp.create_chat_completion(msgs, max_tokens=N, temperature=0, stream=True)]
    assert "".join(parts) == want


@needs_pair
def test_follow_up_prompts_keep_the_mtp_context_in_step(plain, mtp):
    """A prompt that extends the last text (Llama keeps its prefix) and one that cuts into
    it (the MTP context's tail is truncated): still plain's text, still no skipped call."""
    p0 = PROMPTS[0]
    t0 = _text(plain.create_completion(p0, max_tokens=N, temperature=0))
    assert _text(mtp.create_completion(p0, max_tokens=N, temperature=0)) == t0
    for p in (p0 + t0, p0 + t0[: len(t0) // 2], p0[:-1]):
        want = _text(plain.create_completion(p, max_tokens=N, temperature=0))
        assert _text(mtp.create_completion(p, max_tokens=N, temperature=0)) == want, p
    assert not mtp.draft_model.stats.skipped


@needs_pair
def test_drafts_are_the_runtime_mtp_drafters(mtp):
    """Same prompt, same configuration: every proposal (position, drafts, accepted) equals
    what mtplib's own MTP loop proposes, so the adapter feeds the MTP block the same rows."""
    from mtplib.runtime.speculative import MTPRuntime

    ids = mtp.tokenize(PROMPTS[1].encode(), add_bos=False)
    dm = mtp.draft_model
    dm.trace = []
    try:
        mtp.create_completion(ids, max_tokens=N, temperature=0)
        got = dm.trace
    finally:
        dm.trace = None
    with MTPRuntime(str(PAIR.trunk), str(PAIR.sidecar), k=3, n_ctx=512, n_threads=1,
                    flash_attn="off", trace=True) as rt:
        _, metrics = rt.generate(ids, N)
    want = [s for s in metrics.steps if len(s["drafts"]) == 3]
    n = min(len(got), len(want))
    assert n >= 3
    assert got[:n] == want[:n]


@needs_pair
def test_long_prompt_over_several_batches(tmp_path):
    """The prompt decodes in n_batch chunks (rows from each chunk); also checks the score
    buffer: Llama sizes it from logits_all, which mtp_llama forces on."""
    kw = {**KW, "n_batch": 8, "n_ubatch": 8}
    text = "import os\nimport sys\n\n\ndef main(argv):\n    for a in argv:\n        print(a)\n"
    plain = llama_cpp.Llama(str(PAIR.trunk), verbose=False, **kw)
    try:
        assert len(plain.tokenize(text.encode(), add_bos=False)) > 2 * 8
        want = _text(plain.create_completion(text, max_tokens=N, temperature=0))
    finally:
        plain.close()
    llm = mtp_llama(PAIR.trunk, PAIR.sidecar, draft=2, **kw)
    try:
        assert _text(llm.create_completion(text, max_tokens=N, temperature=0)) == want
        s = llm.draft_model.stats
        assert s.accepted > 0 and not s.skipped and s.k == 2
    finally:
        llm.close()


@needs_pair
def test_sampling_runs(mtp):
    out = mtp.create_completion(PROMPTS[2], max_tokens=8, temperature=0.8, seed=3)
    assert out["usage"]["completion_tokens"] >= 1


def test_api_row_source_on_the_fixture(pair):
    """The random fixture's API rows are proven right at n_ubatch 512: the adapter reads
    them through llama_get_embeddings_nextn and still gives plain decoding's tokens."""
    kw = {**KW, "n_ctx": 256}
    prompt = [int(x) for x in np.random.default_rng(0).integers(1, 256, 12)]

    def tokens(llm, n=16):
        out = []
        for t in llm.generate(prompt, temp=0.0):
            out.append(int(t))
            if len(out) == n:
                return out

    plain = llama_cpp.Llama(str(pair.trunk), verbose=False, **kw)
    try:
        want = tokens(plain)
    finally:
        plain.close()
    llm = mtp_llama(pair.trunk, pair.sidecar, draft=2, **kw)
    try:
        assert llm.draft_model.stats.hidden_rows == "api"
        assert tokens(llm) == want
        s = llm.draft_model.stats
        assert s.drafted > 0 and not s.skipped
    finally:
        llm.close()


# -- refused before upstream ----------------------------------------------------------------
@needs_pair
@pytest.mark.parametrize("args,kwargs,match", [
    (("nope.gguf", PAIR.sidecar), {}, "nope.gguf"),
    ((PAIR.sidecar, PAIR.trunk), {}, "sidecar"),
    ((PAIR.trunk, PAIR.trunk), {}, "not an MTP sidecar"),
    ((PAIR.trunk, PAIR.sidecar), {"draft": 0}, "draft"),
    ((PAIR.trunk, PAIR.sidecar), {"draft": 9}, "draft"),
    ((PAIR.trunk, PAIR.sidecar), {"draft": True}, "draft"),
    ((PAIR.trunk, PAIR.sidecar), {"draft": 2.0}, "draft"),
    ((PAIR.trunk, PAIR.sidecar), {"n_ctxx": 512}, "unknown llama_cpp.Llama arguments"),
    ((PAIR.trunk, PAIR.sidecar), {"draft_model": object()}, "draft_model"),
    ((PAIR.trunk, PAIR.sidecar), {"embedding": True}, "embedding"),
    ((PAIR.trunk, PAIR.sidecar), {"n_ctx": 4096}, "context_length"),
    ((PAIR.trunk, PAIR.sidecar), {"draft": 4, "n_batch": 4}, "n_batch"),
    ((PAIR.trunk, PAIR.sidecar), {"type_k": 0, "type_v": 1}, "type_k"),
    ((PAIR.trunk, PAIR.sidecar), {"type_k": 0}, "type_k"),  # type_v stays F16
    ((PAIR.trunk, PAIR.sidecar), {"n_ctx": "512"}, "n_ctx"),
    ((PAIR.trunk, PAIR.sidecar), {"lora_path": "x.gguf"}, "lora_path"),
])
def test_bad_input_is_refused(args, kwargs, match):
    with pytest.raises(InputError, match=match):
        mtp_llama(*args, **kwargs)


@needs_pair
def test_sidecar_of_another_model_is_refused(pair):
    with pytest.raises(InputError, match="not the MTP sidecar"):
        mtp_llama(PAIR.trunk, pair.sidecar)


@needs_pair
def test_unsupported_row_source_refuses_mtp(monkeypatch):
    import mtplib.llama.build as build

    closed = []
    monkeypatch.setattr(build, "choose_row_source", lambda *a, **k: RowSourceDecision(
        "unsupported", "captured rows could not be verified", {}))
    monkeypatch.setattr(llama_cpp.Llama, "close",
                        lambda self, _c=llama_cpp.Llama.close: (closed.append(1), _c(self)))
    with pytest.raises(InputError, match="unsupported for this context configuration"):
        mtp_llama(PAIR.trunk, PAIR.sidecar, **KW)
    assert closed  # the half-built Llama was freed


@needs_pair
def test_bare_draft_model_is_refused():
    dm = MTPDraftModel(PAIR.sidecar, 2)
    try:
        with pytest.raises(InputError, match="mtp_llama"):
            dm(np.array([1, 2, 3], dtype=np.intc))
    finally:
        dm.close()


@needs_pair
def test_llama_speed_compares_plain_and_mtp_on_the_same_prompts():
    """The README's llama-cpp-python numbers come from `mtplib.lab.llama_speed`: it streams
    each prompt through plain `Llama` and `mtp_llama`, times decoding apart from TTFT, and
    checks the text is the same."""
    from mtplib.lab.llama_speed import compare
    from mtplib.lab.wan.inputs import trained_prompts

    r = compare(PAIR.trunk, PAIR.sidecar, trained_prompts(2, 32), draft=2, n_new=12, reps=1)
    assert r["same_text"] and r["config"]["n_prompts"] == 2 and len(r["rows"]) == 2
    assert r["plain_tok_s"]["n"] == 2 and r["mtp_tok_s"]["median"] > 0
    assert r["drafts"]["drafted"] > 0
    assert r["speedup"]["min"] <= r["speedup"]["median"] <= r["speedup"]["max"]
