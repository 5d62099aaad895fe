"""What /metrics, /slots and /props report: one table of slots (one slot when the service
is not batched) with each slot's running request, and the totals since the start.

Why one table for both: a one-slot service and a ``--parallel N`` one differ only in the
number of rows; the request that runs in a slot says which (``slot``), so nothing is kept
per thread. Written by the worker's threads, read by the event loop, under ``lock``."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from mtplib.serve.events import RunMetrics


@dataclass
class SlotState:
    """A slot's running request, as /slots shows it."""

    id_task: int
    #: the request's settings as llama-server reports them (empty: the defaults)
    params: dict
    n_decoded: int
    n_new: int
    n_prompt: int


@dataclass
class Totals:
    """Counters since the start (Prometheus counters), and the last ranged request's
    waits per step."""

    requests: dict[str, int] = field(default_factory=lambda: {"ok": 0, "error": 0})
    prompt_tokens: int = 0
    predicted: int = 0
    decode_steps: int = 0
    drafted: int = 0
    accepted: int = 0
    verify_steps: int = 0
    prompt_s: float = 0.0
    predicted_s: float = 0.0
    n_tokens_max: int = 0
    waits_per_step: dict[str, float] = field(default_factory=dict)
    #: batched steps, and the sum over them of the slots each carried
    batch_steps: int = 0
    slot_steps: int = 0

    def add(self, m: RunMetrics, n_prompt: int, n_out: int) -> None:
        """One request answered: its tokens and figures."""
        self.requests["ok"] += 1
        self.prompt_tokens += n_prompt
        self.predicted += n_out
        self.prompt_s += m.ttft_s or 0.0
        self.predicted_s += m.decode_s or 0.0
        self.n_tokens_max = max(self.n_tokens_max, n_prompt + n_out)
        self.drafted += m.drafted
        self.accepted += m.accepted
        self.verify_steps += m.verify_steps
        self.decode_steps += m.verify_steps + m.plain_steps
        if m.waits_per_step:
            self.waits_per_step = dict(m.waits_per_step)

    @property
    def slots_per_decode(self) -> float:
        """Busy slots per decode: measured per batched step, else one per step."""
        if self.batch_steps:
            return self.slot_steps / self.batch_steps
        return 1.0 if self.decode_steps else 0.0


class SlotTable:
    """Each slot's running request (None: idle) and the totals, under one lock."""

    def __init__(self, n_slots: int = 1) -> None:
        self.lock = threading.Lock()
        self.slots: list[SlotState | None] = [None] * n_slots
        self.totals = Totals()
        self.task = 0

    def begin(self, slot: int, params: dict, n_prompt: int, n_new: int) -> None:
        with self.lock:
            self.task += 1
            self.slots[slot] = SlotState(self.task, params, 0, n_new, n_prompt)

    def step(self, slot: int, n_out: int) -> None:
        with self.lock:
            s = self.slots[slot]
            if s is not None:
                s.n_decoded = n_out

    def done(self, slot: int, m: RunMetrics, n_prompt: int, n_out: int) -> None:
        with self.lock:
            self.slots[slot] = None
            self.totals.add(m, n_prompt, n_out)

    def failed(self, slot: int) -> None:
        with self.lock:
            self.slots[slot] = None
            self.totals.requests["error"] += 1

    def stepped(self, n_slots: int) -> None:
        """One batched step carried ``n_slots`` slots."""
        with self.lock:
            self.totals.batch_steps += 1
            self.totals.slot_steps += n_slots

    def states(self) -> list[SlotState | None]:
        """A copy of the slots (the entries are read, not written, by the caller)."""
        with self.lock:
            return list(self.slots)
