"""Writes evidence/wan/PROJECTION.md (and projection.png) from mtplib.lab.projection.

    PYTHONPATH=$PWD python evidence/wan/projection_report.py          # from the repo root

Every number in PROJECTION.md comes from this script: the weight-less V4-Flash table is
generated into a temporary folder (header only, a few MB, a few seconds), the projection
runs at its defaults, and the trained pair's header (evidence/trained-v4) gives the wait
counts of the check against the issue's measured table. tests/test_projection.py renders
the file again and compares.
"""

from __future__ import annotations

import sys
import tempfile
from dataclasses import fields, replace
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
sys.path.insert(0, str(REPO))

from mtplib.contract.seam import seam_bytes_per_token  # noqa: E402
from mtplib.contract.types import V4_FLASH_DIMS, DType  # noqa: E402
from mtplib.lab import projection as P  # noqa: E402
from mtplib.model.fixture import sha256_header, write_fixture  # noqa: E402
from mtplib.ownership.derivation import Inventory, inventory_from_paths  # noqa: E402
from mtplib.ownership.plan import even_plan, parse_plan  # noqa: E402

COMMAND = "PYTHONPATH=$PWD python evidence/wan/projection_report.py"
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
    d = REPO / "evidence" / "trained-v4"
    return inventory_from_paths(d / "v4-trained.gguf", d / "mtp-v4-trained.gguf")


def _b(x: float) -> str:
    return f"{round(x):,}"


def _gb(x: float) -> str:
    return f"{x / 1e9:.1f}"


def _table(head: list[str], rows: list[list]) -> list[str]:
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    out += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return out + [""]


def _waits(sw: P.StepWaits) -> str:
    return f"{sw.per_seam:g} / {sw.fixed:g} / {sw.tail:g}"


#: Results of `mtplib layer-cost` (issue 24): the compute inputs measured on the V4-Flash-
#: width slice. A GPU result, when one is committed, replaces the assumption in every table.
LAYER_COST = REPO / "evidence" / "layer-cost"


def computes(folder: Path = LAYER_COST) -> list[P.ComputeInputs]:
    """The assumption, then every committed measurement (sorted by file name)."""
    return [P.ASSUMED_COMPUTE] + [P.load_compute(p) for p in sorted(folder.glob("*.json"))
                                  if p.name != "run_record.json"]  # what ran: no result


def main_compute(cs: list[P.ComputeInputs]) -> P.ComputeInputs:
    """What the tables use: a GPU measurement where there is one, else the assumption (a
    CPU figure is not what a shard of H200s computes at: it is shown beside it)."""
    return next((c for c in cs if c.name == "measured-gpu"), P.ASSUMED_COMPUTE)


def _compute_section(inv: Inventory, cs: list[P.ComputeInputs], main: P.ComputeInputs
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
         "shard's, so it is shown here, not used below)." if main is P.ASSUMED_COMPUTE
         else "."))
    w("")
    def rng(sp: dict, key: str, scale: float = 1.0, fmt: str = "{:.3f}") -> str:
        v = sp.get(key)
        return f" ({fmt.format(v[0] * scale)}-{fmt.format(v[1] * scale)})" if v else ""

    rows = []
    for c in cs:
        cm = P.compute_model(inv, c.params())
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
    L += _table(["compute", "hardware", "layer_s (p10-p90)", "one CSA/HCA layer, no head",
                 "plain decode (43 x layer_s)", "verify_token_cost", "draft_cost",
                 "steps", "source"], rows)
    w("What each gives (whole model on one machine, RTT 0, and the 2-shard even plan at "
      "RTT 0 and 50 ms; scenario draft@client, head@client; tokens/s, speed-up over MTP off):")
    w("")
    sc = P.DEFAULT_SCENARIOS[2]
    prow = []
    for c in cs:
        for plan, rtt in (("0-42", 0), (str(even_plan(inv.config.n_layer, 2)), 0),
                          (str(even_plan(inv.config.n_layer, 2)), 50)):
            rs = {r["k"]: r for r in P.project(inv, plans=[plan], rtts_ms=(rtt,),
                                               scenarios=(sc,), params=c.params())}
            prow.append([f"`{c.name}`", f"`{plan}`", rtt] + [
                f"{rs[k]['tok_s']:.2f}" + (f" ({rs[k]['speedup']:.2f}x)" if k else "")
                for k in (0, 1, 2, 3)])
    L += _table(["compute", "plan", "RTT ms", "MTP off", "k=1", "k=2", "k=3"], prow)
    w("The slice's limitations (each result file lists them): 16 routed experts, so a "
      "verify batch touches fewer distinct experts than V4-Flash's 256 would (the measured "
      "`verify_token_cost` is a lower bound); random weights; a short context; layers 4-42 "
      "taken as the CSA/HCA average.")
    w("")
    return L


