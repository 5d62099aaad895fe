"""The acceptance sweep's one configuration and its one break-even rule.

A sweep runs MTP with a synthetic drafter at fixed acceptance rates (upstream's
``--spec-synth-rates`` semantics) and compares decode speed with MTP off. The bench lane
and the side-by-side tool both sweep; they share the settings type and the interpolation
that says where MTP starts to pay.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field

from mtplib.lab.common import checks as C


@dataclass
class SweepConfig:
    """What a sweep measures: draft lengths, synthetic rates, repetitions."""

    rates: list[float] = field(default_factory=lambda: [0.0, 0.25, 0.5, 0.75, 1.0])
    ks: list[int] = field(default_factory=lambda: [1, 2, 3])
    reps: int = 2
    warmup: int = 1
    draft_cost: str = "mtp"  # mtp: the MTP block drafts every step (real cost); none: free
    synth_seed: int = 0

    def to_dict(self) -> dict:
        d = asdict(self)
        d["ks"], d["rates"] = list(self.ks), list(self.rates)
        return d


#: each `SweepConfig` field's one rule (a lane's ``bench.sweep``), checked by
#: `BenchConfig.validate` and by `mtplib.records.parameters`
SWEEP_RULES: dict[str, C.Check] = {
    "rates": C.list_of(C.number(0, 1), what="rates 0..1"),
    "ks": C.drafts(1),
    "reps": C.integer(1, C.MAX_REPEATS),
    "warmup": C.integer(0, C.MAX_REPEATS),
    "draft_cost": C.text(("mtp", "none")),
    "synth_seed": C.integer(0, C.MAX_SEED),
}


def median_or_none(xs: Iterable[float | None]) -> float | None:
    """Median of the values that are not None; None when there are none."""
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def crossing(pts: Sequence[tuple[float, float]]) -> tuple[float | None, str]:
    """Where y (a speed-up) crosses 1 along x, by linear interpolation at the *last*
    upward crossing, so noise below it cannot hide a later dip. None with a note when the
    curve never crosses."""
    pts = sorted(pts)
    if not pts:
        return None, "no data"
    xs, ys = [p[0] for p in pts], [p[1] for p in pts]
    if all(y >= 1 for y in ys):
        return None, "faster than MTP off at every measured acceptance"
    if ys[-1] < 1:
        return None, "not reached: slower than MTP off at the highest measured acceptance"
    i = max(j for j in range(len(ys) - 1) if ys[j] < 1 <= ys[j + 1])
    x0, x1, y0, y1 = xs[i], xs[i + 1], ys[i], ys[i + 1]
    return x0 + (1 - y0) * (x1 - x0) / (y1 - y0), "interpolated"


def break_even(summary: list[dict], *, x: str = "acceptance_pos_1") -> list[dict]:
    """Per (plan, k) (plan where the rows have one): the ``x`` (position-1 acceptance by
    default) at which the speed-up crosses 1, with the speed-up at both ends."""
    out = []
    by: dict[tuple, list[dict]] = {}
    for r in summary:
        by.setdefault((r.get("plan"), r["k"]), []).append(r)
    for (plan, k), rs in sorted(by.items(), key=lambda kv: (str(kv[0][0]), kv[0][1])):
        pts = sorted((r[x], r["speedup"]) for r in rs
                     if r.get(x) is not None and r.get("speedup") is not None)
        value, note = crossing(pts)
        row = {"plan": plan} if plan is not None else {}
        row.update({"k": k, "break_even_acceptance": value, "note": note,
                    "speedup_at_min_acceptance": pts[0][1] if pts else None,
                    "speedup_at_max_acceptance": pts[-1][1] if pts else None,
                    "max_speedup": max(p[1] for p in pts) if pts else None})
        out.append(row)
    return out
