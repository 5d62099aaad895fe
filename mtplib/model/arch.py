"""DeepSeek-V4 (`deepseek4`) names, hyper-parameters and tensor table.

The registry `gguf` package does not know `deepseek4`, so mtplib owns this table, copied
from upstream `src/llama-arch.cpp` and `src/models/deepseek4.cpp` (load_arch_tensors) at
the pinned commit. Shapes are ggml `ne` order (fastest axis first); numpy/GGUF-reader
shapes are the reverse. Pure Python: no llama.cpp import.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from mtplib.errors import InputError

ARCH = "deepseek4"
HC = 4  # hyper-connection streams; upstream asserts hc == 4
HC_MIX = (2 + HC) * HC  # 24 mixing coefficients per token (pre 4, post 4, comb 16)
EXPERT_GATING_SQRTSOFTPLUS = 4
ROOT_TENSORS = ("token_embd", "output_norm", "output")
ROOT_HC_HEAD = ("output_hc_fn", "output_hc_base", "output_hc_scale")


class ConfigError(InputError):
    """A V4 configuration upstream would reject or crash on."""


@dataclass(frozen=True)
class V4Config:
    """Hyper-parameters of a `deepseek4` model (trunk + MTP blocks)."""

    n_vocab: int
    n_embd: int
    n_layer: int  # trunk blocks; MTP blocks come after them
    n_head: int
    head_dim: int  # attention.key_length = value_length (one KV head)
    rope_dim: int
    q_lora: int
    o_groups: int
    o_lora: int
    n_expert: int
    n_expert_used: int
    n_ff_exp: int
    n_expert_shared: int
    n_hash_layers: int
    sliding_window: int
    indexer_heads: int
    indexer_dim: int
    indexer_top_k: int
    compress_ratios: tuple[int, ...]  # n_layer + n_mtp entries
    n_mtp: int = 1
    n_ctx_train: int = 4096
    rms_eps: float = 1e-6
    rope_freq_base: float = 10000.0
    compress_rope_freq_base: float = 160000.0
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    expert_weights_scale: float = 1.5
    expert_weights_norm: bool = True
    swiglu_clamp: float = 10.0
    tokenizer: str = "test"
    extra: dict = field(default_factory=dict, compare=False, hash=False)

    @property
    def hidden_width(self) -> int:
        """Width of one hidden row (`h_nextn`, boundary values): hc * n_embd."""
        return HC * self.n_embd

    @property
    def n_blocks(self) -> int:
        return self.n_layer + self.n_mtp

    def validate(self) -> V4Config:
        """Refuse configurations upstream rejects or crashes on (reference §3)."""
        errs = []
        if len(self.compress_ratios) < self.n_blocks:
            errs.append(f"compress_ratios has {len(self.compress_ratios)} entries, "
                        f"needs {self.n_blocks} (trunk + MTP blocks)")
        if any(r not in (0, 4, 128) for r in self.compress_ratios):
            errs.append(f"compress ratios must be 0, 4 or 128: {self.compress_ratios}")
        if 4 not in self.compress_ratios[: self.n_blocks]:
            errs.append("no ratio-4 layer: upstream dies with SIGFPE at context creation")
        for i in range(self.n_layer, self.n_blocks):
            if self.compress_ratios[i] != 0:
                errs.append(f"MTP block {i} must have compress ratio 0")
        if self.n_hash_layers > self.n_layer:
            errs.append("hash_layer_count exceeds the trunk layer count")
        if self.n_head % self.o_groups:
            errs.append(f"n_head {self.n_head} not divisible by o_groups {self.o_groups}")
        if self.rope_dim > self.head_dim or self.rope_dim > self.indexer_dim:
            errs.append("rope dims must be <= head dim and <= indexer key length")
        if self.indexer_dim % 64:
            errs.append(f"indexer key length {self.indexer_dim} is not a multiple of 64")
        if self.indexer_dim == self.head_dim and self.n_mtp:
            errs.append("indexer key length == head dim crashes MTP context creation (SIGFPE)")
        if self.n_expert_used > self.n_expert:
            errs.append("expert_used_count exceeds expert_count")
        if errs:
            raise ConfigError("invalid DeepSeek-V4 config: " + "; ".join(errs))
        return self

    def to_dict(self) -> dict:
        d = asdict(self)
        d.pop("extra")
        d["compress_ratios"] = list(self.compress_ratios)
        d["hidden_width"] = self.hidden_width
        return d


@dataclass(frozen=True)
class TensorSpec:
    """One tensor upstream creates: name, ggml ne shape, and the block it belongs to."""

    name: str
    ne: tuple[int, ...]
    dtype: str  # "F32" unless a preset says otherwise; I32 for tid2eid
    block: int | None  # None for root tensors
    kind: str  # short role inside a block (e.g. "attn_q_a"), or the root name

    @property
    def n_elements(self) -> int:
        n = 1
        for d in self.ne:
            n *= d
        return n

    @property
    def nbytes(self) -> int:
        """Bytes of the data as a GGUF stores it (block-quantized types included)."""
        return ggml_nbytes(self.dtype, self.ne)


#: ggml types a V4 GGUF uses: (elements per block, bytes per block), from ggml.c type_traits.
GGML_TYPE_SIZES: dict[str, tuple[int, int]] = {
    "F32": (1, 4), "F16": (1, 2), "BF16": (1, 2), "I32": (1, 4), "I64": (1, 8),
    "Q8_0": (32, 34), "MXFP4": (32, 17),
}


def ggml_nbytes(dtype: str, ne: tuple[int, ...]) -> int:
    """Bytes of a contiguous ggml tensor of ``dtype`` and shape ``ne`` (rows of ne[0])."""
    try:
        block, size = GGML_TYPE_SIZES[dtype]
    except KeyError:
        raise InputError(f"unknown ggml type {dtype!r}; known: {sorted(GGML_TYPE_SIZES)}") from None
    if ne and ne[0] % block:
        raise InputError(f"{dtype} needs ne[0] % {block} == 0, got ne={ne}")
    n = 1
    for d in ne:
        n *= d
    return n // block * size


#: dtype policy "converter": the types upstream's converter (conversion/deepseek.py,
#: DeepseekV4Model at the pinned commit) writes for the published DeepSeek-V4 checkpoint:
#: routed experts are repacked to MXFP4; FP8 weights (the ones that ship a `.scale`
#: sibling: wq_a, wq_b, wkv, wo_a, wo_b, indexer.wq_b, shared experts, MTP e/h_proj ->
#: eh_proj) are dequantized and forced to Q8_0; BF16 matrices stay BF16; F32 tensors stay
#: F32; every 1-D tensor and every *_norm is F32 (base.py); tid2eid is written as I32.
#: The source dtypes (which tensors are FP8 / BF16 / F32 in the checkpoint) are taken from
#: the published checkpoint layout, not read from it: see evidence/DGR-065/README.md.
CONVERTER_DTYPES: dict[str, str] = {
    "token_embd": "BF16", "output": "BF16",
    "attn_q_a": "Q8_0", "attn_q_b": "Q8_0", "attn_kv": "Q8_0",
    "attn_output_a": "Q8_0", "attn_output_b": "Q8_0", "indexer.attn_q_b": "Q8_0",
    "ffn_gate_shexp": "Q8_0", "ffn_up_shexp": "Q8_0", "ffn_down_shexp": "Q8_0",
    "nextn.eh_proj": "Q8_0",
    "attn_compressor_kv": "BF16", "attn_compressor_gate": "BF16",
    "indexer_compressor_kv": "BF16", "indexer_compressor_gate": "BF16",
    "indexer.proj": "BF16", "ffn_gate_inp": "BF16",
    "ffn_gate_exps": "MXFP4", "ffn_up_exps": "MXFP4", "ffn_down_exps": "MXFP4",
    "ffn_gate_tid2eid": "I32",
}
DTYPE_POLICIES = ("f32", "converter")


def tensor_dtype(cfg: V4Config, kind: str, default: str = "F32") -> str:
    """The dtype a tensor of ``kind`` gets under the config's dtype policy.

    Policy "f32" (default; `cfg.extra` has no "dtype_policy"): ``default`` (F32, I32 for
    tid2eid), the tiny fixtures' layout. Policy "converter": CONVERTER_DTYPES, else F32.
    """
    policy = cfg.extra.get("dtype_policy", "f32")
    if policy not in DTYPE_POLICIES:
        raise ConfigError(f"unknown dtype_policy {policy!r}; known: {DTYPE_POLICIES}")
    if policy == "f32":
        return default
    return CONVERTER_DTYPES.get(kind, "F32")


def block_tensors(cfg: V4Config, i: int) -> list[TensorSpec]:
    """Tensors of block ``i`` in upstream's creation order (deepseek4.cpp load_arch_tensors)."""
    E, H, D, Q = cfg.n_embd, cfg.n_head, cfg.head_dim, cfg.q_lora
    G, Ro, F = cfg.o_groups, cfg.o_lora, cfg.n_ff_exp
    hc_dim = HC * E
    out: list[TensorSpec] = []

    def add(kind: str, ne: tuple[int, ...], suffix: str = "weight", dtype: str = "F32") -> None:
        dtype = tensor_dtype(cfg, kind, dtype)
        out.append(TensorSpec(f"blk.{i}.{kind}.{suffix}", ne, dtype, i, kind))

    add("attn_norm", (E,))
    add("attn_sinks", (H,))
    add("attn_q_a", (E, Q))
    add("attn_q_a_norm", (Q,))
    add("attn_q_b", (Q, H * D))
    add("attn_kv", (E, D))
    add("attn_kv_a_norm", (D,))
    add("attn_output_a", (H * D // G, Ro * G))  # file shape; upstream reshapes to 3-D
    add("attn_output_b", (G * Ro, E))
    for part in ("attn", "ffn"):
        add(f"hc_{part}_fn", (hc_dim, HC_MIX))
        add(f"hc_{part}_base", (HC_MIX,))
        add(f"hc_{part}_scale", (3,))
    ratio = cfg.compress_ratios[i]
    if ratio:
        c = 2 if ratio == 4 else 1
        add("attn_compressor_kv", (E, c * D))
        add("attn_compressor_gate", (E, c * D))
        add("attn_compressor_ape", (c * D, ratio))
        add("attn_compressor_norm", (D,))
        if ratio == 4:
            Di = cfg.indexer_dim
            add("indexer.proj", (E, cfg.indexer_heads))
            add("indexer.attn_q_b", (Q, cfg.indexer_heads * Di))
            add("indexer_compressor_kv", (E, 2 * Di))
            add("indexer_compressor_gate", (E, 2 * Di))
            add("indexer_compressor_ape", (2 * Di, 4))
            add("indexer_compressor_norm", (Di,))
    add("ffn_gate_inp", (E, cfg.n_expert))
    if i < cfg.n_hash_layers:
        add("ffn_gate_tid2eid", (cfg.n_expert_used, cfg.n_vocab), dtype="I32")
    else:
        add("exp_probs_b", (cfg.n_expert,), suffix="bias")
    add("ffn_norm", (E,))
    add("ffn_gate_exps", (E, F, cfg.n_expert))
    add("ffn_down_exps", (F, E, cfg.n_expert))
    add("ffn_up_exps", (E, F, cfg.n_expert))
    Fs = F * cfg.n_expert_shared
    add("ffn_gate_shexp", (E, Fs))
    add("ffn_down_shexp", (Fs, E))
    add("ffn_up_shexp", (E, Fs))
    if i >= cfg.n_layer:
        add("nextn.eh_proj", (2 * E, E))
        add("nextn.enorm", (E,))
        add("nextn.hnorm", (E,))
        add("nextn.shared_head_norm", (E,))  # upstream's converter writes it
    return out


def root_tensors(cfg: V4Config) -> list[TensorSpec]:
    E, V = cfg.n_embd, cfg.n_vocab
    specs = [
        ("token_embd", (E, V)),
        ("output_norm", (E,)),
        ("output", (E, V)),
        ("output_hc_fn", (HC * E, HC)),
        ("output_hc_base", (HC,)),
        ("output_hc_scale", (1,)),
    ]
    return [TensorSpec(f"{kind}.weight", ne, tensor_dtype(cfg, kind), None, kind)
            for kind, ne in specs]


def trunk_tensors(cfg: V4Config) -> list[TensorSpec]:
    """The trunk file: root tensors and blocks 0..n_layer-1 (no nextn keys)."""
    out = root_tensors(cfg)
    for i in range(cfg.n_layer):
        out += block_tensors(cfg, i)
    return out


def sidecar_tensors(cfg: V4Config) -> list[TensorSpec]:
    """The `mtp-` sidecar: root tensors (its output_hc_* is the MTP head) + MTP blocks."""
    out = root_tensors(cfg)
    for i in range(cfg.n_layer, cfg.n_blocks):
        out += block_tensors(cfg, i)
    return out


def gguf_keys(cfg: V4Config, *, sidecar: bool) -> dict[str, object]:
    """`deepseek4.*` metadata; the sidecar counts the MTP blocks and sets nextn keys."""
    n_blocks = cfg.n_blocks if sidecar else cfg.n_layer
    ratios = list(cfg.compress_ratios[:n_blocks])
    p = ARCH + "."
    keys: dict[str, object] = {
        p + "context_length": cfg.n_ctx_train,
        p + "embedding_length": cfg.n_embd,
        p + "block_count": n_blocks,
        p + "feed_forward_length": cfg.n_ff_exp,
        p + "expert_count": cfg.n_expert,
        p + "expert_used_count": cfg.n_expert_used,
        p + "expert_feed_forward_length": cfg.n_ff_exp,
        p + "expert_shared_count": cfg.n_expert_shared,
        p + "expert_weights_scale": cfg.expert_weights_scale,
        p + "expert_weights_norm": cfg.expert_weights_norm,
        p + "expert_gating_func": EXPERT_GATING_SQRTSOFTPLUS,
        p + "swiglu_clamp_exp": cfg.swiglu_clamp,
        p + "attention.head_count": cfg.n_head,
        p + "attention.head_count_kv": 1,
        p + "attention.key_length": cfg.head_dim,
        p + "attention.value_length": cfg.head_dim,
        p + "attention.layer_norm_rms_epsilon": cfg.rms_eps,
        p + "attention.q_lora_rank": cfg.q_lora,
        p + "attention.sliding_window": cfg.sliding_window,
        p + "attention.output_group_count": cfg.o_groups,
        p + "attention.output_lora_rank": cfg.o_lora,
        p + "attention.compress_rope_freq_base": cfg.compress_rope_freq_base,
        p + "attention.compress_ratios": ratios,
        p + "attention.indexer.head_count": cfg.indexer_heads,
        p + "attention.indexer.key_length": cfg.indexer_dim,
        p + "attention.indexer.top_k": cfg.indexer_top_k,
        p + "rope.dimension_count": cfg.rope_dim,
        p + "rope.freq_base": cfg.rope_freq_base,
        p + "hyper_connection.count": HC,
        p + "hyper_connection.sinkhorn_iterations": cfg.hc_sinkhorn_iters,
        p + "hyper_connection.epsilon": cfg.hc_eps,
        p + "hash_layer_count": cfg.n_hash_layers,
    }
    if sidecar:
        keys[p + "nextn_predict_layers"] = cfg.n_mtp
    keys.update(cfg.extra.get("gguf_keys", {}))  # e.g. rope scaling of a published config
    return keys


def config_from_keys(kv: dict[str, object], n_vocab: int) -> V4Config:
    """Rebuild a V4Config from a GGUF's `deepseek4.*` keys (trunk or sidecar)."""
    p = ARCH + "."

    def g(k: str, default: object = None) -> object:
        return kv.get(p + k, default)

    n_blocks = int(g("block_count"))
    n_mtp = int(g("nextn_predict_layers", 0))
    return V4Config(
        n_vocab=n_vocab,
        n_embd=int(g("embedding_length")),
        n_layer=n_blocks - n_mtp,
        n_head=int(g("attention.head_count")),
        head_dim=int(g("attention.key_length")),
        rope_dim=int(g("rope.dimension_count")),
        q_lora=int(g("attention.q_lora_rank")),
        o_groups=int(g("attention.output_group_count")),
        o_lora=int(g("attention.output_lora_rank")),
        n_expert=int(g("expert_count")),
        n_expert_used=int(g("expert_used_count")),
        n_ff_exp=int(g("expert_feed_forward_length")),
        n_expert_shared=int(g("expert_shared_count")),
        n_hash_layers=int(g("hash_layer_count", 0)),
        sliding_window=int(g("attention.sliding_window")),
        indexer_heads=int(g("attention.indexer.head_count")),
        indexer_dim=int(g("attention.indexer.key_length")),
        indexer_top_k=int(g("attention.indexer.top_k")),
        compress_ratios=tuple(int(r) for r in g("attention.compress_ratios")),
        n_mtp=n_mtp,
        n_ctx_train=int(g("context_length")),
        rms_eps=float(g("attention.layer_norm_rms_epsilon")),
        rope_freq_base=float(g("rope.freq_base", 10000.0)),
        compress_rope_freq_base=float(g("attention.compress_rope_freq_base")),
        hc_sinkhorn_iters=int(g("hyper_connection.sinkhorn_iterations")),
        hc_eps=float(g("hyper_connection.epsilon")),
        expert_weights_scale=float(g("expert_weights_scale", 1.0)),
        expert_weights_norm=bool(g("expert_weights_norm", False)),
        swiglu_clamp=float(g("swiglu_clamp_exp", 0.0)),
    )
