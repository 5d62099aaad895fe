"""Ranged MTP over an emulated WAN: tokens/s against round-trip time, and why.

Every shard of a plan runs behind a counting relay that delays each chunk by half the RTT
each way and, with a bandwidth (``mbits``), caps each direction of the link at that many
Mbit/s (`mtplib.distributed.relay.WanLink`). Two topologies: ``remote`` (every shard
behind the WAN) and ``tail_local`` (the tail shard co-located with the client: its relay has
no delay). Two drafter placements: the MTP block on the tail shard or in the client. For
each (plan, topology, placement) one set of shards and one loaded model serve every RTT and
draft length; MTP off is measured on the same connections.

Two modes. ``warm``: one `RangedMTP` (the object `mtplib serve` holds) serves every
generation of a configuration; its engines are warmed at load, never on a measured prompt.
``cold``: one `mtplib generate --json` process per generation with the CLI's default options
(drafter and head placement, upstream build, context size), as a user runs it; only
``--plan``, ``--mtp/--draft`` and ``--wan`` are given. ``cold_shards``: ``local`` (the CLI
starts its shards, one set per process) or ``endpoints`` (``mtplib shard serve`` processes
started once on this host, each run given ``--endpoints``: how a user tries shards first).

A run resumes (`run_wan` with ``out_dir``): each finished cell (mode, plan, topology,
placement, RTT, bandwidth, k) is written to ``wan.partial.json`` at once; a rerun into the
same folder keeps those rows as they are and measures only the cells still missing, and
refuses a folder measured with another build or other per-run settings.

Each run records tokens/s, tokens per verify step, waits (synchronous round trips) per step
kind, data bytes per step kind by class (`mtplib.contract.wire`) and the cache bytes that
crossed a shard connection (must be 0: the contract's shard-local rule). The cost model
``t_token = compute + RTT x waits_per_token + bytes / bandwidth`` is fitted per
configuration on some RTTs and checked on the others (`fit_cost_model`).

This module runs the cells (`run_wan`: the warm mode's loop here, the cold mode's in
`wan_cold`) and is the entry point of ``python -m mtplib.lab.wan``; the rest lives by
concern, and every name is exported here as before: the config in `wan_config`, the links,
prompts and context in `wan_inputs`, the typed rows in `wan_rows`, the cells in `wan_cells`,
resuming and the checkpoint in `wan_resume`, the summaries in `wan_summary`, the results
folder in `wan_files`, the plots in `wan_plots` and one process per build in `wan_builds`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from mtplib.errors import InputError
from mtplib.lab.wan_builds import PROGRESS_PREFIX, run_builds
from mtplib.lab.wan_cells import Cell, _cell, _n_runs, _warm_cells, cell_of, cells, cold_ks
from mtplib.lab.wan_cold import _run_cold, cli_generate
from mtplib.lab.wan_config import (
    COLD_SHARDS,
    DECODE_PHASES,
    LOG,
    MODES,
    PLACEMENTS,
    TOPOLOGIES,
    WanConfig,
    with_upstream,
)
from mtplib.lab.wan_files import (
    PARTIAL_JSON,
    WAN_JSON,
    build_dirs,
    build_of,
    finish,
    load,
    load_builds,
    resummarize,
    save,
    write_summary_csv,
)
from mtplib.lab.wan_inputs import _settings, default_ctx, links_for, trained_prompts, wan_arg
from mtplib.lab.wan_plots import (
    WAN_MODEL,
    bandwidth_text,
    plot_bandwidth,
    plot_builds,
    plot_rtt,
    plot_rtt_pair,
)
from mtplib.lab.wan_resume import COLD_RESUME_FIELDS, RESUME_FIELDS, Resumed, _Progress, resume
from mtplib.lab.wan_rows import WanRun, _row
from mtplib.lab.wan_summary import bytes_by_class, fit_cost_model, has_bandwidth, summarize, targets

__all__ = [
    "main", "run_wan",
    "COLD_RESUME_FIELDS", "COLD_SHARDS", "Cell", "DECODE_PHASES", "LOG", "MODES", "PARTIAL_JSON",
    "PLACEMENTS", "PROGRESS_PREFIX", "RESUME_FIELDS", "Resumed", "TOPOLOGIES", "WAN_JSON",
    "WAN_MODEL", "WanConfig", "WanRun", "_Progress", "_row", "_settings", "bandwidth_text",
    "build_dirs", "build_of", "bytes_by_class", "cell_of", "cells", "cli_generate", "cold_ks",
    "default_ctx", "finish", "fit_cost_model", "has_bandwidth", "links_for", "load", "load_builds",
    "plot_bandwidth", "plot_builds", "plot_rtt", "plot_rtt_pair", "resume", "resummarize",
    "run_builds", "save", "summarize", "targets", "trained_prompts", "wan_arg", "with_upstream",
    "write_summary_csv",
]


def run_wan(trunk: str, sidecar: str, cfg: WanConfig, prompts: Sequence[Sequence[int]], *,
            log: LOG | None = None, progress: Callable[[int, int], None] | None = None,
            warm_prompt: Sequence[int] | None = None, out_dir=None,
            upstream: dict | None = None) -> dict:
    """Measure every cell of ``cfg`` in each of its modes; returns {"config", "rows",
    "wall_s", "sessions"} (and "upstream" when given). ``warm_prompt``: the held-out prompt
    of ``cfg.warmup``'s untimed generations (never one that is measured). ``out_dir``:
    resume from and checkpoint into its `PARTIAL_JSON` (`resume`); ``upstream``: the build
    this process loads (`mtplib.runtime.lib.upstream_info`), recorded and checked there."""
    log = log or (lambda s: None)
    cfg = with_upstream(cfg)  # the build this process loads, as every row records it
    if len(prompts) != cfg.n_prompts:
        raise InputError(f"wan: {len(prompts)} prompts for n_prompts {cfg.n_prompts}")
    prior = resume(out_dir, cfg, upstream) if out_dir is not None else Resumed()
    if prior.done:
        log(f"resuming {prior.source}: {len(prior.done)} cells kept, "
            f"{len(cells(cfg)) - len(prior.done)} to measure")
    st = _Progress(cfg, prior, _n_runs(cfg, len(prompts), prior.done), out_dir, upstream, log,
                   progress)
    if "warm" in cfg.modes:
        _run_warm(trunk, sidecar, cfg, prompts, st, warm_prompt)
    if "cold" in cfg.modes:
        _run_cold(trunk, sidecar, cfg, prompts, st)
    return st.result()


def _run_warm(trunk, sidecar, cfg: WanConfig, prompts, st: _Progress, warm_prompt) -> None:
    """One RangedMTP per (plan, topology, placement), every RTT, bandwidth and k on it;
    one whose cells are all done is not loaded."""
    from mtplib.distributed.ranged_mtp import RangedMTP
    from mtplib.runtime import selected_upstream
    from mtplib.runtime.request import build_request
    from mtplib.runtime.speculative import EngineOptions

    settings = _settings(cfg, trunk)
    # each draft length's generation options, made (and checked) once for the whole run
    by_k = {k: EngineOptions(k=k, settings=settings, head=cfg.head) for k in cfg.ks}
    # the stock build moves cache state with MTP on: measured deliberately, for comparison
    crossing = selected_upstream() == "stock"
    log = st.log
    for plan in cfg.plans:
        for topo in cfg.topologies:
            for place in cfg.placements:
                todo = [c for c in _warm_cells(cfg, plan, topo, place) if c not in st.done]
                if not todo:
                    log(f"warm: plan {plan}, {topo}, MTP on the {place}: done before")
                    continue
                log(f"warm: plan {plan}, {topo}, MTP on the {place}")
                # this RangedMTP's request, checked once (`build_request`); its default
                # options are the longest draft's
                req = build_request(trunk, sidecar=sidecar, plan=plan,
                                    opts=by_k[max(cfg.ks)], mtp_placement=place,
                                    shard_threads=cfg.shard_threads,
                                    allow_cache_crossing=crossing, seam=cfg.seam)
                with RangedMTP(req) as r:
                    relays = r.rt.relays.relays
                    if warm_prompt is not None:
                        for k in cfg.ks:  # untimed, on a prompt that is not measured
                            for _ in range(cfg.warmup):
                                r.generate(list(warm_prompt), cfg.n_new, by_k[k])
                    for rtt in cfg.rtts_ms:
                        for mbit in cfg.mbits:
                            links = links_for(topo, len(relays), rtt, mbit)
                            for relay, link in zip(relays, links, strict=True):
                                relay.set_link(link)
                            for k in cfg.ks:
                                cell = _cell("warm", plan, topo, place if k else "-", rtt,
                                             mbit, k)
                                if cell not in todo:
                                    continue  # done before, or MTP off of another place

                                def one(prompt, kw, opts=by_k[k]):
                                    toks, m = r.generate(list(prompt), cfg.n_new, opts)
                                    return _row(m, toks, **kw)
                                st.measure(cell, prompts, one, mode="warm", plan=plan,
                                           topology=topo, placement=place if k else "-",
                                           rtt_ms=rtt, mbit=mbit, k=k)


def main(argv: list[str] | None = None) -> int:
    import argparse
    import json

    ap = argparse.ArgumentParser(prog="python -m mtplib.lab.wan",
                                 description="ranged MTP over an emulated WAN on the trained "
                                 "pair (one upstream build: MTPLIB_UPSTREAM)")
    ap.add_argument("--config", default="{}", help="WanConfig as JSON (default: all defaults)")
    ap.add_argument("--out", required=True, help="folder for wan.json and wan_summary.csv "
                    "(a run there that stopped resumes: its finished cells are kept)")
    ap.add_argument("--progress", action="store_true",
                    help=f"print '{PROGRESS_PREFIX}DONE/TOTAL' after each generation")
    a = ap.parse_args(argv)
    from mtplib.model.trained import trained_paths

    cfg = with_upstream(WanConfig.from_dict(json.loads(a.config)))
    pair = trained_paths()
    # one more held-out prompt than measured: the warm-up's, never measured itself
    *prompts, spare = trained_prompts(cfg.n_prompts + 1, cfg.prompt_len)

    def tick(done: int, total: int) -> None:
        print(f"{PROGRESS_PREFIX}{done}/{total}", flush=True)

    from mtplib.runtime.lib import upstream_info

    # resumes from --out's finished cells (a run that did not fit one session)
    res = run_wan(str(pair.trunk), str(pair.sidecar), cfg, prompts, log=print,
                  progress=tick if a.progress else None, warm_prompt=spare, out_dir=a.out,
                  upstream=upstream_info())
    print(finish(res, a.out)["json"])
    return 0


if __name__ == "__main__":
    import sys

    try:
        raise SystemExit(main())
    except InputError as e:  # a refused config or folder: its one line, not a traceback
        print(f"python -m mtplib.lab.wan: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
