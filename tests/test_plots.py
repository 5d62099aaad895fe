"""Plots and tables (issue 16): every plot function's figure, drawn from the committed
evidence, has titles naming what and which plan / model, axis labels with units, legends
with unique labels that sit outside every panel and title, and no data in a reference's
colour; tables round and show missing values as n/a."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import matplotlib
import numpy as np
import pandas as pd
import pytest
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.colors import to_hex

from mtplib.contract.labels import STEP_KINDS
from mtplib.lab import correctness_plots as CP
from mtplib.lab.bench import plots as BP
from mtplib.lab.common import display as D
from mtplib.lab.quality import NOISE_BOUND
from mtplib.lab.sidebyside import sweep_plots as SBS
from mtplib.lab.wan import plots as W

matplotlib.use("Agg")
REPO = Path(__file__).resolve().parents[1]
EVIDENCE = REPO / "evidence"
UNIT = re.compile(r"\([^)]+\)")


# -- what every figure must satisfy --------------------------------------------------------
def _overlap(a, b) -> bool:
    return a.x0 < b.x1 - 1 and b.x0 < a.x1 - 1 and a.y0 < b.y1 - 1 and b.y0 < a.y1 - 1


def _colour(c) -> str | None:
    c = np.asarray(c, dtype=float).reshape(-1, 4) if not isinstance(c, str) else c
    if isinstance(c, str):
        return to_hex(c)
    return to_hex(c[0][:3]) if len(c) else None


def _artists(ax):
    """(label, colour) of every line, patch and collection drawn in ``ax``."""
    out = []
    for ln in ax.get_lines():
        out.append((ln.get_label(), to_hex(ln.get_color())))
    for p in ax.patches:
        out.append((p.get_label(), to_hex(p.get_facecolor()[:3])))
    for cont in ax.containers:  # bar containers label their patches
        for p in cont.patches:
            out.append((cont.get_label(), to_hex(p.get_facecolor()[:3])))
    for c in ax.collections:
        col = _colour(c.get_facecolor()) or _colour(c.get_edgecolor())
        if col:
            out.append((c.get_label(), col))
    return out


def check_figure(fig, *, names: tuple[str, ...] = ()) -> dict:
    """Assert the conventions; returns the texts seen (titles, labels, legend labels)."""
    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    r = canvas.get_renderer()
    axes = [ax for ax in fig.axes if ax.axison]
    sup = fig._suptitle.get_text() if fig._suptitle else ""
    titles = [sup] + [ax.get_title() for ax in fig.axes]
    assert any(t.strip() for t in titles), "no title"
    text = " ".join(titles)
    for n in names:
        assert n in text, (n, text)
    for ax in axes:
        assert ax.get_title().strip(), "a panel without a title"
        assert UNIT.search(ax.get_xlabel()), f"x label without a unit: {ax.get_xlabel()!r}"
        yl = ax.get_ylabel()
        assert not yl or UNIT.search(yl), f"y label without a unit: {yl!r}"
    if axes:
        assert UNIT.search(axes[0].get_ylabel()), "the first panel has no y label with a unit"
    legends = list(fig.legends) + [ax.get_legend() for ax in fig.axes if ax.get_legend()]
    title_boxes = ([fig._suptitle.get_window_extent(r)] if sup else []) + \
        [ax.title.get_window_extent(r) for ax in fig.axes if ax.get_title()]
    labels = []
    for leg in legends:
        labs = [t.get_text() for t in leg.get_texts()]
        assert len(labs) == len(set(labs)), f"repeated legend labels: {labs}"
        labels += labs
        box = leg.get_window_extent(r)
        for ax in axes:
            assert not _overlap(box, ax.get_window_extent(r)), \
                f"legend over the panel {ax.get_title()!r}"
        for tb in title_boxes:
            assert not _overlap(box, tb), "legend over a title"
    ref_colours, data_colours = set(), set()
    for ax in fig.axes:
        for lab, col in _artists(ax):
            (ref_colours if "(ref.)" in lab else data_colours).add(col)
    shared = ref_colours & data_colours
    assert not shared, f"data in a reference colour: {shared}"
    assert ref_colours <= {to_hex(c) for c in D.REFERENCE_COLOURS.values()}
    every = text + " " + " ".join(labels) + " ".join(ax.get_xlabel() + ax.get_ylabel()
                                                     for ax in fig.axes)
    assert "§9" not in every, "a label points at a section outside the repository"
    return {"titles": titles, "labels": labels}


# -- the benchmark's plots -------------------------------------------------------------------
@pytest.fixture(scope="module")
def bench():
    data = json.loads((EVIDENCE / "DGR-066" / "bench" / "bench.json").read_text())
    data["model"] = {"trunk": "v4-tiny-s0.gguf", "sidecar": "mtp-v4-tiny-s0.gguf"}
    return data


def test_bench_figures_follow_the_conventions(bench):
    plans = ("whole model", "ranged 0-1,2-3")
    figs = BP.figures(bench)
    assert set(figs) == {"speed_vs_k", "acceptance_per_position", "time_split",
                         "speedup_curve", "seam_bytes"}
    for name, fig in figs.items():
        need = {"speedup_curve": ("whole model",), "seam_bytes": ("ranged 0-1,2-3",)}
        check_figure(fig, names=("fixture preset tiny, seed 0",) + need.get(name, plans))
    # several plans: one panel per plan, the same k in the same colour on each
    acc = figs["acceptance_per_position"]
    assert len(acc.axes) == 2
    k1 = [{to_hex(ln.get_color()) for ln in ax.get_lines() if ln.get_label() == "MTP k=1"}
          for ax in acc.axes]
    assert k1[0] == k1[1] and len(k1[0]) == 1
    labels = [t.get_text() for t in acc.legends[0].get_texts()]
    assert labels.count("MTP k=1") == 1 and sum("vLLM" in s for s in labels) == 1


def test_bench_plots_without_a_model_or_ranged_plan_say_so(bench):
    whole = dict(bench, model=None, summary=[r for r in bench["summary"]
                                             if r["plan"] == "whole"])
    fig = BP.plot_seam_bytes(whole)
    assert fig._suptitle and "model not recorded" in fig._suptitle.get_text()
    assert not fig.axes[0].axison and "no seam" in fig.axes[0].texts[0].get_text()
    check_figure(BP.plot_speed(whole), names=("whole model",))


def test_reference_sources_are_public_and_cited():
    for key in D.REFERENCE_S9:
        ref = D.REFERENCES[key]
        assert ref.url.startswith("https://") and ref.title and ref.cite().endswith(ref.url)
    t = D.references_table()
    assert list(t["reference"]) == list(D.REFERENCE_S9) and t["url"].str.startswith(
        "https://").all()
    assert not set(D.DATA_COLOURS) & set(D.REFERENCE_COLOURS.values())
    with pytest.raises(ValueError, match="panels"):
        D.data_colour(len(D.DATA_COLOURS))


# -- side-by-side, WAN, correctness ------------------------------------------------------------
def test_side_by_side_sweeps_name_the_preset():
    files = sorted((EVIDENCE / "side-by-side").glob("sweep-*.json"))
    assert files
    fig = SBS.plot_sweeps(files)
    seen = check_figure(fig, names=("fixture preset v4-ratio-cpu, seed 0", "thread"))
    assert not any("v4-v4" in t for t in seen["titles"])
    assert len(fig.axes) == len(files)
    ax = SBS.plot_sweep(files[0])
    check_figure(ax.figure, names=("v4-ratio-cpu",))


def test_wan_rtt_lines_are_all_distinct():
    d = json.loads((EVIDENCE / "wan" / "wan" / "patched" / "wan.json").read_text())
    plan = "0-1,2-3"
    fig = W.plot_rtt_pair(d["summary"], plan=plan, build="patched")
    check_figure(fig, names=(f"plan {plan}", "trained tiny V4", "patched"))
    # one line per measured (topology, placement, k) series, no two alike (the committed
    # sweep: 2 topologies x MTP off and k=1..3 with the drafter in the client)
    series = {(s["topology"], s["placement"], s["k"]) for s in d["summary"]
              if s["plan"] == plan}
    assert len(series) >= 8
    for ax in fig.axes:
        styles = [(to_hex(ln.get_color()), ln.get_linestyle()) for ln in ax.get_lines()
                  if not ln.get_label().startswith("_")]
        assert len(styles) == len(set(styles)) == len(series)
    ax = W.plot_rtt(d["summary"], what="speedup", plan=plan)
    check_figure(ax.figure, names=(plan,))
    with pytest.raises(Exception, match="what"):
        W.plot_rtt(d["summary"], what="waits", plan=plan)


def test_correctness_charts():
    d = json.loads((EVIDENCE / "DGR-066" / "correctness.json").read_text())
    model = D.model_name("/x/v4-tiny-s0.gguf")
    seam = CP.plot_seam_traffic(d["whole_vs_ranged"], model=model)
    check_figure(seam, names=(model, "plan 0-1,2-3", "plan 0-0,1-2,3-3"))
    labels = [t.get_text() for t in seam.legends[0].get_texts()]
    assert "rollback" not in labels  # never measured: no bar, not a 0 bar
    assert not any("bytes_per_token" in s for s in labels)  # readable names, not columns
    # a step kind gets a bar only where the run moved bytes for it: MTP off has no verify
    # step, and a drafter in the client (the default) moves no draft or feed bytes
    ax = seam.axes[0]
    first = [r for r in d["whole_vs_ranged"] if r["plan"] == "0-1,2-3"]

    def moved(r, s):
        v = r.get(f"bytes_per_token_{s}")
        return v is not None and v == v and v > 0

    bars = {c.get_label(): len(c.patches) for c in ax.containers}
    assert bars == {s: n for s in STEP_KINDS if (n := sum(moved(r, s) for r in first))}
    assert bars["verify"] == 3  # k = 1, 2, 3 only
    assert ("draft" in labels) == any(moved(r, "draft") for r in d["whole_vs_ranged"])
    rb = CP.plot_rollback(d["rollback"], noise_bound=NOISE_BOUND, model=model)
    seen = check_figure(rb, names=(model, "rollback"))
    assert any("tail removal" in s for s in seen["labels"])
    assert any("checkpoint" in s for s in seen["labels"])


def test_ownership_chart_legend_clear_of_the_title(inv):
    import matplotlib.pyplot as plt

    from mtplib.ownership import report as rep
    from mtplib.ownership.derivation import derive

    own = derive(inv, "0-1,2-3")
    fig = rep.stacked_bytes_chart({"plan 0-1,2-3": own, "plan 0-0,1-3": derive(inv, "0-0,1-3")},
                                  "roles", unit=2**20, title="tiny fixture: bytes per shard")
    try:
        check_figure(fig, names=("tiny fixture", "plan 0-1,2-3"))
    finally:
        plt.close(fig)


# -- tables ------------------------------------------------------------------------------------
@pytest.mark.parametrize("x, want", [
    (1468.669053, "1469"), (0.0222222222, "0.02222"), (94973.9375, "94974"), (24.0, "24"),
    (0.5, "0.5"), (0.0, "0"), (-3.14159, "-3.142"), (2.2e-4, "0.00022"), (123456789.4, "123456789"),
    (1.0, "1"), (0.99996, "1"), (float("nan"), "n/a"), (float("inf"), "inf"), (3e-7, "3.000e-07"),
])
def test_fmt_number(x, want):
    assert D.fmt_number(x) == want


def test_show_rounds_and_keeps_missing_missing():
    rows = [{"plan": "whole", "k": 1, "tok_s": 1468.669053, "rss": None, "x": float("nan"),
             "ok": True, "pos": [0.0222222, None], "rb": {"tail": 6},
             "prompts": [{"len": 12, "seed": 0}]},
            {"plan": "0-1,2-3", "k": 2, "tok_s": 0.0, "rss": 12.3456, "x": 2.0, "ok": False,
             "pos": [], "rb": {}, "prompts": []}]
    t = D.show(rows, ["plan", "k", "tok_s", "rss", "x", "ok", "pos", "rb", "prompts", "absent"])
    assert list(t.columns) == ["plan", "k", "tok_s", "rss", "x", "ok", "pos", "rb", "prompts"]
    a, b = t.iloc[0], t.iloc[1]
    assert a["tok_s"] == "1469" and b["tok_s"] == "0"  # a measured 0 stays 0
    assert a["rss"] == "n/a" and a["x"] == "n/a" and b["rss"] == "12.35"  # missing: n/a
    assert a["k"] == 1 and not isinstance(a["ok"], str) and a["ok"] and not b["ok"]
    assert a["pos"] == "[0.02222, n/a]" and a["rb"] == "tail: 6" and b["rb"] == "none"
    assert a["prompts"] == "[{len: 12, seed: 0}]"
    # a keyed table (histogram rows: plan and k, never k alone)
    hist = pd.DataFrame([{"plan": "whole", "k": 1, "0 accepted": 5, "2 accepted": math.nan},
                         {"plan": "0-1,2-3", "k": 1, "0 accepted": 5, "2 accepted": 1}])
    h = D.show(hist, index=["plan", "k"])
    assert list(h.index.names) == ["plan", "k"]
    assert h.loc[("whole", 1), "2 accepted"] == "n/a"
    assert h.loc[("0-1,2-3", 1), "2 accepted"] == "1"
    # a DataFrame in, the original untouched
    df = pd.DataFrame(rows)
    D.show(df)
    assert df["tok_s"].iloc[0] == 1468.669053


def test_model_name():
    assert D.model_name("/tmp/w7/fx/v4-v4-ratio-cpu-s0.gguf") == \
        "fixture preset v4-ratio-cpu, seed 0"
    assert D.model_name("mtp-v4-tiny-s3.gguf") == "fixture preset tiny, seed 3"
    assert D.model_name("/m/DeepSeek-V4-Flash.gguf") == "DeepSeek-V4-Flash"
