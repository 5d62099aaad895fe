"""`mtplib info`: the pinned upstream, checked against what is installed."""

from __future__ import annotations

import argparse
import json

from mtplib.commands.common import add_log_args, setup_logging


def run(a: argparse.Namespace) -> int:
    setup_logging(a)
    from mtplib.runtime.lib import upstream_info

    print(json.dumps(upstream_info(), indent=2))
    return 0


def register(sub) -> None:
    i = sub.add_parser("info", help="show the pinned upstream and check the loaded build")
    add_log_args(i)
    i.set_defaults(fn=run)
