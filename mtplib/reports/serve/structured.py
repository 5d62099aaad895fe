"""Structured output through `mtplib serve`: a JSON schema's responses and their decode
speed beside unconstrained ones, on the committed trained pair.

One `mtplib serve` per backend (the whole model; with ``--plan``, two local shards it
starts), MTP at the default draft length, one slot. For each of the 16 held-out prompts
(`lab.wan.inputs.trained_prompts`, the prompts tests/test_grammar.py takes): a constrained
request (/completion with llama-server's ``json_schema``, greedy, up to 160 tokens), the
same request streamed, then an unconstrained request of the same prompt asking exactly as
many tokens as the constrained response had (``ignore_eos``). Recorded per prompt: whether
each constrained response parses and validates against the schema (and the streamed text is
the non-streamed one), and both requests' llama-server timings (``predicted_per_second``,
draft counts). A warm-up pair is not counted.

    python -m mtplib.reports.serve.structured [--prompts 16]
        [--backends whole,ranged] [--out evidence/serve/structured.json]
"""

from __future__ import annotations

import json
import logging
import os
import statistics
import subprocess
import sys
import threading
from pathlib import Path

from mtplib.reports import common

MODULE = "mtplib.reports.serve.structured"
#: named, not __name__ (which is __main__ under python -m)
log = logging.getLogger(MODULE)
HERE = common.evidence("serve")
#: an object with typed fields, an enum and an array (tests/test_grammar.py's SCHEMA)
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "kind": {"enum": ["function", "class", "module"]},
        "n": {"type": "integer"},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 4},
                 "maxItems": 2},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "kind", "n", "tags", "ok"],
    "additionalProperties": False,
}
N_MAX = 160
PLAN = "0-1,2-3"


def summary(xs: list[float]) -> dict:
    xs = sorted(xs)
    q = statistics.quantiles(xs, n=4) if len(xs) > 1 else [xs[0]] * 3
    return {"n": len(xs), "median": statistics.median(xs), "min": xs[0], "max": xs[-1],
            "q1": q[0], "q3": q[2]}


def _valid(text: str) -> bool:
    import jsonschema

    try:
        jsonschema.validate(json.loads(text), SCHEMA)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


def _streamed(url: str, body: dict) -> str:
    import httpx

    with httpx.stream("POST", url + "/completion", json={**body, "stream": True},
                      timeout=600) as r:
        r.raise_for_status()
        return "".join(json.loads(line[6:])["content"] for line in r.iter_lines()
                       if line.startswith("data: {"))