def render(inv: Inventory, hashes: dict, tr: Inventory,
           compute: list[P.ComputeInputs] | None = None) -> str:
    cfg = inv.config
    cs = computes() if compute is None else compute
    main = main_compute(cs)
    prm = main.params()
    cm = P.compute_model(inv, prm)
    ab = P.active_bytes(inv)
    L: list[str] = []
    w = L.append
    w("# V4-Flash over a WAN: the projection (issue 14, item 7)")
    w("")
    w(f"Generated by `{COMMAND}` (this file and `projection.png`) from "
      "`mtplib.lab.projection` at its defaults and the weight-less V4-Flash table "
      "(`mtplib.model.fixture.write_fixture(dir, preset=\"v4-flash\")`, header sha256 "
      f"trunk `{hashes['trunk'][:16]}...`, sidecar `{hashes['sidecar'][:16]}...`). "
      "**Nothing here is a measurement of V4-Flash**: it is the issue's measured message "
      "structure applied to V4-Flash's sizes, with the assumptions named below.")
    w("")
    w("## The model")
    w("")
    w("Per step, `t_step = compute + RTT x waits + bytes / bandwidth`, where *waits* are the "
      "synchronous round trips on remote shards (the client sends and waits: GET_TENSOR in "
      "a decode) and *bytes* everything on remote client-shard links, both directions. The "
      "topology is upstream's RPC star (reference §8): a boundary value goes shard i -> "
      "client (GET, a wait) -> shard i+1 (SET, no wait), and every graph input is set from "
      "the client into each shard whose layers read it, on every step. MTP off, a token is "
      "one plain decode. MTP on with draft length k, a cycle is one verify step (k+1 tokens "
      "through the trunk) + k draft decodes + one feed of the accepted rows to the MTP "
      "context, and yields `1 + sum(acceptance[:k])` tokens (acceptance per position is "
      "unconditional, as in `mtplib.lab.bench`). tokens/s = tokens per cycle / cycle time; "
      "the speed-up compares MTP on with MTP off of the same plan, scenario and RTT. With "
      "`tail_local` the tail shard sits with the client: its waits and bytes are free.")
    w("")
    w("Scenarios: where the drafter runs (`draft@tail`: the sidecar on the tail shard, every "
      "draft a WAN decode; `draft@client`: the sidecar on the client's CPU, no WAN) and where "
      "the output head runs (`head@tail`: logits cross, 129,280 x 4 B per row, and the "
      "drafter's h_nextn rows separately; `head@client`: the tail returns its hidden rows, "
      "which are also the drafter's rows, and the client runs hc head + norm + output). "
      "Boundary values are f32 (what upstream sends today) unless a table says bf16 (the "
      "contract's).")
    w("")
    w("## Inputs and defaults")
    w("")
    rows = []
    for f in fields(P.ProjectionParams):
        v = getattr(prm, f.name)
        src = P.DEFAULT_SOURCES.get(f.name, "llama_context setting (upstream's C default "
                                    "where one exists)")
        if main is not P.ASSUMED_COMPUTE and f.name in ("layer_s", "verify_token_cost",
                                                        "draft_cost"):
            src = f"{main.source}, on {main.hardware}"
        if f.name == "layer_s":
            v = f"{v * 1e3:.3f} ms"
        elif f.name == "bandwidth_bps":
            v = f"{v / 1e9:g} Gbit/s"
        elif f.name == "client_bw":
            v = f"{v / 1e9:g} GB/s"
        rows.append([f"`{f.name}`", v, src])
    rows.append(["capacity", f"{P.H200_BYTES:,} B", P.DEFAULT_SOURCES["capacity"]])
    rows.append(["reserve", f"{8 * 2**30:,} B", P.DEFAULT_SOURCES["reserve"]])
    L += _table(["parameter", "default", "source"], rows)
    w("Derived from the V4-Flash table by `active_bytes` / `compute_model` (memory-bound "
      "view: routed experts read 6 of 256, an embedding one row):")
    w("")
    L += _table(["quantity", "value"], [
        ["weights one trunk token reads", f"{_b(ab['trunk'])} B"],
        ["weights one MTP draft reads (block 43 + its hc head + norm + output head)",
         f"{_b(ab['mtp'])} B"],
        ["weights the output head reads (hc head + norm + output)", f"{_b(ab['head'])} B"],
        ["plain decode compute (43 x layer_s)", f"{cm.decode_s * 1e3:.1f} ms"],
        ["draft on the tail (draft_cost x decode; draft_cost = MTP / trunk bytes)",
         f"{cm.draft_tail_s * 1e3:.2f} ms ({cm.draft_cost:.4f})"],
        ["verify step, each extra token (verify_token_cost, calibrated)",
         f"+{cm.verify_token_cost:.4f} of a decode"],
        ["draft on the client CPU (MTP bytes / client_bw)", f"{cm.draft_client_s * 1e3:.1f} ms"],
        ["output head on the client CPU per step (head bytes / client_bw)",
         f"{cm.head_client_s * 1e3:.1f} ms"],
    ])
    L += _compute_section(inv, cs, main)
    w("The message structure (`MessageStructure`; waits per step as per-seam / fixed / tail, "
      "see its docstring; `MessageStructure.from_run` reads a WAN run's per-shard counts):")
    w("")
    srows = []
    for name, s in P.STRUCTURES.items():
        srows.append([f"`{name}`", _waits(s.plain), _waits(s.verify_head_tail),
                      _waits(s.verify_head_client), _waits(s.draft_on_tail), s.seam_tensors,
                      s.source])
    L += _table(["structure", "plain", "verify, head@tail", "verify, head@client",
                 "draft on tail", "seam tensors", "source"], srows)
    w("The projection uses `measured`. Its plain decode gives the issue's 3 waits per token "
      "on 2 shards: 2 on shard 0, the GETs of the seam's two hc*n_embd tensors, and 1 on the "
      "tail, the logits. The message model (graph inputs per shard from upstream's graph "
      "builders, one SET each; two seam tensors, each a GET from the upstream shard and a "
      "SET into the next) reproduces the issue's per-command counts on the trained pair "
      f"(a plain decode, plan `0-1,2-3`, context {TRAINED_CONTEXT} tokens, f32 boundary, "
      "flash attention), so shard 0's two waits are both seam values and `measured` counts "
      "2 per seam; that a middle shard of a 3+ shard plan behaves the same is the "
      "assumption the WAN benchmark's 3-shard counts can check:")
    w("")
    st = P.step_traffic(tr.config, parse_plan("0-1,2-3", tr.config.n_layer), "plain",
                        scenario=P.Scenario(placement="tail", head="tail"),
                        params=P.ProjectionParams(context=TRAINED_CONTEXT, n_ctx=2048))
    crow = []
    for i, (sets, gets, data) in enumerate(ISSUE_COUNTS):
        crow.append([i, st.sets[i], sets, f"{st.waits[i]:g}", gets,
                     _b(sum(st.bytes[i].values())), data,
                     _b(st.detail[i].get("attn_inp_k_rot(lid)", 0))])
    L += _table(["shard", "SETs model", "SETs issue", "GETs (waits) model", "GETs issue",
                 "data bytes model", "data bytes issue", "of which k_rot"], crow)
    w("(The data bytes are tensor contents in both directions; the issue gives shard 0's "
      "only. Any context up to 256 tokens gives the same numbers: every mask is 256 wide.)")
    w("")

    # -- 1. traffic --------------------------------------------------------------------
    w("## 1. What crosses per step")
    w("")
    side = P.hadamard_side(cfg.indexer_dim)
    rot_q = P.rotation_constants(cfg, "q8_0")
    every = all(r.has_csa for _, p in P.plans_for(inv, range(2, 9))
                for r in P.shard_roles(cfg, p))
    w(f"**The indexer's rotation matrix.** Upstream (src/llama-kv-cache.cpp, "
      "`build_input_k_rot`) sizes `attn_inp_k_rot` as the largest power of two dividing the "
      "cache's head size (doubling from 128; 64 when 128 does not divide it) and re-uploads "
      "it from host memory on every graph; it is always on for the DeepSeek lightning "
      f"indexer, whose head size is the indexer key length, {cfg.indexer_dim} on V4-Flash: "
      f"a {side} x {side} F32 matrix, **{_b(side * side * 4)} B per step on every shard that "
      "holds a ratio-4 (CSA) layer** ("
      + ("every shard of every plan of 2-8 shards below" if every else
         "not every shard of the plans below holds one") + "). With a quantized K "
      f"cache (`type_k=q8_0`) the raw, CSA and HCA caches (head size {cfg.head_dim}) get "
      f"one each too: {P.hadamard_side(cfg.head_dim)} x {P.hadamard_side(cfg.head_dim)} F32 "
      f"= {_b(rot_q['raw'])} B per cache kind per shard per step.")
    w("")
    H = 4 * cfg.n_embd
    contract_min = seam_bytes_per_token(V4_FLASH_DIMS, DType.BF16)["decode_token"]
    w(f"**What the sampler needs.** Per verified row: logits {cfg.n_vocab:,} x 4 B = "
      f"{_b(cfg.n_vocab * 4)} B (F32) with the head on the tail, plus the drafter's h_nextn "
      f"row ({_b(H * 4)} B, F32); with the head in the client, one hidden row: "
      f"{_b(H * 2)} B in bf16 ({_b(H * 4)} B in f32), which is also the drafter's row. The "
      f"contract's minimum per seam and token: {_b(contract_min)} B "
      f"in bf16 (hidden row + position + token id).")
    w("")
    w("**Masks.** The raw SWA mask is n_kv x n_tokens (no padding of n_tokens at the pin), "
      "n_kv = min(cells, max(256, PAD(context, 256))): with `swa_full` (upstream's C "
      "default) the raw cache has n_ctx cells, so this mask grows with the context although "
      f"the window is {cfg.sliding_window}; without it the cache has PAD(min(n_ctx, n_swa + "
      "n_ubatch), 256) = 768 cells. The CSA and indexer masks are PAD(context/4, 256) wide, "
      "the HCA mask PAD(context/128, 256) (`dsv4_build_comp_plan`); F16 with flash attention "
      "and the fused indexer (both on where the device supports them).")
    w("")
    w("Per step, summed over all shard connections (scenario draft@tail, head@tail, f32 "
      "boundary; structure `measured`; verify k=2 = 3 tokens):")
    w("")
    trows = []
    plans = [str(even_plan(cfg.n_layer, n)) for n in TABLE_SHARDS]
    for swa_full in (True, False):
        tp = P.ProjectionParams(swa_full=swa_full)
        for r in P.traffic_rows(inv, plans, params=tp,
                                contexts=(4096, 32768, 131072) if swa_full else (131072,)):
            trows.append([r["n_shards"], r["context"], "yes" if swa_full else "no", r["step"],
                          f"{r['waits']:g}", _b(r["bytes_seam"]), _b(r["bytes_graph_inputs"]),
                          _b(r["mask_bytes_per_step"]), _b(r["bytes_constants"]),
                          _b(r["bytes_output"]), _b(r["bytes_mtp_rows"]), _b(r["bytes_total"])])
    L += _table(["shards", "context", "swa_full", "step", "waits", "seam B", "graph inputs B",
                 "of which masks B", "constants (k_rot) B", "output (logits) B",
                 "h_nextn rows B", "total B"], trows)
    draft = P.step_traffic(cfg, even_plan(cfg.n_layer, 2), "draft", k=1,
                           scenario=P.Scenario(placement="tail", head="tail"))
    w("Seam bytes count each boundary tensor twice (GET from the upstream shard, SET into the "
      "next). A tail draft decode adds, per draft: "
      f"{_b(sum(draft.total().values()))} B "
      "(its inputs, its logits and its own h_nextn row) and 2 waits; a client drafter none.")
    w("")

    # -- 2. fit -------------------------------------------------------------------------
    w("## 2. Which plans fit one H200 per shard")
    w("")
    w("Largest shard: weights (its tensors; the tail holds the output head and the whole "
      "sidecar, with its copies of token_embd and output) + caches (`ownership.derive`, "
      "swa_full, n_rs_seq 3 for MTP rollback) + 8 GiB reserve, against 141 GB. The first "
      "shard's weights include token_embd (1.06 GB), which upstream keeps in host memory.")
    w("")
    frows, fits = [], {}
    fplans = [("whole", "0-42")] + [(k, str(p)) for k, p in P.plans_for(inv, range(2, 9))]
    for kind, p in fplans:
        for r in P.fit_rows(inv, [p]):
            fits.setdefault(r["n_shards"] > 1, []).append(r["fits"])
            frows.append([r["n_shards"], kind, f"`{r['plan']}`", r["n_ctx"],
                          r["largest_shard"], _gb(r["weights_bytes"]), _gb(r["cache_bytes"]),
                          _gb(r["need_bytes"]), _gb(r["headroom_bytes"]),
                          "**yes**" if r["fits"] else "**no**"])
    L += _table(["shards", "plan kind", "plan", "n_ctx", "largest shard", "weights GB",
                 "caches GB", "need GB", "headroom GB", "fits"], frows)
    w("The whole model " + ("does not fit" if not any(fits[False]) else "fits")
      + " one H200 at these contexts; "
      + ("every plan of 2 to 8 shards fits" if all(fits[True]) else
         "not every plan of 2 to 8 shards fits") + ", at 32k and at 128k. "
      "`params/v4-flash-h200.yaml` therefore asks for two H200s and runs upstream's layer "
      "split over them (the ranges of plan `0-21,22-42`).")
    w("")

    # -- 3. projection ------------------------------------------------------------------
    w("## 3. Projected tokens/s against RTT")
    w("")
    w(f"Even plans, context {prm.context:,} tokens (n_ctx {prm.n_ctx:,}, swa_full), "
      f"bandwidth {prm.bandwidth_bps / 1e9:g} Gbit/s, every shard remote, structure "
      "`measured`, acceptance "
      f"{', '.join(f'{a:g}' for a in prm.acceptance)}. Cells: tokens/s (speed-up over MTP off).")
    w("")
    rows_all = P.project(inv, n_shards=TABLE_SHARDS, plan_kinds=("even",), rtts_ms=RTTS,
                         params=prm)
    for sc in P.DEFAULT_SCENARIOS:
        w(f"**{sc.name}**")
        w("")
        prow = []
        for n in TABLE_SHARDS:
            for rtt in RTTS:
                sel = {r["k"]: r for r in rows_all if r["n_shards"] == n and r["rtt_ms"] == rtt
                       and r["scenario"] == sc.name}
                prow.append([n, rtt] + [f"{sel[k]['tok_s']:.2f}" + (
                    f" ({sel[k]['speedup']:.2f}x)" if k else "") for k in (0, 1, 2, 3)]
                    + [f"{sel[0]['waits_per_token']:g} / {sel[2]['waits_per_token']:.2f}"])
        L += _table(["shards", "RTT ms", "MTP off", "k=1", "k=2", "k=3",
                     "waits per token off / k=2"], prow)
    once_sc = P.Scenario(placement="client", head="client")
    w(f"**{once_sc.name}, structure `seam_once`** (patches/0002-0004 as measured on the "
      "trained pair, evidence/upstream-patches/README.md: one wait per shard and step, one "
      "boundary tensor per seam, no rotation matrix per step); last column: tokens/s with "
      "MTP on (k=2) over the same cell under `measured`:")
    w("")
    once = P.project(inv, n_shards=TABLE_SHARDS, plan_kinds=("even",), rtts_ms=RTTS,
                     scenarios=(once_sc,), structure=P.SEAM_ONCE)
    orow = []
    for n in TABLE_SHARDS:
        for rtt in RTTS:
            sel = {r["k"]: r for r in once if r["n_shards"] == n and r["rtt_ms"] == rtt}
            base = next(r for r in rows_all if r["n_shards"] == n and r["rtt_ms"] == rtt
                        and r["scenario"] == once_sc.name and r["k"] == 2)
            orow.append([n, rtt] + [f"{sel[k]['tok_s']:.2f}" + (
                f" ({sel[k]['speedup']:.2f}x)" if k else "") for k in (0, 1, 2, 3)]
                + [f"{sel[0]['waits_per_token']:g} / {sel[2]['waits_per_token']:.2f}",
                   f"{sel[2]['tok_s'] / base['tok_s']:.2f}x"])
    L += _table(["shards", "RTT ms", "MTP off", "k=1", "k=2", "k=3",
                 "waits per token off / k=2", "k=2 over `measured`"], orow)
    w("**The RTT-bound limit.** As RTT grows the speed-up tends to tokens-per-verify x "
      "(waits per plain token) / (waits per cycle). Per scenario and shard count, k=2 "
      f"(tokens per verify {prm.tokens_per_verify(2):.2f}):")
    w("")
    lrows = []
    for sc in P.DEFAULT_SCENARIOS + (P.Scenario(placement="client", head="client",
                                                tail_local=True),):
        for n in TABLE_SHARDS:
            plan = even_plan(cfg.n_layer, n)
            c0 = P.cycle(inv, plan, 0, sc, P.MEASURED, prm, cm)
            c2 = P.cycle(inv, plan, 2, sc, P.MEASURED, prm, cm)
            lim = c2["tokens"] * c0["waits"] / c2["waits"]
            far = P.project(inv, plans=[plan], ks=(2,), rtts_ms=(1e6,), scenarios=(sc,),
                            params=prm)[0]
            lrows.append([sc.name, n, f"{c0['waits']:g}", f"{c2['waits']:g}", f"{lim:.3f}",
                          f"{lim / c2['tokens']:.3f}", f"{far['speedup']:.3f}"])
    L += _table(["scenario", "shards", "waits plain", "waits per k=2 cycle", "limit (x)",
                 "limit / tokens per verify", "model at RTT 1000 s"], lrows)
    w("With the head in the client a verify step costs the waits of a plain step and a "
      "client drafter costs none, so the speed-up approaches tokens per verify step. With the "
      "head on the tail the h_nextn fetch adds a wait per verify (on 2 shards 4 against 3: "
      "0.75 of the ideal, the issue's cap); a tail drafter adds 2 per draft.")
    w("")
    w("![projection](projection.png)")
    w("")

    # -- 4. check ------------------------------------------------------------------------
    w("## 4. Check against the issue's measured table (trained pair)")
    w("")
    w("The same wait counting on the trained pair (`evidence/trained-v4`, plan `0-1,2-3`, "
      "k=2, drafter and head on the tail, structure `today`: verify = 3 GETs on shard 0 and "
      "4 on shard 1 as counted in the issue), with the compute taken from the issue's "
      f"loopback run ({ISSUE_LOOPBACK[0]:g} tok/s off, {ISSUE_LOOPBACK[1]:g} tok/s on, "
      f"{ISSUE_TOKENS_PER_VERIFY:.2f} tokens per verify step) and loopback bytes counted in "
      "that time: t = t_loopback + RTT x waits on remote shards.")
    w("")
    crows, d_off, d_on, extra = [], [], [], []
    plan = "0-1,2-3"
    tp = tr.config
    tcm = P.compute_model(tr, prm)
    for rtt, local, off_meas, on_meas in ISSUE_MEASURED:
        sc = P.Scenario(placement="tail", head="tail", tail_local=local)
        pl = parse_plan(plan, tp.n_layer)
        w0 = P.cycle(tr, pl, 0, sc, P.TODAY, prm, tcm)["waits"]
        w2 = P.cycle(tr, pl, 2, sc, P.TODAY, prm, tcm)["waits"]
        off = 1 / (1 / ISSUE_LOOPBACK[0] + rtt / 1e3 * w0)
        cyc = ISSUE_TOKENS_PER_VERIFY / ISSUE_LOOPBACK[1]
        on = ISSUE_TOKENS_PER_VERIFY / (cyc + rtt / 1e3 * w2)
        d_off.append(abs(off / off_meas - 1) * 100)
        d_on.append((on / on_meas - 1) * 100)
        extra.append((ISSUE_TOKENS_PER_VERIFY / on_meas - cyc) / (rtt / 1e3) - w2)
        crows.append([rtt, "tail local" if local else "all remote", f"{w0:g}", f"{w2:g}",
                      f"{off:.2f}", f"{off_meas:.2f}", f"{(off / off_meas - 1) * 100:+.0f}%",
                      f"{on:.2f}", f"{on_meas:.2f}", f"{(on / on_meas - 1) * 100:+.0f}%"])
    L += _table(["RTT ms", "topology", "waits off", "waits per k=2 cycle", "off model",
                 "off measured", "diff", "on model", "on measured", "diff"], crows)
    w(f"MTP off is within {max(d_off):.0f}%; MTP on is {min(d_on):.0f}-{max(d_on):.0f}% "
      f"optimistic: the measured runs wait {min(extra):.1f}-{max(extra):.1f} more times per "
      "cycle than counted (the issue counts \"about\" 2 GETs per draft, and a generation "
      "has some plain and rollback steps besides its verify cycles).")
    w("")
    L += _graph_section(inv, tr, prm)
    w("## Limitations")
    w("")
    if main is P.ASSUMED_COMPUTE:
        w("- Compute is an assumption anchored to one published number of unknown hardware "
          "(16.4 tok/s); a verify step's cost is calibrated to the PR's 1.5x with vLLM's "
          "acceptance, a draft's from weight bytes. On an H200 the weights one token reads "
          f"({_gb(ab['trunk'])} GB) take {ab['trunk'] / 4.8e12 * 1e3:.1f} ms at its 4.8 "
          "TB/s, so GPU compute may be far below the default and the RTT terms dominate "
          "sooner. The slice's CPU measurement (above) replaces it only once it is an "
          "H200's (`evidence/DGR-066/DEVICE.md`).")
    else:
        w(f"- Compute is measured on the V4-Flash-width slice on {main.hardware} "
          "(section 'Compute'), with the slice's limitations.")
    w("- The structure is the trained pair's, on 2 shards, counted per RPC command; how "
      "waits scale with more shards is an assumption (`measured`: 2 per seam) until the WAN "
      "benchmark counts 3-shard plans; plug its counts in with `MessageStructure.from_run`.")
    w("- Graph descriptions and RPC control bytes are not in sections 1-4 (their structures "
      "count none); section 5 adds them, measured on the trained pair and a 6-layer "
      "fixture, the control bytes' growth with layers an estimate from two points. "
      "Cache/state bytes are taken as 0 (issue item 4's target), which today holds only "
      "with n_rs_seq = 0.")
    w("- Bandwidth is one link rate for all of a step's bytes, its shard passes taken one "
      "after another (no transfer overlaps compute or another transfer); the client's CPU "
      "bandwidth for a client head or drafter is an assumption (50 GB/s).")
    w("- Fit: the compute-buffer reserve (8 GiB) is an assumption, not an allocation; the "
      "caches are `ownership.derive`'s formulas, checked against upstream on fixtures "
      "(DGR-065), not allocated at V4-Flash size.")
    w("")
    return "\n".join(L)


