"""The committed trained pair (evidence/trained-v4/) on upstream vs the logits stored at export.

No torch: the reference logits were computed at export time by the independent PyTorch
implementation (mtplib/train/model.py, float64) from the written files' own weights.
Upstream runs with F32 K/V and flash attention off; the MTP graph gets the trunk's h rows
from the eval callback.
"""

from __future__ import annotations

import numpy as np
import pytest

from mtplib.lab.trained_eval import check_parity
from mtplib.model.trained import trained_paths

PAIR = trained_paths()
pytestmark = pytest.mark.skipif(
    not PAIR.exists(), reason=f"trained pair not committed under {PAIR.trunk.parent}")

TOL = 1e-3


@pytest.fixture(scope="module")
def parity():
    return check_parity(PAIR)


def test_trunk_logits_match(parity):
    assert parity["trunk_rows"] >= 16 and parity["n_tokens"] > 256  # HCA rows visible too
    assert parity["trunk_max_abs"] <= TOL, parity
    assert parity["trunk_argmax_agree"] == 1.0


def test_mtp_logits_match(parity):
    assert parity["mtp_rows"] >= 8
    assert parity["mtp_max_abs"] <= TOL, parity
    assert parity["mtp_argmax_agree"] == 1.0


def test_upstream_tokenizes_heldout_text_like_training_tokenizer():
    from mtplib.runtime.model import Model

    ref = np.load(PAIR.parity)
    text, ids = str(ref["text"]), ref["text_ids"].tolist()
    assert len(text) > 1000 and len(ids) > 300
    with Model(PAIR.trunk) as m:
        assert m.tokenize(text) == ids  # gpt2 BPE, no BOS added
        assert m.detokenize(ids) == text
        assert ref["tokens"].tolist() == ids[: len(ref["tokens"])]


def test_pair_is_a_valid_trunk_and_sidecar():
    from mtplib.model.gguf_header import read_header
    from mtplib.runtime.model import check_pair

    check_pair(read_header(PAIR.trunk), read_header(PAIR.sidecar))
    assert PAIR.trunk.stat().st_size + PAIR.sidecar.stat().st_size < 30 * 2**20


def test_fixture_lookup_names_the_committed_pair():
    from mtplib.model.fixture import trained_pair

    fp = trained_pair()
    assert fp is not None and fp.preset == "trained"
    assert (fp.trunk, fp.sidecar) == (PAIR.trunk, PAIR.sidecar)
    assert fp.config.n_vocab == 2048 and 4 in fp.config.compress_ratios
    assert fp.config.n_layer == 4 and fp.config.n_mtp == 1
