"""Tables and charts of an ownership derivation, for notebooks 01/02 (pandas, matplotlib).

Presentation only: every number comes from mtplib.ownership.derivation (derivation) or
mtplib.runtime.graph_reads (upstream observation); nothing is computed here.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import pandas as pd

from mtplib.ownership.derivation import (
    CACHE_SUMMARY_KEYS,
    ROLES,
    CacheParams,
    Inventory,
    Ownership,
    derive,
    inventory_from_paths,
)
from mtplib.ownership.plan import even_plan

GIB = 2**30


def role_table(own: Ownership | Inventory) -> pd.DataFrame:
    """Tensors grouped by file, role and the graphs that read them."""
    tensors = own.tensors
    df = pd.DataFrame([{"file": t.file, "role": t.role, "read_by": "+".join(t.read_by) or "none",
                        "bytes": t.bytes} for t in tensors])
    out = df.groupby(["file", "role", "read_by"], as_index=False).agg(
        tensors=("bytes", "size"), bytes=("bytes", "sum"))
    out["GiB"] = (out["bytes"] / GIB).round(3)
    return out


def unread_table(own: Ownership | Inventory) -> pd.DataFrame:
    """Tensors shipped but read by no graph."""
    return pd.DataFrame([{"file": t.file, "name": t.name, "role": t.role, "bytes": t.bytes}
                         for t in own.tensors if not t.read_by],
                        columns=["file", "name", "role", "bytes"])


def shard_table(own: Ownership) -> pd.DataFrame:
    rows = []
    for s in own.shards:
        rows.append({"plan": str(own.plan), "shard": s.index,
                     "layers": f"{s.layers[0]}-{s.layers[1]}",
                     "n_layers": s.layers[1] - s.layers[0] + 1, "bytes": s.bytes,
                     **{r: s.bytes_by_role[r] for r in ROLES},
                     "replica_bytes": s.replica_bytes, "copy_bytes": s.copy_bytes,
                     "duplicate_bytes": s.duplicate_bytes, "unread_bytes": s.unread_bytes,
                     "cache_bytes": s.caches["total"], "GiB": round(s.bytes / GIB, 3)})
    return pd.DataFrame(rows)


def replica_table(own: Ownership) -> pd.DataFrame:
    return pd.DataFrame(replica_records(own))


def replica_records(own: Ownership) -> list[dict]:
    """The rows of `replica_table` as plain dicts (no NaN for the fields a kind lacks)."""
    return ([{"shard": s.index, "kind": "replica", **r} for s in own.shards for r in s.replicas]
            + [{"shard": s.index, "kind": "duplicate", **d} for s in own.shards
               for d in s.duplicates])


def cache_table(own: Ownership) -> pd.DataFrame:
    e = own.params.effective()
    return pd.DataFrame([{"plan": str(own.plan), "n_ctx": e["n_ctx"], "n_seq": own.params.n_seq,
                          "swa_full": own.params.swa_full, "shard": s.index,
                          "layers": f"{s.layers[0]}-{s.layers[1]}", **s.caches}
                         for s in own.shards])


def cache_totals(owns: dict) -> pd.DataFrame:
    """Whole-model cache bytes of each ownership (label (n_shards, n_ctx, swa_full) ->
    Ownership): every cache kind summed over the plan's shards."""
    keys = [*CACHE_SUMMARY_KEYS, "total"]
    return pd.DataFrame([{"shards": n, "n_ctx": c, "swa_full": f,
                          **{k: sum(s.caches[k] for s in o.shards) for k in keys}}
                         for (n, c, f), o in owns.items()])


def seam_table(own: Ownership) -> pd.DataFrame:
    seam = own.seam_bytes()
    per = seam["per_seam"]
    df = pd.DataFrame({d: per[d] for d in per})
    df.index.name = "value (bytes per token, one seam)"
    for d in per:
        df[f"{d} x {seam['n_seams']} seams"] = df[d] * seam["n_seams"]
    return df


def flash_ownerships(trunk: str, sidecar: str, shards: Sequence[int] = (2, 4, 8),
                     ctxs: Sequence[int] = (8192, 131072, 1048576),
                     swa_full: Sequence[bool] = (True, False)) -> tuple[dict, float]:
    """Read both headers and derive every (n_shards, n_ctx, swa_full) combination.

    Returns ({(n, ctx, swa_full): Ownership}, seconds): the time covers header reading
    and every derivation, the figure the 5-second criterion is about.
    """
    t0 = time.perf_counter()
    inv = inventory_from_paths(trunk, sidecar)
    owns = {(n, c, f): derive(inv, even_plan(inv.config.n_layer, n),
                              CacheParams(n_ctx=c, swa_full=f))
            for n in shards for c in ctxs for f in swa_full}
    return owns, time.perf_counter() - t0


def stacked_bytes_chart(owns: dict, what: str = "roles", title: str = "", unit: float = GIB):
    """One subplot per ownership (label -> Ownership): a stacked bar per shard, stacked by
    tensor role ("roles") or by cache kind ("caches")."""
    import matplotlib.pyplot as plt

    keys = list(ROLES) if what == "roles" else list(CACHE_SUMMARY_KEYS)
    n = len(owns)
    fig, axes = plt.subplots(1, n, figsize=(4.2 * n + 1.8, 3.6), squeeze=False,
                             layout="constrained")
    for ax, (label, own) in zip(axes[0], owns.items(), strict=True):
        bottom = [0.0] * len(own.shards)
        for k in keys:
            vals = [(s.bytes_by_role[k] if what == "roles" else s.caches[k]) / unit
                    for s in own.shards]
            if any(vals):
                ax.bar([s.index for s in own.shards], vals, bottom=bottom, label=k)
                bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
        ax.set_title(str(label), fontsize=9)
        ax.set_xlabel("shard (index in the plan)")
        ax.set_xticks([s.index for s in own.shards])
    axes[0][0].set_ylabel("bytes held ("
                          + ("GiB" if unit == GIB else "MiB" if unit == 2**20 else "B") + ")")
    handles, labels = [], []
    for ax in axes[0]:
        for h, lab in zip(*ax.get_legend_handles_labels(), strict=True):
            if lab not in labels:
                handles.append(h)
                labels.append(lab)
    # right of the panels: a legend above them covered the title (issue 16)
    fig.legend(handles, labels, loc="outside right center", fontsize=8,
               title="tensor role" if what == "roles" else "cache")
    if title:
        fig.suptitle(title, fontsize=10)
    return fig


def reads_check_table(result: dict) -> pd.DataFrame:
    """graph_reads.check_pair(...)["reads"] as a table."""
    return pd.DataFrame([{k: (", ".join(v) if isinstance(v, list) else v) for k, v in r.items()}
                         for r in result["reads"]])


def caches_check_table(result: dict) -> pd.DataFrame:
    """graph_reads.check_pair(...)["caches"]: one row per upstream cache buffer."""
    rows = []
    for c in result["caches"]:
        for b in c["buffers"]:
            rows.append({"context": c["graph"], "cache": b["cache"],
                         "tensors read": b["tensors"], "derived bytes": b["derived_bytes"],
                         "upstream bytes": b["upstream_bytes"], "equal": b["equal"]})
    return pd.DataFrame(rows)
