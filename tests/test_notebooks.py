"""The notebooks: jupytext pairs in sync, output-free, on the `mtplib` kernel; papermill runs
a notebook through that kernelspec name; `./dev.sh lab` serves the repo root with it."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import jupytext
import nbformat
import pytest

from mtplib.records.jupyter import KERNEL
from mtplib.records.lanes import LaneError, kernel_env

REPO = Path(__file__).resolve().parent.parent
NB = REPO / "notebooks"
PAIRS = sorted(NB.glob("[0-9]*.py"))


def _cells(nb) -> list[tuple[str, str, list[str]]]:
    return [(c.cell_type, c.source, list(c.metadata.get("tags", []))) for c in nb.cells]


def test_every_notebook_is_a_pair():
    ipynbs = sorted(NB.glob("*.ipynb"))
    assert len(PAIRS) >= 6 and len(ipynbs) == len(PAIRS)
    assert [p.stem for p in PAIRS] == [p.stem for p in ipynbs]


@pytest.mark.parametrize("src", PAIRS, ids=lambda p: p.stem)
def test_pair_in_sync_and_output_free(src):
    """The percent source is the truth; the .ipynb papermill runs must say the same."""
    text = jupytext.read(src)
    nb = nbformat.read(str(src.with_suffix(".ipynb")), as_version=4)
    assert _cells(nb) == _cells(text), (
        f"{src.name} and {src.stem}.ipynb differ: run ./dev.sh notebooks")
    for c in nb.cells:
        if c.cell_type == "code":
            assert not c.outputs and c.execution_count is None, (
                f"{src.stem}.ipynb has outputs: run ./dev.sh notebooks")
    tagged = [c for c in nb.cells if "parameters" in c.metadata.get("tags", [])]
    assert len(tagged) == 1, f"{src.stem}: needs exactly one 'parameters' cell"
    for n in (nb, text):
        assert n.metadata["kernelspec"]["name"] == KERNEL


def test_sync_check_fails_on_an_edit(tmp_path):
    """The check above can fail: an edited source no longer matches its .ipynb."""
    src = PAIRS[0]
    text = jupytext.read(src)
    text.cells[-1].source += "\nprint('edited')"
    edited = tmp_path / src.name
    jupytext.write(text, edited)
    nb = nbformat.read(str(src.with_suffix(".ipynb")), as_version=4)
    assert _cells(jupytext.read(edited)) != _cells(nb)


def test_papermill_runs_the_mtplib_kernelspec(tmp_path, monkeypatch):
    """A notebook executed by kernelspec name runs this venv's interpreter and this mtplib."""
    import papermill as pm

    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": KERNEL, "display_name": "mtplib (.venv)",
                                 "language": "python"}
    nb.cells = [nbformat.v4.new_code_cell(
        "import json, sys, mtplib\n"
        "json.dump({'exe': sys.executable, 'mtplib': mtplib.__file__}, open('who.json', 'w'))")]
    src = tmp_path / "who.ipynb"
    nbformat.write(nb, str(src))
    for k, v in kernel_env().items():
        monkeypatch.setenv(k, v)
    pm.execute_notebook(str(src), str(tmp_path / "out.ipynb"), kernel_name=KERNEL,
                        cwd=str(tmp_path), progress_bar=False)
    who = json.loads((tmp_path / "who.json").read_text())
    assert Path(who["exe"]).parent.resolve() == Path(sys.executable).parent.resolve()
    import mtplib

    assert Path(who["mtplib"]).resolve() == Path(mtplib.__file__).resolve()


def test_kernel_of_another_interpreter_is_refused(tmp_path, monkeypatch):
    """A `mtplib` kernelspec pointing at some other Python (another checkout) is named."""
    kdir = tmp_path / "share" / "jupyter" / "kernels" / KERNEL
    kdir.mkdir(parents=True)
    (kdir / "kernel.json").write_text(json.dumps({
        "argv": ["/usr/bin/python3", "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "other", "language": "python"}))
    monkeypatch.setattr(sys, "prefix", str(tmp_path))
    with pytest.raises(LaneError, match="not this interpreter"):
        kernel_env()
    monkeypatch.setattr(sys, "prefix", str(tmp_path / "empty"))
    monkeypatch.setenv("JUPYTER_PATH", "")
    monkeypatch.setenv("JUPYTER_DATA_DIR", str(tmp_path / "nodata"))
    monkeypatch.setattr("jupyter_core.paths.SYSTEM_JUPYTER_PATH", [])
    monkeypatch.setattr("jupyter_core.paths.ENV_JUPYTER_PATH", [])
    with pytest.raises(LaneError, match="run ./dev.sh setup"):
        kernel_env()


@pytest.mark.slow
def test_dev_sh_lab_serves_the_repo_root_with_the_mtplib_kernel():
    """`./dev.sh lab` (as root here: --allow-root) prints a working URL; the server's root is
    the repo, its default kernel `mtplib`, and a percent source opens as a notebook."""
    env = {**os.environ, "DISPLAY": ""}
    p = subprocess.Popen([str(REPO / "dev.sh"), "lab"], cwd="/", env=env, text=True,
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                         start_new_session=True)
    try:
        url = None
        t0 = time.time()
        while url is None and time.time() - t0 < 120:
            line = p.stderr.readline()
            assert line or p.poll() is None, "dev.sh lab exited"
            m = re.search(r"(http://127\.0\.0\.1:\d+)/lab\?token=(\w+)", line)
            if m:
                url, token = m.groups()
        assert url, "dev.sh lab printed no URL"

        def get(path: str) -> dict:
            for _ in range(120):
                try:
                    with urllib.request.urlopen(f"{url}{path}?token={token}", timeout=5) as r:
                        return json.load(r)
                except OSError:
                    time.sleep(0.5)
            raise AssertionError(f"no answer from {url}{path}")

        specs = get("/api/kernelspecs")
        assert specs["default"] == KERNEL and KERNEL in specs["kernelspecs"]
        root = {c["name"] for c in get("/api/contents")["content"]}
        assert {"notebooks", "outputs", "evidence", "params", "README.md"} <= root
        nb = get(f"/api/contents/notebooks/{PAIRS[0].name}")
        assert nb["type"] == "notebook"
    finally:
        os.killpg(p.pid, 15)
        p.wait(timeout=30)
