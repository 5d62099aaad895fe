"""Token choice from target logits: greedy, or temperature/top-k/top-p/min-p with
position-keyed RNG; llama.cpp's repetition penalties and logit biases on the logits first.

Why position-keyed: MTP verification uses *sample-and-match*. The uniform number used to
sample the token at position p depends only on (seed, session, p), never on how many
drafts were made, so MTP-on and MTP-off draw the same uniforms and emit the same tokens
(up to logit noise). For a deterministic (argmax) drafter this is also the best possible
acceptance: a draft d is accepted with probability p(d), exactly what rejection sampling
with a point-mass draft distribution gives; and every emitted token is a sample of the
target distribution at its position, so the output distribution is the target's exactly.

Why the penalties stay exact: they are a function of the history before the position
(prompt + emitted tokens, the last ``repeat_last_n`` of them). The verify step knows that
history for every window position (the committed tokens, then the drafts before it, which
are the history exactly when the position's pick is used), so it passes it to `pick` and
MTP on and off see the same adjusted logits. top-k, top-p and min-p are pure filters of
one position's distribution.

Why a grammar stays exact (`mtplib.runtime.grammar`): it is a filter of one position's
distribution given the history, like the penalties: the verify passes each window
position the grammar state after the committed tokens and the drafts before it, and the
forbidden tokens' logits become -inf before temperature and the position's draw (greedy:
the argmax of what is allowed).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from mtplib.errors import InputError
from mtplib.runtime.structured import GrammarSpec


class Constraint(Protocol):
    """Which tokens may come next at one position (a grammar state: `Grammar`)."""

    def allows(self, token: int) -> bool: ...

    def allowed_among(self, ids: Sequence[int]) -> np.ndarray: ...

    def allowed(self) -> np.ndarray: ...


#: a greedy pick whose argmax the grammar forbids checks this many best tokens (ties at
#: the last one included, up to `GREEDY_CAP`) before the whole vocabulary
GREEDY_CANDIDATES = 64
GREEDY_CAP = 256


def _real(x: object) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool) and not math.isnan(x)


def _int(x: object) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


@dataclass(frozen=True)
class Sampler:
    """The order (llama.cpp's penalties first, then mtplib's fixed chain): logit bias,
    repetition penalties (repeat, frequency, presence) over the last ``repeat_last_n``
    tokens of the history, temperature, top-k, top-p, min-p. Defaults are off; temperature
    0 is the argmax of the (biased, penalized) logits."""

    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    #: keep the k most probable tokens (0: off)
    top_k: int = 0
    #: keep tokens whose probability is >= min_p x the top one's (0: off)
    min_p: float = 0.0
    #: llama.cpp's: a seen token's logit divided by it (positive) or multiplied (negative)
    repeat_penalty: float = 1.0
    #: the window the penalties count in (-1: the whole history; 0: penalties off)
    repeat_last_n: int = 64
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    #: (token id, bias) added to the logits; -inf bans a token
    logit_bias: tuple[tuple[int, float], ...] = ()
    #: report each emitted token's log-probability and the n most probable tokens at its
    #: position (`TokenLogprob`, on the step's `Emitted` tokens); None: off. A number, not
    #: a callback: a ranged sampler is pickled to the worker, and what comes back is the
    #: records, computed there (a position picked again after a rejected window is
    #: reported from its last pick, the emitted token's)
    logprobs: int | None = None
    #: called as observe(position, logits) at every pick (the raw target logits), in this
    #: process only (a probe for tests: a callback cannot cross to a ranged worker, so such
    #: a sampler refuses to be pickled); a position picked again (a rejected window
    #: re-verified) is observed again, the last call being the emitted token's
    observe: Callable[[int, np.ndarray], None] | None = field(default=None, compare=False,
                                                              repr=False)
    #: structured output: the target's picks are constrained to this grammar's language
    #: (each session builds its own grammar state from it: `mtplib.runtime.grammar`)
    grammar: GrammarSpec | None = None
    #: with ``logprobs``: report the distribution the token was drawn from (after the bias,
    #: penalties, grammar, temperature and filters: `post_logprobs`) instead of the raw
    #: one, as llama-server's post_sampling_probs does
    post_sampling_probs: bool = False

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
        if not _int(self.top_k) or self.top_k < 0:
            raise InputError(f"top_k must be an int >= 0 (0: off), got {self.top_k!r}")
        if not _real(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise InputError(f"min_p must be a number in [0, 1], got {self.min_p!r}")
        if not _real(self.repeat_penalty) or not 0.0 < self.repeat_penalty < math.inf:
            raise InputError(f"repeat_penalty must be a finite number > 0, got "
                             f"{self.repeat_penalty!r}")
        if not _int(self.repeat_last_n) or self.repeat_last_n < -1:
            raise InputError(f"repeat_last_n must be an int >= -1, got {self.repeat_last_n!r}")
        for name in ("frequency_penalty", "presence_penalty"):
            v = getattr(self, name)
            if not _real(v) or not -2.0 <= v <= 2.0:
                raise InputError(f"{name} must be a number in [-2, 2], got {v!r}")
        for tok, bias in self.logit_bias:
            if not _int(tok) or tok < 0:
                raise InputError(f"logit_bias: token id must be an int >= 0, got {tok!r}")
            if not _real(bias) or bias == math.inf:
                raise InputError(f"logit_bias: bias of token {tok} must be a number "
                                 f"(or -inf to ban it), got {bias!r}")
        if self.logprobs is not None and (not _int(self.logprobs) or self.logprobs < 0):
            raise InputError(f"logprobs must be an int >= 0 (None: off), got "
                             f"{self.logprobs!r}")
        if self.grammar is not None and not isinstance(self.grammar, GrammarSpec):
            raise InputError(f"grammar must be a GrammarSpec (None: off), got "
                             f"{type(self.grammar).__name__}")

    def __getstate__(self) -> dict:
        """Refused with ``observe``: the callback would run in the worker, never here."""
        if self.observe is not None:
            raise InputError("a Sampler with observe (a callback of this process) cannot "
                             "be sent to another process; ask logprobs=n instead")
        return dict(self.__dict__)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalized(self) -> bool:
        """Whether a pick depends on the history (then `pick` needs it)."""
        return self.repeat_last_n != 0 and (
            self.repeat_penalty != 1.0 or self.frequency_penalty != 0.0
            or self.presence_penalty != 0.0)

    def adjust(self, logits: np.ndarray, history: Sequence[int] | None = None) -> np.ndarray:
        """The logits after the bias and the penalties (float64; the input if neither)."""
        if not self.logit_bias and not self.penalized:
            return logits
        z = logits.astype(np.float64)  # a copy
        for tok, bias in self.logit_bias:
            if tok < len(z):
                z[tok] += bias
        if self.penalized:
            if history is None:
                raise InputError("repetition penalties need the history of the position")
            window = history if self.repeat_last_n == -1 else history[-self.repeat_last_n:]
            ids, counts = np.unique(np.asarray(window, dtype=np.int64), return_counts=True)
            keep = (ids >= 0) & (ids < len(z))
            ids, counts = ids[keep], counts[keep]
            v = z[ids]
            v = np.where(v > 0, v / self.repeat_penalty, v * self.repeat_penalty)
            z[ids] = v - counts * self.frequency_penalty - self.presence_penalty
        return z

    def probs(self, logits: np.ndarray, history: Sequence[int] | None = None, *,
              allowed: np.ndarray | None = None) -> np.ndarray:
        """The target distribution after the bias, penalties, the grammar's ``allowed``
        mask, temperature, top-k, top-p and min-p (float64, sums to 1)."""
        # shift first, then scale: z <= 0 everywhere, so a tiny temperature gives -inf
        # (probability 0) instead of inf - inf = NaN
        z = np.asarray(self.adjust(logits, history), dtype=np.float64)
        if allowed is not None:
            z = masked(z, allowed)
        with np.errstate(over="ignore"):
            z = (z - z.max()) / self.temperature
        p = np.exp(z)
        p /= p.sum()
        if 0 < self.top_k < len(p):
            # ties at the k-th probability: the lower token ids (a stable order), as top-p
            order = np.argsort(-p, kind="stable")
            q = np.zeros_like(p)
            q[order[: self.top_k]] = p[order[: self.top_k]]
            p = q / q.sum()
        if self.top_p < 1.0:
            order = np.argsort(-p, kind="stable")
            cum = np.cumsum(p[order])
            keep = order[: int(np.searchsorted(cum, self.top_p) + 1)]
            q = np.zeros_like(p)
            q[keep] = p[keep]
            p = q / q.sum()
        if self.min_p > 0.0:
            p = np.where(p >= self.min_p * p.max(), p, 0.0)
            p /= p.sum()
        return p

    def post_logprobs(self, logits: np.ndarray, token: int,
                      history: Sequence[int] | None = None,
                      constraint: Constraint | None = None) -> np.ndarray:
        """The log of the distribution ``token`` was drawn from at its position (-inf where
        the chain left nothing): `probs`, or greedy's certainty (the picked token 0, the
        rest -inf, as llama.cpp's temperature 0 leaves one candidate)."""
        if self.greedy:
            out = np.full(len(logits), -np.inf)
            out[token] = 0.0
            return out
        allowed = None if constraint is None else constraint.allowed()
        with np.errstate(divide="ignore"):
            return np.log(self.probs(logits, history, allowed=allowed))

    def uniform(self, stream: int, position: int) -> float:
        return float(np.random.default_rng([self.seed, stream, position]).random())

    def pick(self, logits: np.ndarray, *, stream: int = 0, position: int = 0,
             history: Sequence[int] | None = None,
             constraint: Constraint | None = None) -> int:
        """The token at ``position``: argmax, or inverse-CDF with that position's uniform.
        ``history``: the tokens before ``position`` (needed when `penalized`);
        ``constraint``: the grammar state there (tokens it forbids are never picked)."""
        if self.observe is not None:
            self.observe(position, logits)
        if self.greedy:
            z = self.adjust(logits, history)
            tok = int(np.argmax(z))
            # the argmax of the allowed tokens is the argmax itself when allowed (ties
            # included: a lower id with the same logit would have been the argmax)
            if constraint is None or constraint.allows(tok):
                return tok
            return constrained_argmax(z, constraint)
        allowed = None if constraint is None else constraint.allowed()
        probs = self.probs(logits, history, allowed=allowed)
        cdf = np.cumsum(probs)
        u = self.uniform(stream, position) * cdf[-1]
        i = int(np.searchsorted(cdf, u, side="right"))  # cdf[i] > u >= cdf[i-1]: p_i > 0
        # u rounded up to cdf[-1] (a uniform within 2^-53 of 1): the last token with mass,
        # never a trailing token the bias, the filters or a grammar left at 0
        return i if i < len(cdf) else int(np.flatnonzero(probs)[-1])


