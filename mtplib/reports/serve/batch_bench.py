"""`mtplib serve --parallel N` with N concurrent clients vs one request at a time.

One `mtplib serve` process (the committed trained pair, MTP k=2, greedy), called with the
`openai` client. Each round takes N held-out prompts (`trained_prompts`, fresh ones per
round): first each prompt alone, one after another (one request's tokens/s: n / its wall
time); then all N at once from N threads (aggregate tokens/s: N*n over the time from the
first request sent to the last answer). Each concurrent response's tokens must equal the
same prompt's tokens alone. One client's tokens/s = N*n over the sum of the N requests'
times alone; ratio = aggregate / that. One request before the rounds warms the service
and one set of N concurrent ones (prompts of the same length, not measured: the
service's first-use shapes); odd rounds run alone first, even rounds
concurrent first, so a drift of this shared machine's load does not favour one side.
``tail_bound`` per round: the sum over the max of the N times alone, the ratio N requests
stepped together could reach if a step of N cost what a step of one does and prefills
were free (they end with the slowest).

    python -m mtplib.reports.serve.batch_bench [--rounds 4] [--n 64]
        [--parallel 4] [--plan 0-1,2-3 --wan 100] [--out FILE] [--step-log FILE]

``--step-log FILE``: serve through `mtplib.reports.serve.serve_steplog`, its joins and
steps (sizes, seconds) written to FILE.
"""

from __future__ import annotations

import json
import logging
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

from mtplib.reports import common

MODULE = "mtplib.reports.serve.batch_bench"
#: named, not __name__ (which is __main__ under python -m)
log = logging.getLogger(MODULE)
HERE = common.evidence("serve")


def summary(xs: list[float]) -> dict:
    xs = sorted(xs)
    return {"n": len(xs), "median": statistics.median(xs), "min": xs[0], "max": xs[-1]}


