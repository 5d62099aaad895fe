"""Arguments several commands share."""

from __future__ import annotations

import argparse


def add_log_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--verbose", action="store_true", help="show upstream's log lines")
    p.add_argument("--log-file", help="append upstream's log lines to this file")


def setup_logging(a: argparse.Namespace) -> None:
    from mtplib.runtime.lib import configure_logging

    configure_logging(verbose=a.verbose, log_file=a.log_file)


def parse_tokens(s: str) -> list[int]:
    try:
        toks = [int(x) for x in s.replace(" ", "").split(",") if x != ""]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--tokens takes comma-separated integers, got {s!r}") from None
    if not toks:
        raise argparse.ArgumentTypeError("--tokens is empty")
    return toks
