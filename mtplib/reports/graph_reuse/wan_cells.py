"""MTP off vs on over emulated WAN links with a bandwidth cap, through the CLI as a user runs it.

Each cell (plan, RTT, bandwidth) is a `mtplib.lab.wan.config.WanConfig` in the cold mode, run by
the lab's own runner (`run_wan`): one fresh `mtplib generate --json` process per generation
with default options, local shards started by the CLI behind its relays (`--wan RTT[:MBIT]`
on every shard: every shard remote), the drafter and the head in the client, the trained
pair's held-out prompts, MTP off and k=2 (on the stock build the lab runs MTP off only: the
CLI refuses ranged MTP there). The speed-up is paired by prompt; the ideal is the run's
tokens per verify step (what MTP would gain if a verify step cost what a plain step costs).

    python -m mtplib.reports.graph_reuse.wan_cells --cells 0-1,2-3@100:20 \\
        --prompts 8 --n 64 --out /tmp/wan-cells.json

Each cell's results folder (wan.json and wan_summary.csv, `mtplib.records.load` reads it)
is ``--runs`` (default: beside ``--out``, ``<stem>-runs/``) / the cell; a run cut short
resumes there (the lab's resume: its finished cells are kept). ``--out`` gets the paired
table, rebuilt from every cell folder's rows: per prompt the lab's MTP-off and MTP-on rows,
the speed-up and its share of the ideal, and their summary per cell.

The lab's runner measures a cell's MTP-off generations for every prompt, then its MTP-on
ones; this report's earlier loop (evidence/graph-reuse/wan_cells.py then) ran them back to
back per prompt. The committed
evidence/graph-reuse/wan-cells.json was measured by that loop (its ``runs`` name the
commits) and is not rewritten: ``--out`` refuses a table it did not make.
"""

from __future__ import annotations

import json
import logging
import os
import platform
import statistics
import subprocess
import time
from pathlib import Path

from mtplib.paths import REPO
from mtplib.reports import common

MODULE = "mtplib.reports.graph_reuse.wan_cells"
#: named, not __name__ (which is __main__ under python -m)
log = logging.getLogger(MODULE)
#: how a table this report makes says so (the committed one, from the earlier loop, has none)
SOURCE = f"mtplib.lab.wan cold mode ({MODULE})"


def parse_cell(text: str) -> tuple[str, float, float | None]:
    """``PLAN@RTT[:MBIT]`` -> (plan, RTT ms, Mbit/s or None)."""
    try:
        plan, link = text.split("@")
        rtt, _, mbit = link.partition(":")
        return plan, float(rtt), float(mbit) if mbit else None
    except ValueError:
        raise SystemExit(f"{MODULE}: error: a cell is PLAN@RTT[:MBIT], got {text!r}"
                         ) from None


def cell_config(plan: str, rtt: float, mbit: float | None, *, prompts: int, n: int, k: int):
    """The cell as a lab.wan config: cold, every shard remote, MTP off and ``k``, on the
    star (what the committed cells measured: the default seam then)."""
    from mtplib.lab.wan.config import WanConfig

    return WanConfig(modes=["cold"], plans=[plan], topologies=["remote"], cold_rtts_ms=[rtt],
                     mbits=[mbit], cold_ks=[0, k], cold_shards="local", n_prompts=prompts,
                     prompt_len=64, n_new=n, fit_rtts_ms=[rtt], seam="star")


def link_text(rtt: float, mbit: float | None) -> str:
    return f"{rtt:g}" + ("" if mbit is None else f":{mbit:g}")


def cell_folder(plan: str, rtt: float, mbit: float | None) -> str:
    """A cell's folder name: ``0-1_2-3-rtt100-20mbit`` (letters, digits, '-', '_' only)."""
    return (f"{plan.replace(',', '_')}-rtt{rtt:g}"
            + ("" if mbit is None else f"-{mbit:g}mbit")).replace(".", "p")


