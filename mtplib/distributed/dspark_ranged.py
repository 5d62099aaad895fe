"""A ranged run's DSpark drafter (issue 40 point 3): its placement decision as `routing`
shows it, and its features' bytes in the seam report.

Why apart from `auto_placement`: nothing is timed or moved for DSpark. The drafter runs
in the client (the tail placement is not built: `mtplib.runtime.dspark.ranged`), so the
record states the inputs the decision read (rows, widths, the tail link) and why.
"""

from __future__ import annotations

from collections.abc import Mapping

from mtplib.runtime.dspark.ranged import (
    choose_dspark_placement,
    feature_bytes,
    feature_row_bytes,
)


def placement_record(rt, k: int, requested: str, costs: Mapping[str, float] | None) -> dict:
    """The ``routing["placement"]`` of a ranged DSpark run (``rt``: its `RangedRuntime`)."""
    from mtplib.distributed.auto_placement import tail_rtt

    side = rt.sidecar or {}
    n_layers = len(rt.request.sidecar_header.kv.get("dflash.target_layers", ()))
    rtt, rtt_src, bw = tail_rtt(rt)
    if costs and "rtt_s" in costs:
        rtt, rtt_src = float(costs["rtt_s"]), "given"
    n_embd, n_vocab = int(side.get("n_embd", rt.trunk["n_embd"])), int(rt.trunk["n_vocab"])
    c = choose_dspark_placement(k=k, n_layers=n_layers, n_embd=n_embd, n_vocab=n_vocab,
                                rtt_s=rtt, bandwidth_bps=bw, requested=requested)
    return {"requested": {"mtp_placement": requested, "head": "upstream"},
            "drafter": "dspark",
            "inputs": {"k": k, "target_layers": n_layers, "n_embd": n_embd,
                       "n_vocab": n_vocab, "rtt_s": rtt, "bandwidth_bps": bw,
                       "feature_row_bytes": feature_row_bytes(n_layers, n_embd),
                       "tail_built": False},
            "sources": {"rtt_s": rtt_src, "widths": "the draft's and the trunk's headers"},
            "decisions": {c.what: c.as_dict()}, "moved_sidecar": False}


def feature_rows(relays, label: str) -> dict[str, int]:
    """Feature bytes of one step kind on every link (client links and peer links), by
    direction; "peer" counts a shard-to-shard push of one."""
    out = feature_bytes(relays.by_tensor_dir(label))
    out["peer"] = sum(feature_bytes([{("up", n): b for (_, n), b in d.items()}
                                     for d in relays.peer_by_tensor_dir(label)]).values())
    return out
