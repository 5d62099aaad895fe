"""The inputs of the V4-Flash projection page (`mtplib.reports.wan.projection`): the
issue's measured figures it checks against, the compute inputs (the assumption and every
committed `mtplib layer-cost` result), the two models it reads and the Markdown helpers its
sections share."""

from __future__ import annotations

from pathlib import Path

from mtplib import paths
from mtplib.lab.projection.compute_inputs import ASSUMED_COMPUTE, ComputeInputs, load_compute
from mtplib.lab.projection.structure import StepWaits
from mtplib.model.fixture import sha256_header, write_fixture
from mtplib.ownership.derivation import Inventory, inventory_from_paths

#: the command the page names as its source
COMMAND = "python -m mtplib.reports.wan.projection"
RTTS = (0, 10, 25, 50, 100, 200)
TABLE_SHARDS = (2, 4, 8)

#: Issue 14, "Measured (tried as a new user would)": the trained pair, plan 0-1,2-3, k=2,
#: 32 tokens; (RTT ms, tail local, MTP off tok/s, MTP on tok/s). Loopback: 77.0 / 49.0.
ISSUE_MEASURED = ((100, True, 4.50, 4.74), (100, False, 3.10, 1.44),
                  (25, True, 15.18, 14.88), (25, False, 11.00, 5.25))
ISSUE_LOOPBACK = (77.0, 49.0)
ISSUE_TOKENS_PER_VERIFY = 32 / 18
#: Issue 14, "Where it goes": per MTP-off token, (SET_TENSOR, GET_TENSOR, data bytes) per
#: shard of plan 0-1,2-3; only shard 0's bytes are given (71.8 KB, 65,536 B of them k_rot).
ISSUE_COUNTS = ((20, 2, "71.8 KB"), (13, 1, "-"))
#: A context inside the first 256 cells (the issue's prompt: 600 characters + 32 tokens).
TRAINED_CONTEXT = 200


def v4_flash(tmp: Path) -> tuple[Inventory, dict]:
    pair = write_fixture(tmp, preset="v4-flash")
    return inventory_from_paths(pair.trunk, pair.sidecar), {
        "trunk": sha256_header(pair.trunk), "sidecar": sha256_header(pair.sidecar)}


def trained() -> Inventory:
    d = paths.EVIDENCE / "trained-v4"
    return inventory_from_paths(d / "v4-trained.gguf", d / "mtp-v4-trained.gguf")



def fmt_bytes(x: float) -> str:
    return f"{round(x):,}"


def fmt_gb(x: float) -> str:
    return f"{x / 1e9:.1f}"


def md_table(head: list[str], rows: list[list]) -> list[str]:
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    out += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return out + [""]


def fmt_waits(sw: StepWaits) -> str:
    return f"{sw.per_seam:g} / {sw.fixed:g} / {sw.tail:g}"


#: Results of `mtplib layer-cost` (issue 24): the compute inputs measured on the V4-Flash-
#: width slice. A GPU result, when one is committed, replaces the assumption in every table.
LAYER_COST = paths.EVIDENCE / "layer-cost"


def computes(folder: Path = LAYER_COST) -> list[ComputeInputs]:
    """The assumption, then every committed measurement (sorted by file name)."""
    return [ASSUMED_COMPUTE] + [load_compute(p) for p in sorted(folder.glob("*.json"))
                                if p.name != "run_record.json"]  # what ran: no result


def main_compute(cs: list[ComputeInputs]) -> ComputeInputs:
    """What the tables use: a GPU measurement where there is one, else the assumption (a
    CPU figure is not what a shard of H200s computes at: it is shown beside it)."""
    return next((c for c in cs if c.name == "measured-gpu"), ASSUMED_COMPUTE)
