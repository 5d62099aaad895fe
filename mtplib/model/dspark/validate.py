"""Refuse a DSpark draft (and a draft/trunk pairing) before upstream sees it.

Upstream's `dflash` loader and graph end the process (GGML_ASSERT) on some header-valid
drafts: hc != 4, output_group_count 0, sliding_window 0, key_length != value_length,
Markov tensors without ``dflash.block_size``, a ``target_layers`` entry past the trunk's
layers; others make the load throw (gating != 4, a compress ratio != 0, an extra tensor)
or run silently wrong (no mask token, a draft n_embd unlike the trunk's). Each rule cites
the pinned source (paths relative to vendor/llama.cpp in the llama-cpp-python 0.3.36
sdist; reference v4-dspark.md §1.2, §4.3). Pure Python: the header only.

`validate_dspark(h, trunk)` returns the draft's `DSparkConfig` or raises `DSparkFileError`
(a ModelFileError, so an InputError) naming the first broken rule in one line. Checks run
in phases (layout, key types, hyper-parameters, tensors, the trunk) and stop at the first
phase with a problem.
"""

from __future__ import annotations

import math

from mtplib.model.arch import block_tensors
from mtplib.model.dspark.spec import (
    ARCH,
    MARKOV_W1,
    MASK_KEY,
    ROOT_KINDS,
    ROOT_MATRICES,
    DSparkConfig,
    stage_config,
)
from mtplib.model.gguf_header import (
    GGUFHeader,
    ModelFileError,
    layout_problem,
)
from mtplib.model.validate import (
    ABSENT,
    ARR,
    BOOL,
    F32,
    I32,
    MATRIX_DTYPES,
    MATRIX_KINDS,
    STR,
    U32,
    Problem,
    Shown,
    type_name,
)

P = ARCH + "."
LLAMA_MAX_LAYERS = 512  # src/llama-hparams.h:11
LLAMA_MAX_EXPERTS = 1024  # src/llama-hparams.h:12


class DSparkFileError(ModelFileError):
    """A DSpark draft upstream would abort on, refuse, or run silently wrong with."""


#: suffix -> (type, required). "T|arr": a scalar or one entry per stage (get_key_or_arr).
KEYS: dict[str, tuple[str, bool]] = {
    "context_length": ("u32", True),  # src/llama-model.cpp:1321
    "embedding_length": ("u32", True),  # :1322
    "block_count": ("u32", True),  # :1327
    "expert_count": ("u32", True),  # :1331 (optional there; the V4 stages route)
    "expert_used_count": ("u32|arr", True),  # :1333
    "feed_forward_length": ("u32|arr", False),  # :1395
    "attention.head_count": ("u32|arr", True),  # :1396
    "attention.head_count_kv": ("u32|arr", True),  # :1404 (default n_head: must be 1)
    "attention.key_length": ("u32", True),  # :1440
    "attention.value_length": ("u32", True),  # :1443
    "rope.dimension_count": ("u32", True),  # :1448
    "rope.freq_base": ("f32", False),  # :1415
    "attention.layer_norm_rms_epsilon": ("f32", True),  # src/models/dflash.cpp:23
    "target_layers": ("arr:int", True),  # dflash.cpp:37-39 (throws if absent)
    "block_size": ("u32", True),  # dflash.cpp:31; :311-314 asserts it with Markov tensors
    "hyper_connection.count": ("u32", True),  # dflash.cpp:53 (> 0: the DSV4 backbone)
    "attention.q_lora_rank": ("u32", True),  # dflash.cpp:55-70
    "attention.sliding_window": ("u32", True),
    "expert_feed_forward_length": ("u32|arr", True),
    "expert_shared_count": ("u32", True),
    "expert_weights_scale": ("f32", True),
    "expert_weights_norm": ("bool", True),
    "expert_gating_func": ("u32", True),
    "swiglu_clamp_exp": ("f32|arr", True),
    "swiglu_clamp_shexp": ("f32|arr", False),
    "attention.output_group_count": ("u32", True),
    "attention.output_lora_rank": ("u32", True),
    "hyper_connection.sinkhorn_iterations": ("u32", True),
    "hyper_connection.epsilon": ("f32", True),
    "attention.compress_ratios": ("arr:int", False),  # dflash.cpp:71 (absent: all 0)
    "sample_from_anchor": ("bool", False),  # raw KV, dflash.cpp:317, speculative.cpp:987
    "attention.causal": ("bool", False),  # speculative.cpp:990
    "has_confidence_head": ("bool", False),  # speculative.cpp:998-1004
}
_SCALAR = {"u32": U32, "f32": F32, "bool": BOOL}
#: per-stage keys whose entries must agree (one value sizes every stage's weights)
_UNIFORM = ("expert_used_count", "attention.head_count", "attention.head_count_kv",
            "expert_feed_forward_length")


