"""Every notebook runs when opened on its own (issue 16): no lane, no parameters, any working
directory. It writes only into its own scratch run folder under outputs/scratch/ (never into
notebooks/ or the working directory), and its long cells show progress bars. Also the parts
behind that: `records.scratch.notebook_run` and the lab loops' progress flags."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import nbformat
import pytest

from mtplib import paths
from mtplib.errors import InputError
from mtplib.lab import correctness as C
from mtplib.lab.bench import config as BC
from mtplib.lab.bench import measure as B
from mtplib.records import scratch as S
from mtplib.records.jupyter import KERNEL
from mtplib.records.lanes import kernel_env

REPO = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted(p.name for p in (REPO / "notebooks").glob("[0-9]*.ipynb"))
#: caches and tool folders a run may touch without that being the notebook's output
_SKIP_DIRS = {".git", ".venv", ".upstream", "__pycache__", ".pytest_cache", ".ruff_cache",
              ".hypothesis", ".ipynb_checkpoints"}


# -- the helper ---------------------------------------------------------------------------
def test_scratch_root_is_under_outputs_and_git_ignored():
    assert S.SCRATCH == paths.OUTPUTS / "scratch"
    probe = "outputs/scratch/00_fixture_smoke-20260101-000000/models/v4-tiny-s0.gguf"
    r = subprocess.run(["git", "check-ignore", "-q", probe], cwd=REPO)
    assert r.returncode == 0, f"{probe} is not git-ignored"


def test_no_run_dir_makes_a_scratch_folder_with_the_fixture(tmp_path, capsys):
    nb = S.notebook_run("00_fixture_smoke", None, None, None, root=tmp_path)
    assert nb.scratch and nb.run_dir.parent == tmp_path
    assert nb.run_dir.name.startswith("00_fixture_smoke-")
    assert Path(nb.trunk).parent == Path(nb.sidecar).parent == nb.run_dir / "models"
    assert Path(nb.trunk).is_file() and Path(nb.sidecar).name.startswith("mtp-")
    out = capsys.readouterr().out
    assert str(nb.run_dir) in out and "scratch" in out
    again = S.notebook_run("00_fixture_smoke", "", models=False, root=tmp_path, log=None)
    assert again.run_dir != nb.run_dir and again.trunk is None  # same second: a new folder
    assert capsys.readouterr().out == ""


def test_a_lane_run_dir_and_models_pass_through_untouched(tmp_path):
    run = tmp_path / "run"
    nb = S.notebook_run("03_correctness", str(run), "/m/t.gguf", "/m/mtp-t.gguf",
                        root=tmp_path / "scratch", log=None)
    assert (nb.run_dir, nb.trunk, nb.sidecar, nb.scratch) == (run, "/m/t.gguf",
                                                              "/m/mtp-t.gguf", False)
    assert not run.exists() and not (tmp_path / "scratch").exists()  # nothing written


def test_half_a_pair_and_bad_stems_are_refused(tmp_path):
    with pytest.raises(InputError, match="both trunk and sidecar"):
        S.notebook_run("x", None, "/m/t.gguf", None, root=tmp_path)
    for stem in ("../up", "a/b", ""):
        with pytest.raises(InputError, match="notebook stem"):
            S.scratch_dir(stem, root=tmp_path)
    assert not any(tmp_path.iterdir())


# -- progress flags of the lab loops ------------------------------------------------------
def test_correctness_progress_bar_counts_its_generations(pair, capsys):
    rows = C.equality(str(pair.trunk), str(pair.sidecar), seeds=[0, 1], ks=[1], n_new=4,
                      n_threads=1, progress=True)
    err = capsys.readouterr().err
    assert len(rows) == 2 and "equality" in err and "4/4" in err
    C.equality(str(pair.trunk), str(pair.sidecar), seeds=[0], ks=[1], n_new=4, n_threads=1)
    assert "equality" not in capsys.readouterr().err  # progress=False (the default): silent


class _Bar:
    """Records what `run_bench` tells its bar."""

    made: list[_Bar] = []

    def __init__(self, total, desc, enabled, **kw):
        self.total, self.desc, self.enabled, self.n = total, desc, enabled, 0
        _Bar.made.append(self)

    def update(self, n=1):
        self.n += n

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_bench_progress_total_is_the_number_of_generations(pair, monkeypatch):
    """`n_generations` (the bar's total) equals the generations made, whole and ranged,
    with sampling and the sweep; a total that drifts from the loops fails here."""
    monkeypatch.setattr(B, "progress_bar", _Bar)
    _Bar.made.clear()
    cfg = BC.BenchConfig.from_dict({
        "plans": ["whole", "0-1,2-3"], "ks": [1, 2], "n_new": 4, "reps": 1, "warmup": 1,
        "threads": 1, "prompts": [{"seed": 0, "len": 6}],
        "sweep": {"rates": [1.0], "ks": [1], "reps": 1, "warmup": 0},
        "sampling": {"seeds": 1, "n_new": 4}})
    res = B.run_bench(str(pair.trunk), str(pair.sidecar), cfg, progress=True)
    (bar,) = _Bar.made
    assert bar.enabled and bar.desc == "bench"
    assert bar.total == B.n_generations(cfg) == bar.n
    # the timed rows + one traced reference per prompt + sampled streams (off and each k)
    assert bar.n == len(res.runs) + len(res.sweep_runs) + len(cfg.prompts) + 3


# -- every notebook on its own ------------------------------------------------------------
def _files() -> set[str]:
    """Every file of the checkout but .git, caches and outputs/scratch (relative paths)."""
    out = set()
    for root, dirs, files in os.walk(REPO):
        rel = Path(root).relative_to(REPO)
        dirs[:] = [d for d in dirs if d not in _SKIP_DIRS
                   and (rel / d) != Path("outputs") / "scratch"]
        out.update(str(rel / f) for f in files if not f.endswith(".pyc"))
    return out


def _bars(nb) -> list[str]:
    """The progress bars of an executed notebook's code cells (fails unless each bar is one
    output, none on stderr)."""
    from test_jupyter import BAR, bar_outputs

    bars = []
    for c in nb.cells:
        if c.cell_type == "code":
            shown, err = bar_outputs(c.outputs)
            names = [t.split(":")[0] for t in shown]  # 05 shows one bar per build
            assert len(set(names)) == len(names), shown
            assert not any(BAR.search(t) for t in err), err
            bars += shown
    return bars


@pytest.mark.slow
@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_runs_on_its_own(name, tmp_path, monkeypatch):
    """papermill with NO parameters, cwd an empty folder: it must run through and write
    only its scratch run folder (removed afterwards)."""
    import papermill as pm

    for k, v in kernel_env().items():
        monkeypatch.setenv(k, v)
    stem = Path(name).stem
    before_scratch = set(S.SCRATCH.iterdir()) if S.SCRATCH.is_dir() else set()
    before = _files()
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    out_nb = tmp_path / name
    try:
        pm.execute_notebook(str(REPO / "notebooks" / name), str(out_nb), kernel_name=KERNEL,
                            cwd=str(cwd), progress_bar=False)
        made = sorted(set(S.SCRATCH.iterdir()) - before_scratch)
        assert [p.name.startswith(f"{stem}-") for p in made] == [True], made
        written = [p for p in made[0].rglob("*") if p.is_file()]
        assert written, f"{stem} wrote nothing into its scratch folder {made[0]}"
        logs = [p for p in written if p.name == "run.log"]  # 05: one per upstream build
        assert not any("mtplib-wan-progress" in p.read_text() for p in logs), logs
        assert not any(cwd.iterdir()), f"{stem} wrote into its working directory"
        assert _files() == before, f"{stem} wrote outside outputs/scratch: " \
            f"{sorted(_files() ^ before)}"
        bars = _bars(nbformat.read(str(out_nb), as_version=4))  # one output per bar
        if stem[:2] in ("03", "04", "05"):  # the long cells show their bars
            assert bars and all("100%" in b for b in bars), (stem, bars)
    finally:
        for p in (set(S.SCRATCH.iterdir()) - before_scratch) if S.SCRATCH.is_dir() else ():
            shutil.rmtree(p, ignore_errors=True)
