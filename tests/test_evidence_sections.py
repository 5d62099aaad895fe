"""The evidence READMEs are one function per section: each is callable on its own on the
committed raw data and gives exactly its part of the committed README."""

from __future__ import annotations

from pathlib import Path

import pytest

from mtplib.records import benchmark_report, evidence, ownership_report
from mtplib.records.readme import Links, numbers_trace

REPO = Path(__file__).resolve().parent.parent
STORIES = {"DGR-065": ownership_report, "DGR-066": benchmark_report}


def _committed(story: str):
    folder = REPO / "evidence" / story
    readme = folder / "README.md"
    if not readme.exists() or not (folder / "run_record.json").exists():
        pytest.skip(f"evidence/{story} not committed")
    raw = evidence.load_raw(folder, story)
    mod = STORIES[story]
    try:
        run = mod.Run.from_raw(folder, raw, Links(folder, readme))
    except ValueError as e:
        pytest.skip(f"evidence/{story} not refreshed from the current notebooks: {e}")
    return run, raw, readme.read_text()


CASES = [(story, s) for story, mod in STORIES.items() for s in mod.SECTIONS]


@pytest.mark.parametrize("story, section", CASES,
                         ids=[f"{st}-{s.__name__}" for st, s in CASES])
def test_section_alone_gives_its_part_of_the_committed_readme(story, section):
    run, raw, text = _committed(story)
    lines = section(run)
    assert lines and lines[-1] == "" and lines[0].startswith("#")
    assert all(isinstance(x, str) and "\n" not in x for x in lines)
    part = "\n".join(lines)
    assert part in text
    assert numbers_trace(part, raw) == []


@pytest.mark.parametrize("story", STORIES)
def test_sections_in_order_are_the_committed_readme(story):
    run, _, text = _committed(story)
    mod = STORIES[story]
    parts = ["\n".join(s(run)) for s in reversed(mod.SECTIONS)][::-1]  # order-independent
    assert "\n".join(parts) == text
    headings = [s(run)[0] for s in mod.SECTIONS]
    assert headings == [x for x in text.splitlines() if x.startswith("#")]  # one per section
    assert evidence.WRITERS[story] is mod.render


def test_writers_refuse_a_run_without_their_metrics(tmp_path):
    raw = {"run_record": {"run_dir": str(tmp_path)}}
    link = Links(tmp_path, tmp_path / "README.md")
    with pytest.raises(ValueError, match="did not run the benchmark"):
        benchmark_report.Run.from_raw(tmp_path, raw, link)
    with pytest.raises(ValueError, match="did not run notebooks"):
        ownership_report.Run.from_raw(tmp_path, raw, link)
    with pytest.raises(ValueError, match="older notebooks"):
        ownership_report.Run.from_raw(tmp_path, {**raw, "ownership": {}, "state": {}}, link)


def test_a_failed_check_is_shown_not_hidden():
    run, raw, _ = _committed("DGR-065")
    st = {**run.st, "golden": {**run.st["golden"], "identical": False,
                               "differs": ["seam.json"]}}
    bad = ownership_report.Run(run.run_dir, run.link, run.rec, run.own, st)
    text = "\n".join(ownership_report.criterion_4_contract(bad))
    assert "**differing**: `seam.json`." in text
    assert "every fixture regenerated" not in text
