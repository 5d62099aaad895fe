"""Ranged MTP over an emulated WAN: tokens/s against round-trip time, and why.

Every shard of a plan runs behind a counting relay that delays each chunk by half the RTT
each way and, with a bandwidth (``mbits``), caps each direction of the link at that many
Mbit/s (`mtplib.distributed.relay.WanLink`). Two topologies: ``remote`` (every shard
behind the WAN) and ``tail_local`` (the tail shard co-located with the client: its relay has
no delay). Two drafter placements: the MTP block on the tail shard or in the client. For
each (plan, topology, placement) one set of shards and one loaded model serve every RTT and
draft length; MTP off is measured on the same connections.

Two modes. ``warm``: one `RangedMTP` (the object `mtplib serve` holds) serves every
generation of a configuration; its engines are warmed at load, never on a measured prompt.
``cold``: one `mtplib generate --json` process per generation with the CLI's default options
(drafter and head placement, upstream build, context size), as a user runs it; only
``--plan``, ``--mtp/--draft`` and ``--wan`` are given. ``cold_shards``: ``local`` (the CLI
starts its shards, one set per process) or ``endpoints`` (``mtplib shard serve`` processes
started once on this host, each run given ``--endpoints``: how a user tries shards first).

A run resumes (`run_wan` with ``out_dir``): each finished cell (mode, plan, topology,
placement, RTT, bandwidth, k) is written to ``wan.partial.json`` at once; a rerun into the
same folder keeps those rows as they are and measures only the cells still missing, and
refuses a folder measured with another build or other per-run settings.

Each run records tokens/s, tokens per verify step, waits (synchronous round trips) per step
kind, data bytes per step kind by class (`mtplib.contract.wire`) and the cache bytes that
crossed a shard connection (must be 0: the contract's shard-local rule). The cost model
``t_token = compute + RTT x waits_per_token + bytes / bandwidth`` is fitted per
configuration on some RTTs and checked on the others (`fit_cost_model`).
"""

from __future__ import annotations

import contextlib
import math
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
#: where a cold run's shards come from: started by each CLI process, or external
#: `mtplib shard serve` processes on this host (started once, given as --endpoints)
COLD_SHARDS = ("local", "endpoints")
#: the step kinds of the decoding phase (after the prompt), whose waits a token pays
DECODE_PHASES = DECODING_STEPS
PLACEMENTS = labels.PLACEMENTS
LOG = Callable[[str], None]


@dataclass
class WanConfig:
    """What `run_wan` measures (a lane's ``wan:`` section; every key optional)."""

    rtts_ms: list[float] = field(default_factory=lambda: [0, 10, 25, 50, 100, 200])
    #: link bandwidths (Mbit/s per direction of each WAN link; None: unlimited), crossed
    #: with the RTTs of both modes
    mbits: list[float | None] = field(default_factory=lambda: [None])
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
    cold_shards: str = "local"  # COLD_SHARDS
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
        bad += [self.cold_shards] if self.cold_shards not in COLD_SHARDS else []
        if bad:
            raise InputError(f"wan: unknown topology/placement/mode/cold_shards {bad}; "
                             f"topologies {TOPOLOGIES}, placements {PLACEMENTS}, modes "
                             f"{MODES}, cold_shards {COLD_SHARDS}")
        if not isinstance(self.mbits, list) or not self.mbits or any(
                m is not None and (isinstance(m, bool) or not isinstance(m, int | float)
                                   or not math.isfinite(m) or m <= 0) for m in self.mbits):
            raise InputError(f"wan: mbits must be a non-empty list of Mbit/s > 0 or None "
                             f"(unlimited), got {self.mbits!r}")
        if len(set(self.mbits)) != len(self.mbits):
            raise InputError(f"wan: mbits lists a bandwidth twice: {self.mbits}")
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


def links_for(topology: str, n_shards: int, rtt_ms: float, mbit: float | None = None) -> list:
    """Each shard's link: ``rtt_ms`` and the ``mbit`` cap, except a co-located tail's."""
    from mtplib.distributed.relay import WanLink

    if topology == "remote":
        return [WanLink(rtt_ms, mbit)] * n_shards
    return [WanLink(rtt_ms, mbit)] * (n_shards - 1) + [WanLink()]


