"""MTP off vs on over emulated WAN links with a bandwidth cap, through the CLI as a user runs it.

Each generation is one fresh `mtplib generate --json` process with default options: local
shards started by the CLI behind its relays (`--wan RTT[:MBIT]` on every shard: every shard
remote), the drafter and the head in the client, the trained pair's held-out prompts. A
cell is (plan, RTT, bandwidth); per prompt, MTP off and k=2 run back to back, so the
speed-up is paired by prompt. The ideal is the run's tokens per verify step (what MTP would
gain if a verify step cost what a plain step costs).

    .venv/bin/python evidence/graph-reuse/wan_cells.py --cells 0-1,2-3@100:20 \\
        --prompts 8 --n 64 --out evidence/graph-reuse/wan-cells.json

A cell already in ``--out`` (same plan, link, n, build and prompt) is kept and skipped, so a
run cut short resumes where it stopped.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def run_one(pair, plan: str, wan: str, prompt: list[int], n: int, k: int) -> dict:
    argv = [sys.executable, "-m", "mtplib.cli", "generate", "--model", str(pair.trunk),
            "--plan", plan, "--wan", wan, "--tokens", ",".join(map(str, prompt)),
            "--n", str(n), "--json"]
    if k:
        argv += ["--mtp", str(pair.sidecar), "--draft", str(k)]
    t0 = time.monotonic()
    r = subprocess.run(argv, capture_output=True, text=True, cwd=REPO, timeout=1200)
    wall = time.monotonic() - t0
    if r.returncode != 0:
        raise RuntimeError(f"generate failed ({r.returncode}): {r.stderr[-2000:]}")
    res = json.loads(r.stdout.strip().splitlines()[-1])
    m = res["metrics"]
    steps = m["seam_report"]["steps"]
    return {"k": k, "tokens": res["tokens"], "decode_tok_s": m["decode_tok_s"],
            "ttft_s": m["ttft_s"], "wall_s": wall, "verify_steps": m["verify_steps"],
            "plain_steps": m["plain_steps"], "n_generated": m["n_generated"],
            "accepted": m["accepted"], "drafted": m["drafted"],
            "waits_per_step": m["waits_per_step"], "time_s": m["time_s"],
            "cache_bytes_crossing": m["cache_bytes_crossing"],
            "bytes_per_step": {lab: row["bytes"] / row["steps"] for lab, row in steps.items()
                               if row["steps"] and lab in ("decode", "verify", "prefill")},
            "graph_per_step": {lab: row["graph"] / row["steps"] for lab, row in steps.items()
                               if row["steps"] and lab in ("decode", "verify", "prefill")},
            "upstream": m["upstream"]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cells", required=True,
                    help="PLAN@RTT[:MBIT];... e.g. '0-1,2-3@100:20;0-1,2-3@100'")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--n", type=int, default=64)
    ap.add_argument("--k", type=int, default=2)
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)

    from mtplib.lab.wan import trained_prompts
    from mtplib.model.trained import trained_paths
    from mtplib.runtime import build_info

    pair = trained_paths()
    prompts = trained_prompts(a.prompts, 64)
    out_path = Path(a.out)
    doc = json.loads(out_path.read_text()) if out_path.exists() else {"cells": []}
    build = build_info()
    doc.setdefault("runs", []).append({
        "command": " ".join([Path(sys.argv[0]).name, *(argv or sys.argv[1:])]),
        "commit": subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"],
                                 capture_output=True, text=True).stdout.strip(),
        "build": build, "host": {"machine": platform.machine(), "cpus": os.cpu_count(),
                                 "loadavg_start": os.getloadavg()},
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")})
    done = {(c["plan"], c["wan"], c["n"], c["build"], c["prompt"]) for c in doc["cells"]}
    for cell in a.cells.split(";"):
        plan, wan = cell.split("@")
        for i, prompt in enumerate(prompts):
            key = (plan, wan, a.n, build["patch_set_sha256"] or "stock", i)
            if key in done:
                continue
            off = run_one(pair, plan, wan, prompt, a.n, 0)
            on = run_one(pair, plan, wan, prompt, a.n, a.k)
            row = {"plan": plan, "wan": wan, "n": a.n, "build": key[3], "prompt": i,
                   "off": off, "on": on, "tokens_equal": off["tokens"] == on["tokens"],
                   "speedup": on["decode_tok_s"] / off["decode_tok_s"],
                   # as lab.wan's tokens_per_step: the first token comes from the prefill
                   "tokens_per_verify": (on["n_generated"] - 1) / max(
                       1, on["verify_steps"] + on["plain_steps"])}
            row["of_ideal"] = row["speedup"] / row["tokens_per_verify"]
            doc["cells"].append(row)
            out_path.write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n")
            print(json.dumps({k: row[k] for k in ("plan", "wan", "prompt", "speedup",
                                                  "tokens_per_verify", "of_ideal",
                                                  "tokens_equal")}), flush=True)
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
