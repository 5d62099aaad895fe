"""`mtplib serve` against the warm library path, on the committed trained pair.

One `mtplib serve` process and, in this process, the same backend built by the same
functions from the same arguments (`generate.check_engine_args` + `open_backend`), loaded
side by side. For each held-out prompt, interleaved: one non-streaming request, one
streaming request (both with the openai client), one streaming request read only after
it finished (raw httpx: no client waking per event) and one library `generate`. Request 1 and
the library's first generation are the warm-up; requests 2..N are reported: decode tok/s
(llama-server's `timings.predicted_per_second`, the library's `decode_tok_s`: the same
definition), the client's end-to-end tok/s, and whether the tokens are identical.

    python -m mtplib.reports.serve.measure [--prompts 12] [--n 64]
        [--plan 0-1,2-3 --wan 100 --out evidence/serve/serve-vs-library-ranged-100ms.json]
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

MODULE = "mtplib.reports.serve.measure"
#: named, not __name__ (which is __main__ under python -m)
log = logging.getLogger(MODULE)
HERE = common.evidence("serve")


def summary(xs: list[float]) -> dict:
    xs = sorted(xs)
    q = statistics.quantiles(xs, n=4) if len(xs) > 1 else [xs[0]] * 3
    return {"n": len(xs), "median": statistics.median(xs), "min": xs[0], "max": xs[-1],
            "q1": q[0], "q3": q[2]}


def _stream_read_after(url: str, prompt: list[int], n: int, wait_s: float) -> dict:
    """A streaming request whose events are read only after ``wait_s`` (twice the same
    request's non-streaming time): the server streams into the socket buffer with no client
    waking per event on this machine's CPUs. Its last event."""
    import httpx

    body = {"prompt": prompt, "max_tokens": n, "temperature": 0, "stream": True,
            "return_tokens": True, "ignore_eos": True}
    with httpx.Client(timeout=300) as c, c.stream("POST", url + "/v1/completions",
                                                   json=body) as r:
        time.sleep(wait_s)
        data = b"".join(r.iter_raw()).decode()
    events = [e[len("data: "):] for e in data.split("\n\n") if e.startswith("data: {")]
    return json.loads(events[-1])


def main(argv: list[str] | None = None) -> int:
    ap = common.parser(MODULE, __doc__)
    ap.add_argument("--prompts", type=int, default=12, help="held-out prompts (requests)")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--n", type=int, default=64, help="new tokens per request")
    ap.add_argument("--draft", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--plan", help="ranged: layer ranges on local shards (both sides start "
                    "their own), e.g. 0-1,2-3")
    ap.add_argument("--wan", help="with --plan: the emulated WAN RTT in ms, e.g. 100")
    ap.add_argument("--out", default=str(HERE / "serve-vs-library.json"))
    a = ap.parse_args(argv)
    common.setup_logging()

    import openai

    from mtplib import host, paths
    from mtplib.cli import build_parser
    from mtplib.commands.generate import check_engine_args, open_backend
    from mtplib.host import cpu_info
    from mtplib.lab.wan.inputs import trained_prompts
    from mtplib.model.trained import trained_paths
    from mtplib.runtime import build_info
    from mtplib.runtime.sampling import Sampler

    pair = trained_paths()
    engine = ["-m", str(pair.trunk), "-md", str(pair.sidecar), "--draft", str(a.draft),
              "-c", "512", "-t", str(a.threads)]
    if a.plan:
        # the star: what the committed figures measured (the default seam then)
        engine += ["--plan", a.plan, "--seam", "star"] + (["--wan", a.wan] if a.wan else [])
    serve_cmd = [sys.executable, "-m", "mtplib.cli", "serve", *engine, "--port", "0",
                 "--json"]
    prompts = trained_prompts(a.prompts, a.prompt_len)
    prov = host.provenance(paths.REPO, build_info(), common.command(MODULE, argv))
    load0 = os.getloadavg()[0]
    proc = subprocess.Popen(serve_cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    threading.Thread(target=proc.stderr.read, daemon=True).start()
    try:
        ready = json.loads(proc.stdout.readline())
        client = openai.OpenAI(base_url=ready["listening"] + "/v1", api_key="unused",
                               timeout=300, max_retries=0)
        args = build_parser().parse_args(["serve", *engine])
        check_engine_args(args)
        rows, build = [], None
        with open_backend(args, sampler=Sampler(), warm=True) as lib:
            for i, p in enumerate(prompts):
                extra = {"return_tokens": True, "ignore_eos": True}
                t0 = time.perf_counter()
                r = client.completions.create(model=ready["model"], prompt=p,
                                              max_tokens=a.n, temperature=0, extra_body=extra)
                wall = time.perf_counter() - t0
                t0 = time.perf_counter()
                chunks = list(client.completions.create(
                    model=ready["model"], prompt=p, max_tokens=a.n, temperature=0,
                    stream=True, extra_body=extra))
                wall_s = time.perf_counter() - t0
                deferred = _stream_read_after(ready["listening"], p, a.n, 2 * wall)
                toks, m = lib.generate(p, a.n)
                build = m.upstream
                last = chunks[-1].model_extra
                rows.append({
                    "request": i + 1,
                    "serve_decode_tok_s": r.model_extra["timings"]["predicted_per_second"],
                    "serve_stream_decode_tok_s": last["timings"]["predicted_per_second"],
                    "serve_stream_deferred_decode_tok_s":
                        deferred["timings"]["predicted_per_second"],
                    "library_decode_tok_s": m.decode_tok_s,
                    "serve_client_tok_s": a.n / wall,
                    "serve_stream_client_tok_s": a.n / wall_s,
                    "draft_n": r.model_extra["timings"].get("draft_n", 0),
                    "draft_n_accepted": r.model_extra["timings"].get("draft_n_accepted", 0),
                    "library_drafted": m.drafted, "library_accepted": m.accepted,
                    "tokens_equal": (r.model_extra["tokens"] == toks == last["tokens"]
                                     == deferred["tokens"])})
                log.info("%s", json.dumps(rows[-1]))
    finally:
        proc.terminate()
        rc = proc.wait(60)
    later = rows[1:]  # requests 2..N
    keys = ["serve_decode_tok_s", "serve_stream_decode_tok_s",
            "serve_stream_deferred_decode_tok_s", "library_decode_tok_s",
            "serve_client_tok_s", "serve_stream_client_tok_s"]
    out = {
        "what": "mtplib serve vs the same backend's warm library generate, requests 2..N",
        "command": " ".join(common.command(MODULE, argv)),
        "serve_command": " ".join(["mtplib", *serve_cmd[3:]]),
        "prompts": f"trained_prompts({a.prompts}, {a.prompt_len}) (held-out stdlib)",
        "n_new": a.n, "draft": a.draft, "threads": a.threads, "serve_exit": rc,
        "upstream": build,  # the build both processes load (the service inherits it)
        "cpu": cpu_info(),
        "summary": {k: summary([r[k] for r in later]) for k in keys},
        "ratio_of_medians": {
            k: statistics.median(r[k] for r in later)
            / statistics.median(r["library_decode_tok_s"] for r in later)
            for k in keys if k != "library_decode_tok_s"},
        "per_request_ratio_over_library": {
            k: summary([r[k] / r["library_decode_tok_s"] for r in later])
            for k in ("serve_decode_tok_s", "serve_stream_decode_tok_s",
                      "serve_stream_deferred_decode_tok_s")},
        "loadavg_1min": {"start": load0, "end": os.getloadavg()[0]},
        "tokens_equal_all": all(r["tokens_equal"] for r in rows),
        "rows": rows,
        "provenance": host.finish(prov),
    }
    Path(a.out).write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps({k: out[k] for k in ("summary", "ratio_of_medians",
                                          "per_request_ratio_over_library",
                                          "loadavg_1min", "tokens_equal_all", "serve_exit",
                                          "upstream")},
                     indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
