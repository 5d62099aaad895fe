"""DeepSeek-V4 DSpark drafts (GGUF arch `dflash` + `markov_w1`): hyper-parameters, GGUF
keys and tensor table.

Why its own table: DeepSeek-V4-Flash's official release drafts with DSpark, not with a
NextN MTP block. The pinned upstream loads it as architecture `dflash`
(src/models/dflash.cpp); the registry `gguf` package does not know the names, so mtplib
owns them, restated from the pinned source (dflash.cpp load_arch_hparams/_tensors,
reference v4-dspark.md §1). A draft has ``n_stages`` full V4 blocks (hc, MLA attention with
one shared KV head, MoE with sqrtsoftplus gating and no hash routing, every stage sliding
window, compress ratio 0), the Markov and confidence heads, and ``fc`` fusing the target's
layer-input features (one n_embd row per target layer). It carries no ``token_embd`` /
``output`` of its own: upstream then takes the target's through ``ctx_other``.
Shapes are ggml ``ne`` order. Pure Python.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from mtplib.model.arch import HC, TensorSpec, V4Config, block_tensors

ARCH = "dflash"
#: the tensor whose presence makes a `dflash` file a DSpark draft (common/speculative.cpp)
MARKOV_W1 = "markov_w1.weight"
#: the noise token of the block (tokenizer key; upstream's `llama_vocab_mask`)
MASK_KEY = "tokenizer.ggml.mask_token_id"
#: root tensors upstream may create for a DSpark draft: name -> (kind, required)
ROOT_KINDS: dict[str, tuple[str, bool]] = {
    "markov_w1.weight": ("markov_w1", True),
    "markov_w2.weight": ("markov_w2", True),
    "markov_w2.scale": ("markov_w2_scale", False),
    "conf_proj.weight": ("conf_proj", False),
    "conf_proj.bias": ("conf_proj_bias", False),
    "fc.weight": ("fc", True),
    "fc.scale": ("fc_scale", False),
    "enc.output_norm.weight": ("enc_output_norm", True),
    "output_norm.weight": ("output_norm", True),
    "output_hc_fn.weight": ("output_hc_fn", True),
    "output_hc_base.weight": ("output_hc_base", True),
    "output_hc_scale.weight": ("output_hc_scale", True),
    "token_embd.weight": ("token_embd", False),
    "output.weight": ("output", False),
}
#: roots used as matrices (mul_mat / get_rows sources); the rest are element-wise F32
ROOT_MATRICES = frozenset({"markov_w1", "markov_w2", "conf_proj", "fc", "output_hc_fn",
                           "token_embd", "output"})


@dataclass(frozen=True)
class DSparkConfig:
    """Hyper-parameters of a V4 DSpark draft (what its `dflash.*` keys say)."""

    n_vocab: int
    n_embd: int
    n_stages: int  # block_count: the draft's V4 stages
    n_head: int
    head_dim: int  # key_length = value_length, one shared KV head
    rope_dim: int
    q_lora: int
    o_groups: int
    o_lora: int
    n_expert: int
    n_expert_used: int
    n_ff_exp: int
    n_expert_shared: int
    sliding_window: int
    #: the trunk layer inputs the draft reads, as upstream's converter writes them (layer
    #: ids + 1: the input of layer i+1 = the output of layer i; n_layer = the last output)
    target_layers: tuple[int, ...]
    mask_token_id: int
    block_size: int = 5
    markov_rank: int = 16
    confidence_head: bool = True
    n_ctx_train: int = 4096
    rms_eps: float = 1e-6
    rope_freq_base: float = 10000.0
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    expert_weights_scale: float = 1.5
    expert_weights_norm: bool = True
    swiglu_clamp: float = 10.0
    tokenizer: str = "test"

    @property
    def feature_width(self) -> int:
        """Floats per token the draft's ``fc`` reads: one n_embd row per target layer."""
        return len(self.target_layers) * self.n_embd

    def to_dict(self) -> dict:
        d = asdict(self)
        d["target_layers"] = list(self.target_layers)
        return d


def dspark_config_for(cfg: V4Config, *, n_stages: int = 3, block_size: int = 5,
                      markov_rank: int = 16) -> DSparkConfig:
    """The DSpark draft a trunk of ``cfg`` gets in the fixtures: its widths, stages like its
    blocks, and the last ``n_stages`` layers' outputs as features (V4-Flash: layers 40-42,
    written [41, 42, 43])."""
    n = min(n_stages, cfg.n_layer)
    return DSparkConfig(
        n_vocab=cfg.n_vocab, n_embd=cfg.n_embd, n_stages=n_stages, n_head=cfg.n_head,
        head_dim=cfg.head_dim, rope_dim=cfg.rope_dim, q_lora=cfg.q_lora,
        o_groups=cfg.o_groups, o_lora=cfg.o_lora, n_expert=cfg.n_expert,
        n_expert_used=cfg.n_expert_used, n_ff_exp=cfg.n_ff_exp,
        n_expert_shared=cfg.n_expert_shared, sliding_window=cfg.sliding_window,
        target_layers=tuple(range(cfg.n_layer - n + 1, cfg.n_layer + 1)),
        mask_token_id=cfg.n_vocab - 1, block_size=block_size, markov_rank=markov_rank,
        n_ctx_train=cfg.n_ctx_train, rms_eps=cfg.rms_eps, rope_freq_base=cfg.rope_freq_base,
        hc_sinkhorn_iters=cfg.hc_sinkhorn_iters, hc_eps=cfg.hc_eps,
        expert_weights_scale=cfg.expert_weights_scale,
        expert_weights_norm=cfg.expert_weights_norm, swiglu_clamp=cfg.swiglu_clamp,
        tokenizer=cfg.tokenizer)


