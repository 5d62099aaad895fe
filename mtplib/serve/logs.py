"""The service's log lines ("mtplib serve: ..."), through the ``mtplib.serve`` logger (the
CLI shows them on stderr: `mtplib.logs.configure`), and the rate limit for the lines that
peers cause (`LimitedLog`: `mtplib.logs.RateLimited`, the one a shard front uses too).

Why limited: peers that leave or stall are outside the service's control; one line each
is useful, thousands a second would fill the log."""

from __future__ import annotations

import logging
from collections.abc import Callable

from mtplib.logs import RateLimited

log = logging.getLogger("mtplib.serve")


def log_line(msg: str, level: int = logging.INFO) -> None:
    log.log(level, "mtplib serve: %s", msg)


def _warning(msg: str) -> None:
    log_line(msg, logging.WARNING)


class LimitedLog(RateLimited):
    """At most ``lines`` lines per ``window_s`` (peers that leave or stall must not fill
    the log), then one line saying how many were dropped; warnings by default."""

    def __init__(self, write: Callable[[str], None] = _warning, lines: int = 20,
                 window_s: float = 10.0) -> None:
        super().__init__(write, lines, window_s)
