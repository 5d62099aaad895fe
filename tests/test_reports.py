"""The evidence's reports (`mtplib.reports`, issue 42): each is a module with a ``main(argv)``
that answers ``--help`` under its ``python -m`` name, writes where ``--out`` says (its
default the checkout's evidence folder, not the working directory's), and the tables and
files it regenerates from committed inputs are the committed bytes. The projection page and
plot, the windows projection and the ring projection's table: tests/test_projection.py and
tests/test_windows_projection.py."""

from __future__ import annotations

import contextlib
import importlib
import io
import json
import pkgutil
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import mtplib.reports
from mtplib import paths
from mtplib.records import evidence_runs
from mtplib.records.moved_scripts import MOVED_SCRIPTS, rerun
from mtplib.reports import common

REPO = Path(__file__).resolve().parent.parent
EVIDENCE = REPO / "evidence"
#: the one report whose arguments are the CLI's own (it wraps `mtplib.cli.main`)
CLI_WRAPPER = "mtplib.reports.serve.serve_steplog"
REPORTS = sorted(m.name for m in pkgutil.walk_packages(mtplib.reports.__path__,
                                                       "mtplib.reports.")
                 if not m.ispkg and m.name != "mtplib.reports.common"
                 and not importlib.util.find_spec(m.name).origin.endswith("__init__.py"))


def _printed(main, *argv: str) -> str:
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert main(list(argv)) == 0
    return buf.getvalue().strip()


def test_the_reports_are_the_moved_scripts():
    """Every evidence script became a report (the projection page split in three: its
    inputs and two sections are helpers, not reports)."""
    helpers = {"mtplib.reports.wan.projection_inputs", "mtplib.reports.wan.projection_sections"}
    assert set(REPORTS) - helpers == set(MOVED_SCRIPTS.values())
    assert not [p for p in MOVED_SCRIPTS if (REPO / p).exists()]


@pytest.mark.parametrize("name", [r for r in REPORTS if "projection_" not in r
                                  and r != CLI_WRAPPER])
def test_every_report_answers_help_under_its_module_name(name, capsys):
    mod = importlib.import_module(name)
    with pytest.raises(SystemExit) as e:
        mod.main(["--help"])
    assert e.value.code == 0
    assert f"python -m {name}" in capsys.readouterr().out


def test_the_cli_wrapper_is_the_cli():
    r = subprocess.run([sys.executable, "-m", CLI_WRAPPER, "--help"], capture_output=True,
                       text=True, timeout=120, cwd="/")
    assert r.returncode == 0 and "serve" in r.stdout


