"""Jupyter around the notebooks (issue 23, item 6): saving from Lab cannot dirty the committed
notebooks, the `mtplib` kernelspec can be installed for the user's own Jupyter, and papermill
runs leave no repeated kernel noise or per-refresh progress outputs."""

from __future__ import annotations

import copy
import json
import re
import shutil
import sys
from pathlib import Path

import nbformat
import pytest

from mtplib.errors import InputError
from mtplib.records import jupyter as J

REPO = Path(__file__).resolve().parent.parent
NB = REPO / "notebooks"
HOOK = "mtplib.records.jupyter.strip_on_save"


# -- the committed form ------------------------------------------------------------------------
@pytest.mark.parametrize("path", sorted(NB.glob("[0-9]*.ipynb")), ids=lambda p: p.stem)
def test_committed_notebooks_are_in_the_stripped_form(path):
    """What a save through the hook writes is what is committed, byte for byte."""
    nb = nbformat.read(str(path), as_version=4)
    again = nbformat.writes(nbformat.from_dict(J.strip_notebook(copy.deepcopy(nb)))) + "\n"
    assert again == path.read_text()


@pytest.mark.parametrize("path", sorted(NB.glob("[0-9]*.ipynb")), ids=lambda p: p.stem)
def test_opening_in_lab_changes_no_metadata(path):
    """On open Lab sets the notebook's kernelspec from the kernel's spec and its
    language_info from the kernel's reply, and marks it modified only when a value
    differs: committed as the venv's `mtplib` kernel reports them, they do not (on another
    Python patch version language_info.version differs: the save hook keeps the file)."""
    from jupyter_client.kernelspec import KernelSpecManager

    from mtplib.records.lanes import kernel_env

    md = json.loads(path.read_text())["metadata"]
    dirs = [str(Path(d) / "kernels") for d in kernel_env()["JUPYTER_PATH"].split(":")]
    spec = KernelSpecManager(kernel_dirs=dirs).get_kernel_spec(J.KERNEL)
    assert md["kernelspec"] == {"name": J.KERNEL, "display_name": spec.display_name,
                                "language": spec.language}
    want, got = J.kernel_language_info(), dict(md["language_info"])
    assert got.pop("version").split(".")[:2] == want.pop("version").split(".")[:2]
    assert got == want


def _as_lab_leaves_it(nb: dict) -> dict:
    """A notebook after Run All and a kernel connection in Lab: outputs, counts, the full
    language_info, run metadata on cells."""
    nb = copy.deepcopy(nb)
    for i, c in enumerate(nb["cells"]):
        if c["cell_type"] == "code":
            c["execution_count"] = i + 1
            c["outputs"] = [{"output_type": "stream", "name": "stdout", "text": "x\n"}]
            c["metadata"]["execution"] = {"iopub.status.busy": "2026-01-01T00:00:00Z"}
            c["metadata"]["scrolled"] = True
    nb["metadata"]["language_info"] = {
        "codemirror_mode": {"name": "ipython", "version": 3}, "file_extension": ".py",
        "mimetype": "text/x-python", "name": "python", "nbconvert_exporter": "python",
        "pygments_lexer": "ipython3", "version": "3.11.9"}
    nb["metadata"]["widgets"] = {"application/vnd.jupyter.widget-state+json": {}}
    return nb


def test_lab_save_into_notebooks_keeps_the_pair_as_committed(tmp_path, monkeypatch):
    """Through jupytext's contents manager (what Lab saves with), configured with the hook
    exactly as `./dev.sh lab` passes it: saving a run notebook into notebooks/ writes both
    files of the pair unchanged; a notebook elsewhere keeps its outputs."""
    from jupytext import TextFileContentsManager
    from traitlets.config.loader import KVArgParseConfigLoader

    flag = f"--ContentsManager.pre_save_hook={HOOK}"
    assert flag in (REPO / "dev.sh").read_text()  # the lab command passes it
    root = tmp_path / "root"
    nbs = root / "notebooks"
    nbs.mkdir(parents=True)
    stem = "03_correctness"
    for f in (f"{stem}.ipynb", f"{stem}.py", "jupytext.toml"):
        shutil.copy(NB / f, nbs / f)
    monkeypatch.setattr(J, "NOTEBOOKS", nbs)
    cm = TextFileContentsManager(config=KVArgParseConfigLoader([flag]).load_config(),
                                 root_dir=str(root))
    assert cm.pre_save_hook is J.strip_on_save
    model = cm.get(f"notebooks/{stem}.ipynb")
    ran = _as_lab_leaves_it(model["content"])
    cm.save({"type": "notebook", "content": copy.deepcopy(ran)}, f"notebooks/{stem}.ipynb")
    for f in (f"{stem}.ipynb", f"{stem}.py"):
        assert (nbs / f).read_text() == (NB / f).read_text(), f
    (root / "mine").mkdir()
    cm.save({"type": "notebook", "content": ran}, "mine/x.ipynb")
    mine = nbformat.read(str(root / "mine" / "x.ipynb"), as_version=4)
    assert any(c.get("outputs") for c in mine.cells)


def test_hook_leaves_files_and_other_folders_alone(tmp_path):
    model = {"type": "file", "content": "text"}
    J.strip_on_save(model, "notebooks/x.txt")
    assert model == {"type": "file", "content": "text"}
    nb = {"cells": [{"cell_type": "code", "outputs": [1], "execution_count": 1,
                     "metadata": {}, "source": ""}], "metadata": {}}
    J.strip_on_save({"type": "notebook", "content": nb}, "elsewhere/x.ipynb",
                    type("CM", (), {"root_dir": str(tmp_path)})())
    assert nb["cells"][0]["outputs"] == [1]
    assert J.in_notebooks("notebooks/03_correctness.ipynb", REPO)
    assert not J.in_notebooks("notebooks/../03_correctness.ipynb", REPO)


