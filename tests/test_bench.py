"""DGR-066 part 3: the MTP off vs on benchmark, the acceptance sweep and the evidence README.

One short CPU lane (notebook 04_benchmark + the DGR-066 evidence README) runs once per
module through the papermill pipeline; the tests read its recorded metrics.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

from mtplib.contract.labels import TIME_PARTS
from mtplib.errors import InputError
from mtplib.lab.bench import config as BC
from mtplib.lab.bench import summary as BS
from mtplib.lab.common import tables
from mtplib.lab.common.acceptance_sweep import break_even
from mtplib.lab.common.display import REFERENCE_S9
from mtplib.model.trained import trained_paths
from mtplib.records.evidence import copy_run, load_raw, render_readme, write_evidence_readme
from mtplib.records.lanes import LaneError, load_lane, run_lane
from mtplib.records.readme import numbers_trace, readme_numbers

REPO = Path(__file__).resolve().parent.parent

LANE = """\
lane: bench-ci
fixture: {preset: tiny, seed: 0}
threads: 1
notebooks: [04_benchmark.ipynb]
bench:
  ks: [1, 2]
  prompts: [{seed: 0, len: 12}]
  n_new: 32
  reps: 2
  warmup: 1
  threads: 1
  n_ctx: 256
  sweep: {rates: [0.0, 1.0], ks: [1, 2], reps: 3, warmup: 1, draft_cost: mtp}
  sampling: {temperature: 1.0, top_p: 0.95, seeds: 2, n_new: 8}
