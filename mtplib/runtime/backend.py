"""What a generation backend offers: the interface `MTPRuntime` (whole model) and
`RangedMTP` (layer-range shards) share, and which serve types against.

Declared once here so a third backend (or a change to one) is checked against the same
list: `tests/test_backend_protocol.py` compares both classes with it. The fault part is
separate: only a backend with shards can lose one.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

from mtplib.runtime.generation import Generation
from mtplib.runtime.sampling import Sampler


@runtime_checkable
class Backend(Protocol):
    """A loaded model that generates: tokenizer, one generation at a time (`stream`,
    `generate`), continuous batching (`batch`), and `close`."""

    @property
    def n_ctx(self) -> int:
        """Positions one sequence may hold."""
        ...

    def tokenize(self, text: str) -> list[int]: ...

    def detokenize(self, tokens: Sequence[int]) -> str: ...

    def stream(self, prompt: Sequence[int], n_new: int, *,
               sampler: Sampler | None = None) -> Generation:
        """Step by step: yields each step's tokens; ``tokens``/``metrics`` afterwards."""
        ...

    def generate(self, prompt: Sequence[int], n_new: int, *,
                 sampler: Sampler | None = None) -> tuple[list[int], Any]:
        """The whole generation: its tokens and its metrics."""
        ...

    def batch(self, *, warm: bool = ...) -> Any:
        """Slots that join, step together and leave (`BatchRun`, `RangedBatch`)."""
        ...

    def close(self) -> None: ...


@runtime_checkable
class Recoverable(Protocol):
    """A backend whose shards can fail and be reconnected (`RangedMTP`): what serve's
    /health and recovery use (`mtplib.serve.faults`)."""

    def faults(self) -> list[dict]:
        """What is wrong now, without a round trip; empty while whole."""
        ...

    def describe(self, i: int | None, cause: str = "") -> dict:
        """Shard ``i`` as a fault report names it."""
        ...

    def reconnect(self, timeout_s: float = 0.0) -> dict | None:
        """A new session on the shards (restarting local ones); its setup report."""
        ...
