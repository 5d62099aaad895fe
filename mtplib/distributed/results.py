"""What a ranged generation measured, typed: the engine's `GenerationMetrics` plus the seam
(bytes and waits on the shard connections) and where it ran.

The dict form (`to_dict`) is flat, with the keys `mtplib generate --plan --json` has always
printed; `from_dict` reads it back (wan.json rows, the CLI's output).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from mtplib.runtime.results import GenerationMetrics

#: the seam's figures, as `ShardClient.seam_metrics` reports them (its "wan" aside)
SEAM_KEYS = ("seam_bytes", "seam_bytes_per_token", "seam_data_bytes_per_token",
             "seam_contract_min_per_token", "seam_ratio", "waits_per_step",
             "wire_bytes_by_class", "seam_bytes_by_value", "steps_by_label",
             "cache_bytes_crossing", "wire_violations")


@dataclass(frozen=True, kw_only=True)
class RangedMetrics(GenerationMetrics):
    """One ranged generation: the engine's metrics, the seam (bytes and waits on the shard
    connections by step kind), the plan and where everything ran."""

    #: bytes on the shard connections while generating
    seam_bytes: int
    #: step kind -> bytes per generated token, all of them and the tensors' data only
    seam_bytes_per_token: dict[str, float]
    seam_data_bytes_per_token: dict[str, float]
    #: step kind -> the contract's minimum for the plan, and the measured ratio to it
    seam_contract_min_per_token: dict[str, int]
    seam_ratio: dict[str, float]
    #: step kind -> blocking round trips per step
    waits_per_step: dict[str, float]
    #: step kind -> data bytes by wire class / by boundary value
    wire_bytes_by_class: dict[str, dict[str, int]]
    seam_bytes_by_value: dict[str, dict[str, int]]
    steps_by_label: dict[str, int]
    #: KV / auxiliary cache bytes that crossed a shard connection (the contract says 0)
    cache_bytes_crossing: int
    #: what moved that the contract forbids (only with --allow-cache-crossing)
    wire_violations: list[str]
    #: the relays' full per-step report (`ShardClient.seam_report`)
    seam_report: dict
    plan: str
    endpoints: list[str]
    #: the shards were started by this process (no --endpoints)
    local_shards: bool
    #: layer -> endpoint upstream placed it on
    placement: dict[str, str]
    #: each relay's link ("100" ms, "0")
    wan: list[str]
    transport: str
    head: str
    #: the MTP block's placement ("tail" or "client") and endpoints; None: MTP off
    mtp_placement: str | None = None
    mtp_endpoints: list[str] | None = None
    #: which seam ran (`RangedRuntime.seam_summary`: asked, chosen and why, per shard
    #: pair); None in files from before patches/0007
    seam: dict | None = None

    #: a ranged generation always says its setup (None: set up for an earlier one)
    _ALWAYS: ClassVar[tuple[str, ...]] = ("setup",)
    _OWN: ClassVar[tuple[str, ...]] = (*SEAM_KEYS, "seam_report", "plan", "endpoints",
                                       "local_shards", "placement", "wan", "transport",
                                       "head")

    def to_dict(self) -> dict[str, Any]:
        out = super().to_dict()
        out.update({name: getattr(self, name) for name in self._OWN})
        if self.mtp_placement is not None:
            out["mtp_placement"] = self.mtp_placement
            out["mtp_endpoints"] = self.mtp_endpoints
        if self.seam is not None:
            out["seam"] = self.seam
        return out

    @classmethod
    def from_dict(cls, m: Mapping[str, Any]) -> RangedMetrics:
        return cls(**GenerationMetrics.fields_from(m), **{name: m[name] for name in cls._OWN},
                   mtp_placement=m.get("mtp_placement"), mtp_endpoints=m.get("mtp_endpoints"),
                   seam=m.get("seam"))


@dataclass(frozen=True)
class RangedGeneration:
    """`generate_ranged`'s result: the tokens, their text (a text prompt) and the metrics."""

    tokens: list[int]
    metrics: RangedMetrics
    text: str | None = None
