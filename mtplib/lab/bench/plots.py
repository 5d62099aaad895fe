"""The benchmark's plots (`mtplib.lab.bench`'s results): matplotlib Figures from a loaded
bench.json, no pyplot state. `figures` is what `bench_summary.save` writes under ``plots/``."""

from __future__ import annotations

import numpy as np

from mtplib.contract.labels import TIME_PARTS
from mtplib.lab.bench.runs import typed_runs
from mtplib.lab.common import display as D
from mtplib.lab.common.display import REFERENCE_S9


def figures(data: dict) -> dict:
    """The benchmark's plots as matplotlib Figures (no pyplot state)."""
    return {"speed_vs_k": plot_speed(data), "acceptance_per_position": plot_acceptance(data),
            "time_split": plot_time_split(data), "speedup_curve": plot_speedup_curve(data),
            "seam_bytes": plot_seam_bytes(data)}


def plan_title(plan: str) -> str:
    """A plan as a panel title: 'whole' or the layer ranges with their shard count."""
    if plan == "whole":
        return "plan: whole model (one process)"
    return f"plan: ranged {plan} ({plan.count(',') + 1} RPC shards)"


def model_title(data: dict) -> str:
    """The model a bench ran on (bench.json's ``model``; older files lack it)."""
    trunk = (data.get("model") or {}).get("trunk")
    return D.model_name(trunk) if trunk else "model not recorded"


def _plans(rows: list[dict]) -> list[str]:
    return sorted({r["plan"] for r in rows}, key=lambda p: (p != "whole", p))


def _k_tick(k: int) -> str:
    return "off" if k == 0 else f"k={k}"


def _per_plan(rows: list[dict], title: str, empty: str, **figure) -> tuple:
    """(figure, axes, plans): one panel per plan of ``rows``; with no plan, one panel that
    says ``empty`` under ``title`` (and plans empty)."""
    plans = _plans(rows)
    fig, axes = D.new_figure(max(len(plans), 1), **figure)
    if not plans:
        ax = axes[0]
        ax.text(0.5, 0.5, empty, ha="center", va="center", fontsize=9, transform=ax.transAxes)
        ax.set_axis_off()
        fig.suptitle(title, fontsize=10)
    return fig, axes, plans


def _summary_panels(data: dict, title: str) -> tuple:
    """(figure, axes, [(axis, plan, the plan's summary rows)]): one panel per plan."""
    fig, axes, plans = _per_plan(data["summary"], title, "no measured runs", w=3.6,
                                 sharey=False)
    return fig, axes, [(ax, p, [r for r in data["summary"] if r["plan"] == p])
                       for ax, p in zip(axes, plans, strict=False)]


def plot_speed(data: dict):
    """Decode tokens/s per k (off = MTP off), one panel per plan: median bar, min-max
    whisker, each measured run a dot."""
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    title = f"Decode speed, MTP off vs on: {model_title(data)}"
    fig, axes, panels = _summary_panels(data, title)
    if not panels:
        return fig
    for ax, plan, summ in panels:
        for r in summ:
            if r["decode_tok_s_median"] is None:
                continue
            ax.bar(r["k"], r["decode_tok_s_median"], color=D.data_colour(r["k"]), alpha=0.85)
            ax.vlines(r["k"], r["decode_tok_s_min"], r["decode_tok_s_max"], color=D.NEUTRAL)
        pts = [(r.k, r.decode_tok_s) for r in typed_runs(data["runs"])
               if not r.warmup and r.plan == plan and r.decode_tok_s is not None]
        if pts:
            ax.scatter(*zip(*pts, strict=True), s=8, color=D.NEUTRAL, zorder=3)
        ax.set_xticks([r["k"] for r in summ], [_k_tick(r["k"]) for r in summ])
        ax.set_xlabel("MTP draft length k (tokens)")
        ax.set_title(plan_title(plan), fontsize=9)
    axes[0].set_ylabel("decode speed (tokens/s)")
    fig.suptitle(title, fontsize=10)
    D.legend_outside(fig, axes, extra=[
        (Patch(facecolor="white", edgecolor=D.NEUTRAL), "median over runs (bar, colour: k)"),
        (Line2D([], [], color=D.NEUTRAL), "min-max over runs"),
        (Line2D([], [], color=D.NEUTRAL, marker="o", ms=3, ls="none"), "one measured run")])
    return fig


