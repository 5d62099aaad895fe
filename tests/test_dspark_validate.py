"""Malformed DSpark drafts are refused in one line before upstream sees them.

Each broken file is written by the same writer as the good fixture (`write_dspark` with a
key or tensor changed), so only the broken rule differs. Upstream aborts the process on
several of them (hc != 4, output_group_count 0, sliding_window 0, K != V, a Markov head
without block_size, a target layer past the trunk) and refuses or misruns the rest.
"""

from __future__ import annotations

import subprocess
import sys
from dataclasses import replace

import numpy as np
import pytest

from mtplib.errors import InputError
from mtplib.model.dspark.fixture import REMOVE, write_dspark
from mtplib.model.dspark.spec import MASK_KEY, dspark_config_for
from mtplib.model.dspark.validate import DSparkFileError, is_dspark, validate_dspark
from mtplib.model.gguf_header import read_header
from mtplib.model.presets import TINY

CFG = dspark_config_for(TINY)
D = "dflash."

#: (id, writer changes, text the one-line refusal must name)
CASES = [
    ("missing-key", {"keys": {D + "attention.q_lora_rank": REMOVE}}, "q_lora_rank = <absent>"),
    ("missing-tensor", {"drop": ["blk.1.attn_kv.weight"]}, "blk.1.attn_kv.weight = <absent>"),
    ("hc-count", {"keys": {D + "hyper_connection.count": 2}}, "hyper_connection.count = 2"),
    ("hc-absent", {"keys": {D + "hyper_connection.count": REMOVE}},
     "hyper_connection.count = <absent>"),
    ("target-layers-past-trunk", {"cfg": {"target_layers": (3, 4, 5)}},
     "target_layers = [3, 4, 5]: entries [5] are past the trunk's 4 layers"),
    ("block-size-missing", {"keys": {D + "block_size": REMOVE}}, "block_size = <absent>"),
    ("block-size-zero", {"keys": {D + "block_size": 0}}, "block_size = 0"),
    ("block-size-type", {"keys": {D + "block_size": 5.0}}, "block_size = <f32>: must be a u32"),
    ("head-count-kv", {"keys": {D + "attention.head_count_kv": 2}},
     "head_count_kv = 2: must be 1"),
    ("sliding-window-0", {"keys": {D + "attention.sliding_window": 0}},
     "sliding_window = 0"),
    ("output-groups-0", {"keys": {D + "attention.output_group_count": 0}},
     "output_group_count = 0"),
    ("k-ne-v", {"keys": {D + "attention.value_length": 32}},
     "value_length = 32: must equal key_length (64)"),
    ("gating", {"keys": {D + "expert_gating_func": 1}}, "expert_gating_func = 1"),
    ("compress-ratio", {"keys": {D + "attention.compress_ratios": [0, 4, 0]}},
     "compress_ratios = [0, 4, 0]: must be all 0"),
    ("n-embd-ne-trunk", {"cfg": {"n_embd": 64}},
     "embedding_length = 64: must equal the trunk's (128)"),
    ("no-mask-token", {"keys": {MASK_KEY: REMOVE}}, "mask_token_id = <absent>"),
    ("mask-token-range", {"keys": {MASK_KEY: 256}}, "mask_token_id = 256"),
    ("extra-tensor", {"extra": {"blk.0.ffn_gate_tid2eid.weight":
                                np.zeros((256, 2), dtype=np.int32)}},
     "tensor blk.0.ffn_gate_tid2eid.weight = [2, 256]: not a tensor"),
    ("d2t", {"extra": {"d2t": np.arange(256, dtype=np.int32)}}, "reduced draft vocabulary"),
    ("no-markov-head", {"drop": ["markov_w1.weight", "markov_w2.weight"]},
     "markov_w1.weight = <absent>: not a DSpark draft"),
    ("bonus-anchor", {"keys": {D + "sample_from_anchor": False}}, "sample_from_anchor"),
    ("vocab-ne-trunk", {"cfg": {"n_vocab": 128, "mask_token_id": 127}},
     "must be the trunk's vocabulary (256 tokens)"),
]


def _broken(tmp_path, change: dict):
    cfg = replace(CFG, **change.get("cfg", {}))
    path = tmp_path / "broken.gguf"
    write_dspark(path, cfg, keys=change.get("keys"), drop=change.get("drop", ()),
                 extra=change.get("extra"))
    return path


@pytest.mark.parametrize("change,msg", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_malformed_draft_refused_in_one_line(tmp_path, dspark, change, msg):
    pair, _ = dspark
    path = _broken(tmp_path, change)
    with pytest.raises(DSparkFileError) as e:
        validate_dspark(read_header(path), read_header(pair.trunk))
    text = str(e.value)
    assert msg in text and "\n" not in text and str(path) in text
    assert isinstance(e.value, InputError)


def test_good_draft_validates_and_matches_its_config(dspark):
    pair, path = dspark
    h = read_header(path)
    assert is_dspark(h) and not is_dspark(read_header(pair.trunk))
    cfg = validate_dspark(h, read_header(pair.trunk))
    # what the writer wrote is what the validator reads back (the epsilons as f32)
    assert replace(cfg, rms_eps=CFG.rms_eps, hc_eps=CFG.hc_eps) == CFG
    assert cfg.rms_eps == pytest.approx(CFG.rms_eps) and cfg.hc_eps == pytest.approx(CFG.hc_eps)
    assert cfg.target_layers == (2, 3, 4) and cfg.block_size == 5 and cfg.mask_token_id == 255


@pytest.mark.parametrize("change,msg", [c[1:] for c in CASES if c[0] in (
    "hc-count", "block-size-missing", "target-layers-past-trunk", "sliding-window-0")],
    ids=["hc-count", "block-size-missing", "target-layers-past-trunk", "sliding-window-0"])
def test_the_run_request_refuses_before_any_context(tmp_path, dspark, change, msg):
    """The request (`mtplib generate`'s and MTPRuntime's first step) reads and refuses the
    file: nothing is loaded, so upstream never gets to abort."""
    from mtplib.runtime.request import build_request

    pair, _ = dspark
    with pytest.raises(DSparkFileError, match="dflash|target_layers"):
        build_request(pair.trunk, sidecar=_broken(tmp_path, change))


def test_cli_refuses_a_malformed_draft_in_one_line_exit_2(tmp_path, dspark):
    pair, _ = dspark
    bad = _broken(tmp_path, {"keys": {D + "attention.output_group_count": 0}})
    r = subprocess.run([sys.executable, "-m", "mtplib.cli", "generate", "-m", str(pair.trunk),
                        "-md", str(bad), "--tokens", "1,2,3", "-n", "4"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "output_group_count = 0" in lines[0], r.stderr
