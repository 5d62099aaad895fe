"""One step's traffic on every shard connection (`mtplib.lab.projection`): bytes by class and
waits per shard for a decode, verify, draft or feed step (`step_traffic`).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from mtplib.contract.labels import Placement, StepKind
from mtplib.errors import InputError
from mtplib.lab.projection.constants import itemsize, step_kind
from mtplib.lab.projection.graph_inputs import (
    MTP_INPUT_TENSORS,
    constants,
    graph_inputs,
    mtp_input_bytes,
    shard_roles,
)
from mtplib.lab.projection.params import ProjectionParams, Scenario
from mtplib.lab.projection.structure import MEASURED, MessageStructure
from mtplib.model.arch import HC, V4Config
from mtplib.ownership.plan import ShardPlan

# -- one step's traffic --------------------------------------------------------------------
CLASSES = ("seam", "graph_inputs", "constants", "output", "mtp_rows", "draft", "graph",
           "control", "other")


@dataclass
class StepTraffic:
    """Bytes (by class) and waits on each shard connection for one step."""

    kind: str
    n_tok: int
    bytes: list[dict[str, int]]  # per shard: class -> bytes (both directions)
    waits: list[float]  # per shard
    detail: list[dict[str, int]] = field(default_factory=list)  # per shard: tensor -> bytes
    sets: list[int] = field(default_factory=list)  # per shard: SET_TENSOR messages (no wait)

    def total(self, shards: Iterable[int] | None = None) -> dict[str, int]:
        idx = range(len(self.bytes)) if shards is None else shards
        return {c: sum(self.bytes[i].get(c, 0) for i in idx) for c in CLASSES}


def step_traffic(cfg: V4Config, plan: ShardPlan, kind: str, *, k: int = 0,
                 scenario: Scenario | None = None, structure: MessageStructure = MEASURED,
                 params: ProjectionParams | None = None,
                 tokens_fed: float | None = None) -> StepTraffic:
    """Traffic of one step kind (`step_kind`). decode (or "plain"): one MTP-off decode;
    verify: k+1 tokens; draft: one MTP draft decode (nothing crosses with a client
    drafter); feed: the verify step's accepted rows (``tokens_fed``, default k+1) into the
    tail's MTP context."""
    scenario = scenario or Scenario()
    params = params or ProjectionParams()
    kind = step_kind(kind)
    if kind != StepKind.DECODE and (isinstance(k, bool) or not isinstance(k, int) or k < 1):
        raise InputError(f"a {kind} step needs a draft length k >= 1, got {k!r}")
    roles = shard_roles(cfg, plan)
    n = plan.n_shards
    H = HC * cfg.n_embd
    isz = itemsize(scenario.boundary_dtype)
    per_shard = [dict.fromkeys(CLASSES, 0) for _ in roles]
    detail: list[dict[str, int]] = [{} for _ in roles]
    sets = [0] * n
    tail = n - 1
    if kind in (StepKind.DRAFT, StepKind.FEED):
        if scenario.placement == Placement.CLIENT:
            return StepTraffic(kind, 0, per_shard, [0.0] * n, detail, sets)
        sets[tail] = MTP_INPUT_TENSORS
        if kind == StepKind.DRAFT:
            b = mtp_input_bytes(cfg, params, 1) + cfg.n_vocab * 4 + H * 4  # logits + own row
            per_shard[tail]["draft"] = b
            detail[tail] = {"mtp_inputs": mtp_input_bytes(cfg, params, 1),
                            "mtp_logits": cfg.n_vocab * 4, "mtp_h_nextn": H * 4}
            return StepTraffic(kind, 1, per_shard, structure.draft_on_tail.on_shards(n), detail,
                               sets)
        fed = float(k + 1 if tokens_fed is None else tokens_fed)
        per_shard[tail]["mtp_rows"] = round(mtp_input_bytes(cfg, params, 1) * fed)
        detail[tail] = {"mtp_inputs(fed rows)": per_shard[tail]["mtp_rows"]}
        return StepTraffic(kind, 0, per_shard, structure.feed_on_tail.on_shards(n), detail, sets)
    n_tok = 1 if kind == StepKind.DECODE else k + 1
    n_out = n_tok
    n_rs = 0 if kind == StepKind.DECODE else k
    for r in roles:
        gi = graph_inputs(cfg, r, params, n_tok=n_tok, n_out=n_out, n_rs_seq=n_rs)
        co = constants(cfg, r, params) if structure.constants_per_step else {}
        detail[r.index].update(gi)
        detail[r.index].update(co)
        per_shard[r.index]["graph_inputs"] = sum(gi.values())
        per_shard[r.index]["constants"] = sum(co.values())
        per_shard[r.index]["other"] = structure.other_bytes_per_shard_pass
        held = r.layers[1] - r.layers[0] + 1
        per_shard[r.index]["graph"] = round(structure.graph_bytes(kind, held))
        per_shard[r.index]["control"] = round(structure.control_bytes(kind, held))
        sets[r.index] = len(gi) + len(co) + (0 if r.first else structure.seam_tensors)
        seam = structure.seam_tensors * H * isz * n_tok
        if not r.last:  # GET the boundary values of this shard's seam
            per_shard[r.index]["seam"] += seam
        if not r.first:  # SET them into the next shard
            per_shard[r.index]["seam"] += seam
    if scenario.head == "client":
        out = H * isz * n_out
        detail[tail]["hidden_rows(out)"] = out
    else:
        out = cfg.n_vocab * 4 * n_out
        detail[tail]["logits"] = out
    per_shard[tail]["output"] = out
    if kind == StepKind.VERIFY and scenario.head == Placement.TAIL:
        per_shard[tail]["mtp_rows"] = H * 4 * n_out  # the trunk's h_nextn rows (F32) to the client
        detail[tail]["h_nextn"] = H * 4 * n_out
    waits = (structure.plain if kind == StepKind.DECODE else structure.verify(scenario.head))
    return StepTraffic(kind, n_tok, per_shard, waits.on_shards(n), detail, sets)


def remote_shards(plan: ShardPlan, scenario: Scenario) -> list[int]:
    last = plan.n_shards - 1
    return [i for i in range(plan.n_shards) if not (scenario.tail_local and i == last)]
