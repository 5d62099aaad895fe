"""Plain greedy generation (MTP off): the baseline every MTP run is compared against, on
any context (a local one or a ranged `RemoteContext`), through the engine's one loop."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from mtplib.runtime.model import Context, RuntimeInputError
from mtplib.runtime.results import GenerationMetrics


@dataclass(frozen=True)
class Generation:
    """A plain generation: its tokens, the engine's metrics and the target decodes it took."""

    tokens: list[int]
    metrics: GenerationMetrics
    #: one per token after the first, plus the prompt's chunks of n_batch
    target_decodes: int

    def summary(self) -> dict:
        """The figures a table shows (the smoke notebook's)."""
        m = self.metrics
        return {"n_prompt": m.n_prompt, "n_generated": m.n_generated, "ttft_s": m.ttft_s,
                "decode_s": m.decode_s, "decode_tok_s": m.decode_tok_s,
                "target_decodes": self.target_decodes}


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
    """Greedy decode ``n_new`` tokens after ``prompt``; one target decode per token.

    The engine's loop with no drafter (k = 0: `mtplib.runtime.speculative.run_generation`),
    so plain decoding is written once, for this baseline and for MTP off. The sequence is
    freed afterwards (the engine closes its session)."""
    from mtplib.runtime.drafters import Drafter
    from mtplib.runtime.engine import Engine
    from mtplib.runtime.generation import run_generation

    check_budget(ctx, len(prompt), n_new)
    # plain steps never roll back: no state checkpoints to save (a ranged context's
    # state never moves)
    engine = Engine(ctx, Drafter(), k=0, checkpoints="replay")
    tokens, m = run_generation(engine, prompt, n_new, seq_id=seq_id)
    prefills = (len(prompt) + ctx.n_batch - 1) // ctx.n_batch if tokens else 0
    return Generation(tokens, m, max(len(tokens) - 1, 0) + prefills)


def run_greedy(model_path: str, prompt: Sequence[int], n_new: int, *, n_ctx: int = 2048,
               n_threads: int = 2, **cfg) -> Generation:
    """Load, decode greedily, free: the one-call form used by notebooks and tests."""
    from mtplib.runtime.model import ContextConfig, Model

    with Model(model_path) as model, Context(
            model, ContextConfig(n_ctx=n_ctx, n_threads=n_threads, **cfg)) as ctx:
        return greedy(ctx, prompt, n_new)
