"""MTP off vs on benchmark and the synthetic acceptance sweep (DGR-066 part 3).

One lane's ``bench:`` section (`BenchConfig`) drives three measurements on a trunk and its
`mtp-` sidecar, each a list of plain rows (dicts) that notebooks show with pandas:

- **runs**: MTP off (k = 0) and MTP on (k in ``ks``) per plan, prompt and repetition,
  warm-up runs flagged (and excluded from every summary). Each row: decode tok/s, TTFT,
  drafted / accepted (overall and per draft position), acceptance-length histogram, the
  time split prefill / draft / verify / feed / rollback, memory (peak RSS, weights and
  per-sequence cache state as upstream reports them), seam bytes per token (None for the
  whole model: no seam), and quality against MTP off (greedy token agreement with the
  near-tie audit of `mtplib.lab.quality`).
- **sweep**: the same target with a drafter that proposes the target's own (MTP-off)
  continuation up to a drawn length and a wrong token there, the length drawn with
  upstream's `--spec-synth-rates` semantics at one rate for every position (rate = the
  unconditional probability that a position is accepted: a step accepts nothing with
  probability 1 - rate, otherwise every draft). With ``draft_cost: mtp`` the real MTP
  block still drafts (and is fed) every step, so the sweep pays the real drafting cost
  and only the accepted tokens are synthetic. Speed-up = decode tok/s / decode tok/s of
  MTP off; the break-even acceptance is where the speed-up curve crosses 1. Sweep rows are
  marked ``quality_valid = False``: their drafts are the oracle's, only their speed counts.
- **sampling** (optional): MTP on vs off with temperature / top-p, per seed: equal streams
  (sample-and-match) and the total-variation distance between the pooled token
  distributions.

This module makes the runs (`run_bench`, which notebook 04 calls with a `BenchConfig` of
`mtplib.lab.bench.config`). The rows are typed (`mtplib.lab.bench.runs`); the summaries
(`summarize`, `sweep_summary`, `break_even`) are rows too, and `save` writes every row to
``bench.json`` (the raw metrics the evidence README is generated from), CSVs and the plots
of `mtplib.lab.bench.plots` (both `mtplib.lab.bench.summary`).

Acceptance conventions: ``acceptance`` = accepted / drafted over all draft positions;
``acceptance_pos_i`` = accepted at draft position i / drafted at position i
(unconditional: position 2 counts as accepted only when positions 1 and 2 both are).
The sweep's x axis is the measured position-1 acceptance, the quantity of DeepSeek-V3's
"second-token acceptance" and of vLLM's first per-position figure (`REFERENCE_S9`, whose
sources are cited in `mtplib.lab.common.display.REFERENCES`).
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path

from mtplib.errors import InputError
from mtplib.lab.bench.config import BenchConfig, SamplingConfig, check_requirements
from mtplib.lab.bench.runs import BenchRun, Quality, RangedSeam, SweepDraw
from mtplib.lab.bench.summary import BenchResult
from mtplib.lab.common.progress import bar as progress_bar
from mtplib.lab.correctness import seeded_prompt
from mtplib.lab.quality import compare_streams
from mtplib.runtime.backend import Backend
from mtplib.runtime.drafters import Drafter, SyntheticDrafter
from mtplib.runtime.results import GenerationMetrics
from mtplib.runtime.sampling import Sampler
from mtplib.runtime.settings import DecodeSettings
from mtplib.runtime.speculative import MTPRuntime

LOG = Callable[[str], None]


# -- helpers ----------------------------------------------------------------------------
def _prompt_tokens(rt: MTPRuntime, spec, n_vocab: int) -> list[int]:
    if isinstance(spec, str):
        return rt.trunk.tokenize(spec)
    return seeded_prompt(int(spec["seed"]), int(spec.get("len", 12)), n_vocab)


def _prompt_label(i: int, spec) -> str:
    return f"p{i}:seed{spec['seed']}" if isinstance(spec, dict) else f"p{i}:text"


def _agreement(ref: Sequence[int], got: Sequence[int]) -> float:
    n = max(len(ref), len(got))
    return sum(a == b for a, b in zip(ref, got, strict=False)) / n if n else 1.0



def _run(m: GenerationMetrics, **kw) -> BenchRun:
    """A BenchRun from a generation's metrics (what `generate` returns)."""
    return BenchRun(metrics=m, **kw)


