"""The draft's training and held-out text: the trunk's own greedy continuations.

A draft block is accepted while its tokens equal what the target decodes greedily, so the
draft learns from exactly that (self-distillation, as DFlash and EAGLE train on their
target's generations): prompts of ``prompt_len`` tokens of the stdlib source, continued
for ``n_new`` tokens by the committed trunk through upstream (the runtime's plain greedy
loop with its default context settings, the ones the acceptance measurement uses).

* training prompts: seeded windows of the *training* split's modules (mtplib.train.data);
* held-out prompts: `mtplib.lab.trained_eval.prompts_from` over the held-out modules with
  seed 0, the first 32 of which are the prompts the MTP acceptance of
  evidence/trained-v4/ was measured on.

Both are tokenized by upstream's tokenizer (the training tokenizer gives the same ids).
The result is cached as one .npz in the run directory.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import numpy as np

from mtplib.train.dspark.config import DSparkTrainConfig

log = logging.getLogger(__name__)
DATA_NAME = "distill.npz"
HELDOUT_SEED = 0  # trained_eval's prompt seed
TRAIN_SEED = 1


def continue_greedily(trunk: str | Path, prompts: list[list[int]], n_new: int, *,
                      n_threads: int = 1) -> np.ndarray:
    """(N, len(prompt) + n_new) int32: each prompt followed by the trunk's greedy tokens."""
    from mtplib.runtime.generate import greedy
    from mtplib.runtime.model import Context, ContextConfig, Model

    n_ctx = max(256, -(-(max(len(p) for p in prompts) + n_new) // 256) * 256)
    out = []
    t0 = time.perf_counter()
    with Model(trunk) as m, Context(m, ContextConfig(n_ctx=n_ctx, n_threads=n_threads)) as ctx:
        for i, p in enumerate(prompts):
            g = greedy(ctx, p, n_new)
            out.append(list(p) + list(g.tokens))
            if (i + 1) % 256 == 0:
                log.info("continued %d/%d prompts (%.0f s)", i + 1, len(prompts),
                         time.perf_counter() - t0)
    return np.asarray(out, dtype=np.int32)


def continue_batched(trunk: str | Path, prompts: list[list[int]], n_new: int, *,
                     n_seq: int = 8, n_threads: int = 1) -> np.ndarray:
    """As `continue_greedily`, ``n_seq`` sequences per decode (each its own sequence id):
    the same greedy rule, many times faster on this tiny trunk, whose decode cost is
    mostly per graph. Batching changes the matmul shapes, so a near-tie may break the
    other way than in a one-sequence decode."""
    from mtplib.runtime.model import Context, ContextConfig, Model

    L = max(len(p) for p in prompts) + n_new
    n_ctx_seq = max(256, -(-L // 256) * 256)
    out: list[list[int]] = []
    t0 = time.perf_counter()
    cfg = ContextConfig(n_ctx=n_ctx_seq * n_seq, n_seq_max=n_seq, n_threads=n_threads)
    with Model(trunk) as m, Context(m, cfg) as ctx:
        for g0 in range(0, len(prompts), n_seq):
            group = prompts[g0:g0 + n_seq]
            ctx.clear()
            seqs = [list(p) for p in group]
            last = []
            for q, p in enumerate(group):
                ctx.decode(list(p), range(len(p)), seq_id=q,
                           logits=[False] * (len(p) - 1) + [True])
                last.append(int(np.argmax(ctx.logits(-1))))
            for step in range(n_new):
                for q in range(len(group)):
                    seqs[q].append(last[q])
                if step == n_new - 1:
                    break
                pos = [len(s) - 1 for s in seqs]
                ctx.decode(last, pos, seq_id=list(range(len(group))), logits=True)
                last = [int(np.argmax(r)) for r in ctx.logits_all(len(group))]
            out += seqs
            if (g0 // n_seq + 1) % 16 == 0:
                log.info("continued %d/%d prompts (%.0f s)", g0 + len(group), len(prompts),
                         time.perf_counter() - t0)
    return np.asarray(out, dtype=np.int32)


def training_docs(trunk: str | Path) -> list[list[int]]:
    from mtplib.runtime.model import Model
    from mtplib.train import data

    split = data.make_split()
    with Model(trunk) as m:
        return [m.tokenize(t) for t in split.texts("train")]


def make_distill(trunk: str | Path, out: Path, tc: DSparkTrainConfig, *,
                 n_threads: int = 1) -> dict:
    """Generate (or load the cached) training and held-out sequences."""
    from mtplib.lab.trained_eval import heldout_modules, heldout_tokens, prompts_from

    path = out / DATA_NAME
    want = (tc.prompts_train, tc.prompts_heldout, tc.prompt_len, tc.n_new)
    if path.exists():
        z = np.load(path)
        if tuple(int(v) for v in z["shape_key"]) == want:
            return {"train": z["train"], "heldout": z["heldout"],
                    "seconds": float(z["seconds"]), "cached": True,
                    "heldout_modules": [str(s) for s in z["heldout_modules"]]}
        log.warning("%s was made with other settings: regenerating", path)
    t0 = time.perf_counter()
    mods = heldout_modules(Path(trunk).parent / "split.json")
    if not all(m["sha256_ok"] for m in mods):
        raise RuntimeError("held-out modules differ from split.json's sha256s")
    held_docs = heldout_tokens(trunk, mods)
    held = prompts_from(held_docs, n=tc.prompts_heldout, length=tc.prompt_len,
                        seed=HELDOUT_SEED)
    train = prompts_from(training_docs(trunk), n=tc.prompts_train, length=tc.prompt_len,
                         seed=TRAIN_SEED)
    h = continue_greedily(trunk, held, tc.n_new, n_threads=n_threads)
    t = continue_batched(trunk, train, tc.n_new, n_threads=n_threads)
    secs = time.perf_counter() - t0
    names = [m["module"] for m in mods]
    tmp = path.with_name(path.name + ".tmp.npz")
    np.savez_compressed(tmp, train=t, heldout=h, seconds=secs, shape_key=np.asarray(want),
                        heldout_modules=np.asarray(names))
    tmp.replace(path)
    return {"train": t, "heldout": h, "seconds": secs, "cached": False,
            "heldout_modules": names}
