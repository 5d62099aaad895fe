"""The benchmark's typed rows: `BenchRun` (one timed generation) and its optional parts
(quality against MTP off, a ranged run's seam, a sweep run's draw). Typed everywhere; a flat
dict only at bench.json's edge (`BenchRun.to_dict`, `BenchRun.from_dict`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import MISSING, asdict, dataclass, fields

from mtplib.contract.labels import TIME_PARTS
from mtplib.lab.common.tables import typed
from mtplib.runtime.results import GenerationMetrics


@dataclass(frozen=True)
class Quality:
    """A timed run's tokens against MTP off's (greedy, with the near-tie audit)."""

    equal_to_off: bool
    token_agreement: float
    first_divergence: int | None
    near_tie: bool
    margin_at_divergence: float | None


@dataclass(frozen=True)
class RangedSeam:
    """What a run on shards adds: bytes per token by step kind, the contract's minimum,
    where the MTP block and the output head ran and which seam ran (the generation's
    ``metrics.seam``: asked, chosen and why, each shard pair's star or ring); None: not
    recorded (older files)."""

    seam_by_step: dict[str, float]
    seam_contract_min: dict[str, int]
    mtp_placement: str | None = None
    head: str | None = None
    seam: dict | None = None


@dataclass(frozen=True)
class SweepDraw:
    """A sweep run's synthetic acceptance: the rate drawn at, what drafted, and whether
    the tokens stayed MTP off's (they must: only the speed of a sweep row counts)."""

    rate: float
    draft_cost: str
    reference_intact: bool


#: memory keys of a row (bytes; None where the run did not measure them)
MEMORY_KEYS = ("rss_peak_bytes", "trunk_weights_bytes", "mtp_weights_bytes",
               "target_seq_state_bytes", "mtp_seq_state_bytes")
_PARTS = {"quality": Quality, "ranged": RangedSeam, "sweep": SweepDraw}


@dataclass(frozen=True)
class BenchRun:
    """One timed generation: a row of bench.json's ``runs`` (``mode`` off or mtp) or
    ``sweep_runs`` (synthetic). Typed everywhere; a flat dict only at the file edge
    (`to_dict`, `from_dict`), with exactly the keys its kind has."""

    plan: str
    mode: str
    k: int
    prompt: str
    rep: int | None  # None: a warm-up run
    warmup: bool
    n_new: int
    threads: int
    seam_bytes_per_token: float | None  # None: the whole model (no seam)
    metrics: GenerationMetrics
    quality_valid: bool = True  # False: the drafts were synthetic (sweep)
    quality: Quality | None = None
    ranged: RangedSeam | None = None
    sweep: SweepDraw | None = None

    @property
    def decode_tok_s(self) -> float | None:
        return self.metrics.decode_tok_s

    def time_s(self, part: str) -> float:
        return self.metrics.time_s[part]

    def memory(self, key: str) -> int | None:
        return self.metrics.memory_bytes(key)

    def to_dict(self) -> dict:
        m = self.metrics
        row = {"rep": self.rep, "warmup": self.warmup, "n_new": self.n_new, "mode": self.mode,
               "k": self.k, "prompt": self.prompt, "plan": self.plan,
               **({"rate": self.sweep.rate, "draft_cost": self.sweep.draft_cost}
                  if self.sweep else {}),
               "seam_bytes_per_token": self.seam_bytes_per_token, "threads": self.threads}
        if self.ranged:
            # the seam figures always (None included); the rest where recorded (a row
            # before the field has no placement, head or seam)
            row.update({k: v for k, v in asdict(self.ranged).items()
                        if v is not None or k in ("seam_by_step", "seam_contract_min")})
        row.update({
            "n_prompt": m.n_prompt, "n_generated": m.n_generated,
            "decode_tok_s": m.decode_tok_s, "ttft_s": m.ttft_s, "decode_s": m.decode_s,
            "drafted": m.drafted, "accepted": m.accepted, "acceptance": m.acceptance_rate,
            "accepted_per_position": list(m.accepted_per_position),
            "accepted_per_position_counts": list(m.accepted_per_position_counts),
            "drafted_per_position": list(m.drafted_per_position),
            "accept_len_hist": dict(m.accept_len_hist),
            "verify_steps": m.verify_steps, "plain_steps": m.plain_steps,
            "rollbacks": dict(m.rollbacks),
            **{f"t_{p}_s": m.time_s[p] for p in TIME_PARTS},
            **{key: m.memory_bytes(key) for key in MEMORY_KEYS},
            "quality_valid": self.quality_valid})
        if self.quality:
            row.update(asdict(self.quality))
        if self.sweep:
            row["reference_intact"] = self.sweep.reference_intact
        return row

    @classmethod
    def from_dict(cls, r: dict) -> BenchRun:
        """A row as bench.json holds it (older files lack a ranged row's placement/head)."""
        m = GenerationMetrics.from_dict({
            **r, "acceptance_rate": r["acceptance"],
            "time_s": {p: r[f"t_{p}_s"] for p in TIME_PARTS},
            "memory": {key: r[key] for key in MEMORY_KEYS if r.get(key) is not None}})
        parts = {name: part(**{f.name: r[f.name] for f in fields(part) if f.name in r})
                 for name, part in _PARTS.items()
                 if all(f.name in r for f in fields(part) if f.default is MISSING)}
        return cls(plan=r["plan"], mode=r["mode"], k=r["k"], prompt=r["prompt"], rep=r["rep"],
                   warmup=r["warmup"], n_new=r["n_new"], threads=r["threads"],
                   seam_bytes_per_token=r["seam_bytes_per_token"], metrics=m,
                   quality_valid=r["quality_valid"], **parts)


def typed_runs(rows: Sequence[BenchRun | dict]) -> list[BenchRun]:
    """Rows as BenchRuns (rows read back from bench.json are dicts)."""
    return typed(BenchRun, rows)
