"""Train the tiny DSpark draft on the frozen trained trunk.

``python -m mtplib.train.dspark --out DIR [--minutes M] [--seed S] [--resume] [--steps N]``

Data: the trunk's greedy continuations of training-split prompts (dspark.data). Every
position a from the first generated token on is an anchor: the block [x_a, mask × 4] at
positions a..a+4 sees the trunk features of positions < a (injected K) and learns
slot i -> x_{a+i+1}. One step = ``batch_size`` sequences × every anchor.

Loss: Σ_i decay^i · CE(logits'(i), x_{a+i+1}) / Σ_i decay^i, with the Markov head's prev
teacher forced (prev(0) = anchor, prev(i) = x_{a+i}, the tokens upstream's greedy chain
feeds while the draft is right); plus ``conf_weight`` · BCE(confidence(i), [argmax
logits'(i) == x_{a+i+1}]), the confidence head reading h and w1[prev] detached so it
cannot pull the draft. Trunk, `token_embd` and `output` are frozen. AdamW, warm-up then
cosine, expert bias balancing, checkpoint/resume and the ``--minutes`` cap as
mtplib.train.train does.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from mtplib.train.dspark import metrics
from mtplib.train.dspark.config import MASK_BYTE, DSparkTrainConfig, trained_dspark
from mtplib.train.dspark.model import DSparkDraft, trunk_features
from mtplib.train.train import lr_at

log = logging.getLogger(__name__)
CKPT = "checkpoint.pt"
HISTORY = "history.jsonl"


def mask_token_id(tokenizer_json: str | Path) -> int:
    """The id of byte 0xFF's token in a byte-level BPE (GPT-2 byte-to-unicode: 0xFF is ÿ)."""
    vocab = json.loads(Path(tokenizer_json).read_text())["model"]["vocab"]
    return int(vocab[chr(MASK_BYTE)])


class Frozen:
    """The trained trunk (float32, no gradients) and its shared embedding / head."""

    def __init__(self, trunk_dir: Path) -> None:
        from mtplib.model.trained import trained_paths
        from mtplib.train.parity import load_pair

        pair = trained_paths(trunk_dir)
        self.paths = pair
        self.model = load_pair(pair.trunk, pair.sidecar, dtype=torch.float32)
        for p in self.model.parameters():
            p.requires_grad_(False)
        self.embd = self.model.w("token_embd.weight")
        self.output = self.model.w("output.weight")

    @torch.no_grad()
    def features(self, x: torch.Tensor, layers) -> torch.Tensor:
        return trunk_features(self.model, x, layers)[0]


def block_targets(x: torch.Tensor, anchors: torch.Tensor, n: int):
    """(prev (B,A,n), targets (B,A,n), valid (A,n)): prev(i) = x[a+i], target x[a+i+1]."""
    T = x.shape[1]
    idx = anchors[:, None] + torch.arange(n)
    valid = idx + 1 <= T - 1
    return x[:, idx.clamp(max=T - 1)], x[:, (idx + 1).clamp(max=T - 1)], valid


def losses(model: DSparkDraft, frozen: Frozen, x: torch.Tensor, first: int,
           tc: DSparkTrainConfig) -> tuple[torch.Tensor, dict, torch.Tensor]:
    cfg = model.dcfg
    n = cfg.block_size
    anchors = torch.arange(first, x.shape[1] - 1)
    feats = frozen.features(x, cfg.target_layers)
    logits, h, loads = model.body(feats, x, anchors, frozen.embd, frozen.output)
    prev, y, valid = block_targets(x, anchors, n)
    lo, _ = model.heads(logits, h, prev)
    conf = model.confidence(h.detach(), prev, detach=True)  # its own loss only
    V = lo.shape[-1]
    ce = F.cross_entropy(lo.reshape(-1, V), y.reshape(-1), reduction="none").view(y.shape)
    w = (tc.slot_decay ** torch.arange(n, dtype=lo.dtype))[None, None, :] * valid[None]
    ce_w = (ce * w).sum() / w.expand_as(ce).sum()
    right = (lo.argmax(-1) == y).to(lo.dtype)
    vm = valid[None].expand_as(right)
    bce = F.binary_cross_entropy_with_logits(conf[vm], right[vm])
    loss = ce_w + tc.conf_weight * bce
    stats = {"loss": ce_w.item(), "conf_bce": bce.item(),
             "slot_acc": [float(right[:, :, i][vm[:, :, i]].mean()) for i in range(n)]}
    return loss, stats, loads


