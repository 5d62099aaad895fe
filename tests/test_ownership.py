"""DGR-065 ownership derivation from GGUF headers (pure: no llama.cpp)."""

import json

import pytest

from mtplib.cli import main as cli_main
from mtplib.model.arch import trunk_tensors
from mtplib.model.gguf_header import ModelFileError, read_header, read_header_fast
from mtplib.model.presets import TINY
from mtplib.ownership.derivation import (
    CacheParams,
    PlanError,
    balanced_plan,
    cache_buffers,
    cache_tensors,
    derive,
    inventory_from_paths,
)
from mtplib.ownership.plan import even_plan, parse_plan

N = TINY.n_layer  # 4 trunk layers, MTP block 4


# -- inventory ----------------------------------------------------------------------------

@pytest.mark.parametrize("which", ["trunk", "sidecar"])
def test_fast_header_equals_gguf_reader(pair, which):
    path = getattr(pair, which)
    fast, ref = read_header_fast(path), read_header(path, with_tokens=False)
    assert fast.tensors == ref.tensors and fast.kv == ref.kv


def test_fast_header_rejects_bad_files(tmp_path, pair):
    with pytest.raises(ModelFileError, match="not found"):
        read_header_fast(tmp_path / "nope.gguf")
    bad = tmp_path / "cut.gguf"
    bad.write_bytes(pair.trunk.read_bytes()[:200])
    with pytest.raises(ModelFileError, match="cannot parse"):
        read_header_fast(bad)


def test_roles_and_read_by_of_a_pair(inv):
    by = {(t.file, t.name): t for t in inv.tensors}
    assert inv.layout == "pair"
    assert by[("trunk", "token_embd.weight")].role == "head"
    for n in ("output.weight", "output_norm.weight", "output_hc_fn.weight"):
        assert by[("trunk", n)].role == "tail"
    assert {t.role for t in inv.tensors if t.block is not None and t.file == "trunk"} \
        == {"main_layer"}
    assert {t.role for t in inv.tensors if t.file == "mtp"} == {"mtp"}
    # every trunk tensor is read by the main graph only
    assert {t.read_by for t in inv.tensors if t.file == "trunk"} == {("main",)}
    # the sidecar ships output_norm but its MTP head uses nextn.shared_head_norm instead
    assert by[("mtp", "output_norm.weight")].read_by == ()
    assert by[("mtp", f"blk.{N}.nextn.shared_head_norm.weight")].read_by == ("mtp",)
    assert {t.name for t in inv.tensors if t.file == "mtp" and t.read_by == ("mtp",)} \
        == {t.name for t in inv.tensors if t.file == "mtp"} - {"output_norm.weight"}
    assert len(inv.tensors) == len(trunk_tensors(TINY)) + 34


def test_combined_file_roles_and_reads(combined):
    by = {t.name: t for t in combined.tensors}
    assert combined.layout == "combined" and {t.file for t in combined.tensors} == {"trunk"}
    assert by[f"blk.{N}.attn_norm.weight"].role == "mtp"
    assert by[f"blk.{N}.attn_norm.weight"].read_by == ("mtp",)
    assert by["token_embd.weight"].read_by == ("main", "mtp")
    assert by["output.weight"].read_by == ("main", "mtp")
    assert by["output_hc_fn.weight"].read_by == ("main", "mtp")  # one file: one hc head
    assert by["output_norm.weight"].read_by == ("main",)  # MTP uses shared_head_norm


def test_sidecar_of_other_weights_is_refused(pair, other_pair):
    with pytest.raises(ModelFileError, match="not the MTP sidecar"):
        inventory_from_paths(pair.trunk, other_pair.sidecar)
    with pytest.raises(ModelFileError, match="MTP sidecar, not a trunk"):
        inventory_from_paths(pair.sidecar)
    with pytest.raises(ModelFileError, match="not an MTP sidecar"):
        inventory_from_paths(pair.trunk, pair.trunk)


# -- plans --------------------------------------------------------------------------------

