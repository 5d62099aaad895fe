"""The cells of a WAN run (`mtplib.lab.wan`): (mode, plan, topology, placement, RTT, bandwidth,
k), every cell a config measures in the order it runs them (`cells`), and the cell a row
belongs to (`cell_of`).
"""

from __future__ import annotations

from mtplib.lab.wan.config import WanConfig

#: a cell: (mode, plan, topology, placement, RTT ms, Mbit/s or None, k); the placement is
#: the drafter's for a warm run ("-" for MTP off) and "*" for a cold one (the CLI chooses)
Cell = tuple[str, str, str, str, float, float | None, int]


def make_cell(mode: str, plan: str, topology: str, placement: str, rtt_ms: float,
              mbit: float | None, k: int) -> Cell:
    return (mode, plan, topology, "*" if mode == "cold" else placement, float(rtt_ms),
            None if mbit is None else float(mbit), int(k))


def cell_of(row: dict) -> Cell:
    """The cell a wan.json row belongs to (rows without ``mbit`` ran unlimited)."""
    return make_cell(row.get("mode", "warm"), row["plan"], row["topology"], row["placement"],
                     row["rtt_ms"], row.get("mbit"), row["k"])


def cells(cfg: WanConfig) -> list[Cell]:
    """Every cell ``cfg`` measures, in the order `run_wan` runs them."""
    out: list[Cell] = []
    if "warm" in cfg.modes:
        for plan in cfg.plans:
            for topo in cfg.topologies:
                for place in cfg.placements:
                    out += warm_cells(cfg, plan, topo, place)
    if "cold" in cfg.modes:
        for plan in cfg.plans:
            for topo in cfg.topologies:
                for rtt in cfg.cold_rtts_ms:
                    for mbit in cfg.mbits:
                        for k in cold_ks(cfg):
                            out.append(make_cell("cold", plan, topo, "*", rtt, mbit, k))
    return out


def warm_cells(cfg: WanConfig, plan: str, topo: str, place: str) -> list[Cell]:
    """The warm cells one loaded RangedMTP (plan, topology, drafter placement) serves."""
    return [make_cell("warm", plan, topo, place if k else "-", rtt, mbit, k)
            for rtt in cfg.rtts_ms for mbit in cfg.mbits for k in cfg.ks
            # MTP off does not depend on the drafter's place: measured with the first
            if k or place == cfg.placements[0]]


def cold_ks(cfg: WanConfig) -> list[int]:
    """The cold draft lengths this build runs: the CLI refuses ranged MTP on the stock
    build by default (cache state would cross a seam), so there MTP off only."""
    if cfg.upstream == "stock":
        return [k for k in cfg.cold_ks if not k]
    return list(cfg.cold_ks)


def n_runs(cfg: WanConfig, n_prompts: int, skip: set[Cell] = frozenset()) -> int:
    return sum(1 for c in cells(cfg) if c not in skip) * n_prompts * cfg.reps


def cell_text(c: Cell) -> str:
    mode, plan, topo, place, rtt, mbit, k = c
    bw = "unlimited" if mbit is None else f"{mbit:g} Mbit/s"
    return f"{mode} {plan} {topo} {place} {rtt:g} ms {bw} k={k}"
