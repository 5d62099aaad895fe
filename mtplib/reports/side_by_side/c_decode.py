"""Pure C decode speed: where the gap to upstream's binaries comes from (issue 7).

    MODEL=FX/v4-v4-ratio-cpu-s0.gguf NT=1 ROUNDS=7 \
    STATIC_BENCH=~/.cache/mtplib/upstream-tools/<commit>/build/bin/llama-bench \
    SHARED_DIR=/tmp/ub-shared/bin \
        python -m mtplib.reports.side_by_side.c_decode > c-decode-t1.json

Question: when mtplib's plain decoding is slower than llama-server's, is the difference in
mtplib's Python loop or in the C decode itself, and if in C, in how the library is built
(static binary vs shared libraries) or in the process (Python vs a C++ binary)? Every
variant does only what llama-bench's `tg` test does: one-token `llama_decode` calls from
position 0 (n_ctx 128, the last row's logits computed, never read), a warm-up run, then one
measured run of 128 tokens:

  static-bench   llama-bench linked statically (what llama-server is; `mtplib
                 compare-upstream` builds it: `cmake --build build --target llama-bench`)
  shared-bench   llama-bench from the same source built with BUILD_SHARED_LIBS=ON (the
                 other flags as the static build; SHARED_DIR holds it and its libraries;
                 the cmake lines are in ab_static_shared.sh)
  python-wheel   mtplib's Context over the llama-cpp-python wheel's libraries (timer around
                 the llama_decode C call only; `tok_s_wall` includes the Python loop)
  python-shared  the same, with LLAMA_CPP_LIB_PATH=SHARED_DIR (upstream's shared build)

Each round runs the four in a rotated order, each a fresh process. Prints one JSON object
(the committed ones: evidence/side-by-side/profile/c-decode-t*.json). ``one`` as the only
argument is the Python variant's single process (used by the driver).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import subprocess
import sys
import time

from mtplib.reports import common

MODULE = "mtplib.reports.side_by_side.c_decode"
#: named, not __name__ (which is __main__ under python -m)
log = logging.getLogger(MODULE)
N_GEN = 128


def setup() -> tuple[str, int, dict]:
    """(MODEL, NT, the context) from the environment (module docstring)."""
    try:
        model = os.environ["MODEL"]
    except KeyError:
        raise SystemExit(f"{MODULE}: error: set MODEL to the trunk GGUF") from None
    nt = int(os.environ.get("NT", "1"))
    # llama-bench's context for `-p 0 -n 128`: n_ctx = 128, its default batch sizes
    cfg = dict(n_ctx=N_GEN, n_batch=2048, n_ubatch=512, n_threads=nt, kv_type="f16",
               flash_attn="auto")
    return model, nt, cfg


def python_one() -> dict:
    from mtplib.runtime.model import Context, ContextConfig, Model
    from mtplib.runtime.timing import DecodeTimer

    path, _, cfg = setup()
    out = {}
    with Model(path) as model, Context(model, ContextConfig(**cfg)) as ctx:
        timer = DecodeTimer(ctx.llama)
        ctx.llama = timer
        for _phase in ("warmup", "measured"):  # the measured run's numbers are kept
            ctx.clear()
            n0 = len(timer.times)
            t0 = time.perf_counter()
            for pos in range(N_GEN):
                ctx.decode([pos % ctx.n_vocab], [pos], logits=[True])  # as llama_batch_get_one
            wall = time.perf_counter() - t0
            c = timer.times[n0:]
            out = {"tok_s": N_GEN / sum(c), "tok_s_wall": N_GEN / wall,
                   "c_ms_median": 1e3 * statistics.median(c)}
        out["lib"] = os.path.dirname(model.llama._lib._name)
    return out


def bench_one(binary: str) -> dict:
    model, nt, cfg = setup()
    argv = [binary, "-m", model, "-p", "0", "-n", str(N_GEN), "-t", str(nt), "-r", "1",
            "-o", "json", "-fa", cfg["flash_attn"], "-ctk", "f16", "-ctv", "f16"]
    out = subprocess.run(argv, capture_output=True, text=True, check=True).stdout
    return {"tok_s": float(json.loads(out)[0]["avg_ts"])}


def python_sub(env_extra: dict) -> dict:
    env = {**os.environ, **env_extra}
    out = subprocess.run([sys.executable, "-m", MODULE, "one"], capture_output=True,
                         text=True, check=True, env=env).stdout
    return json.loads(out)


def measure() -> dict:
    """Every round of the four variants (module docstring): the printed document."""
    model, nt, cfg = setup()
    shared = os.path.expanduser(os.environ["SHARED_DIR"])
    variants = {
        "static-bench": lambda: bench_one(os.path.expanduser(os.environ["STATIC_BENCH"])),
        "shared-bench": lambda: bench_one(os.path.join(shared, "llama-bench")),
        "python-wheel": lambda: python_sub({}),
        "python-shared": lambda: python_sub({"LLAMA_CPP_LIB_PATH": shared}),
    }
    names = list(variants)
    rows = []
    for rnd in range(int(os.environ.get("ROUNDS", "7"))):
        order = names[rnd % len(names):] + names[:rnd % len(names)]
        for name in order:
            load = os.getloadavg()[0]
            r = variants[name]()
            rows.append({"variant": name, "round": rnd, "loadavg_1m": load, **r})
            log.info("round %s %-14s %.1f tok/s load %.2f", rnd, name, r["tok_s"], load)
    med = {n: statistics.median(r["tok_s"] for r in rows if r["variant"] == n) for n in names}
    return {"model": model, "threads": nt, "n_gen": N_GEN, "context": cfg,
            "median_tok_s": med,
            "ratio_to_static_bench": {n: med[n] / med["static-bench"] for n in names},
            "python_wheel_wall_tok_s": statistics.median(
                r["tok_s_wall"] for r in rows if r["variant"] == "python-wheel"),
            "rows": rows}


def main(argv: list[str] | None = None) -> int:
    ap = common.parser(MODULE, __doc__, epilog="\n\n".join(__doc__.split("\n\n")[1:]),
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("one", nargs="?", choices=["one"], help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.one:
        print(json.dumps(python_one()))
        return 0
    common.setup_logging()
    print(json.dumps(measure(), indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
