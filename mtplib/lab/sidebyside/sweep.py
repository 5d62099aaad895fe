"""The acceptance sweep (`mtplib.lab.sidebyside`, mtplib only): MTP off and k = 1..3 at synthetic
rates with the real MTP block drafting (`acceptance_sweep`), its summary and break-even
rate per k.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from mtplib.contract.capabilities import Policy
from mtplib.lab.common import acceptance_sweep as sweep
from mtplib.lab.common.acceptance_sweep import SweepConfig, median_or_none
from mtplib.lab.common.tables import row_from_dict, typed
from mtplib.lab.correctness import seeded_prompt
from mtplib.lab.sidebyside.cases import LOG, SideBySideConfig
from mtplib.lab.sidebyside.machine import host_info, loadavg
from mtplib.runtime.results import GenerationMetrics
from mtplib.runtime.routing import require_mtp
from mtplib.runtime.settings import DecodeSettings


# -- the acceptance sweep (mtplib only) ---------------------------------------------------
@dataclass(frozen=True)
class SweepRun:
    """One generation of the acceptance sweep: a row of a sweep file's ``rows`` (MTP off,
    k = 0 and mode "off", or at one synthetic rate). Built typed where it is measured, read
    typed by `sweep_summary`; a dict (`to_dict`, the fields in order) in the file only."""

    decode_tok_s: float | None
    drafted: int
    accepted: int
    acceptance_rate: float | None
    accepted_per_position: list[float | None]
    time_s: dict[str, float]
    loadavg: list[float]
    k: int
    rate: float | None
    sweep_k: int  # the k whose runs this one is interleaved with
    rep: int | None  # None: a warm-up
    warmup: bool
    mode: str  # off | synthetic
    quality_valid: bool

    @classmethod
    def of(cls, g: GenerationMetrics, **kw: Any) -> SweepRun:
        """A run's row from its metrics, with the load average read now."""
        return cls(decode_tok_s=g.decode_tok_s, drafted=g.drafted, accepted=g.accepted,
                   acceptance_rate=g.acceptance_rate,
                   accepted_per_position=list(g.accepted_per_position),
                   time_s=dict(g.time_s), loadavg=loadavg(), **kw)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, r: dict) -> SweepRun:
        return row_from_dict(cls, r, "an acceptance-sweep row")


