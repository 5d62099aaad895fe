"""Which shard plans fit one H200 each (`mtplib.lab.projection`): weights + caches + a
reserve per shard against the GPU's memory (`fit_rows`).
"""

from __future__ import annotations

from collections.abc import Sequence

from mtplib.errors import InputError
from mtplib.lab.projection.constants import H200_BYTES
from mtplib.ownership.derivation import CacheParams, Inventory, derive
from mtplib.ownership.plan import ShardPlan, parse_plan


# -- which plans fit one H200 --------------------------------------------------------------
def fit_rows(inv: Inventory, plans: Sequence[str | ShardPlan], *,
             contexts: Sequence[int] = (32768, 131072), swa_full: bool = True,
             n_rs_seq: int = 3, capacity: int = H200_BYTES, reserve: int = 8 * 2**30
             ) -> list[dict]:
    """Per plan and context: each shard's weights (its files' tensors: the tail holds the
    trunk's head and the whole MTP sidecar) + caches (`ownership.derive` at that context,
    n_rs_seq compressor planes for MTP rollback) + ``reserve`` (compute buffers, CUDA
    context), against ``capacity``. The first shard's count includes token_embd (1.06 GB),
    which upstream keeps in host memory: an over-count there, on the safe side."""
    if capacity <= 0 or reserve < 0:
        raise InputError("capacity must be > 0 and reserve >= 0")
    rows = []
    for p in plans:
        plan = parse_plan(p, inv.config.n_layer) if isinstance(p, str) else p
        for L in contexts:
            own = derive(inv, plan, CacheParams(n_ctx=L, swa_full=swa_full, n_rs_seq=n_rs_seq))
            need = [s.bytes + s.caches["total"] + reserve for s in own.shards]
            worst = max(range(len(need)), key=need.__getitem__)
            rows.append({
                "plan": str(plan), "n_shards": plan.n_shards, "n_ctx": L,
                "swa_full": swa_full, "largest_shard": worst,
                "weights_bytes": own.shards[worst].bytes,
                "cache_bytes": own.shards[worst].caches["total"], "reserve_bytes": reserve,
                "need_bytes": need[worst], "capacity_bytes": capacity,
                "headroom_bytes": capacity - need[worst], "fits": need[worst] <= capacity,
                "need_per_shard": need})
    return rows