def test_out_defaults_to_the_checkouts_evidence_folder(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    ap = common.parser("mtplib.reports.x", "doc")
    common.add_out(ap, "upstream-patches")
    out = ap.parse_args([]).out
    assert out.is_absolute() and out == paths.EVIDENCE / "upstream-patches"
    assert ap.parse_args(["--out", "d"]).out == Path("d")
    assert common.command("mtplib.reports.x", ["--a", "1"]) == [
        "python", "-m", "mtplib.reports.x", "--a", "1"]


def test_no_report_edits_sys_path_or_names_an_old_script():
    for p in Path(mtplib.reports.__path__[0]).rglob("*.py"):
        text = p.read_text()
        assert "sys.path" not in text and "noqa: E402" not in text, p
        assert "PYTHONPATH=$PWD" not in text and "PYTHONPATH=." not in text, p


# -- what the reports regenerate from committed inputs ----------------------------------
def test_upstream_patches_readme_tables_regenerate(tmp_path):
    from mtplib.reports.upstream_patches import report

    here = EVIDENCE / "upstream-patches"
    copy = tmp_path / "up"
    shutil.copytree(here, copy, ignore=shutil.ignore_patterns("*.gguf"))
    assert report.write_readme(copy) == copy / "README.md"
    assert (copy / "README.md").read_bytes() == (here / "README.md").read_bytes()


def test_ring_tables_are_shard_to_shard_mds():
    from mtplib.reports.upstream_patches import ring_kinds, ring_rtt, ring_tokens

    here = EVIDENCE / "upstream-patches"
    md = (here / "shard-to-shard.md").read_text()
    for mod, name in ((ring_kinds, "ring-kinds.json"), (ring_rtt, "ring-rtt.json"),
                      (ring_tokens, "ring-tokens.json")):
        for table in _printed(mod.main, "--table", str(here / name)).split("\n\n"):
            assert table.count("\n") >= 2 and table in md, name


def test_wan_target_headline_is_its_readmes():
    from mtplib.reports.wan import target_headline

    readme = (EVIDENCE / "wan" / "target" / "README.md").read_text()
    for argv in ([], ["--steps"]):
        table = _printed(target_headline.main, *argv)
        assert table.count("\n") >= 4 and table in readme


def test_ttft_summary_and_table_regenerate(tmp_path):
    from mtplib.reports.ttft import ttft

    src = EVIDENCE / "ttft" / "ttft.json"
    copy = tmp_path / "ttft.json"
    shutil.copy(src, copy)
    table = _printed(ttft.main, str(copy), "--resummarize")
    assert copy.read_bytes() == src.read_bytes()
    assert table in (EVIDENCE / "ttft" / "README.md").read_text()


def test_placement_table_regenerates(tmp_path):
    """``--table-only`` recomputes the table from the committed measurement: the same table
    (only the command it records names the module now) and the README's Markdown."""
    from mtplib.reports.placement import placement_table

    src = EVIDENCE / "placement" / "placement.json"
    shutil.copy(src, tmp_path / "placement.json")
    table = _printed(placement_table.main, "--out", str(tmp_path), "--table-only")
    got, want = (json.loads(p.read_text()) for p in (tmp_path / "placement.json", src))
    assert got.pop("table_command") == f"python -m {placement_table.MODULE} --out " \
        "evidence/placement --table-only"
    want.pop("table_command")
    assert got == want
    assert table in (EVIDENCE / "placement" / "README.md").read_text()


# -- the run records name the module -------------------------------------------------------
def test_rerun_names_the_module_with_the_same_arguments():
    assert rerun("evidence/serve/measure.py --prompts 16 --out x.json", "evidence/serve") == (
        "python -m mtplib.reports.serve.measure --prompts 16 --out x.json")
    # older files recorded the script's name alone: it is the folder's
    assert rerun("bytes_table.py --plan 0-1,2-3", "evidence/graph-reuse") == (
        "python -m mtplib.reports.graph_reuse.bytes_table --plan 0-1,2-3")
    assert rerun("PYTHONPATH=$PWD .venv/bin/python evidence/wan/projection_report.py",
                 "evidence/wan") == "python -m mtplib.reports.wan.projection"
    assert rerun("bytes_table.py --plan 0-1", "evidence/ttft") is None
    assert rerun("python tests/serve_traffic.py --seed 1", "evidence/serve") is None
    assert rerun("mtplib layer-cost --out x", "evidence/layer-cost") is None


def test_every_run_record_names_the_module_of_a_moved_script():
    """Each committed run entry whose command names a moved script says ``rerun``, as the
    tool writes it (`evidence_runs.entry`), and names a module that exists."""
    seen = 0
    for rec_path in sorted(EVIDENCE.glob("*/run_record.json")):
        rec = json.loads(rec_path.read_text())
        if evidence_runs.is_lane_record(rec):
            continue
        folder = rec_path.parent.relative_to(REPO).as_posix()
        for r in rec["runs"]:
            want = rerun(r["command"], folder)
            assert r.get("rerun") == want, (rec_path, r["file"])
            if want:
                seen += 1
                assert importlib.util.find_spec(want.split()[2]) is not None, want
    assert seen >= 20
