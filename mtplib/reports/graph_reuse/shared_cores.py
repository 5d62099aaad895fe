"""Client drafting and feeding when the host's cores are shared (issue 29 item 3).

The path a user tries first: two `mtplib shard serve` processes on this host, then
`mtplib generate --mtp ... --plan 0-1,2-3 --endpoints A,B --json` with default options (a
fresh process per generation), the trained pair, k=2, held-out prompts. Each generation runs
idle and again while two busy-loop processes keep both cores busy; the figure is the
client's draft + feed time per drafted token (`metrics.time_s`), busy over idle.

    python -m mtplib.reports.graph_reuse.shared_cores \\
        --out evidence/graph-reuse/shared-cores.json
    # the code before the fix, same build: --tree /path/to/old/checkout --label before

``--tree`` runs another checkout's CLI and shards (PYTHONPATH, and the folder they start in)
with this venv; the shards are this checkout's `LocalShards`, so that checkout's `shard
serve` must take the options it passes (``--threads``, ``--parent-pid``). ``--build`` picks
the upstream build for shards and client alike (stock needs --allow-cache-crossing with MTP,
which the script passes).
"""

from __future__ import annotations

import json
import logging
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

from mtplib.paths import REPO
from mtplib.reports import common

MODULE = "mtplib.reports.graph_reuse.shared_cores"
#: named, not __name__ (which is __main__ under python -m)
log = logging.getLogger(MODULE)


def main(argv: list[str] | None = None) -> int:
    ap = common.parser(MODULE, __doc__)
    ap.add_argument("--out", required=True)
    ap.add_argument("--tree", default=str(REPO), help="checkout whose mtplib runs")
    ap.add_argument("--label", default="after")
    ap.add_argument("--build", default="patched", choices=["stock", "patched"])
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--n", type=int, default=32, help="tokens per generation")
    ap.add_argument("--conditions", default="idle,busy")
    a = ap.parse_args(argv)
    common.setup_logging()

    from mtplib.distributed.processes import LocalShards
    from mtplib.lab.wan.inputs import trained_prompts
    from mtplib.model.trained import trained_paths

    pair = trained_paths()
    prompts = trained_prompts(a.prompts, 48)
    tree = Path(a.tree).resolve()
    env = dict(os.environ, PYTHONPATH=str(tree), MTPLIB_UPSTREAM=a.build)
    py = [sys.executable, "-m", "mtplib.cli"]
    shards = LocalShards(2, env=env, cwd=tree, start_timeout_s=120)
    rows = []
    out = {"command": " ".join(common.command(MODULE, argv)),
           "label": a.label, "tree": str(tree), "build": a.build,
           "commit": subprocess.run(["git", "-C", str(tree), "rev-parse", "HEAD"],
                                    capture_output=True, text=True).stdout.strip(),
           "host": {"machine": platform.machine(), "cpus": os.cpu_count(),
                    "loadavg_start": os.getloadavg()},
           "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "rows": rows}
    with shards:
        eps = shards.endpoints
        for i, prompt in enumerate(prompts):
            for cond in a.conditions.split(","):
                hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
                        for _ in range(2 if cond == "busy" else 0)]
                try:
                    time.sleep(0.2)
                    argv_gen = [*py, "generate", "--model", str(pair.trunk), "--mtp",
                                str(pair.sidecar), "--draft", "2", "--plan", "0-1,2-3",
                                "--endpoints", ",".join(eps), "--tokens",
                                ",".join(map(str, prompt)), "--n", str(a.n), "--json"]
                    if a.build == "stock":
                        argv_gen.append("--allow-cache-crossing")
                    t0 = time.monotonic()
                    r = subprocess.run(argv_gen, capture_output=True, text=True, env=env,
                                       cwd=tree, timeout=600)
                    wall = time.monotonic() - t0
                finally:
                    for h in hogs:
                        h.kill()
                        h.wait()
                if r.returncode not in (0, 3):
                    log.error("mtplib generate failed (exit %s):\n%s", r.returncode,
                              r.stderr[-3000:])
                    return 1
                res = json.loads(r.stdout.strip().splitlines()[-1])
                m = res["metrics"]
                t = m["time_s"]
                drafted = m["drafted"] or 1
                rows.append({"prompt": i, "condition": cond, "wall_s": wall,
                             "draft_s": t.get("draft", 0.0), "feed_s": t.get("feed", 0.0),
                             "verify_s": t.get("verify", 0.0), "drafted": m["drafted"],
                             "accepted": m["accepted"], "decode_tok_s": m["decode_tok_s"],
                             "draft_feed_ms_per_drafted":
                                 1000 * (t.get("draft", 0.0) + t.get("feed", 0.0)) / drafted,
                             "tokens": res["tokens"]})
                log.info("%s", json.dumps({k: v for k, v in rows[-1].items()
                                           if k != "tokens"}))
    summary = {}
    for cond in a.conditions.split(","):
        v = [r["draft_feed_ms_per_drafted"] for r in rows if r["condition"] == cond]
        tok = [r["decode_tok_s"] for r in rows if r["condition"] == cond]
        summary[cond] = {"n": len(v), "draft_feed_ms_per_drafted_median": statistics.median(v),
                         "min": min(v), "max": max(v),
                         "decode_tok_s_median": statistics.median(tok)}
    if "idle" in summary and "busy" in summary:
        summary["busy_over_idle"] = (summary["busy"]["draft_feed_ms_per_drafted_median"]
                                     / summary["idle"]["draft_feed_ms_per_drafted_median"])
    same = {c: [r["tokens"] for r in rows if r["condition"] == c] for c in summary
            if c in ("idle", "busy")}
    out["tokens_equal_idle_busy"] = len({json.dumps(v) for v in same.values()}) <= 1
    out["summary"] = summary
    out["ended"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    out["host"]["loadavg_end"] = os.getloadavg()
    Path(a.out).write_text(json.dumps(out, indent=1, sort_keys=True) + "\n")
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
