"""Crafted GGUFs that upstream aborts on (or refuses) are refused first, with one line.

Every file is written at test time from the tiny fixture (tests/gguf_craft.py: offsets
found by parsing, never hard-coded). Each case runs the CLI in its own process and proves
the contract: exit 2, one `error:` line naming the key or tensor, no traceback, no signal
(before validation existed, most of these killed the process with SIGABRT/SIGFPE/SIGSEGV).
One case per constraint class of mtplib/model/validate.py.
"""

from __future__ import annotations

import struct
from pathlib import Path

import gguf_craft as C
import pytest

from mtplib.model.gguf_header import ModelFileError, read_header, read_header_fast
from mtplib.model.validate import problems, validate_header
from mtplib.runtime.model import check_pair

P = "deepseek4."


def _sc(key: str, v):
    return lambda t, s, d: C.set_scalar(t, d, P + key, v)


def _sc_side(key: str, v):
    return lambda t, s, d: C.set_scalar(s, d, P + key, v)


def _kv(key: str, vtype: int, v, etype=None, side=False):
    full = key if key.startswith((P, "general.", "tokenizer.")) else P + key
    return lambda t, s, d: C.set_kv(s if side else t, d, full, vtype, v, etype)


def _ttype(name: str, ttype: int):
    def make(t, s, d):
        return C.patch(t, d, [(C.parse(t).tensor(name).type_at, "<I", ttype)])
    return make


def _truncate(frac: float):
    def make(t, s, d):
        b = Path(t).read_bytes()
        Path(d).write_bytes(b[: int(len(b) * frac)])
        return Path(d)
    return make


def _offset(i: int, delta: int):
    def make(t, s, d):
        ti = C.parse(t).tensors[i]
        return C.patch(t, d, [(ti.offset_at, "<Q", ti.offset + delta)])
    return make


def _swap_ne(name: str):
    def make(t, s, d):
        ti = C.parse(t).tensor(name)
        return C.patch(t, d, [(ti.ne_at, "<Q", ti.ne[1]), (ti.ne_at + 8, "<Q", ti.ne[0])])
    return make


def _rename(old: str, new: str):
    def make(t, s, d):
        assert len(old) == len(new)
        b = Path(t).read_bytes()
        assert b.count(old.encode()) == 1
        Path(d).write_bytes(b.replace(old.encode(), new.encode()))
        return Path(d)
    return make


def _tid2eid_id(v: int):
    def make(t, s, d):
        g = C.parse(t)
        ti = g.tensor("blk.0.ffn_gate_tid2eid.weight")
        return C.patch(t, d, [(g.data_start + ti.offset + 4 * ti.ne[0] * 7, "<i", v)])
    return make


def _dup_token(t, s, d):
    g = C.parse(t)
    toks = g.kv("tokenizer.ggml.tokens").value
    toks[5] = toks[4]  # "tok_4" twice
    return C.write(g, d)


def _short_scores(t, s, d):
    g = C.parse(t)
    g.kv("tokenizer.ggml.scores").value.pop()
    return C.write(g, d)


def _dup_key(t, s, d):
    g = C.parse(t)
    g.kvs.append(C.KV(P + "block_count", C.U32, 4))
    return C.write(g, d)


def _ndims5(t, s, d):
    b = bytearray(Path(t).read_bytes())
    ti = C.parse(t).tensors[0]
    struct.pack_into("<I", b, ti.ne_at - 4, 5)  # n_dims 5: the reader stops there
    Path(d).write_bytes(bytes(b))
    return Path(d)


def _field_type(key: str, vtype: int):
    def make(t, s, d):
        k = C.parse(t).kv(key)
        return C.patch(t, d, [(k.value_at - 4, "<I", vtype)])
    return make


def _etype(key: str, etype: int):
    def make(t, s, d):
        k = C.parse(t).kv(key)
        return C.patch(t, d, [(k.count_at - 4, "<I", etype)])
    return make


def _issue_repro(t, s, d):
    """The issue's file: head_count_kv 1 -> 2 at byte 722 of v4-tiny-s0.gguf (found by
    parsing here, so the case survives a change of the fixture's key order)."""
    k = C.parse(t).kv(P + "attention.head_count_kv")
    assert k.value == 1 and k.vtype == C.U32
    return C.patch(t, d, [(k.value_at, "<I", 2)])


RATIOS = P + "attention.compress_ratios"
#: id -> (constraint class, builder(trunk, sidecar, dst), which file it replaces, text the
#: error names)
CORPUS: dict[str, tuple] = {}


def _case(cls: str, cid: str, make, expect: str, which: str = "trunk") -> None:
    CORPUS[cid] = (cls, make, which, expect)


