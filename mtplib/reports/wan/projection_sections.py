"""Two sections of the projection page (`mtplib.reports.wan.projection`): the compute
inputs measured on the V4-Flash-width slice beside the assumption, and section 5, graph and
control bytes per shard pass against the link bandwidth (issue 29)."""

from __future__ import annotations

from dataclasses import replace

from mtplib.lab.projection.compute import compute_model
from mtplib.lab.projection.compute_inputs import ASSUMED_COMPUTE, ComputeInputs
from mtplib.lab.projection.constants import (
    CONTROL_BYTES_PER_LAYER_VERIFY,
    CONTROL_BYTES_PER_PASS_VERIFY,
    CONTROL_BYTES_PLAIN_4_LAYERS,
    CONTROL_BYTES_VERIFY_4_LAYERS,
    CONTROL_BYTES_VERIFY_6_LAYERS,
    CONTROL_PLAIN_OVER_VERIFY,
    GRAPH_BYTES_PER_LAYER_WHOLE,
    GRAPH_BYTES_SLOT_PER_PASS,
    GRAPH_BYTES_WHOLE_VERIFY_TRAINED,
)
from mtplib.lab.projection.params import DEFAULT_SCENARIOS, ProjectionParams, Scenario
from mtplib.lab.projection.structure import GRAPH_STRUCTURES, SEAM_ONCE, WHOLE_GRAPH
from mtplib.lab.projection.sweep import project
from mtplib.lab.projection.traffic import step_traffic
from mtplib.ownership.derivation import Inventory
from mtplib.ownership.plan import even_plan, parse_plan
from mtplib.reports.wan.projection_inputs import TABLE_SHARDS, md_table
from mtplib.reports.wan.projection_inputs import fmt_bytes as _b


def compute_section(inv: Inventory, cs: list[ComputeInputs], main: ComputeInputs
                     ) -> list[str]:
    L: list[str] = []
    w = L.append
    w("## Compute: measured on the V4-Flash-width slice, beside the assumption")
    w("")
    w("`mtplib layer-cost` (`mtplib.lab.layer_cost`, issue 24) times the slice "
      "(`--preset v4-flash-slice`: V4-Flash's widths, layer kinds and dtypes in its first six "
      "layers + the MTP block, 16 routed experts of which 6 active) against its first four "
      "layers alone: one CSA + one HCA layer = the difference / 2, and V4-Flash's plain "
      "decode = the four-layer file + 39 such layers. `layer_s` = that decode / 43 (the head "
      "folded in, as in the assumption); `verify_token_cost` = each extra verified token as a "
      "fraction of a plain decode (slope over k = 1..3); `draft_cost` = one MTP draft (its "
      "block + the real 129,280-row head) over a plain decode. Spread: 10-90 % bootstrap "
      f"interval of the medians. The tables below use **{main.name}**"
      + (" (no GPU measurement is committed yet: a CPU's per-layer time is not an H200 "
         "shard's, so it is shown here, not used below)." if main is ASSUMED_COMPUTE
         else "."))
    w("")
    def rng(sp: dict, key: str, scale: float = 1.0, fmt: str = "{:.3f}") -> str:
        v = sp.get(key)
        return f" ({fmt.format(v[0] * scale)}-{fmt.format(v[1] * scale)})" if v else ""

    rows = []
    for c in cs:
        cm = compute_model(inv, c.params())
        sp = c.spread

        rows.append([
            f"`{c.name}`", c.hardware,
            f"{c.layer_s * 1e3:.3f} ms" + rng(sp, "v4_flash_decode_ms_p10_p90", 1 / 43),
            f"{sp['layer_ms']:.3f} ms" + rng(sp, "layer_ms_p10_p90") if "layer_ms" in sp
            else "-",
            f"{cm.decode_s * 1e3:.1f} ms",
            f"{cm.verify_token_cost:.4f}" + rng(sp, "verify_token_cost_p10_p90", 1, "{:.4f}")
            + ("" if c.verify_token_cost is not None else " (calibrated)"),
            f"{cm.draft_cost:.4f}" + rng(sp, "draft_cost_p10_p90", 1, "{:.4f}")
            + ("" if c.draft_cost is not None else " (from bytes)"),
            f"{c.steps}" if c.steps else "-", c.source])
    L += md_table(["compute", "hardware", "layer_s (p10-p90)", "one CSA/HCA layer, no head",
                 "plain decode (43 x layer_s)", "verify_token_cost", "draft_cost",
                 "steps", "source"], rows)
    w("What each gives (whole model on one machine, RTT 0, and the 2-shard even plan at "
      "RTT 0 and 50 ms; scenario draft@client, head@client; tokens/s, speed-up over MTP off):")
    w("")
    sc = DEFAULT_SCENARIOS[2]
    prow = []
    for c in cs:
        for plan, rtt in (("0-42", 0), (str(even_plan(inv.config.n_layer, 2)), 0),
                          (str(even_plan(inv.config.n_layer, 2)), 50)):
            rs = {r["k"]: r for r in project(inv, plans=[plan], rtts_ms=(rtt,),
                                             scenarios=(sc,), params=c.params())}
            prow.append([f"`{c.name}`", f"`{plan}`", rtt] + [
                f"{rs[k]['tok_s']:.2f}" + (f" ({rs[k]['speedup']:.2f}x)" if k else "")
                for k in (0, 1, 2, 3)])
    L += md_table(["compute", "plan", "RTT ms", "MTP off", "k=1", "k=2", "k=3"], prow)
    w("The slice's limitations (each result file lists them): 16 routed experts, so a "
      "verify batch touches fewer distinct experts than V4-Flash's 256 would (the measured "
      "`verify_token_cost` is a lower bound); random weights; a short context; layers 4-42 "
      "taken as the CSA/HCA average.")
    w("")
    return L



