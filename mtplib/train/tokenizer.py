"""Byte-level BPE trained on the training split, in a form upstream's `gpt2` vocab loads.

HF `tokenizers` with the GPT-2 byte-level pre-tokenizer (regex
``'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+``, no prefix
space) and merges applied by rank. Upstream (src/llama-vocab.cpp) loads the same thing from
tokenizer.ggml.model = "gpt2", tokenizer.ggml.pre = "gpt-2" (LLAMA_VOCAB_PRE_TYPE_GPT2, whose
custom splitter implements that regex), tokens (byte-to-unicode strings), token_type and
merges ("a b" strings, rank = order). Id 0 is the end-of-text token (CONTROL), used as
BOS/EOS; no BOS is added when tokenizing.
"""

from __future__ import annotations

import json
from pathlib import Path

EOT = "<|endoftext|>"
TOKEN_TYPE_NORMAL = 1
TOKEN_TYPE_CONTROL = 3


def train_bpe(texts: list[str], vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, special_tokens=[EOT],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    if tok.token_to_id(EOT) != 0:
        raise RuntimeError("end-of-text token must have id 0")
    return tok


def load(path: str | Path):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(path))


def encode(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False).ids


def gguf_vocab(tok) -> dict:
    """tokens / token_type / merges as upstream's BPE loader reads them."""
    spec = json.loads(tok.to_str())
    vocab = spec["model"]["vocab"]
    tokens = [None] * len(vocab)
    for s, i in vocab.items():
        tokens[i] = s
    if any(t is None for t in tokens):
        raise RuntimeError("token ids are not dense")
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    special = {a["content"] for a in spec.get("added_tokens", []) if a.get("special")}
    types = [TOKEN_TYPE_CONTROL if t in special else TOKEN_TYPE_NORMAL for t in tokens]
    return {"tokens": tokens, "token_type": types, "merges": merges, "eot_id": vocab[EOT]}


def add_to_gguf(writer, tok) -> None:
    v = gguf_vocab(tok)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")
    writer.add_token_list(v["tokens"])
    writer.add_token_types(v["token_type"])
    writer.add_token_merges(v["merges"])
    writer.add_bos_token_id(v["eot_id"])
    writer.add_eos_token_id(v["eot_id"])
    writer.add_add_bos_token(False)
    writer.add_add_eos_token(False)
