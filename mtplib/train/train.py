"""Train the tiny DeepSeek-V4 trunk and its MTP block jointly on the stdlib's source.

``python -m mtplib.train --out DIR [--minutes M] [--seed S] [--resume] [--steps N]``

Objective (DeepSeek-V3 §2.2, one MTP depth): L = CE(trunk logits at t, x_{t+1})
+ λ·CE(MTP logits, x_{t+2}), where the MTP entry at position p = t+1 pairs token x_{t+1}
with the trunk's final hidden state h_t (before the hc head), exactly the entries upstream's
MTP context is fed. Embedding and output head are shared by trunk and MTP, as in DeepSeek;
the MTP has its own hc head and shared_head_norm. Routing of the non-hash MoE layers is
balanced without an auxiliary loss (DeepSeek-V3's bias update b += γ·sign(mean load − load)).

Seeded and resumable: the batch of step s depends only on (seed, s); a checkpoint
(model, optimizer, step, history, elapsed time) is written every ``ckpt_every`` steps and
when the time budget runs out; ``--resume`` continues from it. The LR schedule is by step
(warm-up, cosine to ``min_lr_frac``); ``--minutes`` caps the wall time of all sessions
together (the run then stops early and says so).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from mtplib import logs
from mtplib.train import data
from mtplib.train import tokenizer as tk
from mtplib.train.config import TRAINED, TrainConfig
from mtplib.train.model import V4Model

logger = logging.getLogger(__name__)  # (`log` is train's history writer)

CKPT = "checkpoint.pt"
HISTORY = "history.jsonl"


def lr_at(step: int, tc: TrainConfig) -> float:
    """Linear warm-up, then cosine down to ``min_lr_frac``; also the DSpark draft's schedule
    (`DSparkTrainConfig` has the same fields)."""
    if step < tc.warmup:
        return tc.lr * (step + 1) / tc.warmup
    frac = min(1.0, (step - tc.warmup) / max(1, tc.steps - tc.warmup))
    return tc.lr * (tc.min_lr_frac + (1 - tc.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * frac)))


def losses(model: V4Model, x: torch.Tensor):
    """x (B, T+1): trunk on x[:, :T] -> x[:, 1:]; MTP (x_p, h_{p-1}) -> x_{p+1}."""
    logits, mtp, loads = model(x[:, :-1])
    V = logits.shape[-1]
    main = F.cross_entropy(logits.reshape(-1, V), x[:, 1:].reshape(-1))
    aux = F.cross_entropy(mtp.reshape(-1, V), x[:, 2:].reshape(-1))
    return main, aux, loads, logits, mtp


@torch.no_grad()
def evaluate(model: V4Model, stream: np.ndarray, tc: TrainConfig, seed: int) -> dict:
    """Held-out loss and top-1 accuracy of trunk and MTP on fixed windows."""
    tot = {"loss": 0.0, "mtp_loss": 0.0, "acc": 0.0, "mtp_acc": 0.0}
    for i in range(tc.eval_batches):
        x = torch.from_numpy(data.batch(stream, 10**6 + i, seed, tc.batch_size, tc.seq_len + 1))
        main, aux, _, logits, mtp = losses(model, x)
        tot["loss"] += main.item()
        tot["mtp_loss"] += aux.item()
        tot["acc"] += (logits.argmax(-1) == x[:, 1:]).float().mean().item()
        tot["mtp_acc"] += (mtp.argmax(-1) == x[:, 2:]).float().mean().item()
    return {k: v / tc.eval_batches for k, v in tot.items()}


def prepare_data(out: Path) -> dict:
    """Split, tokenizer (trained on the training split) and token streams, cached in out/."""
    split = data.make_split()
    tok_path = out / "tokenizer.json"
    if tok_path.exists():
        tok = tk.load(tok_path)
    else:
        tok = tk.train_bpe(split.texts("train"), TRAINED.n_vocab)
        tok.save(str(tok_path))
    if tok.get_vocab_size() != TRAINED.n_vocab:
        raise RuntimeError(f"tokenizer has {tok.get_vocab_size()} tokens, not {TRAINED.n_vocab}")
    (out / "split.json").write_text(json.dumps(split.to_dict(), indent=1) + "\n")
    eot = tok.token_to_id(tk.EOT)
    streams = {}
    for which in ("train", "heldout"):
        docs = [tk.encode(tok, t) for t in split.texts(which)]
        streams[which] = data.token_stream(docs, eot)
    return {"split": split, "tok": tok, "train": streams["train"], "heldout": streams["heldout"]}


def plot(history: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tr = [h for h in history if h["kind"] == "train"]
    ev = [h for h in history if h["kind"] == "eval"]
    fig, ax = plt.subplots(figsize=(8, 4.5))
    ax.plot([h["step"] for h in tr], [h["loss"] for h in tr], lw=0.6, alpha=0.5,
            label="train: trunk")
    ax.plot([h["step"] for h in tr], [h["mtp_loss"] for h in tr], lw=0.6, alpha=0.5,
            label="train: MTP (token after next)")
    ax.plot([h["step"] for h in ev], [h["loss"] for h in ev], "o-", label="held-out: trunk")
    ax.plot([h["step"] for h in ev], [h["mtp_loss"] for h in ev], "s-", label="held-out: MTP")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.set_title("tiny DeepSeek-V4 + MTP on Python stdlib source")
    ax.set_ylim(0, max(8.0, min(11.0, max(h["loss"] for h in tr[:5]) + 0.5)) if tr else 11)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def save_ckpt(path: Path, model, opt, step: int, elapsed: float, tc: TrainConfig,
              seed: int) -> None:
    tmp = path.with_name(path.name + ".tmp")
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step,
                "elapsed": elapsed, "train_config": tc.to_dict(), "seed": seed}, tmp)
    os.replace(tmp, path)


def param_groups(model: V4Model, wd: float) -> list[dict]:
    decay, no_decay = [], []
    for name, p in model.params.items():
        if not p.requires_grad:
            continue
        (decay if p.dim() >= 2 and not name.endswith("_fn__weight") else no_decay).append(p)
    return [{"params": decay, "weight_decay": wd}, {"params": no_decay, "weight_decay": 0.0}]


def train(out: Path, *, minutes: float, seed: int, resume: bool, tc: TrainConfig,
          threads: int, compile_model: bool, stop_after: int | None = None) -> dict:
    """Train (or resume) in ``out``; ``stop_after`` stops like an interruption would."""
    out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(threads)
    torch.manual_seed(seed)
    t_setup = time.time()
    d = prepare_data(out)
    model = V4Model(TRAINED, seed=seed)
    opt = torch.optim.AdamW(param_groups(model, tc.weight_decay), lr=tc.lr, betas=(0.9, 0.95))
    ckpt, hist_path = out / CKPT, out / HISTORY
    step, elapsed = 0, 0.0
    history: list[dict] = []
    if resume and ckpt.exists():
        st = torch.load(ckpt, weights_only=False)
        if st["seed"] != seed or st["train_config"] != tc.to_dict():
            raise SystemExit("--resume: checkpoint was made with another seed or config")
        model.load_state_dict(st["model"])
        opt.load_state_dict(st["opt"])
        step, elapsed = st["step"], st["elapsed"]
        if hist_path.exists():
            history = [json.loads(line) for line in hist_path.read_text().splitlines()]
            history = [h for h in history if h["step"] <= step]  # drop steps not saved
    elif resume:
        logger.warning("--resume: no checkpoint in %s, starting from step 0", out)
    hist_path.write_text("".join(json.dumps(h) + "\n" for h in history))
    step_fn = torch.compile(losses) if compile_model else losses
    budget = minutes * 60.0
    n_biased = [l for l in range(TRAINED.n_blocks) if l >= TRAINED.n_hash_layers]
    from tqdm import tqdm

    bar = tqdm(total=tc.steps, initial=step, desc="train", unit="step", mininterval=5,
               file=sys.stderr)
    stopped = "steps"
    t_last = time.time()
    logger.info("setup %.1fs; train stream %d tokens, held-out %d", t_last - t_setup,
             len(d["train"]), len(d["heldout"]))

    def log(rec: dict) -> None:
        history.append(rec)
        with open(hist_path, "a") as f:
            f.write(json.dumps(rec) + "\n")

    while step < tc.steps:
        if elapsed >= budget:
            stopped = "time budget"
            break
        if stop_after is not None and step >= stop_after:
            stopped = f"stop_after {stop_after}"
            break
        for g in opt.param_groups:
            g["lr"] = lr_at(step, tc)
        x = torch.from_numpy(data.batch(d["train"], step, seed, tc.batch_size, tc.seq_len + 1))
        main, aux, loads, _, _ = step_fn(model, x)
        loss = main + tc.mtp_weight * aux
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gn = torch.nn.utils.clip_grad_norm_(model.parameters(), tc.grad_clip)
        opt.step()
        with torch.no_grad():  # auxiliary-loss-free balancing of the biased MoE layers
            for l in n_biased:
                b = model.w(f"blk.{l}.exp_probs_b.bias")
                b += tc.bias_update * torch.sign(loads[l].mean() - loads[l])
        step += 1
        now = time.time()
        elapsed += now - t_last
        t_last = now
        rec = {"kind": "train", "step": step, "loss": main.item(), "mtp_loss": aux.item(),
               "lr": lr_at(step - 1, tc), "grad_norm": float(gn), "elapsed_s": round(elapsed, 1)}
        log(rec)
        bar.update(1)
        bar.set_postfix(loss=f"{rec['loss']:.3f}", mtp=f"{rec['mtp_loss']:.3f}",
                        min=f"{elapsed / 60:.1f}")
        if step % tc.eval_every == 0 or step == tc.steps:
            ev = evaluate(model, d["heldout"], tc, seed)
            log({"kind": "eval", "step": step, **ev, "elapsed_s": round(elapsed, 1)})
            bar.write(f"step {step}: held-out loss {ev['loss']:.3f} acc {ev['acc']:.3f} | "
                      f"MTP loss {ev['mtp_loss']:.3f} acc {ev['mtp_acc']:.3f}")
            t_last = time.time()  # evaluation time is not training time
        if step % tc.ckpt_every == 0:
            save_ckpt(ckpt, model, opt, step, elapsed, tc, seed)
            t_last = time.time()
    bar.close()
    save_ckpt(ckpt, model, opt, step, elapsed, tc, seed)
    if not history or history[-1]["kind"] != "eval":
        ev = evaluate(model, d["heldout"], tc, seed)
        log({"kind": "eval", "step": step, **ev, "elapsed_s": round(elapsed, 1)})
    plot(history, out / "loss_curve.png")
    return {"model": model, "tok": d["tok"], "split": d["split"], "heldout": d["heldout"],
            "n_train_tokens": len(d["train"]),
            "step": step, "elapsed_s": elapsed, "stopped": stopped, "history": history}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m mtplib.train", description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="run directory (checkpoints, GGUFs, evidence)")
    ap.add_argument("--minutes", type=float, default=40.0, help="wall-time cap for training")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--resume", action="store_true", help="continue from DIR/checkpoint.pt")
    ap.add_argument("--steps", type=int, default=TrainConfig.steps)
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads (1 is fastest on a shared 2-core machine)")
    ap.add_argument("--compile", action="store_true",
                    help="torch.compile the training step (minutes to compile; about as fast "
                         "as eager on a loaded 2-core machine)")
    ap.add_argument("--no-export", action="store_true")
    ap.add_argument("--stop-after", type=int, help="stop (checkpointed) after this step")
    a = ap.parse_args(argv)
    logs.configure()
    tc = TrainConfig(steps=a.steps)
    out = Path(a.out)
    cmd = "python -m mtplib.train " + " ".join(argv if argv is not None else sys.argv[1:])
    res = train(out, minutes=a.minutes, seed=a.seed, resume=a.resume, tc=tc,
                threads=a.threads, compile_model=a.compile, stop_after=a.stop_after)
    summary = {"command": cmd, "seed": a.seed, "steps_done": res["step"],
               "steps_planned": tc.steps, "stopped_by": res["stopped"],
               "train_minutes": round(res["elapsed_s"] / 60, 2), "train_config": tc.to_dict(),
               "model_config": TRAINED.to_dict(), "torch": torch.__version__,
               "threads": a.threads,
               "n_params": sum(p.numel() for p in res["model"].parameters()),
               "train_tokens": res["n_train_tokens"], "heldout_tokens": len(res["heldout"])}
    last = {k: v for k, v in res["history"][-1].items() if k != "kind"}
    tr = [h for h in res["history"] if h["kind"] == "train"][-50:]
    summary["final_heldout"] = last
    summary["final_train_loss_last50"] = float(np.mean([h["loss"] for h in tr])) if tr else None
    summary["final_train_mtp_loss_last50"] = (float(np.mean([h["mtp_loss"] for h in tr]))
                                              if tr else None)
    if not a.no_export:
        from mtplib.train.export import export_all

        meta = {"mtplib.trained.command": cmd, "mtplib.trained.steps": res["step"]}
        from mtplib.train.export import parity_text

        summary["export"] = export_all(res["model"], res["tok"], out, [], meta=meta,
                                       text=parity_text(res["split"]))
    (out / "train_summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps({k: summary[k] for k in ("steps_done", "stopped_by", "train_minutes",
                                              "final_heldout")}, indent=2))
    return 0
