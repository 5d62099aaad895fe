"""What one generation measured, typed: `GenerationMetrics`.

The engine reports a generation as a JSON-friendly metrics dict (`Metrics.to_dict` plus
what each entry point adds: memory, routing, seam bytes). Code that computes with those
numbers reads them through this dataclass (``g.decode_tok_s``, not ``m["decode_tok_s"]``),
so a renamed or missing key fails in one place, with its name, instead of in every reader.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from mtplib.contract.labels import TIME_PARTS, StepKind


@dataclass(frozen=True)
class GenerationMetrics:
    """One generation's counts and times (the engine's metrics, MTP on or off)."""

    k: int
    n_prompt: int
    n_generated: int
    drafted: int
    accepted: int
    acceptance_rate: float | None
    #: P(draft i accepted) per draft position (None where nothing was drafted there)
    accepted_per_position: list[float | None]
    accepted_per_position_counts: list[int]
    drafted_per_position: list[int]
    #: accepted length ("0".."k") -> verify steps that accepted that many
    accept_len_hist: dict[str, int]
    verify_steps: int
    plain_steps: int
    #: rollback kind -> count (only the kinds that happened)
    rollbacks: dict[str, int]
    ttft_s: float | None
    decode_s: float
    #: generated tokens after the first per second of decoding (None: nothing decoded)
    decode_tok_s: float | None
    #: seconds per part of a step (`mtplib.contract.labels.TIME_PARTS`)
    time_s: dict[StepKind, float]
    #: peak RSS, weights and per-sequence state bytes where the entry point measured them
    memory: dict[str, int] = field(default_factory=dict)
    hidden_rows: str | None = None

    @classmethod
    def from_dict(cls, m: Mapping[str, Any]) -> GenerationMetrics:
        """The typed view of a metrics dict; keys it does not type are ignored, a missing
        required one raises KeyError naming it."""
        opt = {"memory", "hidden_rows"}
        kw = {f.name: m[f.name] for f in fields(cls) if f.name not in opt}
        kw["time_s"] = {p: float(m["time_s"][p]) for p in TIME_PARTS}
        kw["rollbacks"] = dict(m["rollbacks"])
        return cls(**kw, memory=dict(m.get("memory") or {}), hidden_rows=m.get("hidden_rows"))
