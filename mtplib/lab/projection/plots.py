"""The projection's plot (`mtplib.lab.projection`): tokens/s or speed-up against RTT.
"""

from __future__ import annotations

from collections.abc import Sequence

from mtplib.errors import InputError


# -- plot ---------------------------------------------------------------------------------
def plot_projection(rows: Sequence[dict], ax=None, *, plan: str | None = None,
                    scenario: str | None = None, metric: str = "tok_s"):
    """Tokens/s (or ``metric="speedup"``) against RTT for one plan and scenario (default:
    the first row's), one line per draft length; the legend sits outside the axes."""
    import matplotlib.pyplot as plt

    from mtplib.lab.common.display import data_colour

    if not rows:
        raise InputError("no rows to plot")
    if metric not in ("tok_s", "speedup"):
        raise InputError(f"metric must be 'tok_s' or 'speedup', got {metric!r}")
    plan = plan or rows[0]["plan"]
    scenario = scenario or rows[0]["scenario"]
    sel = [r for r in rows if r["plan"] == plan and r["scenario"] == scenario]
    if not sel:
        raise InputError(f"no rows for plan {plan!r} and scenario {scenario!r}")
    if ax is None:
        _, ax = plt.subplots(figsize=(7, 4))
    for i, k in enumerate(sorted({r["k"] for r in sel})):
        pts = sorted((r["rtt_ms"], r[metric]) for r in sel if r["k"] == k)
        label = "MTP off" if k == 0 else f"MTP k={k}"
        ax.plot([x for x, _ in pts], [y for _, y in pts], marker="o", markersize=3,
                color=data_colour(i), label=label)
        if metric == "speedup" and k:
            ideal = next(r["tokens_per_verify"] for r in sel if r["k"] == k)
            ax.axhline(ideal, color=data_colour(i), linestyle=":", linewidth=1,
                       label=f"k={k} ideal ({ideal:.2f} tokens/verify)")
    ax.set_xlabel("round-trip time to each remote shard (ms)")
    ax.set_ylabel("decode speed (tokens/s)" if metric == "tok_s"
                  else "speed-up over MTP off (x)")
    n = sel[0]["n_shards"]
    ax.set_title(f"V4-Flash projection: plan {plan} ({n} shards)\n{scenario}", fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.legend(loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0, fontsize=8)
    return ax