def is_dspark(h: GGUFHeader) -> bool:
    """Upstream's auto-detection (common/speculative.cpp:2287-2300): arch `dflash` and a
    ``markov_w1.weight`` tensor."""
    return h.arch == ARCH and MARKOV_W1 in h.names()


def validate_dspark(h: GGUFHeader, trunk: GGUFHeader | None = None) -> DSparkConfig:
    """The draft's config, or DSparkFileError naming the first broken rule. With
    ``trunk`` (a validated deepseek4 trunk header) the pairing is checked too."""
    cfg, probs = dspark_problems(h, trunk)
    if probs:
        more = f" (and {len(probs) - 1} more problem(s) of this kind)" if len(probs) > 1 else ""
        raise DSparkFileError(f"{h.path}: {probs[0]}{more}")
    assert cfg is not None
    return cfg


def dspark_problems(h: GGUFHeader, trunk: GGUFHeader | None = None
                    ) -> tuple[DSparkConfig | None, list[Problem]]:
    """(config, []) for a draft upstream runs, else (None or the config, the problems of
    the first phase that has any)."""
    out: list[Problem] = []
    bad = layout_problem(h)
    if bad:
        return None, [Problem(bad[0], Shown(bad[1]), bad[2])]
    if h.arch != ARCH:
        return None, [Problem("general.architecture", h.arch, "a DSpark draft is arch "
                              "'dflash' (upstream's converter: --dspark)")]
    _key_types(h, out)
    if out:
        return None, out
    cfg = _hparams(h, out)
    if out or cfg is None:
        return None, out
    _tensors(h, cfg, out)
    if out:
        return cfg, out
    if trunk is not None:
        _pairing(h, cfg, trunk, out)
    return cfg, out


def _key_types(h: GGUFHeader, out: list[Problem]) -> None:
    # llama-model-loader.cpp:164-171, 316-331, 459-482: keys are read by exact type
    for suffix, (spec, required) in KEYS.items():
        key = P + suffix
        if key not in h.kv:
            if required:
                out.append(Problem(key, ABSENT, "required for a V4 DSpark draft "
                                   "(src/models/dflash.cpp, llama-model.cpp)"))
            continue
        t = h.kv_types.get(key, (-1, None))
        if spec == "arr:int":
            ok, want = t[0] == ARR and t[1] in (U32, I32), "an array of u32 / i32"
        elif spec.endswith("|arr"):
            base = _SCALAR[spec[:-4]]
            ok = t == (base, None) or (t[0] == ARR and t[1] in ((base, I32) if base == U32
                                                                 else (base,)))
            want = f"a {spec[:-4]} or one per stage"
        else:
            ok, want = t == (_SCALAR[spec], None), f"a {spec}"
        if not ok:
            out.append(Problem(key, Shown(f"<{type_name(t)}>"), f"must be {want}"))
    tk = "tokenizer.ggml.tokens"
    if h.kv_types.get(tk) != (ARR, STR):
        out.append(Problem(tk, ABSENT if tk not in h.kv else Shown("<not strings>"),
                           "required: the target's vocabulary (an array of strings)"))
    if MASK_KEY not in h.kv:
        # speculative.cpp:997: llama_vocab_mask would be -1, the noise block's token
        out.append(Problem(MASK_KEY, ABSENT, "required: the noise token of the draft block "
                           "(the converter writes dspark_noise_token_id)"))
    elif h.kv_types.get(MASK_KEY) != (U32, None):
        out.append(Problem(MASK_KEY, Shown(f"<{type_name(h.kv_types[MASK_KEY])}>"),
                           "must be a u32"))


