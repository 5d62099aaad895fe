"""What one generation measured, typed: `GenerationMetrics` (the whole model) and, in
`mtplib.distributed.results`, its ranged kind.

Every entry point returns one of these; code that computes with the numbers reads fields
(``g.decode_tok_s``, not ``m["decode_tok_s"]``), so a renamed or missing value fails in one
place, with its name. A dict exists only at the JSON/CSV edge: `to_dict` writes the keys
the files have always had (so ``--json`` output, bench.json and wan.json are unchanged) and
`from_dict` reads them back.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import MISSING, dataclass, fields
from typing import Any, ClassVar

from mtplib.contract.labels import TIME_PARTS, StepKind

#: keys written only when the generation has them (None: absent in the dict)
_OPTIONAL = ("hidden_rows", "memory", "steps", "margins", "routing", "upstream", "setup")


@dataclass(frozen=True)
class GenerationMetrics:
    """One generation's counts and times (the engine's metrics, MTP on or off), with what
    the entry point that ran it adds (memory, routing, build)."""

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
    #: where the drafter's target rows came from ("api", "captured", "off"); None: not said
    hidden_rows: str | None = None
    #: the drafts were forced (a synthetic drafter): the speed counts, the tokens do not
    synthetic: bool = False
    #: peak RSS, weights and per-sequence state bytes (None: the entry point measured none)
    memory: dict[str, int] | None = None
    #: the per-step trace and near-tie margins (only with ``trace=True``)
    steps: list[dict] | None = None
    margins: dict[str, float] | None = None
    #: the routing decision, the upstream build, the load-time setup (where reported)
    routing: dict | None = None
    upstream: dict | None = None
    setup: dict | None = None

    #: keys `to_dict` always writes, even when None (a subclass may add to it)
    _ALWAYS: ClassVar[tuple[str, ...]] = ()

    def memory_bytes(self, key: str) -> int | None:
        """One memory figure (None where it was not measured)."""
        return (self.memory or {}).get(key)

    def to_dict(self) -> dict[str, Any]:
        """The metrics as the JSON files hold them (the keys of every earlier file)."""
        out: dict[str, Any] = {}
        for f in fields(GenerationMetrics):  # a subclass writes its own fields after these
            v = getattr(self, f.name)
            if f.name == "time_s":
                v = {str(p): float(t) for p, t in v.items()}
            elif f.name == "synthetic":
                if v:
                    out.update(synthetic=True, quality_valid=False)
                continue
            elif v is None and f.name in _OPTIONAL and f.name not in self._ALWAYS:
                continue
            out[f.name] = v
        return out

    @classmethod
    def from_dict(cls, m: Mapping[str, Any]) -> GenerationMetrics:
        """The typed view of a metrics dict (what `to_dict` or an earlier file wrote); keys
        it does not type are ignored, a missing required one raises KeyError naming it."""
        return cls(**cls.fields_from(m))

    @staticmethod
    def fields_from(m: Mapping[str, Any]) -> dict[str, Any]:
        """The `GenerationMetrics` fields of a metrics dict (a subclass adds its own)."""
        kw: dict[str, Any] = {}
        for f in fields(GenerationMetrics):
            if f.name == "time_s":
                kw["time_s"] = {p: float(m["time_s"][p]) for p in TIME_PARTS}
            elif f.name == "synthetic":
                kw["synthetic"] = bool(m.get("synthetic", False))
            elif f.name == "rollbacks":
                kw["rollbacks"] = dict(m["rollbacks"])
            elif f.name in m:
                kw[f.name] = m[f.name]
            elif f.default is MISSING:
                raise KeyError(f.name)
        return kw

    def fields_dict(self) -> dict[str, Any]:
        """This generation's `GenerationMetrics` fields (to build a subclass from them)."""
        return {f.name: getattr(self, f.name) for f in fields(GenerationMetrics)}
