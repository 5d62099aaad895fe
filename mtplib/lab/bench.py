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

Summaries (`summarize`, `sweep_summary`, `break_even`) are rows too; `save` writes every
row to ``bench.json`` (the raw metrics the evidence README is generated from), CSVs and
the plots of `mtplib.lab.bench_plots`.

Acceptance conventions: ``acceptance`` = accepted / drafted over all draft positions;
``acceptance_pos_i`` = accepted at draft position i / drafted at position i
(unconditional: position 2 counts as accepted only when positions 1 and 2 both are).
The sweep's x axis is the measured position-1 acceptance, the quantity of DeepSeek-V3's
"second-token acceptance" and of vLLM's first per-position figure (`REFERENCE_S9`, whose
sources are cited in `mtplib.lab.display.REFERENCES`).
"""

from __future__ import annotations

import json
import statistics
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import MISSING, asdict, dataclass, field, fields
from pathlib import Path

from mtplib.contract import labels
from mtplib.contract.capabilities import RouteRefused
from mtplib.contract.types import DRAFT_BOUNDS, DRAFT_RANGE
from mtplib.errors import InputError, UpstreamFault
from mtplib.files import write_json
from mtplib.lab import display as D
from mtplib.lab import tables
from mtplib.lab.correctness import seeded_prompt
from mtplib.lab.progress import bar as progress_bar
from mtplib.lab.quality import compare_streams
from mtplib.lab.sweep import SweepConfig, break_even, median_or_none
from mtplib.runtime.drafters import Drafter, SyntheticDrafter
from mtplib.runtime.results import GenerationMetrics
from mtplib.runtime.routing import resolve_policy, route
from mtplib.runtime.sampling import Sampler
from mtplib.runtime.settings import DecodeSettings
from mtplib.runtime.speculative import MTPRuntime

#: the published reference numbers (`mtplib.lab.display.REFERENCE_S9`)
REFERENCE_S9 = D.REFERENCE_S9
TIME_PARTS = labels.TIME_PARTS  # what the time split splits a token into
LOG = Callable[[str], None]


class BenchConfigError(InputError):
    """A malformed ``bench:`` section."""


# -- configuration ----------------------------------------------------------------------
@dataclass
class SamplingConfig:
    temperature: float = 1.0
    top_p: float = 0.95
    seeds: int = 4
    n_new: int = 16


@dataclass
class BenchConfig:
    """The ``bench:`` section of a lane (every key optional)."""

    ks: list[int] = field(default_factory=lambda: [1, 2, 3])
    plans: list[str] = field(default_factory=lambda: ["whole"])
    #: each prompt: a text (tokenized by the trunk) or {seed: N, len: L} (random token ids)
    prompts: list = field(default_factory=lambda: [{"seed": 0, "len": 12}])
    n_new: int = 48
    reps: int = 3
    warmup: int = 1
    threads: int | None = None  # None: the lane's threads
    n_ctx: int = 512
    backend: str = "cpu"  # cpu | gpu (a gpu lane stops cleanly on a build without a GPU)
    sweep: SweepConfig | None = field(default_factory=SweepConfig)
    sampling: SamplingConfig | None = None
    #: deployment policy (a name; None: the lane's, else $MTPLIB_POLICY, else beta). The
    #: bench compares MTP off with on: under a policy that disables MTP (alpha) it refuses
    #: to run (`check_requirements`) instead of measuring MTP off alone.
    policy: str | None = None
    #: ranged plans only: the emulated WAN in front of each shard, as `generate --wan`
    #: ("RTT_MS[:MBIT]" for every shard, or one per shard, comma-separated); None: loopback
    wan: str | None = None
    #: ranged plans only: a TLS directory (`mtplib tls init`): the local shards serve through
    #: their mutual-TLS gateways and the relays connect with TLS, as `generate --tls`
    tls: str | None = None

    @classmethod
    def from_dict(cls, d: dict | None, *, threads: int | None = None,
                  policy: str | None = None) -> BenchConfig:
        d = dict(d or {})
        if policy is not None and d.get("policy") not in (None, policy):
            raise BenchConfigError(f"bench: policy {d['policy']!r} differs from the lane's "
                                   f"policy {policy!r}")
        if policy is not None:
            d["policy"] = policy
        known = {f for f in cls.__dataclass_fields__}
        unknown = set(d) - known
        if unknown:
            raise BenchConfigError(f"bench: unknown keys {sorted(unknown)} "
                                   f"(known: {sorted(known)})")
        sweep = d.pop("sweep", {})
        sampling = d.pop("sampling", None)
        try:
            cfg = cls(**d)
            cfg.sweep = None if sweep is None or sweep is False else _sub(SweepConfig, sweep)
            cfg.sampling = None if not sampling else _sub(SamplingConfig, sampling)
        except TypeError as e:
            raise BenchConfigError(f"bench: {e}") from None
        if cfg.threads is None:
            cfg.threads = threads or 2
        try:
            cfg.policy = resolve_policy(cfg.policy).name
        except InputError as e:
            raise BenchConfigError(f"bench: {e}") from None
        cfg.validate()
        return cfg

    def validate(self) -> None:
        errs = []
        if not self.ks or any(int(k) not in DRAFT_RANGE for k in self.ks):
            errs.append(f"ks must be draft lengths in {DRAFT_BOUNDS}, got {self.ks}")
        if not self.plans:
            errs.append("plans must list at least one plan ('whole' or ranges like '0-1,2-3')")
        if not self.prompts:
            errs.append("prompts must list at least one prompt")
        for p in self.prompts:
            if not isinstance(p, str) and not (isinstance(p, dict) and "seed" in p):
                errs.append(f"a prompt is a text or {{seed: N, len: L}}, got {p!r}")
        if self.n_new < 2:
            errs.append(f"n_new must be >= 2, got {self.n_new}")
        if self.reps < 1 or self.warmup < 0:
            errs.append("reps must be >= 1 and warmup >= 0")
        if int(self.threads or 0) < 1:
            errs.append("threads must be >= 1")
        if self.backend not in ("cpu", "gpu"):
            errs.append(f"backend must be cpu or gpu, got {self.backend!r}")
        if self.sweep is not None:
            s = self.sweep
            if not s.rates or any(not 0.0 <= float(r) <= 1.0 for r in s.rates):
                errs.append(f"sweep.rates must be in [0, 1], got {s.rates}")
            if not s.ks or any(int(k) not in DRAFT_RANGE for k in s.ks):
                errs.append(f"sweep.ks must be in {DRAFT_BOUNDS}, got {s.ks}")
            if s.reps < 1 or s.warmup < 0:
                errs.append("sweep.reps must be >= 1 and sweep.warmup >= 0")
            if s.draft_cost not in ("mtp", "none"):
                errs.append(f"sweep.draft_cost must be mtp or none, got {s.draft_cost!r}")
        if self.tls is not None and (not isinstance(self.tls, str) or not self.tls):
            errs.append(f"tls must be a directory (mtplib tls init DIR), got {self.tls!r}")
        if errs:
            raise BenchConfigError("bench: " + "; ".join(errs))
        self.tls_config()  # a missing file stops the bench before anything runs

    def tls_config(self):
        """The `TlsConfig` of ``tls`` with both sides' files checked (None without it)."""
        if self.tls is None:
            return None
        from mtplib.distributed.tls import TlsConfig

        try:
            cfg = TlsConfig.load(self.tls)
            cfg.server_context()
            cfg.client_context()
        except InputError as e:
            raise BenchConfigError(f"bench: tls: {e}") from None
        return cfg

    def to_dict(self) -> dict:
        return asdict(self)

    def settings(self) -> DecodeSettings:
        """The context every run of the bench gets: the section's n_ctx and threads, the
        C API's defaults otherwise (the section keeps its keys; lanes write them)."""
        return DecodeSettings(n_ctx=self.n_ctx, n_threads=int(self.threads))