def paired(data: dict, k: int) -> list[dict]:
    """Per prompt of one cell's results: its MTP-off and MTP-on rows side by side."""
    up = data.get("upstream") or {}
    build = up.get("patch_set_sha256") or "stock"
    by: dict[tuple, dict[int, dict]] = {}
    for r in data["rows"]:
        by.setdefault((r["plan"], r["rtt_ms"], r.get("mbit"), r["prompt"], r["rep"]),
                      {})[r["k"]] = r
    out = []
    for (plan, rtt, mbit, prompt, _rep), rows in sorted(by.items(), key=str):
        if 0 not in rows or k not in rows:
            continue
        off, on = rows[0], rows[k]
        row = {"plan": plan, "wan": link_text(rtt, mbit), "n": data["config"]["n_new"],
               "build": build, "prompt": prompt, "off": off, "on": on,
               "tokens_equal": off["tokens"] == on["tokens"],
               "speedup": on["decode_tok_s"] / off["decode_tok_s"],
               "tokens_per_verify": on["tokens_per_step"]}
        row["of_ideal"] = row["speedup"] / row["tokens_per_verify"]
        out.append(row)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = common.parser(MODULE, __doc__)
    ap.add_argument("--cells", required=True,
                    help="PLAN@RTT[:MBIT];... e.g. '0-1,2-3@100:20;0-1,2-3@100'")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--n", type=int, default=64)
    ap.add_argument("--k", type=int, default=2)
    ap.add_argument("--out", required=True, help="the paired table (JSON)")
    ap.add_argument("--runs", help="the cells' lab.wan results folders (default: beside "
                                   "--out, <stem>-runs/)")
    a = ap.parse_args(argv)
    common.setup_logging()

    from mtplib.errors import InputError
    from mtplib.lab.wan.files import WAN_JSON, finish, load
    from mtplib.lab.wan.inputs import trained_prompts
    from mtplib.lab.wan.measure import run_wan
    from mtplib.model.trained import trained_paths
    from mtplib.runtime import build_info
    from mtplib.runtime.lib import upstream_info

    out_path = Path(a.out)
    runs_dir = Path(a.runs) if a.runs else out_path.with_name(out_path.stem + "-runs")
    doc = json.loads(out_path.read_text()) if out_path.exists() else {"source": SOURCE}
    if doc.get("source") != SOURCE:
        raise SystemExit(f"{MODULE}: error: {out_path} holds cells this report's earlier "
                         "loop measured (not from lab.wan's rows); give another --out")
    pair = trained_paths()
    prompts = trained_prompts(a.prompts, 64)
    doc.setdefault("runs", []).append({
        "command": " ".join(common.command(MODULE, argv)),
        "commit": subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"],
                                 capture_output=True, text=True).stdout.strip(),
        "build": build_info(), "host": {"machine": platform.machine(), "cpus": os.cpu_count(),
                                        "loadavg_start": os.getloadavg()},
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")})
    for text in a.cells.split(";"):
        plan, rtt, mbit = parse_cell(text)
        folder = runs_dir / cell_folder(plan, rtt, mbit)
        try:
            cfg = cell_config(plan, rtt, mbit, prompts=a.prompts, n=a.n, k=a.k)
            res = run_wan(str(pair.trunk), str(pair.sidecar), cfg, prompts, log=log.info,
                          out_dir=folder, upstream=upstream_info())
        except InputError as e:
            raise SystemExit(f"{MODULE}: error: {e}") from None
        finish(res, folder)
    doc["cells"] = [row for p in sorted(runs_dir.glob(f"*/{WAN_JSON}"))
                    for row in paired(load(p.parent), a.k)]
    doc["runs"][-1]["ended"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    doc["runs"][-1]["host"]["loadavg_end"] = os.getloadavg()
    doc["summary"] = summarize(doc["cells"])
    out_path.write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n")
    print(json.dumps(doc["summary"], indent=1))
    return 0


def summarize(cells: list[dict]) -> list[dict]:
    """Per (plan, wan, build): median and range of the paired speed-up and of the ideal."""
    groups: dict[tuple, list[dict]] = {}
    for c in cells:
        groups.setdefault((c["plan"], c["wan"], c["build"]), []).append(c)
    out = []
    for (plan, wan, build), rows in sorted(groups.items()):
        sp = [r["speedup"] for r in rows]
        oi = [r["of_ideal"] for r in rows]
        out.append({"plan": plan, "wan": wan, "build": build, "n_prompts": len(rows),
                    "speedup_median": statistics.median(sp), "speedup_min": min(sp),
                    "speedup_max": max(sp), "of_ideal_median": statistics.median(oi),
                    "of_ideal_min": min(oi), "of_ideal_max": max(oi),
                    "off_tok_s_median": statistics.median(r["off"]["decode_tok_s"]
                                                          for r in rows),
                    "on_tok_s_median": statistics.median(r["on"]["decode_tok_s"]
                                                         for r in rows),
                    "tokens_equal": all(r["tokens_equal"] for r in rows),
                    "cache_bytes_crossing": sum(r["on"]["cache_bytes_crossing"]
                                                + r["off"]["cache_bytes_crossing"]
                                                for r in rows)})
    return out


if __name__ == "__main__":
    raise SystemExit(main())