#: the link bandwidths of section 5 (Mbit/s per direction) and its RTTs
LINK_MBITS = (20, 100, 1000)
GRAPH_RTTS = (25, 100)


def graph_section(inv: Inventory, tr: Inventory, prm: ProjectionParams) -> list[str]:
    """Section 5: graph and control bytes per shard pass, and the link bandwidth."""
    L = ["## 5. Graph and control bytes, and the link bandwidth (issue 29)", ""]
    w = L.append
    w("Sections 1-4 count no graph descriptions or RPC control bytes. Measured (the relays' "
      "byte counts per step, trained pair, plan `0-1,2-3`, k=2, drafter in the client, CPU "
      "RPC shards; evidence/graph-reuse/): with patches 0001-0004 every verify step sends "
      "each shard's whole graph (`GRAPH_COMPUTE`, its split uids alternate), "
      f"{GRAPH_BYTES_WHOLE_VERIFY_TRAINED:,} B on both shards, about "
      f"{GRAPH_BYTES_PER_LAYER_WHOLE / 1e3:.0f} KB per layer; with 0005+0006 (graph slots) "
      f"a shard pass sends {GRAPH_BYTES_SLOT_PER_PASS:g} B (a `GRAPH_RECOMPUTE_SLOT`) once "
      "each width has been seen, as an MTP-off decode reuses its graph with either. Control "
      f"bytes per verify step: {CONTROL_BYTES_VERIFY_4_LAYERS:,} B on the trained pair (4 "
      f"layers) and {CONTROL_BYTES_VERIFY_6_LAYERS:,} B on a 6-layer fixture with "
      "V4-Flash's layer kinds (plan `0-2,3-5`), both on 2 shards; a plain decode (MTP off) "
      f"{CONTROL_BYTES_PLAIN_4_LAYERS:,} B on the trained pair.")
    w("")
    w("How control grows with layers is an **estimate from these two points (4 and 6 "
      "layers)**: "
      f"{CONTROL_BYTES_PER_LAYER_VERIFY:,.0f} B per verify step per layer, taken per layer "
      f"a shard holds, plus {CONTROL_BYTES_PER_PASS_VERIFY:g} B per shard pass (on these "
      f"2-shard plans that is {CONTROL_BYTES_VERIFY_4_LAYERS / 4 / 2:,.0f} B per layer of "
      "the model per shard pass; the two points cannot tell the readings apart, which "
      "differ on more shards: a shard's control messages are for its own layers' inputs, so "
      "the model takes the per-layer-held one); a plain decode's control is a verify step's "
      f"x {CONTROL_PLAIN_OVER_VERIFY:.3f} (the trained pair's ratio). The graph bytes per "
      "layer are the trained pair's; the slice's (`v4-flash-slice`, plan `0-2,3-5`) are "
      "about 90 KB per layer. A draft on the tail and the first send of each width "
      "(amortised over a generation) are not counted.")
    w("")
    w("Structures (`seam_once` with these bytes): `whole_graph` = patches 0001-0004, "
      "`graph_slots` = with 0005+0006. The transfer time of a step is its bytes on remote "
      "links / the link bandwidth (per direction; a step's shard passes one after another). "
      "Per step on V4-Flash's even plans, summed over all shard connections (context "
      f"{prm.context:,}):")
    w("")
    brows = []
    for n in TABLE_SHARDS:
        plan = even_plan(inv.config.n_layer, n)
        for name, st in GRAPH_STRUCTURES.items():
            for kind, k in (("plain", 0), ("verify", 2)):
                t = step_traffic(inv.config, plan, kind, k=k, structure=st, params=prm,
                                 scenario=Scenario(placement="client", head="client"))
                tot = t.total()
                label = "plain decode" if kind == "plain" else "verify k=2"
                brows.append([n, f"`{name}`", label, _b(tot["graph"]), _b(tot["control"]),
                              _b(sum(tot.values()))])
    L += md_table(["shards", "structure", "step", "graph B", "control B", "total B"], brows)
    tp = parse_plan("0-1,2-3", tr.config.n_layer)
    chk = {name: {kind: step_traffic(tr.config, tp, kind, k=2, structure=st, params=prm,
                                     scenario=Scenario(placement="client",
                                                       head="client")).total()
                  for kind in ("plain", "verify")}
           for name, st in GRAPH_STRUCTURES.items()}
    w("On the trained pair (plan `0-1,2-3`) the same counting gives per verify step "
      f"{_b(chk['whole_graph']['verify']['graph'])} B of graph with `whole_graph`, "
      f"{_b(chk['graph_slots']['verify']['graph'])} B with `graph_slots`, "
      f"{_b(chk['graph_slots']['verify']['control'])} B of control, and "
      f"{_b(chk['graph_slots']['plain']['control'])} B of control per plain decode: the "
      "measured inputs.")
    w("")
    sc = Scenario(placement="client", head="client")
    w(f"Projected tokens/s, {sc.name}, every shard remote, even plans, k=2: cells are MTP off "
      "/ MTP on tok/s (speed-up), at each link bandwidth per direction:")
    w("")
    res = {}
    for mbit in LINK_MBITS:
        bp = replace(prm, bandwidth_bps=mbit * 1e6)
        for name, st in {"seam_once": SEAM_ONCE, **GRAPH_STRUCTURES}.items():
            for r in project(inv, n_shards=TABLE_SHARDS, plan_kinds=("even",), ks=(0, 2),
                             rtts_ms=GRAPH_RTTS, scenarios=(sc,), structure=st, params=bp):
                res[(mbit, name, r["n_shards"], r["rtt_ms"], r["k"])] = r
    prow = []
    for n in TABLE_SHARDS:
        for rtt in GRAPH_RTTS:
            for name in ("seam_once", *GRAPH_STRUCTURES):
                cells = []
                for mbit in LINK_MBITS:
                    off, on = (res[(mbit, name, n, float(rtt), k)] for k in (0, 2))
                    cells.append(f"{off['tok_s']:.2f} / {on['tok_s']:.2f} "
                                 f"({on['speedup']:.2f}x)")
                on1 = res[(LINK_MBITS[0], name, n, float(rtt), 2)]
                prow.append([n, rtt, f"`{name}`", *cells,
                             _b(on1["bytes_per_token"])])
    L += md_table(["shards", "RTT ms", "structure",
                 *(f"{m:g} Mbit/s" for m in LINK_MBITS), "bytes per token, k=2"], prow)
    whole = step_traffic(inv.config, even_plan(inv.config.n_layer, 2), "verify", k=2,
                         structure=WHOLE_GRAPH, params=prm, scenario=sc).total()["graph"]
    slow = LINK_MBITS[0]
    worst = max(res[(slow, "whole_graph", n, float(rtt), 2)]["speedup"]
                for n in TABLE_SHARDS for rtt in GRAPH_RTTS)
    ctl = [r[4] for r in brows if r[1] == "`graph_slots`"]
    w(f"`seam_once` counts no graph or control bytes (sections 1-4). Re-sending the whole "
      f"graph every verify step costs V4-Flash's {inv.config.n_layer} layers "
      f"{_b(whole)} B per verify step, {whole * 8 / (slow * 1e6):.2f} s of transfer at "
      f"{slow:g} Mbit/s: there MTP " + ("loses in every cell (speed-up at most "
                                        f"{worst:.2f}x)" if worst < 1 else
                                        f"reaches {worst:.2f}x at best") + ". With graph "
      "slots the graph bytes are gone; what is left over `seam_once` are the control "
      f"bytes ({ctl[0]}-{ctl[-1]} B per step by the per-layer estimate).")
    w("")
    return L