def _sub(cls, d: dict):
    if not isinstance(d, dict):
        raise BenchConfigError(f"bench: expected a mapping for {cls.__name__}, got {d!r}")
    return cls(**d)


# -- requirements -----------------------------------------------------------------------
class MissingCapability(UpstreamFault):
    """The lane needs what this machine or build lacks (a GPU backend, ...)."""


def check_requirements(cfg: BenchConfig) -> dict:
    """The build's backends and devices; raises RouteRefused if the policy refuses an MTP
    row (alpha: every one), MissingCapability if the lane needs a GPU and the build has
    none (``llama_supports_gpu_offload()`` alone is not enough: it is true on a CPU build
    with the RPC backend)."""
    from mtplib.runtime.devices import backend_info

    for k in cfg.ks:
        try:
            route(int(k), policy=cfg.policy)
        except RouteRefused as e:
            raise RouteRefused(f"bench: {e}; the bench compares MTP off with MTP on, so it "
                               "does not run under this policy") from None

    info = backend_info()
    if cfg.backend == "gpu" and not info["gpu_devices"]:
        raise MissingCapability(
            "this lane needs a GPU build of llama.cpp (e.g. CMAKE_ARGS='-DGGML_CUDA=ON "
            f"-DGGML_RPC=ON'); the installed build has only {info['backends']} devices "
            f"{[d['name'] for d in info['devices']]}, so the lane stops here")
    return info


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
    where the MTP block and the output head ran (None: not recorded)."""

    seam_by_step: dict[str, float]
    seam_contract_min: dict[str, int]
    mtp_placement: str | None = None
    head: str | None = None


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
            row.update({k: v for k, v in asdict(self.ranged).items()
                        if v is not None or k.startswith("seam")})
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


def _typed(rows: Sequence[BenchRun | dict]) -> list[BenchRun]:
    """Rows as BenchRuns (rows read back from bench.json are dicts)."""
    return [r if isinstance(r, BenchRun) else BenchRun.from_dict(r) for r in rows]


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
    from mtplib.runtime.speculative import EngineOptions

    rows = []
    with RangedMTP(trunk, plan=plan, sidecar=sidecar, policy=cfg.policy, wan=cfg.wan,
                   tls=cfg.tls_config()) as r:
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
                                          m.mtp_placement, m.head),
                        quality=_quality(ref, toks, margins, len(prompt))))
    return rows


# -- the benchmark ----------------------------------------------------------------------
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
        self.runs, self.sweep_runs = _typed(self.runs), _typed(self.sweep_runs)

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
    ``progress``: a `tqdm.auto` bar over the generations (`n_generations`)."""
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

    def timed(rt: MTPRuntime, tokens: list[int], n_new: int, warmup: int, reps: int,
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
    runs = _typed(runs)
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
    off = _off_medians(_typed(runs))
    out = []
    groups = _group(_typed(sweep_runs), lambda r: (r.plan, r.k, r.sweep.rate))
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


# -- saving (the plots: mtplib.lab.bench_plots) ------------------------------------------
#: bench.json's tables, each also written as ``bench_<name>.csv``
TABLES = ("summary", "sweep", "break_even", "runs", "sweep_runs", "sampling")


def write_csvs(data: dict, out_dir: str | Path) -> dict[str, Path]:
    """One tidy CSV per table of bench.json's ``data`` (`mtplib.lab.tables`: lists and
    dicts spread over columns, ``rep`` an integer with an empty cell for warm-up runs)."""
    out = Path(out_dir)
    return {name: tables.to_csv(data[name], out / f"bench_{name}.csv") for name in TABLES}


def save(result: BenchResult, out_dir: str | Path, *, plots: bool = True) -> dict[str, Path]:
    """Write bench.json (all raw rows + summaries), one CSV per table, and the plots."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    data = result.to_json()
    paths = {"json": out / "bench.json"}
    write_json(paths["json"], data, indent=2, sort_keys=True)
    paths.update(write_csvs(data, out))
    if plots:
        from mtplib.lab.bench_plots import figures

        pdir = out / "plots"
        pdir.mkdir(exist_ok=True)
        for name, fig in figures(data).items():
            p = pdir / f"{name}.png"
            fig.savefig(p, dpi=110, bbox_inches="tight")
            paths[f"plot_{name}"] = p
    return paths


def load(out_dir: str | Path) -> dict:
    return json.loads((Path(out_dir) / "bench.json").read_text())