def _hparams(h: GGUFHeader, out: list[Problem]) -> DSparkConfig | None:  # noqa: C901
    kv = h.kv

    def g(key: str, default: object = None) -> object:
        return kv.get(P + key, default)

    def bad(key: str, rule: str, value: object = None) -> None:
        full = key if key.startswith("tokenizer.") else P + key
        out.append(Problem(full, kv.get(full) if value is None else value, rule))

    n_st = g("block_count")
    if not 1 <= n_st <= LLAMA_MAX_LAYERS:  # llama-model.cpp:1328 asserts
        bad("block_count", f"must be in 1..{LLAMA_MAX_LAYERS} (upstream aborts otherwise)")
        return None
    per: dict[str, list] = {}
    for key in ("expert_used_count", "feed_forward_length", "attention.head_count",
                "attention.head_count_kv", "expert_feed_forward_length", "swiglu_clamp_exp",
                "swiglu_clamp_shexp"):
        v = g(key)
        if v is None:
            continue
        if isinstance(v, list) and len(v) != n_st:  # llama-model-loader.cpp:477-479
            bad(key, f"has {len(v)} entries, needs one per stage ({n_st}); upstream refuses")
            continue
        vals = list(v) if isinstance(v, list) else [v] * n_st
        if key in _UNIFORM and len(set(vals)) > 1:
            bad(key, "must be the same for every stage (one value sizes every stage)")
            continue
        per[key] = vals
    if out:
        return None
    hc = g("hyper_connection.count")
    if hc != 4:  # src/models/deepseek4.cpp:366 GGML_ASSERT(hc == 4); 0 is plain DFlash
        bad("hyper_connection.count", "must be 4 (the V4 DSpark backbone; upstream's hc "
            "ops assert 4, and 0 would be a plain DFlash draft, which mtplib does not run)")
    if any(x != 1 for x in per["attention.head_count_kv"]):
        # src/llama-kv-cache.cpp:1343-1360: cpy_k writes one shared-KV head
        bad("attention.head_count_kv", "must be 1 (V4 attention has one shared KV head; "
            "upstream's K write would abort)")
    head_dim = g("attention.key_length")
    if head_dim != g("attention.value_length"):  # deepseek4.cpp:899 asserts K == V
        bad("attention.value_length", f"must equal key_length ({head_dim}); upstream aborts")
    n_head = per["attention.head_count"][0]
    groups = g("attention.output_group_count")
    if n_head < 1:
        bad("attention.head_count", "must be >= 1")
    if groups < 1:  # dflash.cpp:72 GGML_ASSERT(o_group_count > 0)
        bad("attention.output_group_count", "must be >= 1 (upstream aborts on 0)")
    elif n_head % groups:  # deepseek4.cpp:900
        bad("attention.output_group_count", f"must divide head_count ({n_head})")
    if g("attention.sliding_window") < 1:  # dflash.cpp:83 GGML_ASSERT(n_swa > 0)
        bad("attention.sliding_window", "must be >= 1 (every stage is sliding-window; "
            "upstream aborts on 0)")
    if g("expert_gating_func") != 4:  # dflash.cpp:74-76 throws
        bad("expert_gating_func", "must be 4 (sqrtsoftplus); upstream refuses the draft")
    ratios = g("attention.compress_ratios")
    if ratios is not None:
        if len(ratios) != n_st:
            bad("attention.compress_ratios", f"has {len(ratios)} entries, needs {n_st}")
        elif any(r != 0 for r in ratios):  # dflash.cpp:77-81 throws
            bad("attention.compress_ratios", "must be all 0 (DSpark stages attend "
                "uncompressed); upstream refuses the draft")
    n_expert = g("expert_count")
    used = per["expert_used_count"][0]
    if not 1 <= n_expert <= LLAMA_MAX_EXPERTS:  # llama-model.cpp:1357-1374
        bad("expert_count", f"must be in 1..{LLAMA_MAX_EXPERTS}")
    elif not 1 <= used <= n_expert:
        bad("expert_used_count", f"must be in 1..expert_count ({n_expert}); upstream aborts")
    for key in ("embedding_length", "context_length", "attention.q_lora_rank",
                "attention.output_lora_rank", "expert_shared_count"):
        if g(key) < 1:
            bad(key, "must be >= 1")
    if per["expert_feed_forward_length"][0] < 1:
        bad("expert_feed_forward_length", "must be >= 1")
    rope = g("rope.dimension_count")
    if not (1 <= rope <= (head_dim or 0)) or rope % 2:
        bad("rope.dimension_count", f"must be even and in 1..key_length ({head_dim})")
    eps = g("attention.layer_norm_rms_epsilon")
    if not (math.isfinite(eps) and eps > 0):
        bad("attention.layer_norm_rms_epsilon", "must be finite and > 0")
    for key in ("swiglu_clamp_exp", "swiglu_clamp_shexp"):
        if key in per and not all(math.isfinite(x) for x in per[key]):
            bad(key, "must be finite")
    layers = g("target_layers")
    if not layers or any(not 0 <= x <= LLAMA_MAX_LAYERS for x in layers):
        bad("target_layers", "must list the trunk layer inputs the draft reads (ids in "
            "0..n_layer, as the converter writes them: layer ids + 1)")
    if g("block_size") < 1:  # dflash.cpp:315 GGML_ASSERT(block_size > 0)
        bad("block_size", "must be >= 1 (the trained block size; upstream aborts on 0)")
    if g("sample_from_anchor", True) is False:
        bad("sample_from_anchor", "false is the DFlash bonus-anchor layout: mtplib drafts "
            "anchor-first DSpark blocks only (not built)")
    n_vocab = h.n_vocab
    mask = kv.get(MASK_KEY)
    if not 0 <= mask < n_vocab:
        bad(MASK_KEY, f"must be a token id in 0..{n_vocab - 1}")
    if out:
        return None
    w1 = h.tensor(MARKOV_W1)
    has_conf = h.tensor("conf_proj.weight") is not None and g("has_confidence_head", True)
    return DSparkConfig(
        n_vocab=n_vocab, n_embd=g("embedding_length"), n_stages=n_st, n_head=n_head,
        head_dim=head_dim, rope_dim=rope, q_lora=g("attention.q_lora_rank"), o_groups=groups,
        o_lora=g("attention.output_lora_rank"), n_expert=n_expert, n_expert_used=used,
        n_ff_exp=per["expert_feed_forward_length"][0],
        n_expert_shared=g("expert_shared_count"),
        sliding_window=g("attention.sliding_window"), target_layers=tuple(layers),
        mask_token_id=mask, block_size=g("block_size"),
        markov_rank=w1.ne[0] if w1 is not None else 0, confidence_head=bool(has_conf),
        n_ctx_train=g("context_length"), rms_eps=eps, rope_freq_base=g("rope.freq_base", 1e4),
        hc_sinkhorn_iters=g("hyper_connection.sinkhorn_iterations"),
        hc_eps=g("hyper_connection.epsilon"),
        expert_weights_scale=g("expert_weights_scale"),
        expert_weights_norm=g("expert_weights_norm"),
        swiglu_clamp=per["swiglu_clamp_exp"][0],
        tokenizer=str(kv.get("tokenizer.ggml.model", "")))


