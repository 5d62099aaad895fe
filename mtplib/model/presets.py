"""Named DeepSeek-V4 configurations for `mtplib fixture --preset NAME`."""

from __future__ import annotations

from dataclasses import replace

from mtplib.errors import InputError
from mtplib.model.arch import V4Config

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

#: DeepSeek-V4-Flash (published config.json of deepseek-ai/DeepSeek-V4-Flash-Base, reference
#: §2): 43 trunk layers + 1 MTP block. compress_ratios as published (44 entries): layers 0-1
#: SWA only (0), then CSA (4) and HCA (128) alternating from layer 2 (so every even layer
#: >= 2 is CSA, every odd layer >= 3 HCA, layer 42 CSA), and 0 for the MTP block 43.
#: Weight-less: `mtplib fixture --preset v4-flash` writes the real tensor table with the
#: dtypes upstream's converter writes (arch.CONVERTER_DTYPES) and leaves the data region a
#: sparse hole; for inventory and ownership derivation only, never for decoding.
V4_FLASH_RATIOS = (0, 0) + (4, 128) * 20 + (4,) + (0,)
V4_FLASH = V4Config(
    n_vocab=129280,
    n_embd=4096,
    n_layer=43,
    n_head=64,
    head_dim=512,
    rope_dim=64,
    q_lora=1024,
    o_groups=8,
    o_lora=1024,
    n_expert=256,
    n_expert_used=6,
    n_ff_exp=2048,
    n_expert_shared=1,
    n_hash_layers=3,
    sliding_window=128,
    indexer_heads=64,
    indexer_dim=128,
    indexer_top_k=512,
    compress_ratios=V4_FLASH_RATIOS,
    n_mtp=1,
    n_ctx_train=1048576,
    rms_eps=1e-6,
    rope_freq_base=10000.0,
    compress_rope_freq_base=160000.0,
    hc_sinkhorn_iters=20,
    hc_eps=1e-6,
    expert_weights_scale=1.5,
    expert_weights_norm=True,
    swiglu_clamp=10.0,
    extra={
        "dtype_policy": "converter",
        "weightless": True,
        "gguf_keys": {
            "deepseek4.rope.scaling.type": "yarn",
            "deepseek4.rope.scaling.factor": 16.0,
            "deepseek4.rope.scaling.original_context_length": 65536,
        },
    },
)

#: Cost-faithful CPU fixture (issue 7): V4-Flash's layer structure with thin layers, so
#: that one MTP step costs about 1/43 of one trunk step, as in the real model (where the
#: MTP block is about 1/43 of the active compute); on the `tiny` fixture it is 0.20 (1/4.9,
#: measured the same way at 2 threads), so no speed curve measured there transfers.
#: 43 trunk layers with V4-Flash's pattern (V4_FLASH_RATIOS: layers 0-1 SWA only, then CSA
#: (4) and HCA (128) alternating, layer 42 CSA; the first 3 hash-routed) + 1 MTP block
#: (ratio 0); tiny widths (the `tiny` preset's), the real sliding window (128) and indexer
#: top-k (512); vocab 512 so the output head stays small next to a block. Indexer key
#: length 128 != head dim 64 (equal crashes upstream). F32 weights: trunk 47.8 MB,
#: sidecar 1.5 MB, written in 0.5 s.
#: Measured cost ratio (MTP decode / trunk decode, one token, medians of 300 interleaved
#: one-token decodes, time of the llama_decode call only; `mtplib compare-upstream
#: --cost-ratio-only`): 0.0232 = 1/43.2 at 2 threads (trunk 14.5 ms = 69 tok/s, MTP step
#: 0.34 ms), 0.0213 = 1/46.9 at 1 thread; load average 1.7 (V4_RATIO_CPU_MEASURED,
#: evidence/side-by-side/README.md).
V4_RATIO_CPU = replace(
    TINY,  # the widths; what differs from `tiny` is spelled out:
    n_vocab=512,
    n_layer=43,
    n_hash_layers=3,
    sliding_window=128,
    indexer_top_k=512,
    compress_ratios=V4_FLASH_RATIOS,
    n_mtp=1,
)
#: What `cost_ratio` measured on `v4-ratio-cpu` (seed 0), with the command and the load
#: (raw numbers: evidence/side-by-side/cost-ratio-v4-ratio-cpu-t{2,1}.json).
V4_RATIO_CPU_MEASURED: dict = {
    "ratio_mtp_over_trunk": 0.0232,  # threads 2: 1/43.2 (V4-Flash: about 1/43)
    "trunk_decode_ms_median": 14.53,
    "mtp_decode_ms_median": 0.337,
    "threads": 2,
    "ratio_mtp_over_trunk_threads_1": 0.0213,  # 1/46.9
    "loadavg": [1.71, 2.38, 2.25],
    "command": "mtplib fixture --out FX --preset v4-ratio-cpu; mtplib compare-upstream "
               "--cost-ratio-only --model FX/v4-v4-ratio-cpu-s0.gguf --mtp "
               "FX/mtp-v4-v4-ratio-cpu-s0.gguf --threads 2 --cost-tokens 300",
}

