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
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from mtplib.errors import InputError
from mtplib.host import cpu_info, gpu_info
from mtplib.lab.correctness import seeded_prompt
from mtplib.lab.projection import LAYER_COST_SCHEMA as SCHEMA
from mtplib.lab.sidebyside import loadavg

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
        if not self.ks or any(isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= 8
                              for k in self.ks):
            errs.append(f"ks must be draft lengths in 1..8, got {self.ks!r}")
        if not isinstance(self.n_prompt, int) or self.n_prompt < 2:
            errs.append(f"n_prompt must be an int >= 2, got {self.n_prompt!r}")
        elif isinstance(self.n_ctx, int) and isinstance(self.steps, int) and self.ks and \
                self.n_prompt + self.warmup + self.steps + max(self.ks) + 1 > self.n_ctx:
            errs.append(f"n_ctx {self.n_ctx} is too small for {self.n_prompt} prompt tokens "
                        f"+ {self.warmup + self.steps} steps + a verify batch")
        if errs:
            raise InputError("bad layer-cost config: " + "; ".join(errs))
        return self


class _SyncTimer:
    """Stands in for the llama_cpp module on one Context: times `llama_decode` plus a
    `llama_synchronize`, so work a GPU backend queues is inside the measured time."""

    def __init__(self, llama) -> None:
        self._llama = llama
        self.last = 0.0

    def __getattr__(self, name):
        return getattr(self._llama, name)

    def llama_decode(self, ctx, batch):
        t0 = time.perf_counter()
        rc = self._llama.llama_decode(ctx, batch)
        self._llama.llama_synchronize(ctx)
        self.last = time.perf_counter() - t0
        return rc


def summary(xs_s: Sequence[float]) -> dict:
    """Median and spread of a series of seconds, in ms."""
    ms = np.asarray(xs_s, dtype=float) * 1e3
    return {"n": int(ms.size), "median_ms": float(np.median(ms)),
            "p10_ms": float(np.percentile(ms, 10)), "p90_ms": float(np.percentile(ms, 90)),
            "iqr_ms": float(np.percentile(ms, 75) - np.percentile(ms, 25)),
            "min_ms": float(ms.min()), "max_ms": float(ms.max())}


def time_model(trunk: str | Path, sidecar: str | Path | None, cfg: LayerCostConfig,
               progress: Callable[[str], None] | None = None) -> dict:
    """Raw timings on one trunk (and, with ``sidecar``, its MTP block): per step, a verify
    batch of k+1 tokens for each k (then rolled back), then the plain one-token decode
    that advances the context, then (with a sidecar) one MTP draft decode. Seconds."""
    from mtplib.runtime.model import Context, ContextConfig, Model

    cfg = cfg.validate()
    k_max = max(cfg.ks)
    raw: dict = {"plain": [], "verify": {str(k): [] for k in cfg.ks}, "mtp": []}
    rng = np.random.default_rng(cfg.seed)
    with Model(trunk) as tm:
        sm = Model(sidecar, load_mtp=True) if sidecar else None
        try:
            tcfg = ContextConfig(n_ctx=cfg.n_ctx, n_threads=cfg.threads, n_rs_seq=k_max + 1)
            with Context(tm, tcfg) as tc:
                mc = Context(sm, ContextConfig(n_ctx=cfg.n_ctx, n_threads=cfg.threads,
                                               mtp=True, nextn_rows="masked")) if sm else None
                try:
                    prompt = seeded_prompt(cfg.seed, cfg.n_prompt, tm.n_vocab)
                    tc.decode(prompt, range(cfg.n_prompt),
                              logits=[False] * (cfg.n_prompt - 1) + [True])
                    tok = int(np.argmax(tc.logits(-1)))
                    # the draft's input row: a fixed random hc*n_embd row (its values do
                    # not change what the block computes per token, only which experts)
                    row = rng.standard_normal((1, tm.n_embd_out)).astype(np.float32)
                    tt = _SyncTimer(tc.llama)
                    tc.llama = tt
                    mt = _SyncTimer(mc.llama) if mc else None
                    if mc:
                        mc.llama = mt
                    try:
                        for i in range(cfg.warmup + cfg.steps):
                            p = cfg.n_prompt + i
                            keep = i >= cfg.warmup
                            for k in cfg.ks:
                                drafts = [int(t) for t in rng.integers(0, tm.n_vocab, k)]
                                tc.decode([tok, *drafts], range(p, p + k + 1), logits=True)
                                if keep:
                                    raw["verify"][str(k)].append(tt.last)
                                if not tc.seq_rm(0, p):
                                    raise InputError(f"upstream refused to roll back the "
                                                     f"{k + 1}-token verify batch at {p}")
                            tc.decode([tok], [p], logits=True)
                            if keep:
                                raw["plain"].append(tt.last)
                            nxt = int(np.argmax(tc.logits(-1)))
                            if mc:
                                mc.decode([tok], [p], logits=True, rows=row)
                                if keep:
                                    raw["mtp"].append(mt.last)
                            tok = nxt
                            if progress and keep:
                                progress(f"step {i - cfg.warmup + 1}/{cfg.steps}")
                    finally:
                        tc.llama = tt._llama
                        if mc:
                            mc.llama = mt._llama
                finally:
                    if mc:
                        mc.close()
        finally:
            if sm:
                sm.close()
    if not sidecar:
        del raw["mtp"]
    return raw