# the issue's repro and its neighbours (all aborted upstream before)
K = "issue"
_case(K, "issue-head_count_kv-2", _issue_repro, "attention.head_count_kv = 2")
_case(K, "value_length-128", _sc("attention.value_length", 128), "attention.value_length = 128")
_case(K, "block_count-0", _sc("block_count", 0), "block_count = 0")
_case(K, "block_count-1000", _sc("block_count", 1000), "block_count = 1000")
_case(K, "expert_used_count-9", _sc("expert_used_count", 9), "expert_used_count = 9")
_case(K, "norm-dtype-i32", _ttype("blk.0.attn_norm.weight", 26),
      "blk.0.attn_norm.weight dtype = 'I32'")
_case(K, "sidecar-head_count_kv-2", _sc_side("attention.head_count_kv", 2),
      "attention.head_count_kv = 2", "sidecar")
_case(K, "sidecar-value_length-128", _sc_side("attention.value_length", 128),
      "attention.value_length = 128", "sidecar")
# file layout (gguf.cpp / llama-model-loader checks)
K = "layout"
_case(K, "truncated-in-data", _truncate(0.6), "runs past the end of the file")
_case(K, "truncated-last-bytes", _truncate(0.999), "runs past the end of the file")
_case(K, "truncated-in-header", _truncate(0.0001), "cannot parse GGUF header")
_case(K, "offset-past-end", _offset(-1, 10**9), "offset = ")
_case(K, "offset-out-of-order", _offset(5, 32), "offset = ")
_case(K, "alignment-0", _kv("general.alignment", C.U32, 0), "alignment = 0")
_case(K, "alignment-string", _kv("general.alignment", C.STRING, "32"),
      "general.alignment must be a u32")
_case(K, "value-type-77", _field_type(P + "block_count", 77), "unknown GGUF value type")
_case(K, "array-element-type-77", _etype(RATIOS, 77), "unknown element type 77")
_case(K, "ggml-type-99", _ttype("output_norm.weight", 99), "ggml type 99")
_case(K, "ggml-type-removed-4", _ttype("output_norm.weight", 4), "ggml type 4")
_case(K, "ggml-block-misfit", _ttype("output_hc_scale.weight", 8),
      "not a multiple of its block size")
_case(K, "duplicate-key", _dup_key, "duplicate key")
_case(K, "n_dims-5", _ndims5, "5 dimensions")
# key types, required keys, the tokenizer (upstream reads each key by exact type)
K = "keys"
_case(K, "missing-key", lambda t, s, d: C.drop_kv(t, d, P + "attention.q_lora_rank"),
      "attention.q_lora_rank = <absent>")
_case(K, "key-wrong-type", _kv("attention.sliding_window", C.F32, 32.0),
      "attention.sliding_window = <f32>: must be a u32")
_case(K, "gating-func-1", _sc("expert_gating_func", 1), "expert_gating_func = 1")
_case(K, "tokens-missing", lambda t, s, d: C.drop_kv(t, d, "tokenizer.ggml.tokens"),
      "tokenizer.ggml.tokens = <absent>")
_case(K, "scores-short", _short_scores, "tokenizer.ggml.scores")
# layer counts
K = "layers"
_case(K, "nextn-2", _sc_side("nextn_predict_layers", 2), "nextn_predict_layers = 2",
      "sidecar")
_case(K, "nextn-without-mtp-block", _kv("nextn_predict_layers", C.U32, 1),
      "blk.3.nextn.eh_proj.weight is absent")
_case(K, "hash_layer_count-5", _sc("hash_layer_count", 5), "hash_layer_count = 5")
# experts
K = "experts"
_case(K, "expert_count-0", _sc("expert_count", 0), "expert_count = 0")
_case(K, "expert_count-2000", _sc("expert_count", 2000), "expert_count = 2000")
_case(K, "expert_used_count-0", _sc("expert_used_count", 0), "expert_used_count = 0")
_case(K, "expert_group_count-2", _kv("expert_group_count", C.U32, 2),
      "expert_group_used_count")
_case(K, "expert_shared_count-0", _sc("expert_shared_count", 0), "expert_shared_count = 0")
_case(K, "expert_used-array-length", _kv("expert_used_count", C.ARRAY, [2, 2], C.U32),
      "needs one per block")
# heads, lengths, ranks, groups
K = "heads"
_case(K, "head_count-0", _sc("attention.head_count", 0), "attention.head_count = 0")
_case(K, "head_count-per-block-differs",
      _kv("attention.head_count", C.ARRAY, [4, 4, 2, 4], C.U32), "same for every block")
_case(K, "output_group_count-0", _sc("attention.output_group_count", 0),
      "output_group_count = 0")
_case(K, "groups-not-dividing-heads", _sc("attention.head_count", 3),
      "must divide attention.head_count (3)")
