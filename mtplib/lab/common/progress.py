"""Progress bars for the lab's long loops (the notebooks' long cells), one per loop wherever
the loop runs:

- a terminal (the CLI, ``python -m ...``): tqdm's text bar on stderr, redrawn in place;
- a Jupyter kernel with ipywidgets installed: tqdm's widget (`tqdm.notebook`);
- a Jupyter kernel without ipywidgets (this venv): `DisplayBar`, the same text bar drawn as
  one display output that each refresh *updates* (``update_display_data``). JupyterLab
  shows it live; papermill and nbclient replace the stored output in place, so an executed
  notebook holds one output per bar, its last state, with or without ``--engine mtplib``.
  tqdm's own text bar writes one stderr message per refresh (every ``mininterval``), which
  Lab redraws in place but a plain ``papermill IN OUT`` stores as one output each: a short
  fixture bench gave 6 outputs for one bar, a long run hundreds.

Without ipywidgets `tqdm.auto` warns on import ("IProgress not found") in every notebook;
the fallback here is deliberate, so that warning is silenced."""

from __future__ import annotations

import io
import sys
import warnings
from typing import Any

from tqdm.std import tqdm as _TextBar

#: seconds between refreshes (tqdm's ``mininterval``): live enough, few messages
MININTERVAL = 0.5


class _Discard(io.TextIOBase):
    """Where `DisplayBar`'s text bar would write (nothing goes there); UTF-8, so tqdm draws
    the same unicode bar it draws on a kernel's stderr."""

    encoding = "utf-8"

    def write(self, s: str) -> int:
        return len(s)


class DisplayBar(_TextBar):
    """tqdm's text bar as one ``text/plain`` display output that every refresh updates in
    place (IPython's ``display_id``): live in a frontend, one stored output in an executed
    notebook. Only for a running IPython kernel (`in_kernel`)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._handle: Any = None
        kwargs["file"] = _Discard()
        super().__init__(*args, **kwargs)

    def display(self, msg: str | None = None, pos: int | None = None) -> bool:
        from IPython.display import display

        data = {"text/plain": self.__str__() if msg is None else msg}
        if self._handle is None:
            self._handle = display(data, raw=True, display_id=True)
        else:
            self._handle.update(data, raw=True)
        return True


def in_kernel() -> bool:
    """Is this code running in a Jupyter (IPython) kernel? tqdm.autonotebook's test: an
    IPython shell whose config names ``IPKernelApp`` (a terminal IPython has none)."""
    ipython = sys.modules.get("IPython")
    if ipython is None:
        return False
    shell = ipython.get_ipython()
    return shell is not None and "IPKernelApp" in getattr(shell, "config", {})


def bar_class() -> type:
    """The bar class for where this runs (the module docstring lists them)."""
    if not in_kernel():
        return _TextBar
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="IProgress not found")
        from tqdm import notebook
    return notebook.tqdm if getattr(notebook, "IProgress", None) is not None else DisplayBar


def bar(total: int | None, desc: str, enabled: bool, *, unit: str = "gen") -> Any:
    """A progress bar (`bar_class`); a disabled one when not ``enabled``: tests stay silent."""
    return bar_class()(total=total, desc=desc, unit=unit, disable=not enabled,
                       mininterval=MININTERVAL)
