"""Issue 42, point 2: diagnostics are `logging` lines (no ``print`` to stderr outside the
command line's own output), the CLI configures logging once (`mtplib.logs.configure`), and
one rate limit (`mtplib.logs.RateLimited`) serves the service and a shard's front."""

from __future__ import annotations

import ast
import io
import logging
import sys
import time
from pathlib import Path

import pytest

from mtplib import logs

REPO = Path(__file__).resolve().parent.parent
PKG = REPO / "mtplib"
#: where writing to stderr directly is the program's output, not a diagnostic, and why
STDERR_WRITERS = {
    "mtplib/cli.py": "the command line's own lines: an error, a usage, an interruption",
    "mtplib/commands/": "the verbs' own lines: a note on an option, a shard's banner, "
                        "progress a verb's --quiet turns off",
    "mtplib/reports/": "the evidence's report scripts (python -m mtplib.reports...): their "
                       "output, e.g. serve_steplog's STEPLOG lines the evidence reads back",
    "mtplib/records/papermill_engine.py": "papermill's command line: the one line that "
                                          "replaces its traceback (an excepthook)",
    "mtplib/runtime/lib.py": "upstream's own log text passed through as it comes (fragments "
                             "of lines), under --verbose or $MTPLIB_SHOW_ERRORS",
    "mtplib/runtime/grammar.py": "writes back what upstream wrote to fd 2 while its "
                                 "parser's reason was captured",
}


def _stderr_writes(source: str) -> list[int]:
    """Lines of ``print(..., file=sys.stderr)`` and ``sys.stderr.write(...)``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Call):
            continue
        f = node.func
        if isinstance(f, ast.Name) and f.id == "print" and any(
                k.arg == "file" and "stderr" in ast.unparse(k.value) for k in node.keywords):
            found.append(node.lineno)
        elif (isinstance(f, ast.Attribute) and f.attr in ("write", "writelines")
              and "stderr" in ast.unparse(f.value)):
            found.append(node.lineno)
    return found


def _allowed(rel: str) -> bool:
    return any(rel == k or (k.endswith("/") and rel.startswith(k)) for k in STDERR_WRITERS)


def test_no_print_to_stderr_outside_the_command_line():
    offences = [f"{rel}:{line}" for p in sorted(PKG.rglob("*.py"))
                if not _allowed(rel := p.relative_to(REPO).as_posix())
                for line in _stderr_writes(p.read_text())]
    assert not offences, ("log it: log = logging.getLogger(__name__) (mtplib.logs)\n"
                          + "\n".join(offences))
    for key in STDERR_WRITERS:  # every allowance still names something
        assert (REPO / key).exists(), key


def test_the_stderr_scan_sees_prints_and_writes():
    src = ("import sys\nprint('a', file=sys.stderr)\nsys.stderr.write('b')\nprint('c')\n"
           "print('d', file=out)\n")
    assert _stderr_writes(src) == [2, 3]
    assert _allowed("mtplib/commands/generate.py") and not _allowed("mtplib/serve/logs.py")


# -- one handler, configured by the entry point ----------------------------------------------
@pytest.fixture
def clean_mtplib_logger():
    """Leave the mtplib and __main__ loggers as they were."""
    saved = [(lg, lg.level, list(lg.handlers)) for lg in map(logging.getLogger,
                                                               logs.CONFIGURED)]
    yield
    for lg, level, handlers in saved:
        lg.setLevel(level)
        lg.handlers[:] = handlers


def test_configure_is_idempotent_and_writes_the_message_to_the_current_stderr(
        clean_mtplib_logger, monkeypatch):
    logs.configure(logging.INFO)
    logs.configure(logging.INFO)
    handlers = [h for h in logging.getLogger("mtplib").handlers
                if isinstance(h, logs.StderrHandler)]
    assert len(handlers) == 1
    err = io.StringIO()
    monkeypatch.setattr(sys, "stderr", err)  # a redirect made after configure()
    logging.getLogger("mtplib.some.module").info("mtplib x: %s", "one line")
    logging.getLogger("mtplib.some.module").debug("not shown at INFO")
    assert err.getvalue() == "mtplib x: one line\n"


def test_a_bad_log_level_is_one_warning_not_a_failed_start(clean_mtplib_logger,
                                                          monkeypatch):
    monkeypatch.setenv("MTPLIB_LOG_LEVEL", "loud")
    err = io.StringIO()
    monkeypatch.setattr(sys, "stderr", err)
    logs.configure()
    assert logging.getLogger("mtplib").level == logging.INFO
    assert err.getvalue().startswith("mtplib: MTPLIB_LOG_LEVEL must be one of")


def test_the_cli_configures_logging(clean_mtplib_logger, monkeypatch, capsys):
    from mtplib.cli import main

    for lg in map(logging.getLogger, logs.CONFIGURED):
        lg.handlers[:] = [h for h in lg.handlers if not isinstance(h, logs.StderrHandler)]
    monkeypatch.setenv("MTPLIB_LOG_LEVEL", "WARNING")
    assert main(["generate", "--model", "no-such.gguf", "--tokens", "1", "--n", "1"]) == 2
    assert "no-such.gguf" in capsys.readouterr().err
    lg = logging.getLogger("mtplib")
    assert lg.level == logging.WARNING
    assert sum(isinstance(h, logs.StderrHandler) for h in lg.handlers) == 1


# -- one rate limit ---------------------------------------------------------------------------
def test_the_rate_limit_says_how_many_lines_it_dropped():
    out: list[str] = []
    limited = logs.RateLimited(out.append, lines=3, window_s=0.2)
    for i in range(10):
        limited(f"line {i}")
    time.sleep(0.25)
    limited("after")
    assert out == ["line 0", "line 1", "line 2", "(7 similar lines dropped in 0.2 s)",
                   "after"]


def test_the_service_and_a_shard_front_share_the_rate_limit(caplog):
    from mtplib.distributed.front import LOG_LINES
    from mtplib.distributed.plain_front import PlainFront
    from mtplib.serve.logs import LimitedLog

    assert isinstance(LimitedLog(), logs.RateLimited)
    front = PlainFront(("127.0.0.1", 0), ("127.0.0.1", 9))  # never started: no socket use
    try:
        assert isinstance(front.log, logs.RateLimited)
        with caplog.at_level(logging.WARNING, logger="mtplib.distributed.front"):
            for i in range(LOG_LINES + 5):
                front.log(f"stranger {i}")
        lines = [r.getMessage() for r in caplog.records
                 if r.name == "mtplib.distributed.front"]
        # its default: warnings of the module's logger, "mtplib <kind>: ..."
        assert lines[0] == f"mtplib {front.kind}: stranger 0"
        assert len(lines) == LOG_LINES
    finally:
        front.close()