_case(K, "q_lora_rank-0", _sc("attention.q_lora_rank", 0), "q_lora_rank = 0")
_case(K, "output_lora_rank-0", _sc("attention.output_lora_rank", 0), "output_lora_rank = 0")
_case(K, "key_length_swa-differs", _kv("attention.key_length_swa", C.U32, 128),
      "key_length_swa = 128")
# rope
K = "rope"
_case(K, "rope-odd", _sc("rope.dimension_count", 31), "rope.dimension_count = 31")
_case(K, "rope-beyond-head", _sc("rope.dimension_count", 96), "rope.dimension_count = 96")
_case(K, "rope-scaling-bogus", _kv("rope.scaling.type", C.STRING, "bogus"),
      "rope.scaling.type = 'bogus'")
_case(K, "rope-freq-base-nan", _sc("rope.freq_base", float("nan")), "rope.freq_base")
# window, indexer, hyper-connections, norms
K = "window-indexer-hc"
_case(K, "sliding_window-0", _sc("attention.sliding_window", 0), "sliding_window = 0")
_case(K, "indexer-key_length-96", _sc("attention.indexer.key_length", 96),
      "indexer.key_length = 96")
_case(K, "indexer-key_length-equals-head-in-mtp", _sc_side("attention.indexer.key_length", 64),
      "indexer.key_length = 64", "sidecar")
_case(K, "indexer-head_count-0", _sc("attention.indexer.head_count", 0),
      "indexer.head_count = 0")
_case(K, "hc-count-2", _sc("hyper_connection.count", 2), "hyper_connection.count = 2")
_case(K, "sinkhorn-0", _sc("hyper_connection.sinkhorn_iterations", 0),
      "sinkhorn_iterations = 0")
_case(K, "rms-eps-inf", _sc("attention.layer_norm_rms_epsilon", float("inf")),
      "layer_norm_rms_epsilon = inf")
# compression ratios
K = "ratios"
_case(K, "ratio-2", _kv(RATIOS, C.ARRAY, [0, 0, 4, 2], C.U32), "block 3 has ratio 2")
_case(K, "ratios-short", _kv(RATIOS, C.ARRAY, [0, 0, 4], C.U32), "needs one per block")
_case(K, "no-ratio-4", _kv(RATIOS, C.ARRAY, [0, 0, 128, 128], C.U32), "at least one ratio-4")
_case(K, "mtp-ratio-nonzero", _kv(RATIOS, C.ARRAY, [0, 0, 4, 128, 4], C.U32, side=True),
      "MTP block 4 must have ratio 0", "sidecar")
# tensors: shapes, dtypes, names
K = "tensors"
_case(K, "shape-swapped", _swap_ne("blk.1.attn_q_a.weight"),
      "blk.1.attn_q_a.weight shape = [64, 128]")
_case(K, "matrix-dtype-i32", _ttype("blk.1.attn_q_a.weight", 26),
      "blk.1.attn_q_a.weight dtype = 'I32'")
_case(K, "tid2eid-dtype-f32", _ttype("blk.0.ffn_gate_tid2eid.weight", 0),
      "ffn_gate_tid2eid.weight dtype = 'F32'")
_case(K, "unknown-tensor", _rename("blk.1.attn_sinks.weight", "blk.1.attn_sinkz.weight"),
      "blk.1.attn_sinkz.weight")
_case(K, "hc-base-dtype-i32", _ttype("blk.2.hc_ffn_base.weight", 26),
      "hc_ffn_base.weight dtype = 'I32'")
# tensor data upstream indexes with
K = "data"
_case(K, "tid2eid-id-99", _tid2eid_id(99), "= 99: expert ids must be in 0..3")
_case(K, "tid2eid-id-negative", _tid2eid_id(-1), "= -1: expert ids must be in 0..3")
# the tokenizer strings (only gguf-py's reader, which loading uses, keeps them)
K = "tokens"
_case(K, "token-duplicate", _dup_token, "duplicate token")
# a valid sidecar whose shared keys differ from the trunk's (the pair check)
K = "pair"
_case(K, "pair-rope-freq-base", _sc_side("rope.freq_base", 5000.0),
      "rope.freq_base: trunk 10000.0 vs sidecar 5000.0", "sidecar")
_case(K, "pair-sliding_window", _sc_side("attention.sliding_window", 16),
      "attention.sliding_window: trunk 32 vs sidecar 16", "sidecar")

def _cli_cases() -> tuple[str, ...]:
    first: dict[str, str] = {}
    for cid, (cls, *_) in CORPUS.items():
        first.setdefault(cls, cid)
    issue = [cid for cid, (cls, *_) in CORPUS.items() if cls == "issue"]
    return tuple(issue + [cid for cls, cid in first.items() if cls != "issue"])


CLI_CASES = _cli_cases()
#: layout cases `inventory` must refuse too (it exited 0, or with a traceback, on them)
INVENTORY_CASES = ("truncated-in-data", "truncated-last-bytes", "offset-past-end",
                   "alignment-0", "array-element-type-77", "block_count-1000")