def constrained_argmax(z: np.ndarray, constraint: Constraint) -> int:
    """The argmax of ``z`` among the tokens ``constraint`` allows (ties: the lowest id),
    as the masked argmax gives it: the best allowed token among the ``GREEDY_CANDIDATES``
    highest (every token with the last one's value included) is that argmax, since every
    other token is lower; none allowed there: the whole vocabulary's mask."""
    n = min(GREEDY_CANDIDATES, len(z))
    kth = np.partition(z, len(z) - n)[len(z) - n]
    cand = np.flatnonzero(z >= kth)  # ascending ids
    if len(cand) <= GREEDY_CAP and np.isfinite(kth):
        cand = cand[np.argsort(-z[cand], kind="stable")]  # by value, ties by lower id
        ok = np.flatnonzero(constraint.allowed_among(cand))
        if len(ok):
            return int(cand[ok[0]])
    return int(np.argmax(masked(z, constraint.allowed())))


def masked(z: np.ndarray, allowed: np.ndarray) -> np.ndarray:
    """``z`` with the tokens a grammar forbids at -inf; refused when nothing is left."""
    if len(allowed) != len(z):
        raise InputError(f"grammar mask of {len(allowed)} tokens for {len(z)} logits")
    out = np.where(allowed, z, -np.inf)
    if not np.isfinite(out).any():
        raise InputError("the grammar allows no token here that the logits (and the logit "
                         "bias) leave possible")
    return out