def stage_config(c: DSparkConfig) -> V4Config:
    """The stages as `arch.block_tensors` describes V4 blocks: ratio 0 (no compressor, no
    indexer) and no hash routing (exp_probs_b), no NextN tensors."""
    return V4Config(
        n_vocab=c.n_vocab, n_embd=c.n_embd, n_layer=c.n_stages, n_head=c.n_head,
        head_dim=c.head_dim, rope_dim=c.rope_dim, q_lora=c.q_lora, o_groups=c.o_groups,
        o_lora=c.o_lora, n_expert=c.n_expert, n_expert_used=c.n_expert_used,
        n_ff_exp=c.n_ff_exp, n_expert_shared=c.n_expert_shared, n_hash_layers=0,
        sliding_window=c.sliding_window, indexer_heads=0, indexer_dim=0, indexer_top_k=0,
        compress_ratios=(0,) * c.n_stages, n_mtp=0)


def root_tensors(c: DSparkConfig) -> list[TensorSpec]:
    """The root tensors a converter writes (no token_embd / output: the target's)."""
    E, V, R = c.n_embd, c.n_vocab, c.markov_rank
    specs: list[tuple[str, tuple[int, ...]]] = [
        ("markov_w1.weight", (R, V)),
        ("markov_w2.weight", (R, V)),
    ]
    if c.confidence_head:
        specs += [("conf_proj.weight", (E + R, 1)), ("conf_proj.bias", (1,))]
    specs += [
        ("fc.weight", (c.feature_width, E)),
        ("enc.output_norm.weight", (E,)),
        ("output_norm.weight", (E,)),
        ("output_hc_fn.weight", (HC * E, HC)),
        ("output_hc_base.weight", (HC,)),
        ("output_hc_scale.weight", (1,)),
    ]
    return [TensorSpec(name, ne, "F32", None, ROOT_KINDS[name][0]) for name, ne in specs]


def dspark_tensors(c: DSparkConfig) -> list[TensorSpec]:
    """Every tensor of the draft file: roots, then each stage's 24 V4-block tensors."""
    sc = stage_config(c)
    out = root_tensors(c)
    for i in range(c.n_stages):
        out += block_tensors(sc, i)
    return out


def dspark_keys(c: DSparkConfig) -> dict[str, object]:
    """`dflash.*` metadata as the pinned upstream reads it (dflash.cpp:23-94) and the
    converter writes it (conversion/deepseek.py:1017-1034); the tokenizer keys are the
    writer's (the target's tokenizer plus ``tokenizer.ggml.mask_token_id``)."""
    p = ARCH + "."
    keys: dict[str, object] = {
        p + "context_length": c.n_ctx_train,
        p + "embedding_length": c.n_embd,
        p + "block_count": c.n_stages,
        p + "feed_forward_length": c.n_ff_exp,
        p + "expert_count": c.n_expert,
        p + "expert_used_count": c.n_expert_used,
        p + "expert_feed_forward_length": c.n_ff_exp,
        p + "expert_shared_count": c.n_expert_shared,
        p + "expert_weights_scale": c.expert_weights_scale,
        p + "expert_weights_norm": c.expert_weights_norm,
        p + "expert_gating_func": 4,  # sqrtsoftplus: anything else throws at load
        p + "swiglu_clamp_exp": c.swiglu_clamp,
        p + "attention.head_count": c.n_head,
        p + "attention.head_count_kv": 1,
        p + "attention.key_length": c.head_dim,
        p + "attention.value_length": c.head_dim,
        p + "attention.layer_norm_rms_epsilon": c.rms_eps,
        p + "attention.q_lora_rank": c.q_lora,
        p + "attention.sliding_window": c.sliding_window,
        p + "attention.output_group_count": c.o_groups,
        p + "attention.output_lora_rank": c.o_lora,
        p + "attention.compress_ratios": [0] * c.n_stages,
        p + "rope.dimension_count": c.rope_dim,
        p + "rope.freq_base": c.rope_freq_base,
        p + "hyper_connection.count": HC,
        p + "hyper_connection.sinkhorn_iterations": c.hc_sinkhorn_iters,
        p + "hyper_connection.epsilon": c.hc_eps,
        p + "target_layers": list(c.target_layers),
        p + "block_size": c.block_size,
        MASK_KEY: c.mask_token_id,
    }
    return keys
