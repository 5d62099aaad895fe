"""The PyTorch DSpark draft against upstream: same weights, same features, same blocks.

Upstream runs through the runtime (`mtplib.lab.dspark_eval.upstream_blocks`: features
extracted from the trunk, injected, the block decoded; F32 K/V, flash attention off).
The torch side runs in float64 on the torch trunk's features, and once more on the
features upstream extracted (that isolates the draft).
``python -m mtplib.train.dspark.parity DRAFT [--trunk-dir DIR] [--anchors 64 100 ...]``
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from mtplib.lab.dspark_eval import PARITY_SETTINGS, upstream_blocks
from mtplib.train.dspark.export import read_draft
from mtplib.train.dspark.model import trunk_features


def torch_blocks(trunk_dir: str | Path, draft: str | Path, tokens: Sequence[int],
                 anchors: Sequence[int], features: np.ndarray | None = None) -> dict:
    """Float64 torch: the greedy Markov chain's logits, confidences, and the features."""
    from mtplib.model.trained import trained_paths
    from mtplib.train.parity import load_pair

    pair = trained_paths(trunk_dir)
    trunk = load_pair(pair.trunk, pair.sidecar, dtype=torch.float64)
    model = read_draft(draft)
    x = torch.tensor([list(tokens)], dtype=torch.int64)
    with torch.no_grad():
        f, _ = trunk_features(trunk, x, model.dcfg.target_layers)
        if features is not None:
            f = f.clone()
            f[0, : len(features)] = torch.from_numpy(features).to(f.dtype)
        lo, conf, _ = model.chain(f, x, torch.tensor(sorted(anchors)),
                                  trunk.w("token_embd.weight"), trunk.w("output.weight"))
    return {"logits": lo[0].numpy(), "confidences": conf[0].numpy(),
            "features": f[0].numpy()}


def compare(trunk_dir: str | Path, draft: str | Path, tokens: Sequence[int],
            anchors: Sequence[int], *, n_threads: int = 1) -> dict:
    from mtplib.model.trained import trained_paths

    up = upstream_blocks(trained_paths(trunk_dir).trunk, draft, tokens, anchors,
                         n_threads=n_threads)
    own = torch_blocks(trunk_dir, draft, tokens, anchors)
    fed = torch_blocks(trunk_dir, draft, tokens, anchors, features=up["features"])
    nf = len(up["features"])
    return {
        "anchors": sorted(int(a) for a in anchors),
        "n_tokens": len(tokens),
        "features_max_abs": float(np.abs(up["features"] - own["features"][:nf]).max()),
        "logits_max_abs": float(np.abs(up["logits"] - own["logits"]).max()),
        "logits_max_abs_upstream_features": float(np.abs(up["logits"] - fed["logits"]).max()),
        "logit_scale": float(np.abs(own["logits"]).max()),
        "confidence_max_abs": float(np.abs(up["confidences"] - own["confidences"]).max()),
        "argmax_agree": float((up["logits"].argmax(-1) == own["logits"].argmax(-1)).mean()),
        "upstream_config": dict(PARITY_SETTINGS),
    }


def main(argv: list[str] | None = None) -> int:
    import sys

    from mtplib import host, paths
    from mtplib.lab.dspark_eval import check_stored
    from mtplib.model.trained import EVIDENCE_DIR, TrainedDSpark, trained_paths
    from mtplib.runtime import build_info

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("draft")
    ap.add_argument("--trunk-dir", default=str(EVIDENCE_DIR))
    ap.add_argument("--tokens", help="an .npz with a `heldout` (N, T) array (distill.npz)")
    ap.add_argument("--seqs", type=int, nargs="+", default=[0],
                    help="which sequences of --tokens")
    ap.add_argument("--anchors", type=int, nargs="+", default=[64, 100, 150, 186])
    ap.add_argument("--stored", help="also check upstream against this parity_dspark.npz")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", help="write the results JSON here")
    a = ap.parse_args(argv)
    args = list(argv if argv is not None else sys.argv[1:])
    prov = host.provenance(paths.REPO, build_info(), ["python -m mtplib.train.dspark.parity",
                                                       *args])
    if a.tokens:
        seqs = np.load(a.tokens)["heldout"]
        texts = [seqs[i].tolist() for i in a.seqs]
    else:
        texts = [np.random.default_rng(0).integers(1, 2000, max(a.anchors) + 1).tolist()]
    res: dict = {"runs": [{"seq": i, **compare(a.trunk_dir, a.draft, t, a.anchors,
                                                 n_threads=a.threads)}
                          for i, t in zip(a.seqs, texts, strict=False)]}
    for k in ("features_max_abs", "logits_max_abs", "logits_max_abs_upstream_features",
              "confidence_max_abs"):
        res[k] = max(r[k] for r in res["runs"])
    res["argmax_agree"] = min(r["argmax_agree"] for r in res["runs"])
    if a.stored:
        res["stored"] = check_stored(TrainedDSpark(Path(a.draft), Path(a.stored)),
                                     trained_paths(a.trunk_dir).trunk, n_threads=a.threads)
    res["provenance"] = host.finish(prov)
    text = json.dumps(res, indent=2)
    if a.out:
        Path(a.out).write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
