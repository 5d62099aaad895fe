"""The committed trained DSpark draft (evidence/trained-dspark/) on upstream vs the block
logits stored at export.

No torch: the reference was computed at export time by the independent PyTorch draft
(mtplib/train/dspark/, float64) from the written file's own weights. Upstream extracts the
trunk's layer-input features, injects them, decodes the block (F32 K/V, flash attention
off) and applies the Markov and confidence heads in its graph.
"""

from __future__ import annotations

import pytest

from mtplib.lab.dspark_eval import check_stored
from mtplib.model.trained import trained_dspark_paths, trained_paths

DRAFT = trained_dspark_paths()
pytestmark = pytest.mark.skipif(
    not (DRAFT.exists() and trained_paths().exists()),
    reason=f"trained DSpark draft not committed under {DRAFT.draft.parent}")
TOL = 1e-3


@pytest.fixture(scope="module")
def parity():
    return check_stored(DRAFT)


def test_block_logits_match(parity):
    assert len(parity["anchors"]) >= 3
    assert parity["logits_max_abs"] <= TOL, parity
    assert parity["argmax_agree"] == 1.0


def test_confidences_match(parity):
    assert parity["confidence_max_abs"] <= TOL, parity


def test_draft_is_a_valid_pairing_and_small():
    from mtplib.model.dspark.validate import validate_dspark
    from mtplib.model.gguf_header import read_header

    cfg = validate_dspark(read_header(DRAFT.draft), read_header(trained_paths().trunk))
    assert cfg.block_size == 5 and cfg.target_layers == (2, 3, 4)
    assert DRAFT.draft.stat().st_size < 8 * 2**20
