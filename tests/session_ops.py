"""Session operations on a speculative `Engine`, the same on the whole model and ranged.

The ranged engine lives in the ranged client worker (`RangedMTP`), so a test reaches it
with ``r.rt.call(remote, want, op, ...)``: each proposal and verify result then crosses
the process boundary as the pickled contract message (`DraftProposal`, `VerifyResult`)
and comes back to the worker's engine, where a foreign or stale one must be refused. On
the whole model the same ops run on ``MTPRuntime.engine`` here (`local`). Every op returns
plain data, so a test can compare the two runs step by step.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import numpy as np

#: the metrics that must match a whole-model run exactly (counts, not times)
COUNTS = ("n_prompt", "n_generated", "drafted", "accepted", "drafted_per_position",
          "accepted_per_position_counts", "accept_len_hist", "verify_steps", "plain_steps",
          "rollbacks")


def _accept_n(n: int, picks: Sequence[int], drafts: Sequence[int]) -> int:
    return min(n, len(drafts))


def snapshot(e, seq: int) -> dict:
    """What one session holds: committed tokens, its contract session, the target cache's
    bookkeeping and real extent, exact counts, and the MTP drafter's state for it."""
    s = e.sessions[seq]
    m = s.metrics.result()
    d = e.drafter
    return {
        "tokens": list(s.tokens), "seq": s.seq, "session_id": s.id,
        "state": s.session.state.value, "epoch": s.session.epoch,
        "position": s.session.position, "n_cached": s.n_cached,
        "target_pos_max": e.target.seq_pos_max(seq),
        "counts": {k: getattr(m, k) for k in COUNTS},
        "drafter_n_fed": d.n_fed.get(seq), "drafter_pos_max": d.ctx.seq_pos_max(seq),
        "drafter_pending": np.array(d.pending[seq]),
    }


def _open(e, prompt, seq_id=None, session_id=None) -> dict:
    return snapshot(e, e.open(prompt, seq_id=seq_id, session_id=session_id).seq)


def _propose(e, seq, k=None):
    return e.sessions[seq].propose(k)


def _verify(e, seq, proposal):
    return e.sessions[seq].verify(proposal)


def _commit(e, seq, result) -> list[int]:
    return e.sessions[seq].commit(result)


def _step(e, seq, k=None) -> dict:
    e.sessions[seq].step(k)
    return snapshot(e, seq)


def _truncate(e, seq, keep) -> dict:
    e.sessions[seq].truncate(keep)
    return snapshot(e, seq)


def _close(e, seq) -> tuple[int, int]:
    """Close a session; returns its sequence's cache extents after (target, drafter)."""
    e.close(e.sessions[seq])
    return e.target.seq_pos_max(seq), e.drafter.ctx.seq_pos_max(seq)


def _force(e, n: int | None) -> None:
    """Force the accepted length of every verify (the warm-up's hook); None: match."""
    e.forced_accept = None if n is None else functools.partial(_accept_n, n)


def _live(e) -> list[int]:
    return sorted(e.sessions)


def _reset(e) -> None:
    for s in list(e.sessions.values()):
        e.close(s)
    e.forced_accept = None


OPS: dict[str, Callable] = {"open": _open, "propose": _propose, "verify": _verify,
                            "commit": _commit, "step": _step, "truncate": _truncate,
                            "close": _close, "force": _force, "live": _live,
                            "snapshot": snapshot, "reset": _reset}


def pick(engines, want: dict):
    """The one engine whose k and n_rs_seq are ``want``'s."""
    found = [e for e in engines if e.k == want["k"] and e.target.n_rs_seq == want["n_rs_seq"]]
    if len(found) != 1:
        raise LookupError(f"{len(found)} engines match {want}")
    return found[0]


def remote(models, want: dict, op: str, *args):
    """In the ranged worker: ``op`` on the worker's engine described by ``want``."""
    engine = pick([v[0] for v in models.engines.values()], want)
    return OPS[op](engine, *args)


def reset_all(models) -> None:
    """In the ranged worker: close every session, undo every forced acceptance."""
    for engine, _, _ in models.engines.values():
        _reset(engine)


def local(engine) -> Callable:
    """The ops on a whole-model engine in this process, called like the ranged ones."""
    return lambda op, *args: OPS[op](engine, *args)
