"""Export a trained V4Model to a trunk GGUF and an `mtp-` sidecar in upstream's layout.

Names, shapes, creation order and `deepseek4.*` keys come from mtplib.model.arch
(trunk_tensors / sidecar_tensors / gguf_keys), exactly as the random fixtures are written.
The sidecar's root token_embd / output / output_norm hold the trunk's bytes; its root
output_hc_* is the MTP block's own hc head; nextn.shared_head_norm is written. The
tokenizer is the byte-level BPE (tokenizer.ggml.model "gpt2"). Every tensor is F32.

Also writes the parity reference: torch logits (float64, from the weights read back from
the written files) for held-out tokens, stored as float32 in a small .npz.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch

from mtplib.model.arch import ROOT_HC_HEAD, V4Config, gguf_keys, sidecar_tensors, trunk_tensors
from mtplib.model.trained import PARITY_NAME, SIDECAR_NAME, TRUNK_NAME
from mtplib.train import tokenizer as tk
from mtplib.train.model import MTP_HEAD_PREFIX, V4Model

#: Parity reference: this many held-out tokens, logits stored at these many positions.
PARITY_TOKENS = 320
PARITY_TRUNK_ROWS = 32
PARITY_MTP_ROWS = 16
PARITY_CHARS = 1600


def _add_keys(w, cfg: V4Config, sidecar: bool, name: str, tok, meta: dict) -> None:
    from mtplib.model.fixture import add_typed_keys

    w.add_name(name)
    add_typed_keys(w, gguf_keys(cfg, sidecar=sidecar))
    for key, val in meta.items():
        w.add_string(key, str(val))
    tk.add_to_gguf(w, tok)


def _write(path: Path, cfg: V4Config, specs, tensors: dict[str, np.ndarray], sidecar: bool,
           tok, meta: dict) -> None:
    import gguf

    tmp = path.with_name(path.name + ".tmp")
    w = gguf.GGUFWriter(str(tmp), arch="deepseek4")
    _add_keys(w, cfg, sidecar, path.stem, tok, meta)
    for spec in specs:
        src = spec.name
        if sidecar and spec.kind in ROOT_HC_HEAD:
            src = MTP_HEAD_PREFIX + spec.name  # the MTP block's own hc head
        arr = tensors[src]
        want = tuple(reversed(spec.ne))
        if arr.shape != want:
            raise ValueError(f"{spec.name}: shape {arr.shape}, upstream expects {want}")
        w.add_tensor(spec.name, np.ascontiguousarray(arr))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    os.replace(tmp, path)


def export_gguf(model: V4Model, tok, out_dir: str | Path, *, meta: dict | None = None
                ) -> tuple[Path, Path]:
    cfg = model.cfg
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for name, t in model.named_gguf().items():
        a = t.detach().cpu().numpy()
        tensors[name] = a.astype(np.int32) if a.dtype.kind == "i" else a.astype(np.float32)
    trunk, side = out / TRUNK_NAME, out / SIDECAR_NAME
    _write(trunk, cfg, trunk_tensors(cfg), tensors, False, tok, meta or {})
    _write(side, cfg, sidecar_tensors(cfg), tensors, True, tok, meta or {})
    return trunk, side


def _spread(lo: int, hi: int, n: int) -> np.ndarray:
    return np.unique(np.linspace(lo, hi, n).round().astype(np.int64))


def parity_text(split) -> tuple[str, str]:
    """(module, text): the first PARITY_CHARS characters of the first held-out module (in
    sorted order) that is long enough."""
    for name, text in zip(split.heldout, split.texts("heldout"), strict=True):
        if len(text) >= 2 * PARITY_CHARS:
            return name, text[:PARITY_CHARS]
    raise ValueError("no held-out module is long enough for the parity text")


def write_parity(trunk: Path, sidecar: Path, tokens: list[int], out: Path, *,
                 text: str = "", text_ids: list[int] | None = None) -> dict:
    """Store float64-torch logits of the files' own weights for ``tokens`` (and, for the
    tokenizer check, a held-out text with the ids the training tokenizer gives it)."""
    from mtplib.train.parity import load_pair, torch_outputs

    model = load_pair(trunk, sidecar, dtype=torch.float64)
    logits, _rows, mtp = torch_outputs(model, tokens)
    T = len(tokens)
    tp = _spread(0, T - 1, PARITY_TRUNK_ROWS)
    mp = _spread(1, T - 1, PARITY_MTP_ROWS)  # MTP entry positions (row p-1 of `mtp`)
    np.savez_compressed(out, tokens=np.asarray(tokens, dtype=np.int32), trunk_positions=tp,
                        trunk_logits=logits[tp].astype(np.float32), mtp_positions=mp,
                        mtp_logits=mtp[mp - 1].astype(np.float32), text=np.array(text),
                        text_ids=np.asarray(text_ids or [], dtype=np.int32))
    return {"tokens": T, "trunk_positions": tp.tolist(), "mtp_positions": mp.tolist(),
            "text_chars": len(text), "bytes": out.stat().st_size}


def export_all(model: V4Model, tok, out_dir: str | Path, parity_tokens: list[int], *,
               meta: dict | None = None, text: tuple[str, str] | None = None) -> dict:
    """GGUFs + parity reference. With ``text`` = (module, held-out text), the parity tokens
    are that text's ids (stored with it for the tokenizer check); else ``parity_tokens``."""
    trunk, side = export_gguf(model, tok, out_dir, meta=meta)
    ids = tk.encode(tok, text[1]) if text else None
    toks = (ids if ids else parity_tokens)[:PARITY_TOKENS]
    par = write_parity(trunk, side, toks, Path(out_dir) / PARITY_NAME,
                       text=text[1] if text else "", text_ids=ids)
    if text:
        par["text_module"] = text[0]
    return {"trunk": str(trunk), "sidecar": str(side), "parity": par}


def export_run(run: str | Path, out: str | Path | None = None) -> dict:
    """Export a training run's checkpoint (the command's own last step does the same)."""
    import json

    from mtplib.train import data
    from mtplib.train.config import TRAINED

    run = Path(run)
    st = torch.load(run / "checkpoint.pt", weights_only=False)
    model = V4Model(TRAINED, init=False)
    model.load_state_dict(st["model"])
    tok = tk.load(run / "tokenizer.json")
    summary = json.loads((run / "train_summary.json").read_text())
    meta = {"mtplib.trained.command": summary["command"],
            "mtplib.trained.steps": st["step"]}
    return export_all(model, tok, out or run, [], meta=meta,
                      text=parity_text(data.make_split()))


def main(argv: list[str] | None = None) -> int:
    import argparse
    import json

    ap = argparse.ArgumentParser(prog="python -m mtplib.train.export",
                                 description="export a run's checkpoint to GGUF + parity npz")
    ap.add_argument("--run", required=True)
    ap.add_argument("--out")
    a = ap.parse_args(argv)
    print(json.dumps(export_run(a.run, a.out), indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
