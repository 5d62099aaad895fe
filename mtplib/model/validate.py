"""Refuse a `deepseek4` GGUF that upstream would abort on, before upstream ever sees it.

Upstream's loader and graph builder for DeepSeek-V4 end the whole process (GGML_ASSERT,
SIGFPE, SIGSEGV) on some header-valid files: a second KV head, a value length unlike the
key length, 0 or 1000 blocks, 9 of 4 experts used, an I32 norm, an out-of-range expert id
in a hash-routing table. This module restates every constraint that loader and graph
assert on or divide by (and what its own checks refuse), derived from the pinned source;
each rule cites the upstream line it restates. It reads only the header (and the small
hash-routing tables), never runs upstream, and is pure Python.

`validate_header(h)` raises ModelFileError (an InputError) naming the key or tensor, its
value and the rule, in one line. Checks run in phases (file layout, key types, the
hyper-parameters, the tensor table, tensor data) and stop at the first phase that finds a
problem, since later phases read what earlier ones vouch for.

Upstream paths are relative to vendor/llama.cpp in the llama-cpp-python 0.3.36 sdist
(llama.cpp 0c1e57098).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from mtplib.model.arch import ARCH, HC, V4Config, block_tensors, root_tensors
from mtplib.model.gguf_header import (
    GGML_TYPE_BY_NAME,
    GGUF_TYPE_NAMES,
    GGUFHeader,
    ModelFileError,
    layout_problem,
)

P = ARCH + "."
U8, I8, U16, I16, U32, I32, F32, BOOL, STR, ARR, U64, I64, F64 = range(13)
LLAMA_MAX_LAYERS = 512  # src/llama-hparams.h:11
LLAMA_MAX_EXPERTS = 1024  # src/llama-hparams.h:12
GATING_SQRT_SOFTPLUS = 4  # src/llama-hparams.h llama_expert_gating_func_type
ROPE_SCALING_TYPES = ("none", "linear", "yarn", "longrope")  # src/llama-model.cpp:1034
RATIOS = (0, 4, 128)  # src/models/deepseek4.cpp:152, DSV4_CSA_RATIO / DSV4_HCA_RATIO

#: ggml types a weight matrix may have: float and block-quantized types the CPU backend
#: multiplies (ggml-cpu.c type_traits_cpu has a vec_dot for them). Not I8/I16/I32/I64/F64
#: (no matmul), nor Q8_1/Q8_K (activation-only types without vec_dot).
MATRIX_DTYPES = frozenset(GGML_TYPE_BY_NAME) - {"I8", "I16", "I32", "I64", "F64", "Q8_1", "Q8_K"}
#: Tensors used as matrices (mul_mat / mul_mat_id / get_rows source) by deepseek4.cpp; every
#: other tensor is an element-wise operand (norm weights, sinks, hc base/scale, biases, ape
#: rows) and must be F32: upstream's fused hc ops assert F32 scale/base (ggml.c:6476-6477),
#: and its converter and llama-quantize write every 1-D tensor F32.
MATRIX_KINDS = frozenset({
    "token_embd", "output", "output_hc_fn", "attn_q_a", "attn_q_b", "attn_kv",
    "attn_output_a", "attn_output_b", "hc_attn_fn", "hc_ffn_fn", "attn_compressor_kv",
    "attn_compressor_gate", "indexer.proj", "indexer.attn_q_b", "indexer_compressor_kv",
    "indexer_compressor_gate", "ffn_gate_inp", "ffn_gate_exps", "ffn_down_exps",
    "ffn_up_exps", "ffn_gate_shexp", "ffn_down_shexp", "ffn_up_shexp", "nextn.eh_proj",
    "nextn.embed_tokens", "nextn.shared_head_head"})


class Shown(str):
    """A description standing in for a value (e.g. ABSENT): printed without quotes."""


ABSENT = Shown("<absent>")


@dataclass(frozen=True)
class Problem:
    """One broken rule: what (a key or a tensor), its value, and the rule."""

    what: str
    value: object
    rule: str

    def __str__(self) -> str:
        v = self.value
        if isinstance(v, list) and len(v) > 8:
            v = f"[{', '.join(map(str, v[:8]))}, ... ({len(v)} entries)]"
        elif isinstance(v, str) and not isinstance(v, Shown):
            v = repr(v[:80])
        what = self.what if self.what.isprintable() else repr(self.what)  # names come from
        return f"{what} = {v}: {self.rule}"  # the file: keep the message on one line


def validate_header(h: GGUFHeader) -> None:
    """Raise ModelFileError with the first broken rule (and how many more in its phase)."""
    probs = problems(h)
    if probs:
        more = f" (and {len(probs) - 1} more problem(s) of this kind)" if len(probs) > 1 else ""
        raise ModelFileError(f"{h.path}: {probs[0]}{more}")


def problems(h: GGUFHeader) -> list[Problem]:
    """The broken rules of the first phase that has any; [] for a file upstream loads."""
    hp = Hparams()
    for phase in (_layout, _key_types, lambda h_, out: _hparams(h_, hp, out),
                  lambda h_, out: _tensors(h_, hp, out), lambda h_, out: _data(h_, hp, out)):
        out: list[Problem] = []
        phase(h, out)
        if out:
            return out
    return []


# ---------------------------------------------------------------------------------------
# phase 1: the file's layout (what gguf.cpp and llama-model-loader check before any key)
# ---------------------------------------------------------------------------------------
def _layout(h: GGUFHeader, out: list[Problem]) -> None:
    # gguf.cpp's alignment, type and packing rules and llama's file-bounds check: the same
    # function mtplib's readers refuse a file with (model/gguf_header.py)
    bad = layout_problem(h)
    if bad:
        out.append(Problem(bad[0], Shown(bad[1]), bad[2]))


# ---------------------------------------------------------------------------------------
# phase 2: key types (llama-model-loader get_key / get_arr / get_key_or_arr)
# ---------------------------------------------------------------------------------------
#: suffix -> (accepted types, required). "arr:T" = an array of T; "T|arr" = a scalar of
#: type T or one array entry per block (get_key_or_arr). Upstream reads each key by exact
#: GGUF type and throws on another (src/llama-model-loader.cpp:164-171, 316-331, 459-482).
KEYS: dict[str, tuple[str, bool]] = {
    "context_length": ("u32", True),  # src/llama-model.cpp:1321
    "embedding_length": ("u32", True),  # :1322
    "embedding_length_out": ("u32", False),  # :1323
    "attention.causal": ("bool", False),  # :1324
    "pooling_type": ("u32", False),  # :1325
    "block_count": ("u32", True),  # :1327
    "nextn_predict_layers": ("u32", False),  # :1329
    "expert_count": ("u32", False),  # :1331
    "expert_used_count": ("u32|arr", False),  # :1333
    "expert_group_count": ("u32", False),  # :1334
    "expert_group_used_count": ("u32", False),  # :1335
    "feed_forward_length": ("u32|arr", False),  # :1395
    "attention.head_count": ("u32|arr", False),  # :1396
    "attention.head_count_kv": ("u32|arr", False),  # :1404
    "rope.scaling.finetuned": ("bool", False),  # :1407
    "rope.scaling.original_context_length": ("u32", False),  # :1411
    "rope.freq_base": ("f32", False),  # :1415
    "rope.scaling.type": ("str", False),  # :1418
    "rope.scaling.factor": ("f32", False),  # :1425
    "rope.scale_linear": ("f32", False),  # :1427
    "rope.scaling.attn_factor": ("f32", False),  # :1431
    "rope.scaling.alpha": ("f32", False),  # :1432
    "attention.key_length": ("u32", False),  # :1440
    "attention.value_length": ("u32", False),  # :1443
    "rope.dimension_count": ("u32", False),  # :1448
    "attention.key_length_swa": ("u32", False),  # :1465
    "attention.value_length_swa": ("u32", False),  # :1466
    "rope.dimension_count_swa": ("u32", False),  # :1469
    # src/models/deepseek4.cpp load_arch_hparams, lines 28-67
    "attention.layer_norm_rms_epsilon": ("f32", True),
    "attention.q_lora_rank": ("u32", True),
    "attention.sliding_window": ("u32", True),
    "expert_feed_forward_length": ("u32|arr", True),
    "expert_shared_count": ("u32", True),
    "expert_weights_scale": ("f32", True),
    "expert_weights_norm": ("bool", True),
    "swiglu_clamp_exp": ("f32|arr", True),
    "swiglu_clamp_shexp": ("f32|arr", False),
    "attention.indexer.head_count": ("u32", True),
    "attention.indexer.key_length": ("u32", True),
    "attention.indexer.top_k": ("u32", True),
    "attention.output_group_count": ("u32", True),
    "attention.output_lora_rank": ("u32", True),
    "attention.compress_rope_freq_base": ("f32", True),
    "hyper_connection.count": ("u32", True),
    "hyper_connection.sinkhorn_iterations": ("u32", True),
    "hyper_connection.epsilon": ("f32", True),
    "hash_layer_count": ("u32", True),
    "attention.compress_ratios": ("arr:int", True),  # get_arr<uint32_t>: bool/u32/i32 items
    "expert_gating_func": ("u32", True),
}
_SCALAR_OF = {"u32": U32, "f32": F32, "bool": BOOL, "str": STR}


def type_name(t: tuple[int, int | None]) -> str:
    """A GGUF value type as upstream's loader names it (``array of f32``)."""
    if t[0] == ARR:
        return f"array of {GGUF_TYPE_NAMES.get(t[1], t[1])}"
    return GGUF_TYPE_NAMES.get(t[0], str(t[0]))


