"""The lab's progress bars (`mtplib.lab.common.progress`): a text bar on a terminal's stderr, and in
a Jupyter kernel without ipywidgets one display output updated in place, so that a plain
``papermill IN OUT`` stores one output per bar instead of one per refresh (issue 23, item 6;
the papermill runs themselves are in test_jupyter.py)."""

from __future__ import annotations

import re
from types import SimpleNamespace

import IPython
import IPython.display
import pytest
from tqdm import notebook
from tqdm.std import tqdm as TextBar

from mtplib.lab.common import progress as P


@pytest.fixture
def kernel(monkeypatch):
    """This process seen as a Jupyter kernel (what `in_kernel` checks)."""
    shell = SimpleNamespace(config={"IPKernelApp": {}})
    monkeypatch.setattr(IPython, "get_ipython", lambda: shell)


class Frontend:
    """Records IPython `display` calls as a frontend would show them (update in place)."""

    def __init__(self) -> None:
        self.shown: list[str] = []
        self.updates = 0

    def display(self, data, raw=False, display_id=None):
        assert raw and display_id is True
        self.shown.append(data["text/plain"])
        index = len(self.shown) - 1

        def update(new, raw=False):
            assert raw
            self.updates += 1
            self.shown[index] = new["text/plain"]
        return SimpleNamespace(update=update)


def test_terminal_gets_tqdms_text_bar_on_stderr(capsys):
    assert not P.in_kernel() and P.bar_class() is TextBar
    with P.bar(3, "term", True) as b:
        b.update(3)
    err = capsys.readouterr().err
    assert "\r" in err and "term: 100%" in err and "3/3" in err


def test_kernel_without_ipywidgets_gets_one_display_updated_in_place(kernel, monkeypatch,
                                                                     capsys):
    monkeypatch.setattr(notebook, "IProgress", None)
    assert P.in_kernel() and P.bar_class() is P.DisplayBar
    front = Frontend()
    monkeypatch.setattr(IPython.display, "display", front.display)
    with P.bar(5, "nb", True, unit="case") as b:
        b.mininterval = 0  # every update refreshes: the worst case for stored outputs
        for _ in range(5):
            b.update()
    assert len(front.shown) == 1 and front.updates >= 5
    assert re.fullmatch(r"nb: 100%\|█+\| 5/5 \[.*case/s\]", front.shown[0]), front.shown
    assert capsys.readouterr() == ("", "")  # nothing on stdout or stderr


def test_kernel_with_ipywidgets_gets_tqdms_widget(kernel, monkeypatch):
    monkeypatch.setattr(notebook, "IProgress", object)
    assert P.bar_class() is notebook.tqdm


def test_disabled_bar_shows_nothing(kernel, monkeypatch, capsys):
    monkeypatch.setattr(notebook, "IProgress", None)
    front = Frontend()
    monkeypatch.setattr(IPython.display, "display", front.display)
    with P.bar(2, "off", False) as b:
        b.update(2)
    assert front.shown == [] and capsys.readouterr() == ("", "")
