"""Windows in flight over a shard-to-shard ring (issue 31 item 5): a projection for a design
that is NOT built. Reads the committed inputs, writes
evidence/upstream-patches/windows_projection.json.

    python -m mtplib.reports.upstream_patches.windows_projection [--out DIR]

The design (windows-in-flight.md): with the ring of shard-to-shard.md the client sends window
t+1, drafted as if window t were accepted in full, before window t's verdict returns, so W
windows of s = k+1 tokens travel the ring at once. The drafts form one chain from the last
verified token (the anchor): window 1 = [anchor, d1..dk], window j >= 2 = the next k+1
drafts. Each target row checks the next draft; the first mismatch ends the chain (its row is
the correction token) and every window sent after the rejecting one is wasted.

With A_d the unconditional probability that the first d drafts are all accepted (A_0 = 1) and
N the accepted run: tokens per chain E[N+1] = 1 + sum_d A_d; the chain ends with the verdict
of window J = ceil((N+1)/s), so E[J] = sum_{j>=0} A_{j*s}; windows leave every
period = max(traversal / W, slowest stage) and the chain lasts (J-1) x period + traversal.
W = 1 is ordinary speculation: each window is its own chain and the target's last row a free
token, 1 + sum_{d<=k} A_d tokens per traversal.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from mtplib import paths
from mtplib.contract.seam import seam_bytes_per_token
from mtplib.contract.types import MAX_DRAFT, DType, ModelDims
from mtplib.errors import InputError
from mtplib.lab.projection.graph_inputs import graph_inputs, shard_roles
from mtplib.lab.projection.params import ProjectionParams
from mtplib.model.presets import get_preset
from mtplib.ownership.plan import parse_plan
from mtplib.reports import common

MODULE = "mtplib.reports.upstream_patches.windows_projection"
#: named, not __name__ (which is __main__ under python -m)
log = logging.getLogger(MODULE)
REPO = paths.REPO
SCHEMA = "mtplib.windows_projection/1"
#: the file it writes, in --out
OUT_NAME = "windows_projection.json"
ACCEPTANCE_FILE = "evidence/trained-v4/metrics.json"
ACCEPTANCE_KEY = ("acceptance_captured_rows", "by_k", "3")
LAYER_COST_FILE = "evidence/layer-cost/layer-cost-cpu.json"

# -- the Shard project's published numbers (github.com/leyten/shard; the note cites each) ----
#: layers per RTX 5090, plan order (README: "8 layers per card"; 43 layers: 8/8/8/8/8/3)
SHARD_STAGES = (8, 8, 8, 8, 8, 3)
#: slowest stage per s=1 frame, an 8-layer stage (docs/V4_TREE_VERDICT.md, the 07-31 ring)
SHARD_TAU_MAX_S = 9.5e-3
#: ring latency there (docs/V4_TREE_VERDICT.md: "L ~ 156 ms") and its measured tok/s that night
SHARD_L_S = 0.156
SHARD_MEASURED_THAT_NIGHT = 29.2
#: DSpark's per-depth conditional acceptance there (block 5) and their tokens per cycle
SHARD_DSPARK_CONDITIONAL = (0.93, 0.85, 0.83, 0.95, 0.84)
SHARD_DSPARK_TOKENS_PER_CYCLE = 4.52
#: README headline (median of three warm runs) and the ring the issue quotes
SHARD_README_TOK_S = 30.15
SHARD_RING_MS = 152

RTTS_MS = (25, 50, 100, 152, 200)
KS = tuple(range(0, MAX_DRAFT + 1))
WS = tuple(range(1, 65))
BANDWIDTH_BPS = 1e9  # every link, as mtplib.lab.projection's default: an ASSUMPTION
CONTEXT = 32768      # mtplib.lab.projection's default context
CONTEXTS = (4096, 32768)
KNEE = 0.95  # the smallest W within this share of the best tok/s (less waste, less queueing)
W_SHOWN = (1, 2, 4, 8, 16, 32, 64)  # the W whose best k the JSON lists
BETAS = (0.1, 0.3)  # verify cost per extra token tried beside the measured one: ASSUMPTIONS
MAX_DEPTH = 4096     # where an extrapolated chain is cut (A_d is far below 1e-12 there)


# -- the chain ---------------------------------------------------------------------------
def depth_profile(per_position: Sequence[float], *, tail: float | None = None,
                  max_depth: int = MAX_DEPTH) -> tuple[float, ...]:
    """A_1..A_D: the measured unconditional per-position acceptance, then (``tail`` not 0)
    extrapolated at a constant conditional rate: ``tail`` or, None, the last measured one."""
    a = [float(x) for x in per_position]
    if not a or any(not 0 <= x <= 1 for x in a) or any(a[i + 1] > a[i] for i in range(len(a) - 1)):
        raise InputError(f"per-position acceptance must be non-increasing values in [0, 1], "
                         f"got {list(per_position)}")
    if tail is None:
        tail = a[-1] / (a[-2] if len(a) > 1 else 1.0) if a[-1] else 0.0
    if not 0 <= tail < 1:
        raise InputError(f"the tail's conditional rate must be in [0, 1), got {tail!r}")
    while tail and len(a) < max_depth and a[-1] * tail > 1e-15:
        a.append(a[-1] * tail)
    return tuple(a)


def cumulative(conditional: Sequence[float]) -> tuple[float, ...]:
    """Unconditional A_d from per-depth conditional rates (as Shard publishes them)."""
    out, p = [], 1.0
    for c in conditional:
        p *= c
        out.append(p)
    return tuple(out)


@dataclass(frozen=True)
class Chain:
    """Expected tokens committed per chain and windows until the verdict that ends it."""

    tokens: float
    windows: float


def chain(A: Sequence[float], k: int, in_flight: bool) -> Chain:
    """One chain's expectations for windows of k+1 tokens (A beyond its end: 0)."""
    if isinstance(k, bool) or not isinstance(k, int) or k < 0:
        raise InputError(f"k must be an int >= 0, got {k!r}")
    if not in_flight:  # W = 1: ordinary speculation
        return Chain(1.0 + sum(A[:k]), 1.0)
    s = k + 1
    return Chain(1.0 + sum(A), 1.0 + sum(A[j * s - 1] for j in range(1, len(A) // s + 1)))


def pipeline(A: Sequence[float], k: int, W: int, traversal_s: float,
             stage_s: float = 0.0) -> dict:
    """Tokens/s with W windows in flight: a window leaves every max(traversal / W, stage_s);
    a chain ends with the verdict of its J-th window, the W_eff - 1 windows behind it wasted."""
    if isinstance(W, bool) or not isinstance(W, int) or W < 1:
        raise InputError(f"W must be an int >= 1, got {W!r}")
    if not traversal_s > 0 or stage_s < 0:
        raise InputError("traversal_s must be > 0 and stage_s >= 0")
    c = chain(A, k, in_flight=W > 1)
    period = traversal_s if W == 1 else max(traversal_s / W, stage_s)
    seconds = (c.windows - 1) * period + traversal_s
    w_eff = traversal_s / period
    sent = c.windows - 1 + w_eff
    return {"k": k, "W": W, "w_eff": w_eff, "period_s": period, "traversal_s": traversal_s,
            "tokens_per_chain": c.tokens, "windows_per_chain": c.windows,
            "windows_sent_per_chain": sent, "wasted_windows_per_chain": w_eff - 1,
            "wasted_fraction": (w_eff - 1) / sent, "chain_s": seconds,
            "tok_s": c.tokens / seconds, "tokens_per_traversal": c.tokens / seconds * traversal_s,
            "windows_sent_per_token": sent / c.tokens}


# -- the ring's time per window -------------------------------------------------------------
@dataclass(frozen=True)
class Ring:
    """One window's costs on a ring client -> shard 0 -> ... -> tail -> client. Compute of
    a window of k+1 tokens is (1 + verify_token_cost x k) times one token's; the head runs
    in the client, and so does the drafter (the client drafts the windows)."""

    stages: tuple[int, ...]
    layer_s: float
    head_s: float
    verify_token_cost: float
    draft_s: float
    bandwidth_bps: float
    seam_bytes: Mapping[int, int]  # k -> bytes per shard-to-shard hop per window
    return_bytes: Mapping[int, int]  # k -> tail -> client (hidden rows)
    client_bytes: Callable[[int, int], int]  # (k, in-flight positions) -> client -> shards

    def costs(self, rtt_s: float, k: int, W: int) -> tuple[float, float, dict]:
        """(traversal seconds, slowest stage seconds, the parts) of one window."""
        f = 1.0 + self.verify_token_cost * k
        bps = self.bandwidth_bps / 8
        comp = [n * self.layer_s * f for n in self.stages]
        head = self.head_s * f
        sent = self.client_bytes(k, W * (k + 1) if W > 1 else k)
        wire = (sent + (len(self.stages) - 1) * self.seam_bytes[k] + self.return_bytes[k]) / bps
        parts = {"rtt_s": rtt_s, "shard_compute_s": sum(comp), "head_s": head,
                 "first_drafts_s": k * self.draft_s, "serialization_s": wire,
                 "client_bytes": sent}
        traversal = rtt_s + sum(comp) + head + k * self.draft_s + wire
        stage = max(max(comp), head + (k + 1) * self.draft_s, sent / bps,
                    self.seam_bytes[k] / bps, self.return_bytes[k] / bps)
        return traversal, stage, parts


def best(rows: Sequence[dict], **where) -> dict:
    sel = [r for r in rows if all(r[key] == v for key, v in where.items())]
    return max(sel, key=lambda r: r["tok_s"])


def sweep(A: Sequence[float], ring: Ring, rtts_ms: Sequence[float] = RTTS_MS,
          ks: Sequence[int] = KS, ws: Sequence[int] = WS) -> list[dict]:
    rows = []
    for rtt in rtts_ms:
        for k in ks:
            for W in ws:
                traversal, stage, parts = ring.costs(rtt / 1000, k, W)
                r = pipeline(A, k, W, traversal, stage)
                # shard compute per committed token, in MTP-off decodes
                r["compute_per_token"] = r["windows_sent_per_token"] * (
                    1 + ring.verify_token_cost * k)
                rows.append({"rtt_ms": rtt, **r, **parts})
    return rows


# -- committed inputs -----------------------------------------------------------------------
def load_acceptance(repo: Path = REPO) -> dict:
    d = json.loads((repo / ACCEPTANCE_FILE).read_text())
    for key in ACCEPTANCE_KEY:
        d = d[key]
    rates = d["accepted_per_position"]
    n = d["drafted_counts"]
    return {"source": f"{ACCEPTANCE_FILE}: {'.'.join(ACCEPTANCE_KEY)}",
            "per_position": rates, "accepted_counts": d["accepted_counts"], "drafted_counts": n,
            "binomial_se": [math.sqrt(p * (1 - p) / m) for p, m in zip(rates, n, strict=True)],
            "conditional": [rates[0]] + [rates[i] / rates[i - 1] for i in range(1, len(rates))],
            "accept_len_hist": d["accept_len_hist"],
            "what": "trained tiny V4 pair (evidence/trained-v4), 32 held-out prompts x 128 "
                    "new tokens, k=3, greedy, captured rows"}


def load_layer_cost(repo: Path = REPO) -> dict:
    d = json.loads((repo / LAYER_COST_FILE).read_text())
    der = d["derived_cpu"]
    decode = der["v4_flash_decode_ms"] / 1000
    layer = der["layer_ms"] / 1000
    return {"source": f"{LAYER_COST_FILE}: derived_cpu", "hardware": d["hardware"]["label"],
            "layer_s": layer, "decode_s": decode,
            "head_layers": (decode - 43 * layer) / layer,
            "verify_token_cost": der["verify_token_cost"],
            "verify_token_cost_p10_p90": der["verify_token_cost_p10_p90"],
            "draft_cost": der["draft_cost"], "draft_cost_p10_p90": der["draft_cost_p10_p90"],
            "limitations": d["limitations"]}


def build_ring(lc: dict, layer_s: float, context: int = CONTEXT) -> Ring:
    """The ring over Shard's tiling with per-layer compute ``layer_s``, the head's share and
    the verify/draft costs of the layer-cost file, contract seam bytes (bf16 boundary rows)
    and the per-window graph inputs mtplib.lab.projection counts (masks, indices, the first
    shard's embedding rows) sent by the client to every shard."""
    cfg = get_preset("v4-flash")
    dims = ModelDims(n_embd=cfg.n_embd, n_vocab=cfg.n_vocab)
    seam = seam_bytes_per_token(dims, DType.BF16)
    seam_k = {k: seam["decode_token"] if k == 0 else seam[f"verify_k{k}"] for k in KS}
    back = {k: (k + 1) * seam["boundary_hidden"] for k in KS}
    plan = parse_plan(",".join(_ranges(SHARD_STAGES)), cfg.n_layer)
    roles = shard_roles(cfg, plan)
    params = ProjectionParams(context=context, n_ctx=max(context, ProjectionParams().n_ctx))
    memo: dict[tuple[int, int], int] = {}

    def client_bytes(k: int, n_rs: int) -> int:
        if (k, n_rs) not in memo:
            memo[(k, n_rs)] = sum(sum(graph_inputs(cfg, r, params, n_tok=k + 1, n_out=k + 1,
                                                   n_rs_seq=n_rs).values()) for r in roles)
        return memo[(k, n_rs)]

    decode = layer_s * (43 + lc["head_layers"])
    return Ring(stages=SHARD_STAGES, layer_s=layer_s, head_s=layer_s * lc["head_layers"],
                verify_token_cost=lc["verify_token_cost"], draft_s=lc["draft_cost"] * decode,
                bandwidth_bps=BANDWIDTH_BPS, seam_bytes=seam_k, return_bytes=back,
                client_bytes=client_bytes)


def _ranges(stages: Sequence[int]) -> list[str]:
    out, a = [], 0
    for n in stages:
        out.append(f"{a}-{a + n - 1}")
        a += n
    return out


def snapshot_bytes_per_plane(stages: Sequence[int] = SHARD_STAGES) -> list[int]:
    """Compressor-state bytes of one rollback plane per shard: kv + score, F32, per layer
    CSA 8 x 2*head_dim and indexer 8 x 2*indexer_dim (ratio 4), HCA 128 x head_dim
    (src/llama-kv-cache-dsv4.cpp, the llama_dsv4_comp_state constructors)."""
    cfg = get_preset("v4-flash")
    csa = 2 * 4 * 8 * 2 * cfg.head_dim + 2 * 4 * 8 * 2 * cfg.indexer_dim
    hca = 2 * 4 * 128 * cfg.head_dim
    out, a = [], 0
    for n in stages:
        rs = cfg.compress_ratios[a:a + n]
        out.append(sum(csa for r in rs if r == 4) + sum(hca for r in rs if r == 128))
        a += n
    return out


VARIANTS = {
    "measured depths only": {"tail": 0.0, "why": "A_d = 0 beyond the 3 measured depths"},
    "geometric tail": {"tail": None, "why": "beyond depth 3 each draft keeps depth 3's "
                                            "measured conditional rate: an ASSUMPTION"},
}


CHOICES = ("off", "w1", "in_flight", "in_flight_knee", "in_flight_k2")


def summary(rows: list[dict], rtts_ms: Sequence[float] = RTTS_MS, **labels) -> list[dict]:
    """Per RTT, one row per choice: MTP off, the best W=1 (ordinary speculation), the best
    (k, W), the smallest W within KNEE of it (same k), and the best W for k=2."""
    out = []
    for rtt in rtts_ms:
        off = best(rows, rtt_ms=rtt, k=0, W=1)
        one = best(rows, rtt_ms=rtt, W=1)
        fly = best(rows, rtt_ms=rtt)
        knee = min((r for r in rows if r["rtt_ms"] == rtt and r["k"] == fly["k"]
                    and r["tok_s"] >= KNEE * fly["tok_s"]), key=lambda r: r["W"])
        picks = (off, one, fly, knee, best(rows, rtt_ms=rtt, k=2))
        out += [{**labels, "rtt_ms": rtt, "choice": c, **_short(r),
                 "over_w1": r["tok_s"] / one["tok_s"], "over_off": r["tok_s"] / off["tok_s"]}
                for c, r in zip(CHOICES, picks, strict=True)]
    return out


def _short(r: dict) -> dict:
    keys = ("k", "W", "w_eff", "tok_s", "tokens_per_chain", "tokens_per_traversal",
            "traversal_s", "period_s", "wasted_windows_per_chain", "wasted_fraction",
            "compute_per_token", "client_bytes")
    return {key: r[key] for key in keys}


def shard_check() -> dict:
    """Our chain formula on Shard's own published inputs (DSpark, block 5, s=1 frames)."""
    A = cumulative(SHARD_DSPARK_CONDITIONAL)
    lo = pipeline(A, 0, 16, SHARD_L_S, SHARD_TAU_MAX_S)
    return {"A": A, "tokens_per_chain": lo["tokens_per_chain"],
            "their_tokens_per_cycle": SHARD_DSPARK_TOKENS_PER_CYCLE,
            "tok_s_ours": lo["tok_s"], "tok_s_one_latency_per_chain": lo["tokens_per_chain"]
            / SHARD_L_S, "measured_that_night": SHARD_MEASURED_THAT_NIGHT}


def project() -> dict:
    """Everything windows_projection.json holds, from the committed inputs."""
    acc = load_acceptance()
    lc = load_layer_cost()
    bases = {"shard-gpu": {"layer_s": SHARD_TAU_MAX_S / SHARD_STAGES[0],
                           "why": "Shard's slowest 8-layer stage per s=1 frame (9.5 ms) / 8 "
                                  "layers, their engine on an RTX 5090; head, verify and "
                                  "draft costs relative to it from the layer-cost file"},
             "measured-cpu": {"layer_s": lc["layer_s"],
                              "why": "the layer-cost file's CPU time per layer (one 2-core "
                                     "EPYC thread): not a GPU figure"}}
    results, per_w = [], []
    for basis, b in bases.items():
        for ctx in CONTEXTS:
            ring = build_ring(lc, b["layer_s"], ctx)
            for name, v in VARIANTS.items():
                rows = sweep(depth_profile(acc["per_position"], tail=v["tail"]), ring)
                labels = {"basis": basis, "context": ctx, "variant": name}
                results += summary(rows, **labels)
                per_w += [{**labels, "rtt_ms": rtt, **_short(best(rows, rtt_ms=rtt, W=W))}
                          for rtt in RTTS_MS for W in W_SHOWN]
    sens = []
    for beta in (*BETAS, lc["verify_token_cost"]):
        ring = replace(build_ring(lc, bases["shard-gpu"]["layer_s"]), verify_token_cost=beta)
        for name, v in VARIANTS.items():
            rows = sweep(depth_profile(acc["per_position"], tail=v["tail"]), ring, rtts_ms=(100,))
            sens += [{"verify_token_cost": beta, "variant": name, "rtt_ms": 100,
                      "context": CONTEXT, "basis": "shard-gpu", "choice": c, **_short(r)}
                     for c, r in (("w1", best(rows, W=1)), ("in_flight", best(rows)))]
    planes = snapshot_bytes_per_plane()
    out = {
        "schema": SCHEMA, "status": "a projection for a design that is not built",
        "command": f"python -m {MODULE}",
        "formula": " ".join(__doc__.split("\n\n", 2)[2].split()),
        "inputs": {"acceptance": acc, "layer_cost": lc, "compute_bases": bases,
                   "variants": VARIANTS, "tiling": SHARD_STAGES, "bandwidth_bps": BANDWIDTH_BPS,
                   "contexts": CONTEXTS, "rtts_ms": RTTS_MS, "ks": KS, "ws": WS,
                   "rtt_means": "network latency of one traversal: the sum of the one-way "
                                "hops client -> shard 0 -> ... -> tail -> client",
                   "shard": {"readme_tok_s": SHARD_README_TOK_S, "ring_ms": SHARD_RING_MS,
                             "tau_max_s": SHARD_TAU_MAX_S, "L_s": SHARD_L_S}},
        "snapshot_bytes_per_plane_per_shard": planes,
        "shard_check": shard_check(),
        "verify_cost_sensitivity": sens,
        "rows": results,
        "best_k_per_W": per_w,
    }
    return json.loads(json.dumps(out, default=list))


#: the results the note's tables show: the GPU-scaled basis at the default context
TABLE_BASIS = "shard-gpu"


def render(d: dict) -> str:
    """The note's tables (markdown), from windows_projection.json's content."""
    head = ["RTT ms", "MTP off tok/s (traversal ms)", "W=1: tok/s (k)",
            "in flight: tok/s (k, W)", "tokens per traversal", "windows wasted (share sent)",
            "shard compute per token (decodes)", "95% of it: tok/s (W)",
            "k=2 in flight: tok/s (W)", "over W=1", "over off"]
    out = []
    for variant in VARIANTS:
        sel = [r for r in d["rows"] if r["basis"] == TABLE_BASIS and r["context"] == CONTEXT
               and r["variant"] == variant]
        out += [f"**{variant}** (context {CONTEXT}, compute basis {TABLE_BASIS}):", "",
                "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for rtt in RTTS_MS:
            o, w1, f, kn, k2 = (next(r for r in sel if r["rtt_ms"] == rtt and r["choice"] == c)
                                for c in CHOICES)
            out.append(
                f"| {rtt:g} | {o['tok_s']:.2f} ({o['traversal_s'] * 1000:.0f}) | "
                f"{w1['tok_s']:.2f} ({w1['k']}) | {f['tok_s']:.2f} ({f['k']}, {f['W']}) | "
                f"{f['tokens_per_traversal']:.2f} | {f['wasted_fraction']:.0%} | "
                f"{f['compute_per_token']:.1f} | {kn['tok_s']:.2f} ({kn['W']}) | "
                f"{k2['tok_s']:.2f} ({k2['W']}) | {f['over_w1']:.2f}x | {f['over_off']:.2f}x |")
        out.append("")
    return "\n".join(out[:-1])


def main(argv: list[str] | None = None) -> int:
    ap = common.parser(MODULE, __doc__)
    common.add_out(ap, "upstream-patches")
    a = ap.parse_args(argv)
    common.setup_logging()
    d = project()
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / OUT_NAME).write_text(json.dumps(d, indent=1) + "\n")
    print(render(d))
    log.info("wrote %s", a.out / OUT_NAME)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
