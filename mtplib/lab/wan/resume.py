"""Resuming a WAN run (`mtplib.lab.wan`): the finished cells a results folder already holds,
checked against the config and the build (`resume`), and the rows and checkpoint of the
run in progress (`RunProgress`), written after every finished cell.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from mtplib import host, paths
from mtplib.errors import InputError
from mtplib.files import write_json
from mtplib.lab.common.acceptance_sweep import median_or_none
from mtplib.lab.wan.cells import Cell, cell_of, cell_text, cells
from mtplib.lab.wan.config import LOG, WanConfig
from mtplib.lab.wan.files import PARTIAL_JSON, WAN_JSON
from mtplib.lab.wan.runs import typed_runs
from mtplib.runtime import build_info

#: WanConfig fields a cell's rows depend on besides its coordinates: a folder measured
#: with other values is refused, never resumed into
RESUME_FIELDS = ("head", "n_prompts", "prompt_len", "n_new", "reps", "warmup", "n_ctx",
                 "threads", "shard_threads", "upstream", "seam")
#: the same for cold cells only
COLD_RESUME_FIELDS = ("cold_shards",)
#: what a field's absence from a results folder's config means: the value every run had
#: before the field was recorded (a config without ``seam`` ran the star, whatever the
#: default is now), not today's default
UNRECORDED = {"seam": "star"}


@dataclass
class Resumed:
    """What a results folder already holds for a config: its rows (kept as they are), the
    cells they complete, and the earlier sessions' wall time."""

    rows: list[dict] = field(default_factory=list)
    done: set[Cell] = field(default_factory=set)
    sessions: list[dict] = field(default_factory=list)
    source: Path | None = None


def resume(out_dir, cfg: WanConfig, upstream: dict | None) -> Resumed:
    """The finished cells of ``out_dir`` (its wan.partial.json, else its wan.json) that
    ``cfg`` measures, checked: another build or patch set, another value of a
    `RESUME_FIELDS` field, a cell ``cfg`` does not list, or a cell with the wrong number of
    rows is refused (InputError naming it); nothing there: an empty Resumed."""
    import json

    out = Path(out_dir)
    src = next((p for p in (out / PARTIAL_JSON, out / WAN_JSON) if p.is_file()), None)
    if src is None:
        return Resumed()
    try:
        old = json.loads(src.read_text())
        old_cfg, old_rows = old["config"], old["rows"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise InputError(f"{src}: not a readable WAN results file ({e}); move it away to "
                         "measure into this folder") from None
    again = "use another output folder, or move it away to measure afresh"
    rows_cold = any(r.get("mode") == "cold" for r in old_rows)
    fields = RESUME_FIELDS + (COLD_RESUME_FIELDS if rows_cold else ())
    defaults = {**asdict(WanConfig()), **UNRECORDED}
    new = asdict(cfg)
    diff = [f"{f}: {old_cfg.get(f, defaults[f])!r} there, {new[f]!r} now" for f in fields
            if old_cfg.get(f, defaults[f]) != new[f]]
    if upstream is not None:
        was = old.get("upstream") or {}
        for f in ("build", "patches"):
            if f in was and was[f] != upstream.get(f):
                diff.append(f"upstream {f}: {was[f]!r} there, {upstream.get(f)!r} now")
    if diff:
        raise InputError(f"wan: cannot resume into {src}: it was measured with other "
                         f"settings ({'; '.join(diff)}); {again}")
    want = set(cells(cfg))
    by: dict[Cell, list[dict]] = {}
    for r in old_rows:
        by.setdefault(cell_of(r), []).append(r)
    extra = sorted((c for c in by if c not in want), key=str)
    if extra:
        raise InputError(f"wan: cannot resume into {src}: it holds cells this config does "
                         f"not list ({', '.join(map(cell_text, extra[:4]))}"
                         f"{' ...' if len(extra) > 4 else ''}); list them too, or {again}")
    n = cfg.n_prompts * cfg.reps
    short = [c for c, rs in by.items() if len(rs) != n]
    if short:
        raise InputError(f"wan: cannot resume into {src}: cell {cell_text(short[0])} has "
                         f"{len(by[short[0]])} rows, not n_prompts x reps = {n}; {again}")
    return Resumed(rows=list(old_rows), done=set(by), sessions=list(old.get("sessions", [])),
                   source=src)


class RunProgress:
    """Rows, the finished cells and the checkpoint of one `run_wan` call."""

    def __init__(self, cfg: WanConfig, prior: Resumed, total: int, out_dir,
                 upstream: dict | None, log: LOG,
                 progress: Callable[[int, int], None] | None) -> None:
        self.cfg, self.prior, self.total, self.log = cfg, prior, total, log
        self.rows: list[dict] = list(prior.rows)
        self.done: set[Cell] = set(prior.done)
        self.out = None if out_dir is None else Path(out_dir)
        self.upstream, self.progress = upstream, progress
        self.count, self.cells_run, self.t0 = 0, 0, time.time()
        # what this session of the run ran (a resumed run has one per session)
        self.provenance = host.provenance(paths.REPO, build_info(), list(sys.argv))

    def tick(self) -> None:
        self.count += 1
        if self.progress:
            self.progress(self.count, self.total)

    def measure(self, cell: Cell, prompts: Sequence[Sequence[int]],
                one: Callable[[Sequence[int], dict], dict], **coords) -> None:
        """Every generation of one cell (``one(prompt, row fields)`` -> its row; the fields
        are ``coords`` with the prompt's index and the repetition), then the cell as
        finished: its rows are written together or not at all."""
        new = []
        for pi, prompt in enumerate(prompts):
            for rep in range(self.cfg.reps):
                new.append(one(prompt, {**coords, "prompt": pi, "rep": rep}))
                self.tick()
        self.rows += new
        self.finished(cell)
        _log_cell(self.log, new, cell[4], cell[5], cell[6])

    def finished(self, cell: Cell) -> None:
        """A cell's rows are all in: remember it and write the checkpoint."""
        self.done.add(cell)
        self.cells_run += 1
        if self.out is not None:
            self.out.mkdir(parents=True, exist_ok=True)
            write_json(self.out / PARTIAL_JSON, self.result(), indent=1, default=str)

    def result(self) -> dict:
        wall = time.time() - self.t0
        sessions = [*self.prior.sessions, {"wall_s": wall, "cells_run": self.cells_run,
                                           "cells_kept": len(self.prior.done),
                                           "provenance": host.finish(self.provenance)}]
        out = {"config": asdict(self.cfg), "rows": self.rows,
               "wall_s": sum(s["wall_s"] for s in sessions), "sessions": sessions,
               "provenance": sessions[-1]["provenance"]}
        if self.upstream is not None:
            out["upstream"] = self.upstream
        return out


def _log_cell(log, rows, rtt, mbit, k) -> None:
    med = median_or_none(x.decode_tok_s for x in typed_runs(rows))
    bw = "" if mbit is None else f" {mbit:g} Mbit/s"
    log(f"  rtt {rtt:g} ms{bw} k={k}: " + ("n/a" if med is None else f"{med:.2f}") + " tok/s")
