"""Ranged MTP over an emulated WAN: tokens/s against round-trip time, and why.

Every shard of a plan runs behind a counting relay that delays each chunk by half the RTT
each way (`mtplib.distributed.relay.WanLink`). Two topologies: ``remote`` (every shard
behind the WAN) and ``tail_local`` (the tail shard co-located with the client: its relay has
no delay). Two drafter placements: the MTP block on the tail shard or in the client. For
each (plan, topology, placement) one set of shards and one loaded model serve every RTT and
draft length; MTP off is measured on the same connections.

Two modes. ``warm``: one `RangedMTP` (the object `mtplib serve` holds) serves every
generation of a configuration; its engines are warmed at load, never on a measured prompt.
``cold``: one `mtplib generate --json` process per generation with the CLI's default options
(drafter and head placement, upstream build, context size), as a user runs it; only
``--plan``, ``--mtp/--draft`` and ``--wan`` are given.

Each run records tokens/s, tokens per verify step, waits (synchronous round trips) per step
kind, data bytes per step kind by class (`mtplib.contract.wire`) and the cache bytes that
crossed a shard connection (must be 0: the contract's shard-local rule). The cost model
``t_token = compute + RTT x waits_per_token + bytes / bandwidth`` is fitted per
configuration on some RTTs and checked on the others (`fit_cost_model`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import numpy as np

from mtplib.contract import labels
from mtplib.contract.labels import DECODING_STEPS, StepKind
from mtplib.contract.types import MAX_DRAFT, draft_problem
from mtplib.distributed.results import RangedMetrics
from mtplib.errors import InputError
from mtplib.files import write_json
from mtplib.lab.rows import row_from_dict, typed
from mtplib.lab.sweep import median_or_none

TOPOLOGIES = ("remote", "tail_local")
MODES = ("warm", "cold")
#: the step kinds of the decoding phase (after the prompt), whose waits a token pays
DECODE_PHASES = DECODING_STEPS
PLACEMENTS = labels.PLACEMENTS
LOG = Callable[[str], None]


@dataclass
class WanConfig:
    """What `run_wan` measures (a lane's ``wan:`` section; every key optional)."""

    rtts_ms: list[float] = field(default_factory=lambda: [0, 10, 25, 50, 100, 200])
    ks: list[int] = field(default_factory=lambda: [0, 1, 2, 3])  # 0 = MTP off
    plans: list[str] = field(default_factory=lambda: ["0-1,2-3", "0-0,1-2,3-3"])
    topologies: list[str] = field(default_factory=lambda: list(TOPOLOGIES))
    placements: list[str] = field(default_factory=lambda: list(PLACEMENTS))
    head: str = "auto"  # where the output head runs (EngineOptions.head; auto: client)
    n_prompts: int = 4  # held-out prompts of the trained pair (prompts_from, seed 0)
    prompt_len: int = 48
    n_new: int = 24
    reps: int = 1
    #: untimed warm-mode generations per draft length before the sweep, on a held-out
    #: prompt that is not measured (engines are warmed at load anyway: default 0)
    warmup: int = 0
    #: None: the CLI's default (min(2048, the model's context_length)), in both modes
    n_ctx: int | None = None
    modes: list[str] = field(default_factory=lambda: ["warm"])
    #: the cold mode's grid (one CLI process per generation costs seconds of start-up each)
    cold_rtts_ms: list[float] = field(default_factory=lambda: [100])
    cold_ks: list[int] = field(default_factory=lambda: [0, 2])
    threads: int = 1  # client threads (the shards get shard_threads)
    shard_threads: int = 1
    fit_rtts_ms: list[float] = field(default_factory=lambda: [0, 10, 25, 50])
    #: a cost-model prediction is good when within this fraction of the measurement
    cost_model_tolerance: float = 0.15
    upstream: str = "stock"  # which build ran (recorded; chosen by MTPLIB_UPSTREAM)

    def __post_init__(self) -> None:
        bad = [t for t in self.topologies if t not in TOPOLOGIES]
        bad += [p for p in self.placements if p not in PLACEMENTS]
        bad += [m for m in self.modes if m not in MODES]
        if bad:
            raise InputError(f"wan: unknown topology/placement/mode {bad}; topologies "
                             f"{TOPOLOGIES}, placements {PLACEMENTS}, modes {MODES}")
        if any(draft_problem("k", k) for k in [*self.ks, *self.cold_ks]):
            raise InputError(f"wan: ks and cold_ks must be in 0..{MAX_DRAFT}, got {self.ks}, "
                             f"{self.cold_ks}")
        if any(not 0 <= r <= 10_000 for r in [*self.rtts_ms, *self.cold_rtts_ms]):
            raise InputError(f"wan: rtts_ms and cold_rtts_ms must be in 0..10000, got "
                             f"{self.rtts_ms}, {self.cold_rtts_ms}")
        if self.warmup < 0:
            raise InputError(f"wan: warmup must be >= 0, got {self.warmup}")
        for name in ("n_prompts", "prompt_len", "n_new", "reps", "threads", "shard_threads"):
            if int(getattr(self, name)) < 1:
                raise InputError(f"wan: {name} must be >= 1, got {getattr(self, name)}")
        if self.n_ctx is not None and self.prompt_len + self.n_new + 8 > self.n_ctx:
            raise InputError(f"wan: prompt_len + n_new ({self.prompt_len + self.n_new}) do not "
                             f"fit n_ctx {self.n_ctx}")

    @classmethod
    def from_dict(cls, d: dict | None) -> WanConfig:
        d = dict(d or {})
        unknown = set(d) - {f for f in cls.__dataclass_fields__}
        if unknown:
            raise InputError(f"wan: unknown keys {sorted(unknown)}; known: "
                             f"{sorted(cls.__dataclass_fields__)}")
        return cls(**d)


def links_for(topology: str, n_shards: int, rtt_ms: float) -> list:
    from mtplib.distributed.relay import WanLink

    if topology == "remote":
        return [WanLink(rtt_ms)] * n_shards
    return [WanLink(rtt_ms)] * (n_shards - 1) + [WanLink()]


def wan_arg(topology: str, n_shards: int, rtt_ms: float) -> str:
    """The ``--wan`` value of `mtplib generate` for a topology (one RTT per shard)."""
    return ",".join(f"{w.rtt_ms:g}" for w in links_for(topology, n_shards, rtt_ms))


def trained_prompts(n: int, length: int) -> list[list[int]]:
    """``n`` held-out prompts of the committed trained pair (the stdlib modules it never
    saw in training), as `mtplib.lab.trained_eval` measures acceptance on."""
    from mtplib.lab.trained_eval import heldout_modules, heldout_tokens, prompts_from
    from mtplib.model.trained import trained_paths

    pair = trained_paths()
    docs = heldout_tokens(pair.trunk, heldout_modules())
    return prompts_from(docs, n=n, length=length, seed=0)


@dataclass(frozen=True)
class WanRun:
    """One generation of the WAN benchmark: a row of wan.json's ``rows``. Built typed
    (`_row`) and read typed (`from_dict`, by the summaries); a dict in the file only."""

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

    def to_dict(self) -> dict:
        """The row as wan.json holds it (a cold run's process fields after ``rep``)."""
        d = asdict(self)
        head = {f: d.pop(f) for f in ("mode", "plan", "topology", "placement", "rtt_ms", "k",
                                      "prompt", "rep")}
        cold = {f: d.pop(f) for f in ("process_wall_s", "exit")}
        return {**head, **(cold if self.mode == "cold" else {}), **d}

    @classmethod
    def from_dict(cls, r: dict) -> WanRun:
        """A row of any committed wan.json (the oldest lack mode, build, patches, setup)."""
        return row_from_dict(cls, {"mode": "warm", "build": None, "patches": [],
                                   "setup_s": None, **r}, "a WAN row")


def _typed(rows: Sequence[WanRun | dict]) -> list[WanRun]:
    return typed(WanRun, rows)


def _row(m: RangedMetrics, tokens: list[int], **kw) -> dict:
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
        tokens=tokens).to_dict()


