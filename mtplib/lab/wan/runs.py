"""One generation of the WAN benchmark as a typed row (`mtplib.lab.wan`): `WanRun`, built from a
run's metrics (`run_row`) and read back from any committed wan.json (`WanRun.from_dict`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass

from mtplib.distributed.results import RangedMetrics
from mtplib.lab.common.tables import row_from_dict, typed
from mtplib.lab.wan.config import DECODE_PHASES


@dataclass(frozen=True)
class WanRun:
    """One generation of the WAN benchmark: a row of wan.json's ``rows``. Built typed
    (`run_row`) and read typed (`from_dict`, by the summaries); a dict in the file only."""

    mode: str  # warm (one process) | cold (one CLI process per generation)
    plan: str
    topology: str
    placement: str  # where the MTP block ran; "-" for MTP off
    rtt_ms: float
    k: int
    prompt: int
    rep: int
    build: str | None
    patches: list[str]
    setup_s: float | None
    decode_tok_s: float | None
    ttft_s: float | None
    n_generated: int
    drafted: int
    accepted: int
    steps: int
    tokens_per_step: float | None
    hidden_rows: str | None
    waits_per_step: dict[str, float]
    steps_by_label: dict[str, int]
    wire_bytes_by_class: dict[str, dict[str, int]]
    seam_bytes_per_token: dict[str, float]
    cache_bytes_crossing: int
    wire_violations: list
    waits_decode_phase: float | None
    tokens: list[int]
    process_wall_s: float | None = None  # cold runs: the CLI process's wall time
    exit: int | None = None  # cold runs: its exit status
    #: cold runs: "local" (the CLI started its shards) or "endpoints" (it was given running
    #: shards), from the run's own metrics; None in rows older than the field
    shards: str | None = None
    #: the link cap in Mbit/s per direction (None: unlimited; rows older than the field
    #: ran unlimited)
    mbit: float | None = None
    #: which seam ran (the generation's ``metrics.seam``: asked, chosen and why, each
    #: shard pair's star or ring); None in rows older than the field
    seam: dict | None = None

    def to_dict(self) -> dict:
        """The row as wan.json holds it (the bandwidth after ``rtt_ms``, a cold run's
        process fields after ``rep``)."""
        d = asdict(self)
        head = {f: d.pop(f) for f in ("mode", "plan", "topology", "placement", "rtt_ms",
                                      "mbit", "k", "prompt", "rep")}
        cold = {f: d.pop(f) for f in ("process_wall_s", "exit", "shards")}
        if head["mbit"] is None:  # unlimited: the rows before the field, and these, omit it
            del head["mbit"]
        if cold["shards"] is None:  # cold rows before the field did not record it
            del cold["shards"]
        if d["seam"] is None:  # rows before the field
            del d["seam"]
        return {**head, **(cold if self.mode == "cold" else {}), **d}

    @classmethod
    def from_dict(cls, r: dict) -> WanRun:
        """A row of any committed wan.json (the oldest lack mode, build, patches, setup)."""
        return row_from_dict(cls, {"mode": "warm", "build": None, "patches": [],
                                   "setup_s": None, **r}, "a WAN row")


def typed_runs(rows: Sequence[WanRun | dict]) -> list[WanRun]:
    return typed(WanRun, rows)


def run_row(m: RangedMetrics, tokens: list[int], **kw) -> dict:
    """A generation's row (as its dict: the result is saved as it is)."""
    steps = m.verify_steps + m.plain_steps
    up = m.upstream or {}
    return WanRun(
        **kw, build=up.get("build"), patches=up.get("patches", []),
        setup_s=(m.setup or {}).get("setup_s"), decode_tok_s=m.decode_tok_s,
        ttft_s=m.ttft_s, n_generated=m.n_generated, drafted=m.drafted,
        accepted=m.accepted, steps=steps,
        tokens_per_step=(m.n_generated - 1) / steps if steps else None,
        hidden_rows=m.hidden_rows, waits_per_step=m.waits_per_step,
        steps_by_label=m.steps_by_label, wire_bytes_by_class=m.wire_bytes_by_class,
        seam_bytes_per_token=m.seam_bytes_per_token,
        cache_bytes_crossing=m.cache_bytes_crossing,
        wire_violations=m.wire_violations, waits_decode_phase=_decode_waits(m),
        tokens=tokens, seam=m.seam).to_dict()


def _decode_waits(m: RangedMetrics) -> float | None:
    """Waits of the decoding phase (every step kind but prefill), per generated token."""
    tot = 0.0
    for label, w in m.waits_per_step.items():
        if label in DECODE_PHASES and w:
            tot += w * m.steps_by_label.get(label, 0)
    n = m.n_generated - 1
    return tot / n if n > 0 else None