def _key_types(h: GGUFHeader, out: list[Problem]) -> None:
    for suffix, (spec, required) in KEYS.items():
        key = P + suffix
        if key not in h.kv:
            if required:  # llama-model-loader.cpp:428-430: "key not found in model"
                out.append(Problem(key, ABSENT, "required by upstream's deepseek4 loader"))
            continue
        t = h.kv_types.get(key, (-1, None))
        if spec == "arr:int":
            ok = t[0] == ARR and t[1] in (BOOL, U32, I32)  # llama-model-loader.cpp:365-376
            want = "an array of u32 / i32"
        elif spec.endswith("|arr"):
            base = _SCALAR_OF[spec[:-4]]
            ok = t == (base, None) or (t[0] == ARR and (t[1] == base or (
                base == U32 and t[1] in (BOOL, I32))))
            want = f"a {GGUF_TYPE_NAMES[base]} or an array of them (one per block)"
        else:
            ok = t == (_SCALAR_OF[spec], None)
            want = f"a {GGUF_TYPE_NAMES[_SCALAR_OF[spec]]}"
        if not ok:
            out.append(Problem(key, Shown(f"<{type_name(t)}>"), f"must be {want}"))
    # the tokenizer: src/llama-vocab.cpp:2460-2500 (tokens: strings; scores: f32 or i32;
    # token types: i32; at least as many scores / types as tokens)
    tk = "tokenizer.ggml.tokens"
    if tk not in h.kv:
        out.append(Problem(tk, ABSENT, "required (upstream's vocabulary)"))
    elif h.kv_types.get(tk) != (ARR, STR):
        out.append(Problem(tk, Shown(f"<{type_name(h.kv_types.get(tk, (-1, None)))}>"),
                           "must be an array of strings"))
    for key, types in (("tokenizer.ggml.scores", (F32, I32)), ("tokenizer.ggml.token_type",
                                                                (I32,))):
        if key in h.kv:
            t = h.kv_types.get(key, (-1, None))
            if t[0] != ARR or t[1] not in types:
                out.append(Problem(key, Shown(f"<{type_name(t)}>"), "must be an array of "
                                   + " or ".join(GGUF_TYPE_NAMES[x] for x in types)))
            elif h.array_lengths.get(key, 0) < h.array_lengths.get(tk, 0):
                out.append(Problem(key, Shown(f"<{h.array_lengths.get(key)} entries>"),
                                   f"needs one entry per token ({h.array_lengths.get(tk)})"))