def _decode_waits(m: RangedMetrics) -> float | None:
    """Waits of the decoding phase (every step kind but prefill), per generated token."""
    tot = 0.0
    for label, w in m.waits_per_step.items():
        if label in DECODE_PHASES and w:
            tot += w * m.steps_by_label.get(label, 0)
    n = m.n_generated - 1
    return tot / n if n > 0 else None


def _settings(cfg: WanConfig, trunk: str):
    from mtplib.runtime.settings import DecodeSettings

    return DecodeSettings(n_ctx=cfg.n_ctx or default_ctx(trunk), n_threads=cfg.threads)


def default_ctx(trunk: str) -> int:
    """The context size `mtplib generate` uses without --ctx, so both modes run alike."""
    from mtplib.model.gguf_header import read_header_fast

    ctx_len = int(read_header_fast(trunk).kv.get("deepseek4.context_length", 2048))
    return min(2048, ctx_len)


def _n_runs(cfg: WanConfig, n_prompts: int) -> int:
    groups = len(cfg.plans) * len(cfg.topologies)
    n = 0
    if "warm" in cfg.modes:
        ks_on = sum(1 for k in cfg.ks if k) * len(cfg.placements)
        n += (ks_on + sum(1 for k in cfg.ks if not k)) * len(cfg.rtts_ms) * groups
    if "cold" in cfg.modes:
        n += len(cfg.cold_ks) * len(cfg.cold_rtts_ms) * groups
    return n * n_prompts * cfg.reps


