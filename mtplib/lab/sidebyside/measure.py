"""mtplib's Python MTP loop side by side with upstream's own C++ loop, on the same files.

Three measurements, each saved as one JSON file; the runs of the side-by-side and of the
sweep are typed rows (`SideRun`, `SweepRun`) until they are written, and their summaries read
them typed (`from_dict` for the rows of a file):

- **cost ratio** (`cost_ratio`): one-token decode time of the MTP block (MTP context, one
  token + one hidden row) over one-token decode time of the trunk, timed around the
  `llama_decode` call only (no Python loop around it), interleaved trunk / MTP, median of
  many tokens. The quantity the `v4-ratio-cpu` preset is sized by (real V4-Flash: ~1/43).
- **side by side** (`run_side_by_side`): per case (plain decoding; k drafts with real MTP
  drafts; k drafts with upstream's synthetic acceptance ``--spec-synth-rates``), the same
  trunk, sidecar, prompt (token ids), threads, context, batch sizes, k and rates through
  upstream's `llama-server` (`mtplib.lab.upstream_tools`) and through `MTPRuntime`. Runs are
  interleaved A/B within a case (warm-up of each first, then U M, M U, U M, ...), the
  load average is read before and after every run; decode tok/s is each side's own
  measure of the same quantity ((n_new - 1) / time from the first to the last token).
  Ratio = median mtplib / median upstream.
- **acceptance sweep** (`acceptance_sweep`): mtplib only, MTP off and k = 1..3 at
  synthetic rates (the same rate at every position, upstream's unconditional semantics)
  with the real MTP block drafting every step; speed-up over MTP off and the break-even
  rate per k.

Policy: each of the three runs MTP, so each first asks `mtplib.runtime.routing.require_mtp`
(the deployment policy through `negotiate()`, as MTPRuntime does) for every draft length
it will run, before it loads a model or starts upstream's server; under alpha it raises
RouteRefused naming the policy (exit 2 from `mtplib compare-upstream`).

`table(path)` renders the side-by-side table from the JSON (a pandas DataFrame) for the
benchmark notebook; `sweep_table(path)` / `break_even(rows)` the sweep.

This module runs the side by side (`run_side_by_side`, one `_UpstreamSide` and one
`_MtplibSide` per case) and finds and writes its files; the rest lives by concern, one module
each: the config, cases and A/B order in `cases`, the typed runs and summary in `runs`, what
is recorded of the machine in `machine`, the cost ratio in `cost`, the acceptance sweep in
`sweep` and its plots in `sweep_plots`.
"""

from __future__ import annotations

import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from mtplib import host, paths
from mtplib.contract.capabilities import Policy
from mtplib.files import write_json
from mtplib.lab.correctness import seeded_prompt
from mtplib.lab.sidebyside.cases import (
    LOG,
    Case,
    SideBySideConfig,
    ab_order,
    make_cases,
)
from mtplib.lab.sidebyside.machine import host_info, loadavg
from mtplib.lab.sidebyside.runs import SideRun, summarize
from mtplib.runtime import build_info
from mtplib.runtime.routing import require_mtp


class _MtplibSide:
    """One MTPRuntime per case; synthetic cases get a fresh SyntheticDrafter per run (the
    same seed, as upstream reseeds per request) wrapping the real MTP drafter."""

    def __init__(self, trunk: str, sidecar: str, case: Case, cfg: SideBySideConfig,
                 policy: Policy | str | None = None) -> None:
        from mtplib.runtime.speculative import MTPRuntime

        self.case, self.cfg = case, cfg
        self.rt = MTPRuntime(trunk, sidecar if case.k else None, k=case.k,
                             settings=cfg.settings, policy=policy)
        self.mtp = self.rt.engine.drafter

    def run(self, prompt: list[int], ref: list[int] | None, **case: Any) -> SideRun:
        from mtplib.runtime.drafters import SyntheticDrafter

        if self.case.synthetic:
            self.rt.engine.drafter = SyntheticDrafter(
                ref or [0], len(prompt), list(self.case.rates), self.rt.trunk.n_vocab,
                seed=self.cfg.synth_seed, inner=self.mtp)
        try:
            toks, g = self.rt.generate(prompt, self.cfg.n_new)
        finally:
            self.rt.engine.drafter = self.mtp
        return SideRun(decode_tok_s=g.decode_tok_s, n_generated=g.n_generated,
                       drafted=g.drafted, accepted=g.accepted,
                       acceptance_rate=g.acceptance_rate, tokens=toks,
                       time_s=dict(g.time_s), hidden_rows=g.hidden_rows,
                       loadavg_after=loadavg(), **case)

    def close(self) -> None:
        self.rt.close()