def acceptance_sweep(trunk: str, sidecar: str, sw: SweepConfig, cfg: SideBySideConfig, *,
                     log: LOG | None = None, policy: Policy | str | None = None) -> dict:
    """MTP off, then per k and rate of ``sw`` (same rate at every position) with the MTP
    block drafting every step; runs of the rates interleaved (rep-major) within each k,
    MTP-off runs interleaved with every k's. ``cfg`` gives the context, prompt and length
    (its own ks, rate_sets and runs are not used). Refused under a policy that disables
    MTP before anything runs."""
    from mtplib.runtime.drafters import SyntheticDrafter
    from mtplib.runtime.speculative import MTPRuntime

    pol = require_mtp("acceptance sweep", sw.ks, policy=policy)
    log = log or (lambda s: None)
    t0 = time.time()
    # mtplib only: cfg's context size and threads, the C API's defaults otherwise (swa_full
    # on), as the committed sweeps ran
    ctx = DecodeSettings(n_ctx=cfg.settings.n_ctx, n_threads=cfg.settings.n_threads)
    rows: list[SweepRun] = []

    def row(g: GenerationMetrics, **kw: Any) -> SweepRun:
        r = SweepRun.of(g, **kw)
        rows.append(r)
        return r

    with MTPRuntime(trunk, None, k=0, settings=ctx, policy=pol) as off:
        prompt = seeded_prompt(cfg.prompt_seed, cfg.n_prompt, off.trunk.n_vocab)
        ref, _ = off.generate(prompt, cfg.n_new)
        n_vocab = off.trunk.n_vocab
        for k in sw.ks:
            log(f"sweep k={k}")
            with MTPRuntime(trunk, sidecar, k=k, settings=ctx, policy=pol) as rt:
                mtp = rt.engine.drafter
                for rep in [None] * sw.warmup + list(range(sw.reps)):
                    _, m = off.generate(prompt, cfg.n_new)
                    row(m, k=0, rate=None, sweep_k=k, rep=rep, warmup=rep is None,
                        mode="off", quality_valid=True)
                    order = sw.rates if (rep or 0) % 2 == 0 else list(reversed(sw.rates))
                    for rate in order:
                        rt.engine.drafter = SyntheticDrafter(
                            ref, len(prompt), [rate] * k, n_vocab, seed=sw.synth_seed,
                            inner=mtp)
                        try:
                            _, m = rt.generate(prompt, cfg.n_new)
                        finally:
                            rt.engine.drafter = mtp
                        r = row(m, k=k, rate=rate, sweep_k=k, rep=rep, warmup=rep is None,
                                mode="synthetic", quality_valid=False)
                        log(f"  k={k} rate={rate} rep={rep} {r.decode_tok_s:.1f} tok/s")
    summary = sweep_summary(rows)
    config = {"ks": list(sw.ks), "rates": list(sw.rates), "runs": sw.reps,
              "warmup": sw.warmup, "synth_seed": sw.synth_seed,
              "threads": ctx.n_threads, "n_ctx": ctx.n_ctx,
              **{f: getattr(cfg, f) for f in ("n_new", "n_prompt", "prompt_seed")}}
    return {"kind": "acceptance-sweep", "config": config, "trunk": str(trunk),
            "sidecar": str(sidecar), "prompt": prompt, "rows": [r.to_dict() for r in rows],
            "summary": summary,
            "break_even": break_even(summary), "host": host_info(),
            "wall_s": time.time() - t0}


def sweep_summary(rows: Sequence[SweepRun | dict]) -> list[dict]:
    """Per (k, rate): median tok/s, speed-up over the MTP-off runs interleaved with it."""
    out = []
    meas = [r for r in typed(SweepRun, rows) if not r.warmup]
    for k in sorted({r.sweep_k for r in meas}):
        off = median_or_none(r.decode_tok_s for r in meas if r.sweep_k == k and r.k == 0)
        rates = sorted({r.rate for r in meas if r.sweep_k == k and r.k == k})
        for rate in rates:
            rs = [r for r in meas if r.k == k and r.rate == rate]
            med = median_or_none(r.decode_tok_s for r in rs)
            d = sum(r.drafted for r in rs)
            a = sum(r.accepted for r in rs)
            pos1 = median_or_none(r.accepted_per_position[0] for r in rs)
            out.append({"k": k, "rate": rate, "runs": len(rs), "off_tok_s": off,
                        "tok_s": med, "speedup": med / off if off and med else None,
                        "acceptance_pos_1": pos1, "acceptance": a / d if d else None,
                        "loadavg_1m_min_max": [min(r.loadavg[0] for r in rs),
                                               max(r.loadavg[0] for r in rs)]})
    return out


def break_even(summary: list[dict]) -> list[dict]:
    """Per k: where the speed-up crosses 1 against the realized position-1 acceptance
    (`mtplib.lab.common.acceptance_sweep.break_even`) and against the nominal rate (the
    seeded draws of a short run differ from the nominal rate)."""
    out = []
    for be in sweep.break_even(summary):
        rs = [r for r in summary if r["k"] == be["k"] and r.get("speedup") is not None]
        rate, note = sweep.crossing([(r["rate"], r["speedup"]) for r in rs])
        out.append({"k": be["k"], "break_even_rate": rate,
                    "break_even_acceptance_pos_1": be["break_even_acceptance"],
                    "max_speedup": max((r["speedup"] for r in rs), default=None),
                    "note": note})
    return out


def sweep_table(path: str | Path):
    import pandas as pd

    data = json.loads(Path(path).read_text())
    return pd.DataFrame(data["summary"]).round(3), pd.DataFrame(data["break_even"]).round(3)
