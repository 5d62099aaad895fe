"""Prefill time of a long prompt with llama.cpp's pipeline parallelism off (mtplib's default
on split models) and on (``MTPLIB_PIPELINE_PARALLEL=1``, upstream's choice): the trained
pair over 2 shards (0-1,2-3) behind 100 ms links, MTP off, one new token.

Each setting runs in its own process (the choice is made when the model loads), the two
alternate ``--rounds`` times; each process first runs one unmeasured prompt (its cold run),
then ``--reps`` measured ones. Writes ``pipeline_ttft.json`` into ``--out`` (default
evidence/graph-reuse/).

    python -m mtplib.reports.graph_reuse.pipeline_ttft [--n-prompt 1536] [--rounds 2] [--reps 3]
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys

from mtplib.paths import REPO
from mtplib.reports import common

MODULE = "mtplib.reports.graph_reuse.pipeline_ttft"
#: named, not __name__ (which is __main__ under python -m)
log = logging.getLogger(MODULE)

ONE = """
import json, random, sys, time
from mtplib.distributed.ranged_mtp import RangedMTP
from mtplib.model.trained import trained_paths
from mtplib.runtime.settings import DecodeSettings
from mtplib.runtime.speculative import EngineOptions
n_prompt, reps, seed = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
rng = random.Random(seed)
opts = EngineOptions(k=0, settings=DecodeSettings(n_ctx=2048, n_threads=1))
out = []
# the star: what the committed figures measured
with RangedMTP(str(trained_paths().trunk), plan="0-1,2-3", wan="100", seam="star") as r:
    for i in range(reps + 1):
        prompt = [rng.randrange(10, 500) for _ in range(n_prompt)]
        t0 = time.perf_counter()
        r.generate(prompt, 1, opts)
        if i:  # the first is the process's cold run
            out.append(round(time.perf_counter() - t0, 4))
print(json.dumps(out))
"""


def main(argv: list[str] | None = None) -> int:
    ap = common.parser(MODULE, __doc__)
    ap.add_argument("--n-prompt", type=int, default=1536)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--reps", type=int, default=3)
    common.add_out(ap, "graph-reuse")
    a = ap.parse_args(argv)
    common.setup_logging()
    from mtplib import host, paths
    from mtplib.runtime import build_info

    prov = host.provenance(paths.REPO, build_info(), common.command(MODULE, argv))
    runs: dict[str, list[float]] = {"off": [], "on": []}
    load = []
    for rnd in range(a.rounds):
        for name, pp in (("off", "0"), ("on", "1")):
            env = dict(os.environ, MTPLIB_PIPELINE_PARALLEL=pp)
            load.append(os.getloadavg()[0])
            p = subprocess.run([sys.executable, "-c", ONE, str(a.n_prompt), str(a.reps),
                                str(rnd)], capture_output=True, text=True, env=env, cwd=REPO,
                               timeout=900)
            if p.returncode:
                log.error("pipeline parallelism %s: the run failed:\n%s", name,
                          p.stderr[-2000:])
                return 1
            runs[name] += json.loads(p.stdout.strip().splitlines()[-1])
    res = {"what": "prefill s of one prompt, ranged 0-1,2-3, --wan 100, MTP off, n_ubatch 512",
           "n_prompt": a.n_prompt, "rounds": a.rounds, "reps": a.reps,
           "pipeline_parallel": {k: {"s": v, "min": min(v), "median": sorted(v)[len(v) // 2],
                                     "max": max(v)} for k, v in runs.items()},
           "loadavg_1m_per_process": load, "provenance": host.finish(prov)}
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "pipeline_ttft.json").write_text(json.dumps(res, indent=1) + "\n")
    print(json.dumps(res["pipeline_parallel"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
