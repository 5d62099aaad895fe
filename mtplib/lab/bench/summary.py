"""A bench's result (`BenchResult`) and what is made of its rows: the summaries
(`summarize`, `sweep_summary`, `break_even` of `mtplib.lab.common.acceptance_sweep`), all of
them rows too, and the files: ``bench.json`` (the raw metrics the evidence README is
generated from), one CSV per table and the plots of `mtplib.lab.bench.plots` (`save`,
`load`)."""

from __future__ import annotations

import json
import statistics
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from mtplib.contract.labels import TIME_PARTS
from mtplib.files import write_json
from mtplib.lab.bench.runs import BenchRun, typed_runs
from mtplib.lab.common import tables
from mtplib.lab.common.acceptance_sweep import break_even, median_or_none
from mtplib.lab.common.display import REFERENCE_S9


# -- summaries --------------------------------------------------------------------------
def _sum_pos(rows: list[BenchRun], key: str, k: int) -> list[int]:
    """Per draft position 1..k: the sum over ``rows`` of their metrics' ``key`` list."""
    out = [0] * k
    for r in rows:
        for i, v in enumerate(getattr(r.metrics, key)[:k]):
            out[i] += v
    return out


def _group(rows: Sequence[BenchRun], key: Callable[[BenchRun], tuple]
           ) -> dict[tuple, list[BenchRun]]:
    """The measured rows (warm-up excluded) by ``key``."""
    groups: dict[tuple, list[BenchRun]] = {}
    for r in rows:
        if not r.warmup:
            groups.setdefault(key(r), []).append(r)
    return groups


def _off_medians(runs: list[BenchRun]) -> dict[str, float]:
    return {plan: median_or_none(r.decode_tok_s for r in rs)
            for (plan, mode), rs in _group(runs, lambda r: (r.plan, r.mode)).items()
            if mode == "off"}


def _scaled(v: float | None, unit: float) -> float | None:
    """``v`` in ``unit``s; None (not measured) stays None rather than becoming 0."""
    return None if v is None else v / unit


def summarize(runs: Sequence[BenchRun | dict], sampling: list[dict] | None = None
              ) -> list[dict]:
    """One row per (plan, k): medians and spread over measured runs (warm-up excluded).
    ``runs``: BenchRuns, or their dicts as bench.json holds them."""
    runs = typed_runs(runs)
    off = _off_medians(runs)
    samp = {r["k"]: r for r in sampling or []}
    out = []
    for (plan, k), rs in sorted(_group(runs, lambda r: (r.plan, r.k)).items()):
        tps = [r.decode_tok_s for r in rs if r.decode_tok_s is not None]
        med = median_or_none(tps)
        drafted = sum(r.metrics.drafted for r in rs)
        accepted = sum(r.metrics.accepted for r in rs)
        acc_n, dr_n = _sum_pos(rs, "accepted_per_position_counts", k), \
            _sum_pos(rs, "drafted_per_position", k)
        hist = Counter()
        for r in rs:
            hist.update({int(a): n for a, n in r.metrics.accept_len_hist.items()})
        n_gen = sum(r.metrics.n_generated for r in rs)
        t = {p: sum(r.time_s(p) for r in rs) for p in TIME_PARTS}
        t_total = sum(t.values())
        seam = [r.seam_bytes_per_token for r in rs if r.seam_bytes_per_token is not None]
        first = rs[0]
        quality = [r.quality for r in rs if r.quality is not None]
        row = {
            "plan": plan, "k": k, "mode": "off" if k == 0 else "mtp", "runs": len(rs),
            "decode_tok_s_median": med, "decode_tok_s_min": min(tps) if tps else None,
            "decode_tok_s_max": max(tps) if tps else None,
            "decode_tok_s_spread_pct": (100 * (max(tps) - min(tps)) / med) if med else None,
            "speedup": med / off[plan] if med and off.get(plan) else None,
            "ttft_ms_median": 1000 * median_or_none(r.metrics.ttft_s for r in rs),
            "drafted": drafted, "accepted": accepted,
            "acceptance": accepted / drafted if drafted else None,
            "accepted_per_position": [a / d if d else None for a, d in zip(acc_n, dr_n,
                                                                             strict=True)],
            "accept_len_hist": {str(a): hist.get(a, 0) for a in range(k + 1)} if k else {},
            "mean_accept_len": (sum(a * n for a, n in hist.items()) / sum(hist.values())
                                if sum(hist.values()) else None),
            **{f"ms_per_token_{p}": 1000 * t[p] / n_gen for p in TIME_PARTS},
            **{f"share_{p}_pct": 100 * t[p] / t_total if t_total else None
               for p in TIME_PARTS},
            "seam_bytes_per_token": median_or_none(seam) if seam else None,
            # not measured (a ranged run's RSS is the shards', MTP off loads no MTP
            # context): None, written as an empty CSV cell and shown as n/a, never 0
            "rss_peak_mib": _scaled(max((r.memory("rss_peak_bytes") for r in rs
                                         if r.memory("rss_peak_bytes") is not None),
                                        default=None), 2**20),
            "trunk_weights_mib": _scaled(first.memory("trunk_weights_bytes"), 2**20),
            "mtp_weights_mib": _scaled(first.memory("mtp_weights_bytes"), 2**20),
            "target_seq_state_kib": _scaled(first.memory("target_seq_state_bytes"), 2**10),
            "mtp_seq_state_kib": _scaled(first.memory("mtp_seq_state_bytes"), 2**10),
            "equal_to_off_runs": sum(bool(q.equal_to_off) for q in quality),
            "token_agreement_pct": 100 * statistics.fmean(q.token_agreement for q in quality),
            "near_tie_divergences": sum(bool(q.near_tie) for q in quality),
            "unexplained_divergences": sum(not q.equal_to_off and not q.near_tie
                                           for q in quality),
        }
        for i in range(3):
            row[f"acceptance_pos_{i + 1}"] = row["accepted_per_position"][i] if i < k else None
        if k in samp:
            s = samp[k]
            row.update(sampling_equal_streams=s["equal_streams"], sampling_streams=s["streams"],
                       sampling_tv_distance=s["tv_distance"])
        out.append(row)
    return out


