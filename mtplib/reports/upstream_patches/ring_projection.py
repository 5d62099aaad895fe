"""The V4-Flash projection (mtplib.lab.projection, its defaults) for three message
structures: today's star (`measured`: 2 waits per seam + 1), the star with one wait per seam
(`seam_once`, patches/0002-0004, measured on the trained pair) and the shard-to-shard ring
(patches/0007, `ring_structure`: its waits measured, ring-waits.json). Prints a markdown
table.

    python -m mtplib.reports.upstream_patches.ring_projection

The ring: the client sends the step's inputs to every shard (SETs: no wait), each shard
pushes its boundary value to the next, the tail answers the client. With every link at the
same RTT r, a step is n_shards + 1 one-way hops = (n_shards + 1) / 2 round trips by
construction (per_seam 0.5, tail 1 in `StepWaits.on_shards`), against the star's n_shards.
The structure used is the measured one: the ring rows of ring-waits.json (the trained
pair, MTP off, every link at 100 ms: effective waits per plain token by time on 2 and 3
shards) give tail + per_seam x (n_shards - 1) through both points, each rounded to 2
decimals. A verify step with the head in the client is the same traversal (the relays
count 1 client wait for both); with the head on the tail it waits once more on the tail,
as in `seam_once`. Bytes are counted as in the star (each boundary value twice), which
overstates the ring's by one hop per seam.
"""

from __future__ import annotations

import json
import tempfile
from dataclasses import replace
from pathlib import Path

from mtplib.lab.projection.params import Scenario
from mtplib.lab.projection.structure import MEASURED, SEAM_ONCE, MessageStructure, StepWaits
from mtplib.lab.projection.sweep import project
from mtplib.model.fixture import write_fixture
from mtplib.ownership.derivation import inventory_from_paths
from mtplib.reports import common

MODULE = "mtplib.reports.upstream_patches.ring_projection"
#: the measured ring: its waits by time per plain token on 2 and 3 shards
WAITS = common.evidence("upstream-patches") / "ring-waits.json"


def ring_structure(path: Path = WAITS):
    """`seam_once` with the ring's measured waits: (per_seam, tail) through the ring rows'
    (n_shards, waits by time) points, rounded to 2 decimals."""
    rows = {r["n_shards"]: r["waits_by_time"] for r in json.loads(path.read_text())["rows"]
            if r["seam"] == "ring"}
    (n1, w1), (n2, w2) = sorted(rows.items())
    per_seam = round((w2 - w1) / (n2 - n1), 2)
    tail = round(w1 - per_seam * (n1 - 1), 2)
    return replace(SEAM_ONCE, plain=StepWaits(per_seam=per_seam, tail=tail),
                   verify_head_client=StepWaits(per_seam=per_seam, tail=tail),
                   verify_head_tail=StepWaits(per_seam=per_seam, tail=tail + 1),
                   source=f"measured: patches/0007's ring, waits by time on 2 and 3 shards "
                          f"at 100 ms ({path.name}): per_seam {per_seam:g}, tail {tail:g}")


def structures() -> tuple[tuple[str, MessageStructure], ...]:
    """The three structures the table compares, by the name its header gives each."""
    return (("star today", MEASURED), ("star, one wait per seam", SEAM_ONCE),
            ("shard-to-shard ring (measured waits)", ring_structure()))


SHARDS = (2, 4, 8)
RTTS = (10, 25, 50, 100, 200)
SCENARIO = Scenario(placement="client", head="client")


def main(argv: list[str] | None = None) -> int:
    common.parser(MODULE, __doc__).parse_args(argv)
    structs = structures()
    with tempfile.TemporaryDirectory() as tmp:
        pair = write_fixture(tmp, preset="v4-flash")
        inv = inventory_from_paths(pair.trunk, pair.sidecar)
    rows = {}
    for name, st in structs:
        for r in project(inv, n_shards=SHARDS, plan_kinds=("even",), ks=(0, 2),
                         rtts_ms=RTTS, scenarios=(SCENARIO,), structure=st):
            rows[(name, r["n_shards"], r["rtt_ms"], r["k"])] = r
    head = ["shards", "RTT ms"] + [f"{n}: off / k=2 tok/s (waits per token)"
                                   for n, _ in structs]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for n in SHARDS:
        for rtt in RTTS:
            cells = []
            for name, _ in structs:
                off, on = rows[(name, n, float(rtt), 0)], rows[(name, n, float(rtt), 2)]
                cells.append(f"{off['tok_s']:.2f} / {on['tok_s']:.2f} "
                             f"({off['waits_per_token']:g} / {on['waits_per_token']:.2f})")
            print(f"| {n} | {rtt} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
