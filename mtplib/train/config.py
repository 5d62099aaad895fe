"""The trained tiny DeepSeek-V4's configuration and training hyper-parameters (no torch).

Layer pattern: 0 hash-routed SWA-only, 1 CSA (ratio 4, lightning indexer), 2 HCA (ratio
128), 3 SWA-only, then the MTP block (ratio 0). The indexer top-k (512) is at least the
number of compressed rows visible anywhere in the context (2048 / 4), so the indexer
selects every visible row: training stays differentiable and the result cannot depend on
tie order. Indexer key length (128) != head dim (64): equal values crash MTP context
creation upstream.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from mtplib.model.arch import V4Config

TRAINED = V4Config(
    n_vocab=2048,
    n_embd=128,
    n_layer=4,
    n_head=4,
    head_dim=64,
    rope_dim=32,
    q_lora=64,
    o_groups=2,
    o_lora=64,
    n_expert=4,
    n_expert_used=2,
    n_ff_exp=128,
    n_expert_shared=1,
    n_hash_layers=1,
    sliding_window=64,
    indexer_heads=2,
    indexer_dim=128,
    indexer_top_k=512,
    compress_ratios=(0, 4, 128, 0, 0),
    n_ctx_train=2048,
    tokenizer="gpt2",
)


@dataclass(frozen=True)
class TrainConfig:
    vocab_size: int = TRAINED.n_vocab
    seq_len: int = 256  # trunk positions per training window (the MTP sees 1..seq_len-1)
    batch_size: int = 8
    steps: int = 500
    lr: float = 3e-3
    min_lr_frac: float = 0.1
    warmup: int = 50
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    mtp_weight: float = 0.3  # lambda of DeepSeek-V3's MTP loss (0.3 early in training)
    bias_update: float = 1e-3  # gamma of the auxiliary-loss-free expert bias update
    eval_every: int = 50
    ckpt_every: int = 50
    eval_batches: int = 4

    def to_dict(self) -> dict:
        return asdict(self)
