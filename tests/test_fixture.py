import time

import numpy as np
import pytest

from mtplib.model.arch import ConfigError, sidecar_tensors, trunk_tensors
from mtplib.model.fixture import write_fixture
from mtplib.model.gguf_header import read_header
from mtplib.model.presets import TINY
from mtplib.stamps import sha256_file


def test_same_seed_gives_identical_bytes(tmp_path, pair):
    t0 = time.perf_counter()
    again = write_fixture(tmp_path, seed=0)
    assert time.perf_counter() - t0 < 10
    assert sha256_file(again.trunk) == sha256_file(pair.trunk)
    assert sha256_file(again.sidecar) == sha256_file(pair.sidecar)


def test_other_seed_gives_other_weights(pair, other_pair):
    assert sha256_file(pair.trunk) != sha256_file(other_pair.trunk)


def test_sizes_under_limit(pair):
    assert pair.trunk.stat().st_size + pair.sidecar.stat().st_size < 64 * 2**20


def test_layer_kinds_covered():
    r = TINY.compress_ratios
    assert {0, 4, 128} <= set(r[: TINY.n_layer])
    assert TINY.n_hash_layers >= 1 and r[TINY.n_layer] == 0


@pytest.mark.parametrize("which", ["trunk", "sidecar"])
def test_every_expected_tensor_with_shape_and_dtype(pair, which):
    path = getattr(pair, which)
    expected = trunk_tensors(TINY) if which == "trunk" else sidecar_tensors(TINY)
    h = read_header(path)
    got = {t.name: (t.ne, t.dtype) for t in h.tensors}
    assert got == {s.name: (s.ne, s.dtype) for s in expected}
    if which == "sidecar":
        assert h.is_mtp_only
        assert h.kv["deepseek4.block_count"] == TINY.n_layer + 1
        assert h.kv["deepseek4.nextn_predict_layers"] == 1
        assert f"blk.{TINY.n_layer}.nextn.shared_head_norm.weight" in got
    else:
        assert not h.is_mtp_only and "deepseek4.nextn_predict_layers" not in h.kv


def _data(path, name):
    import gguf

    r = gguf.GGUFReader(str(path))
    return next(np.array(t.data) for t in r.tensors if t.name == name)


def test_sidecar_shares_root_data_but_has_its_own_hc_head(pair):
    for name in ("token_embd.weight", "output.weight", "output_norm.weight"):
        assert np.array_equal(_data(pair.trunk, name), _data(pair.sidecar, name)), name
    assert not np.array_equal(_data(pair.trunk, "output_hc_fn.weight"),
                              _data(pair.sidecar, "output_hc_fn.weight"))


def test_tid2eid_is_valid_expert_ids(pair):
    ids = _data(pair.trunk, "blk.0.ffn_gate_tid2eid.weight")
    assert ids.dtype == np.int32 and ids.min() >= 0 and ids.max() < TINY.n_expert
    assert all(len(set(row)) == TINY.n_expert_used for row in ids)


@pytest.mark.parametrize("change, msg", [
    ({"compress_ratios": (0, 0, 128, 128, 0)}, "no ratio-4 layer"),
    ({"indexer_dim": 64}, "SIGFPE"),
    ({"compress_ratios": (0, 0, 4, 128, 4)}, "MTP block 4 must have compress ratio 0"),
    ({"compress_ratios": (0, 0, 4, 64, 0)}, "must be 0, 4 or 128"),
    ({"o_groups": 3}, "not divisible"),
])
def test_configs_upstream_would_crash_on_are_refused(change, msg):
    from dataclasses import replace

    with pytest.raises(ConfigError, match=msg):
        replace(TINY, **change).validate()


def test_existing_different_file_is_not_overwritten(tmp_path, pair):
    victim = tmp_path / pair.trunk.name
    victim.write_bytes(b"someone's data")
    with pytest.raises(FileExistsError, match="--force"):
        write_fixture(tmp_path, seed=0)
    assert victim.read_bytes() == b"someone's data"
    write_fixture(tmp_path, seed=0, force=True)
    assert sha256_file(victim) == sha256_file(pair.trunk)


def test_unknown_preset_and_bad_seed():
    with pytest.raises(ValueError, match="unknown preset"):
        write_fixture("/tmp/unused", preset="nope")
    with pytest.raises(ValueError, match="seed"):
        write_fixture("/tmp/unused", seed=-1)


def test_tiny_slice_is_tiny_with_v4_flashs_first_six_layer_kinds(tmp_path):
    """The preset `mtplib.reports.graph_reuse.bytes_table --tiny-slice` writes (it once added it to
    PRESETS at run time): only the layer count, kinds and hash-routed layers differ."""
    from dataclasses import asdict

    from mtplib.model.presets import PRESETS, TINY_SLICE, V4_FLASH_SLICE_RATIOS

    assert PRESETS["tiny-slice"] is TINY_SLICE
    diff = {k for k, v in asdict(TINY_SLICE).items() if asdict(TINY)[k] != v}
    assert diff == {"n_layer", "n_hash_layers", "compress_ratios"}
    assert (TINY_SLICE.n_layer, TINY_SLICE.n_hash_layers) == (6, 3)
    assert TINY_SLICE.compress_ratios == V4_FLASH_SLICE_RATIOS == (0, 0, 4, 128, 4, 128, 0)
    pair = write_fixture(tmp_path, preset="tiny-slice")
    assert read_header(pair.trunk).kv["deepseek4.block_count"] == 6
