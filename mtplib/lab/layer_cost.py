"""What one V4-Flash layer, one extra verified token and one MTP draft cost, measured on the
V4-Flash-width slice (issue 24), for `mtplib.lab.projection` instead of its assumption.

Why: the WAN projection's largest assumption is its per-layer compute time (1.418 ms, one
published DGX Spark figure spread over 43 layers). The slice (`--preset v4-flash-slice`)
has V4-Flash's real widths, layer kinds and dtypes in six trunk layers + the MTP block;
its partner `v4-flash-slice-l4` is its first four layers alone (same bytes). So

    layer   = (T_slice - T_l4) / 2        one CSA + one HCA layer, no head, no embedding
    V4-Flash plain decode = T_l4 + 39 x layer   (layers 0-3 are the l4 file's; 4-42 are
                                                 CSA/HCA, not hash-routed, like 4-5)

for a one-token decode and for a verify batch of k+1 tokens alike, and

    verify_token_cost = least-squares slope of (V(k+1) / V(1) - 1) over k   (per extra token,
                                                 as a fraction of one plain decode)
    draft_cost        = T_mtp / V(1)            (the MTP block + the real 129,280-row head)

Each T is the median of ``steps`` timed `llama_decode` calls (a device synchronise inside
the timed region, so a GPU's asynchronous work is counted); the spread is the 10-90 %
interval of a bootstrap over the raw steps. A verify batch is rolled back after timing
(`seq_rm`, n_rs_seq >= k + 1) so every step decodes at the same growing context, as
`MTPRuntime` does. Limitations (written into the result): 16 routed experts, not 256, so a
verify's extra tokens touch fewer distinct experts than the real model's (a lower bound,
`distinct_experts`); random weights; a short context (``n_prompt`` + steps tokens).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from mtplib.contract.types import DRAFT_BOUNDS, DRAFT_RANGE
from mtplib.errors import InputError
from mtplib.host import cpu_info, gpu_info
from mtplib.lab.correctness import seeded_prompt
from mtplib.lab.projection.compute_inputs import LAYER_COST_SCHEMA as SCHEMA
from mtplib.lab.sidebyside.machine import loadavg

SLICE = "v4-flash-slice"
PARTNER = "v4-flash-slice-l4"
#: V4-Flash: 43 trunk layers; the partner holds layers 0-3, so 39 more of the slice's kind.
V4_FLASH_LAYERS = 43
EXTRA_LAYERS = V4_FLASH_LAYERS - 4
#: Layers the slice has beyond its partner (one CSA, one HCA).
DIFF_LAYERS = 2
MIN_STEPS = 20


def distinct_experts(n_tokens: int, n_expert: int, n_used: int = 6) -> float:
    """Expected distinct routed experts a batch of ``n_tokens`` reads when each token picks
    ``n_used`` of ``n_expert`` uniformly: the slice (16) under-counts the real model (256)."""
    if not 0 < n_used <= n_expert or n_tokens < 1:
        raise InputError(f"bad expert counts: tokens {n_tokens}, used {n_used} of {n_expert}")
    return n_expert * (1 - (1 - n_used / n_expert) ** n_tokens)


@dataclass(frozen=True)
class LayerCostConfig:
    """How the slice is timed (recorded with the result)."""

    steps: int = 30
    warmup: int = 3
    ks: tuple[int, ...] = (1, 2, 3)
    n_prompt: int = 160  # > 128: every HCA layer has a compressed row before timing starts
    n_ctx: int = 1024
    threads: int = 2
    seed: int = 0
    bootstrap: int = 2000

    def validate(self) -> LayerCostConfig:
        errs = []
        if isinstance(self.steps, bool) or not isinstance(self.steps, int) \
                or self.steps < MIN_STEPS:
            errs.append(f"steps must be an int >= {MIN_STEPS} (median and spread), "
                        f"got {self.steps!r}")
        if not isinstance(self.warmup, int) or self.warmup < 0:
            errs.append(f"warmup must be an int >= 0, got {self.warmup!r}")
        if not self.ks or any(isinstance(k, bool) or not isinstance(k, int)
                              or k not in DRAFT_RANGE for k in self.ks):
            errs.append(f"ks must be draft lengths in {DRAFT_BOUNDS}, got {self.ks!r}")
        if not isinstance(self.n_prompt, int) or self.n_prompt < 2:
            errs.append(f"n_prompt must be an int >= 2, got {self.n_prompt!r}")
        elif isinstance(self.n_ctx, int) and isinstance(self.steps, int) and self.ks and \
                self.n_prompt + self.warmup + self.steps + max(self.ks) + 1 > self.n_ctx:
            errs.append(f"n_ctx {self.n_ctx} is too small for {self.n_prompt} prompt tokens "
                        f"+ {self.warmup + self.steps} steps + a verify batch")
        if errs:
            raise InputError("bad layer-cost config: " + "; ".join(errs))
        return self


def summary(xs_s: Sequence[float]) -> dict:
    """Median and spread of a series of seconds, in ms."""
    ms = np.asarray(xs_s, dtype=float) * 1e3
    return {"n": int(ms.size), "median_ms": float(np.median(ms)),
            "p10_ms": float(np.percentile(ms, 10)), "p90_ms": float(np.percentile(ms, 90)),
            "iqr_ms": float(np.percentile(ms, 75) - np.percentile(ms, 25)),
            "min_ms": float(ms.min()), "max_ms": float(ms.max())}


class _Runner:
    """One model's contexts and timers inside `time_models`: one step at a time."""

    def __init__(self, stack: ExitStack, trunk, sidecar, cfg: LayerCostConfig,
                 rng: np.random.Generator) -> None:
        from mtplib.runtime.model import Context, ContextConfig, Model
        from mtplib.runtime.timing import timed

        self.cfg, self.rng = cfg, rng
        tm = self.tm = stack.enter_context(Model(trunk))
        tcfg = ContextConfig(n_ctx=cfg.n_ctx, n_threads=cfg.threads, n_rs_seq=max(cfg.ks) + 1)
        self.tc = stack.enter_context(Context(tm, tcfg))
        self.mc = None
        if sidecar:
            sm = stack.enter_context(Model(sidecar, load_mtp=True))
            self.mc = stack.enter_context(Context(sm, ContextConfig(
                n_ctx=cfg.n_ctx, n_threads=cfg.threads, mtp=True, nextn_rows="masked")))
        self.raw: dict = {"plain": [], "verify": {str(k): [] for k in cfg.ks}}
        if self.mc:
            self.raw["mtp"] = []
        self.raw["cpu"] = {key: ({} if key == "verify" else []) for key in self.raw}
        self.raw["cpu"]["verify"] = {str(k): [] for k in cfg.ks}
        prompt = seeded_prompt(cfg.seed, cfg.n_prompt, tm.n_vocab)
        self.tc.decode(prompt, range(cfg.n_prompt),
                       logits=[False] * (cfg.n_prompt - 1) + [True])
        self.tok = int(np.argmax(self.tc.logits(-1)))
        # the draft's input row: a fixed random hc*n_embd row (its values change which
        # experts the block routes to, not how much it computes per token)
        self.row = rng.standard_normal((1, tm.n_embd_out)).astype(np.float32)
        # decode + synchronize: work a GPU backend queues is inside the measured time
        self.tt = stack.enter_context(timed(self.tc, sync=True))
        if self.mc:
            self.mt = stack.enter_context(timed(self.mc, sync=True))

    def step(self, i: int) -> None:
        """Verify batches of k+1 tokens (each rolled back), the plain decode that advances
        the context, the MTP draft; kept after the warm-up."""
        cfg, tc, tok = self.cfg, self.tc, self.tok
        p = cfg.n_prompt + i
        keep = i >= cfg.warmup
        for k in cfg.ks:
            drafts = [int(t) for t in self.rng.integers(0, self.tm.n_vocab, k)]
            tc.decode([tok, *drafts], range(p, p + k + 1), logits=True)
            if keep:
                self.raw["verify"][str(k)].append(self.tt.last)
                self.raw["cpu"]["verify"][str(k)].append(self.tt.last_cpu)
            if not tc.seq_rm(0, p):
                raise InputError(f"upstream refused to roll back the {k + 1}-token verify "
                                 f"batch at {p}")
        tc.decode([tok], [p], logits=True)
        if keep:
            self.raw["plain"].append(self.tt.last)
            self.raw["cpu"]["plain"].append(self.tt.last_cpu)
        self.tok = int(np.argmax(tc.logits(-1)))
        if self.mc:
            self.mc.decode([tok], [p], logits=True, rows=self.row)
            if keep:
                self.raw["mtp"].append(self.mt.last)
                self.raw["cpu"]["mtp"].append(self.mt.last_cpu)


