"""What every report module shares: the evidence folder it writes (resolved from the
repository, not the working directory), the command line a results file records, and the
logging its progress lines go to (stdout stays for the report's product: a table, a JSON
document)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from mtplib import logs, paths


def evidence(topic: str) -> Path:
    """``evidence/<topic>`` of this checkout, wherever the command runs from."""
    return paths.EVIDENCE / topic


def add_out(ap: argparse.ArgumentParser, topic: str, what: str = "the evidence folder "
            "written") -> None:
    """``--out DIR``, defaulting to ``evidence/<topic>`` of this checkout."""
    ap.add_argument("--out", type=Path, default=evidence(topic),
                    help=f"{what} (default: {evidence(topic).relative_to(paths.REPO)}/)")


def parser(module: str, doc: str | None, **kw) -> argparse.ArgumentParser:
    """An argument parser named by the module (``python -m mtplib.reports...``), described
    by the first paragraph of ``doc``."""
    return argparse.ArgumentParser(prog=f"python -m {module}",
                                   description=(doc or "").split("\n\n")[0], **kw)


def command(module: str, argv: list[str] | None) -> list[str]:
    """The command a results file records for this run: the module and its arguments."""
    return ["python", "-m", module, *(sys.argv[1:] if argv is None else argv)]


def setup_logging() -> None:
    """Progress lines to stderr, one message per line, as the scripts printed them (the
    entry point's `mtplib.logs.configure`)."""
    logs.configure()