def _tensors(h: GGUFHeader, c: DSparkConfig, out: list[Problem]) -> None:
    """dflash.cpp:111-220: the tensors upstream creates, their shapes and dtypes."""
    if h.tensor(MARKOV_W1) is None:
        out.append(Problem(f"tensor {MARKOV_W1}", ABSENT, "not a DSpark draft: a `dflash` "
                           "file without the Markov head is a plain DFlash draft, which "
                           "mtplib does not run"))
        return
    E, V, R = c.n_embd, c.n_vocab, c.markov_rank
    root_ne = {"markov_w1.weight": (R, V), "markov_w2.weight": (R, V), "markov_w2.scale": (1,),
               "conf_proj.weight": (E + R, 1), "conf_proj.bias": (1,),
               "fc.weight": (c.feature_width, E), "fc.scale": (1,),
               "enc.output_norm.weight": (E,), "output_norm.weight": (E,),
               "output_hc_fn.weight": (4 * E, 4), "output_hc_base.weight": (4,),
               "output_hc_scale.weight": (1,), "token_embd.weight": (E, V),
               "output.weight": (E, V)}
    # name -> (ne, kind, required, matrix)
    expected = {n: (root_ne[n], kind, req, kind in ROOT_MATRICES)
                for n, (kind, req) in ROOT_KINDS.items()}
    for i in range(c.n_stages):
        for s in _stage_specs(c, i):
            expected[s.name] = (s.ne, s.kind, True, s.kind in MATRIX_KINDS)
    have = {t.name for t in h.tensors}
    for t in h.tensors:
        if t.name not in expected:
            why = {"d2t": "a reduced draft vocabulary (d2t) is not built in mtplib"}.get(
                t.name, "not a tensor upstream's dflash loader creates for a V4 DSpark draft "
                "(llama-model-loader.cpp:1398 then refuses the file)")
            if t.name.startswith("selector_"):
                why = "a DFlash2 selector: not a DSpark draft (not built in mtplib)"
            out.append(Problem(f"tensor {t.name}", list(t.ne), why))
            continue
        ne, kind, _, matrix = expected[t.name]
        got = tuple(t.ne) + (1,) * (4 - len(t.ne))
        want = tuple(ne) + (1,) * (4 - len(ne))
        ok = math.prod(got) == math.prod(want) if kind == "attn_output_a" else got == want
        if not ok:
            out.append(Problem(f"tensor {t.name} shape", list(t.ne),
                               f"upstream expects {list(ne)} for these hyper-parameters"))
        elif matrix and t.dtype not in MATRIX_DTYPES:
            out.append(Problem(f"tensor {t.name} dtype", t.dtype, "a weight matrix must be "
                               "a float or block-quantized type the CPU backend multiplies"))
        elif not matrix and t.dtype != "F32":
            out.append(Problem(f"tensor {t.name} dtype", t.dtype, "must be F32 (an "
                               "element-wise operand)"))
    for name, (ne, _, required, _) in expected.items():
        if required and name not in have:  # llama-model-loader.cpp:886-891
            out.append(Problem(f"tensor {name}", ABSENT, f"required by upstream's dflash "
                               f"loader (shape {list(ne)})"))


