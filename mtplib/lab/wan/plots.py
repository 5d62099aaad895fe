"""The WAN benchmark's plots (`mtplib.lab.wan`): tokens/s and speed-up against RTT, per build
and against the link bandwidth.
"""

from __future__ import annotations

from mtplib.errors import InputError

#: the model every WAN run measures (mtplib.model.trained: the committed trained pair)
WAN_MODEL = "trained tiny V4 pair"


def _rtt_series(rows: list[dict]) -> list[tuple[str, str, int]]:
    return sorted({(s["topology"], s["placement"], s["k"]) for s in rows},
                  key=lambda t: (t[0], t[2] > 0, str(t[1]), t[2]))


def _rtt_colour(place: str, k: int, combos: list[tuple[str, int]]) -> str:
    from mtplib.lab.common.display import data_colour

    return data_colour(combos.index((place, k)))


def bandwidth_text(mbit: float | None) -> str:
    return "unlimited" if mbit is None else f"{mbit:g} Mbit/s"


def plot_rtt(summary: list[dict], *, what: str = "tok_s", plan: str | None = None, ax=None,
             legend: bool = True, mbit: float | None = None):
    """tokens/s (``what="tok_s"``) or speed-up over MTP off (``"speedup"``) against RTT
    for one plan and link bandwidth (``mbit``; None: unlimited, which rows without the
    field ran at): colour = drafter placement and k (MTP off has its own), line style =
    topology, so no two lines look alike; the legend right of the axes."""
    from mtplib.lab.common import display as D

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
    from mtplib.lab.common import display as D

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
    from mtplib.lab.common import display as D

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
    from mtplib.lab.common import display as D

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
