"""``--mtp-placement auto`` and ``--head auto`` of a ranged run, from costs measured at load
(issue 29 item 4; the decision itself: `mtplib.runtime.placement`).

Why here: the costs are the loaded drafter's and head's, timed in the ranged worker on a
throwaway sequence right after the engine is built and warmed (a few drafts, a few head
calls: cheap), and the tail link's round trip is the quickest of the handshake's round
trips plus the WAN a relay emulates. The tail's drafter is not loaded under ``auto`` (the
sidecar starts in the client), so its compute is an ESTIMATE: the client's own figure (the
same work on a CPU shard; a GPU tail drafts faster, which only a given cost can say). When
the tail wins, the sidecar is moved there once, at load, and the engines are rebuilt.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Mapping
from dataclasses import replace

from mtplib.contract.labels import Placement
from mtplib.runtime.placement import (
    Choice,
    PlacementInputs,
    choose_head,
    choose_placement,
    decision_record,
)

#: timed repetitions of each measurement (after one untimed)
REPS = 5


def _median_spread(xs: list[float]) -> tuple[float, list[float]]:
    return statistics.median(xs), [min(xs), max(xs)]


# -- the worker side (run through RangedRuntime.call) -----------------------------------
def _worker_costs(models, key: tuple, reps: int = REPS) -> dict:
    """Seconds per drafted token of the engine's drafter and per row of its client head
    (None where it has none), timed on a throwaway sequence; the rows' and logits' bytes."""
    import numpy as np

    from mtplib.runtime.drafters import MTPDrafter

    engine, _, _ = models.engines[key]
    target = engine.target
    out: dict = {"draft_s": None, "head_s": None, "row_bytes": target.width * 4,
                 "logits_bytes": target.n_vocab * 4, "reps": reps}
    k = max(engine.k, 1)
    if isinstance(engine.drafter, MTPDrafter):
        d = engine.drafter
        s = engine.open([1 % target.n_vocab] * 4)
        try:
            seq, base, last = s.seq, s.base, s.last
            times = []
            for i in range(reps + 1):
                t0 = time.perf_counter()
                d.propose(seq, last, base, k)
                dt = (time.perf_counter() - t0) / k
                d.truncate(seq, base + 1, None)  # back to n_fed == base, pending kept
                if i:
                    times.append(dt)
            out["draft_s"] = times
        finally:
            engine.close(s)
    if engine.head is not None:
        rows = np.random.default_rng(0).standard_normal((k + 1, target.width)).astype(
            np.float32)
        times = []
        for i in range(reps + 1):
            t0 = time.perf_counter()
            engine.head(rows)
            if i:
                times.append((time.perf_counter() - t0) / (k + 1))
        out["head_s"] = times
    return out


def worker_move_sidecar(models, placement: str) -> dict:
    """Load the sidecar at ``placement`` instead (every engine closed first: their MTP
    contexts belong to the old one); returns its model info, as the worker's open does."""
    from mtplib.distributed.worker import model_info
    from mtplib.runtime.rpc import load_sidecar

    engines = models.__dict__.pop("engines", {})
    for _, owned, _ in engines.values():
        for c in reversed(owned):
            c.close()
    old = models.sidecar
    path, header = old.path, old.header
    old.close()
    models.sidecar = load_sidecar(models.trunk, path, placement, header=header)
    s = models.sidecar
    return model_info(s, s.placement, s.load_buffers)


# -- the caller's side --------------------------------------------------------------------
def tail_rtt(rt) -> tuple[float, str, float | None]:
    """(seconds of one round trip on the tail's link, its source, the link's bits/s or
    None): the handshake's quickest round trip plus the relay's emulated RTT."""
    probe = rt.shard_info[-1].rtt_s or 0.0
    relays = rt.relays.relays
    link = relays[-1].link if relays else None
    wan = (link.rtt_ms / 1e3) if link is not None else 0.0
    bw = link.mbit * 1e6 if link is not None and link.mbit is not None else None
    src = (f"measured: the quickest of the tail handshake's 5 round trips "
           f"({probe * 1e3:.3g} ms) + the emulated WAN's {wan * 1e3:g} ms")
    return probe + wan, src, bw


def measure(rt, key: tuple, k: int, *, placement: str) -> tuple[PlacementInputs, dict]:
    """The inputs of a decision for the engine ``key`` (k drafts per step), whose drafter
    runs at ``placement``; and the raw timings (median, min-max, n) for the record."""
    raw = rt.call(_worker_costs, key)
    rtt, rtt_src, bw = tail_rtt(rt)
    sources = {"rtt_s": rtt_src}
    timings: dict = {"reps": raw["reps"]}
    vals: dict = {}
    if raw["draft_s"]:
        med, spread = _median_spread(raw["draft_s"])
        timings["draft_s"] = {"median": med, "min_max": spread, "where": placement}
        if placement == Placement.CLIENT:
            vals["client_draft_s"] = med
            sources["client_draft_s"] = (f"measured: {raw['reps']} timed drafts of {k} "
                                         "tokens on the loaded drafter in this client")
            vals["tail_draft_s"] = med
            sources["tail_draft_s"] = ("estimated: the client's figure (the same work on a "
                                       "CPU shard; the tail's drafter is not loaded)")
        else:
            # timed through the tail link: its round trips are in the figure, take them out
            from mtplib.runtime.placement import DRAFT_WAITS_PER_TOKEN

            waits = DRAFT_WAITS_PER_TOKEN["client"]
            vals["tail_draft_s"] = max(0.0, med - waits * rtt)
            sources["tail_draft_s"] = (f"measured: {raw['reps']} timed drafts on the tail, "
                                       f"less {waits:g} waits x RTT per token")
    if raw["head_s"]:
        med, spread = _median_spread(raw["head_s"])
        timings["head_s"] = {"median": med, "min_max": spread}
        vals["client_head_s"] = vals["tail_head_s"] = med
        sources["client_head_s"] = (f"measured: {raw['reps']} timed head calls on {k + 1} "
                                    "rows in this client")
        sources["tail_head_s"] = "estimated: the client's figure (the same work on the tail)"
    inp = PlacementInputs(k=k, rtt_s=rtt, bandwidth_bps=bw, row_bytes=raw["row_bytes"],
                          logits_bytes=raw["logits_bytes"], sources=sources, **vals)
    return inp, timings


def decide(inp: PlacementInputs, *, placement: str, head: str, running: str
           ) -> tuple[Choice | None, Choice | None]:
    """The decisions ``auto`` asks for: the drafter's (only when ``placement`` is auto and
    the run drafts) and the head's (only when ``head`` is auto); ``running``: where the
    drafter is now, for the head's decision when the placement is not decided here."""
    where = running
    pc = None
    if placement == "auto" and inp.k:
        pc = choose_placement(inp, head="client" if head == "auto" else head)
        where = pc.chosen
    hc = choose_head(inp, placement=where) if head == "auto" else None
    return pc, hc


def record(inp: PlacementInputs, timings: dict, pc: Choice | None, hc: Choice | None, *,
           requested: Mapping[str, str], moved: bool) -> dict:
    """The ``routing["placement"]`` of a run."""
    rec = decision_record(inp, placement=pc, head=hc, requested=requested)
    rec["timings"] = timings
    rec["moved_sidecar"] = moved
    return rec


def with_k(inp: PlacementInputs, k: int) -> PlacementInputs:
    """The same measured costs for another draft length (the head's decision per k)."""
    return replace(inp, k=k)