def test_parse_plan_ok():
    p = parse_plan("0-1, 2-3", N)
    assert p.ranges == ((0, 1), (2, 3)) and p.shard_of(2) == 1 and str(p) == "0-1,2-3"
    assert parse_plan("0,1-2,3", N).ranges == ((0, 0), (1, 2), (3, 3))


@pytest.mark.parametrize("text, msg", [
    ("0-1,3-3", "gap before range 1"),
    ("0-2,2-3", "overlaps the previous range"),
    ("0-1,2-4", "out of range"),
    ("0-1,2-2", "layers 3-3 belong to no shard"),
    ("1-3", "gap before range 0"),
    ("2-1,2-3", "reversed"),
    ("0-1;2-3", "cannot parse"),
    ("0-a", "cannot parse"),
    ("", "empty"),
    ("2-3,0-1", "increasing layer order"),
])
def test_parse_plan_errors(text, msg):
    with pytest.raises(PlanError, match=msg):
        parse_plan(text, N)


def test_even_and_balanced_plans(inv):
    assert even_plan(43, 8).ranges[0] == (0, 5) and even_plan(43, 8).ranges[-1] == (38, 42)
    with pytest.raises(PlanError):
        even_plan(4, 5)
    for k in (1, 2, 3, 4):
        b, e = derive(inv, balanced_plan(inv, k)), derive(inv, even_plan(N, k))
        assert max(s.bytes for s in b.shards) <= max(s.bytes for s in e.shards)


# -- shards, replicas ---------------------------------------------------------------------

def test_shard_assignment_and_replicas(inv):
    own = derive(inv, "0-1,2-3")
    assert sum(s.bytes for s in own.shards) == sum(t.bytes for t in inv.tensors)
    first, last = own.shards
    assert first.bytes_by_role["head"] > 0 and first.bytes_by_role["tail"] == 0
    assert last.holds_mtp and last.bytes_by_role["mtp"] > 0 and last.bytes_by_role["tail"] > 0
    assert {t.shard for t in own.tensors if t.block in (0, 1)} == {0}
    assert {t.shard for t in own.tensors if t.file == "mtp"} == {1}
    # the MTP on the tail shard reads the token embedding the head shard owns
    assert [r["name"] for r in last.replicas] == ["token_embd.weight"]
    assert last.replicas[0]["owner_shard"] == 0 and last.copy_bytes == 0
    emb = next(t.bytes for t in inv.tensors if t.name == "token_embd.weight")
    assert last.replica_bytes == emb and first.replicas == ()
    # the sidecar's output/output_norm duplicate the trunk's tail on the same shard
    assert {d["name"] for d in last.duplicates} == {"output.weight", "output_norm.weight"}
    assert last.unread_bytes == next(t.bytes for t in inv.tensors
                                     if t.file == "mtp" and t.name == "output_norm.weight")


def test_one_shard_has_no_replicas_but_duplicates(inv):
    own = derive(inv)
    assert own.shards[0].replicas == ()
    assert {d["name"] for d in own.shards[0].duplicates} == {
        "token_embd.weight", "output.weight", "output_norm.weight"}


def test_combined_layout_needs_a_copy_of_the_embedding(combined):
    last = derive(combined, "0-1,2-3").shards[1]
    emb = next(t.bytes for t in combined.tensors if t.name == "token_embd.weight")
    assert last.copy_bytes == emb and last.replicas[0]["provided_by"] == "copy from shard 0"
    assert last.duplicates == ()


def test_mtp_block_bytes(inv):
    own = derive(inv)
    assert own.mtp_block_bytes == sum(t.bytes for t in inv.tensors
                                      if t.file == "mtp" and t.block == N)


# -- caches -------------------------------------------------------------------------------

