"""The projection's tables (`mtplib.lab.projection`): plans per shard count (`plans_for`),
one generation cycle's cost (`cycle`), decode speed over plans, scenarios, draft lengths
and RTTs (`project`), and the traffic per plan and context (`traffic_rows`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import replace

from mtplib.contract.labels import StepKind
from mtplib.contract.seam import seam_bytes_per_token
from mtplib.contract.types import DType, ModelDims
from mtplib.errors import InputError
from mtplib.lab.projection.compute import ComputeModel, compute_model
from mtplib.lab.projection.constants import itemsize
from mtplib.lab.projection.params import DEFAULT_SCENARIOS, ProjectionParams, Scenario
from mtplib.lab.projection.structure import GRAPH_STRUCTURES, MEASURED, STRUCTURES, MessageStructure
from mtplib.lab.projection.traffic import CLASSES, remote_shards, step_traffic
from mtplib.model.arch import HC
from mtplib.ownership.derivation import Inventory, balanced_plan
from mtplib.ownership.plan import ShardPlan, even_plan, parse_plan


def plans_for(inv: Inventory, n_shards: Iterable[int],
              kinds: Sequence[str] = ("even", "balanced")) -> list[tuple[str, ShardPlan]]:
    """(kind, plan) for every shard count: even layer counts (`even_plan`) and byte-balanced
    ranges (`balanced_plan`); a kind that gives the same ranges as an earlier one is kept
    (both rows say so) so tables stay rectangular."""
    out = []
    for n in n_shards:
        for kind in kinds:
            if kind == "even":
                out.append((kind, even_plan(inv.config.n_layer, n)))
            elif kind == "balanced":
                out.append((kind, balanced_plan(inv, n)))
            else:
                raise InputError(f"plan kind must be 'even' or 'balanced', got {kind!r}")
    return out


# -- the projection ------------------------------------------------------------------------
def cycle(inv: Inventory, plan: ShardPlan, k: int, scenario: Scenario,
          structure: MessageStructure, params: ProjectionParams, cm: ComputeModel
          ) -> dict:
    """One generation cycle at RTT 0: MTP off, a plain decode (1 token); MTP on, one verify
    step + k drafts + one feed (1 + sum(acceptance[:k]) tokens). Returns compute seconds,
    waits and bytes by class on remote links, all per cycle."""
    cfg = inv.config
    if k == 0:
        steps = [(step_traffic(cfg, plan, StepKind.DECODE, scenario=scenario,
                               structure=structure, params=params), 1,
                  cm.step_s(StepKind.DECODE, 0, scenario))]
        tokens = 1.0
    else:
        tokens = params.tokens_per_verify(k)
        kw = {"k": k, "scenario": scenario, "structure": structure, "params": params}
        steps = [(step_traffic(cfg, plan, StepKind.VERIFY, **kw), 1,
                  cm.step_s(StepKind.VERIFY, k, scenario)),
                 (step_traffic(cfg, plan, StepKind.DRAFT, **kw), k,
                  cm.step_s(StepKind.DRAFT, k, scenario)),
                 (step_traffic(cfg, plan, "feed", tokens_fed=tokens, **kw), 1, 0.0)]
    remote = remote_shards(plan, scenario)
    waits, compute = 0.0, 0.0
    by_class = dict.fromkeys(CLASSES, 0)
    for st, times, comp in steps:
        compute += comp * times
        waits += sum(st.waits[i] for i in remote) * times
        for c, v in st.total(remote).items():
            by_class[c] += v * times
    return {"tokens": tokens, "compute_s": compute, "waits": waits, "bytes": by_class}


def project(inv: Inventory, *, n_shards: Iterable[int] = range(2, 9),
            plan_kinds: Sequence[str] = ("even", "balanced"),
            plans: Sequence[str | ShardPlan] | None = None,
            ks: Sequence[int] = (0, 1, 2, 3),
            rtts_ms: Sequence[float] = tuple(range(0, 201, 10)),
            scenarios: Sequence[Scenario] = DEFAULT_SCENARIOS,
            structure: MessageStructure = MEASURED,
            params: ProjectionParams | None = None) -> list[dict]:
    """Projected decode speed of V4-Flash (or any inventory) over a WAN, one row per (plan,
    scenario, k, RTT): tokens/s, the speed-up over MTP off of the same plan, scenario and
    RTT, the RTT-bound ideal (tokens per verify step), and per generated token: waits,
    bytes on remote links by class, compute. ``plans`` (strings or ShardPlans) replaces
    the even/balanced plans of ``n_shards``. DataFrame-ready."""
    params = params or ProjectionParams()
    if not ks or any(isinstance(k, bool) or not isinstance(k, int) or k < 0 for k in ks):
        raise InputError(f"ks must be draft lengths >= 0 (0 = MTP off), got {list(ks)}")
    for k in ks:
        params.tokens_per_verify(k)
    if not rtts_ms or any(isinstance(r, bool) or not isinstance(r, int | float) or r < 0
                          or r != r for r in rtts_ms):
        raise InputError(f"rtts_ms must be numbers >= 0, got {list(rtts_ms)}")
    if not scenarios or not all(isinstance(s, Scenario) for s in scenarios):
        raise InputError("scenarios must be a non-empty list of Scenario")
    if not isinstance(structure, MessageStructure):
        raise InputError("structure must be a MessageStructure")
    if plans is not None:
        chosen = [("given", parse_plan(p, inv.config.n_layer) if isinstance(p, str) else p)
                  for p in plans]
    else:
        chosen = plans_for(inv, n_shards, plan_kinds)
    cm = compute_model(inv, params)
    bw = params.bandwidth_bps / 8
    rows = []
    for kind, plan in chosen:
        for sc in scenarios:
            cycles = {k: cycle(inv, plan, k, sc, structure, params, cm)
                      for k in sorted(set(ks) | {0})}
            for rtt in rtts_ms:
                rtt_s = rtt / 1000

                def t_token(c: dict, rtt_s: float = rtt_s) -> float:
                    return (c["compute_s"] + rtt_s * c["waits"]
                            + sum(c["bytes"].values()) / bw) / c["tokens"]

                off = t_token(cycles[0])
                for k in ks:
                    c = cycles[k]
                    t = t_token(c)
                    rows.append({
                        "plan": str(plan), "plan_kind": kind, "n_shards": plan.n_shards,
                        "scenario": sc.name, "placement": sc.placement, "head": sc.head,
                        "tail_local": sc.tail_local, "boundary_dtype": sc.boundary_dtype,
                        "structure": next((n for n, s in {**STRUCTURES,
                                                          **GRAPH_STRUCTURES}.items()
                                           if s == structure), "custom"),
                        "k": k, "mode": "mtp" if k else "off", "rtt_ms": float(rtt),
                        "context": params.context, "tokens_per_verify": c["tokens"],
                        "waits_per_token": c["waits"] / c["tokens"],
                        "bytes_per_token": sum(c["bytes"].values()) / c["tokens"],
                        **{f"bytes_{cl}_per_token": v / c["tokens"]
                           for cl, v in c["bytes"].items()},
                        "compute_s_per_token": c["compute_s"] / c["tokens"],
                        "t_token_s": t, "tok_s": 1.0 / t, "speedup": off / t,
                        "speedup_over_ideal": off / t / c["tokens"],
                    })
    return rows


def traffic_rows(inv: Inventory, plans: Sequence[str | ShardPlan], *,
                 ks: Sequence[int] = (0, 2), contexts: Sequence[int] = (4096, 32768, 131072),
                 scenario: Scenario | None = None, structure: MessageStructure = MEASURED,
                 params: ProjectionParams | None = None) -> list[dict]:
    """Per plan, step kind and context: waits and bytes by class summed over all shard
    connections (k=0: a plain decode; k>0: one verify step of k+1 tokens), bytes per seam
    (f32 and bf16 boundary rows) and the contract's minimum per seam and token."""
    scenario = scenario or Scenario(placement="tail", head="tail")
    params = params or ProjectionParams()
    cfg = inv.config
    dims = ModelDims(n_embd=cfg.n_embd, n_vocab=cfg.n_vocab)
    rows = []
    for p in plans:
        plan = parse_plan(p, cfg.n_layer) if isinstance(p, str) else p
        for L in contexts:
            prm = replace(params, context=L, n_ctx=max(params.n_ctx, L))
            for k in ks:
                kind = StepKind.VERIFY if k else StepKind.DECODE
                st = step_traffic(cfg, plan, kind, k=k, scenario=scenario,
                                  structure=structure, params=prm)
                tot = st.total()
                row = {"plan": str(plan), "n_shards": plan.n_shards, "context": L,
                       "step": f"verify k={k}" if k else "plain decode", "tokens": st.n_tok,
                       "waits": sum(st.waits), "waits_per_shard": st.waits,
                       **{f"bytes_{c}": v for c, v in tot.items()},
                       "bytes_total": sum(tot.values())}
                for dt in ("bf16", "f32"):
                    row[f"seam_bytes_per_seam_{dt}"] = (
                        structure.seam_tensors * HC * cfg.n_embd * itemsize(dt) * st.n_tok * 2)
                row["contract_min_per_seam_bf16"] = seam_bytes_per_token(
                    dims, DType.BF16)["decode_token" if not k else f"verify_k{k}"]
                row["k_rot_bytes_per_step"] = sum(
                    v for d in st.detail for n_, v in d.items() if n_.startswith("attn_inp_k_rot"))
                row["mask_bytes_per_step"] = sum(
                    v for d in st.detail for n_, v in d.items() if n_.endswith("kq_mask"))
                rows.append(row)
    return rows
