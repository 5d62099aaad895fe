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
`cold`) and holds the entry point ``python -m mtplib.lab.wan`` (`main`, run by the package's
``__main__``); the rest lives by concern, one module each: the config in `config`, the
links, prompts and context in `inputs`, the typed runs in `runs`, the cells in `cells`,
resuming and the checkpoint in `resume`, the summaries in `summary`, the results folder in
`files`, the plots in `plots` and one process per build in `builds`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from mtplib.errors import InputError
from mtplib.lab.wan.builds import PROGRESS_PREFIX
from mtplib.lab.wan.cells import cells, make_cell, n_runs, warm_cells
from mtplib.lab.wan.cold import run_cold
from mtplib.lab.wan.config import LOG, WanConfig, with_upstream
from mtplib.lab.wan.files import finish
from mtplib.lab.wan.inputs import decode_settings, links_for, trained_prompts
from mtplib.lab.wan.resume import Resumed, RunProgress, resume
from mtplib.lab.wan.runs import run_row


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
    st = RunProgress(cfg, prior, n_runs(cfg, len(prompts), prior.done), out_dir, upstream, log,
                     progress)
    if "warm" in cfg.modes:
        _run_warm(trunk, sidecar, cfg, prompts, st, warm_prompt)
    if "cold" in cfg.modes:
        run_cold(trunk, sidecar, cfg, prompts, st)
    return st.result()


def _run_warm(trunk, sidecar, cfg: WanConfig, prompts, st: RunProgress, warm_prompt) -> None:
    """One RangedMTP per (plan, topology, placement), every RTT, bandwidth and k on it;
    one whose cells are all done is not loaded."""
    from mtplib.distributed.ranged_mtp import RangedMTP
    from mtplib.runtime import selected_upstream
    from mtplib.runtime.engine_options import EngineOptions
    from mtplib.runtime.request import build_request

    settings = decode_settings(cfg, trunk)
    # each draft length's generation options, made (and checked) once for the whole run
    by_k = {k: EngineOptions(k=k, settings=settings, head=cfg.head) for k in cfg.ks}
    # the stock build moves cache state with MTP on: measured deliberately, for comparison
    crossing = selected_upstream() == "stock"
    log = st.log
    for plan in cfg.plans:
        for topo in cfg.topologies:
            for place in cfg.placements:
                todo = [c for c in warm_cells(cfg, plan, topo, place) if c not in st.done]
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
                                cell = make_cell("warm", plan, topo, place if k else "-", rtt,
                                                 mbit, k)
                                if cell not in todo:
                                    continue  # done before, or MTP off of another place

                                def one(prompt, kw, opts=by_k[k]):
                                    toks, m = r.generate(list(prompt), cfg.n_new, opts)
                                    return run_row(m, toks, **kw)
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