@torch.no_grad()
def evaluate(model: DSparkDraft, frozen: Frozen, seqs: np.ndarray, first: int,
             batch: int = 8) -> dict:
    """Held-out: per-slot accuracy, conditional acceptance, the greedy loop's tokens per
    verify step (n_max = block size 5), CE of slot 0, and the confidence head's calibration."""
    cfg = model.dcfg
    n = cfg.block_size
    T = seqs.shape[1]
    corr = np.zeros((len(seqs), T, n), dtype=bool)
    valid_all = np.zeros((len(seqs), T, n), dtype=bool)
    ce0, confs, rights = [], [], []
    for s in range(0, len(seqs), batch):
        x = torch.from_numpy(seqs[s : s + batch].astype(np.int64))
        anchors = torch.arange(first, T - 1)
        feats = frozen.features(x, cfg.target_layers)
        lo, conf, drafts = model.chain(feats, x, anchors, frozen.embd, frozen.output)
        _, y, valid = block_targets(x, anchors, n)
        c = (drafts == y).numpy()
        corr[s : s + batch, first : T - 1] = c
        valid_all[s : s + batch, first : T - 1] = valid.numpy()[None]
        ce0.append(F.cross_entropy(lo[:, :, 0].reshape(-1, lo.shape[-1]),
                                   y[:, :, 0].reshape(-1)).item())
        lead = torch.from_numpy(metrics.leading(c & valid.numpy()[None]))
        reach = lead[..., None] >= torch.arange(n)  # slot reached by the loop
        confs.append(conf[reach & valid].numpy())
        rights.append(torch.from_numpy(c)[reach & valid].numpy())
    out = metrics.slot_stats(corr[:, first : T - 1], valid_all[:, first : T - 1])
    out["loop_n5"] = metrics.loop_stats(corr, first, 5)
    cf, rt = np.concatenate(confs), np.concatenate(rights)
    out["conf_mean_when_right"] = float(cf[rt].mean()) if rt.any() else None
    out["conf_mean_when_wrong"] = float(cf[~rt].mean()) if (~rt).any() else None
    out["slot0_ce"] = float(np.mean(ce0))
    out["sequences"] = int(len(seqs))
    return out


def param_groups(model: DSparkDraft, wd: float) -> list[dict]:
    decay, no_decay = [], []
    for name, p in model.params.items():
        if p.requires_grad:
            (decay if p.dim() >= 2 and not name.endswith("_fn__weight") else no_decay).append(p)
    return [{"params": decay, "weight_decay": wd}, {"params": no_decay, "weight_decay": 0.0}]


def plot(history: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tr = [h for h in history if h["kind"] == "train"]
    ev = [h for h in history if h["kind"] == "eval"]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4.2))
    a1.plot([h["step"] for h in tr], [h["loss"] for h in tr], lw=0.6, alpha=0.6,
            label="train: slot-weighted CE")
    a1.plot([h["step"] for h in ev], [h["slot0_ce"] for h in ev], "o-", label="held-out: slot 0 CE")
    a1.set_xlabel("step")
    a1.set_ylabel("cross-entropy (nats/token)")
    a1.grid(alpha=0.3)
    a1.legend()
    for i in range(len(ev[0]["slot_accuracy"]) if ev else 0):
        a2.plot([h["step"] for h in ev], [h["slot_accuracy"][i] for h in ev], "o-",
                label=f"held-out slot {i}")
    a2.plot([h["step"] for h in ev], [h["loop_n5"]["tokens_per_verify_step"] / 6 for h in ev],
            "k--", label="tokens per verify step / 6")
    a2.set_xlabel("step")
    a2.set_ylabel("accuracy (greedy text)")
    a2.set_ylim(0, 1)
    a2.grid(alpha=0.3)
    a2.legend(fontsize=8)
    fig.suptitle("tiny DSpark (3 V4 stages, block 5) on the frozen trained trunk")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def save_ckpt(path: Path, model, opt, step: int, elapsed: float, tc, seed: int) -> None:
    tmp = path.with_name(path.name + ".tmp")
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step,
                "elapsed": elapsed, "train_config": tc.to_dict(), "seed": seed,
                "dspark_config": model.dcfg.to_dict()}, tmp)
    os.replace(tmp, path)