class CostedSyntheticDrafter(Drafter):
    """Synthetic acceptance at the real drafting cost: the MTP block drafts (and is fed)
    every step as usual, then its drafts are replaced by the synthetic ones (the target's
    own continuation up to a length drawn with upstream's `--spec-synth-rates` semantics,
    see SyntheticDrafter)."""

    name = "synthetic+mtp"
    needs_rows = True

    def __init__(self, mtp: Drafter, synth: SyntheticDrafter) -> None:
        self.mtp, self.synth = mtp, synth

    def prefill(self, seq, tokens, rows):
        self.mtp.prefill(seq, tokens, rows)

    def propose(self, seq, last, base, k):
        self.mtp.propose(seq, last, base, k)
        return self.synth.propose(seq, last, base, k)

    def commit(self, seq, base, tokens, rows):
        self.mtp.commit(seq, base, tokens, rows)

    def truncate(self, seq, keep, last_row):
        self.mtp.truncate(seq, keep, last_row)


def _run_ranged(trunk: str, sidecar: str, plan: str, cfg: BenchConfig, refs: dict,
                settings: DecodeSettings, tick: Callable[[], object] = lambda: None
                ) -> list[BenchRun]:
    """MTP off / on on a layer-range plan over local RPC shards
    (mtplib.distributed.ranged_mtp): the same rows as the whole-model runs with ``plan``
    set and ``seam_bytes_per_token`` (bytes on all shard connections while generating, per
    generated token) measured by the shards' counting relays; ``seam_by_step`` keeps the
    per-step-kind figures."""
    from mtplib.distributed.ranged_mtp import RangedMTP
    from mtplib.runtime.engine_options import EngineOptions
    from mtplib.runtime.request import build_request

    rows = []
    # the plan's request, checked once (`build_request`): plan, WAN, TLS, policy, files
    req = build_request(trunk, sidecar=sidecar, plan=plan, policy=cfg.policy,
                        wan=cfg.wan_links(plan), tls=cfg.tls_config(), seam=cfg.seam)
    with RangedMTP(req) as r:
        for k in [0, *cfg.ks]:
            opts = EngineOptions(k=k, settings=settings)
            for i, spec in enumerate(cfg.prompts):
                prompt, ref, margins = refs[i]
                for rep in range(cfg.warmup + cfg.reps):
                    toks, m = r.generate(prompt, cfg.n_new, opts)
                    tick()
                    gen_bytes = sum(row["bytes"] for lab, row in m.seam_report["steps"].items()
                                    if lab not in ("load", "setup", "other", "prefill"))
                    rows.append(BenchRun(
                        rep=rep - cfg.warmup if rep >= cfg.warmup else None,
                        warmup=rep < cfg.warmup, n_new=cfg.n_new, mode="mtp" if k else "off",
                        k=k, prompt=_prompt_label(i, spec), plan=plan, threads=cfg.threads,
                        seam_bytes_per_token=gen_bytes / max(m.n_generated, 1), metrics=m,
                        ranged=RangedSeam(m.seam_bytes_per_token,
                                          m.seam_contract_min_per_token,
                                          m.mtp_placement, m.head, m.seam),
                        quality=_quality(ref, toks, margins, len(prompt))))
    return rows


# -- the benchmark ----------------------------------------------------------------------
def n_generations(cfg: BenchConfig) -> int:
    """How many generations `run_bench` makes for ``cfg`` (its progress bar's total)."""
    n_p, per = len(cfg.prompts), cfg.warmup + cfg.reps
    sampled = n_p * cfg.sampling.seeds if cfg.sampling else 0
    n = 0
    for plan in cfg.plans:
        if plan == "whole":  # MTP off: one traced reference pass per prompt, then timed
            n += n_p * (1 + per) + sampled + len(cfg.ks) * (n_p * per + sampled)
        else:
            n += (1 + len(cfg.ks)) * n_p * per
    if cfg.sweep:
        sw = cfg.sweep
        n += len(sw.ks) * len(sw.rates) * n_p * (sw.warmup + sw.reps)
    return n


