"""The PyTorch DSpark draft (mtplib.train.dspark) against upstream, and its training mechanics.

Needs the optional extra `train` (torch, tokenizers) and the committed trained pair
(evidence/trained-v4/, the frozen trunk): skipped without them.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("tokenizers")

from mtplib.model.trained import EVIDENCE_DIR, trained_paths  # noqa: E402
from mtplib.train.dspark import metrics  # noqa: E402
from mtplib.train.dspark.config import DSparkTrainConfig, trained_dspark  # noqa: E402
from mtplib.train.dspark.model import DSparkDraft  # noqa: E402
from mtplib.train.dspark.train import Frozen, losses, mask_token_id  # noqa: E402

pytestmark = pytest.mark.skipif(not trained_paths().exists(),
                                reason="the trained pair (the frozen trunk) is not committed")
TOL_LOGITS = 1e-4  # observed ~1e-6; a wrong mask, rope or Markov term moves logits by >0.1
TOL_CONF = 1e-5


@pytest.fixture(scope="module")
def mask_id() -> int:
    return mask_token_id(EVIDENCE_DIR / "tokenizer.json")


@pytest.fixture(scope="module")
def frozen() -> Frozen:
    torch.set_num_threads(1)
    return Frozen(EVIDENCE_DIR)


def random_draft(mask_id: int, seed: int) -> DSparkDraft:
    """The trained config with random weights, the Markov and confidence heads non-zero
    (their trained-from-zero init would hide them) and the expert biases spread."""
    m = DSparkDraft(trained_dspark(mask_id), seed=seed)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        m.w("markov_w2.weight").copy_(torch.randn(m.w("markov_w2.weight").shape, generator=g))
        m.w("conf_proj.weight").copy_(0.2 * torch.randn(m.w("conf_proj.weight").shape,
                                                        generator=g))
        m.w("conf_proj.bias").fill_(0.3)
        for l in range(m.dcfg.n_stages):
            m.w(f"blk.{l}.exp_probs_b.bias").copy_(0.05 * torch.randn(4, generator=g))
    return m


def test_mask_token_never_appears_in_text(mask_id):
    from mtplib.train import tokenizer as tk

    tok = tk.load(EVIDENCE_DIR / "tokenizer.json")
    assert tok.id_to_token(mask_id) == "ÿ"  # byte 0xFF: never in UTF-8
    text = "ÿ ÿÿ héllo\x00\x7f 😀 " + "".join(chr(c) for c in range(32, 1024))
    assert mask_id not in tk.encode(tok, text)


def test_torch_draft_matches_upstream(tmp_path, mask_id):
    """A random draft, exported, run by upstream (features, injection, block, both heads)
    and by torch in float64: logits (Markov bias included) and confidences agree."""
    from mtplib.train import tokenizer as tk
    from mtplib.train.dspark.export import write_gguf
    from mtplib.train.dspark.parity import compare

    path = write_gguf(random_draft(mask_id, 5), tk.load(EVIDENCE_DIR / "tokenizer.json"),
                      tmp_path / "dspark-random.gguf")
    toks = np.random.default_rng(1).integers(1, 2000, 160).tolist()
    r = compare(EVIDENCE_DIR, path, toks, [3, 70, 140])  # 140: past the 128-token window
    assert r["features_max_abs"] < 1e-4, r
    assert r["logits_max_abs"] < TOL_LOGITS, r
    assert r["logits_max_abs_upstream_features"] < TOL_LOGITS, r
    assert r["confidence_max_abs"] < TOL_CONF, r
    assert r["argmax_agree"] == 1.0
    assert r["logit_scale"] > 1.0  # not a degenerate all-zero draft


def test_block_sees_injected_cells_before_the_anchor_within_the_window(frozen, mask_id):
    """Row i of the block at anchor a attends injected cell p iff p < a and a+i-p < W
    (non-causal, SWA): features at or after the anchor, or W or more before it, cannot
    move the block; the newest and the oldest visible cell do."""
    m = random_draft(mask_id, 2)
    T, a, W = 200, 150, m.dcfg.sliding_window
    x = torch.from_numpy(np.random.default_rng(2).integers(1, 2000, (1, T)))
    f = torch.randn(1, T, m.dcfg.feature_width, generator=torch.Generator().manual_seed(2))

    def block(feats):
        return m.chain(feats, x, torch.tensor([a]), frozen.embd, frozen.output)[0]

    base = block(f)

    def moved(p):
        g = f.clone()
        g[0, p] += 1.0
        return (block(g) - base).abs().amax(-1)[0, 0]  # per block row

    assert moved(a).max() == 0 and moved(T - 1).max() == 0 and moved(a - W).max() == 0
    assert moved(a - 1).min() > 1e-4  # every row sees the newest cell
    oldest = moved(a - W + 1)  # visible to row 0 only (a+i-p < W fails for i >= 1) ...
    assert oldest[0] > 1e-4
    # ... yet rows attend each other inside the block, so row 0's change reaches them too
    assert moved(a + 2).max() == 0


def test_training_steps_reduce_the_loss(frozen, mask_id):
    torch.manual_seed(0)
    m = DSparkDraft(trained_dspark(mask_id), seed=0)
    tc = DSparkTrainConfig(batch_size=1)
    x = torch.from_numpy(np.random.default_rng(3).integers(1, 300, (1, 32)))
    opt = torch.optim.AdamW(m.parameters(), lr=3e-3)
    first = []
    for _ in range(10):
        loss, st, _ = losses(m, frozen, x, 8, tc)
        opt.zero_grad()
        loss.backward()
        opt.step()
        first.append(st["loss"])
    assert first[-1] < first[0] - 0.5, first
    assert np.isfinite(first).all()


def test_export_round_trip(tmp_path, mask_id, frozen):
    from mtplib.model.dspark.validate import validate_dspark
    from mtplib.model.gguf_header import read_header
    from mtplib.train import tokenizer as tk
    from mtplib.train.dspark.export import read_draft, write_gguf

    m = random_draft(mask_id, 4)
    path = write_gguf(m, tk.load(EVIDENCE_DIR / "tokenizer.json"), tmp_path / "d.gguf")
    cfg = validate_dspark(read_header(path), read_header(frozen.paths.trunk))
    assert replace(cfg, rms_eps=1e-6, hc_eps=1e-6) == m.dcfg  # the file holds f32 epsilons
    assert cfg.rms_eps == pytest.approx(1e-6, rel=1e-6)
    back = read_draft(path, dtype=torch.float32)
    for name, t in m.named_gguf().items():
        assert torch.equal(back.w(name), t), name
    x = torch.from_numpy(np.random.default_rng(4).integers(1, 2000, (1, 40)))
    f = frozen.features(x, cfg.target_layers)
    args = (f, x, torch.tensor([10, 30]), frozen.embd, frozen.output)
    assert torch.equal(back.chain(*args)[0], m.chain(*args)[0])


def test_loop_simulation_counts_leading_accepts():
    corr = np.zeros((12, 5), dtype=bool)
    corr[2] = [True, True, False, True, True]  # 2 accepted -> next anchor 5
    corr[5] = [True] * 5  # 5 accepted -> next anchor 11, the text's last position
    steps, toks, hist = metrics.simulate_loop(corr, 2, 5)
    assert hist == [2, 5] and steps == 2 and toks == 9
    st = metrics.slot_stats(corr[None, 2:11], np.ones((1, 9, 5), dtype=bool))
    assert st["slot_accuracy"][0] == pytest.approx(2 / 9)
    assert st["conditional_acceptance"][2] == pytest.approx(0.5)
    assert st["mean_accepted_all_anchors"] == pytest.approx(7 / 9)
