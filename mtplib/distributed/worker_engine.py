"""The client worker's engines, one per engine configuration (built and warmed once, at
most MAX_ENGINES kept): shared by the one-request path (`ranged_mtp`) and the batch
(`ranged_batch`). Moved out of `ranged_mtp` as is."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import asdict, replace

from mtplib.runtime.engine_options import EngineOptions

#: engines a worker keeps warm at once (one per distinct engine configuration)
MAX_ENGINES = 4


def engine_key(opts: EngineOptions) -> tuple:
    """What makes two generations need different engines (sampler and trace do not)."""
    d = asdict(replace(opts, sampler=None, trace=False))
    return tuple(sorted((k, repr(v)) for k, v in d.items()))


def engine_for(models, opts: EngineOptions, warm: bool) -> dict | None:
    """The worker's engine for ``opts`` (built and warmed once; at most MAX_ENGINES kept);
    returns the setup report when it was built by this call."""
    from mtplib.distributed.worker import worker_step
    from mtplib.runtime.engine import no_phase
    from mtplib.runtime.generation import warm_up
    from mtplib.runtime.speculative import build_engine

    cache: OrderedDict = models.__dict__.setdefault("engines", OrderedDict())
    key = engine_key(opts)
    if key in cache:
        cache.move_to_end(key)
        return None
    while len(cache) >= MAX_ENGINES:
        _, (_, owned, _) = cache.popitem(last=False)
        for c in reversed(owned):
            c.close()
    with worker_step("setup"):
        engine, owned = build_engine(models.trunk, models.sidecar if opts.k else None, opts,
                                     phase=no_phase)
        try:
            report = warm_up(engine) if warm else {"setup_s": 0.0, "widths": []}
        except BaseException:
            for c in reversed(owned):
                c.close()
            raise
    engine.phase = worker_step
    cache[key] = (engine, owned, report)
    return report


def worker_memory(models, engine, owned):
    """``memory(seq)``: the weights and one sequence's cache state in bytes, as a
    generation on ``engine`` records them."""
    llama = models.trunk.llama

    def memory(seq: int) -> dict:
        mem = {"trunk_weights_bytes": models.trunk.size_bytes,
               "target_seq_state_bytes": int(llama.llama_state_seq_get_size(
                   engine.target.ptr, seq))}
        if len(owned) > 1:
            mem["mtp_weights_bytes"] = models.sidecar.size_bytes
        return mem

    return memory