class _UpstreamSide:
    def __init__(self, trunk: str, sidecar: str, case: Case, cfg: SideBySideConfig,
                 log_path: Path | None, policy: Policy | str | None = None) -> None:
        from mtplib.lab.upstream_tools import Server, ServerConfig

        if case.k:  # upstream's own MTP loop is an MTP path like ours
            require_mtp("upstream's MTP loop (llama-server)", (case.k,), policy=policy)
        self.server = Server(ServerConfig(
            model=trunk, mtp=sidecar if case.k else None, k=case.k,
            rates=list(case.rates) if case.rates else None, settings=cfg.settings,
            seed=cfg.synth_seed),
            log_path=log_path)
        self.argv = self.server.cfg.argv(self.server.binary, self.server.port)

        self.n_new = cfg.n_new

    def run(self, prompt: list[int], ref: list[int] | None, **case: Any) -> SideRun:
        from mtplib.lab.upstream_tools import parse_completion

        c = parse_completion(self.server.complete(prompt, self.n_new))
        return SideRun(**asdict(c), argv=self.argv, loadavg_after=loadavg(), **case)

    def close(self) -> None:
        self.server.close()


def run_side_by_side(trunk: str, sidecar: str, cfg: SideBySideConfig, *,
                     log: LOG | None = None, log_dir: Path | None = None,
                     policy: Policy | str | None = None) -> dict:
    """Every case through upstream's llama-server and mtplib, interleaved A/B. Every MTP
    case's draft length is routed under ``policy`` before any server starts."""
    from mtplib.model.gguf_header import read_header

    cases = make_cases(cfg.ks, cfg.rate_sets, real_mtp=cfg.real_mtp)
    pol = require_mtp("side-by-side", sorted({c.k for c in cases if c.k}), policy=policy)
    log = log or (lambda s: None)
    t0 = time.time()
    prov = host.provenance(paths.REPO, build_info(), list(sys.argv))  # what this run ran
    n_vocab = read_header(trunk).n_vocab
    prompt = seeded_prompt(cfg.prompt_seed, cfg.n_prompt, n_vocab)
    rows: list[SideRun] = []
    ref: list[int] | None = None
    for case in cases:
        log(f"{case.label}: starting upstream server and mtplib runtime")
        la0 = loadavg()
        up = _UpstreamSide(trunk, sidecar, case, cfg,
                           (log_dir / f"server-{_slug(case.label)}.log") if log_dir else None,
                           policy=pol)
        mt = _MtplibSide(trunk, sidecar, case, cfg, policy=pol)
        try:
            sides = {"upstream": up, "mtplib": mt}
            for rep, engine in ab_order(cfg.runs, cfg.warmup):
                la = loadavg()
                r = sides[engine].run(prompt, ref, case=case.label, k=case.k,
                                      rates=list(case.rates) if case.rates else None,
                                      synthetic=case.synthetic, engine=engine, rep=rep,
                                      warmup=rep is None, loadavg_before=la,
                                      quality_valid=not case.synthetic)
                rows.append(r)
                log(f"  {engine:8s} rep={rep} {r.decode_tok_s:.1f} tok/s "
                    f"acc={r.accepted}/{r.drafted} load={la[0]:.2f}")
            if case.k == 0 and ref is None:  # MTP-off output: the synthetic reference
                ref = next(r.tokens for r in rows
                           if r.case == "plain" and r.engine == "mtplib")
        finally:
            up.close()
            mt.close()
        log(f"{case.label}: load {la0} -> {loadavg()}")
    return {"kind": "side-by-side", "config": cfg.to_dict(), "trunk": str(trunk),
            "sidecar": str(sidecar), "prompt": prompt, "rows": [r.to_dict() for r in rows],
            "summary": summarize(rows), "host": host_info(), "wall_s": time.time() - t0,
            "provenance": host.finish(prov)}


#: where the committed side-by-side results live (issue 7)
EVIDENCE_DIR = paths.EVIDENCE / "side-by-side"


def evidence_dir(path: str | Path | None = None) -> Path:
    """A results folder; relative paths are taken from the repository root, so a notebook
    finds the committed files whatever its working directory."""
    if path is None:
        return EVIDENCE_DIR
    p = Path(path)
    return p if p.is_absolute() else EVIDENCE_DIR.parents[1] / p


def _slug(s: str) -> str:
    return "".join(c if c.isalnum() else "-" for c in s).strip("-")


def save(result: dict, path: str | Path) -> Path:
    """Write one result (side-by-side, cost ratio or sweep) as JSON at ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json(path, result, indent=1, default=float)
    return path