def wan_arg(topology: str, n_shards: int, rtt_ms: float, mbit: float | None = None) -> str:
    """The ``--wan`` value of `mtplib generate` for a topology (``RTT[:MBIT]`` per shard)."""
    return ",".join(str(w) for w in links_for(topology, n_shards, rtt_ms, mbit))


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
    #: cold runs: "local" (the CLI started its shards) or "endpoints" (it was given running
    #: shards), from the run's own metrics; None in rows older than the field
    shards: str | None = None
    #: the link cap in Mbit/s per direction (None: unlimited; rows older than the field
    #: ran unlimited)
    mbit: float | None = None

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


#: a cell: (mode, plan, topology, placement, RTT ms, Mbit/s or None, k); the placement is
#: the drafter's for a warm run ("-" for MTP off) and "*" for a cold one (the CLI chooses)
Cell = tuple[str, str, str, str, float, float | None, int]
#: where a run in progress keeps its finished cells (`run_wan` with ``out_dir``); the
#: finished run's wan.json replaces it
PARTIAL_JSON = "wan.partial.json"
#: WanConfig fields a cell's rows depend on besides its coordinates: a folder measured
#: with other values is refused, never resumed into
RESUME_FIELDS = ("head", "n_prompts", "prompt_len", "n_new", "reps", "warmup", "n_ctx",
                 "threads", "shard_threads", "upstream")
#: the same for cold cells only
COLD_RESUME_FIELDS = ("cold_shards",)


def _cell(mode: str, plan: str, topology: str, placement: str, rtt_ms: float,
          mbit: float | None, k: int) -> Cell:
    return (mode, plan, topology, "*" if mode == "cold" else placement, float(rtt_ms),
            None if mbit is None else float(mbit), int(k))


def cell_of(row: dict) -> Cell:
    """The cell a wan.json row belongs to (rows without ``mbit`` ran unlimited)."""
    return _cell(row.get("mode", "warm"), row["plan"], row["topology"], row["placement"],
                 row["rtt_ms"], row.get("mbit"), row["k"])


def cells(cfg: WanConfig) -> list[Cell]:
    """Every cell ``cfg`` measures, in the order `run_wan` runs them."""
    out: list[Cell] = []
    if "warm" in cfg.modes:
        for plan in cfg.plans:
            for topo in cfg.topologies:
                for place in cfg.placements:
                    out += _warm_cells(cfg, plan, topo, place)
    if "cold" in cfg.modes:
        for plan in cfg.plans:
            for topo in cfg.topologies:
                for rtt in cfg.cold_rtts_ms:
                    for mbit in cfg.mbits:
                        for k in cold_ks(cfg):
                            out.append(_cell("cold", plan, topo, "*", rtt, mbit, k))
    return out


def _warm_cells(cfg: WanConfig, plan: str, topo: str, place: str) -> list[Cell]:
    """The warm cells one loaded RangedMTP (plan, topology, drafter placement) serves."""
    return [_cell("warm", plan, topo, place if k else "-", rtt, mbit, k)
            for rtt in cfg.rtts_ms for mbit in cfg.mbits for k in cfg.ks
            # MTP off does not depend on the drafter's place: measured with the first
            if k or place == cfg.placements[0]]


def cold_ks(cfg: WanConfig) -> list[int]:
    """The cold draft lengths this build runs: the CLI refuses ranged MTP on the stock
    build by default (cache state would cross a seam), so there MTP off only."""
    if cfg.upstream == "stock":
        return [k for k in cfg.cold_ks if not k]
    return list(cfg.cold_ks)


def _n_runs(cfg: WanConfig, n_prompts: int, skip: set[Cell] = frozenset()) -> int:
    return sum(1 for c in cells(cfg) if c not in skip) * n_prompts * cfg.reps


@dataclass
class Resumed:
    """What a results folder already holds for a config: its rows (kept as they are), the
    cells they complete, and the earlier sessions' wall time."""

    rows: list[dict] = field(default_factory=list)
    done: set[Cell] = field(default_factory=set)
    sessions: list[dict] = field(default_factory=list)
    source: Path | None = None


