"""`mtplib layer-cost`: time the V4-Flash-width slice for the projection's compute inputs."""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from pathlib import Path

from mtplib.commands.common import add_json_arg, add_log_args, int_list, setup_logging
from mtplib.errors import InputError, WouldOverwrite


def _ks(s: str) -> tuple[int, ...]:
    try:
        ks = tuple(int_list(s, "--ks", "comma-separated integers, e.g. 1,2,3"))
    except InputError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    if not ks:
        raise argparse.ArgumentTypeError("--ks is empty")
    return ks


def run(a: argparse.Namespace) -> int:
    from mtplib import host, paths
    from mtplib.lab.layer_cost import LayerCostConfig, measure
    from mtplib.runtime import build_info

    cfg = LayerCostConfig(steps=a.steps, warmup=a.warmup, ks=a.ks, n_prompt=a.n_prompt,
                          n_ctx=a.ctx, threads=a.threads, seed=a.seed).validate()
    out = Path(a.out)
    if out.exists() and not a.force:
        raise WouldOverwrite(f"{out} exists; remove it or pass --force")
    if out.parent and not out.parent.is_dir():
        raise InputError(f"the folder of --out ({out.parent}) does not exist")
    setup_logging(a)

    def progress(s: str) -> None:
        if not a.json:
            print(s, file=sys.stderr, flush=True)

    command = shlex.join(["mtplib", *sys.argv[1:]])
    prov = host.provenance(paths.REPO, build_info(), [command])
    res = measure(a.fixtures, cfg, seed=a.seed, reuse=a.reuse, command=command,
                  progress=progress)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(json.dumps({**res.to_dict(), "provenance": host.finish(prov)}, indent=1)
                   + "\n")
    os.replace(tmp, out)
    d = res.derived
    brief = {"out": str(out), "hardware": res.hardware["label"], **{
        k: d.get(k) for k in ("layer_ms", "layer_ms_p10_p90", "v4_flash_decode_ms",
                              "layer_s", "verify_token_cost", "verify_token_cost_p10_p90",
                              "draft_ms", "draft_cost", "draft_cost_p10_p90")},
        "steps": cfg.steps, "seconds": res.seconds, "loadavg": res.loadavg_after}
    print(json.dumps(brief, indent=None if a.json else 2))
    return 0


def register(sub) -> None:
    from mtplib.lab.layer_cost import LayerCostConfig

    d = LayerCostConfig()
    p = sub.add_parser(
        "layer-cost", help="time V4-Flash's per-layer, verify and draft cost on the slice",
        description="Generate (or reuse) the V4-Flash-width slice (--preset v4-flash-slice, "
        "about 6.9 GB) and its four-layer partner (v4-flash-slice-l4, 3.6 GB) in --fixtures, "
        "time one-token decodes, verify batches of k+1 tokens and MTP drafts on each, and "
        "write the raw steps and the projection's inputs (layer_s, verify_token_cost, "
        "draft_cost, with their spread and hardware) to --out as JSON.")
    p.add_argument("--fixtures", required=True, help="folder for the generated slice files")
    p.add_argument("--out", required=True, help="result JSON file (not overwritten)")
    p.add_argument("--steps", type=int, default=d.steps, help="timed steps per series")
    p.add_argument("--warmup", type=int, default=d.warmup, help="untimed steps first")
    p.add_argument("--ks", type=_ks, default=d.ks, help="verify draft lengths, e.g. 1,2,3")
    p.add_argument("--n-prompt", type=int, default=d.n_prompt, help="prompt tokens first")
    p.add_argument("--ctx", type=int, default=d.n_ctx, help="context size")
    p.add_argument("--threads", type=int, default=d.threads, help="upstream threads")
    p.add_argument("--seed", type=int, default=d.seed, help="weights and prompt seed")
    p.add_argument("--reuse", action="store_true",
                   help="time the slice files already in --fixtures as they are, instead of "
                   "writing them again (their sha256 is recorded either way)")
    p.add_argument("--force", action="store_true", help="overwrite --out")
    add_json_arg(p, "the summary on one line")
    add_log_args(p)
    p.set_defaults(fn=run)