def train(out: Path, *, trunk_dir: Path, minutes: float, seed: int, resume: bool,
          tc: DSparkTrainConfig, threads: int, stop_after: int | None = None) -> dict:
    from mtplib.train.dspark.data import make_distill

    out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(threads)
    torch.manual_seed(seed)
    frozen = Frozen(trunk_dir)
    d = make_distill(frozen.paths.trunk, out, tc)
    cfg = trained_dspark(mask_token_id(Path(trunk_dir) / "tokenizer.json"))
    for k in ("train", "heldout"):
        if (d[k] == cfg.mask_token_id).any():
            raise RuntimeError(f"the noise token {cfg.mask_token_id} occurs in the {k} text")
    model = DSparkDraft(cfg, seed=seed)
    opt = torch.optim.AdamW(param_groups(model, tc.weight_decay), lr=tc.lr, betas=(0.9, 0.95))
    ckpt, hist_path = out / CKPT, out / HISTORY
    step, elapsed, history = 0, 0.0, []
    if resume and ckpt.exists():
        st = torch.load(ckpt, weights_only=False)
        if st["seed"] != seed or st["train_config"] != tc.to_dict():
            raise SystemExit("--resume: checkpoint was made with another seed or config")
        model.load_state_dict(st["model"])
        opt.load_state_dict(st["opt"])
        step, elapsed = st["step"], st["elapsed"]
        if hist_path.exists():
            history = [json.loads(x) for x in hist_path.read_text().splitlines()]
            history = [h for h in history if h["step"] <= step and h["kind"] != "final_eval"]
    hist_path.write_text("".join(json.dumps(h) + "\n" for h in history))

    def record(rec: dict) -> None:
        history.append(rec)
        with open(hist_path, "a") as f:
            f.write(json.dumps(rec) + "\n")

    first = tc.prompt_len
    held_eval = d["heldout"][:32]  # during training; all of them at the end
    n_train = len(d["train"])
    stopped, t_last = "steps", time.time()
    while step < tc.steps:
        if elapsed >= minutes * 60.0:
            stopped = "time budget"
            break
        if stop_after is not None and step >= stop_after:
            stopped = f"stop_after {stop_after}"
            break
        for g in opt.param_groups:
            g["lr"] = lr_at(step, tc)
        rng = np.random.default_rng([seed, step])
        x = torch.from_numpy(d["train"][rng.integers(0, n_train, tc.batch_size)].astype(np.int64))
        loss, st, loads = losses(model, frozen, x, first, tc)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gn = torch.nn.utils.clip_grad_norm_(model.parameters(), tc.grad_clip)
        opt.step()
        with torch.no_grad():  # auxiliary-loss-free expert balancing (DeepSeek-V3)
            for l in range(cfg.n_stages):
                b = model.w(f"blk.{l}.exp_probs_b.bias")
                b += tc.bias_update * torch.sign(loads[l].mean() - loads[l])
        step += 1
        now = time.time()
        elapsed += now - t_last
        t_last = now
        record({"kind": "train", "step": step, **st, "lr": lr_at(step - 1, tc),
                "grad_norm": float(gn), "elapsed_s": round(elapsed, 1)})
        if step % 10 == 0:
            log.info("step %d loss %.3f slot acc %s (%.1f min)", step, st["loss"],
                     " ".join(f"{a:.2f}" for a in st["slot_acc"]), elapsed / 60)
        if step % tc.eval_every == 0 or step == tc.steps:
            ev = evaluate(model, frozen, held_eval, first)
            record({"kind": "eval", "step": step, **_short(ev), "elapsed_s": round(elapsed, 1)})
            log.info("step %d held-out slot acc %s, tokens/verify %.3f", step,
                     " ".join(f"{a:.3f}" for a in ev["slot_accuracy"]),
                     ev["loop_n5"]["tokens_per_verify_step"])
            t_last = time.time()  # evaluation is not training time
        if step % tc.ckpt_every == 0:
            save_ckpt(ckpt, model, opt, step, elapsed, tc, seed)
            t_last = time.time()
    save_ckpt(ckpt, model, opt, step, elapsed, tc, seed)
    final = evaluate(model, frozen, d["heldout"], first)
    record({"kind": "final_eval", "step": step, **_short(final), "elapsed_s": round(elapsed, 1)})
    plot(history, out / "loss_curve.png")
    return {"model": model, "frozen": frozen, "data": d, "step": step, "elapsed_s": elapsed,
            "stopped": stopped, "history": history, "final": final}


