"""The PyTorch V4 model against upstream llama.cpp: same weights, same tokens, logits compared.

`load_pair` reads any trunk + `mtp-` sidecar pair (the random fixtures as well as the
trained pair) into `V4Model`; `compare` runs both and reports max |Δlogit| for the trunk
and for the MTP graph. Upstream runs with F32 K/V and flash attention off (flash attention
rounds K/V to F16, about 3e-3); the MTP graph is fed the trunk rows seen through the eval
callback. ``python -m mtplib.train.parity TRUNK SIDECAR [--tokens N]``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch

from mtplib.model.arch import ROOT_HC_HEAD, config_from_keys
from mtplib.train.model import MTP_HEAD_PREFIX, V4Model


def read_tensors(path: str | Path) -> dict[str, np.ndarray]:
    import gguf

    return {t.name: np.array(t.data) for t in gguf.GGUFReader(str(path)).tensors}


def load_pair(trunk: str | Path, sidecar: str | Path, *,
              dtype: torch.dtype = torch.float64) -> V4Model:
    """A V4Model holding the weights of a trunk and its `mtp-` sidecar."""
    from mtplib.model.gguf_header import read_header

    h = read_header(sidecar)
    cfg = config_from_keys(h.kv, h.n_vocab)
    model = V4Model(cfg, init=False)
    tensors = read_tensors(trunk)
    side = read_tensors(sidecar)
    for name, arr in side.items():
        if name.split(".")[0] in ROOT_HC_HEAD:
            tensors[MTP_HEAD_PREFIX + name] = arr
        elif name.startswith("blk."):
            tensors[name] = arr
        elif not np.array_equal(arr, tensors[name]):
            raise ValueError(f"sidecar root tensor {name} differs from the trunk's")
    model.load_gguf_tensors({k: torch.from_numpy(np.ascontiguousarray(v))
                             for k, v in tensors.items()})
    return model.to(dtype)


@torch.no_grad()
def torch_outputs(model: V4Model, tokens, rows: np.ndarray | None = None):
    """(trunk logits (T,V), rows (T,hc*E), MTP logits (T-1,V)) in the model's dtype.

    The MTP graph takes ``rows`` (e.g. upstream's) when given, else the model's own rows.
    """
    t = torch.tensor([list(tokens)], dtype=torch.int64)
    logits, X = model.trunk(t)
    T = t.shape[1]
    h = X[0].reshape(T, -1)
    hin = X[:, :-1] if rows is None else torch.from_numpy(rows[: T - 1]).to(X.dtype).view_as(
        X[:, :-1])
    mtp, _ = model.mtp(t[:, 1:], hin, 1)
    return logits[0].numpy(), h.numpy(), mtp[0].numpy()


def compare(trunk: str | Path, sidecar: str | Path, tokens, *, n_threads: int = 2) -> dict:
    from mtplib.lab.trained_eval import PARITY_CTX, upstream_mtp, upstream_trunk

    model = load_pair(trunk, sidecar)
    up_logits, up_rows = upstream_trunk(trunk, tokens, n_threads=n_threads, **PARITY_CTX)
    up_mtp = upstream_mtp(sidecar, tokens, up_rows, n_threads=n_threads, **PARITY_CTX)
    t_logits, t_rows, t_mtp_own = torch_outputs(model, tokens)
    _, _, t_mtp_up = torch_outputs(model, tokens, up_rows)
    return {
        "n_tokens": len(tokens),
        "trunk_max_abs": float(np.abs(up_logits - t_logits).max()),
        "trunk_logit_scale": float(np.abs(t_logits).max()),
        "rows_max_abs": float(np.abs(up_rows - t_rows).max()),
        "mtp_max_abs_upstream_rows": float(np.abs(up_mtp - t_mtp_up).max()),
        "mtp_max_abs_torch_rows": float(np.abs(up_mtp - t_mtp_own).max()),
        "mtp_logit_scale": float(np.abs(t_mtp_own).max()),
        "trunk_argmax_agree": float((up_logits.argmax(-1) == t_logits.argmax(-1)).mean()),
        "mtp_argmax_agree": float((up_mtp.argmax(-1) == t_mtp_own.argmax(-1)).mean()),
        "upstream_config": dict(PARITY_CTX),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trunk")
    ap.add_argument("sidecar")
    ap.add_argument("--tokens", type=int, default=300, help="random token ids (seeded)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args(argv)
    from mtplib.model.gguf_header import read_header

    n_vocab = read_header(a.trunk).n_vocab
    toks = np.random.default_rng(a.seed).integers(0, n_vocab, a.tokens).tolist()
    print(json.dumps(compare(a.trunk, a.sidecar, toks, n_threads=a.threads), indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