def run_wan(trunk: str, sidecar: str, cfg: WanConfig, prompts: Sequence[Sequence[int]], *,
            log: LOG | None = None, progress: Callable[[int, int], None] | None = None,
            warm_prompt: Sequence[int] | None = None) -> dict:
    """Measure every configuration of ``cfg`` in each of its modes; returns {"config",
    "rows", "wall_s"}. ``warm_prompt``: the held-out prompt of ``cfg.warmup``'s untimed
    generations (never one that is measured)."""
    log = log or (lambda s: None)
    t0 = time.time()
    rows: list[dict] = []
    total = _n_runs(cfg, len(prompts))
    count = {"done": 0}

    def tick() -> None:
        count["done"] += 1
        if progress:
            progress(count["done"], total)

    if "warm" in cfg.modes:
        _run_warm(trunk, sidecar, cfg, prompts, rows, log, tick, warm_prompt)
    if "cold" in cfg.modes:
        _run_cold(trunk, sidecar, cfg, prompts, rows, log, tick)
    return {"config": asdict(cfg), "rows": rows, "wall_s": time.time() - t0}


def _run_warm(trunk, sidecar, cfg, prompts, rows, log, tick, warm_prompt) -> None:
    """One RangedMTP per (plan, topology, placement), every RTT and k on it."""
    from mtplib.distributed.ranged_mtp import RangedMTP
    from mtplib.runtime import selected_upstream
    from mtplib.runtime.speculative import EngineOptions

    settings = _settings(cfg, trunk)
    # the stock build moves cache state with MTP on: measured deliberately, for comparison
    crossing = selected_upstream() == "stock"
    for plan in cfg.plans:
        for topo in cfg.topologies:
            for place in cfg.placements:
                log(f"warm: plan {plan}, {topo}, MTP on the {place}")
                first = EngineOptions(k=max(cfg.ks), settings=settings, head=cfg.head)
                with RangedMTP(trunk, plan=plan, sidecar=sidecar, mtp_placement=place,
                               shard_threads=cfg.shard_threads, opts=first,
                               allow_cache_crossing=crossing) as r:
                    relays = r.rt.relays.relays
                    if warm_prompt is not None:
                        for k in cfg.ks:  # untimed, on a prompt that is not measured
                            opts = EngineOptions(k=k, settings=settings, head=cfg.head)
                            for _ in range(cfg.warmup):
                                r.generate(list(warm_prompt), cfg.n_new, opts)
                    for rtt in cfg.rtts_ms:
                        for relay, link in zip(relays, links_for(topo, len(relays), rtt),
                                               strict=True):
                            relay.set_link(link)
                        for k in cfg.ks:
                            if k == 0 and place != cfg.placements[0]:
                                continue  # MTP off does not depend on the drafter's place
                            opts = EngineOptions(k=k, settings=settings, head=cfg.head)
                            for pi, prompt in enumerate(prompts):
                                for rep in range(cfg.reps):
                                    toks, m = r.generate(list(prompt), cfg.n_new, opts)
                                    rows.append(_row(m, toks, mode="warm", plan=plan,
                                                     topology=topo,
                                                     placement=place if k else "-",
                                                     rtt_ms=rtt, k=k, prompt=pi, rep=rep))
                                    tick()
                            _log_cell(log, rows, len(prompts) * cfg.reps, rtt, k)


def cli_generate(trunk: str, sidecar: str | None, *, plan: str, k: int, tokens: Sequence[int],
                 n_new: int, wan: str, n_ctx: int | None = None) -> list[str]:
    """The `mtplib generate` command line of one cold run: the CLI's defaults except the
    model, the plan, MTP and the emulated WAN (and --ctx only if the config fixes one)."""
    import shutil
    import sys

    exe = Path(sys.executable).with_name("mtplib")
    cmd = [str(exe)] if exe.is_file() else (
        [shutil.which("mtplib")] if shutil.which("mtplib") else
        [sys.executable, "-m", "mtplib.cli"])
    cmd += ["generate", "--model", trunk, "--plan", plan, "--tokens",
            ",".join(str(int(t)) for t in tokens), "--n", str(n_new), "--wan", wan, "--json"]
    if k:
        cmd += ["--mtp", str(sidecar), "--draft", str(k)]
    if n_ctx is not None:
        cmd += ["--ctx", str(n_ctx)]
    return cmd