def sweep_summary(sweep_runs: Sequence[BenchRun | dict], runs: Sequence[BenchRun | dict]
                  ) -> list[dict]:
    """One row per (k, rate): measured acceptance, median decode tok/s, speed-up vs off."""
    off = _off_medians(typed_runs(runs))
    out = []
    groups = _group(typed_runs(sweep_runs), lambda r: (r.plan, r.k, r.sweep.rate))
    for (plan, k, rate), rs in sorted(groups.items()):
        med = median_or_none(r.decode_tok_s for r in rs)
        acc_n = _sum_pos(rs, "accepted_per_position_counts", k)
        dr_n = _sum_pos(rs, "drafted_per_position", k)
        drafted = sum(r.metrics.drafted for r in rs)
        out.append({
            "plan": plan, "k": k, "rate": rate, "runs": len(rs),
            "acceptance_pos_1": acc_n[0] / dr_n[0] if dr_n[0] else None,
            "acceptance": sum(r.metrics.accepted for r in rs) / drafted if drafted else None,
            "decode_tok_s_median": med,
            "decode_tok_s_min": min(r.decode_tok_s for r in rs),
            "decode_tok_s_max": max(r.decode_tok_s for r in rs),
            "off_tok_s_median": off.get(plan),
            "speedup": med / off[plan] if med and off.get(plan) else None,
            "reference_intact_runs": sum(r.sweep.reference_intact for r in rs),
            "draft_cost": rs[0].sweep.draft_cost, "quality_valid": False,
        })
    return out


# -- the result -------------------------------------------------------------------------
@dataclass
class BenchResult:
    config: dict
    runs: list[BenchRun]
    sweep_runs: list[BenchRun]
    sampling: list[dict]
    backend: dict
    wall_s: float
    prompts: list[dict]
    #: the files measured (names only: paths differ between machines)
    model: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        # rows read back from bench.json are dicts: typed here, as a run makes them
        self.runs, self.sweep_runs = typed_runs(self.runs), typed_runs(self.sweep_runs)

    @property
    def summary(self) -> list[dict]:
        return summarize(self.runs, self.sampling)

    @property
    def sweep(self) -> list[dict]:
        return sweep_summary(self.sweep_runs, self.runs)

    @property
    def break_even(self) -> list[dict]:
        return break_even(self.sweep)

    def to_json(self) -> dict:
        return {"config": self.config, "reference_s9": REFERENCE_S9, "backend": self.backend,
                "wall_s": self.wall_s, "prompts": self.prompts,
                **({"model": self.model} if self.model else {}), "summary": self.summary,
                "sweep": self.sweep, "break_even": self.break_even,
                "runs": [r.to_dict() for r in self.runs],
                "sweep_runs": [r.to_dict() for r in self.sweep_runs], "sampling": self.sampling}


# -- saving (the plots: mtplib.lab.bench.plots) ------------------------------------------
#: bench.json's tables, each also written as ``bench_<name>.csv``
TABLES = ("summary", "sweep", "break_even", "runs", "sweep_runs", "sampling")


#: the columns a bench CSV starts with (where its table has them); the rest follow sorted
LEAD_COLUMNS = ("plan", "mode", "k", "rate", "prompt", "rep", "warmup")


def _ordered(row: dict) -> dict:
    """``row`` with `LEAD_COLUMNS` first and the other keys sorted: the same columns in the
    same order whether the rows come from a run or from bench.json (written sorted)."""
    lead = [c for c in LEAD_COLUMNS if c in row]
    return {c: row[c] for c in [*lead, *sorted(set(row) - set(lead))]}


def write_csvs(data: dict, out_dir: str | Path) -> dict[str, Path]:
    """One tidy CSV per table of bench.json's ``data`` (`mtplib.lab.common.tables`: lists and
    dicts spread over columns, ``rep`` an integer with an empty cell for warm-up runs)."""
    out = Path(out_dir)
    return {name: tables.to_csv([_ordered(r) for r in data[name]], out / f"bench_{name}.csv")
            for name in TABLES}


def save(result: BenchResult, out_dir: str | Path, *, plots: bool = True) -> dict[str, Path]:
    """Write bench.json (all raw rows + summaries), one CSV per table, and the plots."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    data = result.to_json()
    paths = {"json": out / "bench.json"}
    write_json(paths["json"], data, indent=2, sort_keys=True)
    paths.update(write_csvs(data, out))
    if plots:
        from mtplib.lab.bench.plots import figures

        pdir = out / "plots"
        pdir.mkdir(exist_ok=True)
        for name, fig in figures(data).items():
            p = pdir / f"{name}.png"
            fig.savefig(p, dpi=110, bbox_inches="tight")
            paths[f"plot_{name}"] = p
    return paths


def load(out_dir: str | Path) -> dict:
    return json.loads((Path(out_dir) / "bench.json").read_text())