def _boot(rng: np.random.Generator, xs: Sequence[float], n: int) -> np.ndarray:
    a = np.asarray(xs, dtype=float)
    return np.median(a[rng.integers(0, a.size, (n, a.size))], axis=1)


def derive(slice_raw: dict, l4_raw: dict, cfg: LayerCostConfig) -> dict:
    """The projection's inputs from the two files' raw timings (seconds), with bootstrap
    10-90 % intervals: each series is resampled on its own (they ran at other moments)."""
    rng = np.random.default_rng(cfg.seed)
    B = cfg.bootstrap
    med = {}  # name -> (point, bootstrap samples), seconds
    for name, a, b in [("1", slice_raw["plain"], l4_raw["plain"])] + [
            (str(k + 1), slice_raw["verify"][str(k)], l4_raw["verify"][str(k)])
            for k in cfg.ks]:
        layer = (np.median(a) - np.median(b)) / DIFF_LAYERS
        layer_b = (_boot(rng, a, B) - _boot(rng, b, B)) / DIFF_LAYERS
        l4_b = _boot(rng, b, B)
        med[name] = {"layer": (layer, layer_b),
                     "v4": (np.median(b) + EXTRA_LAYERS * layer, l4_b + EXTRA_LAYERS * layer_b)}
    v1, v1_b = med["1"]["v4"]

    def iv(x: np.ndarray, scale: float = 1e3) -> list[float]:
        return [float(np.percentile(x, 10)) * scale, float(np.percentile(x, 90)) * scale]

    ks = np.asarray(cfg.ks, dtype=float)
    ys = np.asarray([med[str(k + 1)]["v4"][0] / v1 - 1 for k in cfg.ks])
    ys_b = np.stack([med[str(k + 1)]["v4"][1] / v1_b - 1 for k in cfg.ks])
    beta = float((ks @ ys) / (ks @ ks))
    beta_b = (ks @ ys_b) / (ks @ ks)
    out = {
        "layer_ms": float(med["1"]["layer"][0]) * 1e3,
        "layer_ms_p10_p90": iv(med["1"]["layer"][1]),
        "v4_flash_decode_ms": float(v1) * 1e3,
        "v4_flash_decode_ms_p10_p90": iv(v1_b),
        "layer_s": float(v1) / V4_FLASH_LAYERS,
        "layer_s_note": "V4-Flash plain decode / 43 (head and embedding folded in, as the "
                        "assumption it replaces)",
        "verify_token_cost": beta,
        "verify_token_cost_p10_p90": iv(beta_b, 1.0),
        "verify_by_k": {str(k): {"v4_flash_ms": float(med[str(k + 1)]["v4"][0]) * 1e3,
                                 "per_extra_token": float(y / k),
                                 "layer_ms": float(med[str(k + 1)]["layer"][0]) * 1e3}
                        for k, y in zip(cfg.ks, ys, strict=True)},
    }
    if "mtp" in slice_raw:
        m = np.median(slice_raw["mtp"])
        m_b = _boot(rng, slice_raw["mtp"], B)
        out.update({"draft_ms": float(m) * 1e3, "draft_ms_p10_p90": iv(m_b),
                    "draft_cost": float(m / v1), "draft_cost_p10_p90": iv(m_b / v1_b, 1.0)})
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


def measure(fixture_dir: str | Path, cfg: LayerCostConfig | None = None, *, seed: int = 0,
            command: str = "", progress: Callable[[str], None] | None = None
            ) -> LayerCostResult:
    """Generate (or reuse) the slice and its partner in ``fixture_dir``, time both, derive."""
    from mtplib.model.fixture import write_fixture
    from mtplib.runtime.devices import backend_info

    cfg = (cfg or LayerCostConfig()).validate()
    la0 = loadavg()
    secs: dict = {}
    t0 = time.perf_counter()
    sl = write_fixture(fixture_dir, seed=seed, preset=SLICE)
    l4 = write_fixture(fixture_dir, seed=seed, preset=PARTNER, sidecar=False)
    secs["generate"] = round(time.perf_counter() - t0, 1)
    files = {"slice": sl.summary(), "partner": l4.summary()}
    t0 = time.perf_counter()
    raw_slice = time_model(sl.trunk, sl.sidecar, cfg,
                           progress=(lambda s: progress(f"{SLICE}: {s}")) if progress else None)
    secs["time_slice"] = round(time.perf_counter() - t0, 1)
    t0 = time.perf_counter()
    raw_l4 = time_model(l4.trunk, None, cfg,
                        progress=(lambda s: progress(f"{PARTNER}: {s}")) if progress else None)
    secs["time_partner"] = round(time.perf_counter() - t0, 1)
    summaries = {
        "slice": {"plain": summary(raw_slice["plain"]), "mtp": summary(raw_slice["mtp"]),
                  **{f"verify_k{k}": summary(raw_slice["verify"][str(k)]) for k in cfg.ks}},
        "partner": {"plain": summary(raw_l4["plain"]),
                    **{f"verify_k{k}": summary(raw_l4["verify"][str(k)]) for k in cfg.ks}},
    }
    return LayerCostResult(
        config=asdict(cfg), files=files, hardware=hardware(), backend=backend_info(),
        raw={"slice": raw_slice, "partner": raw_l4}, summaries=summaries,
        derived=derive(raw_slice, raw_l4, cfg), limitations=list(LIMITATIONS),
        command=command, loadavg_before=la0, loadavg_after=loadavg(), seconds=secs)

