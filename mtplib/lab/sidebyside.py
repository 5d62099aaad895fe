"""mtplib's Python MTP loop side by side with upstream's own C++ loop, on the same files.

Three measurements, each saved as one JSON file; the runs of the side-by-side and of the
sweep are typed rows (`SideRun`, `SweepRun`) until they are written, and their summaries read
them typed (`from_dict` for the rows of a file):

- **cost ratio** (`cost_ratio`): one-token decode time of the MTP block (MTP context, one
  token + one hidden row) over one-token decode time of the trunk, timed around the
  `llama_decode` call only (no Python loop around it), interleaved trunk / MTP, median of
  many tokens. The quantity the `v4-ratio-cpu` preset is sized by (real V4-Flash: ~1/43).
- **side by side** (`run_side_by_side`): per case (plain decoding; k drafts with real MTP
  drafts; k drafts with upstream's synthetic acceptance ``--spec-synth-rates``), the same
  trunk, sidecar, prompt (token ids), threads, context, batch sizes, k and rates through
  upstream's `llama-server` (`mtplib.lab.upstream_tools`) and through `MTPRuntime`. Runs are
  interleaved A/B within a case (warm-up of each first, then U M, M U, U M, ...), the
  load average is read before and after every run; decode tok/s is each side's own
  measure of the same quantity ((n_new - 1) / time from the first to the last token).
  Ratio = median mtplib / median upstream.
- **acceptance sweep** (`acceptance_sweep`): mtplib only, MTP off and k = 1..3 at
  synthetic rates (the same rate at every position, upstream's unconditional semantics)
  with the real MTP block drafting every step; speed-up over MTP off and the break-even
  rate per k.

Policy: each of the three runs MTP, so each first asks `mtplib.runtime.routing.require_mtp`
(the deployment policy through `negotiate()`, as MTPRuntime does) for every draft length
it will run, before it loads a model or starts upstream's server; under alpha it raises
RouteRefused naming the policy (exit 2 from `mtplib compare-upstream`).

`table(path)` renders the side-by-side table from the JSON (a pandas DataFrame) for the
benchmark notebook; `sweep_table(path)` / `break_even(rows)` the sweep.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from mtplib import paths, pins
from mtplib.contract.capabilities import Policy
from mtplib.errors import InputError
from mtplib.files import write_json
from mtplib.lab import sweep
from mtplib.lab.correctness import seeded_prompt
from mtplib.lab.rows import row_from_dict, typed
from mtplib.lab.sweep import SweepConfig, median_or_none
from mtplib.runtime.results import GenerationMetrics
from mtplib.runtime.routing import require_mtp
from mtplib.runtime.settings import DecodeSettings

LOG = Callable[[str], None]
ENGINES = ("upstream", "mtplib")


def loadavg() -> list[float]:
    try:
        return [float(x) for x in Path("/proc/loadavg").read_text().split()[:3]]
    except OSError:
        return [float("nan")] * 3


# -- cases ------------------------------------------------------------------------------
def parse_rates(text: str) -> list[float]:
    """``"0.77,0.37"`` -> [0.77, 0.37]; validated as upstream does (in [0, 1],
    non-increasing)."""
    try:
        rates = [float(x) for x in text.replace(" ", "").split(",") if x != ""]
    except ValueError:
        raise InputError(f"rates must be comma-separated numbers, got {text!r}") from None
    if not rates or any(not 0.0 <= r <= 1.0 for r in rates):
        raise InputError(f"rates must be in [0, 1], got {text!r}")
    if any(b > a for a, b in zip(rates, rates[1:], strict=False)):
        raise InputError(f"rates must be non-increasing (unconditional per position): {text!r}")
    return rates


def rates_for_k(rates: Sequence[float], k: int) -> list[float]:
    """Exactly k rates (upstream requires n_max values): cut, or pad with the last one."""
    rates = list(rates)
    return (rates + [rates[-1]] * k)[:k]


@dataclass(frozen=True)
class Case:
    """One configuration: k = 0 plain decoding; rates None = real MTP drafts."""

    k: int
    rates: tuple[float, ...] | None = None

    @property
    def label(self) -> str:
        if self.k == 0:
            return "plain"
        if self.rates is None:
            return f"k={self.k} mtp"
        return f"k={self.k} synth {','.join(f'{r:g}' for r in self.rates)}"

    @property
    def synthetic(self) -> bool:
        return self.rates is not None


def make_cases(ks: Sequence[int], rate_sets: Sequence[Sequence[float]], *,
               real_mtp: bool = True) -> list[Case]:
    """Plain decoding, then per k: real MTP drafts (optional) and each synthetic rate set
    (padded / cut to k values)."""
    out = [Case(0)]
    for k in ks:
        if k < 1:
            raise InputError(f"k must be >= 1 for MTP cases, got {k}")
        if real_mtp:
            out.append(Case(k))
        for rs in rate_sets:
            out.append(Case(k, tuple(rates_for_k(rs, k))))
    return out


def ab_order(runs: int, warmup: int = 1) -> list[tuple[int | None, str]]:
    """The interleaved run order within one case: (rep or None for warm-up, engine).

    Warm-ups of both engines first (excluded from summaries), then the measured
    repetitions alternating which engine goes first (U M, M U, U M, ...), so a slow drift
    in machine load hits both sides alike.
    """
    if runs < 1 or warmup < 0:
        raise InputError("runs must be >= 1 and warmup >= 0")
    order: list[tuple[int | None, str]] = []
    for _ in range(warmup):
        order += [(None, "upstream"), (None, "mtplib")]
    for rep in range(runs):
        pair = ENGINES if rep % 2 == 0 else tuple(reversed(ENGINES))
        order += [(rep, e) for e in pair]
    return order


# -- the cost ratio -----------------------------------------------------------------------
def cost_ratio(trunk: str, sidecar: str, *, n_tokens: int = 200, n_prompt: int = 32,
               warmup: int = 16, threads: int = 2, n_ctx: int = 1024, seed: int = 0,
               policy: Policy | str | None = None) -> dict:
    """MTP-step / trunk-step one-token decode time (medians), interleaved, raw decode.
    The MTP block runs: refused (RouteRefused) under a policy that disables MTP."""
    from mtplib.runtime.model import Context, ContextConfig, Model
    from mtplib.runtime.timing import timed

    require_mtp("cost ratio", policy=policy)
    with Model(trunk) as tm, Model(sidecar, load_mtp=True) as sm:
        common = dict(n_ctx=n_ctx, n_threads=threads)
        with Context(tm, ContextConfig(**common, nextn_rows="all")) as tc, \
                Context(sm, ContextConfig(**common, mtp=True, nextn_rows="masked")) as mc:
            prompt = seeded_prompt(seed, n_prompt, tm.n_vocab)
            tc.decode(prompt, range(n_prompt), logits=[False] * (n_prompt - 1) + [True])
            rows = tc.nextn_rows(n_prompt)
            mc.decode(prompt[1:], range(1, n_prompt), rows=rows[:-1])
            h, tok = rows[-1].copy(), int(np.argmax(tc.logits(-1)))
            with timed(tc) as tt, timed(mc) as mt:
                for i in range(warmup + n_tokens):
                    p = n_prompt + i
                    if i % 2 == 0:  # alternate which goes first
                        mc.decode([tok], [p], logits=True, rows=h[None, :])
                        tc.decode([tok], [p], logits=True)
                    else:
                        tc.decode([tok], [p], logits=True)
                        mc.decode([tok], [p], logits=True, rows=h[None, :])
                    h = tc.nextn_rows(1)[0].copy()
                    tok = int(np.argmax(tc.logits(-1)))
    t_trunk = tt.times[warmup:]
    t_mtp = mt.times[warmup:]
    med_t, med_m = statistics.median(t_trunk), statistics.median(t_mtp)
    cpu_t, cpu_m = statistics.median(tt.cpu[warmup:]), statistics.median(mt.cpu[warmup:])
    return {"trunk_decode_ms_median": 1e3 * med_t, "mtp_decode_ms_median": 1e3 * med_m,
            "ratio_mtp_over_trunk": med_m / med_t, "one_over_ratio": med_t / med_m,
            "trunk_tok_s_raw": 1.0 / med_t,
            "trunk_cpu_ms_median": 1e3 * cpu_t, "mtp_cpu_ms_median": 1e3 * cpu_m,
            "cpu_ratio_mtp_over_trunk": cpu_m / cpu_t if cpu_t else None,
            "trunk_decode_ms_p10_p90": [1e3 * float(np.percentile(t_trunk, q)) for q in (10, 90)],
            "mtp_decode_ms_p10_p90": [1e3 * float(np.percentile(t_mtp, q)) for q in (10, 90)],
            "n_tokens": n_tokens, "warmup": warmup, "threads": threads, "n_ctx": n_ctx,
            "n_prompt": n_prompt, "loadavg": loadavg(),
            "method": "median one-token llama_decode time (perf_counter around the C call "
                      "only), trunk and MTP interleaved token by token, positions "
                      f"{n_prompt}..{n_prompt + warmup + n_tokens - 1}, first {warmup} "
                      "dropped"}


# -- the side-by-side ----------------------------------------------------------------------
#: the context both sides run with unless told otherwise: the SWA cache as llama-server
#: has it by default (false, a window-sized cache; true is the C API default and
#: mtplib's). Runs before swa_full was recorded had false on the server and true in mtplib.
SIDE_BY_SIDE_SETTINGS = DecodeSettings(n_ctx=1024, swa_full=False)
#: the settings recorded in a result's ``config`` (``threads`` is n_threads; the key
#: predates DecodeSettings and the committed results and plots read it)
_RECORDED = (("threads", "n_threads"), ("n_ctx", "n_ctx"), ("n_batch", "n_batch"),
             ("n_ubatch", "n_ubatch"))


@dataclass
class SideBySideConfig:
    ks: tuple[int, ...] = (1, 2, 3)
    rate_sets: tuple[tuple[float, ...], ...] = ((0.0,), (0.77, 0.37), (1.0,))
    real_mtp: bool = True
    runs: int = 5
    warmup: int = 1
    #: the same settings on both sides (hidden_rows is mtplib's only)
    settings: DecodeSettings = SIDE_BY_SIDE_SETTINGS
    n_new: int = 128
    n_prompt: int = 32
    prompt_seed: int = 0
    synth_seed: int = 0

    def to_dict(self) -> dict:
        """The recorded config: the keys and order of the committed results."""
        s = self.settings
        return {"ks": list(self.ks), "rate_sets": [list(r) for r in self.rate_sets],
                "real_mtp": self.real_mtp, "runs": self.runs, "warmup": self.warmup,
                **{key: getattr(s, f) for key, f in _RECORDED},
                "n_new": self.n_new, "n_prompt": self.n_prompt,
                "prompt_seed": self.prompt_seed, "synth_seed": self.synth_seed,
                "kv_type": s.kv_type, "flash_attn": s.flash_attn, "swa_full": s.swa_full}


#: the fields only one engine's runs have (the other's rows lack the keys)
UPSTREAM_ONLY = ("decode_ms", "prompt_n", "prompt_tok_s", "argv")
MTPLIB_ONLY = ("time_s", "hidden_rows")


@dataclass(frozen=True)
class SideRun:
    """One run of one engine in one case: a row of a side-by-side file's ``rows``. Built
    typed where it is measured (`_UpstreamSide.run`, `_MtplibSide.run`), read typed by
    `summarize`; a dict (`to_dict`) in the file only. An upstream run has the server's
    timings (`UPSTREAM_ONLY`), an mtplib run its time split and hidden-row mode
    (`MTPLIB_ONLY`)."""

    decode_tok_s: float | None
    n_generated: int
    drafted: int
    accepted: int
    acceptance_rate: float | None
    tokens: list[int]
    case: str
    k: int
    rates: list[float] | None
    synthetic: bool
    engine: str  # one of ENGINES
    rep: int | None  # None: a warm-up
    warmup: bool
    loadavg_before: list[float]
    loadavg_after: list[float]
    quality_valid: bool
    decode_ms: float | None = None
    prompt_n: int | None = None
    prompt_tok_s: float | None = None
    argv: list[str] | None = None
    time_s: dict[str, float] | None = None
    hidden_rows: str | None = None

    def to_dict(self) -> dict:
        """The row as the committed files hold it: the measured numbers (upstream's timings
        after n_generated, mtplib's time split after the tokens), the case, upstream's argv
        last."""
        d = asdict(self)
        up = {f: d.pop(f) for f in UPSTREAM_ONLY}
        mt = {f: d.pop(f) for f in MTPLIB_ONLY}
        upstream = self.engine == "upstream"
        head = {f: d.pop(f) for f in ("decode_tok_s", "n_generated")}
        counts = {f: d.pop(f) for f in ("drafted", "accepted", "acceptance_rate", "tokens")}
        timings = {f: up[f] for f in UPSTREAM_ONLY[:3]} if upstream else {}
        return {**head, **timings, **counts, **({} if upstream else mt), **d,
                **({"argv": up["argv"]} if upstream else {})}

    @classmethod
    def from_dict(cls, r: dict) -> SideRun:
        """A row of a side-by-side file (its engine's own keys must be there too)."""
        engine = r.get("engine")
        if engine not in ENGINES:
            raise InputError(f"a side-by-side row's engine must be one of {ENGINES}, "
                             f"got {engine!r}")
        return row_from_dict(cls, r, f"a side-by-side {engine} row",
                             UPSTREAM_ONLY if engine == "upstream" else MTPLIB_ONLY)


class _MtplibSide:
    """One MTPRuntime per case; synthetic cases get a fresh SyntheticDrafter per run (the
    same seed, as upstream reseeds per request) wrapping the real MTP drafter."""

    def __init__(self, trunk: str, sidecar: str, case: Case, cfg: SideBySideConfig,
                 policy: Policy | str | None = None) -> None:
        from mtplib.runtime.speculative import MTPRuntime

        self.case, self.cfg = case, cfg
        self.rt = MTPRuntime(trunk, sidecar if case.k else None, k=case.k,
                             settings=cfg.settings, policy=policy)
        self.mtp = self.rt.engine.drafter

    def run(self, prompt: list[int], ref: list[int] | None, **case: Any) -> SideRun:
        from mtplib.runtime.drafters import SyntheticDrafter

        if self.case.synthetic:
            self.rt.engine.drafter = SyntheticDrafter(
                ref or [0], len(prompt), list(self.case.rates), self.rt.trunk.n_vocab,
                seed=self.cfg.synth_seed, inner=self.mtp)
        try:
            toks, g = self.rt.generate(prompt, self.cfg.n_new)
        finally:
            self.rt.engine.drafter = self.mtp
        return SideRun(decode_tok_s=g.decode_tok_s, n_generated=g.n_generated,
                       drafted=g.drafted, accepted=g.accepted,
                       acceptance_rate=g.acceptance_rate, tokens=toks,
                       time_s=dict(g.time_s), hidden_rows=g.hidden_rows,
                       loadavg_after=loadavg(), **case)

    def close(self) -> None:
        self.rt.close()


class _UpstreamSide:
    def __init__(self, trunk: str, sidecar: str, case: Case, cfg: SideBySideConfig,
                 log_path: Path | None, policy: Policy | str | None = None) -> None:
        from mtplib.lab.upstream_tools import Server, ServerConfig

        if case.k:  # upstream's own MTP loop is an MTP path like ours
            require_mtp("upstream's MTP loop (llama-server)", (case.k,), policy=policy)
        self.server = Server(ServerConfig(
            model=trunk, mtp=sidecar if case.k else None, k=case.k,
            rates=list(case.rates) if case.rates else None, settings=cfg.settings,
            seed=cfg.synth_seed),
            log_path=log_path)
        self.argv = self.server.cfg.argv(self.server.binary, self.server.port)

        self.n_new = cfg.n_new

    def run(self, prompt: list[int], ref: list[int] | None, **case: Any) -> SideRun:
        from mtplib.lab.upstream_tools import parse_completion

        c = parse_completion(self.server.complete(prompt, self.n_new))
        return SideRun(**asdict(c), argv=self.argv, loadavg_after=loadavg(), **case)

    def close(self) -> None:
        self.server.close()


def run_side_by_side(trunk: str, sidecar: str, cfg: SideBySideConfig, *,
                     log: LOG | None = None, log_dir: Path | None = None,
                     policy: Policy | str | None = None) -> dict:
    """Every case through upstream's llama-server and mtplib, interleaved A/B. Every MTP
    case's draft length is routed under ``policy`` before any server starts."""
    from mtplib.model.gguf_header import read_header

    cases = make_cases(cfg.ks, cfg.rate_sets, real_mtp=cfg.real_mtp)
    pol = require_mtp("side-by-side", sorted({c.k for c in cases if c.k}), policy=policy)
    log = log or (lambda s: None)
    t0 = time.time()
    n_vocab = read_header(trunk).n_vocab
    prompt = seeded_prompt(cfg.prompt_seed, cfg.n_prompt, n_vocab)
    rows: list[SideRun] = []
    ref: list[int] | None = None
    for case in cases:
        log(f"{case.label}: starting upstream server and mtplib runtime")
        la0 = loadavg()
        up = _UpstreamSide(trunk, sidecar, case, cfg,
                           (log_dir / f"server-{_slug(case.label)}.log") if log_dir else None,
                           policy=pol)
        mt = _MtplibSide(trunk, sidecar, case, cfg, policy=pol)
        try:
            sides = {"upstream": up, "mtplib": mt}
            for rep, engine in ab_order(cfg.runs, cfg.warmup):
                la = loadavg()
                r = sides[engine].run(prompt, ref, case=case.label, k=case.k,
                                      rates=list(case.rates) if case.rates else None,
                                      synthetic=case.synthetic, engine=engine, rep=rep,
                                      warmup=rep is None, loadavg_before=la,
                                      quality_valid=not case.synthetic)
                rows.append(r)
                log(f"  {engine:8s} rep={rep} {r.decode_tok_s:.1f} tok/s "
                    f"acc={r.accepted}/{r.drafted} load={la[0]:.2f}")
            if case.k == 0 and ref is None:  # MTP-off output: the synthetic reference
                ref = next(r.tokens for r in rows
                           if r.case == "plain" and r.engine == "mtplib")
        finally:
            up.close()
            mt.close()
        log(f"{case.label}: load {la0} -> {loadavg()}")
    return {"kind": "side-by-side", "config": cfg.to_dict(), "trunk": str(trunk),
            "sidecar": str(sidecar), "prompt": prompt, "rows": [r.to_dict() for r in rows],
            "summary": summarize(rows), "host": host_info(), "wall_s": time.time() - t0}


#: where the committed side-by-side results live (issue 7)
EVIDENCE_DIR = paths.EVIDENCE / "side-by-side"


def evidence_dir(path: str | Path | None = None) -> Path:
    """A results folder; relative paths are taken from the repository root, so a notebook
    finds the committed files whatever its working directory."""
    if path is None:
        return EVIDENCE_DIR
    p = Path(path)
    return p if p.is_absolute() else EVIDENCE_DIR.parents[1] / p


def _slug(s: str) -> str:
    return "".join(c if c.isalnum() else "-" for c in s).strip("-")


def host_info() -> dict:
    from mtplib.host import cpu_info, git_state
    from mtplib.lab.upstream_tools import tools_dir

    info = {"machine": platform.machine(), "cpus": os.cpu_count(), "python":
            platform.python_version(), "pins": pins.as_dict(),
            "mtplib_git": git_state(paths.REPO),
            "cpu_model": cpu_info()["model"]}
    bi = tools_dir() / "build_info.json"
    if bi.is_file():
        info["upstream_build"] = json.loads(bi.read_text())
    return info



def summarize(rows: Sequence[SideRun | dict]) -> list[dict]:
    """One row per case: median decode tok/s of each engine, ratio mtplib / upstream,
    accepted / drafted of each, token agreement, load average range."""
    out = []
    runs = typed(SideRun, rows)
    labels = list(dict.fromkeys(r.case for r in runs))
    for label in labels:
        rs = [r for r in runs if r.case == label and not r.warmup]
        by = {e: [r for r in rs if r.engine == e] for e in ENGINES}
        med = {e: median_or_none(r.decode_tok_s for r in by[e]) for e in ENGINES}
        first = rs[0]
        la = [r.loadavg_before[0] for r in rs] + [r.loadavg_after[0] for r in rs]
        row = {"case": label, "k": first.k, "rates": first.rates,
               "synthetic": first.synthetic, "runs": min(len(by[e]) for e in ENGINES),
               "upstream_tok_s": med["upstream"], "mtplib_tok_s": med["mtplib"],
               "ratio": (med["mtplib"] / med["upstream"]) if med["upstream"] else None,
               "upstream_tok_s_min_max": _minmax(by["upstream"]),
               "mtplib_tok_s_min_max": _minmax(by["mtplib"]),
               "loadavg_1m_min_max": [min(la), max(la)] if la else None}
        for e in ENGINES:
            d = sum(r.drafted for r in by[e])
            a = sum(r.accepted for r in by[e])
            row[f"{e}_acceptance"] = a / d if d else None
            row[f"{e}_accepted_drafted_per_run"] = [by[e][0].accepted, by[e][0].drafted] \
                if by[e] else None
        if not first.synthetic and by["upstream"] and by["mtplib"]:
            u, m = by["upstream"][0].tokens, by["mtplib"][0].tokens
            row["tokens_equal"] = u == m
            row["first_token_divergence"] = next(
                (i for i, (a, b) in enumerate(zip(u, m, strict=False)) if a != b), None)
        out.append(row)
    return out


def _minmax(rs: list[SideRun]) -> list[float] | None:
    xs = [r.decode_tok_s for r in rs if r.decode_tok_s is not None]
    return [min(xs), max(xs)] if xs else None


def table(path: str | Path):
    """The side-by-side table of a results JSON (pandas DataFrame, one row per case)."""
    import pandas as pd

    data = json.loads(Path(path).read_text())
    s = pd.DataFrame(data["summary"])
    cols = ["case", "k", "rates", "runs", "upstream_tok_s", "mtplib_tok_s", "ratio",
            "upstream_acceptance", "mtplib_acceptance", "loadavg_1m_min_max"]
    if "tokens_equal" in s:
        cols.append("tokens_equal")
    return s[[c for c in cols if c in s]].round(3)


COST_RATIO_COLUMNS = ("threads", "trunk_decode_ms_median", "mtp_decode_ms_median",
                      "ratio_mtp_over_trunk", "one_over_ratio", "n_tokens")


def cost_ratio_table(paths: Sequence[str | Path]):
    """One row per cost-ratio JSON (`compare-upstream --cost-ratio-only`): the MTP step's
    cost as a fraction of a trunk step, with the load it was measured under."""
    import pandas as pd

    rows = []
    for p in paths:
        d = json.loads(Path(p).read_text())
        c = d["cost_ratio"]
        rows.append({"file": Path(p).name, "trunk": Path(d["trunk"]).name,
                     **{k: c.get(k) for k in COST_RATIO_COLUMNS},
                     "loadavg": c.get("loadavg", d.get("loadavg"))})
    return pd.DataFrame(rows).round(4)


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
    (`mtplib.lab.sweep.break_even`) and against the nominal rate (the seeded draws of a
    short run differ from the nominal rate)."""
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


def save(result: dict, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json(path, result, indent=1, default=float)
    return path


def sweep_title(data: dict) -> str:
    """What a sweep file measured, as a reader names it: the fixture preset and seed (not
    the file stem 'v4-v4-ratio-cpu-s0'), the engine and the threads."""
    from mtplib.lab.display import model_name

    return (f"mtplib MTP loop, whole model: {model_name(data['trunk'])}, "
            f"{data['config']['threads']} thread(s)")


def plot_sweep(path: str | Path, ax=None, *, legend: bool = True):
    """Speed-up over MTP off vs the synthetic rate (same at every position), one line per
    k, break-even marked; the legend right of the axes. Returns the matplotlib Axes. The
    rate is upstream's ``--spec-synth-rates`` one, the same at every position and
    unconditional."""
    from matplotlib.lines import Line2D

    from mtplib.lab import display as D

    data = json.loads(Path(path).read_text())
    if ax is None:
        fig, axes = D.new_figure(1, w=5.0, h=3.8)
        ax = axes[0]
    for k in sorted({r["k"] for r in data["summary"]}):
        pts = sorted((r["rate"], r["speedup"]) for r in data["summary"]
                     if r["k"] == k and r["speedup"] is not None)
        ax.plot([x for x, _ in pts], [y for _, y in pts], "o-", color=D.data_colour(k),
                label=D.k_label(k))
    for be in data["break_even"]:
        if be["break_even_rate"] is not None:
            ax.plot([be["break_even_rate"]], [1.0], marker="x", ms=9, ls="none",
                    color=D.data_colour(be["k"]))
    ax.axhline(1.0, color=D.NEUTRAL, lw=0.8, ls="--", label="speed-up 1 (MTP off)")
    ax.set_xlabel("synthetic acceptance rate (fraction)")
    ax.set_ylabel("decode speed-up over MTP off (x)")
    ax.set_title(sweep_title(data), fontsize=9)
    if legend:
        h, lab = ax.get_legend_handles_labels()
        h.append(Line2D([], [], color=D.NEUTRAL, marker="x", ms=8, ls="none"))
        lab.append("break-even (speed-up 1, per k)")
        ax.legend(h, lab, loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0,
                  fontsize=8)
    return ax


def plot_sweeps(paths: Sequence[str | Path]):
    """One panel per sweep file (same y scale), one legend right of them all; a Figure."""
    from matplotlib.lines import Line2D

    from mtplib.lab import display as D

    if not paths:
        raise InputError("no sweep files to plot")
    fig, axes = D.new_figure(len(paths), w=4.6, h=3.8)
    for p, ax in zip(paths, axes, strict=True):
        plot_sweep(p, ax=ax, legend=False)
        ax.set_title(f"{ax.get_title()}\n({Path(p).name})", fontsize=8)
    for ax in axes[1:]:
        ax.set_ylabel("")
    fig.suptitle("Acceptance -> speed-up on the side-by-side preset (synthetic drafts at one "
                 "unconditional rate for every position; the MTP block drafts)", fontsize=10)
    D.legend_outside(fig, axes, extra=[(Line2D([], [], color=D.NEUTRAL, marker="x", ms=8,
                                               ls="none"), "break-even (speed-up 1, per k)")])
    return fig
