"""Named DeepSeek-V4 configurations for `mtplib fixture --preset NAME`."""

from __future__ import annotations

from mtplib.v4.arch import V4Config

#: Default lane: every V4 layer kind in 4 trunk layers, small enough for CI on 2 cores.
#: Layer 0 is hash-routed and SWA-only, 1 SWA-only, 2 CSA (ratio 4, indexer), 3 HCA (128);
#: block 4 is the MTP block (ratio 0). Indexer key length (128) != head dim (64): equal
#: values crash MTP context creation upstream.
TINY = V4Config(
    n_vocab=256,
    n_embd=128,
    n_layer=4,
    n_head=4,
    head_dim=64,
    rope_dim=32,
    q_lora=64,
    o_groups=2,
    o_lora=32,
    n_expert=4,
    n_expert_used=2,
    n_ff_exp=64,
    n_expert_shared=1,
    n_hash_layers=1,
    sliding_window=32,
    indexer_heads=4,
    indexer_dim=128,
    indexer_top_k=64,
    compress_ratios=(0, 0, 4, 128, 0),
    n_ctx_train=4096,
)

PRESETS: dict[str, V4Config] = {"tiny": TINY}
DEFAULT_PRESET = "tiny"


def get_preset(name: str) -> V4Config:
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(
            f"unknown preset {name!r}; choose one of: {', '.join(sorted(PRESETS))}"
        ) from None
