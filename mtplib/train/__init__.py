"""Train a tiny DeepSeek-V4 with a real MTP head (optional extra ``train``: torch, tokenizers).

Modules: config (the model and training hyper-parameters, no torch), data (stdlib source,
split by module), tokenizer (byte-level BPE written as a `gpt2` GGUF vocab), model (the V4
forward pass and MTP block as upstream computes it), train (joint trunk + MTP training),
export (trunk GGUF + `mtp-` sidecar + parity logits), parity (torch vs upstream); the
subpackage dspark trains a DSpark draft (`dflash`) on the frozen trained trunk.
Nothing here is imported by the default install, the tests or CI.
"""