def time_models(models: Sequence[tuple[str | Path, str | Path | None]],
                cfg: LayerCostConfig, progress: Callable[[str], None] | None = None
                ) -> list[dict]:
    """Raw timings (seconds) of each (trunk, sidecar or None), all loaded at once and run
    step by step in turn (the order alternating), so that a change in the machine's load
    hits every model's step i alike and differences can be taken step by step. Wall time;
    ``["cpu"]`` holds the same series in process CPU time. Timing the MTP block runs it:
    the deployment policy is asked first ($MTPLIB_POLICY; alpha refuses)."""
    from mtplib.runtime.routing import require_mtp

    cfg = cfg.validate()
    if any(s is not None for _, s in models):
        require_mtp("layer-cost (times the MTP block's draft)")
    rng = np.random.default_rng(cfg.seed)
    with ExitStack() as stack:
        runners = [_Runner(stack, t, s, cfg, rng) for t, s in models]
        for i in range(cfg.warmup + cfg.steps):
            for r in (runners if i % 2 == 0 else runners[::-1]):
                r.step(i)
            if progress and i >= cfg.warmup:
                progress(f"step {i - cfg.warmup + 1}/{cfg.steps}")
        return [r.raw for r in runners]


def _boot_idx(rng: np.random.Generator, n: int, b: int) -> np.ndarray:
    return rng.integers(0, n, (b, n))