def _run_cold(trunk, sidecar, cfg, prompts, rows, log, tick) -> None:
    """One fresh `mtplib generate` process per generation (shards started by it, as a user
    without --endpoints gets them); its wall time is recorded beside its own metrics."""
    import json
    import subprocess

    from mtplib.runtime import selected_upstream

    ks = cfg.cold_ks
    if selected_upstream() == "stock" and any(ks):
        # the CLI refuses MTP on the stock build by default (cache state would cross a
        # seam): a user gets exit 2, not a measurement
        log("cold: the stock build refuses ranged MTP by default; MTP off only")
        ks = [k for k in ks if not k]
    for plan in cfg.plans:
        n_shards = plan.count(",") + 1
        for topo in cfg.topologies:
            for rtt in cfg.cold_rtts_ms:
                wan = wan_arg(topo, n_shards, rtt)
                for k in ks:
                    log(f"cold: plan {plan}, {topo}, rtt {rtt:g} ms, k={k}")
                    for pi, prompt in enumerate(prompts):
                        for rep in range(cfg.reps):
                            cmd = cli_generate(trunk, sidecar, plan=plan, k=k, tokens=prompt,
                                               n_new=cfg.n_new, wan=wan, n_ctx=cfg.n_ctx)
                            t0 = time.time()
                            p = subprocess.run(cmd, capture_output=True, text=True,
                                               timeout=900)
                            wall = time.time() - t0
                            try:
                                out = json.loads(p.stdout.strip().splitlines()[-1])
                            except (json.JSONDecodeError, IndexError):
                                out = {"error": (p.stderr or p.stdout)[-600:]}
                            if "error" in out or p.returncode not in (0, 3):
                                raise InputError(f"cold run failed (exit {p.returncode}): "
                                                 f"{' '.join(cmd[:12])} ...: "
                                                 f"{out.get('error')}")
                            m = RangedMetrics.from_dict(out["metrics"])  # the CLI's JSON
                            rows.append(_row(m, out["tokens"], mode="cold", plan=plan,
                                             topology=topo,
                                             placement=(m.mtp_placement or "-") if k
                                             else "-", rtt_ms=rtt, k=k, prompt=pi, rep=rep,
                                             process_wall_s=wall, exit=p.returncode))
                            tick()
                    _log_cell(log, rows, len(prompts) * cfg.reps, rtt, k)


def _log_cell(log, rows, n, rtt, k) -> None:
    med = median_or_none(x.decode_tok_s for x in _typed(rows[-n:]))
    log(f"  rtt {rtt:g} ms k={k}: " + ("n/a" if med is None else f"{med:.2f}") + " tok/s")


# ---------------------------------------------------------------------------------------
# summaries
# ---------------------------------------------------------------------------------------
def _key(r: WanRun) -> tuple:
    return (r.mode, r.plan, r.topology, r.placement, r.k)


def _spread(xs) -> dict:
    """n, median, min, max and the interquartile range of the values that are not None."""
    v = [float(x) for x in xs if x is not None]
    if not v:
        return {"n": 0, "median": None, "min": None, "max": None, "p25": None, "p75": None}
    q = np.percentile(v, [25, 50, 75])
    return {"n": len(v), "median": float(q[1]), "min": min(v), "max": max(v),
            "p25": float(q[0]), "p75": float(q[2])}


def summarize(rows: Sequence[WanRun | dict]) -> list[dict]:
    """Per (mode, plan, topology, placement, k, RTT): n runs, tok/s (median and spread), the
    speed-up over MTP off of the same mode/plan/topology/RTT (ratio of medians, and the
    spread of the per-prompt paired ratios), tokens per verify step, waits per token, cache
    bytes crossing summed over every run, identical tokens."""
    rows = _typed(rows)
    off: dict[tuple, list[WanRun]] = {}
    for r in rows:
        if r.k == 0:
            off.setdefault((r.mode, r.plan, r.topology, r.rtt_ms), []).append(r)
    out = []
    groups: dict[tuple, list[WanRun]] = {}
    for r in rows:
        groups.setdefault((*_key(r), r.rtt_ms), []).append(r)
    for (mode, plan, topo, place, k, rtt), rs in sorted(groups.items(), key=lambda kv: (
            kv[0][0], kv[0][1], kv[0][2], str(kv[0][3]), kv[0][4], kv[0][5])):
        ref = off.get((mode, plan, topo, rtt), [])
        sp = _spread(x.decode_tok_s for x in rs)
        tok_s = sp["median"]
        off_tok_s = median_or_none(x.decode_tok_s for x in ref)
        tps = median_or_none(x.tokens_per_step for x in rs)
        by_run = {(y.prompt, y.rep): y for y in ref}
        pairs = [(x, by_run[(x.prompt, x.rep)]) for x in rs if (x.prompt, x.rep) in by_run]
        same = [x.tokens == y.tokens for x, y in pairs]
        paired = _spread(x.decode_tok_s / y.decode_tok_s for x, y in pairs
                         if x.decode_tok_s and y.decode_tok_s)
        drafted = sum(x.drafted for x in rs)
        out.append({
            "mode": mode, "plan": plan, "topology": topo, "placement": place, "k": k,
            "rtt_ms": rtt, "runs": len(rs),
            "builds": ",".join(sorted({str(x.build) for x in rs})),
            "tok_s": tok_s, "tok_s_min": sp["min"], "tok_s_max": sp["max"],
            "tok_s_p25": sp["p25"], "tok_s_p75": sp["p75"], "off_tok_s": off_tok_s,
            "speedup": tok_s / off_tok_s if tok_s and off_tok_s else None,
            "speedup_paired_median": paired["median"] if k else None,
            "speedup_paired_min": paired["min"] if k else None,
            "speedup_paired_max": paired["max"] if k else None,
            "tokens_per_step": tps,
            "speedup_over_ideal": (tok_s / off_tok_s / tps) if tok_s and off_tok_s and tps
            else None,
            "acceptance": sum(x.accepted for x in rs) / drafted if drafted else None,
            "ttft_s": median_or_none(x.ttft_s for x in rs),
            "setup_s": median_or_none(x.setup_s for x in rs),
            "process_wall_s": median_or_none(x.process_wall_s for x in rs),
            "waits_per_token": median_or_none(x.waits_decode_phase for x in rs),
            "waits_per_verify": median_or_none(x.waits_per_step.get(StepKind.VERIFY)
                                               for x in rs),
            "waits_per_plain": median_or_none(x.waits_per_step.get(StepKind.DECODE)
                                              for x in rs),
            "waits_per_draft": median_or_none(x.waits_per_step.get(StepKind.DRAFT)
                                              for x in rs),
            "cache_bytes_crossing": sum(x.cache_bytes_crossing for x in rs),
            "identical_to_off": all(same) if same else None,
        })
    return out