def _ref_band_and_vllm(ax) -> None:
    d, v = REFERENCE_S9["deepseek_v3"], REFERENCE_S9["vllm_v4"]["acceptance_per_position"]
    ax.plot(range(1, len(v) + 1), v, ls="--", marker="s", color=D.REFERENCE_COLOURS["vllm_v4"],
            label=D.ref_label("vllm_v4", f"k={len(v)}"))
    ax.fill_between([0.8, 1.2], d["second_token_acceptance_low"],
                    d["second_token_acceptance_high"], color=D.REFERENCE_COLOURS["deepseek_v3"],
                    alpha=0.3, label=D.ref_label("deepseek_v3", "2nd-token acceptance"))


def plot_acceptance(data: dict):
    """Acceptance per draft position, one panel per plan, one line per k (offset a little
    along x so equal lines stay visible), with the published references."""
    title = f"Acceptance per draft position: {model_title(data)}"
    fig, axes, plans = _per_plan([r for r in data["summary"] if r["k"] > 0], title,
                                 "no MTP runs", w=3.8)
    if not plans:
        return fig
    for ax, plan in zip(axes, plans, strict=True):
        rows = [r for r in data["summary"] if r["plan"] == plan and r["k"] > 0]
        ks = [r["k"] for r in rows]
        for j, r in enumerate(rows):
            dx = (j - (len(rows) - 1) / 2) * 0.06
            ys = [np.nan if y is None else y for y in r["accepted_per_position"]]
            ax.plot([i + 1 + dx for i in range(len(ys))], ys, marker="o",
                    color=D.data_colour(r["k"]), label=D.k_label(r["k"]))
        _ref_band_and_vllm(ax)
        ax.set_xlabel("draft position (1 = first drafted token)")
        ax.set_ylim(-0.02, 1.02)
        ax.set_xticks(range(1, max(ks + [2]) + 1))
        ax.set_title(plan_title(plan), fontsize=9)
    axes[0].set_ylabel("acceptance (fraction of drafts, unconditional)")
    fig.suptitle(title, fontsize=10)
    D.legend_outside(fig, axes)
    return fig


def plot_time_split(data: dict):
    """Milliseconds per generated token by part (prefill, draft, verify, feed, rollback),
    one stacked bar per k, one panel per plan."""
    title = f"Where the decode time goes: {model_title(data)}"
    fig, axes, panels = _summary_panels(data, title)
    if not panels:
        return fig
    for ax, plan, summ in panels:
        bottom = np.zeros(len(summ))
        xs = np.arange(len(summ))
        for j, p in enumerate(TIME_PARTS):
            v = np.array([r[f"ms_per_token_{p}"] or 0.0 for r in summ])
            ax.bar(xs, v, bottom=bottom, label=p, color=D.data_colour(j))
            bottom += v
        ax.set_xticks(xs, [_k_tick(r["k"]) for r in summ])
        ax.set_xlabel("MTP draft length k (tokens)")
        ax.set_title(plan_title(plan), fontsize=9)
    axes[0].set_ylabel("time per generated token (ms)")
    fig.suptitle(title, fontsize=10)
    D.legend_outside(fig, axes, title="part of the step")
    return fig


