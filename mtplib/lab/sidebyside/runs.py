"""The side-by-side's typed rows and summary (`mtplib.lab.sidebyside`): one run of one engine in
one case (`SideRun`), the per-case summary (`summarize`) and its table (`table`).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from mtplib.errors import InputError
from mtplib.lab.common.acceptance_sweep import median_or_none
from mtplib.lab.common.tables import row_from_dict, typed
from mtplib.lab.sidebyside.cases import ENGINES

#: the fields only one engine's runs have (the other's rows lack the keys)
UPSTREAM_ONLY = ("decode_ms", "prompt_n", "prompt_tok_s", "argv")
MTPLIB_ONLY = ("time_s", "hidden_rows")


@dataclass(frozen=True)
class SideRun:
    """One run of one engine in one case: a row of a side-by-side file's ``rows``. Built
    typed where it is measured (`_UpstreamSide.run`, `_MtplibSide.run`), read typed by
    `summarize`; a dict (`to_dict`) in the file only. An upstream run has the server's
    timings (`UPSTREAM_ONLY`), an mtplib run its time split and hidden-row mode
    (`MTPLIB_ONLY`)."""

    decode_tok_s: float | None
    n_generated: int
    drafted: int
    accepted: int
    acceptance_rate: float | None
    tokens: list[int]
    case: str
    k: int
    rates: list[float] | None
    synthetic: bool
    engine: str  # one of ENGINES
    rep: int | None  # None: a warm-up
    warmup: bool
    loadavg_before: list[float]
    loadavg_after: list[float]
    quality_valid: bool
    decode_ms: float | None = None
    prompt_n: int | None = None
    prompt_tok_s: float | None = None
    argv: list[str] | None = None
    time_s: dict[str, float] | None = None
    hidden_rows: str | None = None

    def to_dict(self) -> dict:
        """The row as the committed files hold it: the measured numbers (upstream's timings
        after n_generated, mtplib's time split after the tokens), the case, upstream's argv
        last."""
        d = asdict(self)
        up = {f: d.pop(f) for f in UPSTREAM_ONLY}
        mt = {f: d.pop(f) for f in MTPLIB_ONLY}
        upstream = self.engine == "upstream"
        head = {f: d.pop(f) for f in ("decode_tok_s", "n_generated")}
        counts = {f: d.pop(f) for f in ("drafted", "accepted", "acceptance_rate", "tokens")}
        timings = {f: up[f] for f in UPSTREAM_ONLY[:3]} if upstream else {}
        return {**head, **timings, **counts, **({} if upstream else mt), **d,
                **({"argv": up["argv"]} if upstream else {})}

    @classmethod
    def from_dict(cls, r: dict) -> SideRun:
        """A row of a side-by-side file (its engine's own keys must be there too)."""
        engine = r.get("engine")
        if engine not in ENGINES:
            raise InputError(f"a side-by-side row's engine must be one of {ENGINES}, "
                             f"got {engine!r}")
        return row_from_dict(cls, r, f"a side-by-side {engine} row",
                             UPSTREAM_ONLY if engine == "upstream" else MTPLIB_ONLY)


def summarize(rows: Sequence[SideRun | dict]) -> list[dict]:
    """One row per case: median decode tok/s of each engine, ratio mtplib / upstream,
    accepted / drafted of each, token agreement, load average range."""
    out = []
    runs = typed(SideRun, rows)
    labels = list(dict.fromkeys(r.case for r in runs))
    for label in labels:
        rs = [r for r in runs if r.case == label and not r.warmup]
        by = {e: [r for r in rs if r.engine == e] for e in ENGINES}
        med = {e: median_or_none(r.decode_tok_s for r in by[e]) for e in ENGINES}
        first = rs[0]
        la = [r.loadavg_before[0] for r in rs] + [r.loadavg_after[0] for r in rs]
        row = {"case": label, "k": first.k, "rates": first.rates,
               "synthetic": first.synthetic, "runs": min(len(by[e]) for e in ENGINES),
               "upstream_tok_s": med["upstream"], "mtplib_tok_s": med["mtplib"],
               "ratio": (med["mtplib"] / med["upstream"]) if med["upstream"] else None,
               "upstream_tok_s_min_max": _minmax(by["upstream"]),
               "mtplib_tok_s_min_max": _minmax(by["mtplib"]),
               "loadavg_1m_min_max": [min(la), max(la)] if la else None}
        for e in ENGINES:
            d = sum(r.drafted for r in by[e])
            a = sum(r.accepted for r in by[e])
            row[f"{e}_acceptance"] = a / d if d else None
            row[f"{e}_accepted_drafted_per_run"] = [by[e][0].accepted, by[e][0].drafted] \
                if by[e] else None
        if not first.synthetic and by["upstream"] and by["mtplib"]:
            u, m = by["upstream"][0].tokens, by["mtplib"][0].tokens
            row["tokens_equal"] = u == m
            row["first_token_divergence"] = next(
                (i for i, (a, b) in enumerate(zip(u, m, strict=False)) if a != b), None)
        out.append(row)
    return out


def _minmax(rs: list[SideRun]) -> list[float] | None:
    xs = [r.decode_tok_s for r in rs if r.decode_tok_s is not None]
    return [min(xs), max(xs)] if xs else None


def table(path: str | Path):
    """The side-by-side table of a results JSON (pandas DataFrame, one row per case)."""
    import pandas as pd

    data = json.loads(Path(path).read_text())
    s = pd.DataFrame(data["summary"])
    cols = ["case", "k", "rates", "runs", "upstream_tok_s", "mtplib_tok_s", "ratio",
            "upstream_acceptance", "mtplib_acceptance", "loadavg_1m_min_max"]
    if "tokens_equal" in s:
        cols.append("tokens_equal")
    return s[[c for c in cols if c in s]].round(3)
