"""The one generation loop over an `Engine` (`generation_steps`; `run_generation` and
`Generation` around it) and `warm_up`, which runs every graph shape once at load. Split
from `mtplib.runtime.speculative`, which still exports every name.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace

from mtplib.runtime.engine import Engine
from mtplib.runtime.grammar import grammar_end
from mtplib.runtime.model import RuntimeInputError, check_n_new, check_tokens
from mtplib.runtime.results import GenerationMetrics
from mtplib.runtime.sampling import Sampler
from mtplib.runtime.spec_metrics import Metrics


def expected_verify_steps(n_new: int, k: int) -> int:
    """With 100% acceptance: the first token comes from the prefill, then k+1 per step."""
    return math.ceil((n_new - 1) / (k + 1)) if n_new > 1 else 0


def check_request(engine: Engine, prompt: Sequence[int], n_new: int, *,
                  per: str = "") -> tuple[list[int], int]:
    """A generation's prompt and length, checked against ``engine``'s target before
    upstream sees them (one sequence, or one slot of a batch: ``per`` names it in the
    context message)."""
    n_new = check_n_new(n_new)
    prompt = check_tokens(prompt, engine.target.n_vocab)
    if not prompt:
        raise RuntimeInputError("the prompt is empty: give at least one token")
    if len(prompt) + n_new > engine.target.n_ctx:
        raise RuntimeInputError(
            f"prompt ({len(prompt)} tokens) + {n_new} new tokens exceed the context "
            f"of {engine.target.n_ctx} tokens{per}; shorten the prompt or lower --n")
    return prompt, n_new


def generation_steps(engine: Engine, prompt: Sequence[int], n_new: int, *,
                     seq_id: int | None = None, memory: Callable[[int], dict] | None = None,
                     result: dict | None = None) -> Iterator[list[int]]:
    """The one generation loop: open a session, yield the tokens each step emits (the first
    from the prefill; an `Emitted`, with log-probabilities when the sampler asks), then
    put ``"tokens"`` and ``"metrics"`` (and the trace) into ``result`` and close the
    session. Closing the iterator early closes the session too. ``n_new`` 0 generates
    nothing (no decode at all). Under a grammar the response ends with the first EOG it
    allows (the grammar is complete): tokens after it in that step are not emitted."""
    prompt, n_new = check_request(engine, prompt, n_new)
    if n_new == 0:  # the prefill would emit a first token: decode nothing instead
        metrics = empty_metrics(engine, len(prompt), memory, 0 if seq_id is None else seq_id)
        if result is not None:
            result["tokens"], result["metrics"] = [], metrics
        return
    s = engine.open(prompt, seq_id=seq_id)
    try:
        yield s.emitted  # the prefill's first token (an `Emitted`, as every step's)
        while s.metrics.n_generated < n_new and grammar_end(s) is None:
            before = s.metrics.n_generated
            out = s.step(min(engine.k, n_new - before - 1))
            end = grammar_end(s)
            yield out if end is None else out[: end - before]
        end = grammar_end(s)
        if end is not None:  # the response ended at its EOG: what followed is dropped
            s.metrics.n_generated = end
        metrics = session_metrics(engine, s, memory)
        if result is not None:
            result["tokens"] = s.tokens[s.metrics.n_prompt:][:s.metrics.n_generated]
            result["metrics"] = metrics
    finally:
        engine.close(s)


def session_metrics(engine: Engine, s, memory: Callable[[int], dict] | None = None
                    ) -> GenerationMetrics:
    """A finished session's metrics (ends its clock), as a generation reports them."""
    s.metrics.t_end = time.perf_counter()
    traced = s.trace is not None
    n_prompt = s.metrics.n_prompt
    return s.metrics.result(
        hidden_rows=engine.hidden_rows,
        # forced acceptance: the speed counts, the tokens do not
        synthetic=bool(getattr(engine.drafter, "synthetic", False)),
        memory=None if memory is None else memory(s.seq),
        steps=s.trace if traced else None,
        margins={str(p): m for p, m in sorted(s.margins.items()) if p >= n_prompt}
        if traced else None)