def bytes_by_class(rows: Sequence[WanRun | dict]) -> list[dict]:
    """Per configuration and step kind: data bytes per generated token (after the first,
    which the prefill emits) by class (first RTT, all prompts; bytes do not depend on the
    RTT)."""
    rows = _typed(rows)
    out = []
    seen = set()
    for r in rows:
        key = _key(r)
        if key in seen:
            continue
        seen.add(key)
        same = [x for x in rows if _key(x) == key and x.rtt_ms == r.rtt_ms]
        for label in sorted({lb for x in same for lb in x.wire_bytes_by_class}):
            agg: dict[str, float] = {}
            for x in same:
                for c, b in x.wire_bytes_by_class.get(label, {}).items():
                    agg[c] = agg.get(c, 0) + b
            n_tok = sum(max(x.n_generated - 1, 0) for x in same)
            out.append({"mode": key[0], "plan": key[1], "topology": key[2],
                        "placement": key[3], "k": key[4], "step": label,
                        **{c: v / max(n_tok, 1) for c, v in agg.items()}})
    return out


def fit_cost_model(summary: list[dict], fit_rtts: Sequence[float]) -> list[dict]:
    """Per configuration: fit ``s_per_token = compute + RTT x w`` (least squares) on the
    ``fit_rtts`` points, predict the other RTTs, report the relative error of each
    prediction and the fitted w next to the measured waits per token."""
    by: dict[tuple, list[dict]] = {}
    for s in summary:
        if s["tok_s"]:
            by.setdefault((s.get("mode", "warm"), s["plan"], s["topology"], s["placement"],
                           s["k"]), []).append(s)
    out = []
    fit_set = {float(x) for x in fit_rtts}
    for key, ss in sorted(by.items(), key=lambda kv: (kv[0][0], kv[0][1], kv[0][2],
                                                       str(kv[0][3]), kv[0][4])):
        fit = [s for s in ss if float(s["rtt_ms"]) in fit_set]
        test = [s for s in ss if float(s["rtt_ms"]) not in fit_set]
        if len(fit) < 2:
            continue
        x = np.array([s["rtt_ms"] / 1000 for s in fit])
        y = np.array([1 / s["tok_s"] for s in fit])
        w, c = np.polyfit(x, y, 1)
        for s in test:
            pred = c + w * s["rtt_ms"] / 1000
            meas = 1 / s["tok_s"]
            out.append({"mode": key[0], "plan": key[1], "topology": key[2],
                        "placement": key[3], "k": key[4],
                        "rtt_ms": s["rtt_ms"], "compute_s_per_token": float(c),
                        "fitted_waits_per_token": float(w),
                        "measured_waits_per_token": s["waits_per_token"],
                        "predicted_s_per_token": float(pred), "measured_s_per_token": meas,
                        "rel_error": float(abs(pred - meas) / meas)})
    return out


def targets(summary: list[dict], *, rtt_ms: float = 100, k: int = 2,
            plan: str = "0-1,2-3") -> list[dict]:
    """The targets at one RTT: speed-up against tokens per verify step (the CLI with its
    defaults in a fresh process, ``cold``: >= 0.85 in both topologies; warm: >= 0.85 with
    the tail co-located, >= 0.70 with every shard remote and the drafter in the client),
    waits per verify step against a plain step's (+0 with the head in the client), and
    cache bytes crossing (0)."""
    want = {("warm", "tail_local", "tail"): 0.85, ("warm", "tail_local", "client"): 0.85,
            ("warm", "remote", "client"): 0.70, ("warm", "remote", "tail"): None,
            ("cold", "tail_local", "client"): 0.85, ("cold", "remote", "client"): 0.85}
    plain = {(s.get("mode", "warm"), s["plan"], s["topology"], s["rtt_ms"]):
             s["waits_per_plain"] for s in summary if s["k"] == 0}
    out = []
    for s in summary:
        if (s["rtt_ms"], s["k"], s["plan"]) != (rtt_ms, k, plan):
            continue
        mode = s.get("mode", "warm")
        goal = want.get((mode, s["topology"], s["placement"]))
        ratio = s["speedup_over_ideal"]
        # the MTP-off run's plain step
        base = plain.get((mode, s["plan"], s["topology"], s["rtt_ms"]))
        extra = (s["waits_per_verify"] - base
                 if s["waits_per_verify"] is not None and base is not None else None)
        out.append({"mode": mode, "plan": plan, "topology": s["topology"],
                    "placement": s["placement"], "runs": s["runs"],
                    "speedup_paired_min": s.get("speedup_paired_min"),
                    "speedup_paired_max": s.get("speedup_paired_max"),
                    "k": k, "rtt_ms": rtt_ms, "speedup": s["speedup"],
                    "waits_per_verify": s["waits_per_verify"], "waits_per_plain_off": base,
                    "tokens_per_step": s["tokens_per_step"], "speedup_over_ideal": ratio,
                    "goal": goal, "met": None if goal is None or ratio is None
                    else bool(ratio >= goal),
                    "extra_waits_per_verify": extra,
                    "cache_bytes_crossing": s["cache_bytes_crossing"],
                    "identical_to_off": s["identical_to_off"]})
    return out