def _stage_specs(c: DSparkConfig, i: int):
    return block_tensors(stage_config(c), i)


def _pairing(h: GGUFHeader, c: DSparkConfig, trunk: GGUFHeader, out: list[Problem]) -> None:
    """The draft runs on the trunk's features, token embeddings and output head."""
    tk = trunk.kv
    n_layer = int(tk["deepseek4.block_count"]) - int(tk.get("deepseek4.nextn_predict_layers", 0))
    if c.n_embd != tk["deepseek4.embedding_length"]:
        # speculative.cpp:976-978 sizes features by the target's n_embd, dflash.cpp:41 by
        # the draft's; upstream does not compare them
        out.append(Problem(P + "embedding_length", c.n_embd, f"must equal the trunk's "
                           f"({tk['deepseek4.embedding_length']}): the draft reads the "
                           "trunk's features, embeddings and output head"))
    far = [x for x in c.target_layers if x > n_layer]
    if far:  # llama-context.cpp:1240 GGML_ASSERT(lid <= n_layer)
        out.append(Problem(P + "target_layers", list(c.target_layers), f"entries {far} are "
                           f"past the trunk's {n_layer} layers (upstream aborts; "
                           f"{n_layer} = the last layer's output)"))
    if c.n_vocab != trunk.n_vocab:
        out.append(Problem("tokenizer.ggml.tokens", Shown(f"<{c.n_vocab} tokens>"),
                           f"must be the trunk's vocabulary ({trunk.n_vocab} tokens)"))
    tm = tk.get("tokenizer.ggml.model")
    if c.tokenizer != tm:
        out.append(Problem("tokenizer.ggml.model", c.tokenizer, f"must be the trunk's "
                           f"({tm!r})"))