def empty_metrics(engine: Engine, n_prompt: int, memory: Callable[[int], dict] | None = None,
                  seq: int = 0) -> GenerationMetrics:
    """The metrics of a generation of 0 tokens (nothing decoded)."""
    m = Metrics(k=engine.k)
    m.n_prompt = n_prompt
    return m.result(hidden_rows=engine.hidden_rows,
                    memory=None if memory is None else memory(seq))


def run_generation(engine: Engine, prompt: Sequence[int], n_new: int, *,
                   seq_id: int | None = None, memory: Callable[[int], dict] | None = None
                   ) -> tuple[list[int], GenerationMetrics]:
    """Open a session, generate, report metrics (and the trace), close the session."""
    out: dict = {}
    for _ in generation_steps(engine, prompt, n_new, seq_id=seq_id, memory=memory, result=out):
        pass
    return out["tokens"], out["metrics"]


class Generation:
    """One generation as it happens: iterating yields the tokens each step emits (the first
    one from the prefill); afterwards ``tokens`` and ``metrics`` hold what `generate` would
    have returned. `close` (or leaving a ``with`` block) ends it early and frees its
    sequence; the object that made it serves the next generation only after that."""

    def __init__(self, steps: Iterator[list[int]], result: dict) -> None:
        self._steps, self._result = steps, result
        self.done = False

    def __iter__(self) -> Iterator[list[int]]:
        try:
            yield from self._steps
            self.done = True
        finally:
            self.close()

    @property
    def tokens(self) -> list[int]:
        return self._require("tokens")

    @property
    def metrics(self) -> GenerationMetrics:
        return self._require("metrics")

    def _require(self, key: str):
        if key not in self._result:
            raise RuntimeInputError(f"the generation has not finished: {key} is known once "
                                    "every step has been read")
        return self._result[key]

    def close(self) -> None:
        close = getattr(self._steps, "close", None)
        if close is not None:
            close()

    def __enter__(self) -> Generation:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def unconstrained(sampler: Sampler) -> Sampler | None:
    """``sampler`` without its grammar (None: the engine's, when it has none)."""
    return None if sampler.grammar is None else replace(sampler, grammar=None)


def warm_up(engine: Engine, *, n_prompt: int = 8) -> dict:
    """Run every graph shape a generation decodes once, on a throwaway sequence: the plain
    step (1 token), each verify width 2..k+1, each feed width 1..k+1, the drafts, rollbacks.

    Why: upstream's RPC client asks a shard for the allocation size of every new matmul /
    attention shape (a blocking round trip each, cached process-wide) and its scheduler
    reallocates compute buffers on first use; a fresh process paid that inside its first
    verify steps (up to 8.5 waits per verify step instead of 3 over a WAN). Paid here, at
    load, it is setup time apart from TTFT. The prompt's width is not among them (a
    caller's prompt is unknown at load; this prefill is ``n_prompt`` tokens): the first
    prefill of each other width in a process asks those queries inside its prefill step
    (ranged: a CPU shard's are answered by the client's relay, no round trip; a GPU shard's
    cost one each, counted as GET_ALLOC_SIZE in the step's waits_by_command). Returns
    {"setup_s", "widths"}."""
    t0 = time.perf_counter()
    k, target = engine.k, engine.target
    n_prompt = max(1, min(n_prompt, target.n_ctx - (k + 2) * (k + 3)))
    prompt = [1 % target.n_vocab] * n_prompt
    widths: list[int] = []
    # every shape with forced acceptance: no grammar (it would cut the forced drafts)
    s = engine.open(prompt, sampler=unconstrained(engine.sampler))
    try:
        plan = [(k, n) for n in range(k + 1)]  # verify k+1, feed n+1 for every n accepted
        plan += [(kk, 0) for kk in range(1, k)] + [(0, 0)]  # verify widths 2..k, plain
        for kk, n_acc in plan:
            if s.base + kk + 1 >= target.n_ctx:
                break
            engine.forced_accept = (lambda _p, d, n=n_acc: min(n, len(d))) if kk else None
            s.step(kk)
            widths.append(kk + 1)
    finally:
        engine.forced_accept = None
        engine.close(s)
    return {"setup_s": time.perf_counter() - t0, "widths": sorted(set(widths))}