@dataclass(frozen=True)
class TokenLogprob:
    """An emitted token's log-probability and the n most probable tokens at its position,
    of the target's raw distribution (`top_logprobs`): what a response's logprobs list.
    Plain numbers: a ranged worker sends these back with the tokens, not a logits row."""

    token: int
    logprob: float
    #: (token id, log-probability) of the n most probable tokens, most probable first
    top: tuple[tuple[int, float], ...] = ()


def token_logprob(logits: np.ndarray, token: int, n: int) -> TokenLogprob:
    """``token``'s record from the raw logits of its position, with the top ``n``."""
    lp = log_softmax(logits)
    ids = _top_ids(lp, n)
    return TokenLogprob(int(token), float(lp[token]),
                        tuple((int(i), float(lp[i])) for i in ids))


def top_logprobs(logits: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
    """(ids, log-probabilities) of the n most probable tokens of the raw logits' softmax
    (temperature 1, no filter: the model's own distribution), most probable first."""
    lp = log_softmax(logits)
    ids = _top_ids(lp, n)
    return ids, lp[ids]


def _top_ids(lp: np.ndarray, n: int) -> np.ndarray:
    """The n largest, most first, ties by lower id (a stable sort's order); a partition
    first: per emitted token, a full sort of a 129k vocabulary took ~23 ms, this ~0.5."""
    n = max(0, min(n, len(lp)))
    if n == 0:
        return np.zeros(0, dtype=np.int64)
    cand = np.arange(len(lp))
    if n < len(lp):
        kth = np.partition(lp, len(lp) - n)[len(lp) - n]  # the n-th largest value
        cand = np.flatnonzero(lp >= kth)  # ascending ids, so ties keep the lower first
    return cand[np.argsort(-lp[cand], kind="stable")[:n]]


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """Log-probabilities of the raw logits (float64, shifted: no overflow)."""
    z = logits.astype(np.float64)
    z -= z.max()
    return z - np.log(np.exp(z).sum())
