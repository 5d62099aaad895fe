"""DGR-065: the derived read_by and cache bytes equal what upstream's graphs read and
upstream's caches allocate (one main decode and one MTP decode with cb_eval)."""

from dataclasses import replace

import pytest

from mtplib.ownership.derivation import CacheParams, Inventory
from mtplib.runtime.graph_reads import (
    check_caches,
    check_pair,
    check_reads,
    derived_caches,
    observe,
)

PARAMS = [
    CacheParams(n_ctx=512),
    # 2 sequences, rollback planes, window-sized SWA caches (swa_full off)
    CacheParams(n_ctx=2048, n_seq=2, n_ubatch=64, swa_full=False, n_rs_seq=2),
    CacheParams(n_ctx=1024, type_k="f32"),
]


@pytest.mark.parametrize("params", PARAMS, ids=["n512", "seq2-rs2-swa", "f32"])
def test_pair_reads_and_caches_equal_upstream(inv, params):
    r = check_pair(inv, params)
    assert r["reads_equal"], r["reads"]
    assert r["caches_equal"], r["caches"]
    main, mtp = r["reads"]
    assert main["observed"] == sum(1 for t in inv.tensors if t.file == "trunk")
    assert mtp["observed"] == sum(1 for t in inv.tensors if t.file == "mtp") - 1  # output_norm
    for c in r["caches"]:
        assert c["derived_total"] == c["upstream_total"] > 0


def test_combined_file_equals_upstream(combined):
    r = check_pair(combined, CacheParams(n_ctx=512), flash_attn="off")
    assert r["reads_equal"], r["reads"]
    assert r["caches_equal"], r["caches"]
    raw = next(b for b in r["caches"][0]["buffers"] if b["cache"] == "raw_swa")
    # the main context allocates raw K for all 5 blocks (MTP block included), reads 4
    assert raw["upstream_bytes"] == 5 * 512 * 64 * 2 and raw["tensors"] == 4


def test_a_wrong_rule_is_caught(inv):
    """The comparison fails on a derivation that differs from upstream by one tensor."""
    obs = observe(inv.paths["mtp"], CacheParams(n_ctx=512), graph="mtp")
    assert check_reads(inv, obs, "mtp")["equal"]
    wrong = [replace(t, read_by=("mtp",)) if t.name == "output_norm.weight" else t
             for t in inv.tensors]
    bad = check_reads(Inventory(inv.config, inv.layout, inv.paths, tuple(wrong)), obs, "mtp")
    assert not bad["equal"] and bad["missing_in_upstream"] == ["output_norm.weight"]
    # a derivation that forgets the (unread) V cache gets the buffer size wrong
    caches = [c for c in derived_caches(inv, CacheParams(n_ctx=512), "mtp") if c.part == "k"]
    bad = check_caches(caches, obs)
    assert bad["tensors_equal"] and not bad["equal"]
