"""The projection's compute model (`mtplib.lab.projection`): the weight bytes one token reads
(`active_bytes`) and the seconds per step kind (`ComputeModel`, `compute_model`),
calibrated on llama.cpp's V4 MTP PR unless measured inputs are given.
"""

from __future__ import annotations

from dataclasses import dataclass

from mtplib.contract.labels import Placement, StepKind
from mtplib.lab.projection.constants import ANCHOR_SPEEDUP_K2, VLLM_ACCEPTANCE, step_kind
from mtplib.lab.projection.params import ProjectionParams, Scenario
from mtplib.ownership.derivation import Inventory


# -- compute ------------------------------------------------------------------------------
def active_bytes(inv: Inventory) -> dict[str, int]:
    """Weight bytes one token reads (memory-bound view): routed experts count
    n_expert_used / n_expert of their bytes, an embedding one row, everything else whole.
    trunk: the main graph (blocks 0..n_layer-1, hc head, norm, output head); mtp: one draft
    (the sidecar's block n_layer, its hc head, norm and output head); head: the trunk's hc
    head + norm + output head (what a client-side head reads per step)."""
    cfg = inv.config
    frac = cfg.n_expert_used / cfg.n_expert
    out = {"trunk": 0, "mtp": 0, "head": 0}
    for t in inv.tensors:
        if "main" not in t.read_by and "mtp" not in t.read_by:
            continue
        b = t.bytes
        if "_exps" in t.name:
            b = round(b * frac)
        elif t.name == "token_embd.weight":
            b = t.bytes // cfg.n_vocab
        if t.file == "trunk" and "main" in t.read_by:
            out["trunk"] += b
            if t.block is None and t.name != "token_embd.weight":
                out["head"] += b
        if "mtp" in t.read_by and (t.file == "mtp" or inv.layout != "pair"):
            out["mtp"] += b
    return out


@dataclass(frozen=True)
class ComputeModel:
    """Seconds of compute per step kind (derived in `compute_model`)."""

    decode_s: float
    verify_token_cost: float
    draft_tail_s: float
    draft_client_s: float
    head_client_s: float
    draft_cost: float

    def step_s(self, kind: str, k: int, scenario: Scenario) -> float:
        kind = step_kind(kind)
        head = self.head_client_s if scenario.head == Placement.CLIENT else 0.0
        if kind == StepKind.DECODE:
            return self.decode_s + head
        if kind == StepKind.VERIFY:
            return self.decode_s * (1 + self.verify_token_cost * k) + head
        if kind == StepKind.DRAFT:
            return (self.draft_client_s if scenario.placement == Placement.CLIENT
                    else self.draft_tail_s)
        return 0.0  # feed: folded into the drafts (upstream feeds, then drafts from its rows)


def compute_model(inv: Inventory, params: ProjectionParams | None = None) -> ComputeModel:
    """Compute per step: a plain decode is n_layer x layer_s on the shards (the pipeline is
    serial for one sequence, so the shard count does not change it); a tail draft is
    draft_cost decodes; a client draft or client head reads its weights at client_bw."""
    params = params or ProjectionParams()
    ab = active_bytes(inv)
    decode = inv.config.n_layer * params.layer_s
    draft_cost = params.draft_cost if params.draft_cost is not None \
        else ab["mtp"] / ab["trunk"]
    if params.verify_token_cost is not None:
        beta = params.verify_token_cost
    else:  # whole model, RTT 0, k=2, vLLM acceptance -> the PR's 1.5x
        t2 = 1 + sum(VLLM_ACCEPTANCE)
        beta = max(0.0, (t2 / ANCHOR_SPEEDUP_K2 - 1 - 2 * draft_cost) / 2)
    return ComputeModel(decode_s=decode, verify_token_cost=beta,
                        draft_tail_s=draft_cost * decode,
                        draft_client_s=ab["mtp"] / params.client_bw,
                        head_client_s=ab["head"] / params.client_bw, draft_cost=draft_cost)