# ---------------------------------------------------------------------------------------
# phase 3: the hyper-parameters and their relations
# ---------------------------------------------------------------------------------------
@dataclass
class Hparams:
    """The values upstream derives (filled by phase 3, read by phases 4-5)."""

    n_layer_all: int = 0
    n_nextn: int = 0
    mtp_only: bool = False
    values: dict[str, object] = field(default_factory=dict)
    cfg: V4Config | None = None

    @property
    def n_layer(self) -> int:
        return self.n_layer_all - self.n_nextn


def _per_block(v: object, n: int) -> list:
    """get_key_or_arr: a scalar applies to every block, an array has one entry per block."""
    return list(v) if isinstance(v, list) else [v] * n


def _finite(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _hparams(h: GGUFHeader, hp: Hparams, out: list[Problem]) -> None:  # noqa: C901
    kv = h.kv

    def bad(key: str, rule: str, value: object = None) -> None:
        out.append(Problem(P + key if not key.startswith(("tokenizer.", "blk.")) else key,
                           kv.get(P + key) if value is None else value, rule))

    def g(key: str, default: object = None) -> object:
        return kv.get(P + key, default)

    n_all = g("block_count")
    # src/llama-model.cpp:1328: GGML_ASSERT(0 < n_layer_all <= LLAMA_MAX_LAYERS)
    if not 1 <= n_all <= LLAMA_MAX_LAYERS:
        bad("block_count", f"must be in 1..{LLAMA_MAX_LAYERS} (upstream aborts otherwise)")
        return
    hp.n_layer_all = n_all
    n_nextn = g("nextn_predict_layers", 0)
    # src/llama-model.cpp:1330: GGML_ASSERT(n_layer_nextn <= n_layer_all)
    if n_nextn > n_all:
        bad("nextn_predict_layers", f"must be <= block_count ({n_all}); upstream aborts")
        return
    # src/models/deepseek4.cpp:1365: the MTP graph asserts n_layer_nextn == 1
    if n_nextn > 1:
        bad("nextn_predict_layers", "must be 0 or 1: upstream's V4 MTP graph runs exactly "
            "one MTP block and aborts otherwise")
        return
    if n_nextn:
        probe = f"blk.{n_all - n_nextn}.nextn.eh_proj.weight"
        # src/models/deepseek4.cpp:20-26: without the probe tensor the MTP block is ignored
        if probe not in h.names():
            bad("nextn_predict_layers", f"says the file has an MTP block, but {probe} is "
                "absent (upstream then ignores the MTP block and loads block "
                f"{n_all - n_nextn} as a trunk layer)")
            return
    hp.n_nextn = n_nextn
    n_layer = n_all - n_nextn
    # src/models/deepseek4.cpp:86: mtp_only = n_layer_nextn > 0 && no blk.0.attn_norm
    hp.mtp_only = n_nextn > 0 and "blk.0.attn_norm.weight" not in h.names()
    if n_layer < 1:
        bad("block_count", f"leaves no trunk layer (nextn_predict_layers = {n_nextn}); a V4 "
            "model needs >= 1 trunk layer before its MTP block")
        return

    # per-block arrays: llama-model-loader.cpp:477-479 (length == block_count); V4 reads one
    # value for every block's tensor shapes (deepseek4.cpp LLAMA_LOAD_LOCALS), so the
    # entries must also agree, or the caches and the weights disagree per layer
    per: dict[str, list] = {}
    for key in ("expert_used_count", "feed_forward_length", "attention.head_count",
                "attention.head_count_kv", "expert_feed_forward_length", "swiglu_clamp_exp",
                "swiglu_clamp_shexp"):
        v = g(key)
        if v is None:
            continue
        if isinstance(v, list) and len(v) != n_all:
            bad(key, f"has {len(v)} entries, needs one per block ({n_all}); upstream refuses")
            continue
        vals = _per_block(v, n_all)
        if key not in ("swiglu_clamp_exp", "swiglu_clamp_shexp", "feed_forward_length") \
                and len(set(vals)) > 1:
            bad(key, "must be the same for every block: V4 sizes every layer's weights and "
                "caches from one value")
            continue
        per[key] = vals
    if out:
        return
    for key in ("swiglu_clamp_exp", "swiglu_clamp_shexp"):
        if key in per and not all(_finite(x) for x in per[key]):
            bad(key, "must be finite")

    n_embd = g("embedding_length")
    if n_embd < 1:
        bad("embedding_length", "must be >= 1")
    if g("context_length") < 1:  # the runtime bounds n_ctx by it; 0 leaves no context
        bad("context_length", "must be >= 1")

    # experts: src/llama-model.cpp:1357-1374
    n_expert = g("expert_count", 0)
    used = per.get("expert_used_count", [0])[0]
    groups, group_used = g("expert_group_count", 0), g("expert_group_used_count", 0)
    if not 1 <= n_expert <= LLAMA_MAX_EXPERTS:
        # :1361 asserts <= 1024; V4's graph always routes (deepseek4.cpp build_moe_ffn), and
        # 0 experts aborts upstream
        bad("expert_count", f"must be in 1..{LLAMA_MAX_EXPERTS}: V4 layers are MoE (upstream "
            "aborts otherwise)", n_expert)
    elif not 1 <= used <= n_expert:
        # :1362 GGML_ASSERT(n_expert_used_max <= n_expert), :1364 (n_expert_used_max > 0)
        bad("expert_used_count", f"must be in 1..expert_count ({n_expert}); upstream aborts",
            g("expert_used_count", 0))
    elif groups >= n_expert:  # :1365 GGML_ASSERT(n_expert_groups < n_expert)
        bad("expert_group_count", f"must be < expert_count ({n_expert}); upstream aborts")
    elif groups > 1:
        if n_expert % groups:  # :1367
            bad("expert_group_count", f"must divide expert_count ({n_expert}); upstream aborts")
        elif not 0 < group_used < groups:  # :1368-1369
            bad("expert_group_used_count", f"must be in 1..{groups - 1} "
                "(expert_group_count - 1); upstream aborts", group_used)
        elif n_expert // groups < 2:
            # src/llama-graph.cpp:2103: ggml_argsort_top_k(group, 2) needs 2 experts a group
            bad("expert_group_count", "leaves fewer than 2 experts per group (upstream's "
                "group scoring takes the top 2 of each; it aborts)")
    if g("expert_gating_func") != GATING_SQRT_SOFTPLUS:  # deepseek4.cpp:63-66
        bad("expert_gating_func", f"must be {GATING_SQRT_SOFTPLUS} (sqrtsoftplus), the only "
            "scoring upstream's V4 loader accepts")
    n_ff_exp = per.get("expert_feed_forward_length", [0])[0]
    if n_ff_exp < 1:
        bad("expert_feed_forward_length", "must be >= 1")
    if g("expert_shared_count") < 1:
        # deepseek4.cpp build_ffn(shexp) runs the shared expert in every layer
        bad("expert_shared_count", "must be >= 1: every V4 layer runs its shared expert")

    # attention heads and lengths
    n_head = per.get("attention.head_count", [0])[0]
    if n_head < 1:
        # src/llama-model.cpp:1436-1452: without heads upstream sets head sizes to 0;
        # V4's graph divides by them (deepseek4.cpp:894)
        bad("attention.head_count", "must be >= 1", g("attention.head_count", 0))
        return
    kv_heads = per.get("attention.head_count_kv", [n_head])
    if any(x != 1 for x in kv_heads):
        # src/models/deepseek4.cpp:929: kv is reshaped to [head_dim, 1, n_tokens] (one
        # shared K=V head); the cache holds head_count_kv heads, so ggml_set_rows aborts
        bad("attention.head_count_kv", "must be 1: V4 attention has one shared KV head "
            "(upstream aborts otherwise)", g("attention.head_count_kv", n_head))
    head_k = g("attention.key_length", n_embd // n_head)  # llama-model.cpp:1439-1440
    head_v = g("attention.value_length", n_embd // n_head)  # :1442-1443
    if head_k < 1:
        bad("attention.key_length", "must be >= 1", head_k)
    elif head_v != head_k:
        # src/models/deepseek4.cpp:899: GGML_ASSERT(n_embd_head == n_embd_head_v)
        bad("attention.value_length", f"must equal attention.key_length ({head_k}); "
            "upstream aborts", head_v)
    n_rot = g("rope.dimension_count", head_k)  # llama-model.cpp:1446-1448
    # src/llama-model.cpp:1461-1470: V4 layers are all SWA (deepseek4.cpp:68-74), so the
    # *_swa keys, when present, replace the lengths above
    for swa, base, val in (("attention.key_length_swa", "attention.key_length", head_k),
                           ("attention.value_length_swa", "attention.value_length", head_v),
                           ("rope.dimension_count_swa", "rope.dimension_count", n_rot)):
        if g(swa) is not None and g(swa) != val:
            bad(swa, f"must equal {P}{base} ({val}): V4's layers are all SWA layers, so "
                "upstream sizes them by this key and the weights by the other")
    idx_dim = g("attention.indexer.key_length")
    if n_rot % 2:
        bad("rope.dimension_count", "must be even: ggml's rope turns pairs "
            "(ggml-cpu/ops.cpp:6356 aborts)", n_rot)
    elif n_rot > head_k:
        # deepseek4.cpp:486,536 GGML_ASSERT(n_embd_head >= n_embd_head_rope)
        bad("rope.dimension_count", f"must be <= attention.key_length ({head_k}); upstream "
            "aborts", n_rot)
    elif n_rot > idx_dim:
        # deepseek4.cpp:607 GGML_ASSERT(n_embd_indexer_head >= n_embd_indexer_head_rope)
        bad("rope.dimension_count", f"must be <= attention.indexer.key_length ({idx_dim}); "
            "upstream aborts", n_rot)
    scaling = g("rope.scaling.type", "linear")
    if scaling not in ROPE_SCALING_TYPES:
        # src/llama-model.cpp:1418-1420: GGML_ASSERT(type != UNSPECIFIED)
        bad("rope.scaling.type", f"must be one of {', '.join(ROPE_SCALING_TYPES)}; upstream "
            "aborts on any other", scaling)
    q_lora, o_lora, o_groups = (g("attention.q_lora_rank"), g("attention.output_lora_rank"),
                                g("attention.output_group_count"))
    if q_lora < 1:
        bad("attention.q_lora_rank", "must be >= 1")
    if o_lora < 1:
        bad("attention.output_lora_rank", "must be >= 1")
    if o_groups < 1:
        # deepseek4.cpp:122 and :894 divide by it (SIGFPE)
        bad("attention.output_group_count", "must be >= 1: upstream divides by it (SIGFPE)")
    elif n_head % o_groups:
        # deepseek4.cpp:900: GGML_ASSERT(n_head % n_groups == 0)
        bad("attention.output_group_count", f"must divide attention.head_count ({n_head}); "
            "upstream aborts")
    if g("attention.sliding_window") < 1:
        # src/llama-hparams.h is_masked_swa: p1 - p0 >= n_swa masks every key, the token's own
        bad("attention.sliding_window", "must be >= 1: a window of 0 masks every key, the "
            "token's own included")
    # the lightning indexer
    if g("attention.indexer.head_count") < 1:
        bad("attention.indexer.head_count", "must be >= 1: every ratio-4 layer runs the "
            "lightning indexer")
    if idx_dim < 64 or idx_dim % 64:
        # src/llama-kv-cache.cpp:327-331,1447-1457: the indexer cache always rotates K with
        # a Hadamard matrix of side 64 * 2^k dividing the key length
        bad("attention.indexer.key_length", "must be a positive multiple of 64 (upstream's "
            "indexer cache rotates K in 64-wide Hadamard blocks)", idx_dim)
    elif n_nextn and idx_dim == head_k:
        # reference §3 (checked by running it): equal lengths turn K rotation on for the
        # MTP context's cache too, and creating that context dies with SIGFPE
        bad("attention.indexer.key_length", f"must differ from attention.key_length "
            f"({head_k}) in a file with an MTP block: equal lengths crash MTP context "
            "creation upstream (SIGFPE)", idx_dim)
    # hyper-connections
    if g("hyper_connection.count") != HC:
        # deepseek4.cpp:366 GGML_ASSERT(hc == 4); ggml.c dsv4_hc_comb asserts hc == 4
        bad("hyper_connection.count", f"must be {HC}; upstream aborts otherwise")
    if g("hyper_connection.sinkhorn_iterations") < 1:
        # ggml/src/ggml.c:6478: ggml_dsv4_hc_comb asserts n_iter > 0
        bad("hyper_connection.sinkhorn_iterations", "must be >= 1; upstream aborts")
    for key in ("attention.layer_norm_rms_epsilon", "hyper_connection.epsilon",
                "expert_weights_scale", "rope.scaling.factor", "rope.scale_linear",
                "rope.scaling.attn_factor", "rope.scaling.alpha"):
        if g(key) is not None and not _finite(g(key)):
            bad(key, "must be finite")
    for key in ("attention.layer_norm_rms_epsilon", "hyper_connection.epsilon"):
        if _finite(g(key)) and g(key) < 0:
            bad(key, "must be >= 0")
    for key in ("rope.freq_base", "attention.compress_rope_freq_base"):
        if g(key) is not None and not (_finite(g(key)) and g(key) > 0):
            bad(key, "must be a finite number > 0 (the rope frequency base)")
    # layers: hash routing and compression ratios
    n_hash = g("hash_layer_count")
    if n_hash > n_layer:
        # deepseek4.cpp:1450: the MTP block must not be hash-routed (GGML_ASSERT); hash
        # layers are the first trunk layers
        bad("hash_layer_count", f"must be <= the trunk layer count ({n_layer}); upstream "
            "aborts on a hash-routed MTP block")
    ratios = g("attention.compress_ratios")
    if len(ratios) < n_all:  # deepseek4.cpp:57-59
        bad("attention.compress_ratios", f"has {len(ratios)} entries, needs one per block "
            f"({n_all}); upstream refuses")
    elif len(ratios) > LLAMA_MAX_LAYERS:  # deepseek4.cpp:60 GGML_ASSERT(<= LLAMA_MAX_LAYERS)
        bad("attention.compress_ratios", f"has {len(ratios)} entries, more than "
            f"{LLAMA_MAX_LAYERS}; upstream aborts")
    else:
        odd = [(i, r) for i, r in enumerate(ratios[:n_all]) if r not in RATIOS]
        if odd:  # deepseek4.cpp:150-153 (ratios 0, 4 and 128 only)
            bad("attention.compress_ratios", f"block {odd[0][0]} has ratio {odd[0][1]}; "
                "ratios must be 0, 4 or 128")
        elif any(r for r in ratios[n_layer:n_all]):
            # deepseek4.cpp:938: GGML_ASSERT(inp_dsv4 || ratio == 0) in the MTP graph
            bad("attention.compress_ratios", f"the MTP block {n_layer} must have ratio 0; "
                "upstream aborts")
        elif 4 not in ratios[:n_layer]:
            # reference §3 (checked by running it): no ratio-4 layer leaves the indexer
            # cache empty and context creation dies with SIGFPE
            bad("attention.compress_ratios", "needs at least one ratio-4 (CSA) trunk layer: "
                "without one, upstream's context creation dies with SIGFPE")
    # the vocabulary
    n_vocab = h.n_vocab
    if n_vocab < 1:
        bad("tokenizer.ggml.tokens", "must hold at least one token", Shown(f"<{n_vocab} entries>"))
    toks = kv.get("tokenizer.ggml.tokens")
    if isinstance(toks, list):
        seen: set[str] = set()
        for i, tok in enumerate(toks):
            word = tok or f"[EMPTY_{i}]"  # src/llama-vocab.cpp:2512-2515
            if word in seen:
                # src/llama-vocab.cpp:2544: GGML_ASSERT(id_to_token.size() == token_to_id.size())
                bad("tokenizer.ggml.tokens", "every token string must be unique (upstream "
                    "aborts on a duplicate)", Shown(f"<duplicate token {word[:40]!r} at id {i}>"))
                break
            seen.add(word)
    if out:
        return
    hp.values = {"n_embd": n_embd, "n_head": n_head, "head_k": head_k, "n_rot": n_rot,
                 "n_expert": n_expert, "n_expert_used": used, "n_ff_exp": n_ff_exp}
    hp.cfg = V4Config(
        n_vocab=n_vocab, n_embd=n_embd, n_layer=n_layer, n_head=n_head, head_dim=head_k,
        rope_dim=n_rot, q_lora=q_lora, o_groups=o_groups, o_lora=o_lora, n_expert=n_expert,
        n_expert_used=used, n_ff_exp=n_ff_exp, n_expert_shared=g("expert_shared_count"),
        n_hash_layers=n_hash, sliding_window=g("attention.sliding_window"),
        indexer_heads=g("attention.indexer.head_count"), indexer_dim=idx_dim,
        indexer_top_k=g("attention.indexer.top_k"), compress_ratios=tuple(ratios[:n_all]),
        n_mtp=n_nextn)


# ---------------------------------------------------------------------------------------
# phase 4: the tensor table (src/models/deepseek4.cpp load_arch_tensors, lines 82-190)
# ---------------------------------------------------------------------------------------
def _tensors(h: GGUFHeader, hp: Hparams, out: list[Problem]) -> None:
    cfg = hp.cfg
    assert cfg is not None
    E, V = cfg.n_embd, cfg.n_vocab
    expected: dict[str, tuple[tuple[int, ...], str, bool]] = {}  # name -> (ne, kind, required)
    for s in root_tensors(cfg):
        expected[s.name] = (s.ne, s.kind, True)
    for i in range(hp.n_layer_all):
        # deepseek4.cpp:87-88: an MTP-only file's trunk blocks are not required
        required = not (i < hp.n_layer and hp.mtp_only)
        for s in block_tensors(cfg, i):
            expected[s.name] = (s.ne, s.kind, required and s.kind != "nextn.shared_head_norm")
        # deepseek4.cpp:163 (vision routing bias) and :184-186: optional tensors
        expected[f"blk.{i}.exp_probs_b_vl.bias"] = ((cfg.n_expert,), "exp_probs_b_vl", False)
        if i >= hp.n_layer:
            expected[f"blk.{i}.nextn.embed_tokens.weight"] = ((E, V), "nextn.embed_tokens",
                                                             False)
            expected[f"blk.{i}.nextn.shared_head_head.weight"] = ((E, V),
                                                                 "nextn.shared_head_head", False)
    have = {t.name: t for t in h.tensors}
    for t in h.tensors:
        if t.name not in expected:
            # llama-model-loader.cpp:1393-1398: a tensor the loader never creates makes it
            # refuse the file ("wrong number of tensors")
            out.append(Problem(f"tensor {t.name}", list(t.ne), "not a tensor upstream's "
                               "deepseek4 loader creates for these hyper-parameters"))
            continue
        ne, kind, _ = expected[t.name]
        got = tuple(t.ne) + (1,) * (4 - len(t.ne))
        want = tuple(ne) + (1,) * (4 - len(ne))
        if kind == "attn_output_a":
            # deepseek4.cpp:122: TENSOR_ALLOW_RESHAPE, so only the element count must match
            # (llama-model-loader.cpp:896-905)
            ok = math.prod(got) == math.prod(want)
        else:
            ok = got == want  # llama-model-loader.cpp:906-912: ne equal, trailing dims 1
        if not ok:
            out.append(Problem(f"tensor {t.name} shape", list(t.ne),
                               f"upstream expects {list(ne)} for these hyper-parameters"))
        elif kind == "ffn_gate_tid2eid":
            if t.dtype != "I32":  # deepseek4.cpp:1420 get_rows -> expert ids, which are I32
                out.append(Problem(f"tensor {t.name} dtype", t.dtype, "must be I32 (expert "
                                   "ids of the hash routing)"))
        elif kind in MATRIX_KINDS:
            if t.dtype not in MATRIX_DTYPES:
                out.append(Problem(f"tensor {t.name} dtype", t.dtype, "a weight matrix must "
                                   "be F32, F16, BF16 or a block-quantized type the CPU "
                                   "backend multiplies (not an integer type, Q8_1 or Q8_K)"))
        elif t.dtype != "F32":
            out.append(Problem(f"tensor {t.name} dtype", t.dtype, "must be F32 (an "
                               "element-wise operand: upstream's ops assert F32)"))
    for name, (ne, _, required) in expected.items():
        if required and name not in have:  # llama-model-loader.cpp:886-891
            out.append(Problem(f"tensor {name}", ABSENT, f"required by upstream's "
                               f"deepseek4 loader (shape {list(ne)})"))


# ---------------------------------------------------------------------------------------
# phase 5: data upstream indexes with (the hash-routing tables)
# ---------------------------------------------------------------------------------------
def _data(h: GGUFHeader, hp: Hparams, out: list[Problem]) -> None:
    import numpy as np

    n_expert = hp.values["n_expert"]
    for t in h.tensors:
        if not t.name.endswith(".ffn_gate_tid2eid.weight"):
            continue
        # deepseek4.cpp:1420: the ids pick expert rows; ggml-cpu/ops.cpp:5363 aborts on an
        # id outside [0, n_expert)
        ids = np.fromfile(h.path, dtype="<i4", count=math.prod(t.ne), offset=t.offset)
        bad = np.flatnonzero((ids < 0) | (ids >= n_expert))
        if bad.size:
            j = int(bad[0])
            out.append(Problem(f"tensor {t.name}[token {j // t.ne[0]}]", int(ids[j]),
                               f"expert ids must be in 0..{n_expert - 1} (upstream aborts)"))