def plot_speedup_curve(data: dict):
    """Speed-up over MTP off against the measured position-1 acceptance of the synthetic
    sweep, one panel per plan swept, one line per k; break-even and this lane's own MTP
    marked; the published references in their own colours."""
    from matplotlib.lines import Line2D

    title = (f"Acceptance -> speed-up (synthetic drafts, MTP block drafting): "
             f"{model_title(data)}")
    fig, axes, plans = _per_plan(data["sweep"], title, "sweep off (bench.sweep not set)",
                                 w=5.0, h=3.8)
    if not plans:
        return fig
    d, v = REFERENCE_S9["deepseek_v3"], REFERENCE_S9["vllm_v4"]
    for ax, plan in zip(axes, plans, strict=True):
        sweep = [r for r in data["sweep"] if r["plan"] == plan]
        for k in sorted({r["k"] for r in sweep}):
            rs = sorted((r for r in sweep if r["k"] == k and r["acceptance_pos_1"] is not None
                         and r["speedup"] is not None), key=lambda r: r["acceptance_pos_1"])
            ax.plot([r["acceptance_pos_1"] for r in rs], [r["speedup"] for r in rs],
                    marker="o", color=D.data_colour(k), label=D.k_label(k))
            for b in data["break_even"]:
                if b.get("plan", plan) == plan and b["k"] == k and b["break_even_acceptance"]:
                    ax.plot(b["break_even_acceptance"], 1.0, marker="x", ms=10,
                            color=D.data_colour(k))
        for r in data["summary"]:  # where the lane's own MTP sits
            if (r["plan"] == plan and r["k"] > 0 and r["acceptance_pos_1"] is not None
                    and r["speedup"]):
                ax.plot(r["acceptance_pos_1"], r["speedup"], marker="D", ms=6, ls="none",
                        color=D.data_colour(r["k"]), markeredgecolor=D.NEUTRAL)
        ax.axhline(1.0, color=D.NEUTRAL, lw=0.8)
        ax.axvspan(d["second_token_acceptance_low"], d["second_token_acceptance_high"],
                   color=D.REFERENCE_COLOURS["deepseek_v3"], alpha=0.15,
                   label=D.ref_label("deepseek_v3", "2nd-token acceptance"))
        ax.plot([(d["second_token_acceptance_low"] + d["second_token_acceptance_high"]) / 2],
                [d["speedup"]], marker="*", ms=12, color=D.REFERENCE_COLOURS["deepseek_v3"],
                ls="none", label=D.ref_label("deepseek_v3", f"{d['speedup']}x"))
        ax.axvline(v["acceptance_per_position"][0], color=D.REFERENCE_COLOURS["vllm_v4"],
                   ls="--", label=D.ref_label("vllm_v4", "position-1 acceptance"))
        lp = REFERENCE_S9["llama_cpp_pr"]
        ax.axhline(lp["speedup"], color=D.REFERENCE_COLOURS["llama_cpp_pr"], ls=":",
                   label=D.ref_label("llama_cpp_pr", f"k={lp['k']} speed-up"))
        ax.set_xlabel("acceptance at draft position 1 (measured fraction)")
        ax.set_xlim(-0.02, 1.02)
        ax.set_title(plan_title(plan), fontsize=9)
    axes[0].set_ylabel("speed-up over MTP off (x)")
    fig.suptitle(title, fontsize=10)
    D.legend_outside(fig, axes, fontsize=7, extra=[
        (Line2D([], [], color=D.NEUTRAL, marker="x", ms=8, ls="none"),
         "break-even (speed-up 1, per k)"),
        (Line2D([], [], color="white", marker="D", ms=6, ls="none", markeredgecolor=D.NEUTRAL),
         "this lane's MTP (real drafts)")])
    return fig


def plot_seam_bytes(data: dict):
    """Bytes crossing shard seams per generated token, per ranged plan and k (the whole
    model has no seam: said, not drawn as 0)."""
    rows = [r for r in data["summary"] if r["seam_bytes_per_token"] is not None]
    title = f"Seam bytes per generated token: {model_title(data)}"
    fig, axes, plans = _per_plan(
        rows, title, "whole model only: no seam, no bytes cross one.\nAdd a ranged plan "
        "(e.g. 0-1,2-3) to the lane's bench.plans to measure them.", w=3.6, h=3.0,
        sharey=False)
    if not plans:
        return fig
    for ax, plan in zip(axes, plans, strict=True):
        rs = [r for r in rows if r["plan"] == plan]
        ax.bar([_k_tick(r["k"]) for r in rs], [r["seam_bytes_per_token"] / 1024 for r in rs],
               color=[D.data_colour(r["k"]) for r in rs])
        ax.set_xlabel("MTP draft length k (tokens)")
        ax.set_title(plan_title(plan), fontsize=9)
    axes[0].set_ylabel("seam traffic per token (KiB)")
    fig.suptitle(title, fontsize=10)
    return fig