def run_bench(trunk: str, sidecar: str, cfg: BenchConfig, *, log: LOG | None = None,
              progress: bool = False) -> BenchResult:
    """Measure MTP off vs on (per plan), the synthetic sweep and the sampling check.
    ``progress``: a bar (`mtplib.lab.common.progress.bar`) over the generations
    (`n_generations`)."""
    with progress_bar(n_generations(cfg), "bench", progress) as bar:
        return _run_bench(trunk, sidecar, cfg, log or (lambda s: None), lambda: bar.update())


def _run_bench(trunk: str, sidecar: str, cfg: BenchConfig, log: LOG,
               tick: Callable[[], object]) -> BenchResult:
    t_start = time.perf_counter()
    backend = check_requirements(cfg)
    settings = cfg.settings()
    runs: list[BenchRun] = []
    refs: dict[int, tuple[list[int], list[int], dict]] = {}
    prompts_info: list[dict] = []
    sampling_rows: list[dict] = []

    def timed(rt: Backend, tokens: list[int], n_new: int, warmup: int, reps: int,
              ref: list[int], margins: dict, **extra):
        for rep in range(warmup + reps):
            toks, m = rt.generate(tokens, n_new)
            tick()
            yield _run(m, rep=rep - warmup if rep >= warmup else None, warmup=rep < warmup,
                       n_new=n_new, quality=_quality(ref, toks, margins, len(tokens)), **extra)

    # the whole model first: its MTP-off pass is every plan's quality reference
    for plan in sorted(cfg.plans, key=lambda p: p != "whole"):
        if plan != "whole":
            if not refs:
                raise InputError("ranged plans need 'whole' in plans (the quality reference)")
            runs.extend(_run_ranged(trunk, sidecar, plan, cfg, refs, settings, tick))
            continue
        common = {"plan": "whole", "seam_bytes_per_token": None, "threads": cfg.threads}
        # MTP off: one traced reference pass per prompt (tokens + top-2 margins), untimed
        log("MTP off")
        with MTPRuntime(trunk, None, k=0, settings=settings) as rt:
            n_vocab = rt.trunk.n_vocab
            for i, spec in enumerate(cfg.prompts):
                prompt = _prompt_tokens(rt, spec, n_vocab)
                rt.engine.trace = True
                ref, ref_m = rt.generate(prompt, cfg.n_new)
                tick()
                rt.engine.trace = False
                refs[i] = (prompt, ref, ref_m.margins)
                prompts_info.append({"prompt": _prompt_label(i, spec), "n_prompt": len(prompt),
                                     "min_margin_off": min(ref_m.margins.values())})
                runs.extend(timed(rt, prompt, cfg.n_new, cfg.warmup, cfg.reps, ref,
                                  ref_m.margins, mode="off", k=0,
                                  prompt=_prompt_label(i, spec), **common))
            if cfg.sampling:
                off_streams = _sampled(rt, refs, cfg.sampling, tick)
        for k in cfg.ks:
            log(f"MTP on, k={k}")
            with MTPRuntime(trunk, sidecar, k=k, settings=settings, policy=cfg.policy) as rt:
                for i, spec in enumerate(cfg.prompts):
                    prompt, ref, margins = refs[i]
                    runs.extend(timed(rt, prompt, cfg.n_new, cfg.warmup, cfg.reps, ref,
                                      margins, mode="mtp", k=k,
                                      prompt=_prompt_label(i, spec), **common))
                if cfg.sampling:
                    on_streams = _sampled(rt, refs, cfg.sampling, tick)
                    sampling_rows.append(_sampling_row(k, off_streams, on_streams,
                                                       cfg.sampling))
    sweep_runs = _sweep(trunk, sidecar, cfg, refs, settings, log, tick) if cfg.sweep else []
    return BenchResult(config=cfg.to_dict(), runs=runs, sweep_runs=sweep_runs,
                       sampling=sampling_rows, backend=backend,
                       wall_s=time.perf_counter() - t_start, prompts=prompts_info,
                       model={"trunk": Path(trunk).name, "sidecar": Path(sidecar).name})