def test_cache_bytes_by_hand():
    """Independent arithmetic for the tiny config (D=64, Di=128, window 32, ratios
    0,0,4,128 | MTP 0), n_ctx 512, 1 sequence, F16 K."""
    D, Di, f16, f32 = 64, 128, 2, 4
    main = cache_buffers(cache_tensors(TINY, CacheParams(n_ctx=512), context="main",
                                       layers=range(N)))
    assert main[("main", "raw_swa")] == 4 * 512 * D * f16  # swa_full: n_ctx_seq cells
    assert main[("main", "csa")] == 256 * D * f16  # PAD(512/4, 256)
    assert main[("main", "hca")] == 256 * D * f16  # PAD(max(1, 512/128), 256)
    assert main[("main", "lid")] == 256 * Di * f16
    assert main[("main", "csa_state")] == 2 * (2 * D) * 8 * f32
    assert main[("main", "hca_state")] == 2 * D * 128 * f32
    assert main[("main", "lid_state")] == 2 * (2 * Di) * 8 * f32
    mtp = cache_buffers(cache_tensors(TINY, CacheParams(n_ctx=512), context="mtp"))
    assert mtp == {("mtp", "mtp_swa"): 2 * 512 * D * f16}  # K and (unread) V
    p = CacheParams(n_ctx=2048, n_seq=2, n_ubatch=64, swa_full=False, n_rs_seq=2)
    two = cache_buffers(cache_tensors(TINY, p, context="main", layers=range(N)))
    assert two[("main", "raw_swa")] == 4 * 256 * D * f16 * 2  # PAD(32+64, 256) x 2 streams
    assert two[("main", "csa")] == 256 * D * f16 * 2  # n_ctx_seq 1024 -> PAD(256, 256)
    assert two[("main", "csa_state")] == 2 * (2 * D) * 8 * f32 * 2 * 3  # 2 seqs x (1+2)


def test_caches_follow_the_plan(inv):
    own = derive(inv, "0-1,2-3", CacheParams(n_ctx=512))
    a, b = own.shards
    assert a.caches["csa_compressed_k"] == a.caches["hca_compressed_k"] == 0  # layers 0-1: SWA
    assert b.caches["csa_compressed_k"] > 0 and b.caches["mtp_swa_k"] > 0
    assert a.caches["raw_swa_k"] == b.caches["raw_swa_k"]
    assert a.caches["mtp_swa_k"] == 0 and b.caches["mtp_swa_v_unread"] == b.caches["mtp_swa_k"]
    total = sum(s.caches["total"] for s in own.shards)
    assert total == sum(c.bytes for c in own.caches)


def test_cache_params_are_validated():
    with pytest.raises(ValueError, match="n_ctx"):
        CacheParams(n_ctx=0)
    with pytest.raises(ValueError, match="type_k"):
        CacheParams(type_k="q4")


# -- CLI ----------------------------------------------------------------------------------

def test_cli_json_schema(pair, capsys):
    rc = cli_main(["inventory", str(pair.trunk), "--mtp", str(pair.sidecar), "--plan", "0-1,2-3",
                   "--ctx", "512", "--json"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out) == {"model", "tensors", "shards", "seam_bytes_per_token"}
    t = out["tensors"][0]
    assert {"file", "name", "role", "block", "shape", "dtype", "bytes", "read_by",
            "shard"} <= set(t)
    assert {t["file"] for t in out["tensors"]} == {"trunk", "mtp"}
    s = out["shards"][1]
    assert {"index", "layers", "bytes", "replicas", "caches"} <= set(s)
    assert s["layers"] == [2, 3]
    seam = out["seam_bytes_per_token"]
    assert seam["n_seams"] == 1
    assert seam["per_seam"]["f32"]["boundary_hidden"] == 4 * TINY.n_embd * 4


def test_cli_tables_and_errors(pair, capsys):
    assert cli_main(["inventory", str(pair.trunk), "--mtp", str(pair.sidecar)]) == 0
    out = capsys.readouterr().out
    assert "MTP block bytes" in out and "seam bytes per token" in out
    assert cli_main(["inventory", str(pair.trunk), "--plan", "0-1,1-3"]) == 2
    assert "overlaps" in capsys.readouterr().err
    assert cli_main(["inventory", str(pair.sidecar)]) == 2
    assert "MTP sidecar, not a trunk" in capsys.readouterr().err
