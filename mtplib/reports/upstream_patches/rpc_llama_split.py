"""A generic RPC split (not DeepSeek-V4): a tiny random-weight `llama` GGUF, its layers over
two or three local RPC shards, each behind a counting relay; a prompt decode and greedy
single-token decodes. Prints one JSON line: the build, the tokens, a sha256 of every
decode's logits (bytes), and the waits (round trips) per single-token decode on each shard.

    MTPLIB_UPSTREAM=stock   python -m mtplib.reports.upstream_patches.rpc_llama_split
    MTPLIB_UPSTREAM=patched python -m mtplib.reports.upstream_patches.rpc_llama_split

patches/0002 must leave the bytes unchanged: the same tokens and logits hashes on both
builds (tests/test_patches.py). A llama layer hands one tensor (the residual) to the next
layer, so the waits per seam are the same on both builds here; the V4 graph hands two
(evidence/upstream-patches/README.md).
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import tempfile
from pathlib import Path

import numpy as np

from mtplib.reports import common

MODULE = "mtplib.reports.upstream_patches.rpc_llama_split"
N_EMBD, N_HEAD, N_HEAD_KV, N_FF, N_VOCAB, N_CTX = 64, 4, 2, 128, 256, 128


def write_llama(path: Path, n_layer: int, seed: int = 0) -> None:
    """A tiny llama-architecture GGUF with random F32 weights and no tokenizer ("none")."""
    import gguf

    rng = np.random.default_rng(seed)
    head = N_EMBD // N_HEAD
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(n_layer)
    w.add_context_length(N_CTX)
    w.add_embedding_length(N_EMBD)
    w.add_feed_forward_length(N_FF)
    w.add_head_count(N_HEAD)
    w.add_head_count_kv(N_HEAD_KV)
    w.add_rope_dimension_count(head)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(N_VOCAB)
    w.add_tokenizer_model("none")

    def t(name: str, *shape: int, scale: float = 0.2) -> None:
        w.add_tensor(name, (rng.standard_normal(shape) * scale).astype(np.float32))

    t("token_embd.weight", N_VOCAB, N_EMBD, scale=1.0)
    for i in range(n_layer):
        p = f"blk.{i}."
        w.add_tensor(p + "attn_norm.weight", np.ones(N_EMBD, np.float32))
        t(p + "attn_q.weight", N_EMBD, N_EMBD)
        t(p + "attn_k.weight", N_HEAD_KV * head, N_EMBD)
        t(p + "attn_v.weight", N_HEAD_KV * head, N_EMBD)
        t(p + "attn_output.weight", N_EMBD, N_EMBD)
        w.add_tensor(p + "ffn_norm.weight", np.ones(N_EMBD, np.float32))
        t(p + "ffn_gate.weight", N_FF, N_EMBD)
        t(p + "ffn_up.weight", N_FF, N_EMBD)
        t(p + "ffn_down.weight", N_EMBD, N_FF)
    w.add_tensor("output_norm.weight", np.ones(N_EMBD, np.float32))
    t("output.weight", N_VOCAB, N_EMBD)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def run(n_shards: int, n_layer: int, n_new: int) -> dict:
    from mtplib.distributed.processes import LocalShards
    from mtplib.distributed.relay import CountingRelay, RelaySet, WanLink
    from mtplib.runtime.lib import load, upstream_info
    from mtplib.runtime.rpc import add_server

    llama, _ = load()
    with tempfile.TemporaryDirectory(prefix="rpc-llama-") as tmp, LocalShards(n_shards) as shards:
        path = Path(tmp) / "llama-tiny.gguf"
        write_llama(path, n_layer)
        # a short emulated WAN: requests sent back to back are then seen as one round trip
        relays = [CountingRelay(ep, link=WanLink(10)) for ep in shards.endpoints]
        rs = RelaySet(relays)
        try:
            devs = [add_server(r.endpoint)[0] for r in relays]
            mp = llama.llama_model_default_params()
            arr = (ctypes.c_void_p * (n_shards + 1))(*devs, None)
            mp.devices = ctypes.cast(arr, ctypes.c_void_p)
            mp.n_gpu_layers = 0x7FFFFFFF
            mp.split_mode = 1  # LLAMA_SPLIT_MODE_LAYER
            per = n_layer / n_shards
            ts = (ctypes.c_float * llama.LLAMA_MAX_DEVICES)(*([per] * n_shards))
            mp.tensor_split = ts
            model = llama.llama_model_load_from_file(str(path).encode(), mp)
            assert model, "upstream failed to load the tiny llama model"
            cp = llama.llama_context_default_params()
            cp.n_ctx, cp.n_batch, cp.n_ubatch = N_CTX, 32, 32
            cp.n_threads = cp.n_threads_batch = 1
            ctx = llama.llama_init_from_model(model, cp)
            assert ctx, "upstream failed to create a context"

            def decode(tokens: list[int]) -> list[float]:
                arr_t = (llama.llama_token * len(tokens))(*tokens)
                assert llama.llama_decode(ctx, llama.llama_batch_get_one(arr_t, len(tokens))) == 0
                p = llama.llama_get_logits_ith(ctx, -1)
                return np.ctypeslib.as_array(p, shape=(N_VOCAB,)).copy()

            logits = decode([1, 17, 33, 99, 5, 250, 42, 7])
            hashes = [hashlib.sha256(logits.tobytes()).hexdigest()[:16]]
            tokens, waits = [], []
            for step in range(n_new):
                tok = int(np.argmax(logits))
                tokens.append(tok)
                with rs.step(f"decode{step}"):
                    logits = decode([tok])
                hashes.append(hashlib.sha256(logits.tobytes()).hexdigest()[:16])
                by = rs.by_label()[f"decode{step}"]
                waits.append(by["waits_per_shard"])
            llama.llama_free(ctx)
            llama.llama_model_free(model)
        finally:
            for r in relays:
                r.close()
    info = upstream_info()
    return {"build": info["build"], "patches": info.get("patches"), "n_shards": n_shards,
            "n_layer": n_layer, "tokens": tokens, "logits_sha256": hashes,
            "waits_per_decode_per_shard": waits}


def main(argv: list[str] | None = None) -> int:
    ap = common.parser(MODULE, __doc__)
    ap.add_argument("--shards", type=int, default=2)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--new", type=int, default=6)
    a = ap.parse_args(argv)
    print(json.dumps(run(a.shards, a.layers, a.new)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