# -- the kernelspec for the user's own Jupyter --------------------------------------------------
def test_user_kernel_install_is_seen_by_a_plain_jupyter(tmp_path, monkeypatch):
    """`--user` writes into the user's Jupyter data dir (JUPYTER_DATA_DIR here), running
    this interpreter; a Jupyter that knows nothing of the venv then lists it."""
    from jupyter_client.kernelspec import KernelSpecManager

    data = tmp_path / "data"
    monkeypatch.setenv("JUPYTER_DATA_DIR", str(data))
    out = J.install_kernel(user=True)
    assert out == data / "kernels" / J.KERNEL
    spec = KernelSpecManager(kernel_dirs=[str(data / "kernels")]).get_kernel_spec(J.KERNEL)
    assert Path(spec.argv[0]) == Path(sys.executable)
    assert spec.display_name == J.DISPLAY_NAME
    assert J.install_kernel(user=True) == out  # again: same interpreter, fine


def test_another_checkouts_kernel_is_not_replaced_silently(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("JUPYTER_DATA_DIR", str(tmp_path / "data"))
    kdir = J.kernel_dir(user=True)
    kdir.mkdir(parents=True)
    other = {"argv": ["/other/venv/bin/python", "-m", "ipykernel_launcher", "-f",
                      "{connection_file}"], "display_name": "other", "language": "python"}
    (kdir / "kernel.json").write_text(json.dumps(other))
    with pytest.raises(InputError, match="runs /other/venv/bin/python.*--replace"):
        J.install_kernel(user=True)
    assert json.loads((kdir / "kernel.json").read_text()) == other
    assert J.main(["kernel", "--user"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--replace" in err[0]
    assert J.main(["kernel", "--user", "--replace"]) == 0
    assert json.loads((kdir / "kernel.json").read_text())["argv"][0] == sys.executable


def test_prefix_install_and_bad_combination(tmp_path):
    out = J.install_kernel(prefix=tmp_path / "p")
    assert out == tmp_path / "p" / "share" / "jupyter" / "kernels" / J.KERNEL
    assert (out / "kernel.json").is_file()
    with pytest.raises(InputError, match="either --user or --prefix"):
        J.install_kernel(user=True, prefix=tmp_path)


# -- quiet papermill runs ----------------------------------------------------------------------
#: tqdm's elapsed time, e.g. "[00:01<00:02, 3.1gen/s]" or "[00:01, 3.1gen/s]" (no total)
BAR = re.compile(r"\[\d\d:\d\d")


def bar_outputs(outputs: list) -> tuple[list[str], list[str]]:
    """(the texts of a cell's outputs that show a progress bar, its stderr stream texts)."""
    texts = [o.get("text", "") if o.get("output_type") == "stream"
             else o.get("data", {}).get("text/plain", "") for o in outputs]
    err = [o["text"] for o in outputs if o.get("name") == "stderr"]
    return [t for t in texts if BAR.search(t)], err


@pytest.mark.slow
@pytest.mark.parametrize("how", ["bare", "options", "engine"])
def test_papermill_run_without_kernel_noise_or_per_refresh_outputs(tmp_path, monkeypatch, capfd,
                                                                   how):
    """A progress bar that refreshes several times is ONE output, its last state (100%),
    and nothing on stderr: with a plain ``papermill IN OUT`` ("bare"; before, one stderr
    output per refresh: 6 here, 5 states and a newline), with the options lanes pass and
    with the `mtplib` engine; those two also start the kernel without the "without
    encryption" warning (a bare run's kernel still logs it once, to papermill's stderr)."""
    import papermill as pm
    from papermill.engines import papermill_engines

    from mtplib.records.lanes import kernel_env
    from mtplib.records.papermill_engine import QuietEngine

    for k, v in kernel_env().items():
        monkeypatch.setenv(k, v)
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": J.KERNEL, "display_name": J.DISPLAY_NAME,
                                 "language": "python"}
    nb.cells = [nbformat.v4.new_code_cell(
        "import time\nfrom mtplib.lab.common.progress import bar\n"
        "with bar(30, 'loop', True) as b:\n"
        "    for _ in range(30):\n        time.sleep(0.06)\n        b.update()\n"
        "print('done')")]
    nbformat.write(nb, str(tmp_path / "in.ipynb"))
    if how == "engine":  # as the entry point registers it once the package is installed
        monkeypatch.setitem(papermill_engines._engines, "mtplib", QuietEngine)
    kw = {"options": J.papermill_options(), "engine": {"engine_name": "mtplib"}}.get(how, {})
    pm.execute_notebook(str(tmp_path / "in.ipynb"), str(tmp_path / "out.ipynb"),
                        kernel_name=J.KERNEL, cwd=str(tmp_path), progress_bar=False, **kw)
    if how != "bare":
        assert "without encryption" not in capfd.readouterr().err
    out = nbformat.read(str(tmp_path / "out.ipynb"), as_version=4).cells[0].outputs
    bars, err = bar_outputs(out)
    assert err == [] and len(bars) == 1, (bars, err)
    assert re.fullmatch(r"loop: 100%\|\S+\| 30/30 \[.*\]", bars[0]), bars[0]
    assert [o.get("text") for o in out if o.get("name") == "stdout"] == ["done\n"]


def test_papermill_engine_entry_point_names_the_quiet_engine():
    """pyproject registers `--engine mtplib` (active once the package is (re)installed)."""
    import importlib
    import tomllib

    from mtplib.records.papermill_engine import QuietEngine

    eps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["entry-points"]
    mod, _, attr = eps["papermill.engine"]["mtplib"].partition(":")
    assert getattr(importlib.import_module(mod), attr) is QuietEngine