RANGED_CASES = ("issue-head_count_kv-2", "block_count-1000", "missing-key")


@pytest.fixture(scope="module")
def crafted(pair, tmp_path_factory):
    """Every corpus file, written from the fixture pair."""
    d = tmp_path_factory.mktemp("crafted")
    return {cid: make(pair.trunk, pair.sidecar, d / f"{cid}.gguf")
            for cid, (_, make, _, _) in CORPUS.items()}


@pytest.fixture(scope="module")
def cli(pair, crafted):
    """The CLI's answer to the CLI cases (generate) and the inventory cases, a few
    processes at a time."""
    argvs = {}
    for cid in CLI_CASES:
        gen = ["generate", "--tokens", "1,2,3", "--n", "4", "--threads", "1", "--ctx", "256"]
        if CORPUS[cid][2] == "trunk":
            argvs[("generate", cid)] = gen + ["--model", crafted[cid]]
        else:
            argvs[("generate", cid)] = gen + ["--model", pair.trunk, "--mtp", crafted[cid]]
    for cid in INVENTORY_CASES:
        argvs[("inventory", cid)] = ["inventory", crafted[cid]]
    for cid in RANGED_CASES:  # the ranged client reads the header before any shard loads
        argvs[("ranged", cid)] = ["generate", "--tokens", "1,2,3", "--n", "4", "--plan",
                                  "0-1,2-3", "--model", crafted[cid]]
    return dict(zip(argvs, C.run_many(list(argvs.values())), strict=True))


@pytest.mark.parametrize("cid", list(CORPUS))
def test_crafted_file_refused(pair, crafted, cid):
    """Refused by the check every load runs first (Model and the pair check call it), with
    one line naming the key or tensor."""
    cls, _, which, expect = CORPUS[cid]
    read = read_header if cls == "tokens" else read_header_fast
    with pytest.raises(ModelFileError) as e:
        if which == "trunk":
            validate_header(read(crafted[cid]))
        else:
            check_pair(read(pair.trunk), read(crafted[cid]))
    msg = str(e.value)
    assert expect in msg and "\n" not in msg, msg


@pytest.mark.parametrize("cid", CLI_CASES)
def test_cli_refuses_before_upstream(cli, cid):
    """The CLI: exit 2, one error line, no traceback, no signal (these aborted before)."""
    line = cli[("generate", cid)].one_line_error()
    assert CORPUS[cid][3] in line, line


@pytest.mark.parametrize("cid", INVENTORY_CASES)
def test_inventory_refuses_crafted_file(cli, cid):
    line = cli[("inventory", cid)].one_line_error()
    assert line.startswith("mtplib inventory: error:") and CORPUS[cid][3] in line, line


@pytest.mark.parametrize("cid", RANGED_CASES)
def test_ranged_generate_refuses_crafted_trunk(cli, cid):
    line = cli[("ranged", cid)].one_line_error()
    assert CORPUS[cid][3] in line, line


def _verdict(reader, path) -> str:
    try:
        validate_header(reader(path))
    except ModelFileError as e:
        return str(e)
    return "valid"


def test_both_readers_give_the_same_verdict(crafted):
    """A file is refused with the same line through gguf-py's reader (what loading uses)
    and mtplib's fast one (what inventory uses)."""
    for cid in ("issue-head_count_kv-2", "tid2eid-id-99", "shape-swapped", "ratio-2",
                "truncated-in-data", "offset-past-end", "alignment-0", "norm-dtype-i32",
                "token-duplicate"):
        fast, ref = _verdict(read_header_fast, crafted[cid]), _verdict(read_header,
                                                                        crafted[cid])
        if cid == "token-duplicate":  # the fast reader skips the token strings
            assert fast == "valid" and "duplicate token" in ref
        else:
            assert fast == ref != "valid", (cid, fast, ref)


def test_valid_files_pass(pair, combined, tmp_path):
    """No false refusal: the fixture pair, a combined file, the v4-ratio-cpu preset and
    the committed trained pair are all valid."""
    from mtplib.model.fixture import trained_pair, write_fixture

    paths = [pair.trunk, pair.sidecar, combined.paths["trunk"]]
    rc = write_fixture(tmp_path, preset="v4-ratio-cpu")
    paths += [rc.trunk, rc.sidecar]
    tp = trained_pair()
    if tp is not None:
        paths += [tp.trunk, tp.sidecar]
    for p in paths:
        validate_header(read_header_fast(p))
        assert problems(read_header(p)) == [], p


def test_problem_names_key_value_and_rule(crafted):
    files = crafted
    (p,) = problems(read_header_fast(files["issue-head_count_kv-2"]))
    assert (p.what, p.value) == (P + "attention.head_count_kv", 2)
    assert "must be 1" in p.rule
