"""The acceptance sweep's plots (`mtplib.lab.sidebyside`): speed-up against the synthetic rate,
one panel per sweep file.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from mtplib.errors import InputError


def sweep_title(data: dict) -> str:
    """What a sweep file measured, as a reader names it: the fixture preset and seed (not
    the file stem 'v4-v4-ratio-cpu-s0'), the engine and the threads."""
    from mtplib.lab.common.display import model_name

    return (f"mtplib MTP loop, whole model: {model_name(data['trunk'])}, "
            f"{data['config']['threads']} thread(s)")


def plot_sweep(path: str | Path, ax=None, *, legend: bool = True):
    """Speed-up over MTP off vs the synthetic rate (same at every position), one line per
    k, break-even marked; the legend right of the axes. Returns the matplotlib Axes. The
    rate is upstream's ``--spec-synth-rates`` one, the same at every position and
    unconditional."""
    from matplotlib.lines import Line2D

    from mtplib.lab.common import display as D

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

    from mtplib.lab.common import display as D

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