def derive(slice_raw: dict, l4_raw: dict, cfg: LayerCostConfig) -> dict:
    """The projection's inputs from the two files' raw timings (seconds), step by step
    (step i of both ran back to back), with bootstrap 10-90 % intervals over the steps."""
    rng = np.random.default_rng(cfg.seed)
    n = len(slice_raw["plain"])
    if any(len(x) != n for x in [l4_raw["plain"], *slice_raw["verify"].values(),
                                 *l4_raw["verify"].values()]):
        raise InputError("the slice's and its partner's series must have one entry per step")
    idx = _boot_idx(rng, n, cfg.bootstrap)
    series = {"1": (slice_raw["plain"], l4_raw["plain"])}
    series.update({str(k + 1): (slice_raw["verify"][str(k)], l4_raw["verify"][str(k)])
                   for k in cfg.ks})
    layer, v4 = {}, {}  # batch size -> per-step seconds
    for b, (a, c) in series.items():
        a, c = np.asarray(a, float), np.asarray(c, float)
        layer[b] = (a - c) / DIFF_LAYERS
        v4[b] = c + EXTRA_LAYERS * layer[b]

    def med(x: np.ndarray) -> float:
        return float(np.median(x))

    def iv(x: np.ndarray | Callable[[np.ndarray], float], scale: float = 1e3) -> list[float]:
        """10-90 % of a statistic (the median of ``x``, or ``x(steps)``) over resamples."""
        stat = x if callable(x) else (lambda j: med(x[j]))
        boots = np.array([stat(j) for j in idx])
        return [float(np.percentile(boots, 10)) * scale,
                float(np.percentile(boots, 90)) * scale]

    ks = np.asarray(cfg.ks, dtype=float)

    def beta(j: np.ndarray | slice) -> float:
        v1 = np.median(v4["1"][j])
        ys = np.asarray([np.median(v4[str(k + 1)][j]) / v1 - 1 for k in cfg.ks])
        return float((ks @ ys) / (ks @ ks))

    whole = slice(None)
    v1 = med(v4["1"])
    out = {
        "layer_ms": med(layer["1"]) * 1e3,
        "layer_ms_p10_p90": iv(layer["1"]),
        "v4_flash_decode_ms": v1 * 1e3,
        "v4_flash_decode_ms_p10_p90": iv(v4["1"]),
        "layer_s": v1 / V4_FLASH_LAYERS,
        "layer_s_note": "V4-Flash plain decode / 43 (head and embedding folded in, as the "
                        "assumption it replaces)",
        "verify_token_cost": beta(whole),
        "verify_token_cost_p10_p90": iv(beta, scale=1.0),
        "verify_by_k": {str(k): {"v4_flash_ms": med(v4[str(k + 1)]) * 1e3,
                                 "per_extra_token": (med(v4[str(k + 1)]) / v1 - 1) / k,
                                 "layer_ms": med(layer[str(k + 1)]) * 1e3}
                        for k in cfg.ks},
        "method": "paired: step i of the slice and of its partner ran back to back; layer = "
                  "(slice - partner) / 2 per step, V4-Flash = partner + 39 x layer per step; "
                  "medians over the steps; 10-90 % of a bootstrap over the steps",
    }
    if "mtp" in slice_raw:
        m = np.asarray(slice_raw["mtp"], float)
        out.update({"draft_ms": med(m) * 1e3, "draft_ms_p10_p90": iv(m),
                    "draft_cost": med(m) / v1,
                    "draft_cost_p10_p90": iv(lambda j: med(m[j]) / med(v4["1"][j]),
                                             scale=1.0)})
    return out


