"""Issue 23 item 5: a run's results load into tidy pandas DataFrames (`mtplib.records.load`),
the CSVs spread lists over columns (no JSON text in a cell), ``rep`` stays an integer, the
WAN tables carry their build, and `mtplib.lab.wan.files.load` names the per-build folders."""

from __future__ import annotations

import csv
import json
import shutil
from pathlib import Path

import pandas as pd
import pytest

import mtplib.records
from mtplib.errors import InputError
from mtplib.lab.bench import config as BC
from mtplib.lab.bench import measure as B
from mtplib.lab.bench import summary as BS
from mtplib.lab.common import tables
from mtplib.lab.wan import files as W
from mtplib.records.frames import SkippedWarning

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


# -- issue 32 item 5: every committed layout, one missing-value spelling, numeric dtypes ------
FOLDERS = sorted(p for p in EVIDENCE.iterdir() if p.is_dir())


@pytest.mark.parametrize("folder", FOLDERS, ids=lambda p: p.name)
def test_every_evidence_folder_loads(folder):
    """Each committed evidence folder gives frames with rows, reads every JSON file of a
    known layout (only the run record and the tokenizer are skipped) and warns of none."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error", SkippedWarning)
        f = mtplib.records.load(folder)
    assert f and any(len(df) for df in f.values()), folder.name
    assert set(f.skipped) <= {"run_record.json", "trained-v4/tokenizer.json",
                              "tokenizer.json"}, f.skipped
    n_json = len([p for p in folder.rglob("*.json")])
    assert n_json == len(f.skipped) + len(_files_read(folder, f)), folder.name


def _files_read(folder: Path, f: dict) -> set[str]:
    """The JSON files the frames name (a ``file`` or ``source`` column; the known layouts
    by name)."""
    names = {str(v) for df in f.values() for c in ("file", "source") if c in df.columns
             for v in df[c]}
    known = {p.relative_to(folder).as_posix() for p in folder.rglob("*.json")
             if p.name in ("bench.json", "correctness.json", "seam_bytes.json", "wan.json")}
    rels = {p.relative_to(folder).as_posix() for p in folder.rglob("*.json")}
    return known | {r for r in rels if r in names or r.rsplit("/", 1)[-1] in names}


def _all_frames():
    return [(folder.name, key, df) for folder in FOLDERS
            for key, df in mtplib.records.load(folder).items()]


def test_one_missing_spelling_and_no_numbers_as_object():
    """0 object columns that hold only numbers or missing values; a missing value is pd.NA
    only: no None, NaN, '' or '-' left in any cell."""
    bad_dtype, bad_missing = [], []
    for folder, key, df in _all_frames():
        for c in df.columns:
            values = df[c].tolist()
            if df[c].dtype == object and all(
                    v is pd.NA or (isinstance(v, int | float) and not isinstance(v, bool))
                    for v in values):
                bad_dtype.append(f"{folder}:{key}.{c}")
            if any(v is None or (isinstance(v, float) and v != v)
                   or (isinstance(v, str) and v in ("", "-")) for v in values):
                bad_missing.append(f"{folder}:{key}.{c}")
    assert not bad_dtype, bad_dtype[:20]
    assert not bad_missing, bad_missing[:20]


def test_dtypes_are_nullable_and_all_missing_is_numeric():
    df = mtplib.records.frames.tidy(pd.DataFrame({
        "rep": [None, 1], "x": [float("nan"), 2.5], "ok": [True, None], "none": [None, None],
        "placement": ["-", "client"], "note": ["", "a"], "tokens": [[1, 2], [3]],
        "mixed": [1, "a"]}, dtype=object))
    assert {c: str(t) for c, t in df.dtypes.items()} == {
        "rep": "Int64", "x": "Float64", "ok": "boolean", "none": "Float64",
        "placement": "string", "note": "string", "tokens": "object", "mixed": "object"}
    assert df.loc[0, ["rep", "x", "none", "placement", "note"]].isna().all()
    assert df.loc[1, "ok"] is pd.NA and df.loc[1, "rep"] == 1
    assert df["tokens"].tolist() == [[1, 2], [3]]


def test_the_prompt_label_is_split_into_its_parts(frames):
    b = frames["bench"]
    assert str(b["prompt_index"].dtype) == str(b["prompt_seed"].dtype) == "Int64"
    want = [(int(i), int(s)) for i, s in
            (p[1:].split(":seed") for p in b["prompt"])]
    assert list(zip(b["prompt_index"], b["prompt_seed"], strict=True)) == want
    t = mtplib.records.frames.tidy(pd.DataFrame({"prompt": ["p0:seed7", "p1:text"]}))
    assert t["prompt_index"].tolist() == [0, 1]
    assert t["prompt_seed"].tolist() == [7, pd.NA]
    other = mtplib.records.frames.tidy(pd.DataFrame({"prompt": ["p0:seed7", "hello"]}))
    assert "prompt_index" not in other  # not all labels: left as they are


def test_upstream_patches_target_layout():
    """target/<build>/<mode>/wan.json: read from the folder itself and from above it."""
    base = EVIDENCE / "upstream-patches"
    files = sorted((base / "target").glob("*/*/wan.json"))
    assert len(files) == 4
    t = mtplib.records.load(base / "target")
    assert len(t["wan"]) == sum(len(_json(p.parent, "wan.json")["rows"]) for p in files)
    assert set(t["wan"]["build"]) == {"baseline", "patched"}
    assert set(t["wan"]["results"]) == {"."} and set(t["wan"]["mode"]) == {"cold", "warm"}
    up = mtplib.records.load(base)["wan_summary"]
    assert set(up["results"]) == {"wan", "target", "target-rerun"}
    assert set(up.loc[up["results"] == "wan", "build"]) == {"stock", "baseline", "patched"}


def test_an_unknown_layout_is_named(tmp_path):
    shutil.copy(EVIDENCE / "DGR-066" / "seam_bytes.json", tmp_path / "seam_bytes.json")
    (tmp_path / "mystery.json").write_text('{"rows": [{"a": 1}]}')
    (tmp_path / "waits-broken.json").write_text("{not json")
    (tmp_path / "run_record.json").write_text("{}")
    with pytest.warns(SkippedWarning, match="mystery.json") as w:
        f = mtplib.records.load(tmp_path)
    assert "run_record.json" not in str(w[0].message)
    assert set(f) == {"seam_bytes"} and len(f["seam_bytes"]) == 8
    assert f.skipped["mystery.json"] == "no reader for this layout"
    assert f.skipped["waits-broken.json"].startswith("not readable JSON")
    assert f.skipped["run_record.json"].startswith("the run record")
    only = tmp_path / "only"
    only.mkdir()
    (only / "mystery.json").write_text("{}")
    with pytest.warns(SkippedWarning), pytest.raises(InputError, match="skipped: mystery.json"):
        mtplib.records.load(only)


def test_the_docs_plot_snippet_runs(monkeypatch, tmp_path):
    """docs/data.md's speed-up-vs-RTT block, as written (5 lines), on the committed WAN
    evidence: it plots one line per build and writes the PNG."""
    import matplotlib

    matplotlib.use("Agg")
    text = (EVIDENCE.parent / "docs" / "data.md").read_text()
    part = text[text.index("## Speed-up against RTT"):]
    code = part[part.index("```python\n") + 10:part.index("\n```", part.index("```python"))]
    assert len(code.splitlines()) == 5
    monkeypatch.chdir(EVIDENCE.parent)
    monkeypatch.setattr("matplotlib.pyplot.savefig",
                        lambda name, **kw: matplotlib.pyplot.gcf().savefig(tmp_path / name))
    ns: dict = {}
    exec(compile(code, "docs/data.md", "exec"), ns)  # noqa: S102 - the repo's own docs
    ax = matplotlib.pyplot.gca()
    assert sorted(line.get_label() for line in ax.get_lines()) == ["patched", "stock"]
    assert all(len(line.get_xdata()) == 6 for line in ax.get_lines())  # 0..200 ms
    assert (tmp_path / "speedup-vs-rtt.png").stat().st_size > 0
    matplotlib.pyplot.close("all")
