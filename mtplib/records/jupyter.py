"""Jupyter around the notebooks: the `mtplib` kernelspec, quiet papermill runs, and a save
hook that keeps the committed notebooks free of outputs.

- `strip_on_save`: a contents-manager pre-save hook (``./dev.sh lab`` sets it). Saving a
  notebook that lives in the repo's ``notebooks/`` (Lab's autosave after Run All, too)
  writes it without outputs, execution counts or run metadata (`strip_notebook`), so the
  committed pairs stay as they are; notebooks anywhere else are saved as they are. The
  committed notebooks carry the ``language_info`` the kernel reports
  (`kernel_language_info`), which is all Lab changes when one is opened and its kernel
  connects: equal, it changes nothing and the notebook is not marked modified.
- `install_kernel`: the kernelspec that runs this interpreter, in this venv (what
  ``./dev.sh setup`` does) or, opt-in, in the user's Jupyter (``./dev.sh lab --user``), so a
  Jupyter outside the venv lists the ``mtplib`` kernel the notebooks name.
- `papermill_options`: what lanes pass to papermill so executed notebooks and lane logs
  carry no repeated noise: each cell's stream outputs merged (a loop's prints are one
  output; the lab's progress bars are one display output each anyway, `lab.progress`)
  and the kernel's connection encrypted with
  CurveZMQ keys provisioned by jupyter_client (ipykernel warns "Kernel is running over TCP
  without encryption" for every kernel otherwise). ``papermill IN OUT --engine mtplib``
  applies them to a run by hand (`mtplib.records.papermill_engine`).

``python -m mtplib.records.jupyter strip FILE...`` and ``... kernel [--user | --prefix
DIR] [--replace]`` are the command-line forms (dev.sh calls them).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from mtplib import logs, paths
from mtplib.errors import InputError

log = logging.getLogger(__name__)

#: The kernelspec notebooks and lanes run on.
KERNEL = "mtplib"
DISPLAY_NAME = "mtplib (.venv)"
#: the folder whose notebooks are saved without outputs
NOTEBOOKS = paths.REPO / "notebooks"
#: notebook metadata the committed notebooks carry (jupytext.toml's filter, and the
#: language_info their kernel reports); the rest (widgets state, ...) is run state
KEEP_METADATA = ("kernelspec", "jupytext", "language_info")


def kernel_language_info() -> dict:
    """The ``language_info`` this interpreter's ipykernel reports, which Lab writes into a
    notebook's metadata when its kernel connects: committed as it is, opening a notebook
    changes nothing (Lab skips an equal value) and so does not mark it modified."""
    from ipykernel.ipkernel import IPythonKernel

    return dict(IPythonKernel.language_info)


def strip_notebook(nb: dict, language_info: dict | None = None) -> dict:
    """``nb`` (a notebook as a dict, changed in place and returned) in its committed form:
    no outputs or execution counts, cells' metadata only their tags, the notebook's only
    kernelspec, jupytext (without its text_representation, as jupytext writes .ipynb)
    and language_info (``language_info`` when given)."""
    for c in nb.get("cells", []):
        if c.get("cell_type") == "code":
            c["outputs"], c["execution_count"] = [], None
        md = c.get("metadata") or {}
        c["metadata"] = {"tags": md["tags"]} if md.get("tags") else {}
    md = nb.get("metadata") or {}
    keep = {k: md[k] for k in KEEP_METADATA if k in md}
    if isinstance(keep.get("jupytext"), dict):
        keep["jupytext"] = {k: v for k, v in keep["jupytext"].items()
                            if k != "text_representation"}
    if language_info is not None:
        keep["language_info"] = language_info
    nb["metadata"] = keep
    return nb


def in_notebooks(path: str | Path, root_dir: str | Path | None = None) -> bool:
    """Is ``path`` (relative to the server's ``root_dir``, or absolute) a file directly in
    the repo's notebooks/ folder?"""
    p = Path(root_dir or ".") / str(path).lstrip("/")
    try:
        return p.resolve().parent == NOTEBOOKS.resolve()
    except OSError:
        return False


def strip_on_save(model: dict, path: str, contents_manager: object = None, **kw: object
                  ) -> None:
    """Jupyter's ``ContentsManager.pre_save_hook``: a notebook saved into notebooks/ is
    written in its committed form (`strip_notebook`); anything else is left alone."""
    if model.get("type") != "notebook" or not isinstance(model.get("content"), dict):
        return
    root = getattr(contents_manager, "root_dir", None)
    if in_notebooks(path, root):  # the committed language_info stays (another Python's too)
        strip_notebook(model["content"], _language_info_on_disk(Path(root or ".") / path))


def _language_info_on_disk(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())["metadata"]["language_info"]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def papermill_options() -> dict:
    """Keyword arguments for ``papermill.execute_notebook`` (nbclient options): merged
    stream outputs per cell and a CurveZMQ-encrypted kernel connection where the
    kernelspec declares support (ipykernel's kernelspecs do; otherwise as before)."""
    import zmq
    from traitlets.config import Config

    cfg = Config()
    if zmq.has("curve"):
        cfg.KernelManager.transport_encryption = "auto"
    return {"coalesce_streams": True, "config": cfg}


def kernel_dir(*, user: bool = False, prefix: str | Path | None = None) -> Path:
    """Where `install_kernel` writes: the user's Jupyter data dir (``JUPYTER_DATA_DIR``
    or the platform's), ``prefix``/share/jupyter, or this venv's."""
    from jupyter_core.paths import jupyter_data_dir

    if user and prefix is not None:
        raise InputError("give either --user or --prefix, not both")
    base = Path(jupyter_data_dir()) if user else Path(prefix or sys.prefix) / "share" / "jupyter"
    return base / "kernels" / KERNEL


def install_kernel(*, user: bool = False, prefix: str | Path | None = None,
                   replace: bool = False) -> Path:
    """Install the ``mtplib`` kernelspec running this interpreter (`kernel_dir` says
    where). A ``mtplib`` kernel there that runs another interpreter (another checkout's)
    is kept unless ``replace``: the user's own setup is not overwritten silently."""
    from ipykernel.kernelspec import install

    dest = kernel_dir(user=user, prefix=prefix)
    spec = dest / "kernel.json"
    if spec.is_file() and not replace:
        try:
            exe = json.loads(spec.read_text())["argv"][0]
        except (OSError, ValueError, KeyError, IndexError, TypeError):
            exe = None
        if exe is None or Path(exe).resolve() != Path(sys.executable).resolve():
            raise InputError(f"{spec} exists and runs {exe or 'something unreadable'}, not "
                             f"{sys.executable}; pass --replace to point it at this checkout")
    out = install(user=user, prefix=None if user else str(prefix or sys.prefix),
                  kernel_name=KERNEL, display_name=DISPLAY_NAME)
    return Path(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m mtplib.records.jupyter",
                                 description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("strip", help="write notebooks in their committed form (in place)")
    s.add_argument("files", nargs="+")
    k = sub.add_parser("kernel", help="install the mtplib kernelspec for this interpreter")
    k.add_argument("--user", action="store_true", help="into the user's Jupyter data dir")
    k.add_argument("--prefix", help="into PREFIX/share/jupyter/kernels")
    k.add_argument("--replace", action="store_true",
                   help="replace a mtplib kernel that runs another interpreter")
    a = ap.parse_args(argv)
    logs.configure()
    try:
        if a.cmd == "strip":
            import nbformat

            info = kernel_language_info()
            for f in a.files:
                nb = nbformat.read(f, as_version=4)
                nbformat.write(nbformat.from_dict(strip_notebook(nb, info)), f)
        else:
            print(install_kernel(user=a.user, prefix=a.prefix, replace=a.replace))
    except InputError as e:
        log.error("error: %s", e)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