@dataclass
class LayerCostResult:
    """One measurement: raw steps, summaries, the derived projection inputs, provenance."""

    config: dict
    files: dict
    hardware: dict
    backend: dict
    raw: dict
    summaries: dict
    derived: dict
    limitations: list[str]
    #: the same derivation on each decode's process CPU time
    derived_cpu: dict = field(default_factory=dict)
    #: which of the two the projection takes: "cpu" for a one-thread run without a GPU (on a
    #: shared machine the wall time counts the other jobs' share; one thread's CPU time is
    #: the decode's own cost), else "wall"
    projection_basis: str = "wall"
    command: str = ""
    loadavg_before: list[float] = field(default_factory=list)
    loadavg_after: list[float] = field(default_factory=list)
    seconds: dict = field(default_factory=dict)
    schema: str = SCHEMA

    def to_dict(self) -> dict:
        return asdict(self)


def hardware() -> dict:
    """The machine, as the projection cites it: the GPU when a GPU build ran on one."""
    cpu = cpu_info()
    gpus = gpu_info()
    return {"cpu": cpu, "gpus": gpus,
            "label": (f"{gpus[0]['name']} (driver {gpus[0]['driver']})" if gpus
                      else f"{cpu['model']}, {cpu['logical_cores']} logical cores")}


LIMITATIONS = [
    "16 routed experts in total, not 256 (6 active + 1 shared per token as in V4-Flash): a "
    "one-token decode does the real per-token work; a verify batch of n tokens touches at "
    "most 16 distinct experts (expected 9.8 / 12.1 / 13.6 for n = 2..4) where V4-Flash "
    "touches about 11.9 / 17.6 / 23.2, so verify_token_cost is a LOWER bound",
    "random weights (routing and activations are not the trained model's)",
    "short context: the prompt plus the timed steps (a few hundred tokens); attention over "
    "a long context (the projection's 32k) costs more",
    "layers 4-42 are taken as 39 layers of the slice's CSA+HCA average (V4-Flash has 20 "
    "CSA and 19 HCA there)",
]


def _existing(fixture_dir: Path, preset: str, seed: int, sidecar: bool):
    """The pair `write_fixture` would write, if its files are all there (else None)."""
    from mtplib.model.fixture import FixturePair, fixture_names
    from mtplib.model.presets import get_preset

    t, m = (fixture_dir / n for n in fixture_names(preset, seed))
    if not t.is_file() or (sidecar and not m.is_file()):
        return None
    return FixturePair(t, m if sidecar else None, get_preset(preset), seed, preset)


def measure(fixture_dir: str | Path, cfg: LayerCostConfig | None = None, *, seed: int = 0,
            command: str = "", progress: Callable[[str], None] | None = None,
            reuse: bool = False) -> LayerCostResult:
    """Generate the slice and its partner in ``fixture_dir`` (``reuse``: take the files
    already there as they are; the result records the sha256 of what was timed either
    way), time both step by step, derive."""
    from mtplib.model.fixture import write_fixture
    from mtplib.runtime.devices import backend_info

    cfg = (cfg or LayerCostConfig()).validate()
    la0 = loadavg()
    secs: dict = {}
    t0 = time.perf_counter()
    d = Path(fixture_dir)
    sl = (reuse and _existing(d, SLICE, seed, True)) or write_fixture(d, seed=seed,
                                                                      preset=SLICE)
    l4 = (reuse and _existing(d, PARTNER, seed, False)) or write_fixture(
        d, seed=seed, preset=PARTNER, sidecar=False)
    secs["generate"] = round(time.perf_counter() - t0, 1)
    secs["reused_files"] = bool(reuse and secs["generate"] < 1)
    files = {"slice": sl.summary(), "partner": l4.summary()}
    t0 = time.perf_counter()
    raw_slice, raw_l4 = time_models([(sl.trunk, sl.sidecar), (l4.trunk, None)], cfg,
                                    progress=progress)
    secs["time"] = round(time.perf_counter() - t0, 1)
    def summaries(a: dict, b: dict) -> dict:
        return {"slice": {"plain": summary(a["plain"]), "mtp": summary(a["mtp"]),
                          **{f"verify_k{k}": summary(a["verify"][str(k)]) for k in cfg.ks}},
                "partner": {"plain": summary(b["plain"]),
                            **{f"verify_k{k}": summary(b["verify"][str(k)]) for k in cfg.ks}}}

    backend = backend_info()
    basis = "cpu" if cfg.threads == 1 and not backend["gpu_devices"] else "wall"
    return LayerCostResult(
        config=asdict(cfg), files=files, hardware=hardware(), backend=backend,
        raw={"slice": raw_slice, "partner": raw_l4},
        summaries={"wall": summaries(raw_slice, raw_l4),
                   "cpu": summaries(raw_slice["cpu"], raw_l4["cpu"])},
        derived=derive(raw_slice, raw_l4, cfg),
        derived_cpu=derive(raw_slice["cpu"], raw_l4["cpu"], cfg),
        projection_basis=basis, limitations=list(LIMITATIONS),
        command=command, loadavg_before=la0, loadavg_after=loadavg(), seconds=secs)
