"""Plain greedy generation (MTP off): the baseline every MTP run is compared against."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from mtplib.runtime.model import Context, RuntimeInputError


@dataclass
class Generation:
    tokens: list[int]
    metrics: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        return {"tokens": self.tokens, "metrics": self.metrics}


def check_budget(ctx: Context, n_prompt: int, n_new: int) -> None:
    """Refuse a prompt + generation that cannot fit the context, before any decode."""
    if n_prompt < 1:
        raise RuntimeInputError("the prompt is empty: give at least one token")
    if n_new < 0:
        raise RuntimeInputError(f"--n must be >= 0, got {n_new}")
    if n_prompt + n_new > ctx.n_ctx:
        raise RuntimeInputError(
            f"prompt ({n_prompt} tokens) + {n_new} new tokens exceed the context of "
            f"{ctx.n_ctx} tokens; shorten the prompt, lower --n or raise --ctx")


def prefill(ctx: Context, tokens: Sequence[int], *, seq_id: int = 0, start: int = 0,
            want_rows: bool = False) -> tuple[np.ndarray, np.ndarray | None]:
    """Decode ``tokens`` in chunks of n_batch; return the last logits (and all nextn rows)."""
    rows = []
    n = len(tokens)
    for a in range(0, n, ctx.n_batch):
        chunk = list(tokens[a : a + ctx.n_batch])
        last = a + len(chunk) == n
        flags = [False] * (len(chunk) - 1) + [last]
        ctx.decode(chunk, range(start + a, start + a + len(chunk)), seq_id=seq_id, logits=flags)
        if want_rows:
            rows.append(ctx.nextn_rows(len(chunk)))
    return ctx.logits(-1), (np.concatenate(rows) if want_rows else None)


def greedy(ctx: Context, prompt: Sequence[int], n_new: int, *, seq_id: int = 0) -> Generation:
    """Greedy decode ``n_new`` tokens after ``prompt``; one target decode per token."""
    check_budget(ctx, len(prompt), n_new)
    t0 = time.perf_counter()
    logits, _ = prefill(ctx, prompt, seq_id=seq_id)
    out: list[int] = []
    t_first = None
    pos = len(prompt)
    while len(out) < n_new:
        tok = int(np.argmax(logits))
        out.append(tok)
        if t_first is None:
            t_first = time.perf_counter()
        if len(out) == n_new:
            break
        ctx.decode([tok], [pos], seq_id=seq_id, logits=True)
        pos += 1
        logits = ctx.logits(-1)
    t1 = time.perf_counter()
    n_dec = max(len(out) - 1, 0)
    metrics = {
        "n_prompt": len(prompt),
        "n_generated": len(out),
        "ttft_s": (t_first - t0) if t_first else None,
        "decode_s": (t1 - t_first) if t_first else 0.0,
        "decode_tok_s": (n_dec / (t1 - t_first)) if t_first and t1 > t_first else None,
        "target_decodes": n_dec + (len(prompt) + ctx.n_batch - 1) // ctx.n_batch,
    }
    return Generation(out, metrics)


def run_greedy(model_path: str, prompt: Sequence[int], n_new: int, *, n_ctx: int = 2048,
               n_threads: int = 2, **cfg) -> Generation:
    """Load, decode greedily, free: the one-call form used by notebooks and tests."""
    from mtplib.runtime.model import ContextConfig, Model

    with Model(model_path) as model, Context(
            model, ContextConfig(n_ctx=n_ctx, n_threads=n_threads, **cfg)) as ctx:
        return greedy(ctx, prompt, n_new)