def resume(out_dir, cfg: WanConfig, upstream: dict | None) -> Resumed:
    """The finished cells of ``out_dir`` (its wan.partial.json, else its wan.json) that
    ``cfg`` measures, checked: another build or patch set, another value of a
    `RESUME_FIELDS` field, a cell ``cfg`` does not list, or a cell with the wrong number of
    rows is refused (InputError naming it); nothing there: an empty Resumed."""
    import json

    out = Path(out_dir)
    src = next((p for p in (out / PARTIAL_JSON, out / WAN_JSON) if p.is_file()), None)
    if src is None:
        return Resumed()
    try:
        old = json.loads(src.read_text())
        old_cfg, old_rows = old["config"], old["rows"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise InputError(f"{src}: not a readable WAN results file ({e}); move it away to "
                         "measure into this folder") from None
    again = "use another output folder, or move it away to measure afresh"
    rows_cold = any(r.get("mode") == "cold" for r in old_rows)
    fields = RESUME_FIELDS + (COLD_RESUME_FIELDS if rows_cold else ())
    defaults = asdict(WanConfig())
    new = asdict(cfg)
    diff = [f"{f}: {old_cfg.get(f, defaults[f])!r} there, {new[f]!r} now" for f in fields
            if old_cfg.get(f, defaults[f]) != new[f]]
    if upstream is not None:
        was = old.get("upstream") or {}
        for f in ("build", "patches"):
            if f in was and was[f] != upstream.get(f):
                diff.append(f"upstream {f}: {was[f]!r} there, {upstream.get(f)!r} now")
    if diff:
        raise InputError(f"wan: cannot resume into {src}: it was measured with other "
                         f"settings ({'; '.join(diff)}); {again}")
    want = set(cells(cfg))
    by: dict[Cell, list[dict]] = {}
    for r in old_rows:
        by.setdefault(cell_of(r), []).append(r)
    extra = sorted((c for c in by if c not in want), key=str)
    if extra:
        raise InputError(f"wan: cannot resume into {src}: it holds cells this config does "
                         f"not list ({', '.join(map(_cell_text, extra[:4]))}"
                         f"{' ...' if len(extra) > 4 else ''}); list them too, or {again}")
    n = cfg.n_prompts * cfg.reps
    short = [c for c, rs in by.items() if len(rs) != n]
    if short:
        raise InputError(f"wan: cannot resume into {src}: cell {_cell_text(short[0])} has "
                         f"{len(by[short[0]])} rows, not n_prompts x reps = {n}; {again}")
    return Resumed(rows=list(old_rows), done=set(by), sessions=list(old.get("sessions", [])),
                   source=src)


def _cell_text(c: Cell) -> str:
    mode, plan, topo, place, rtt, mbit, k = c
    bw = "unlimited" if mbit is None else f"{mbit:g} Mbit/s"
    return f"{mode} {plan} {topo} {place} {rtt:g} ms {bw} k={k}"


class _Progress:
    """Rows, the finished cells and the checkpoint of one `run_wan` call."""

    def __init__(self, cfg: WanConfig, prior: Resumed, total: int, out_dir,
                 upstream: dict | None, log: LOG,
                 progress: Callable[[int, int], None] | None) -> None:
        self.cfg, self.prior, self.total, self.log = cfg, prior, total, log
        self.rows: list[dict] = list(prior.rows)
        self.done: set[Cell] = set(prior.done)
        self.out = None if out_dir is None else Path(out_dir)
        self.upstream, self.progress = upstream, progress
        self.count, self.cells_run, self.t0 = 0, 0, time.time()

    def tick(self) -> None:
        self.count += 1
        if self.progress:
            self.progress(self.count, self.total)

    def measure(self, cell: Cell, prompts: Sequence[Sequence[int]],
                one: Callable[[Sequence[int], dict], dict], **coords) -> None:
        """Every generation of one cell (``one(prompt, row fields)`` -> its row; the fields
        are ``coords`` with the prompt's index and the repetition), then the cell as
        finished: its rows are written together or not at all."""
        new = []
        for pi, prompt in enumerate(prompts):
            for rep in range(self.cfg.reps):
                new.append(one(prompt, {**coords, "prompt": pi, "rep": rep}))
                self.tick()
        self.rows += new
        self.finished(cell)
        _log_cell(self.log, new, cell[4], cell[5], cell[6])

    def finished(self, cell: Cell) -> None:
        """A cell's rows are all in: remember it and write the checkpoint."""
        self.done.add(cell)
        self.cells_run += 1
        if self.out is not None:
            self.out.mkdir(parents=True, exist_ok=True)
            write_json(self.out / PARTIAL_JSON, self.result(), indent=1, default=str)

    def result(self) -> dict:
        wall = time.time() - self.t0
        sessions = [*self.prior.sessions, {"wall_s": wall, "cells_run": self.cells_run,
                                           "cells_kept": len(self.prior.done)}]
        out = {"config": asdict(self.cfg), "rows": self.rows,
               "wall_s": sum(s["wall_s"] for s in sessions), "sessions": sessions}
        if self.upstream is not None:
            out["upstream"] = self.upstream
        return out


def run_wan(trunk: str, sidecar: str, cfg: WanConfig, prompts: Sequence[Sequence[int]], *,
            log: LOG | None = None, progress: Callable[[int, int], None] | None = None,
            warm_prompt: Sequence[int] | None = None, out_dir=None,
            upstream: dict | None = None) -> dict:
    """Measure every cell of ``cfg`` in each of its modes; returns {"config", "rows",
    "wall_s", "sessions"} (and "upstream" when given). ``warm_prompt``: the held-out prompt
    of ``cfg.warmup``'s untimed generations (never one that is measured). ``out_dir``:
    resume from and checkpoint into its `PARTIAL_JSON` (`resume`); ``upstream``: the build
    this process loads (`mtplib.runtime.lib.upstream_info`), recorded and checked there."""
    log = log or (lambda s: None)
    cfg = with_upstream(cfg)  # the build this process loads, as every row records it
    if len(prompts) != cfg.n_prompts:
        raise InputError(f"wan: {len(prompts)} prompts for n_prompts {cfg.n_prompts}")
    prior = resume(out_dir, cfg, upstream) if out_dir is not None else Resumed()
    if prior.done:
        log(f"resuming {prior.source}: {len(prior.done)} cells kept, "
            f"{len(cells(cfg)) - len(prior.done)} to measure")
    st = _Progress(cfg, prior, _n_runs(cfg, len(prompts), prior.done), out_dir, upstream, log,
                   progress)
    if "warm" in cfg.modes:
        _run_warm(trunk, sidecar, cfg, prompts, st, warm_prompt)
    if "cold" in cfg.modes:
        _run_cold(trunk, sidecar, cfg, prompts, st)
    return st.result()


def _run_warm(trunk, sidecar, cfg: WanConfig, prompts, st: _Progress, warm_prompt) -> None:
    """One RangedMTP per (plan, topology, placement), every RTT, bandwidth and k on it;
    one whose cells are all done is not loaded."""
    from mtplib.distributed.ranged_mtp import RangedMTP
    from mtplib.runtime import selected_upstream
    from mtplib.runtime.speculative import EngineOptions

    settings = _settings(cfg, trunk)
    # the stock build moves cache state with MTP on: measured deliberately, for comparison
    crossing = selected_upstream() == "stock"
    log = st.log
    for plan in cfg.plans:
        for topo in cfg.topologies:
            for place in cfg.placements:
                todo = [c for c in _warm_cells(cfg, plan, topo, place) if c not in st.done]
                if not todo:
                    log(f"warm: plan {plan}, {topo}, MTP on the {place}: done before")
                    continue
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
                        for mbit in cfg.mbits:
                            links = links_for(topo, len(relays), rtt, mbit)
                            for relay, link in zip(relays, links, strict=True):
                                relay.set_link(link)
                            for k in cfg.ks:
                                cell = _cell("warm", plan, topo, place if k else "-", rtt,
                                             mbit, k)
                                if cell not in todo:
                                    continue  # done before, or MTP off of another place
                                opts = EngineOptions(k=k, settings=settings, head=cfg.head)

                                def one(prompt, kw, opts=opts):
                                    toks, m = r.generate(list(prompt), cfg.n_new, opts)
                                    return _row(m, toks, **kw)
                                st.measure(cell, prompts, one, mode="warm", plan=plan,
                                           topology=topo, placement=place if k else "-",
                                           rtt_ms=rtt, mbit=mbit, k=k)


def cli_generate(trunk: str, sidecar: str | None, *, plan: str, k: int, tokens: Sequence[int],
                 n_new: int, wan: str, n_ctx: int | None = None,
                 endpoints: Sequence[str] | None = None) -> list[str]:
    """The `mtplib generate` command line of one cold run: the CLI's defaults except the
    model, the plan, MTP, the emulated WAN, the running shards when ``endpoints`` are given
    (else the CLI starts its own) and --ctx only if the config fixes one."""
    import shutil
    import sys

    exe = Path(sys.executable).with_name("mtplib")
    cmd = [str(exe)] if exe.is_file() else (
        [shutil.which("mtplib")] if shutil.which("mtplib") else
        [sys.executable, "-m", "mtplib.cli"])
    cmd += ["generate", "--model", trunk, "--plan", plan, "--tokens",
            ",".join(str(int(t)) for t in tokens), "--n", str(n_new), "--wan", wan, "--json"]
    if endpoints:
        cmd += ["--endpoints", ",".join(endpoints)]
    if k:
        cmd += ["--mtp", str(sidecar), "--draft", str(k)]
    if n_ctx is not None:
        cmd += ["--ctx", str(n_ctx)]
    return cmd


def _run_cold(trunk, sidecar, cfg: WanConfig, prompts, st: _Progress) -> None:
    """One fresh `mtplib generate` process per generation; its wall time is recorded beside
    its own metrics. ``cold_shards="endpoints"``: the shards (`LocalShards`: `mtplib shard
    serve` processes on free loopback ports, the shard CLI's defaults) are started once for
    every cold cell and stopped at the end, on an error or Ctrl-C too."""
    from mtplib.distributed.processes import LocalShards

    log = st.log
    ks = cold_ks(cfg)
    if len(ks) < len(cfg.cold_ks):
        log("cold: the stock build refuses ranged MTP by default; MTP off only")
    todo = [c for c in cells(cfg) if c[0] == "cold" and c not in st.done]
    if not todo:
        if any(c[0] == "cold" for c in cells(cfg)):
            log("cold: every cell done before")
        return
    with contextlib.ExitStack() as stack:
        shards = None
        if cfg.cold_shards == "endpoints":
            n_max = max(c[1].count(",") + 1 for c in todo)
            shards = stack.enter_context(LocalShards(n_max, cfg.shard_threads))
            log(f"cold: {n_max} shard processes on this host: {', '.join(shards.endpoints)}")
        for plan in cfg.plans:
            n_shards = plan.count(",") + 1
            eps = None if shards is None else shards.endpoints[:n_shards]
            for topo in cfg.topologies:
                for rtt in cfg.cold_rtts_ms:
                    for mbit in cfg.mbits:
                        wan = wan_arg(topo, n_shards, rtt, mbit)
                        for k in ks:
                            cell = _cell("cold", plan, topo, "*", rtt, mbit, k)
                            if cell not in todo:
                                continue
                            log(f"cold: plan {plan}, {topo}, --wan {wan}, k={k}")

                            def one(prompt, kw, wan=wan, eps=eps):
                                cmd = cli_generate(trunk, sidecar, plan=kw["plan"], k=kw["k"],
                                                   tokens=prompt, n_new=cfg.n_new, wan=wan,
                                                   n_ctx=cfg.n_ctx, endpoints=eps)
                                return _cold_run(cmd, **kw)
                            st.measure(cell, prompts, one, plan=plan, topology=topo,
                                       rtt_ms=rtt, mbit=mbit, k=k)


def _cold_run(cmd: list[str], *, k: int, **coords) -> dict:
    """One CLI process and its row; InputError with its message when it failed."""
    import json
    import subprocess

    t0 = time.time()
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    wall = time.time() - t0
    try:
        out = json.loads(p.stdout.strip().splitlines()[-1])
    except (json.JSONDecodeError, IndexError):
        out = {"error": (p.stderr or p.stdout)[-600:]}
    if "error" in out or p.returncode not in (0, 3):
        raise InputError(f"cold run failed (exit {p.returncode}): {' '.join(cmd[:12])} ...: "
                         f"{out.get('error')}")
    m = RangedMetrics.from_dict(out["metrics"])  # the CLI's JSON
    return _row(m, out["tokens"], mode="cold", k=k,
                placement=(m.mtp_placement or "-") if k else "-", process_wall_s=wall,
                exit=p.returncode, shards="local" if m.local_shards else "endpoints", **coords)


def _log_cell(log, rows, rtt, mbit, k) -> None:
    med = median_or_none(x.decode_tok_s for x in _typed(rows))
    bw = "" if mbit is None else f" {mbit:g} Mbit/s"
    log(f"  rtt {rtt:g} ms{bw} k={k}: " + ("n/a" if med is None else f"{med:.2f}") + " tok/s")


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


def has_bandwidth(rows: Sequence[WanRun | dict]) -> bool:
    """Do the rows record a capped link (``mbit``)? Unlimited rows omit the field, as rows
    older than it do: their summaries keep the columns they were written with."""
    return any(r.get("mbit") is not None if isinstance(r, dict) else r.mbit is not None
               for r in rows)


def _mbit_order(mbit: float | None) -> tuple:
    return (mbit is None, mbit or 0.0)  # capped links by bandwidth, unlimited last


def summarize(rows: Sequence[WanRun | dict]) -> list[dict]:
    """Per (mode, plan, topology, placement, k, RTT, bandwidth): n runs, tok/s (median and
    spread), the speed-up over MTP off of the same mode/plan/topology/RTT/bandwidth (ratio of
    medians, and the spread of the per-prompt paired ratios), tokens per verify step, waits
    per token, cache bytes crossing summed over every run, identical tokens. ``mbit`` is a
    column (after ``rtt_ms``) when the rows record it (`has_bandwidth`)."""
    bw = has_bandwidth(rows)
    rows = _typed(rows)
    off: dict[tuple, list[WanRun]] = {}
    for r in rows:
        if r.k == 0:
            off.setdefault((r.mode, r.plan, r.topology, r.rtt_ms, r.mbit), []).append(r)
    out = []
    groups: dict[tuple, list[WanRun]] = {}
    for r in rows:
        groups.setdefault((*_key(r), r.rtt_ms, r.mbit), []).append(r)
    for (mode, plan, topo, place, k, rtt, mbit), rs in sorted(groups.items(), key=lambda kv: (
            kv[0][0], kv[0][1], kv[0][2], str(kv[0][3]), kv[0][4], kv[0][5],
            _mbit_order(kv[0][6]))):
        ref = off.get((mode, plan, topo, rtt, mbit), [])
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
            "rtt_ms": rtt, **({"mbit": mbit} if bw else {}), "runs": len(rs),
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
    RTT nor on the bandwidth: the first bandwidth's)."""
    rows = _typed(rows)
    out = []
    seen = set()
    for r in rows:
        key = _key(r)
        if key in seen:
            continue
        seen.add(key)
        same = [x for x in rows if _key(x) == key and x.rtt_ms == r.rtt_ms
                and x.mbit == r.mbit]
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
    """Per configuration (and bandwidth, where the summary has one): fit ``s_per_token =
    compute + RTT x w`` (least squares) on the ``fit_rtts`` points, predict the other RTTs,
    report the relative error of each prediction and the fitted w next to the measured
    waits per token."""
    by: dict[tuple, list[dict]] = {}
    for s in summary:
        if s["tok_s"]:
            by.setdefault((s.get("mode", "warm"), s["plan"], s["topology"], s["placement"],
                           s["k"], s.get("mbit")), []).append(s)
    bw = any("mbit" in s for s in summary)
    out = []
    fit_set = {float(x) for x in fit_rtts}
    for key, ss in sorted(by.items(), key=lambda kv: (kv[0][0], kv[0][1], kv[0][2],
                                                       str(kv[0][3]), kv[0][4],
                                                       _mbit_order(kv[0][5]))):
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
                        "rtt_ms": s["rtt_ms"], **({"mbit": key[5]} if bw else {}),
                        "compute_s_per_token": float(c),
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
    cache bytes crossing (0). One row per bandwidth where the summary has one (``mbit``, the
    same goals: the issue's targets hold at 20 and 100 Mbit/s too)."""
    want = {("warm", "tail_local", "tail"): 0.85, ("warm", "tail_local", "client"): 0.85,
            ("warm", "remote", "client"): 0.70, ("warm", "remote", "tail"): None,
            ("cold", "tail_local", "client"): 0.85, ("cold", "remote", "client"): 0.85}
    plain = {(s.get("mode", "warm"), s["plan"], s["topology"], s["rtt_ms"], s.get("mbit")):
             s["waits_per_plain"] for s in summary if s["k"] == 0}
    out = []
    for s in summary:
        if (s["rtt_ms"], s["k"], s["plan"]) != (rtt_ms, k, plan):
            continue
        mode = s.get("mode", "warm")
        goal = want.get((mode, s["topology"], s["placement"]))
        ratio = s["speedup_over_ideal"]
        # the MTP-off run's plain step
        base = plain.get((mode, s["plan"], s["topology"], s["rtt_ms"], s.get("mbit")))
        extra = (s["waits_per_verify"] - base
                 if s["waits_per_verify"] is not None and base is not None else None)
        out.append({"mode": mode, "plan": plan, "topology": s["topology"],
                    "placement": s["placement"], "runs": s["runs"],
                    "speedup_paired_min": s.get("speedup_paired_min"),
                    "speedup_paired_max": s.get("speedup_paired_max"),
                    "k": k, "rtt_ms": rtt_ms, **({"mbit": s["mbit"]} if "mbit" in s else {}),
                    "speedup": s["speedup"],
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


def finish(result: dict, out_dir) -> dict:
    """`save` a finished run and drop its checkpoint (`PARTIAL_JSON`): the wan.json now
    holds every cell."""
    paths = save(result, out_dir)
    (Path(out_dir) / PARTIAL_JSON).unlink(missing_ok=True)
    return paths


def resummarize(out_dir) -> dict:
    """Rewrite a results folder's derived sections (summary, bytes, cost model, targets)
    from its raw rows with this code; the measurement (rows, config, upstream) is kept."""
    d = load(out_dir)
    keep = {k: d[k] for k in ("config", "rows", "wall_s", "sessions", "upstream") if k in d}
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


def bandwidth_text(mbit: float | None) -> str:
    return "unlimited" if mbit is None else f"{mbit:g} Mbit/s"


def plot_rtt(summary: list[dict], *, what: str = "tok_s", plan: str | None = None, ax=None,
             legend: bool = True, mbit: float | None = None):
    """tokens/s (``what="tok_s"``) or speed-up over MTP off (``"speedup"``) against RTT
    for one plan and link bandwidth (``mbit``; None: unlimited, which rows without the
    field ran at): colour = drafter placement and k (MTP off has its own), line style =
    topology, so no two lines look alike; the legend right of the axes."""
    from mtplib.lab import display as D

    if what not in ("tok_s", "speedup"):
        raise InputError(f"what must be 'tok_s' or 'speedup', got {what!r}")
    plan = plan or summary[0]["plan"]
    rows = [s for s in summary if s["plan"] == plan and s[what] is not None
            and s.get("mbit") == mbit]
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
                 + ("decode speed" if what == "tok_s" else "MTP speed-up") + " vs RTT"
                 + (f", {bandwidth_text(mbit)}" if any("mbit" in s for s in rows) else ""),
                 fontsize=9)
    if legend:
        D.ax_legend_outside(ax, fontsize=7)
    return ax


def plot_rtt_pair(summary: list[dict], *, plan: str, build: str = "",
                  mbit: float | None = None):
    """Tokens/s and speed-up against RTT side by side for one plan and bandwidth, one
    shared legend right of both; a Figure titled with the model, the plan and the build."""
    from mtplib.lab import display as D

    fig, axes = D.new_figure(2, w=5.0, h=4.0, sharey=False)
    plot_rtt(summary, what="tok_s", plan=plan, ax=axes[0], legend=False, mbit=mbit)
    plot_rtt(summary, what="speedup", plan=plan, ax=axes[1], legend=False, mbit=mbit)
    for ax in axes:
        ax.set_title(ax.get_title().split(": ", 1)[1], fontsize=9)
    fig.suptitle(f"{WAN_MODEL}, plan {plan} ({plan.count(',') + 1} RPC shards)"
                 + (f", upstream build: {build}" if build else ""), fontsize=10)
    D.legend_outside(fig, axes, fontsize=7, title="topology, drafter")
    return fig


def plot_builds(summaries: dict[str, list[dict]], *, plan: str, mode: str = "warm",
                placement: str = "client", mbit: float | None = None):
    """Tokens/s and speed-up against every measured RTT for one plan, mode and bandwidth
    (``mbit``, None: unlimited), every build on the same axes: colour = k (MTP off its own),
    line style = build, marker = topology; MTP on with the drafter ``placement`` (the
    default's). None when nothing was measured."""
    from mtplib.lab import display as D

    pts = {b: [x for x in s if x.get("mode", "warm") == mode and x["plan"] == plan
               and x.get("mbit") == mbit
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
    bw = any("mbit" in x for v in pts.values() for x in v)
    fig.suptitle(f"{WAN_MODEL}, plan {plan} ({plan.count(',') + 1} RPC shards), {mode} "
                 f"({'one CLI process per run' if mode == 'cold' else 'one loaded runtime'}),"
                 f" MTP on the {placement}" + (f", links {bandwidth_text(mbit)}" if bw else ""),
                 fontsize=10)
    D.legend_outside(fig, axes, fontsize=7, title="build, topology, draft")
    return fig


def plot_bandwidth(summary: list[dict], *, plan: str, rtt_ms: float, mode: str = "warm",
                   placement: str = "client", ax=None):
    """Speed-up over MTP off against the link bandwidth at one RTT, one plan and mode: a
    line per topology and k (the unlimited link drawn right of the largest cap, labelled
    so). None when the summary has no bandwidth or nothing at that RTT."""
    from mtplib.lab import display as D

    rows = [s for s in summary if "mbit" in s and s.get("mode", "warm") == mode
            and s["plan"] == plan and s["rtt_ms"] == rtt_ms and s["k"]
            and s["placement"] == placement and s["speedup"] is not None]
    if not rows:
        return None
    caps = sorted({s["mbit"] for s in rows if s["mbit"] is not None})
    xs = {**{m: i for i, m in enumerate(caps)}, None: len(caps)}
    if ax is None:
        fig, axes = D.new_figure(1, w=5.5, h=4.0)
        ax = axes[0]
    styles = {"remote": "-", "tail_local": "--"}
    ks = sorted({s["k"] for s in rows})
    for topo in sorted({s["topology"] for s in rows}):
        for k in ks:
            pts = sorted((xs[s["mbit"]], s["speedup"]) for s in rows
                         if s["topology"] == topo and s["k"] == k)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], styles.get(topo, ":"),
                    marker="o", ms=4, color=D.data_colour(ks.index(k)), label=f"{topo}, k={k}")
    ax.set_xticks(list(xs.values()), [bandwidth_text(m) for m in xs])
    ax.axhline(1.0, color=D.NEUTRAL, lw=0.8)
    ax.set_xlabel("link bandwidth per direction")
    ax.set_ylabel("speed-up over MTP off (x)")
    ax.set_title(f"{WAN_MODEL}, plan {plan}, {mode}, RTT {rtt_ms:g} ms: MTP speed-up vs "
                 "bandwidth", fontsize=9)
    D.ax_legend_outside(ax, fontsize=7)
    return ax


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
        # appended to: a rerun into the same folder resumes the run (its finished cells kept)
        with (d / "run.log").open("a") as f, bar(None, f"wan {build}", progress) as pb:
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
    ap.add_argument("--out", required=True, help="folder for wan.json and wan_summary.csv "
                    "(a run there that stopped resumes: its finished cells are kept)")
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

    from mtplib.runtime.lib import upstream_info

    # resumes from --out's finished cells (a run that did not fit one session)
    res = run_wan(str(pair.trunk), str(pair.sidecar), cfg, prompts, log=print,
                  progress=tick if a.progress else None, warm_prompt=spare, out_dir=a.out,
                  upstream=upstream_info())
    print(finish(res, a.out)["json"])
    return 0


if __name__ == "__main__":
    import sys

    try:
        raise SystemExit(main())
    except InputError as e:  # a refused config or folder: its one line, not a traceback
        print(f"python -m mtplib.lab.wan: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
