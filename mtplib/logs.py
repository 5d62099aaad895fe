"""mtplib's diagnostics go through `logging`, never ``print`` to stderr: each module logs to
``logging.getLogger(__name__)`` (under ``mtplib``), and an entry point (the CLI's `main`, a
``python -m`` module's) calls `configure` once. Importing mtplib configures nothing: a
program that uses it as a library and configures no logging sees its warnings and errors
(Python's last-resort handler, the message alone on stderr) and nothing below them.

`RateLimited` is the one rate limit for lines that peers cause (the service's, a shard
front's): peers that leave, stall or fail to prove themselves are outside our control; one
line each is useful, thousands a second would fill the log.

Foundation layer: imports only the standard library, `mtplib.envs` and `mtplib.errors`.
"""

from __future__ import annotations

import logging
import math
import sys
import threading
import time
from collections.abc import Callable

from mtplib import envs
from mtplib.errors import InputError

#: the logger every mtplib module's logger sits under
ROOT = "mtplib"
#: the loggers `configure` sets up: mtplib's, and that of a module run as ``python -m``
#: (its ``logging.getLogger(__name__)`` is then ``__main__``)
CONFIGURED = (ROOT, "__main__")


class StderrHandler(logging.StreamHandler):
    """Writes each line to ``sys.stderr`` as it is when the line is written (a redirect,
    pytest's capture), not as it was when the handler was made."""

    def __init__(self) -> None:
        super().__init__()
        self.setFormatter(logging.Formatter("%(message)s"))

    @property
    def stream(self):  # type: ignore[override]
        return sys.stderr

    @stream.setter
    def stream(self, _value) -> None:
        pass


def configure(level: int | None = None) -> None:
    """An entry point's logging: mtplib's lines (`CONFIGURED`) on stderr as they are written
    (the message alone, as they were printed before logging), from ``level`` up (default
    $MTPLIB_LOG_LEVEL, else INFO). Idempotent: a second call sets the level again and adds
    no second handler. Records still propagate, so a program's own handlers see them too.
    A bad $MTPLIB_LOG_LEVEL is one warning line (INFO is used), never a failed start."""
    bad = None
    if level is None:
        try:
            level = envs.log_level()
        except InputError as e:
            level, bad = logging.INFO, e
    for name in CONFIGURED:
        logger = logging.getLogger(name)
        logger.setLevel(level)
        if not any(isinstance(h, StderrHandler) for h in logger.handlers):
            logger.addHandler(StderrHandler())
    if bad is not None:
        logging.getLogger(__name__).warning("mtplib: %s; using INFO", bad)


class RateLimited:
    """A log writer that passes at most ``lines`` lines per ``window_s`` to ``write`` (e.g.
    a logger's ``warning``), then, before the first line of a later window, one line saying
    how many it dropped. Thread-safe; ``write`` is called outside its lock."""

    def __init__(self, write: Callable[[str], None], lines: int = 20,
                 window_s: float = 10.0) -> None:
        self.write, self.lines, self.window_s = write, lines, window_s
        self.t0, self.n, self.dropped = -math.inf, 0, 0
        self.lock = threading.Lock()

    def __call__(self, line: str) -> None:
        now = time.monotonic()
        with self.lock:
            dropped = 0
            if now - self.t0 > self.window_s:
                dropped, self.dropped, self.t0, self.n = self.dropped, 0, now, 0
            self.n += 1
            if self.n > self.lines:
                self.dropped += 1
                return
        if dropped:
            self.write(f"({dropped} similar lines dropped in {self.window_s:g} s)")
        self.write(line)