def with_upstream(cfg: WanConfig) -> WanConfig:
    """``cfg`` with the build this process loads recorded in it."""
    from mtplib.runtime import selected_upstream

    return replace(cfg, upstream=selected_upstream())


# ---------------------------------------------------------------------------------------
# files and plots
# ---------------------------------------------------------------------------------------
WAN_JSON = "wan.json"


def build_of(result: dict) -> str | None:
    """The upstream build a results file measured (its ``upstream``, else its config's)."""
    return (result.get("upstream") or {}).get("build") or result["config"].get("upstream")


def write_summary_csv(data: dict, out_dir) -> Path:
    """``wan_summary.csv``: the summary rows with the ``build`` they measured first (a
    run's builds sit in sibling folders; concatenated CSVs stay apart)."""
    from mtplib.lab import tables

    return tables.to_csv(data["summary"], Path(out_dir) / "wan_summary.csv",
                         build=build_of(data))


def save(result: dict, out_dir) -> dict:
    """Write ``wan.json`` (config, raw rows, summary, bytes by class, cost-model check,
    targets) and ``wan_summary.csv`` into ``out_dir``; returns their paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    summary = summarize(result["rows"])
    cost = fit_cost_model(summary, result["config"]["fit_rtts_ms"])
    tol = result["config"].get("cost_model_tolerance", 0.15)
    data = {**result, "summary": summary, "bytes_by_class": bytes_by_class(result["rows"]),
            "cost_model": cost, "targets": targets(summary),
            "cost_model_check": {
                "predictions": len(cost), "tolerance": tol,
                "within_tolerance": sum(c["rel_error"] <= tol for c in cost),
                "worst_rel_error": max((c["rel_error"] for c in cost), default=None)}}
    p = out / WAN_JSON
    write_json(p, data, indent=1, default=str)
    return {"json": p, "csv": write_summary_csv(data, out)}


def resummarize(out_dir) -> dict:
    """Rewrite a results folder's derived sections (summary, bytes, cost model, targets)
    from its raw rows with this code; the measurement (rows, config, upstream) is kept."""
    d = load(out_dir)
    keep = {k: d[k] for k in ("config", "rows", "wall_s", "upstream") if k in d}
    save(keep, out_dir)
    return load(out_dir)


def build_dirs(run_dir) -> dict[str, Path]:
    """build -> its results folder under ``run_dir``: ``<build>/wan.json`` (what `run_builds`
    writes into its folder) or ``wan/<build>/wan.json`` (a lane's run folder)."""
    run = Path(run_dir)
    for base in (run, run / "wan"):
        found = {p.parent.name: p.parent for p in sorted(base.glob(f"*/{WAN_JSON}"))}
        if found:
            return found
    return {}


def load(out_dir) -> dict:
    """One build's results (``out_dir/wan.json``). A folder that holds one results folder
    per build instead is named in the error, with `load_builds` to read them all."""
    import json

    p = Path(out_dir) / WAN_JSON
    if not p.is_file():
        subs = build_dirs(out_dir)
        if subs:
            names = ", ".join(str(d) for d in subs.values())
            raise InputError(f"{p} not found: {out_dir} holds one results folder per build "
                             f"({names}); load one of those, or all with "
                             "mtplib.lab.wan.load_builds(run_dir) (as DataFrames: "
                             "mtplib.records.load(run_dir))")
        raise InputError(f"{p} not found: run the WAN benchmark first (notebook 05_wan)")
    return json.loads(p.read_text())


def load_builds(run_dir) -> dict[str, dict]:
    """build -> its results, for every build's folder under ``run_dir`` (`build_dirs`)."""
    subs = build_dirs(run_dir)
    if not subs:
        raise InputError(f"no {WAN_JSON} under {run_dir} (looked in <build>/ and "
                         "wan/<build>/): run the WAN benchmark first (notebook 05_wan)")
    return {b: load(d) for b, d in subs.items()}


#: the model every WAN run measures (mtplib.model.trained: the committed trained pair)
WAN_MODEL = "trained tiny V4 pair"


def _rtt_series(rows: list[dict]) -> list[tuple[str, str, int]]:
    return sorted({(s["topology"], s["placement"], s["k"]) for s in rows},
                  key=lambda t: (t[0], t[2] > 0, str(t[1]), t[2]))


def _rtt_colour(place: str, k: int, combos: list[tuple[str, int]]) -> str:
    from mtplib.lab.display import data_colour

    return data_colour(combos.index((place, k)))


def plot_rtt(summary: list[dict], *, what: str = "tok_s", plan: str | None = None, ax=None,
             legend: bool = True):
    """tokens/s (``what="tok_s"``) or speed-up over MTP off (``"speedup"``) against RTT
    for one plan: colour = drafter placement and k (MTP off has its own), line style =
    topology, so no two lines look alike; the legend right of the axes."""
    from mtplib.lab import display as D

    if what not in ("tok_s", "speedup"):
        raise InputError(f"what must be 'tok_s' or 'speedup', got {what!r}")
    plan = plan or summary[0]["plan"]
    rows = [s for s in summary if s["plan"] == plan and s[what] is not None]
    if ax is None:
        fig, axes = D.new_figure(1, w=5.5, h=4.0)
        ax = axes[0]
    styles = {"remote": "-", "tail_local": "--"}
    combos = sorted({(str(s["placement"]), s["k"]) for s in rows},
                    key=lambda t: (t[1] > 0, t[0] != "tail", t[1]))
    for topo, place, k in _rtt_series(rows):
        pts = sorted((s["rtt_ms"], s[what]) for s in rows
                     if (s["topology"], s["placement"], s["k"]) == (topo, place, k))
        label = f"{topo}, " + ("MTP off" if k == 0 else f"k={k}, MTP on the {place}")
        ax.plot([p[0] for p in pts], [p[1] for p in pts], styles.get(topo, ":"), marker="o",
                ms=3, color=_rtt_colour(str(place), k, combos), label=label)
    if what == "speedup":
        ax.axhline(1.0, color=D.NEUTRAL, lw=0.8)
    ax.set_xlabel("round-trip time per shard connection (ms)")
    ax.set_ylabel("decode speed (tokens/s)" if what == "tok_s"
                  else "speed-up over MTP off (x)")
    ax.set_title(f"{WAN_MODEL}, plan {plan}: "
                 + ("decode speed" if what == "tok_s" else "MTP speed-up") + " vs RTT",
                 fontsize=9)
    if legend:
        D.ax_legend_outside(ax, fontsize=7)
    return ax


def plot_rtt_pair(summary: list[dict], *, plan: str, build: str = ""):
    """Tokens/s and speed-up against RTT side by side for one plan, one shared legend
    right of both; a Figure titled with the model, the plan and the upstream build."""
    from mtplib.lab import display as D

    fig, axes = D.new_figure(2, w=5.0, h=4.0, sharey=False)
    plot_rtt(summary, what="tok_s", plan=plan, ax=axes[0], legend=False)
    plot_rtt(summary, what="speedup", plan=plan, ax=axes[1], legend=False)
    for ax in axes:
        ax.set_title(ax.get_title().split(": ", 1)[1], fontsize=9)
    fig.suptitle(f"{WAN_MODEL}, plan {plan} ({plan.count(',') + 1} RPC shards)"
                 + (f", upstream build: {build}" if build else ""), fontsize=10)
    D.legend_outside(fig, axes, fontsize=7, title="topology, drafter")
    return fig


def plot_builds(summaries: dict[str, list[dict]], *, plan: str, mode: str = "warm",
                placement: str = "client"):
    """Tokens/s and speed-up against every measured RTT for one plan and mode, every build
    on the same axes: colour = k (MTP off its own), line style = build, marker = topology;
    MTP on with the drafter ``placement`` (the default's). None when nothing was measured."""
    from mtplib.lab import display as D

    pts = {b: [x for x in s if x.get("mode", "warm") == mode and x["plan"] == plan
               and (x["k"] == 0 or x["placement"] == placement)] for b, s in summaries.items()}
    if not any(pts.values()):
        return None
    fig, axes = D.new_figure(2, w=5.0, h=4.0, sharey=False)
    ks = sorted({x["k"] for v in pts.values() for x in v})
    styles = {"patched": "-", "stock": "--"}
    marks = {"remote": "o", "tail_local": "s"}
    for ax, what in zip(axes, ("tok_s", "speedup"), strict=True):
        for b, rows in pts.items():
            for topo in sorted({x["topology"] for x in rows}):
                for k in ks:
                    if what == "speedup" and k == 0:
                        continue
                    xy = sorted((x["rtt_ms"], x[what]) for x in rows
                                if x["topology"] == topo and x["k"] == k and x[what])
                    if not xy:
                        continue
                    ax.plot([p[0] for p in xy], [p[1] for p in xy], styles.get(b, ":"),
                            marker=marks.get(topo, "^"), ms=4, color=D.data_colour(ks.index(k)),
                            label=f"{b}, {topo}, " + ("MTP off" if k == 0 else f"k={k}"))
        ax.set_xlabel("round-trip time per shard connection (ms)")
        ax.set_ylabel("decode speed (tokens/s)" if what == "tok_s"
                      else "speed-up over MTP off (x)")
        if what == "speedup":
            ax.axhline(1.0, color=D.NEUTRAL, lw=0.8)
        ax.set_title("decode speed vs RTT" if what == "tok_s" else "MTP speed-up vs RTT",
                     fontsize=9)
    fig.suptitle(f"{WAN_MODEL}, plan {plan} ({plan.count(',') + 1} RPC shards), {mode} "
                 f"({'one CLI process per run' if mode == 'cold' else 'one loaded runtime'}),"
                 f" MTP on the {placement}", fontsize=10)
    D.legend_outside(fig, axes, fontsize=7, title="build, topology, draft")
    return fig


# ---------------------------------------------------------------------------------------
# one process per upstream build (the build is chosen before llama_cpp is imported)
# ---------------------------------------------------------------------------------------
#: a line the child prints per generation under ``--progress`` ("PREFIX done/total"); the
#: parent drives its bar with it and keeps it out of run.log
PROGRESS_PREFIX = "mtplib-wan-progress "


def run_builds(cfg: WanConfig, out_dir, *, builds: Sequence[str] = ("stock", "patched"),
               overrides: dict[str, dict] | None = None, log: LOG | None = None,
               progress: bool = False) -> dict[str, dict]:
    """Run the benchmark once per upstream build, each in its own Python process with
    ``MTPLIB_UPSTREAM`` set, into ``out_dir/<build>/``; returns build -> loaded results.
    ``overrides``: build -> WanConfig fields that differ for that build (e.g. a smaller
    grid for the stock comparison). A build that is not installed (``.upstream/patched``
    missing) is skipped with a note. ``progress``: a bar (`mtplib.lab.progress.bar`) per
    build over its generations, fed by the child's progress lines."""
    import json
    import os
    import subprocess
    import sys

    from mtplib.lab.progress import bar
    from mtplib.runtime import PATCHED_DIR

    log = log or (lambda s: None)
    out: dict[str, dict] = {}
    for build in builds:
        if build == "patched" and not (PATCHED_DIR / "llama_cpp" / "MTPLIB_PATCHES").is_file():
            log(f"{build}: not installed ({PATCHED_DIR}); run ./dev.sh setup. Skipped.")
            continue
        d = Path(out_dir) / build
        d.mkdir(parents=True, exist_ok=True)
        env = dict(os.environ, MTPLIB_UPSTREAM=build, PYTHONUNBUFFERED="1")
        bcfg = replace(cfg, **(overrides or {}).get(build, {}), upstream=build)
        cmd = [sys.executable, "-m", "mtplib.lab.wan", "--config",
               json.dumps(bcfg.__dict__), "--out", str(d)] + (["--progress"] if progress else [])
        log(f"{build}: {' '.join(cmd[:3])} ... --out {d}")
        with (d / "run.log").open("w") as f, bar(None, f"wan {build}", progress) as pb:
            child = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, errors="replace")
            assert child.stdout is not None
            for line in child.stdout:
                if line.startswith(PROGRESS_PREFIX):
                    done, total = (int(x) for x in line[len(PROGRESS_PREFIX):].split("/"))
                    pb.total = total
                    pb.update(done - pb.n)
                else:
                    f.write(line)
            rc = child.wait()
        if rc != 0:
            tail = (d / "run.log").read_text()[-2000:]
            raise InputError(f"the {build} WAN run failed (exit {rc}); log {d / 'run.log'}:\n"
                             f"{tail}")
        out[build] = load(d)
    return out


