"""Export a trained DSpark draft to a `dflash` GGUF in upstream's converter layout.

Keys and tensor table come from mtplib.model.dspark.spec (`dspark_keys`, `dspark_tensors`):
arch `dflash`, `target_layers`, `block_size`, the V4 stage keys, no `token_embd` /
`output` (the target's, through ``ctx_other``). The tokenizer is the trunk's byte-level
BPE (`gpt2`, as evidence/trained-v4/) plus ``tokenizer.ggml.mask_token_id``, the noise
token. Every tensor is F32. `mtplib.model.dspark.fixture.write_dspark` writes random
weights and a placeholder vocabulary only, so the trained weights are written here.

Also writes the parity reference: the float64 torch draft's block logits and confidences
(upstream's greedy Markov chain) at a few anchors of one held-out sequence, from the
weights read back from the written file.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch

from mtplib.model.dspark.spec import ARCH, dspark_keys, dspark_tensors
from mtplib.model.trained import DSPARK_NAME, DSPARK_PARITY_NAME
from mtplib.train import tokenizer as tk
from mtplib.train.dspark.model import DSparkDraft

PARITY_ANCHORS = (64, 100, 150, 186)  # in one 192-token held-out sequence


def write_gguf(model: DSparkDraft, tok, path: Path, *, meta: dict | None = None) -> Path:
    import gguf

    from mtplib.model.fixture import add_typed_keys

    cfg = model.dcfg
    tensors = {n: t.detach().cpu().numpy().astype(np.float32)
               for n, t in model.named_gguf().items()}
    tmp = path.with_name(path.name + ".tmp")
    w = gguf.GGUFWriter(str(tmp), arch=ARCH)
    w.add_name(path.stem)
    add_typed_keys(w, dspark_keys(cfg))
    for key, val in (meta or {}).items():
        w.add_string(key, str(val))
    tk.add_to_gguf(w, tok)
    for spec in dspark_tensors(cfg):
        arr = tensors[spec.name]
        want = tuple(reversed(spec.ne))
        if arr.shape != want:
            raise ValueError(f"{spec.name}: shape {arr.shape}, upstream expects {want}")
        w.add_tensor(spec.name, np.ascontiguousarray(arr))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    os.replace(tmp, path)
    return path


def read_draft(path: str | Path, *, dtype: torch.dtype = torch.float64) -> DSparkDraft:
    """A DSparkDraft holding a `dflash` GGUF's weights (config from its header)."""
    from mtplib.model.dspark.validate import validate_dspark
    from mtplib.model.gguf_header import read_header
    from mtplib.train.parity import read_tensors

    cfg = validate_dspark(read_header(path))
    model = DSparkDraft(cfg, init=False)
    model.load_gguf_tensors({k: torch.from_numpy(np.ascontiguousarray(v))
                             for k, v in read_tensors(path).items()})
    return model.to(dtype)


def write_parity(draft: Path, trunk_dir: Path, tokens: np.ndarray, out: Path) -> dict:
    """Float64 torch block logits / confidences at PARITY_ANCHORS of ``tokens``."""
    from mtplib.model.trained import trained_paths
    from mtplib.train.dspark.model import trunk_features
    from mtplib.train.parity import load_pair

    pair = trained_paths(trunk_dir)
    trunk = load_pair(pair.trunk, pair.sidecar, dtype=torch.float64)
    model = read_draft(draft)
    x = torch.from_numpy(np.asarray(tokens, dtype=np.int64))[None]
    anchors = torch.tensor(PARITY_ANCHORS)
    with torch.no_grad():
        feats, _ = trunk_features(trunk, x, model.dcfg.target_layers)
        lo, conf, drafts = model.chain(feats, x, anchors, trunk.w("token_embd.weight"),
                                       trunk.w("output.weight"))
    np.savez_compressed(out, tokens=np.asarray(tokens, dtype=np.int32),
                        anchors=np.asarray(PARITY_ANCHORS, dtype=np.int32),
                        logits=lo[0].numpy().astype(np.float32),
                        confidences=conf[0].numpy().astype(np.float32),
                        drafts=drafts[0].numpy().astype(np.int32))
    return {"anchors": list(PARITY_ANCHORS), "tokens": int(len(tokens)),
            "bytes": out.stat().st_size}


def export_dspark(model: DSparkDraft, frozen, out_dir: str | Path, *, heldout: np.ndarray,
                  meta: dict | None = None) -> dict:
    """The GGUF and the parity reference (on the first held-out sequence)."""
    out = Path(out_dir)
    trunk_dir = Path(frozen.paths.trunk).parent
    tok = tk.load(trunk_dir / "tokenizer.json")
    path = write_gguf(model, tok, out / DSPARK_NAME, meta=meta)
    par = write_parity(path, trunk_dir, heldout[0], out / DSPARK_PARITY_NAME)
    return {"draft": str(path), "bytes": path.stat().st_size, "parity": par}
