"""What one generation counts: drafted / accepted per position, steps, rollbacks, time.

Counted in one place for every loop that verifies drafts (the engine's `Metrics`, the
llama_cpp adapter's `DraftStats`); split from `mtplib.runtime.speculative` (which still
exports both) so the counting is apart from the loop that counts.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from mtplib.contract.labels import TIME_PARTS
from mtplib.runtime.results import GenerationMetrics


@dataclass
class DraftCounts:
    """Drafted / accepted counts of one run, per draft position and by accepted length:
    counted in one place for every loop that verifies drafts (the engine's `Metrics`, the
    llama_cpp adapter's `DraftStats`)."""

    k: int
    drafted: int = 0
    accepted: int = 0
    drafted_per_position: list[int] = field(default_factory=list)
    accepted_per_position_n: list[int] = field(default_factory=list)
    accept_len_hist: Counter = field(default_factory=Counter)

    def __post_init__(self) -> None:
        self.drafted_per_position = [0] * self.k
        self.accepted_per_position_n = [0] * self.k

    def count(self, n_drafted: int, n_accepted: int) -> None:
        """One verification: ``n_accepted`` of ``n_drafted`` drafts kept (a prefix)."""
        self.drafted += n_drafted
        self.accepted += n_accepted
        self.accept_len_hist[n_accepted] += 1
        for i in range(n_drafted):
            self.drafted_per_position[i] += 1
            self.accepted_per_position_n[i] += i < n_accepted

    @property
    def acceptance_rate(self) -> float | None:
        return self.accepted / self.drafted if self.drafted else None

    @property
    def accepted_per_position(self) -> list[float | None]:
        """P(draft i accepted) per draft position i."""
        return [a / d if d else None for a, d in
                zip(self.accepted_per_position_n, self.drafted_per_position, strict=True)]

    def counts_dict(self) -> dict:
        return {
            "drafted": self.drafted,
            "accepted": self.accepted,
            "acceptance_rate": self.acceptance_rate,
            "accepted_per_position": self.accepted_per_position,
            "accepted_per_position_counts": list(self.accepted_per_position_n),
            "drafted_per_position": list(self.drafted_per_position),
            "accept_len_hist": {str(i): self.accept_len_hist.get(i, 0)
                                for i in range(self.k + 1)},
        }


@dataclass
class Metrics(DraftCounts):
    verify_steps: int = 0
    plain_steps: int = 0
    rollbacks: Counter = field(default_factory=Counter)
    t_prefill: float = 0.0
    t_draft: float = 0.0
    t_verify: float = 0.0
    t_feed: float = 0.0
    t_rollback: float = 0.0
    t_start: float = 0.0
    t_first: float | None = None
    t_end: float = 0.0
    n_prompt: int = 0
    n_generated: int = 0

    def result(self, **extra) -> GenerationMetrics:
        """What the generation measured, typed; ``extra``: what the caller adds (the row
        source, memory, the trace)."""
        dec = self.t_end - self.t_first if self.t_first else 0.0
        n_dec = max(self.n_generated - 1, 0)
        return GenerationMetrics(
            k=self.k, n_prompt=self.n_prompt, n_generated=self.n_generated,
            **self.counts_dict(), verify_steps=self.verify_steps, plain_steps=self.plain_steps,
            rollbacks=dict(self.rollbacks),
            ttft_s=(self.t_first - self.t_start) if self.t_first else None,
            decode_s=dec, decode_tok_s=n_dec / dec if dec > 0 else None,
            time_s=dict(zip(TIME_PARTS, (self.t_prefill, self.t_draft, self.t_verify,
                                         self.t_feed, self.t_rollback), strict=True)),
            **extra)