def main(argv: list[str] | None = None) -> int:
    import argparse
    import json

    ap = argparse.ArgumentParser(prog="python -m mtplib.lab.wan",
                                 description="ranged MTP over an emulated WAN on the trained "
                                 "pair (one upstream build: MTPLIB_UPSTREAM)")
    ap.add_argument("--config", default="{}", help="WanConfig as JSON (default: all defaults)")
    ap.add_argument("--out", required=True, help="folder for wan.json and wan_summary.csv")
    ap.add_argument("--progress", action="store_true",
                    help=f"print '{PROGRESS_PREFIX}DONE/TOTAL' after each generation")
    a = ap.parse_args(argv)
    from mtplib.model.trained import trained_paths

    cfg = with_upstream(WanConfig.from_dict(json.loads(a.config)))
    pair = trained_paths()
    # one more held-out prompt than measured: the warm-up's, never measured itself
    *prompts, spare = trained_prompts(cfg.n_prompts + 1, cfg.prompt_len)

    def tick(done: int, total: int) -> None:
        print(f"{PROGRESS_PREFIX}{done}/{total}", flush=True)

    res = run_wan(str(pair.trunk), str(pair.sidecar), cfg, prompts, log=print,
                  progress=tick if a.progress else None, warm_prompt=spare)
    from mtplib.runtime.lib import upstream_info

    res["upstream"] = upstream_info()
    print(save(res, a.out)["json"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
