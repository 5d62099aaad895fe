"""The papermill engine ``mtplib`` (pyproject's ``papermill.engine`` entry point):
papermill's nbclient engine with the options lanes use (`jupyter.papermill_options`), so
``papermill IN OUT --engine mtplib -p ...`` by hand gives the same quiet executed notebook:
one merged stream output per cell, no "Kernel is running over TCP without encryption".

papermill imports every ``papermill.engine`` entry point when it starts, whichever engine
runs, so this module is also where a notebook's refused parameter (a `ParameterError` in
its check cell) becomes one line on papermill's stderr and exit status 1, instead of
papermill's own traceback around the cell's: `one_line_errors` wraps ``sys.excepthook``
for that one exception and hands every other one to the hook before it."""

from __future__ import annotations

import sys
from collections.abc import Callable
from types import TracebackType

from papermill.engines import NBClientEngine
from papermill.exceptions import PapermillExecutionError

from mtplib.records.jupyter import papermill_options

#: the notebook errors shown as their one line (the check cell's, `records.parameters`)
ONE_LINE = frozenset({"ParameterError"})

Hook = Callable[[type[BaseException], BaseException, TracebackType | None], object]


class QuietEngine(NBClientEngine):
    """`NBClientEngine` with `papermill_options` (explicit keyword arguments win)."""

    @classmethod
    def execute_managed_notebook(cls, nb_man, kernel_name, **kwargs):
        return super().execute_managed_notebook(nb_man, kernel_name,
                                                **{**papermill_options(), **kwargs})


def one_line_errors(previous: Hook) -> Hook:
    """An excepthook that prints an uncaught `PapermillExecutionError` of a `ONE_LINE`
    kind as ``NAME: message`` and passes anything else to ``previous``."""
    def hook(tp: type[BaseException], value: BaseException, tb: TracebackType | None
             ) -> object:
        if isinstance(value, PapermillExecutionError) and value.ename in ONE_LINE:
            print(f"{value.ename}: {value.evalue}", file=sys.stderr)
            return None
        return previous(tp, value, tb)

    hook.one_line_errors = True  # type: ignore[attr-defined]
    return hook


if not getattr(sys.excepthook, "one_line_errors", False):
    sys.excepthook = one_line_errors(sys.excepthook)
