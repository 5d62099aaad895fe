"""DGR-065 at real scale: the weight-less DeepSeek-V4-Flash table and its ownership."""

import time
from collections import Counter

import pytest

from mtplib.model.arch import ConfigError, sidecar_tensors, tensor_dtype, trunk_tensors
from mtplib.model.fixture import sha256_header, write_fixture
from mtplib.model.gguf_header import ModelFileError
from mtplib.model.presets import TINY, V4_FLASH
from mtplib.ownership.derivation import CacheParams, derive, inventory_from_paths
from mtplib.ownership.plan import even_plan

GB = 10**9


@pytest.fixture(scope="module")
def flash(tmp_path_factory):
    return write_fixture(tmp_path_factory.mktemp("flash"), preset="v4-flash")


@pytest.fixture(scope="module")
def inv(flash):
    return inventory_from_paths(flash.trunk, flash.sidecar)


def test_published_config_and_ratio_order():
    r = V4_FLASH.compress_ratios
    assert len(r) == 44 and r[:2] == (0, 0) and r[43] == 0
    assert all(r[i] == (4 if i % 2 == 0 else 128) for i in range(2, 43))
    assert r.count(4) == 21 and r.count(128) == 20
    V4_FLASH.validate()


def test_sparse_files_hold_the_real_table(flash):
    assert flash.trunk.name == "v4-flash-weightless.gguf"
    assert flash.sidecar.name == "mtp-v4-flash-weightless.gguf"
    for path, specs in ((flash.trunk, trunk_tensors(V4_FLASH)),
                        (flash.sidecar, sidecar_tensors(V4_FLASH))):
        st = path.stat()
        assert st.st_size > sum(s.nbytes for s in specs)  # the whole data region exists
        assert st.st_blocks * 512 < 16 * 2**20  # ... as a hole: a few MB on disk
        s = flash.summary()["trunk" if path == flash.trunk else "sidecar"]
        assert s["weightless"] and s["sha256_header"] == sha256_header(path)


def test_rewrite_is_identical(flash):
    again = write_fixture(flash.trunk.parent, preset="v4-flash")
    assert sha256_header(again.trunk) == sha256_header(flash.trunk)


def test_inventory_matches_the_table_with_converter_dtypes(inv):
    trunk = {t.name: t for t in inv.tensors if t.file == "trunk"}
    want = {s.name: s for s in trunk_tensors(V4_FLASH)}
    assert set(trunk) == set(want)
    assert all(trunk[n].shape == want[n].ne and trunk[n].dtype == want[n].dtype
               and trunk[n].bytes == want[n].nbytes for n in want)
    dt = Counter(t.dtype for t in trunk.values())
    assert dt["MXFP4"] == 3 * 43 and dt["I32"] == 3 and set(dt) == {
        "MXFP4", "Q8_0", "BF16", "F32", "I32"}
    assert trunk["blk.0.ffn_gate_exps.weight"].dtype == "MXFP4"
    assert trunk["blk.5.attn_q_b.weight"].dtype == "Q8_0"
    assert trunk["token_embd.weight"].dtype == "BF16"
    assert trunk["blk.2.attn_compressor_kv.weight"].dtype == "BF16"
    assert trunk["blk.7.hc_attn_fn.weight"].dtype == "F32"
    n_params = sum(s.n_elements for s in trunk_tensors(V4_FLASH))
    assert 283 * GB < n_params < 285 * GB  # "about 284B parameters"
    mtp_params = sum(s.n_elements for s in sidecar_tensors(V4_FLASH) if s.block == 43)
    assert 6.5 * GB < mtp_params < 6.7 * GB  # "the MTP block is about 6.6B"


def test_tiny_policy_is_unchanged():
    assert {s.dtype for s in trunk_tensors(TINY)} == {"F32", "I32"}
    with pytest.raises(ConfigError, match="dtype_policy"):
        from dataclasses import replace
        tensor_dtype(replace(TINY, extra={"dtype_policy": "fp4"}), "output")


def test_derivation_under_five_seconds(flash):
    t0 = time.perf_counter()
    inv = inventory_from_paths(flash.trunk, flash.sidecar)
    for n in (2, 4, 8):
        for ctx in (8192, 131072, 1048576):
            own = derive(inv, even_plan(43, n), CacheParams(n_ctx=ctx))
            own.to_json()
    assert time.perf_counter() - t0 < 5


def test_shards_and_caches_at_scale(inv):
    total = sum(t.bytes for t in inv.tensors)
    for n in (2, 4, 8):
        own = derive(inv, even_plan(43, n), CacheParams(n_ctx=1048576))
        assert sum(s.bytes for s in own.shards) == total
        last = own.shards[-1]
        assert last.holds_mtp and [r["name"] for r in last.replicas] == ["token_embd.weight"]
        assert last.replica_bytes == 129280 * 4096 * 2  # BF16 embedding, shipped by the sidecar
    own = derive(inv, None, CacheParams(n_ctx=1048576))
    c = own.shards[0].caches
    assert c["raw_swa_k"] == 43 * 1048576 * 512 * 2  # swa_full: every cell, every layer
    assert c["csa_compressed_k"] == 21 * 262144 * 512 * 2
    assert c["hca_compressed_k"] == 20 * 8192 * 512 * 2
    assert c["indexer_k"] == 21 * 262144 * 128 * 2
    assert c["mtp_swa_k"] == c["mtp_swa_v_unread"] == 1048576 * 512 * 2
    small = derive(inv, None, CacheParams(n_ctx=1048576, swa_full=False)).shards[0].caches
    assert small["raw_swa_k"] == 43 * 768 * 512 * 2  # PAD(128 + 512, 256) cells


def test_upstream_loads_the_real_scale_table(inv):
    """Upstream's loader (no_alloc: metadata only, in a child process) accepts every
    tensor of both files and computes the same bytes."""
    from mtplib.runtime.graph_reads import table_check

    rows = table_check(inv)
    assert [r["file"] for r in rows] == ["trunk", "mtp"]
    assert all(r["loaded"] and r["equal"] for r in rows), rows
    assert rows[0]["n_params"] == sum(s.n_elements for s in trunk_tensors(V4_FLASH))


def test_weightless_files_are_never_decoded(flash):
    from mtplib.runtime.graph_reads import LoadedModel, observe

    with pytest.raises(ModelFileError, match="weight-less"):
        LoadedModel(flash.trunk)
    with pytest.raises(ModelFileError, match="weight-less"):
        observe(flash.sidecar, CacheParams(n_ctx=512), graph="mtp")