#: V4-Flash-width slice (issue 24): V4-Flash's real widths, layer kinds and weight dtypes in
#: a few layers, for measuring what one layer, one extra verified token and one MTP draft
#: cost (`mtplib.lab.layer_cost`). What is V4-Flash's: hidden 4096, 64 query heads x 512,
#: rope 64, q_lora 1024, o_lora 1024 x 8 groups, sliding window 128, the compressed
#: attention (CSA ratio 4 with the 64 x 128 lightning indexer, top-k 512; HCA ratio 128),
#: hyper-connections (4 streams, Sinkhorn 20), 6 active routed experts of FFN 2048 + 1
#: shared expert, the 129,280-token vocabulary (so the output head a draft reads is the
#: real one), and the converter's dtypes (arch.CONVERTER_DTYPES: routed experts MXFP4, FP8
#: sources Q8_0, BF16 matrices BF16, norms/1-D F32), random weights.
#: What differs, and why: 6 trunk layers instead of 43 (V4-Flash's first six: 0-1 SWA only,
#: 2 CSA, 3 HCA, 4 CSA, 5 HCA; the first 3 hash-routed, as in the real model) + the MTP
#: block (ratio 0); 16 routed experts in total instead of 256 (a 256-expert layer is 3.4 GB
#: of MXFP4; 16 keep the file about 4 GB). One token still runs exactly 6 routed experts
#: + the shared one, so a one-token decode does the real per-token work; a verify batch of
#: n tokens can touch at most 16 distinct experts (expected 6, 9.8, 12.1, 13.6 for n = 1..4
#: under uniform routing) where the real model touches about 6n (6, 11.9, 17.6, 23.2), so
#: the routed-expert part of a verify's extra tokens is UNDER-counted: the measured verify
#: cost per extra token is a lower bound (`layer_cost.distinct_experts` gives both).
V4_FLASH_SLICE_RATIOS = (0, 0, 4, 128, 4, 128, 0)
V4_FLASH_SLICE = replace(
    V4_FLASH,
    n_layer=6,
    n_expert=16,
    compress_ratios=V4_FLASH_SLICE_RATIOS,
    extra={"dtype_policy": "converter",
           "gguf_keys": V4_FLASH.extra["gguf_keys"]},
)
#: The slice's first four trunk layers alone (V4-Flash's layers 0-3: the same tensors,
#: the same bytes for the same seed): the partner `layer_cost` subtracts from the slice,
#: so that (slice - slice-l4) / 2 is one CSA + one HCA layer with no head or embedding in
#: it, the kinds 41 of V4-Flash's 43 layers are.
V4_FLASH_SLICE_L4 = replace(V4_FLASH_SLICE, n_layer=4,
                            compress_ratios=V4_FLASH_SLICE_RATIOS[:4] + (0,))

#: The `tiny` preset's widths with V4-Flash's first six layer kinds (0-1 SWA, 2 CSA, 3 HCA,
#: 4 CSA, 5 HCA, the first 3 hash-routed): `v4-flash-slice`'s structure in 7 MB, for counting
#: the graph and control bytes a shard pass sends per layer kind
#: (`python -m mtplib.reports.graph_reuse.bytes_table --tiny-slice`).
TINY_SLICE = replace(TINY, n_layer=6, n_hash_layers=3, compress_ratios=V4_FLASH_SLICE_RATIOS)

PRESETS: dict[str, V4Config] = {"tiny": TINY, "v4-flash": V4_FLASH,
                                "v4-ratio-cpu": V4_RATIO_CPU,
                                "v4-flash-slice": V4_FLASH_SLICE,
                                "v4-flash-slice-l4": V4_FLASH_SLICE_L4,
                                "tiny-slice": TINY_SLICE}
DEFAULT_PRESET = "tiny"


def get_preset(name: str) -> V4Config:
    try:
        return PRESETS[name]
    except KeyError:
        raise InputError(
            f"unknown preset {name!r}; choose one of: {', '.join(sorted(PRESETS))}"
        ) from None
