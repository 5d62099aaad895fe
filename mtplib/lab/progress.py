"""Progress bars for the lab's long loops (the notebooks' long cells): `tqdm.auto`, a widget
in JupyterLab where ipywidgets is installed, a text bar elsewhere. Without ipywidgets
`tqdm.auto` warns on import ("IProgress not found") in every notebook that shows a bar;
the text bar it falls back to works, so that warning is silenced here."""

from __future__ import annotations

import warnings
from typing import Any


def bar(total: int | None, desc: str, enabled: bool, *, unit: str = "gen") -> Any:
    """A `tqdm.auto` bar (a disabled one when not ``enabled``: tests stay silent)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="IProgress not found")
        from tqdm.auto import tqdm
    return tqdm(total=total, desc=desc, unit=unit, disable=not enabled, mininterval=0.5)
