"""Ranged MTP over an emulated WAN: tokens/s against round-trip time, and why.

Every shard of a plan runs behind a counting relay that delays each chunk by half the RTT
each way (`mtplib.distributed.relay.WanLink`). Two topologies: ``remote`` (every shard
behind the WAN) and ``tail_local`` (the tail shard co-located with the client: its relay has
no delay). Two drafter placements: the MTP block on the tail shard or in the client. For
each (plan, topology, placement) one set of shards and one loaded model serve every RTT and
draft length; MTP off is measured on the same connections.

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

import numpy as np

from mtplib.errors import InputError
from mtplib.files import write_json
from mtplib.lab.sweep import median_or_none

TOPOLOGIES = ("remote", "tail_local")
#: the step kinds of the decoding phase (after the prompt), whose waits a token pays
DECODE_PHASES = ("decode", "verify", "draft", "feed", "rollback")
PLACEMENTS = ("tail", "client")
LOG = Callable[[str], None]


@dataclass
class WanConfig:
    """What `run_wan` measures (a lane's ``wan:`` section; every key optional)."""

    rtts_ms: list[float] = field(default_factory=lambda: [0, 10, 25, 50, 100, 200])
    ks: list[int] = field(default_factory=lambda: [0, 1, 2, 3])  # 0 = MTP off
    plans: list[str] = field(default_factory=lambda: ["0-1,2-3", "0-0,1-2,3-3"])
    topologies: list[str] = field(default_factory=lambda: list(TOPOLOGIES))
    placements: list[str] = field(default_factory=lambda: list(PLACEMENTS))
    head: str = "client"  # where the output head runs (EngineOptions.head)
    n_prompts: int = 4  # held-out prompts of the trained pair (prompts_from, seed 0)
    prompt_len: int = 48
    n_new: int = 24
    reps: int = 1
    #: untimed generations per draft length before the sweep: the first generation on a
    #: connection pays one-time buffer allocations on the shards (answered commands)
    warmup: int = 1
    n_ctx: int = 256
    threads: int = 1  # client threads (the shards get shard_threads)
    shard_threads: int = 1
    fit_rtts_ms: list[float] = field(default_factory=lambda: [0, 10, 25, 50])
    #: a cost-model prediction is good when within this fraction of the measurement
    cost_model_tolerance: float = 0.15
    upstream: str = "stock"  # which build ran (recorded; chosen by MTPLIB_UPSTREAM)

    def __post_init__(self) -> None:
        bad = [t for t in self.topologies if t not in TOPOLOGIES]
        bad += [p for p in self.placements if p not in PLACEMENTS]
        if bad:
            raise InputError(f"wan: unknown topology/placement {bad}; topologies "
                             f"{TOPOLOGIES}, placements {PLACEMENTS}")
        if any(k < 0 or k > 8 for k in self.ks):
            raise InputError(f"wan: ks must be in 0..8, got {self.ks}")
        if any(not 0 <= r <= 10_000 for r in self.rtts_ms):
            raise InputError(f"wan: rtts_ms must be in 0..10000, got {self.rtts_ms}")
        if self.warmup < 0:
            raise InputError(f"wan: warmup must be >= 0, got {self.warmup}")
        for name in ("n_prompts", "prompt_len", "n_new", "reps", "n_ctx", "threads",
                     "shard_threads"):
            if int(getattr(self, name)) < 1:
                raise InputError(f"wan: {name} must be >= 1, got {getattr(self, name)}")
        if self.prompt_len + self.n_new + 8 > self.n_ctx:
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


def trained_prompts(n: int, length: int) -> list[list[int]]:
    """``n`` held-out prompts of the committed trained pair (the stdlib modules it never
    saw in training), as `mtplib.lab.trained_eval` measures acceptance on."""
    from mtplib.lab.trained_eval import heldout_modules, heldout_tokens, prompts_from
    from mtplib.model.trained import trained_paths

    pair = trained_paths()
    docs = heldout_tokens(pair.trunk, heldout_modules())
    return prompts_from(docs, n=n, length=length, seed=0)


def _row(m: dict, tokens: list[int], **kw) -> dict:
    steps = (m.get("verify_steps") or 0) + (m.get("plain_steps") or 0)
    return {**kw,
            "decode_tok_s": m["decode_tok_s"], "ttft_s": m["ttft_s"],
            "n_generated": m["n_generated"], "drafted": m.get("drafted", 0),
            "accepted": m.get("accepted", 0), "steps": steps,
            "tokens_per_step": (m["n_generated"] - 1) / steps if steps else None,
            "hidden_rows": m.get("hidden_rows"),
            "waits_per_step": m["waits_per_step"], "steps_by_label": m["steps_by_label"],
            "wire_bytes_by_class": m["wire_bytes_by_class"],
            "seam_bytes_per_token": m["seam_bytes_per_token"],
            "cache_bytes_crossing": m["cache_bytes_crossing"],
            "wire_violations": m["wire_violations"],
            "waits_decode_phase": _decode_waits(m),
            "tokens": tokens}


def _decode_waits(m: dict) -> float | None:
    """Waits of the decoding phase (every step kind but prefill), per generated token."""
    tot = 0.0
    for label, w in m["waits_per_step"].items():
        if label in DECODE_PHASES and w:
            tot += w * m["steps_by_label"].get(label, 0)
    n = m["n_generated"] - 1
    return tot / n if n > 0 else None


def run_wan(trunk: str, sidecar: str, cfg: WanConfig, prompts: Sequence[Sequence[int]], *,
            log: LOG | None = None, progress: Callable[[int, int], None] | None = None
            ) -> dict:
    """Measure every configuration of ``cfg``; returns {"config", "rows", "wall_s"}."""
    from mtplib.distributed.ranged_mtp import RangedMTP
    from mtplib.runtime.settings import DecodeSettings
    from mtplib.runtime.speculative import EngineOptions

    log = log or (lambda s: None)
    t0 = time.time()
    settings = DecodeSettings(n_ctx=cfg.n_ctx, n_threads=cfg.threads)
    rows: list[dict] = []
    groups = [(plan, topo, place) for plan in cfg.plans for topo in cfg.topologies
              for place in cfg.placements]
    n_off = sum(1 for k in cfg.ks if k == 0)  # MTP off: measured in one placement only
    per_rtt = (len(cfg.ks) - n_off) * len(groups) + n_off * len(groups) // len(cfg.placements)
    total = per_rtt * len(cfg.rtts_ms) * len(prompts) * cfg.reps
    done = 0
    for plan, topo, place in groups:
        log(f"plan {plan}, {topo}, MTP on the {place}")
        with RangedMTP(trunk, plan=plan, sidecar=sidecar, shard_threads=cfg.shard_threads,
                       mtp_placement=place) as r:
            relays = r.rt.relays.relays
            for k in cfg.ks:  # warm-up over loopback, not recorded
                opts = EngineOptions(k=k, settings=settings, head=cfg.head)
                for _ in range(cfg.warmup):
                    r.generate(list(prompts[0]), cfg.n_new, opts)
            for rtt in cfg.rtts_ms:
                for relay, link in zip(relays, links_for(topo, len(relays), rtt), strict=True):
                    relay.set_link(link)
                for k in cfg.ks:
                    if k == 0 and place != cfg.placements[0]:
                        continue  # MTP off does not depend on the drafter's placement
                    opts = EngineOptions(k=k, settings=settings, head=cfg.head)
                    for pi, prompt in enumerate(prompts):
                        for rep in range(cfg.reps):
                            toks, m = r.generate(list(prompt), cfg.n_new, opts)
                            rows.append(_row(m, toks, plan=plan, topology=topo,
                                             placement=place if k else "-", rtt_ms=rtt, k=k,
                                             prompt=pi, rep=rep))
                            done += 1
                            if progress:
                                progress(done, total)
                    med = median_or_none(x["decode_tok_s"]
                                         for x in rows[-len(prompts) * cfg.reps:])
                    log(f"  rtt {rtt:g} ms k={k}: "
                        + ("n/a" if med is None else f"{med:.2f}") + " tok/s")
    return {"config": asdict(cfg), "rows": rows, "wall_s": time.time() - t0}


# ---------------------------------------------------------------------------------------
# summaries
# ---------------------------------------------------------------------------------------
def _key(r: dict) -> tuple:
    return (r["plan"], r["topology"], r["placement"], r["k"])


def summarize(rows: list[dict]) -> list[dict]:
    """Per (plan, topology, placement, k, RTT): median tok/s, the speed-up over MTP off of
    the same plan/topology/RTT, tokens per verify step, waits per token, identical tokens."""
    off = {}
    for r in rows:
        if r["k"] == 0:
            off.setdefault((r["plan"], r["topology"], r["rtt_ms"]), []).append(r)
    out = []
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((*_key(r), r["rtt_ms"]), []).append(r)
    for (plan, topo, place, k, rtt), rs in sorted(groups.items(), key=lambda kv: (
            kv[0][0], kv[0][1], str(kv[0][2]), kv[0][3], kv[0][4])):
        ref = off.get((plan, topo, rtt), [])
        tok_s = median_or_none(x["decode_tok_s"] for x in rs)
        off_tok_s = median_or_none(x["decode_tok_s"] for x in ref)
        tps = median_or_none(x["tokens_per_step"] for x in rs)
        same = [x["tokens"] == y["tokens"] for x in rs for y in ref
                if (x["prompt"], x["rep"]) == (y["prompt"], y["rep"])]
        out.append({
            "plan": plan, "topology": topo, "placement": place, "k": k, "rtt_ms": rtt,
            "runs": len(rs), "tok_s": tok_s, "off_tok_s": off_tok_s,
            "speedup": tok_s / off_tok_s if tok_s and off_tok_s else None,
            "tokens_per_step": tps,
            "speedup_over_ideal": (tok_s / off_tok_s / tps) if tok_s and off_tok_s and tps
            else None,
            "acceptance": (sum(x["accepted"] for x in rs) / sum(x["drafted"] for x in rs)
                           if sum(x["drafted"] for x in rs) else None),
            "waits_per_token": median_or_none(x["waits_decode_phase"] for x in rs),
            "waits_per_verify": median_or_none(x["waits_per_step"].get("verify") for x in rs),
            "waits_per_plain": median_or_none(x["waits_per_step"].get("decode") for x in rs),
            "waits_per_draft": median_or_none(x["waits_per_step"].get("draft") for x in rs),
            "cache_bytes_crossing": sum(x["cache_bytes_crossing"] for x in rs),
            "identical_to_off": all(same) if same else None,
        })
    return out


def bytes_by_class(rows: list[dict]) -> list[dict]:
    """Per configuration and step kind: data bytes per generated token (after the first,
    which the prefill emits) by class (first RTT, all prompts; bytes do not depend on the
    RTT)."""
    out = []
    seen = set()
    for r in rows:
        key = _key(r)
        if key in seen:
            continue
        seen.add(key)
        same = [x for x in rows if _key(x) == key and x["rtt_ms"] == r["rtt_ms"]]
        for label in sorted({lb for x in same for lb in x["wire_bytes_by_class"]}):
            agg: dict[str, float] = {}
            for x in same:
                for c, b in x["wire_bytes_by_class"].get(label, {}).items():
                    agg[c] = agg.get(c, 0) + b
            n_tok = sum(max(x["n_generated"] - 1, 0) for x in same)
            out.append({"plan": key[0], "topology": key[1], "placement": key[2], "k": key[3],
                        "step": label, **{c: v / max(n_tok, 1) for c, v in agg.items()}})
    return out


def fit_cost_model(summary: list[dict], fit_rtts: Sequence[float]) -> list[dict]:
    """Per configuration: fit ``s_per_token = compute + RTT x w`` (least squares) on the
    ``fit_rtts`` points, predict the other RTTs, report the relative error of each
    prediction and the fitted w next to the measured waits per token."""
    by: dict[tuple, list[dict]] = {}
    for s in summary:
        if s["tok_s"]:
            by.setdefault((s["plan"], s["topology"], s["placement"], s["k"]), []).append(s)
    out = []
    fit_set = {float(x) for x in fit_rtts}
    for key, ss in sorted(by.items(), key=lambda kv: (kv[0][0], kv[0][1], str(kv[0][2]),
                                                       kv[0][3])):
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
            out.append({"plan": key[0], "topology": key[1], "placement": key[2], "k": key[3],
                        "rtt_ms": s["rtt_ms"], "compute_s_per_token": float(c),
                        "fitted_waits_per_token": float(w),
                        "measured_waits_per_token": s["waits_per_token"],
                        "predicted_s_per_token": float(pred), "measured_s_per_token": meas,
                        "rel_error": float(abs(pred - meas) / meas)})
    return out


def targets(summary: list[dict], *, rtt_ms: float = 100, k: int = 2,
            plan: str = "0-1,2-3") -> list[dict]:
    """The issue's targets at one RTT: speed-up against tokens per verify step (>= 0.85 with
    the tail co-located, >= 0.70 with every shard remote and the drafter in the client),
    waits per verify step against a plain step's (<= +1, +0 with the head in the client),
    and cache bytes crossing (0)."""
    want = {("tail_local", "tail"): 0.85, ("tail_local", "client"): 0.85,
            ("remote", "client"): 0.70, ("remote", "tail"): None}
    plain = {(s["plan"], s["topology"], s["rtt_ms"]): s["waits_per_plain"]
             for s in summary if s["k"] == 0}
    out = []
    for s in summary:
        if (s["rtt_ms"], s["k"], s["plan"]) != (rtt_ms, k, plan):
            continue
        goal = want.get((s["topology"], s["placement"]))
        ratio = s["speedup_over_ideal"]
        base = plain.get((s["plan"], s["topology"], s["rtt_ms"]))  # the MTP-off run's step
        extra = (s["waits_per_verify"] - base
                 if s["waits_per_verify"] is not None and base is not None else None)
        out.append({"plan": plan, "topology": s["topology"], "placement": s["placement"],
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


def save(result: dict, out_dir) -> dict:
    """Write ``wan.json`` (config, raw rows, summary, bytes by class, cost-model check,
    targets) and ``wan_summary.csv`` into ``out_dir``; returns their paths."""
    import csv
    from pathlib import Path

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
    c = out / "wan_summary.csv"
    with c.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(summary[0]) if summary else ["empty"],
                           lineterminator="\n")
        w.writeheader()
        w.writerows(summary)
    return {"json": p, "csv": c}


def resummarize(out_dir) -> dict:
    """Rewrite a results folder's derived sections (summary, bytes, cost model, targets)
    from its raw rows with this code; the measurement (rows, config, upstream) is kept."""
    d = load(out_dir)
    keep = {k: d[k] for k in ("config", "rows", "wall_s", "upstream") if k in d}
    save(keep, out_dir)
    return load(out_dir)


def load(out_dir) -> dict:
    import json
    from pathlib import Path

    p = Path(out_dir) / WAN_JSON
    if not p.is_file():
        raise InputError(f"{p} not found: run the WAN benchmark first (notebook 05_wan)")
    return json.loads(p.read_text())


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
    missing) is skipped with a note. ``progress``: a `tqdm.auto` bar per build over its
    generations, fed by the child's progress lines."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

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
    prompts = trained_prompts(cfg.n_prompts, cfg.prompt_len)
    def tick(done: int, total: int) -> None:
        print(f"{PROGRESS_PREFIX}{done}/{total}", flush=True)

    res = run_wan(str(pair.trunk), str(pair.sidecar), cfg, prompts, log=print,
                  progress=tick if a.progress else None)
    from mtplib.runtime.lib import upstream_info

    res["upstream"] = upstream_info()
    print(save(res, a.out)["json"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
