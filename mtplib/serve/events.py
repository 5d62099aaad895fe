"""What the worker thread sends back to a request, typed: `Started`, `Progress`,
`Tokens`, `Done` and `Failed`, with the figures (`RunMetrics`), each token's log-probabilities
(`TokenProb`) and how the generation ended (`End`).

Why dataclasses: the event loop side matches on the event's class and reads named fields,
so a change to what a worker sends fails where it is read, with its name; the figures stay
typed until the response's JSON (`mtplib.serve.native.timings`)."""

from __future__ import annotations

from dataclasses import dataclass

from mtplib.distributed.results import RangedMetrics
from mtplib.runtime.results import GenerationMetrics
from mtplib.serve.errors import ApiError


@dataclass(frozen=True)
class RunMetrics:
    """What the service reads of a generation's metrics: its times and speculative counts
    (the library's own when the generation ran to its length, else this side's clock)."""

    ttft_s: float | None
    decode_s: float
    drafted: int = 0
    accepted: int = 0
    verify_steps: int = 0
    plain_steps: int = 0
    #: step kind -> blocking round trips per step (ranged only; None: not measured)
    waits_per_step: dict[str, float] | None = None
    #: what moved that the contract forbids (ranged, only with --allow-cache-crossing)
    wire_violations: tuple[str, ...] = ()

    @classmethod
    def of(cls, m: GenerationMetrics) -> RunMetrics:
        """The figures of a finished generation (whole model or ranged)."""
        ranged = isinstance(m, RangedMetrics)
        return cls(ttft_s=m.ttft_s, decode_s=m.decode_s or 0.0, drafted=int(m.drafted or 0),
                   accepted=int(m.accepted or 0), verify_steps=int(m.verify_steps or 0),
                   plain_steps=int(m.plain_steps or 0),
                   waits_per_step=dict(m.waits_per_step) if ranged else None,
                   wire_violations=tuple(m.wire_violations or ()) if ranged else ())

    @classmethod
    def clock(cls, ttft_s: float | None, decode_s: float) -> RunMetrics:
        """A generation stopped early (end of generation, a stop string): this side's
        clock, no speculative counts."""
        return cls(ttft_s=ttft_s, decode_s=decode_s)


@dataclass(frozen=True)
class Alternative:
    """One of the most probable tokens at a position."""

    id: int
    token: str
    logprob: float


@dataclass(frozen=True)
class TokenProb:
    """An emitted token, its log-probability and the most probable tokens at its place."""

    id: int
    token: str
    logprob: float
    top: tuple[Alternative, ...] = ()


@dataclass(frozen=True)
class End:
    """How a generation ended, as llama-server reports it."""

    #: the generation reached the context's end (llama-server's truncated)
    truncated: bool
    #: "eos", "word" (a stop string) or "limit"
    stop_type: str
    #: the stop string reached ("" if none)
    stopping_word: str


@dataclass(frozen=True)
class Started:
    """The prompt was accepted: its token count (and its text for /completion)."""

    n_prompt: int
    prompt_text: str | None


@dataclass(frozen=True)
class Progress:
    """The prompt was processed (llama-server's return_progress): its tokens, and the
    milliseconds since its processing started."""

    n_prompt: int
    time_ms: float


@dataclass(frozen=True)
class Tokens:
    """Tokens emitted since the last event, their text (stop strings held back) and, when
    asked, their log-probabilities; with timings_per_token, the figures so far (this
    side's clock) over ``n_out`` tokens."""

    tokens: list[int]
    text: str
    probs: list[TokenProb]
    timings: RunMetrics | None = None
    n_out: int = 0


@dataclass(frozen=True)
class Done:
    """The generation ended: why ("length", "stop"), every token, the figures."""

    finish: str
    tokens: list[int]
    metrics: RunMetrics
    end: End


@dataclass(frozen=True)
class Failed:
    """The request failed or was refused: its response."""

    error: ApiError


Event = Started | Progress | Tokens | Done | Failed
