"""Token choice from target logits: greedy, or temperature/top-p with position-keyed RNG.

Why position-keyed: MTP verification uses *sample-and-match*. The uniform number used to
sample the token at position p depends only on (seed, session, p), never on how many
drafts were made, so MTP-on and MTP-off draw the same uniforms and emit the same tokens
(up to logit noise). For a deterministic (argmax) drafter this is also the best possible
acceptance: a draft d is accepted with probability p(d), exactly what rejection sampling
with a point-mass draft distribution gives; and every emitted token is a sample of the
target distribution at its position, so the output distribution is the target's exactly.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import numpy as np

from mtplib.errors import InputError


def _real(x: object) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool) and not math.isnan(x)


@dataclass(frozen=True)
class Sampler:
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        # a NaN temperature would pass "< 0" and turn every probability into NaN (the run
        # then emits one token forever); inf makes every token equally likely by accident
        if not _real(self.temperature) or not 0.0 <= self.temperature < math.inf:
            raise InputError(f"temperature must be a finite number >= 0, got "
                             f"{self.temperature!r}")
        if not _real(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise InputError(f"top_p must be a number in (0, 1], got {self.top_p!r}")
        # position-keyed uniforms come from numpy's SeedSequence: non-negative ints only
        if isinstance(self.seed, bool) or not isinstance(self.seed, numbers.Integral) \
                or self.seed < 0:
            raise InputError(f"seed must be an int >= 0, got {self.seed!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def probs(self, logits: np.ndarray) -> np.ndarray:
        """The target distribution after temperature and top-p (float64, sums to 1)."""
        # shift first, then scale: z <= 0 everywhere, so a tiny temperature gives -inf
        # (probability 0) instead of inf - inf = NaN
        z = logits.astype(np.float64)
        with np.errstate(over="ignore"):
            z = (z - z.max()) / self.temperature
        p = np.exp(z)
        p /= p.sum()
        if self.top_p < 1.0:
            order = np.argsort(-p, kind="stable")
            cum = np.cumsum(p[order])
            keep = order[: int(np.searchsorted(cum, self.top_p) + 1)]
            q = np.zeros_like(p)
            q[keep] = p[keep]
            p = q / q.sum()
        return p

    def uniform(self, stream: int, position: int) -> float:
        return float(np.random.default_rng([self.seed, stream, position]).random())

    def pick(self, logits: np.ndarray, *, stream: int = 0, position: int = 0) -> int:
        """The token at ``position``: argmax, or inverse-CDF with that position's uniform."""
        if self.greedy:
            return int(np.argmax(logits))
        cdf = np.cumsum(self.probs(logits))
        u = self.uniform(stream, position) * cdf[-1]
        return int(min(np.searchsorted(cdf, u, side="right"), len(cdf) - 1))
