"""The trained tiny DSpark's configuration and training hyper-parameters (no torch).

A V4 DSpark draft (GGUF arch `dflash` + `markov_w1`) for the committed trained trunk
(evidence/trained-v4/): three full V4 stages (ratio-0 attention, no hash routing), the
trunk's width (128), vocabulary and tokenizer; the trunk's `token_embd` / `output` are
shared, not copied (upstream reads them from the target through `ctx_other`).

Target layers. V4-Flash (43 layers, 0..42) conditions its DSpark on the outputs of its last
three layers, `dspark_target_layer_ids` [40, 41, 42], which the converter writes as GGUF
`target_layers` [41, 42, 43] (layer id + 1: upstream's feature `il` is the hc-mean of the
residual *entering* layer `il`, and `il == n_layer` is the last layer's output). The
trunk here has 4 layers (0..3), so the same rule gives the outputs of layers 1, 2, 3 =
`target_layers` [2, 3, 4]: the deepest features, which carry the most about the next
tokens, as upstream's choice for the full model does.

The config type is mtplib.model.dspark.spec's (the keys and tensor table the export writes).

Noise token. The byte-level BPE's initial alphabet holds all 256 bytes, but bytes 0xF5-0xFF
never occur in UTF-8 text, so their tokens never appear in any tokenized text. The noise
(mask) token is the byte 0xFF's token; `mask_token_id` finds its id in a tokenizer and
the trainer checks that it occurs in neither token stream.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from mtplib.model.dspark.spec import DSparkConfig
from mtplib.train.config import TRAINED

#: The byte whose token is the noise token (never part of valid UTF-8).
MASK_BYTE = 0xFF


def trained_dspark(mask_token_id: int) -> DSparkConfig:
    """The draft for the trained trunk: its width, heads, experts and vocabulary; 3
    stages, block 5, Markov rank 32, a 128-token draft window (V4-Flash's n_swa)."""
    t = TRAINED
    return DSparkConfig(
        n_vocab=t.n_vocab, n_embd=t.n_embd, n_stages=3, n_head=t.n_head,
        head_dim=t.head_dim, rope_dim=t.rope_dim, q_lora=t.q_lora, o_groups=t.o_groups,
        o_lora=t.o_lora, n_expert=t.n_expert, n_expert_used=t.n_expert_used,
        n_ff_exp=t.n_ff_exp, n_expert_shared=t.n_expert_shared, sliding_window=128,
        block_size=5, markov_rank=32, target_layers=(2, 3, 4),
        mask_token_id=mask_token_id, n_ctx_train=t.n_ctx_train, rms_eps=t.rms_eps,
        rope_freq_base=t.rope_freq_base, hc_sinkhorn_iters=t.hc_sinkhorn_iters,
        hc_eps=t.hc_eps, expert_weights_scale=t.expert_weights_scale,
        expert_weights_norm=t.expert_weights_norm, swiglu_clamp=t.swiglu_clamp,
        tokenizer=t.tokenizer)


@dataclass(frozen=True)
class DSparkTrainConfig:
    prompts_train: int = 1536  # training-split prompts continued greedily by the trunk
    prompts_heldout: int = 64  # held-out prompts (the first 32 are trained_eval's)
    prompt_len: int = 64
    n_new: int = 128
    batch_size: int = 8  # sequences per step; every anchor of each is a block
    steps: int = 450
    lr: float = 2e-3
    min_lr_frac: float = 0.1
    warmup: int = 40
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    slot_decay: float = 0.85  # CE weight of slot i: slot_decay**i (earlier slots matter more)
    conf_weight: float = 0.1  # weight of the confidence head's BCE
    bias_update: float = 1e-3
    eval_every: int = 50
    ckpt_every: int = 25

    def to_dict(self) -> dict:
        return asdict(self)
