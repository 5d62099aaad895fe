"""Where MTP pays through llama-cpp-python, measured: plain `llama_cpp.Llama` against
`mtplib.llama.mtp_llama` (the same trunk drafting with its MTP block) on the trained pair's
held-out prompts, greedy, streamed through `create_completion` as a user calls it.

Decode speed is timed from the first streamed token to the last (the prompt's evaluation
is TTFT, reported apart), and a non-streamed call is timed whole (prompt included); runs
alternate plain / MTP per prompt so both see the same load.
On the tiny pair a target decode costs about as much as an MTP draft, so drafting cannot
pay on a CPU; over a WAN, where a token costs round trips rather than compute, it does
(`mtplib.lab.wan`). ``python -m mtplib.lab.llama_speed --out FILE.json`` writes the result.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np


def _stream(llm, prompt: Sequence[int], n_new: int) -> tuple[list[str], float | None, float]:
    """(text pieces, decode tok/s from the first to the last streamed token, TTFT s)."""
    t0 = time.perf_counter()
    t_first, pieces = None, []
    for chunk in llm.create_completion(list(prompt), max_tokens=n_new, temperature=0.0,
                                       stream=True):
        if t_first is None:
            t_first = time.perf_counter()
        pieces.append(chunk["choices"][0]["text"])
    t_end = time.perf_counter()
    n = len(pieces)
    rate = (n - 1) / (t_end - t_first) if t_first is not None and n > 1 else None
    return pieces, rate, (t_first or t_end) - t0


def _whole(llm, prompt: Sequence[int], n_new: int) -> tuple[str, float]:
    """(text, tokens/s of the whole non-streamed call, prompt evaluation included)."""
    t0 = time.perf_counter()
    r = llm.create_completion(list(prompt), max_tokens=n_new, temperature=0.0)
    dt = time.perf_counter() - t0
    return r["choices"][0]["text"], r["usage"]["completion_tokens"] / dt


def compare(trunk: str | Path, sidecar: str | Path, prompts: Sequence[Sequence[int]], *,
            draft: int = 3, n_new: int = 128, n_ctx: int = 512, n_threads: int = 1,
            reps: int = 1) -> dict:
    """Plain vs MTP tok/s per prompt (median and range), identical text, draft stats."""
    from mtplib.llama import mtp_llama, plain_llama

    plain = plain_llama(trunk, n_ctx=n_ctx, n_threads=n_threads)
    mtp = mtp_llama(trunk, sidecar, draft=draft, n_ctx=n_ctx, n_threads=n_threads)
    rows = []
    try:
        for rep in range(reps):
            for i, p in enumerate(prompts):
                a, ra, ta = _stream(plain, p, n_new)
                b, rb, tb = _stream(mtp, p, n_new)
                wa, qa = _whole(plain, p, n_new)
                wb, qb = _whole(mtp, p, n_new)
                rows.append({"prompt": i, "rep": rep, "plain_tok_s": ra, "mtp_tok_s": rb,
                             "plain_ttft_s": ta, "mtp_ttft_s": tb, "n_tokens": len(a),
                             "plain_whole_tok_s": qa, "mtp_whole_tok_s": qb,
                             "same_text": "".join(a) == "".join(b) == wa == wb})
        stats = mtp.draft_model.stats
        drafts = {"drafted": stats.drafted, "accepted": stats.accepted,
                  "accepted_per_position": stats.accepted_per_position}
    finally:
        mtp.close()
        plain.close()

    def spread(key: str) -> dict:
        v = [r[key] for r in rows if r[key]]
        return {"median": float(np.median(v)), "min": min(v), "max": max(v), "n": len(v)}

    ratios = [r["mtp_tok_s"] / r["plain_tok_s"] for r in rows
              if r["mtp_tok_s"] and r["plain_tok_s"]]
    return {"config": {"draft": draft, "n_new": n_new, "n_ctx": n_ctx, "n_threads": n_threads,
                       "reps": reps, "n_prompts": len(prompts)},
            "plain_tok_s": spread("plain_tok_s"), "mtp_tok_s": spread("mtp_tok_s"),
            "plain_whole_tok_s": spread("plain_whole_tok_s"),
            "mtp_whole_tok_s": spread("mtp_whole_tok_s"),
            "speedup": {"median": float(np.median(ratios)), "min": min(ratios),
                        "max": max(ratios)},
            "same_text": all(r["same_text"] for r in rows), "drafts": drafts, "rows": rows,
            "loadavg_after": list(os.getloadavg())}


def main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="python -m mtplib.lab.llama_speed",
                                 description="plain Llama vs mtp_llama on the trained pair")
    ap.add_argument("--out", required=True, help="result JSON")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--n", type=int, default=128)
    ap.add_argument("--draft", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--reps", type=int, default=2)
    a = ap.parse_args(argv)
    from mtplib import host, paths
    from mtplib.lab.wan.inputs import trained_prompts
    from mtplib.model.trained import trained_paths
    from mtplib.runtime import build_info

    args = sys.argv[1:] if argv is None else argv
    prov = host.provenance(paths.REPO, build_info(), ["python -m mtplib.lab.llama_speed", *args])
    pair = trained_paths()
    res = compare(pair.trunk, pair.sidecar, trained_prompts(a.prompts, a.prompt_len),
                  draft=a.draft, n_new=a.n, n_threads=a.threads, reps=a.reps)
    res["command"] = prov["command"]
    res["provenance"] = host.finish(prov)
    Path(a.out).write_text(json.dumps(res, indent=1) + "\n")
    print(json.dumps({k: res[k] for k in ("plain_tok_s", "mtp_tok_s", "plain_whole_tok_s",
                                          "mtp_whole_tok_s", "speedup", "same_text",
                                          "drafts")}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