def _quality(ref, toks, margins, n_prompt) -> Quality:
    cmp = compare_streams(ref, toks, margins, n_prompt=n_prompt)
    return Quality(equal_to_off=cmp["equal"], token_agreement=_agreement(ref, toks),
                   first_divergence=cmp["first_divergence"], near_tie=cmp["near_tie"],
                   margin_at_divergence=cmp["margin_at_divergence"])


def _sampled(rt: MTPRuntime, refs: dict, sc: SamplingConfig,
             tick: Callable[[], object] = lambda: None) -> dict:
    old = rt.engine.sampler
    out = {}
    try:
        for i, (prompt, _, _) in refs.items():
            for seed in range(sc.seeds):
                rt.engine.sampler = Sampler(sc.temperature, sc.top_p, seed)
                toks, m = rt.generate(prompt, sc.n_new)
                tick()
                out[(i, seed)] = (toks, m)
    finally:
        rt.engine.sampler = old
    return out


def _sampling_row(k: int, off: dict, on: dict, sc: SamplingConfig) -> dict:
    equal = sum(off[key][0] == on[key][0] for key in off)
    c_off = Counter(t for toks, _ in off.values() for t in toks)
    c_on = Counter(t for toks, _ in on.values() for t in toks)
    n_off, n_on = sum(c_off.values()), sum(c_on.values())
    tv = 0.5 * sum(abs(c_off[t] / n_off - c_on[t] / n_on) for t in set(c_off) | set(c_on))
    drafted = sum(m.drafted for _, m in on.values())
    accepted = sum(m.accepted for _, m in on.values())
    return {"k": k, "temperature": sc.temperature, "top_p": sc.top_p, "streams": len(off),
            "n_new": sc.n_new, "equal_streams": equal, "tv_distance": tv,
            "sampled_tokens": n_on, "acceptance": accepted / drafted if drafted else None}


def _sweep(trunk, sidecar, cfg: BenchConfig, refs: dict, settings: DecodeSettings,
           log: LOG, tick: Callable[[], object] = lambda: None) -> list[BenchRun]:
    sc = cfg.sweep
    rows = []
    for k in sc.ks:
        log(f"sweep k={k}")
        use_mtp = sc.draft_cost == "mtp"
        placeholder = None if use_mtp else SyntheticDrafter([0], 1, [0.0], n_vocab=2)
        with MTPRuntime(trunk, sidecar if use_mtp else None, k=k, drafter=placeholder,
                        settings=settings, policy=cfg.policy) as rt:
            n_vocab = rt.trunk.n_vocab
            mtp = rt.engine.drafter
            for rate in sc.rates:
                for i, spec in enumerate(cfg.prompts):
                    prompt, ref, _ = refs[i]
                    for rep in range(sc.warmup + sc.reps):
                        # same seed every repetition: the same accept pattern, comparable times
                        synth = SyntheticDrafter(ref, len(prompt), [float(rate)],
                                                 n_vocab=n_vocab, seed=1000 * i + k)
                        rt.engine.drafter = CostedSyntheticDrafter(mtp, synth) if use_mtp \
                            else synth
                        toks, m = rt.generate(prompt, cfg.n_new)
                        tick()
                        rows.append(_run(
                            m, plan="whole", mode="synthetic", k=k,
                            sweep=SweepDraw(float(rate), sc.draft_cost, toks == ref),
                            prompt=_prompt_label(i, spec),
                            rep=rep - sc.warmup if rep >= sc.warmup else None,
                            warmup=rep < sc.warmup, threads=cfg.threads, n_new=cfg.n_new,
                            seam_bytes_per_token=None, quality_valid=False))
            rt.engine.drafter = mtp
    return rows
