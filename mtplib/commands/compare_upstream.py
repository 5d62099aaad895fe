"""`mtplib compare-upstream`: mtplib's MTP loop side by side with upstream's C++ loop.

Opt-in, never part of CI: the first call builds upstream's llama-server / llama-cli from
the pinned sdist (about 9 minutes on 2 cores, cached under
~/.cache/mtplib/upstream-tools/<commit>/).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

from mtplib.commands.common import add_json_arg, add_option, comma_list, int_list, resolve_ctx
from mtplib.errors import InputError

#: --ctx when not given, capped by the model's context_length
DEFAULT_CTX = 1024


def _ks(s: str) -> tuple[int, ...]:
    try:
        ks = tuple(int_list(s, "--k", "comma-separated integers, e.g. 1,2,3"))
    except InputError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    if ks == (0,):
        return ()  # plain decoding only
    if not ks or min(ks) < 1:
        raise argparse.ArgumentTypeError(f"--k values must be >= 1 (or just 0), got {s!r}")
    return ks


def run(a: argparse.Namespace) -> int:
    from mtplib.lab import upstream_tools as U
    from mtplib.lab.sidebyside.cases import SIDE_BY_SIDE_SETTINGS, SideBySideConfig, parse_rates
    from mtplib.lab.sidebyside.cost import cost_ratio
    from mtplib.lab.sidebyside.measure import run_side_by_side, save
    from mtplib.runtime.routing import require_mtp

    def log(s: str) -> None:
        if not a.quiet:
            print(f"[compare-upstream] {s}", file=sys.stderr, flush=True)

    if not a.build_only:  # the policy before anything: every mode but plain runs MTP
        mtp_ks = tuple(a.k) or ((1,) if a.cost_ratio or a.cost_ratio_only else ())
        a.policy = require_mtp("compare-upstream", mtp_ks, policy=a.policy)
    resolve_ctx(a, DEFAULT_CTX, a.model, a.mtp)
    if a.cost_ratio_only:
        return _cost_ratio(a, log)
    if a.sweep:
        return _sweep(a, log)
    if not a.build_only:  # inputs first: the build takes about 9 minutes
        if not a.model or not a.mtp:
            raise InputError("--model and --mtp are required (or --build-only)")
        from mtplib.model.gguf_header import read_header
        from mtplib.runtime.model import check_pair

        check_pair(read_header(a.model), read_header(a.mtp))
    bindir = U.build_tools(sdist=a.sdist, jobs=a.jobs, force=a.rebuild, log=log)
    log(f"upstream tools: {bindir}")
    if a.build_only:
        print(json.dumps({"bin": str(bindir),
                          "flags": U.check_flags(bindir / "llama-server")},
                         indent=None if a.json else 2))
        return 0
    rate_sets = tuple(tuple(parse_rates(r)) for r in a.rates.split(";") if r.strip())
    settings = replace(SIDE_BY_SIDE_SETTINGS, n_threads=a.threads, n_ctx=a.ctx,
                       swa_full=a.swa_full == "on")
    cfg = SideBySideConfig(ks=a.k, rate_sets=rate_sets, real_mtp=not a.no_real_mtp,
                           runs=a.runs, warmup=a.warmup, settings=settings,
                           n_new=a.n, n_prompt=a.prompt_len, synth_seed=a.seed)
    out = Path(a.out) if a.out else None
    log_dir = (out.parent / (out.stem + "-logs")) if out else None
    if log_dir:
        log_dir.mkdir(parents=True, exist_ok=True)
    result = run_side_by_side(a.model, a.mtp, cfg, log=log, log_dir=log_dir,
                              policy=a.policy)
    result["argv"] = ["mtplib", *sys.argv[1:]]
    if a.cost_ratio:
        log("cost ratio (MTP step / trunk step)")
        result["cost_ratio"] = cost_ratio(a.model, a.mtp, n_tokens=a.cost_tokens,
                                          threads=a.threads, policy=a.policy)
    if out:
        save(result, out)
        log(f"results: {out}")
    if a.json:
        print(json.dumps({"out": str(out) if out else None, "summary": result["summary"],
                          "cost_ratio": result.get("cost_ratio")}, default=float))
        return 0
    import pandas as pd

    pd.set_option("display.width", 200)
    print(pd.DataFrame(result["summary"])[
        ["case", "runs", "upstream_tok_s", "mtplib_tok_s", "ratio", "upstream_acceptance",
         "mtplib_acceptance", "loadavg_1m_min_max"]].round(3).to_string(index=False))
    return 0


def _cost_ratio(a: argparse.Namespace, log) -> int:
    """mtplib only: one MTP step / one trunk step, one-token decode time medians."""
    from mtplib.lab.sidebyside.cost import cost_ratio
    from mtplib.lab.sidebyside.machine import host_info
    from mtplib.lab.sidebyside.measure import save
    if not a.model or not a.mtp:
        raise InputError("--cost-ratio-only needs --model and --mtp")
    log(f"cost ratio, {a.threads} thread(s), {a.cost_tokens} tokens")
    r = cost_ratio(a.model, a.mtp, n_tokens=a.cost_tokens, threads=a.threads, n_ctx=a.ctx,
                   policy=a.policy)
    result = {"kind": "cost-ratio", "argv": ["mtplib", *sys.argv[1:]], "trunk": a.model,
              "sidecar": a.mtp, "cost_ratio": r, "host": host_info()}
    if a.out:
        save(result, a.out)
    print(json.dumps({k: v for k, v in r.items() if k != "method"},
                     indent=None if a.json else 1, default=float))
    return 0


def _sweep(a: argparse.Namespace, log) -> int:
    """mtplib only: MTP off and k drafts at synthetic rates, speed-up and break-even."""
    from mtplib.lab.common.acceptance_sweep import SweepConfig
    from mtplib.lab.sidebyside.cases import SIDE_BY_SIDE_SETTINGS, SideBySideConfig
    from mtplib.lab.sidebyside.cost import cost_ratio
    from mtplib.lab.sidebyside.measure import save
    from mtplib.lab.sidebyside.sweep import acceptance_sweep
    if not a.model or not a.mtp:
        raise InputError("--sweep needs --model and --mtp")
    parts = comma_list(a.sweep, "--sweep", "rates in [0, 1], e.g. 0.8,0.5")
    try:
        rates = tuple(float(x) for x in parts)
    except ValueError:  # an element that is no number (was a traceback)
        raise InputError(f"--sweep takes rates in [0, 1], got {a.sweep!r}") from None
    if not rates or any(not 0.0 <= r <= 1.0 for r in rates):
        raise InputError(f"--sweep takes rates in [0, 1], got {a.sweep!r}")
    sw = SweepConfig(ks=list(a.k), rates=list(rates), reps=a.runs, warmup=a.warmup,
                     synth_seed=a.seed)
    cfg = SideBySideConfig(
        settings=replace(SIDE_BY_SIDE_SETTINGS, n_threads=a.threads, n_ctx=a.ctx),
        n_new=a.n, n_prompt=a.prompt_len)
    result = acceptance_sweep(a.model, a.mtp, sw, cfg, log=log, policy=a.policy)
    result["argv"] = ["mtplib", *sys.argv[1:]]
    if a.cost_ratio:
        log("cost ratio (MTP step / trunk step)")
        result["cost_ratio"] = cost_ratio(a.model, a.mtp, n_tokens=a.cost_tokens,
                                          threads=a.threads, policy=a.policy)
    if a.out:
        save(result, a.out)
        log(f"results: {a.out}")
    if a.json:
        print(json.dumps({"out": a.out, "summary": result["summary"],
                          "break_even": result["break_even"],
                          "cost_ratio": result.get("cost_ratio")}, default=float))
        return 0
    import pandas as pd

    pd.set_option("display.width", 200)
    print(pd.DataFrame(result["summary"]).round(3).to_string(index=False))
    print(pd.DataFrame(result["break_even"]).round(3).to_string(index=False))
    return 0


def register(sub) -> None:
    p = sub.add_parser(
        "compare-upstream", help="side by side with upstream's own C++ MTP loop (opt-in)",
        description="Build upstream's llama-server from the pinned sdist once (cached in "
        "~/.cache/mtplib/upstream-tools/<commit>/, about 9 minutes on 2 cores), then run the "
        "same trunk and mtp- sidecar through upstream (--spec-type draft-mtp -md SIDECAR "
        "--spec-draft-n-max k [--spec-synth-rates ...]) and through mtplib: plain decoding, "
        "real MTP drafts and synthetic acceptance, interleaved A/B; prints decode tok/s "
        "medians and the ratio mtplib / upstream per case.")
    add_option(p, "--model", help="trunk GGUF")
    add_option(p, "--mtp", help="its mtp- sidecar GGUF")
    p.add_argument("--k", type=_ks, default=(1, 2, 3),
                   help="draft lengths (0: plain decoding only)")
    p.add_argument("--rates", default="0;0.77,0.37;1",
                   help="synthetic rate sets, ';'-separated, each comma-separated "
                   "unconditional per-position probabilities (upstream --spec-synth-rates), "
                   "padded with the last value / cut to k")
    p.add_argument("--no-real-mtp", action="store_true",
                   help="skip the cases with real (non-synthetic) MTP drafts")
    p.add_argument("--runs", type=int, default=5, help="measured runs per engine and case")
    p.add_argument("--warmup", type=int, default=1, help="warm-up runs per engine and case")
    add_option(p, "--threads", type=int, default=2, help="CPU threads (both engines)")
    add_option(p, "--ctx", type=int, default=None,
                   help=f"context size, both engines (default: min({DEFAULT_CTX}, the "
                   "model's context_length)); a value above context_length is refused")
    p.add_argument("--swa-full", default="off", choices=["on", "off"],
                   help="full-size SWA cache on both sides (off: llama-server's default; "
                   "mtplib's own default is on, the C API's)")
    add_option(p, "--n", type=int, default=128, help="tokens to generate per run")
    p.add_argument("--prompt-len", type=int, default=32, help="seeded random prompt length")
    p.add_argument("--seed", type=int, default=0, help="synthetic acceptance seed (both)")
    p.add_argument("--cost-ratio", action="store_true",
                   help="also measure the MTP-step / trunk-step decode time ratio")
    p.add_argument("--sweep", metavar="RATES",
                   help="mtplib only (no upstream): the acceptance sweep at these synthetic "
                   "rates (comma-separated, the same rate at every position) for each --k, "
                   "with MTP off interleaved; speed-up and break-even rate per k")
    p.add_argument("--cost-ratio-only", action="store_true",
                   help="mtplib only (no upstream): measure the MTP-step / trunk-step "
                   "one-token decode time ratio (medians over --cost-tokens interleaved "
                   "decodes) and exit")
    p.add_argument("--cost-tokens", type=int, default=300,
                   help="one-token decodes per side for the cost ratio")
    p.add_argument("--out", help="results JSON (server logs go next to it)")
    p.add_argument("--sdist", help="the pinned llama-cpp-python sdist (default: known "
                   "locations, else pip download)")
    p.add_argument("--jobs", type=int, default=2, help="build parallelism")
    p.add_argument("--rebuild", action="store_true", help="rebuild upstream's tools")
    p.add_argument("--build-only", action="store_true", help="build (or check) and exit")
    p.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    add_json_arg(p, "the result (summary, break-even, cost ratio, paths)")
    p.add_argument("--policy", choices=["alpha", "beta"], default=None,
                   help="deployment policy (default: $MTPLIB_POLICY, else beta); alpha "
                   "refuses every mode that runs MTP, before upstream's tools are built")
    p.set_defaults(fn=run)