def main(argv: list[str] | None = None) -> int:
    ap = common.parser(MODULE, __doc__)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--parallel", type=int, default=4)
    ap.add_argument("--n", type=int, default=64, help="new tokens per request")
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--draft", type=int, default=2)
    ap.add_argument("--plan", help="ranged on local shards, e.g. 0-1,2-3")
    ap.add_argument("--wan", help="with --plan: emulated WAN RTT in ms, e.g. 100")
    ap.add_argument("--out", default=str(HERE / "batch-whole.json"))
    ap.add_argument("--step-log", help="log the scheduler's joins and steps to this file")
    a = ap.parse_args(argv)
    common.setup_logging()

    import openai

    from mtplib.host import cpu_info
    from mtplib.lab.wan.inputs import trained_prompts
    from mtplib.model.trained import trained_paths

    pair = trained_paths()
    n_ctx = a.parallel * (a.prompt_len + 2 * a.n + 16)  # room for a gap filler (batch.py)
    engine = ["-m", str(pair.trunk), "-md", str(pair.sidecar), "--draft", str(a.draft),
              "-c", str(n_ctx), "--parallel", str(a.parallel)]
    if a.plan:
        # the star: what the committed figures measured (the default seam then)
        engine += ["--plan", a.plan, "--seam", "star"] + (["--wan", a.wan] if a.wan else [])
    cmd = [sys.executable, "-m", "mtplib.cli", "serve", *engine, "--port", "0", "--json"]
    if a.step_log:
        cmd[2] = "mtplib.reports.serve.serve_steplog"  # -m it: the CLI, steps logged
    prompts = trained_prompts((a.rounds + 1) * a.parallel + 1, a.prompt_len)
    warm, prompts = prompts[-(a.parallel + 1):], prompts[:-(a.parallel + 1)]
    load0 = os.getloadavg()[0]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    err: list[str] = []
    threading.Thread(target=lambda: err.extend(proc.stderr), daemon=True).start()
    rounds = []
    try:
        line = proc.stdout.readline()
        if not line:
            raise SystemExit("serve did not start:\n" + "".join(err[-20:]))
        ready = json.loads(line)
        client = openai.OpenAI(base_url=ready["listening"] + "/v1", api_key="unused",
                               timeout=600, max_retries=0)

        def ask(p: list[int]) -> tuple[list[int], float, float, dict]:
            t0 = time.perf_counter()
            r = client.completions.create(
                model=ready["model"], prompt=p, max_tokens=a.n, temperature=0,
                extra_body={"return_tokens": True, "ignore_eos": True})
            return r.model_extra["tokens"], t0, time.perf_counter(), r.model_extra["timings"]

        ask(warm[0])
        ws = [threading.Thread(target=ask, args=(p,)) for p in warm[1:]]
        for t in ws:
            t.start()
        for t in ws:
            t.join()
        for i in range(a.rounds):
            ps = prompts[i * a.parallel:(i + 1) * a.parallel]
            got: list = [None] * len(ps)

            def run(j: int, p: list[int], got: list = got) -> None:
                got[j] = ask(p)

            def concurrent(ps: list = ps) -> None:
                ts = [threading.Thread(target=run, args=(j, p)) for j, p in enumerate(ps)]
                for t in ts:
                    t.start()
                for t in ts:
                    t.join()

            if i % 2:
                concurrent()
            alone = [ask(p) for p in ps]
            if not i % 2:
                concurrent()
            one = [a.n / (x[2] - x[1]) for x in alone]
            one_client = len(ps) * a.n / sum(x[2] - x[1] for x in alone)
            span = max(x[2] for x in got) - min(x[1] for x in got)
            agg = len(ps) * a.n / span
            walls = [x[2] - x[1] for x in alone]
            rounds.append({
                "round": i + 1, "order": "concurrent first" if i % 2 else "alone first",
                # N concurrent end with the slowest: the ratio if a step of N cost what a
                # step of one does and the prefill were free (sum / max of times alone)
                "tail_bound": sum(walls) / max(walls),
                "one_request_tok_s": one, "one_client_tok_s": one_client,
                "aggregate_tok_s": agg, "ratio": agg / one_client,
                "concurrent_wall_s": [x[2] - x[1] for x in got],
                "tokens_identical": [g[0] == s[0] for g, s in zip(got, alone, strict=True)],
                "draft_n_accepted_alone": [x[3].get("draft_n_accepted") for x in alone],
                "draft_n_accepted_concurrent": [x[3].get("draft_n_accepted") for x in got]})
            log.info("%s", json.dumps(rounds[-1]))
    finally:
        proc.terminate()
        rc = proc.wait(120)
    out = {
        "what": f"mtplib serve --parallel {a.parallel}: {a.parallel} concurrent requests vs "
                "one at a time (same service), greedy, ignore_eos",
        "command": " ".join(common.command(MODULE, argv)),
        "serve_command": " ".join(["mtplib", "serve", *engine, "--port", "0", "--json"]),
        "prompts": f"trained_prompts({a.rounds * a.parallel}, {a.prompt_len}) (held-out), "
                   f"{a.parallel} per round",
        "n_new": a.n, "draft": a.draft, "serve_exit": rc, "cpu": cpu_info(),
        "ratio": summary([r["ratio"] for r in rounds]),
        "tail_bound": summary([r["tail_bound"] for r in rounds]),
        "aggregate_tok_s": summary([r["aggregate_tok_s"] for r in rounds]),
        "one_client_tok_s": summary([r["one_client_tok_s"] for r in rounds]),
        "one_request_tok_s": summary([x for r in rounds for x in r["one_request_tok_s"]]),
        "all_tokens_identical": all(all(r["tokens_identical"]) for r in rounds),
        "loadavg_1min": {"start": load0, "end": os.getloadavg()[0]},
        "rounds": rounds,
    }
    if a.step_log:
        Path(a.step_log).write_text("".join(x for x in err if x.startswith("STEPLOG")))
    Path(a.out).write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps({k: out[k] for k in ("ratio", "aggregate_tok_s", "all_tokens_identical")}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
