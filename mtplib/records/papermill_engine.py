"""The papermill engine ``mtplib`` (pyproject's ``papermill.engine`` entry point):
papermill's nbclient engine with the options lanes use (`jupyter.papermill_options`), so
``papermill IN OUT --engine mtplib -p ...`` by hand gives the same quiet executed notebook:
one merged stream output per cell, no "Kernel is running over TCP without encryption"."""

from __future__ import annotations

from papermill.engines import NBClientEngine

from mtplib.records.jupyter import papermill_options


class QuietEngine(NBClientEngine):
    """`NBClientEngine` with `papermill_options` (explicit keyword arguments win)."""

    @classmethod
    def execute_managed_notebook(cls, nb_man, kernel_name, **kwargs):
        return super().execute_managed_notebook(nb_man, kernel_name,
                                                **{**papermill_options(), **kwargs})
