"""Issue 23 item 5: a run's results load into tidy pandas DataFrames (`mtplib.records.load`),
the CSVs spread lists over columns (no JSON text in a cell), ``rep`` stays an integer, the
WAN tables carry their build, and `mtplib.lab.wan.load` names the per-build folders."""

from __future__ import annotations

import csv
import json
import shutil
from pathlib import Path

import pandas as pd
import pytest

import mtplib.records
from mtplib.errors import InputError
from mtplib.lab import bench as B
from mtplib.lab import bench_config as BC
from mtplib.lab import bench_summary as BS
from mtplib.lab import tables
from mtplib.lab import wan as W

EVIDENCE = Path(__file__).resolve().parent.parent / "evidence"
WAN_FILES = [f"{folder}/{b}/wan.json" for folder in ("wan", "wan-target")
             for b in ("stock", "patched")]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    """A run folder laid out as a lane leaves it, from the committed evidence's files."""
    run = tmp_path_factory.mktemp("run")
    for rel in ("bench/bench.json", "correctness.json", "seam_bytes.json"):
        (run / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(EVIDENCE / "DGR-066" / rel, run / rel)
    for rel in WAN_FILES:
        (run / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(EVIDENCE / "wan" / rel, run / rel)
    sbs = run / "side-by-side"
    sbs.mkdir()
    for name in ("sbs-v4-ratio-cpu-t2.json", "sweep-v4-ratio-cpu-t2.json"):
        shutil.copy(EVIDENCE / "side-by-side" / name, sbs / name)
    return run


@pytest.fixture(scope="module")
def frames(run_dir) -> dict[str, pd.DataFrame]:
    return mtplib.records.load(run_dir)


def _json(run: Path, rel: str):
    return json.loads((run / rel).read_text())


def test_load_gives_every_table_with_its_rows(run_dir, frames):
    bench = _json(run_dir, "bench/bench.json")
    corr = _json(run_dir, "correctness.json")
    wan = [_json(run_dir, rel) for rel in WAN_FILES]
    assert all(isinstance(f, pd.DataFrame) for f in frames.values())
    want = {"bench": len(bench["runs"]), "bench_summary": len(bench["summary"]),
            "bench_sweep_runs": len(bench["sweep_runs"]),
            "correctness": len(corr["equality"]), "correctness_forced": len(corr["forced"]),
            "correctness_sampling": 1, "seam_bytes": len(corr["whole_vs_ranged"]),
            "wan": sum(len(w["rows"]) for w in wan),
            "wan_summary": sum(len(w["summary"]) for w in wan),
            "side_by_side_summary": len(_json(run_dir, "side-by-side/sbs-v4-ratio-cpu-t2.json")
                                        ["summary"]),
            "acceptance_sweep_break_even": len(
                _json(run_dir, "side-by-side/sweep-v4-ratio-cpu-t2.json")["break_even"])}
    assert {k: len(frames[k]) for k in want} == want


def test_bench_frame_is_tidy(frames):
    df = frames["bench"]
    assert str(df["rep"].dtype) == "Int64"  # an integer; warm-up runs have none
    assert df.loc[df["warmup"], "rep"].isna().all() and df.loc[~df["warmup"], "rep"].notna().all()
    assert {"accepted_per_position_1", "accepted_per_position_3", "accept_len_hist_0",
            "drafted_per_position_2", "t_rollback_s"} <= set(df.columns)
    assert "accepted_per_position" not in df.columns
    # per position: k of them, the rest missing (not 0) for shorter drafts
    k1 = df[df["k"] == 1]
    assert k1["drafted_per_position_1"].gt(0).all() and k1["drafted_per_position_2"].isna().all()
    # a counter lacks the kinds never seen: 0 there, not missing
    assert df.loc[df["k"] == 0, "rollbacks_tail"].eq(0).all()
    assert not any(isinstance(v, list | dict | str) and str(v)[:1] in "[{"
                   for c in df.columns for v in df[c])


def test_wan_frames_carry_the_build_and_results_set(run_dir, frames):
    for key in ("wan", "wan_summary", "wan_targets", "wan_cost_model", "wan_bytes_by_class"):
        df = frames[key]
        assert list(df.columns[:2]) == ["build", "results"], key
        assert set(df["build"]) == {"stock", "patched"}, key
        assert set(df["results"]) <= {"wan", "wan-target"}, key
    assert set(frames["wan_summary"]["results"]) == {"wan", "wan-target"}
    w = frames["wan"]
    assert str(w["rep"].dtype) in ("int64", "Int64") and isinstance(w["tokens"].iloc[0], list)
    for rel in WAN_FILES:  # each file's rows under its own build
        results, build, _ = rel.split("/")
        rows = w[(w["results"] == results) & (w["build"] == build)]
        assert len(rows) == len(_json(run_dir, rel)["rows"]), rel
    one = mtplib.records.load(run_dir / "wan" / "stock")  # a lone build's folder
    assert set(one["wan_summary"]["build"]) == {"stock"} and set(one["wan"]["results"]) == {"."}


def test_seam_bytes_rows_say_mtp_on_tail_as_a_nullable_bool(frames):
    s = frames["seam_bytes"]
    assert s.loc[s["k"] == 0, "mtp_on_tail"].isna().all()
    assert str(s["mtp_on_tail"].dtype) == "boolean"


def test_bench_csvs_have_one_scalar_per_cell_and_integer_reps(run_dir, tmp_path):
    data = _json(run_dir, "bench/bench.json")
    paths = BS.write_csvs(data, tmp_path)
    assert set(paths) == set(BS.TABLES)
    with paths["runs"].open() as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == len(data["runs"])
    assert {r["rep"] for r in rows} == {"", *map(str, range(max(
        x["rep"] for x in data["runs"] if x["rep"] is not None) + 1))}
    for r in rows:
        assert not any(v.startswith(("[", "{")) for v in r.values()), r
    back = pd.read_csv(paths["summary"])
    assert "accepted_per_position_1" in back and "accepted_per_position" not in back


def test_wan_summary_csv_has_a_build_column(run_dir, tmp_path):
    data = _json(run_dir, "wan/patched/wan.json")
    p = W.write_summary_csv(data, tmp_path)
    back = pd.read_csv(p)
    assert back.columns[0] == "build" and set(back["build"]) == {"patched"}
    assert len(back) == len(data["summary"])


def test_wan_load_names_the_build_folders(run_dir, tmp_path):
    with pytest.raises(InputError, match="one results folder per build") as e:
        W.load(run_dir)
    assert "wan/stock" in str(e.value) and "wan/patched" in str(e.value)
    assert sorted(W.load_builds(run_dir)) == ["patched", "stock"]
    assert W.load(run_dir / "wan" / "stock")["upstream"]["build"] == "stock"
    with pytest.raises(InputError, match="run the WAN benchmark first"):
        W.load(tmp_path)
    with pytest.raises(InputError, match="no wan.json"):
        W.load_builds(tmp_path)


def test_load_refuses_an_empty_or_missing_folder(tmp_path):
    with pytest.raises(InputError, match="no results found"):
        mtplib.records.load(tmp_path)
    with pytest.raises(InputError, match="no such run folder"):
        mtplib.records.load(tmp_path / "nope")
    (tmp_path / "correctness.json").write_text("{not json")
    with pytest.raises(InputError, match="not a readable results file"):
        mtplib.records.load(tmp_path)


def test_frame_dtypes_and_counters():
    df = tables.frame([{"rep": None, "ok": True, "rollbacks": {}, "pos": [0.5]},
                       {"rep": 1, "ok": None, "rollbacks": {"tail": 2}, "pos": [1.0, 0.0]}],
                      build="stock")
    assert list(df.columns) == ["build", "rep", "ok", "rollbacks_tail", "pos_1", "pos_2"]
    assert str(df["rep"].dtype) == "Int64" and str(df["ok"].dtype) == "boolean"
    assert df["rollbacks_tail"].tolist() == [0, 2]
    assert df["pos_2"].isna().tolist() == [True, False]


def test_a_fresh_bench_run_loads(pair, tmp_path):
    cfg = BC.BenchConfig.from_dict({"ks": [1], "n_new": 4, "reps": 1, "warmup": 1,
                                   "threads": 1, "prompts": [{"seed": 0, "len": 6}],
                                   "sweep": None})
    res = B.run_bench(str(pair.trunk), str(pair.sidecar), cfg)
    BS.save(res, tmp_path / "bench", plots=False)
    f = mtplib.records.load(tmp_path)
    assert set(f) == {"bench", "bench_summary", "bench_sweep", "bench_sweep_runs",
                      "bench_break_even", "bench_sampling"}
    assert len(f["bench"]) == 4 and f["bench"]["rep"].tolist() == [pd.NA, 0, pd.NA, 0]
    assert len(f["bench_summary"]) == 2


def test_the_readme_example_runs(monkeypatch):
    """The docs' pandas example (docs/evidence.md), as written, on the committed evidence."""
    text = (EVIDENCE.parent / "docs" / "evidence.md").read_text()
    part = text[text.index("**Results in pandas.**"):]
    code = part[part.index("```python\n") + 10:part.index("\n```", part.index("```python"))]
    monkeypatch.chdir(EVIDENCE.parent)
    ns: dict = {}
    exec(compile(code, "docs/evidence.md", "exec"), ns)  # noqa: S102 - the repo's own docs
    assert len(ns["runs"]) and {"build", "results", "speedup"} <= set(ns["wan"].columns)