def run_backend(name: str, prompts: list[list[int]], warm: list[int], threads: int
                ) -> tuple[list[dict], dict]:
    """(rows, what ran) for one backend's service."""
    import httpx

    from mtplib.model.trained import trained_paths

    pair = trained_paths()
    engine = ["-m", str(pair.trunk), "-md", str(pair.sidecar), "-c", "512", "-t",
              str(threads)]
    if name == "ranged":
        from mtplib.runtime import build_info

        # the stock build refuses ranged MTP unless told (it would move cache state)
        engine += ["--plan", PLAN] + ([] if build_info()["build"] == "patched"
                                      else ["--allow-cache-crossing"])
    cmd = [sys.executable, "-m", "mtplib.cli", "serve", *engine, "--port", "0", "--json"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    err: list[str] = []
    threading.Thread(target=lambda: err.extend(proc.stderr), daemon=True).start()
    rows = []
    try:
        line = proc.stdout.readline()
        if not line:
            raise SystemExit("serve did not start:\n" + "".join(err[-20:]))
        ready = json.loads(line)
        url = ready["listening"]

        def ask(body: dict) -> dict:
            r = httpx.post(url + "/completion", json=body, timeout=600)
            r.raise_for_status()
            return r.json()

        def pair_of(p: list[int]) -> tuple[dict, dict, str]:
            body = {"prompt": p, "n_predict": N_MAX, "json_schema": SCHEMA,
                    "temperature": 0, "return_tokens": True}
            c = ask(body)
            s = _streamed(url, body)
            u = ask({"prompt": p, "n_predict": len(c["tokens"]), "temperature": 0,
                     "ignore_eos": True, "return_tokens": True})
            return c, u, s

        pair_of(warm)
        for i, p in enumerate(prompts):
            c, u, s = pair_of(p)
            tc, tu = c["timings"], u["timings"]
            rows.append({
                "backend": name, "prompt": i, "n_prompt": len(p),
                "constrained_n": tc["predicted_n"], "constrained_stop_type": c["stop_type"],
                "valid": _valid(c["content"]), "stream_valid": _valid(s),
                "stream_equal": s == c["content"],
                "constrained_decode_tok_s": tc["predicted_per_second"],
                "constrained_draft_n": tc.get("draft_n", 0),
                "constrained_draft_n_accepted": tc.get("draft_n_accepted", 0),
                "unconstrained_n": tu["predicted_n"],
                "unconstrained_decode_tok_s": tu["predicted_per_second"],
                "unconstrained_draft_n": tu.get("draft_n", 0),
                "unconstrained_draft_n_accepted": tu.get("draft_n_accepted", 0),
                "ratio": tc["predicted_per_second"] / tu["predicted_per_second"],
                "text": c["content"]})
            log.info("%s", json.dumps({k: v for k, v in rows[-1].items() if k != "text"}))
    finally:
        proc.terminate()
        rc = proc.wait(120)
    shown = [os.path.relpath(x) if x.startswith(str(pair.trunk.parent)) else x
             for x in cmd[3:]]
    return rows, {"serve_command": " ".join(["mtplib", *shown]), "serve_exit": rc,
                  "upstream": ready.get("upstream"), "draft": ready.get("draft")}


def backend_summary(rows: list[dict]) -> dict:
    acc = {k: sum(r[f"{k}_draft_n_accepted"] for r in rows)
           / max(1, sum(r[f"{k}_draft_n"] for r in rows))
           for k in ("constrained", "unconstrained")}
    return {
        "valid": sum(r["valid"] for r in rows), "stream_valid": sum(
            r["stream_valid"] for r in rows),
        "stream_equal": sum(r["stream_equal"] for r in rows), "of": len(rows),
        "ended_at_eos": sum(r["constrained_stop_type"] == "eos" for r in rows),
        "constrained_decode_tok_s": summary([r["constrained_decode_tok_s"] for r in rows]),
        "unconstrained_decode_tok_s": summary([r["unconstrained_decode_tok_s"]
                                               for r in rows]),
        "ratio": summary([r["ratio"] for r in rows]),
        "constrained_tokens": summary([r["constrained_n"] for r in rows]),
        "acceptance_rate": acc,
    }


def main(argv: list[str] | None = None) -> int:
    ap = common.parser(MODULE, __doc__)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--backends", default="whole,ranged")
    ap.add_argument("--out", default=str(HERE / "structured.json"))
    a = ap.parse_args(argv)
    common.setup_logging()

    from mtplib import host, paths
    from mtplib.lab.wan.inputs import trained_prompts
    from mtplib.runtime import build_info

    prov = host.provenance(paths.REPO, build_info(), common.command(MODULE, argv))
    ps = trained_prompts(a.prompts + 1, a.prompt_len)
    prompts, warm = ps[:a.prompts], ps[a.prompts]
    load0 = os.getloadavg()[0]
    rows: list[dict] = []
    runs = {}
    for name in a.backends.split(","):
        got, ran = run_backend(name, prompts, warm, a.threads)
        rows += got
        runs[name] = {**ran, "summary": backend_summary(got)}
    out = {
        "what": "JSON-schema constrained /completion vs unconstrained of the same length, "
                "greedy, MTP default draft, one slot, per backend",
        "command": " ".join(common.command(MODULE, argv)),
        "prompts": f"trained_prompts({a.prompts}, {a.prompt_len}) (held-out stdlib)",
        "schema": SCHEMA, "n_max": N_MAX, "threads": a.threads,
        "loadavg_1min": {"start": load0, "end": os.getloadavg()[0]},
        "runs": runs, "rows": rows, "provenance": host.finish(prov),
    }
    Path(a.out).write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps({k: v["summary"] for k, v in runs.items()}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
