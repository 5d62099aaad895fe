"""Tables of a model file for notebooks and the CLI (header only, no weights read)."""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from mtplib.model.arch import config_from_keys
from mtplib.model.gguf_header import read_header


def config_frame(path: str | Path) -> pd.DataFrame:
    """The V4 hyper-parameters of a GGUF as a two-column table."""
    h = read_header(path, with_tokens=False)
    cfg = config_from_keys(h.kv, h.n_vocab)
    d = cfg.to_dict()
    d["compress_ratios"] = ",".join(map(str, d["compress_ratios"]))
    return pd.DataFrame({"key": list(d), "value": [str(v) for v in d.values()]})


def tensor_frame(path: str | Path) -> pd.DataFrame:
    h = read_header(path, with_tokens=False)
    return pd.DataFrame([{"name": t.name, "block": t.block, "shape": str(t.ne),
                          "dtype": t.dtype, "bytes": t.nbytes} for t in h.tensors])