#: the link bandwidths of section 5 (Mbit/s per direction) and its RTTs
LINK_MBITS = (20, 100, 1000)
GRAPH_RTTS = (25, 100)


def _graph_section(inv: Inventory, tr: Inventory, prm: P.ProjectionParams) -> list[str]:
    """Section 5: graph and control bytes per shard pass, and the link bandwidth."""
    L = ["## 5. Graph and control bytes, and the link bandwidth (issue 29)", ""]
    w = L.append
    w("Sections 1-4 count no graph descriptions or RPC control bytes. Measured (the relays' "
      "byte counts per step, trained pair, plan `0-1,2-3`, k=2, drafter in the client, CPU "
      "RPC shards; evidence/graph-reuse/): with patches 0001-0004 every verify step sends "
      "each shard's whole graph (`GRAPH_COMPUTE`, its split uids alternate), "
      f"{P.GRAPH_BYTES_WHOLE_VERIFY_TRAINED:,} B on both shards, about "
      f"{P.GRAPH_BYTES_PER_LAYER_WHOLE / 1e3:.0f} KB per layer; with 0005+0006 (graph slots) "
      f"a shard pass sends {P.GRAPH_BYTES_SLOT_PER_PASS:g} B (a `GRAPH_RECOMPUTE_SLOT`) once "
      "each width has been seen, as an MTP-off decode reuses its graph with either. Control "
      f"bytes per verify step: {P.CONTROL_BYTES_VERIFY_4_LAYERS:,} B on the trained pair (4 "
      f"layers) and {P.CONTROL_BYTES_VERIFY_6_LAYERS:,} B on a 6-layer fixture with "
      "V4-Flash's layer kinds (plan `0-2,3-5`), both on 2 shards; a plain decode (MTP off) "
      f"{P.CONTROL_BYTES_PLAIN_4_LAYERS:,} B on the trained pair.")
    w("")
    w("How control grows with layers is an **estimate from these two points (4 and 6 "
      "layers)**: "
      f"{P.CONTROL_BYTES_PER_LAYER_VERIFY:,.0f} B per verify step per layer, taken per layer "
      f"a shard holds, plus {P.CONTROL_BYTES_PER_PASS_VERIFY:g} B per shard pass (on these "
      f"2-shard plans that is {P.CONTROL_BYTES_VERIFY_4_LAYERS / 4 / 2:,.0f} B per layer of "
      "the model per shard pass; the two points cannot tell the readings apart, which "
      "differ on more shards: a shard's control messages are for its own layers' inputs, so "
      "the model takes the per-layer-held one); a plain decode's control is a verify step's "
      f"x {P.CONTROL_PLAIN_OVER_VERIFY:.3f} (the trained pair's ratio). The graph bytes per "
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
        for name, st in P.GRAPH_STRUCTURES.items():
            for kind, k in (("plain", 0), ("verify", 2)):
                t = P.step_traffic(inv.config, plan, kind, k=k, structure=st, params=prm,
                                   scenario=P.Scenario(placement="client", head="client"))
                tot = t.total()
                label = "plain decode" if kind == "plain" else "verify k=2"
                brows.append([n, f"`{name}`", label, _b(tot["graph"]), _b(tot["control"]),
                              _b(sum(tot.values()))])
    L += _table(["shards", "structure", "step", "graph B", "control B", "total B"], brows)
    tp = parse_plan("0-1,2-3", tr.config.n_layer)
    chk = {name: {kind: P.step_traffic(tr.config, tp, kind, k=2, structure=st, params=prm,
                                       scenario=P.Scenario(placement="client",
                                                           head="client")).total()
                  for kind in ("plain", "verify")}
           for name, st in P.GRAPH_STRUCTURES.items()}
    w("On the trained pair (plan `0-1,2-3`) the same counting gives per verify step "
      f"{_b(chk['whole_graph']['verify']['graph'])} B of graph with `whole_graph`, "
      f"{_b(chk['graph_slots']['verify']['graph'])} B with `graph_slots`, "
      f"{_b(chk['graph_slots']['verify']['control'])} B of control, and "
      f"{_b(chk['graph_slots']['plain']['control'])} B of control per plain decode: the "
      "measured inputs.")
    w("")
    sc = P.Scenario(placement="client", head="client")
    w(f"Projected tokens/s, {sc.name}, every shard remote, even plans, k=2: cells are MTP off "
      "/ MTP on tok/s (speed-up), at each link bandwidth per direction:")
    w("")
    res = {}
    for mbit in LINK_MBITS:
        bp = replace(prm, bandwidth_bps=mbit * 1e6)
        for name, st in {"seam_once": P.SEAM_ONCE, **P.GRAPH_STRUCTURES}.items():
            for r in P.project(inv, n_shards=TABLE_SHARDS, plan_kinds=("even",), ks=(0, 2),
                               rtts_ms=GRAPH_RTTS, scenarios=(sc,), structure=st, params=bp):
                res[(mbit, name, r["n_shards"], r["rtt_ms"], r["k"])] = r
    prow = []
    for n in TABLE_SHARDS:
        for rtt in GRAPH_RTTS:
            for name in ("seam_once", *P.GRAPH_STRUCTURES):
                cells = []
                for mbit in LINK_MBITS:
                    off, on = (res[(mbit, name, n, float(rtt), k)] for k in (0, 2))
                    cells.append(f"{off['tok_s']:.2f} / {on['tok_s']:.2f} "
                                 f"({on['speedup']:.2f}x)")
                on1 = res[(LINK_MBITS[0], name, n, float(rtt), 2)]
                prow.append([n, rtt, f"`{name}`", *cells,
                             _b(on1["bytes_per_token"])])
    L += _table(["shards", "RTT ms", "structure",
                 *(f"{m:g} Mbit/s" for m in LINK_MBITS), "bytes per token, k=2"], prow)
    whole = P.step_traffic(inv.config, even_plan(inv.config.n_layer, 2), "verify", k=2,
                           structure=P.WHOLE_GRAPH, params=prm, scenario=sc).total()["graph"]
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


def plot(inv: Inventory, path: Path, params: P.ProjectionParams | None = None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = P.project(inv, n_shards=(2, 8), plan_kinds=("even",), params=params)
    sc = P.DEFAULT_SCENARIOS[2].name
    fig, axes = plt.subplots(2, 2, figsize=(14, 8), constrained_layout=True)
    for col, n in enumerate((2, 8)):
        plan = str(even_plan(inv.config.n_layer, n))
        P.plot_projection(rows, axes[0][col], plan=plan, scenario=sc)
        P.plot_projection(rows, axes[1][col], plan=plan, scenario=sc, metric="speedup")
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        inv, hashes = v4_flash(Path(tmp))
        text = render(inv, hashes, trained())
        (HERE / "PROJECTION.md").write_text(text)
        plot(inv, HERE / "projection.png", main_compute(computes()).params())
    print(f"wrote {HERE / 'PROJECTION.md'} and {HERE / 'projection.png'}")


if __name__ == "__main__":
    main()
