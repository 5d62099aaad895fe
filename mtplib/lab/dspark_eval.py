"""The trained DSpark draft on upstream: block logits against a stored torch reference,
and acceptance in the runtime's greedy loop next to the trained MTP block's.

No torch: upstream runs through the runtime (mtplib.runtime.dspark.context). The trunk decodes the
text up to each anchor with layer-input extraction on; the feature rows are injected into
the draft context (``ctx_other`` = the trunk); the block ``[anchor, mask × (n-1)]`` is
decoded and its logits (Markov bias included) and confidences are read; the block's K is
removed again, as the drafter does. F32 K/V and flash attention off (flash attention
rounds K to F16). The reference (`parity_dspark.npz`) holds the float64 PyTorch draft's
logits (mtplib.train.dspark, upstream's greedy Markov chain) for the same blocks.

Acceptance: `MTPRuntime` with the DSpark draft as its sidecar (`DSparkDrafter`, k = the
block size) and with the MTP sidecar (k = 1, 2, 3), greedy, the same held-out prompts
(`mtplib.lab.trained_eval.prompts_from`, seed 0), the runtime's default settings; per
prompt the tokens committed per verify step.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from mtplib import logs
from mtplib.contract.capabilities import Policy
from mtplib.errors import InputError
from mtplib.model.dspark.validate import validate_dspark
from mtplib.model.gguf_header import read_header
from mtplib.model.trained import TrainedDSpark, trained_dspark_paths, trained_paths
from mtplib.runtime.routing import require_mtp

log = logging.getLogger(__name__)

#: Parity configuration: F32 K/V, flash attention off.
PARITY_SETTINGS = {"kv_type": "f32", "flash_attn": "off"}


def upstream_blocks(trunk: str | Path, draft: str | Path, tokens: Sequence[int],
                    anchors: Sequence[int], *, n_threads: int = 1,
                    policy: Policy | str | None = None) -> dict:
    """Upstream's block logits (A, n, V), confidences (A, n) and the features (a_max, L*E)
    of positions 0..max(anchors)-1. Routed like every drafting path (`require_mtp`, as
    DSpark): a policy that disables drafting refuses it before anything loads."""
    from mtplib.runtime.dspark.context import DSparkContext, DSparkModel, TargetFeatures
    from mtplib.runtime.model import Context, ContextConfig, Model
    from mtplib.runtime.settings import ContextSettings

    block = validate_dspark(read_header(draft)).block_size
    require_mtp("upstream_blocks", policy=policy, drafter="dspark", dspark_block=block)
    anchors = sorted(int(a) for a in anchors)
    if not anchors or anchors[0] < 1 or anchors[-1] >= len(tokens):
        raise InputError(f"anchors {anchors} must lie in 1..{len(tokens) - 1}")
    if len(set(anchors)) != len(anchors):
        raise InputError(f"anchors {anchors} repeat")
    n_ctx = max(256, -(-(len(tokens) + 8) // 256) * 256)
    logits, confs, rows = [], [], []
    with Model(trunk) as tm:
        tcfg = ContextConfig(n_ctx=n_ctx, n_threads=n_threads, **PARITY_SETTINGS)
        with Context(tm, tcfg) as tctx, DSparkModel(draft, trunk_header=tm.header) as dm:
            feats = TargetFeatures(tctx, dm.layer_ids, tm.n_embd)
            settings = ContextSettings(n_ctx=n_ctx, n_threads=n_threads, **PARITY_SETTINGS)
            with DSparkContext(dm, tctx, settings, n_threads=n_threads) as dctx:
                n, fed = dm.config.block_size, 0
                for a in anchors:
                    for s in range(fed, a, tctx.n_batch):  # the target's chunks
                        e = min(a, s + tctx.n_batch)
                        tctx.decode(list(tokens[s:e]), range(s, e))
                        r = feats.rows(tctx, e - s)
                        rows.append(r)
                        dctx.inject(r, list(range(s, e)), [0] * (e - s))
                    fed = a
                    block = [int(tokens[a])] + [dm.config.mask_token_id] * (n - 1)
                    dctx.block(block, list(range(a, a + n)), [0] * n, 1)
                    logits.append(dctx.logits_all(n))
                    confs.append(dctx.confidences(n))
                    dctx.seq_rm(0, a, -1)  # the block's K is noise
    return {"logits": np.stack(logits), "confidences": np.stack(confs),
            "features": np.concatenate(rows)}


def check_stored(draft: TrainedDSpark | None = None, trunk: str | Path | None = None, *,
                 n_threads: int = 1) -> dict:
    """Upstream against the torch logits stored at export time."""
    draft = draft or trained_dspark_paths()
    trunk = trunk or trained_paths().trunk
    ref = np.load(draft.parity)
    up = upstream_blocks(trunk, draft.draft, ref["tokens"].tolist(), ref["anchors"].tolist(),
                         n_threads=n_threads)
    return {"anchors": ref["anchors"].tolist(),
            "logits_max_abs": float(np.abs(up["logits"] - ref["logits"]).max()),
            "logit_scale": float(np.abs(ref["logits"]).max()),
            "confidence_max_abs": float(np.abs(up["confidences"] - ref["confidences"]).max()),
            "argmax_agree": float((up["logits"].argmax(-1) == ref["drafts"]).mean()),
            "config": dict(PARITY_SETTINGS)}


def tokens_per_step(hist: dict[str, int]) -> float:
    """Mean committed tokens per verify step (accepted drafts + the target's own)."""
    steps = sum(hist.values())
    return sum((int(k) + 1) * v for k, v in hist.items()) / max(steps, 1)


def run_prompts(trunk: str | Path, sidecar: str | Path, k: int, prompts: list[list[int]],
                n_new: int, *, n_threads: int = 1) -> dict:
    """Greedy generation of every prompt with one drafter; per prompt and in total."""
    from mtplib.runtime.speculative import MTPRuntime

    n_ctx = max(256, -(-(max(len(p) for p in prompts) + n_new) // 256) * 256)
    rt = MTPRuntime(str(trunk), str(sidecar), k=k, n_ctx=n_ctx, n_threads=n_threads)
    per, outputs, hists = [], [], []
    hist = [0] * (k + 1)
    acc, drafted = np.zeros(k), np.zeros(k)
    try:
        for p in prompts:
            toks, m = rt.generate(p, n_new)
            outputs.append(toks)
            per.append(tokens_per_step(m.accept_len_hist))
            hists.append([m.accept_len_hist[str(i)] for i in range(k + 1)])
            for i in range(k + 1):
                hist[i] += m.accept_len_hist[str(i)]
            acc += m.accepted_per_position_counts
            drafted += m.drafted_per_position
    finally:
        rt.close()
    return {"k": k, "tokens_per_verify_step": tokens_per_step(
                {str(i): h for i, h in enumerate(hist)}),
            "tokens_per_verify_step_per_prompt": per, "accept_len_hist": hist,
            "accept_len_hist_per_prompt": hists,
            "accepted_per_position": (acc / np.maximum(drafted, 1)).tolist(),
            "drafted_counts": drafted.astype(int).tolist(), "outputs": outputs}


def compare_acceptance(*, n_prompts: int = 16, n_new: int = 128, prompt_len: int = 64,
                       mtp_ks=(1, 2, 3), n_threads: int = 1) -> dict:
    """DSpark (k = block size) vs the MTP block (each k) on the same held-out prompts."""
    from mtplib.lab.trained_eval import heldout_modules, heldout_tokens, prompts_from
    pair, draft = trained_paths(), trained_dspark_paths()
    docs = heldout_tokens(pair.trunk, heldout_modules(Path(pair.trunk).parent / "split.json"))
    prompts = prompts_from(docs, n=n_prompts, length=prompt_len)
    k = validate_dspark(read_header(draft.draft)).block_size
    ds = run_prompts(pair.trunk, draft.draft, k, prompts, n_new, n_threads=n_threads)
    mtp = {str(j): run_prompts(pair.trunk, pair.sidecar, j, prompts, n_new,
                               n_threads=n_threads) for j in mtp_ks}
    best = [max(mtp[str(j)]["tokens_per_verify_step_per_prompt"][i] for j in mtp_ks)
            for i in range(len(prompts))]
    ratio = [d / b for d, b in zip(ds["tokens_per_verify_step_per_prompt"], best, strict=True)]
    same = all(ds["outputs"] == mtp[str(j)]["outputs"] for j in mtp_ks)

    def first(n: int) -> dict:  # the same figures over the first n prompts
        def tps(run: dict) -> float:
            h = np.sum(run["accept_len_hist_per_prompt"][:n], 0)
            return tokens_per_step({str(i): int(v) for i, v in enumerate(h)})

        best_k = max(mtp_ks, key=lambda j: tps(mtp[str(j)]))
        return {"prompts": n, "dspark_tokens_per_verify_step": tps(ds),
                "mtp_tokens_per_verify_step": {str(j): tps(mtp[str(j)]) for j in mtp_ks},
                "mtp_best_k": best_k,
                "dspark_over_mtp_best_total": tps(ds) / tps(mtp[str(best_k)]),
                "dspark_over_mtp_best_per_prompt_min": min(ratio[:n]),
                "dspark_over_mtp_best_per_prompt_mean": float(np.mean(ratio[:n])),
                "prompts_below_1_25": int(sum(r < 1.25 for r in ratio[:n]))}

    return {"subsets": [first(n) for n in sorted({min(16, len(prompts)), len(prompts)})],
            "prompts": len(prompts), "prompt_tokens": prompt_len, "n_new": n_new,
            "dspark": ds, "mtp": mtp, "mtp_best_per_prompt": best,
            "dspark_over_mtp_best_per_prompt": ratio,
            "dspark_over_mtp_best_min": min(ratio),
            "dspark_over_mtp_best_total": ds["tokens_per_verify_step"] / max(
                mtp[str(j)]["tokens_per_verify_step"] for j in mtp_ks),
            "same_tokens_as_mtp": same}


def main(argv: list[str] | None = None) -> int:
    import argparse
    import json
    import sys

    from mtplib import host, paths
    from mtplib.errors import MtplibError
    from mtplib.runtime import build_info

    ap = argparse.ArgumentParser(prog="python -m mtplib.lab.dspark_eval",
                                 description="the trained DSpark draft on upstream (no torch)")
    ap.add_argument("--out", help="write the acceptance JSON here")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--n", type=int, default=128, help="tokens generated per prompt")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--parity-only", action="store_true")
    a = ap.parse_args(argv)
    logs.configure()
    args = list(argv if argv is not None else sys.argv[1:])
    prov = host.provenance(paths.REPO, build_info(), ["python -m mtplib.lab.dspark_eval", *args])
    try:
        res = {"parity": check_stored(n_threads=a.threads)}
        if not a.parity_only:
            res.update(compare_acceptance(n_prompts=a.prompts, n_new=a.n,
                                          n_threads=a.threads))
    except MtplibError as e:
        log.error("%s: error: %s", ap.prog, e)
        return 2
    res["provenance"] = host.finish(prov)
    text = json.dumps(res, indent=2)
    if a.out:
        Path(a.out).write_text(text + "\n")
    short = {k: v for k, v in res.items() if k not in ("dspark", "mtp", "provenance")}
    print(json.dumps(short, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
