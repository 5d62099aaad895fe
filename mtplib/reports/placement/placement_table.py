"""Which drafter placement wins where (issue 29 item 4), from measured inputs.

Measures, on this host, over loopback shards (plan 0-1,2-3, k=2, one thread per process):

1. waits per step kind for every drafter x head placement on the trained pair (the cost
   model's wait counts, `mtplib.runtime.placement.DRAFT_WAITS_PER_TOKEN` and friends):
   one untimed warm-up generation, then one of 16 tokens, per configuration;
2. the draft cost per token that ``auto`` times at load (`routing["placement"]`), with the
   drafter in the client and on the tail, for the trained pair and the tiny fixture, on
   ``--loads`` fresh loads each (5 timed drafts per load);

then reads V4-Flash's CPU draft (block + head) from evidence/layer-cost/layer-cost-cpu.json
and tabulates the decision of `choose_placement` over RTTs, with the break-even RTT.

    python -m mtplib.reports.placement.placement_table --out evidence/placement

``--table-only`` recomputes the table from the committed measurement (no run).
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import tempfile
from pathlib import Path

from mtplib.contract.labels import Placement
from mtplib.distributed.ranged_mtp import RangedMTP
from mtplib.lab.wan.inputs import trained_prompts
from mtplib.model.fixture import write_fixture
from mtplib.model.trained import trained_paths
from mtplib.paths import EVIDENCE
from mtplib.reports import common
from mtplib.runtime import build_info
from mtplib.runtime.engine_options import EngineOptions
from mtplib.runtime.placement import PlacementInputs, break_even_rtt_s, choose_placement
from mtplib.runtime.settings import DecodeSettings

MODULE = "mtplib.reports.placement.placement_table"
PLAN = "0-1,2-3"
K = 2
SETTINGS = DecodeSettings(n_ctx=256, n_threads=1)
RTTS_MS = (0, 0.1, 1, 5, 25, 50, 100, 200)
#: V4-Flash's tail draft as a fraction of its CPU client draft: no GPU run of the slice is
#: committed, so these rows are ASSUMPTIONS, labelled as such in the table
ASSUMED_TAIL_FRACTIONS = (1.0, 0.1, 0.01)


def waits(pair, prompt) -> list[dict]:
    rows = []
    for placement in (Placement.TAIL, Placement.CLIENT):
        # the star: what the committed figures measured (the default seam then)
        with RangedMTP(str(pair.trunk), plan=PLAN, sidecar=str(pair.sidecar),
                       mtp_placement=placement, seam="star") as r:
            for head in ("upstream", "client"):
                opts = EngineOptions(k=K, settings=SETTINGS, head=head)
                r.generate(prompt, 16, opts)  # warm-up
                toks, m = r.generate(prompt, 16, opts)
                rows.append({"mtp_placement": placement, "head": head,
                             "waits_per_step": {str(k): v for k, v in
                                                m.waits_per_step.items()},
                             "steps": {str(k): v for k, v in m.steps_by_label.items()},
                             "cache_bytes_crossing": m.cache_bytes_crossing,
                             "tokens": toks})
    return rows


def draft_costs(name: str, pair, loads: int) -> dict:
    """Per load: the median of 5 timed drafts per token (client, tail) and the RTT."""
    out: dict = {"client_draft_s": [], "tail_draft_s": [], "tail_timed_s": [], "rtt_s": [],
                 "head_s": []}
    opts = EngineOptions(k=K, settings=SETTINGS)
    for _ in range(loads):
        for placement in (Placement.CLIENT, Placement.TAIL):
            with RangedMTP(str(pair.trunk), plan=PLAN, sidecar=str(pair.sidecar),
                           mtp_placement=placement, opts=opts, seam="star") as r:
                rec = r.placement_record
            t = rec["timings"]
            if placement == "client":
                out["client_draft_s"].append(rec["inputs"]["client_draft_s"])
                out["head_s"].append(t["head_s"]["median"])
                out["rtt_s"].append(rec["inputs"]["rtt_s"])
            else:
                out["tail_timed_s"].append(t["draft_s"]["median"])
                out["tail_draft_s"].append(rec["inputs"]["tail_draft_s"])
    summary = {k: {"median": statistics.median(v), "min_max": [min(v), max(v)], "n": len(v)}
               for k, v in out.items()}
    return {"model": name, "loads": loads, "raw": out, "summary": summary}


def table(rows: list[tuple[str, float, float, str]]) -> list[dict]:
    out = []
    for label, client_s, tail_s, basis in rows:
        cells = {}
        for rtt in RTTS_MS:
            c = choose_placement(PlacementInputs(k=K, rtt_s=rtt / 1e3, client_draft_s=client_s,
                                                 tail_draft_s=tail_s))
            cells[f"{rtt:g}"] = c.chosen
        be = break_even_rtt_s(client_s, tail_s)
        out.append({"case": label, "client_draft_ms": client_s * 1e3,
                    "tail_draft_ms": tail_s * 1e3, "basis": basis,
                    "break_even_rtt_ms": None if be is None else be * 1e3,
                    "winner_by_rtt_ms": cells})
    return out


def markdown(t: list[dict]) -> str:
    head = "| case | client ms/token | tail ms/token | basis | tail wins below | " + \
        " | ".join(f"{r:g} ms" for r in RTTS_MS) + " |"
    lines = [head, "|" + "---|" * (5 + len(RTTS_MS))]
    for r in t:
        be = "never" if r["break_even_rtt_ms"] is None else f"{r['break_even_rtt_ms']:.3g} ms"
        lines.append(f"| {r['case']} | {r['client_draft_ms']:.3g} | {r['tail_draft_ms']:.3g} | "
                     f"{r['basis']} | {be} | "
                     + " | ".join(r["winner_by_rtt_ms"][f"{x:g}"] for x in RTTS_MS) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = common.parser(MODULE, __doc__)
    common.add_out(ap, "placement")
    ap.add_argument("--loads", type=int, default=3)
    ap.add_argument("--table-only", action="store_true",
                    help="measure nothing: the table again from --out's placement.json "
                    "(after the cost model's wait counts changed)")
    a = ap.parse_args(argv)
    a.out.mkdir(parents=True, exist_ok=True)
    if a.table_only:
        result = json.loads((a.out / "placement.json").read_text())
        result["table"] = table([(r["case"], r["client_draft_ms"] / 1e3,
                                  r["tail_draft_ms"] / 1e3, r["basis"])
                                 for r in result["table"]])
        result["table_command"] = f"python -m {MODULE} --out evidence/placement --table-only"
        (a.out / "placement.json").write_text(json.dumps(result, indent=1) + "\n")
        print(markdown(result["table"]))
        return 0
    from mtplib import host, paths

    trained = trained_paths()
    prompt = trained_prompts(1, 48)[0]
    info = build_info()
    prov = host.provenance(paths.REPO, info, common.command(MODULE, argv))
    up = {k: info.get(k) for k in ("build", "patches")}
    load_before = os.getloadavg()
    w = waits(trained, prompt)
    (a.out / "waits.json").write_text(json.dumps(
        {"upstream": up, "plan": PLAN, "k": K, "prompt_tokens": len(prompt), "n_new": 16,
         "rows": w, "provenance": host.finish(prov)}, indent=1) + "\n")
    with tempfile.TemporaryDirectory() as tmp:
        tiny = write_fixture(Path(tmp), seed=0)
        costs = [draft_costs("trained pair", trained, a.loads),
                 draft_costs("tiny fixture (seed 0)", tiny, a.loads)]
    lc = json.loads((EVIDENCE / "layer-cost" / "layer-cost-cpu.json").read_text())
    v4_ms = lc["derived_cpu"]["draft_ms"]
    rows = []
    for c in costs:
        s = c["summary"]
        rows.append((c["model"], s["client_draft_s"]["median"], s["tail_draft_s"]["median"],
                     "both measured here (CPU shards on this host)"))
    for f in ASSUMED_TAIL_FRACTIONS:
        rows.append((f"V4-Flash, CPU client, tail at {f:g}x its time", v4_ms / 1e3,
                     v4_ms / 1e3 * f, "client: layer-cost (1 thread, CPU time); tail: "
                     "ASSUMED fraction"))
    t = table(rows)
    result = {"command": f"python -m {MODULE} --out evidence/placement"
                         + (f" --loads {a.loads}" if a.loads != 3 else ""),
              "upstream": up, "host": {"cpu": platform.processor() or platform.machine(),
                                       "cores": os.cpu_count(),
                                       "loadavg_before": load_before,
                                       "loadavg_after": os.getloadavg()},
              "plan": PLAN, "k": K, "costs": costs,
              "v4_flash_cpu_draft_ms": v4_ms,
              "v4_flash_source": "evidence/layer-cost/layer-cost-cpu.json derived_cpu.draft_ms",
              "table": t, "provenance": host.finish(prov)}
    (a.out / "placement.json").write_text(json.dumps(result, indent=1) + "\n")
    print(markdown(t))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
