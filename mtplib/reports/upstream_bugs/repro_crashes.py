"""Reproduce two process crashes (SIGFPE) at context creation for `deepseek4` GGUFs.

    python -m mtplib.reports.upstream_bugs.repro_crashes [--out DIR] [--gdb]

(a) indexer key length == head dim (attention.indexer.key_length == attention.key_length):
    creating an MTP context (LLAMA_CONTEXT_TYPE_MTP) on the `mtp-` sidecar dies.
(b) no layer with compress ratio 4: creating a normal context on the trunk dies.

mtplib's V4Config.validate() refuses both configurations, so the GGUFs are written with
mtplib's internal fixture writer from `dataclasses.replace(TINY, ...)`, bypassing it. Every
case runs in a child process (a crash kills the process); the parent prints the exit
status. A control case (the valid tiny fixture) shows the same calls succeed. --gdb also
runs each crashing child under gdb and prints the innermost frames.
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import json
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from mtplib.reports import common

MODULE = "mtplib.reports.upstream_bugs.repro_crashes"
CASES = {
    # name: (config change, which file, context type)
    "control_trunk": ({}, "trunk", "default"),
    "control_mtp": ({}, "sidecar", "mtp"),
    "a_indexer_dim_eq_head_dim_trunk": ({"indexer_dim": 64}, "trunk", "default"),
    "a_indexer_dim_eq_head_dim_mtp": ({"indexer_dim": 64}, "sidecar", "mtp"),
    "b_no_ratio4_layer_trunk": ({"compress_ratios": (0, 0, 128, 128, 0)}, "trunk", "default"),
}


def write(case: str, out: Path) -> Path:
    from mtplib.model.arch import sidecar_tensors, trunk_tensors
    from mtplib.model.fixture import write_gguf
    from mtplib.model.presets import TINY

    change, which, _ = CASES[case]
    cfg = dataclasses.replace(TINY, **change)  # NOT validated: upstream must see it as is
    sidecar = which == "sidecar"
    specs = sidecar_tensors(cfg) if sidecar else trunk_tensors(cfg)
    name = f"{'mtp-' if sidecar else ''}v4-{case}"
    path = out / f"{name}.gguf"
    write_gguf(path, cfg, specs, 0, sidecar, name)
    return path


def child(case: str, path: str) -> int:
    """Load the model and create one context; print a line before each step."""
    from llama_cpp import llama_cpp as L

    def log(_level, text, _user):  # keep upstream quiet, except the K-rotation set-up lines
        line = (text or b"").decode("utf-8", "replace")
        if "attn_rot_k" in line or "llama_kv_cache: size" in line:
            print(f"[{case}] upstream: {line.strip()}", flush=True)

    keep = L.llama_log_callback(log)  # upstream holds the pointer: keep a reference
    L.llama_log_set(keep, ctypes.c_void_p(0))
    L.llama_backend_init()
    _, which, ctx_type = CASES[case]
    mp = L.llama_model_default_params()
    mp.load_mtp = which == "sidecar"
    print(f"[{case}] loading {path} (load_mtp={mp.load_mtp})", flush=True)
    model = L.llama_model_load_from_file(path.encode(), mp)
    if not model:
        print(f"[{case}] model load failed (NULL)", flush=True)
        return 3
    cp = L.llama_context_default_params()
    cp.n_ctx, cp.n_threads, cp.n_threads_batch = 256, 1, 1
    if ctx_type == "mtp":
        cp.ctx_type = L.LLAMA_CONTEXT_TYPE_MTP
    print(f"[{case}] creating context (ctx_type={ctx_type})", flush=True)
    ctx = L.llama_init_from_model(model, cp)
    print(f"[{case}] context created: {bool(ctx)}", flush=True)
    if ctx:
        L.llama_free(ctx)
    L.llama_model_free(model)
    return 0 if ctx else 4


def describe(rc: int) -> str:
    if rc < 0:
        return f"killed by {signal.Signals(-rc).name} (exit status {rc})"
    return f"exit status {rc}"


def main(argv: list[str] | None = None) -> int:
    ap = common.parser(MODULE, __doc__)
    ap.add_argument("--out", help="where to write the GGUFs (default: a temp dir)")
    ap.add_argument("--gdb", action="store_true", help="also show a gdb backtrace per crash")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--child", nargs=2, metavar=("CASE", "PATH"), help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child:
        return child(*a.child)
    out = Path(a.out) if a.out else Path(tempfile.mkdtemp(prefix="repro-crash-"))
    out.mkdir(parents=True, exist_ok=True)
    results = []
    for case in CASES:
        path = write(case, out)
        cmd = [sys.executable, "-m", MODULE, "--child", case, str(path)]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        res = {"case": case, "config_change": {k: list(v) if isinstance(v, tuple) else v
                                               for k, v in CASES[case][0].items()},
               "file": CASES[case][1], "ctx_type": CASES[case][2],
               "returncode": r.returncode, "result": describe(r.returncode),
               "stdout": r.stdout.strip().splitlines()}
        print(f"{case}: {res['result']}")
        for line in res["stdout"]:
            print("    " + line)
        if a.gdb and r.returncode < 0 and shutil.which("gdb"):
            g = subprocess.run(["gdb", "-q", "-batch", "-ex", "run", "-ex", "bt 6", "--args",
                                *cmd], capture_output=True, text=True, timeout=300)
            frames = [ln for ln in g.stdout.splitlines()
                      if ln.startswith("#") or "received signal" in ln]
            res["gdb"] = frames
            for line in frames:
                print("    gdb: " + line[:160])
        results.append(res)
    if a.json:
        Path(a.json).write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
