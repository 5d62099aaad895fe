"""The charts of notebook 03 (correctness): seam traffic per step kind and rollback
exactness, as pyplot-free Figures that follow `mtplib.lab.common.display`'s conventions (a title
naming what and which model / plan, labelled axes with units, legends outside the data).
They take the rows `mtplib.lab.correctness` returns (or the DataFrames made of them)."""

from __future__ import annotations

import math

from mtplib.contract import labels
from mtplib.errors import InputError
from mtplib.lab.common import display as D

#: step kinds of `correctness.whole_vs_ranged`'s ``bytes_per_token_<kind>`` columns
STEP_KINDS = labels.STEP_KINDS


def _records(rows) -> list[dict]:
    return rows.to_dict("records") if hasattr(rows, "to_dict") else list(rows)


def _num(v) -> float | None:
    return None if D.is_missing(v) else float(v)


def _plan_title(plan: str) -> str:
    return f"plan {plan} ({plan.count(',') + 1} RPC shards)"


def plot_seam_traffic(rows, *, model: str = ""):
    """Bytes on the shard connections per token, by step kind (grouped bars per k), one
    panel per ranged plan, log scale, with the contract's minimum per decode token. A
    step kind a run did not have (MTP off has no draft) gets no bar, not a 0."""
    import numpy as np

    rs = _records(rows)
    if not rs:
        raise InputError("no whole-vs-ranged rows to plot")
    plans = list(dict.fromkeys(r["plan"] for r in rs))
    kinds = [s for s in STEP_KINDS
             if any(_num(r.get(f"bytes_per_token_{s}")) for r in rs)]
    fig, axes = D.new_figure(len(plans), w=4.6, h=3.6)
    width = 0.8 / max(len(kinds), 1)
    for ax, plan in zip(axes, plans, strict=True):
        prs = sorted((r for r in rs if r["plan"] == plan), key=lambda r: r["k"])
        xs = np.arange(len(prs))
        for j, s in enumerate(kinds):
            vals = [_num(r.get(f"bytes_per_token_{s}")) for r in prs]
            pos = [x + (j - (len(kinds) - 1) / 2) * width for x, v in zip(xs, vals,
                                                                          strict=True) if v]
            ax.bar(pos, [v for v in vals if v], width=width, color=D.data_colour(j), label=s)
        cmin = next((_num(r.get("contract_min_decode")) for r in prs
                     if _num(r.get("contract_min_decode"))), None)
        if cmin:
            ax.axhline(cmin, color=D.NEUTRAL, ls="--", lw=1,
                       label="contract minimum per decode token")
        ax.set_yscale("log")
        ax.set_xticks(xs, ["off" if r["k"] == 0 else f"k={r['k']}" for r in prs])
        ax.set_xlabel("MTP draft length k (tokens)")
        ax.set_title(_plan_title(plan), fontsize=9)
    axes[0].set_ylabel("bytes per token of the step (B, log scale)")
    fig.suptitle("Bytes on the shard connections per token, by step kind"
                 + (f": {model}" if model else ""), fontsize=10)
    D.legend_outside(fig, axes, title="step kind")
    return fig


def _method(r: dict) -> str:
    rb = r.get("rollbacks") or {}
    if isinstance(rb, dict) and rb:
        kind = next(iter(rb))
    else:
        kind = "tail" if r.get("n_rs_seq") else "checkpoint_replay"
    return {"tail": "tail removal (seq_rm)",
            "checkpoint_replay": "checkpoint restore + replay"}.get(kind, kind)


def plot_rollback(rows, *, noise_bound: float, model: str = ""):
    """Largest |logit difference| after a rollback against a fresh context, one bar per
    scenario (method and prompt seed), coloured by method, with the noise bound."""
    rs = _records(rows)
    if not rs:
        raise InputError("no rollback rows to plot")
    methods = list(dict.fromkeys(_method(r) for r in rs))
    fig, axes = D.new_figure(1, w=5.0, h=3.4)
    ax = axes[0]
    labels = [f"seed {r['seed']}\n" + ("tail" if "tail" in _method(r) else "ckpt")
              for r in rs]
    for i, r in enumerate(rs):
        m = _method(r)
        v = _num(r["max_abs_dlogit"])
        ax.bar(i, math.nan if v is None else v, color=D.data_colour(methods.index(m)),
               label=m)
    ax.axhline(noise_bound, color=D.NEUTRAL, ls="--", lw=1,
               label=f"noise bound ({D.fmt_number(noise_bound)})")
    ax.set_xticks(range(len(rs)), labels, fontsize=8)
    ax.set_xlabel("scenario (prompt seed, rollback method)")
    ax.set_ylabel("max |Δ logit| (logit units)")
    ax.set_title("Next-token logits after a rollback vs a fresh context"
                 + (f": {model}" if model else ""), fontsize=9)
    D.legend_outside(fig, axes, title="rollback method")
    return fig
