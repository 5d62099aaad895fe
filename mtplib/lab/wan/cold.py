"""The WAN benchmark's cold mode (`mtplib.lab.wan`): one `mtplib generate --json` process per
generation with the CLI's defaults, on shards it starts or on `mtplib shard serve`
processes started once (`LocalShards`).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Sequence
from pathlib import Path

from mtplib.distributed.results import RangedMetrics
from mtplib.errors import InputError
from mtplib.lab.wan.cells import cells, cold_ks, make_cell
from mtplib.lab.wan.config import WanConfig
from mtplib.lab.wan.inputs import wan_arg
from mtplib.lab.wan.resume import RunProgress
from mtplib.lab.wan.runs import run_row
from mtplib.runtime.request import DEFAULT_SEAM


def cli_generate(trunk: str, sidecar: str | None, *, plan: str, k: int, tokens: Sequence[int],
                 n_new: int, wan: str, n_ctx: int | None = None,
                 endpoints: Sequence[str] | None = None, seam: str = DEFAULT_SEAM
                 ) -> list[str]:
    """The `mtplib generate` command line of one cold run: the CLI's defaults except the
    model, the plan, MTP, the emulated WAN, the running shards when ``endpoints`` are given
    (else the CLI starts its own), --ctx only if the config fixes one and --seam only
    where it is not the default (`DEFAULT_SEAM`, the CLI's)."""
    import shutil
    import sys

    exe = Path(sys.executable).with_name("mtplib")
    cmd = [str(exe)] if exe.is_file() else (
        [shutil.which("mtplib")] if shutil.which("mtplib") else
        [sys.executable, "-m", "mtplib.cli"])
    cmd += ["generate", "--model", trunk, "--plan", plan, "--tokens",
            ",".join(str(int(t)) for t in tokens), "--n", str(n_new), "--wan", wan, "--json"]
    if endpoints:
        cmd += ["--endpoints", ",".join(endpoints)]
    if k:
        cmd += ["--mtp", str(sidecar), "--draft", str(k)]
    if n_ctx is not None:
        cmd += ["--ctx", str(n_ctx)]
    if seam != DEFAULT_SEAM:
        cmd += ["--seam", seam]
    return cmd


def run_cold(trunk, sidecar, cfg: WanConfig, prompts, st: RunProgress) -> None:
    """One fresh `mtplib generate` process per generation; its wall time is recorded beside
    its own metrics. ``cold_shards="endpoints"``: the shards (`LocalShards`: `mtplib shard
    serve` processes on free loopback ports, the shard CLI's defaults) are started once for
    every cold cell and stopped at the end, on an error or Ctrl-C too."""
    from mtplib.distributed.processes import LocalShards

    log = st.log
    ks = cold_ks(cfg)
    if len(ks) < len(cfg.cold_ks):
        log("cold: the stock build refuses ranged MTP by default; MTP off only")
    todo = [c for c in cells(cfg) if c[0] == "cold" and c not in st.done]
    if not todo:
        if any(c[0] == "cold" for c in cells(cfg)):
            log("cold: every cell done before")
        return
    with contextlib.ExitStack() as stack:
        shards = None
        if cfg.cold_shards == "endpoints":
            n_max = max(c[1].count(",") + 1 for c in todo)
            shards = stack.enter_context(LocalShards(n_max, cfg.shard_threads))
            log(f"cold: {n_max} shard processes on this host: {', '.join(shards.endpoints)}")
        for plan in cfg.plans:
            n_shards = plan.count(",") + 1
            eps = None if shards is None else shards.endpoints[:n_shards]
            for topo in cfg.topologies:
                for rtt in cfg.cold_rtts_ms:
                    for mbit in cfg.mbits:
                        wan = wan_arg(topo, n_shards, rtt, mbit)
                        for k in ks:
                            cell = make_cell("cold", plan, topo, "*", rtt, mbit, k)
                            if cell not in todo:
                                continue
                            log(f"cold: plan {plan}, {topo}, --wan {wan}, k={k}")

                            def one(prompt, kw, wan=wan, eps=eps):
                                cmd = cli_generate(trunk, sidecar, plan=kw["plan"], k=kw["k"],
                                                   tokens=prompt, n_new=cfg.n_new, wan=wan,
                                                   n_ctx=cfg.n_ctx, endpoints=eps,
                                                   seam=cfg.seam)
                                return _cold_run(cmd, **kw)
                            st.measure(cell, prompts, one, plan=plan, topology=topo,
                                       rtt_ms=rtt, mbit=mbit, k=k)


def run_cli_json(cmd: list[str], timeout_s: float = 900,
                 env: dict[str, str] | None = None) -> tuple[int, dict, float]:
    """One `mtplib generate --json` process (``env``: its environment, default this
    process's): (exit code, its last stdout line as JSON, or ``{"error": the output's
    tail}`` when there is none, wall seconds)."""
    import json
    import subprocess

    t0 = time.time()
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=env)
    wall = time.time() - t0
    try:
        out = json.loads(p.stdout.strip().splitlines()[-1])
    except (json.JSONDecodeError, IndexError):
        out = {"error": (p.stderr or p.stdout)[-600:]}
    return p.returncode, out, wall


def seam_run(trunk: str, sidecar: str, *, plan: str, k: int, prompt: Sequence[int], n: int,
             wan: str, seam: str) -> dict:
    """One fresh `mtplib generate --json` process with the CLI's defaults and ``--seam``
    (evidence/upstream-patches' ring_tokens.py and ring_rtt.py): its tokens, tokens/s,
    TTFT, waits per step (and what the prefill's waited on) and which seam ran; InputError
    naming the command when it failed."""
    cmd = [*cli_generate(trunk, sidecar, plan=plan, k=k, tokens=prompt, n_new=n, wan=wan),
           "--seam", seam]
    rc, out, wall = run_cli_json(cmd)
    if "error" in out or rc != 0:
        raise InputError(f"{' '.join(cmd[:8])} ... --seam {seam} failed (exit {rc}): "
                         f"{out.get('error')}")
    m = RangedMetrics.from_dict(out["metrics"])
    steps = m.verify_steps + m.plain_steps
    prefill = m.seam_report.get("steps", {}).get("prefill", {})
    return {"seam_asked": seam, "k": k, "wan": wan, "tokens": out["tokens"],
            "decode_tok_s": m.decode_tok_s, "ttft_s": m.ttft_s,
            "tokens_per_step": (m.n_generated - 1) / steps if steps else None,
            "acceptance_rate": m.acceptance_rate,
            "waits_per_step": m.waits_per_step,
            # None in results of a build whose relays did not count waits by command
            "prefill_waits_by_command": prefill.get("waits_by_command"), "seam": m.seam,
            "cache_bytes_crossing": m.cache_bytes_crossing, "process_wall_s": wall}


def _cold_run(cmd: list[str], *, k: int, **coords) -> dict:
    """One CLI process and its row; InputError with its message when it failed."""
    rc, out, wall = run_cli_json(cmd)
    if "error" in out or rc not in (0, 3):
        raise InputError(f"cold run failed (exit {rc}): {' '.join(cmd[:12])} ...: "
                         f"{out.get('error')}")
    m = RangedMetrics.from_dict(out["metrics"])  # the CLI's JSON
    return run_row(m, out["tokens"], mode="cold", k=k,
                   placement=(m.mtp_placement or "-") if k else "-", process_wall_s=wall,
                   exit=rc, shards="local" if m.local_shards else "endpoints", **coords)