evidence: [DGR-066]
"""


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bench")
    lane = tmp / "bench-ci.yaml"
    lane.write_text(LANE)
    return run_lane(lane, out_root=tmp / "outputs", run_id="ci", progress=False)


@pytest.fixture(scope="module")
def data(run_dir):
    return BS.load(run_dir / "bench")


def test_lane_writes_notebook_metrics_plots_record_and_readme(run_dir):
    nb = nbformat.read(str(run_dir / "04_benchmark.ipynb"), as_version=4)
    outs = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]
    # the five bench plots, then one figure for the committed side-by-side sweeps (issue 7)
    assert sum("image/png" in o.get("data", {}) for o in outs) == 6
    text = "".join(str(o.get("data", {}).get(kind, "")) for o in outs
                   for kind in ("text/plain", "text/markdown"))
    for name in ("sbs-v4-ratio-cpu-t2.json", "sweep-v4-ratio-cpu-t2.json"):
        assert name in text, f"notebook 04 did not show {name}"
    for name in ("bench.json", "bench_summary.csv", "bench_runs.csv", "bench_sweep.csv",
                 "bench_break_even.csv", "bench_sweep_runs.csv", "bench_sampling.csv"):
        assert (run_dir / "bench" / name).stat().st_size > 0, name
    for name in ("speed_vs_k", "acceptance_per_position", "time_split", "speedup_curve",
                 "seam_bytes"):
        assert (run_dir / "bench" / "plots" / f"{name}.png").stat().st_size > 1000, name
    rec = json.loads((run_dir / "run_record.json").read_text())
    assert rec["status"] == "ok" and rec["network"] == "loopback"
    assert rec["backend"]["devices"] and len(rec["model_sha256"]) == 2
    assert rec["evidence"] == [str(run_dir / "evidence" / "DGR-066" / "README.md")]


def test_rows_are_complete_and_sane(data):
    runs = data["runs"]
    # off + k=1 + k=2, one prompt, 1 warm-up + 2 measured each
    assert len(runs) == 3 * 3 and sum(r["warmup"] for r in runs) == 3
    for r in runs:
        assert r["plan"] == "whole" and r["seam_bytes_per_token"] is None
        assert r["n_generated"] == 32 and r["decode_tok_s"] > 0 and r["ttft_s"] > 0
        assert sum(r["accept_len_hist"].values()) == r["verify_steps"]
        assert r["quality_valid"] and (r["equal_to_off"] or r["near_tie"]), r
        assert all(r[f"t_{p}_s"] >= 0 for p in TIME_PARTS)
        assert r["rss_peak_bytes"] > 0 and r["trunk_weights_bytes"] > 0
    summ = {r["k"]: r for r in data["summary"]}
    assert sorted(summ) == [0, 1, 2]
    assert summ[0]["speedup"] == pytest.approx(1.0) and summ[0]["drafted"] == 0
    for k in (1, 2):
        s = summ[k]
        assert s["runs"] == 2 and s["drafted"] > 0 and 0 <= s["acceptance"] <= 1
        assert len(s["accepted_per_position"]) == k and s["mtp_weights_mib"] > 0
        assert s["decode_tok_s_min"] <= s["decode_tok_s_median"] <= s["decode_tok_s_max"]
        assert s["unexplained_divergences"] == 0
        assert sum(s[f"share_{p}_pct"] for p in TIME_PARTS) == pytest.approx(100)
        assert s["sampling_streams"] == 2 and s["sampling_equal_streams"] == 2
    assert data["reference_s9"] == REFERENCE_S9
    # the summaries are recomputed from the recorded per-run rows
    assert BS.summarize(data["runs"], data["sampling"]) == data["summary"]
    assert BS.sweep_summary(data["sweep_runs"], data["runs"]) == data["sweep"]
    assert break_even(data["sweep"]) == data["break_even"]


def test_sweep_speedup_and_exact_acceptance_at_rates_0_and_1(data):
    sweep = {(r["k"], r["rate"]): r for r in data["sweep"]}
    assert sorted(sweep) == [(1, 0.0), (1, 1.0), (2, 0.0), (2, 1.0)]
    for k in (1, 2):
        lo, hi = sweep[(k, 0.0)], sweep[(k, 1.0)]
        assert lo["acceptance_pos_1"] == 0.0 and lo["acceptance"] == 0.0
        assert hi["reference_intact_runs"] == hi["runs"] == 3
        assert hi["acceptance_pos_1"] == 1.0 and hi["acceptance"] == 1.0
        assert hi["speedup"] > lo["speedup"] > 0
        assert not hi["quality_valid"]
    assert all(not r["quality_valid"] for r in data["sweep_runs"])
    assert {r["k"] for r in data["break_even"]} == {1, 2}


def test_break_even_interpolation():
    def pts(k, xy):
        return [{"plan": "whole", "k": k, "acceptance_pos_1": x, "speedup": y} for x, y in xy]

    rows = {r["k"]: r for r in break_even(
        pts(1, [(0.0, 0.5), (0.5, 0.9), (1.0, 1.3)])
        + pts(2, [(0.0, 0.4), (1.0, 0.8)])
        + pts(3, [(0.0, 1.1), (1.0, 2.0)])
        + pts(4, [(0.0, 0.5), (0.25, 1.1), (0.5, 0.9), (1.0, 1.5)]))}
    assert rows[1]["break_even_acceptance"] == pytest.approx(0.5 + 0.1 / 0.4 * 0.5)
    assert rows[2]["break_even_acceptance"] is None and rows[2]["note"].startswith("not")
    assert rows[3]["break_even_acceptance"] is None and rows[3]["note"].startswith("faster")
    assert rows[4]["break_even_acceptance"] == pytest.approx(0.5 + 0.1 / 0.6 * 0.5)  # last


def test_evidence_readme_regenerates_and_every_number_traces(run_dir):
    readme = run_dir / "evidence" / "DGR-066" / "README.md"
    text = readme.read_text()
    raw = load_raw(run_dir)
    assert numbers_trace(text, raw) == []
    assert len(readme_numbers(text)) > 100  # the tables are there
    assert render_readme(run_dir, "DGR-066", readme) == text  # regenerates identically
    summ = {r["k"]: r for r in raw["bench"]["summary"]}
    assert f"| k=1 | 2 | {summ[1]['decode_tok_s_median']:.1f} |" in text
    for link in ("../../04_benchmark.ipynb", "../../bench/bench.json",
                 "../../bench/plots/speed_vs_k.png"):
        assert f"]({link})" in text


@pytest.mark.parametrize("template", ["speed-up {}", "acceptance {}%", "| k=9 | {} |"])
def test_injected_number_is_caught(run_dir, template):
    raw = load_raw(run_dir)
    # a number that, alone, is not in the raw metrics (a short one may be, by chance)
    number = next(n for n in (f"{x / 10:.1f}" for x in range(1231, 2000))
                  if numbers_trace(template.format(n), raw))
    text = (run_dir / "evidence" / "DGR-066" / "README.md").read_text()
    bad = text.replace("## Limitations", template.format(number) + "\n\n## Limitations")
    want = number + "%" if "%" in template else number
    assert numbers_trace(bad, raw) == [want]


def test_number_rule():
    text = ("# Heading 99\nk=1 V4 DGR-066 pos-2 §9 `123 2025-01-01 abc` [x 1](a/555.png)\n"
            "| 3.25 | 45.5% | 1.8× |\n")
    assert readme_numbers(text) == ["1", "3.25", "45.5%", "1.8"]
    assert numbers_trace(text, {"a": 1, "b": [3.2499, 0.455], "c": {"d": 1.8}}) == []
    assert numbers_trace(text, {"a": 1, "b": [3.2, 0.455, 1.8]}) == ["3.25"]
    assert write_evidence_readme  # the pipeline hook and the command use it


def test_copy_run_into_evidence_refuses_to_overwrite(run_dir, tmp_path):
    readme = copy_run(run_dir, "DGR-066", tmp_path)
    story = tmp_path / "DGR-066"
    assert readme == story / "README.md"
    assert (story / "04_benchmark.ipynb").exists() and (story / "run_record.json").exists()
    assert (story / "bench" / "bench.json").exists()
    assert (story / "bench" / "plots" / "speedup_curve.png").exists()
    assert not (story / "models").exists() and not list(story.rglob("*.gguf"))
    text = readme.read_text()
    assert "](04_benchmark.ipynb)" in text and "(missing)" not in text
    assert numbers_trace(text, load_raw(story)) == []
    assert copy_run(run_dir, "DGR-066", tmp_path) == readme  # same content: fine
    readme.write_text(text + "\nhand edit\n")
    with pytest.raises(FileExistsError, match="--force"):
        copy_run(run_dir, "DGR-066", tmp_path)
    copy_run(run_dir, "DGR-066", tmp_path, force=True)
    assert readme.read_text() == text
    r = subprocess.run([sys.executable, "-m", "mtplib.cli", "evidence", "--run", str(run_dir),
                        "--dest", str(tmp_path), "--story", "DGR-999"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "no evidence README writer" in r.stderr


def test_committed_evidence_readme_traces_to_its_run():
    story = REPO / "evidence" / "DGR-066"
    readme = story / "README.md"
    if not readme.exists():
        pytest.skip("evidence/DGR-066 not written yet (mtplib evidence --run RUN_DIR)")
    text = readme.read_text()
    assert render_readme(story, "DGR-066", readme) == text
    assert numbers_trace(text, load_raw(story)) == []


def test_gpu_lanes_stop_cleanly_without_a_gpu_build(tmp_path):
    from mtplib.runtime.devices import gpu_devices

    if gpu_devices():
        pytest.skip("this build has a GPU device")
    for lane in ("gpu-fixture", "v4-flash-h200"):
        with pytest.raises(LaneError, match="needs a GPU build"):
            run_lane(REPO / "params" / f"{lane}.yaml", out_root=tmp_path / lane,
                     progress=False)
        assert not (tmp_path / lane).exists()  # stopped before anything was written
    r = subprocess.run([sys.executable, "-m", "mtplib.cli", "bench", "--params",
                        str(REPO / "params" / "gpu-fixture.yaml"), "--out", str(tmp_path / "b")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "needs a GPU build" in r.stderr
    assert "Traceback" not in r.stderr


def test_bench_config_validation(tmp_path):
    cfg = BC.BenchConfig.from_dict(load_lane(REPO / "params" / "cpu-fixture.yaml").bench)
    assert cfg.plans == ["whole", "0-1,2-3"] and cfg.ks == [1, 2, 3]
    assert cfg.sweep.rates[-1] == 1.0
    for bad, msg in [({"wat": 1}, "unknown keys"), ({"ks": [0]}, "ks must"),
                     ({"sweep": {"rates": [1.5]}}, "sweep.rates"),
                     ({"sweep": {"nope": 1}}, "unexpected keyword"),
                     ({"backend": "tpu"}, "backend")]:
        with pytest.raises(BC.BenchConfigError, match=msg):
            BC.BenchConfig.from_dict(bad)
    lane = tmp_path / "bad.yaml"
    lane.write_text("lane: x\nfixture: {preset: tiny}\nnotebooks: [04_benchmark.ipynb]\n"
                    "bench: {ks: [0]}\n")
    with pytest.raises(LaneError, match=r"bench\.ks\[0\]: expected an int 1\.\.8, got 0"):
        run_lane(lane, out_root=tmp_path / "out", progress=False)
    lane.write_text("lane: x\nfixture: {preset: tiny}\nnotebooks: [04_benchmark.ipynb]\n"
                    "evidence: [DGR-999]\n")
    with pytest.raises(LaneError, match="no evidence README writer"):
        run_lane(lane, out_root=tmp_path / "out", progress=False)


def test_unmeasured_memory_is_missing_not_zero(tmp_path):
    """Ranged runs measure no peak RSS and MTP off has no MTP state: the summary holds None,
    the CSV an empty cell and the README n/a, never 0 (issue 15). On the committed runs."""
    import pandas as pd

    from mtplib.records.readme import fmt

    runs = json.loads((REPO / "evidence" / "DGR-066" / "bench" / "bench.json").read_text())["runs"]
    summ = {(s["plan"], s["k"]): s for s in BS.summarize(runs)}
    ranged = [s for (plan, _), s in summ.items() if plan != "whole"]
    assert ranged and all(s["rss_peak_mib"] is None for s in ranged)
    assert summ[("whole", 0)]["mtp_seq_state_kib"] is None
    assert summ[("whole", 0)]["rss_peak_mib"] > 0 and summ[("whole", 1)]["mtp_seq_state_kib"] > 0
    csv = tmp_path / "s.csv"
    tables.to_csv(list(summ.values()), csv)
    back = pd.read_csv(csv)
    assert back.loc[back["plan"] != "whole", "rss_peak_mib"].isna().all()
    assert fmt(summ[("whole", 0)]["mtp_seq_state_kib"], 2) == "n/a"


def test_bench_takes_a_wan_for_its_ranged_plans():
    import subprocess
    import sys

    cfg = BC.BenchConfig.from_dict({"plans": ["whole", "0-1,2-3"], "wan": "50:100"})
    assert cfg.wan == "50:100"
    r = subprocess.run([sys.executable, "-m", "mtplib.cli", "bench", "--wan", "5,6,7",
                        "--quiet"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "one per shard" in r.stderr and "Traceback" not in r.stderr


def test_bench_takes_a_seam_for_its_ranged_plans():
    assert BC.BenchConfig.from_dict({}).seam == "auto"  # the request's default
    assert BC.BenchConfig.from_dict({"plans": ["0-1,2-3"], "seam": "ring"}).seam == "ring"
    with pytest.raises(BC.BenchConfigError, match="seam must be one of auto, star, ring"):
        BC.BenchConfig.from_dict({"seam": "mesh"})
    from mtplib.records.parameters import check_value

    with pytest.raises(InputError, match="seam"):
        check_value("bench", {"seam": "mesh"})
    assert check_value("bench", {"seam": "auto"})["seam"] == "auto"
    with pytest.raises(InputError, match="seam"):
        check_value("wan", {"seam": "mesh"})


@pytest.mark.slow
def test_a_ranged_bench_row_says_which_seam_ran_per_pair(tmp_path):
    """The default bench.seam (auto) on 0-1,2-3: every ranged row carries the generation's
    seam (asked, ran, each shard pair's ring or star and why), as generate's metrics do;
    it reads back. With this build's local shards auto is the ring where the build speaks
    RPC 7.2 (patches/0007), else the star."""
    from mtplib.lab.bench import measure as B
    from mtplib.lab.bench.runs import BenchRun
    from mtplib.runtime.rpc import client_proto_minor

    pair = trained_paths()
    cfg = BC.BenchConfig.from_dict({"plans": ["whole", "0-1,2-3"], "ks": [2], "n_new": 6,
                                    "reps": 1, "warmup": 0, "sweep": None,
                                    "n_ctx": 256, "prompts": [{"seed": 0, "len": 8}]},
                                   threads=1)
    res = B.run_bench(str(pair.trunk), str(pair.sidecar), cfg)
    rows = [r.to_dict() for r in res.runs]
    ranged = [r for r in rows if r["plan"] == "0-1,2-3"]
    assert ranged and all(r["seam"]["requested"] == "auto" for r in ranged)
    want = "ring" if client_proto_minor() >= 2 else "star"
    assert all(r["seam"]["seam"] == want for r in ranged)
    assert all([x["seam"] for x in r["seam"]["pairs"]] == [want] for r in ranged)
    # upstream logs a link per pair only where it was asked to ring
    assert all([x["seam"] for x in r["seam"]["links"]] == ([want] if want == "ring" else [])
               for r in ranged)
    assert BenchRun.from_dict(ranged[0]).ranged.seam == ranged[0]["seam"]