def _short(ev: dict) -> dict:
    """An eval record for history.jsonl (without the per-sequence lists)."""
    out = {k: v for k, v in ev.items() if not k.startswith("loop_")}
    for k in ("loop_n5",):
        out[k] = {a: b for a, b in ev[k].items() if a != "tokens_per_verify_step_per_sequence"}
    return out


def main(argv: list[str] | None = None) -> int:
    from mtplib.model.trained import EVIDENCE_DIR

    ap = argparse.ArgumentParser(prog="python -m mtplib.train.dspark",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="run directory (data, checkpoints, GGUF)")
    ap.add_argument("--trunk-dir", default=str(EVIDENCE_DIR),
                    help="the trained pair's folder (trunk GGUF, sidecar, tokenizer.json)")
    ap.add_argument("--minutes", type=float, default=30.0, help="wall-time cap for training")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--steps", type=int, default=DSparkTrainConfig.steps)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--stop-after", type=int)
    ap.add_argument("--no-export", action="store_true")
    a = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stderr)
    from mtplib import host, paths
    from mtplib.model.trained import trained_paths
    from mtplib.runtime import build_info

    if not trained_paths(a.trunk_dir).exists() or not (Path(a.trunk_dir) / "tokenizer.json"
                                                       ).exists():
        ap.error(f"no trained pair (trunk, sidecar, parity, tokenizer.json) in {a.trunk_dir}")
    if a.steps < 1 or a.minutes <= 0:
        ap.error("--steps must be >= 1 and --minutes > 0")
    tc = DSparkTrainConfig(steps=a.steps)
    out = Path(a.out)
    args = list(argv if argv is not None else sys.argv[1:])
    cmd = "python -m mtplib.train.dspark " + " ".join(args)
    prov = host.provenance(paths.REPO, build_info(), ["python -m mtplib.train.dspark", *args])
    res = train(out, trunk_dir=Path(a.trunk_dir), minutes=a.minutes, seed=a.seed,
                resume=a.resume, tc=tc, threads=a.threads, stop_after=a.stop_after)
    model = res["model"]
    tr = [h for h in res["history"] if h["kind"] == "train"][-50:]
    summary = {"command": cmd, "seed": a.seed, "steps_done": res["step"],
               "steps_planned": tc.steps, "stopped_by": res["stopped"],
               "train_minutes": round(res["elapsed_s"] / 60, 2),
               "data_minutes": round(res["data"]["seconds"] / 60, 2),
               "data_cached": res["data"]["cached"],
               "train_sequences": int(len(res["data"]["train"])),
               "heldout_sequences": int(len(res["data"]["heldout"])),
               "heldout_modules": res["data"]["heldout_modules"],
               "train_config": tc.to_dict(), "dspark_config": model.dcfg.to_dict(),
               "torch": torch.__version__, "threads": a.threads,
               "n_params": sum(p.numel() for p in model.parameters()),
               "final_train_loss_last50": float(np.mean([h["loss"] for h in tr])) if tr else None,
               "final_heldout": res["final"]}
    if not a.no_export:
        from mtplib.train.dspark.export import export_dspark

        meta = {"mtplib.trained.command": cmd, "mtplib.trained.steps": res["step"]}
        summary["export"] = export_dspark(model, res["frozen"], out,
                                          heldout=res["data"]["heldout"], meta=meta)
    summary["provenance"] = host.finish(prov)
    (out / "train_summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps({k: summary[k] for k in ("steps_done", "stopped_by", "train_minutes")}))
    return 0
