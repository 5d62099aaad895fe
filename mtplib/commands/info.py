"""`mtplib info`: the pinned upstream, checked against what is installed."""

from __future__ import annotations

import argparse
import json

from mtplib.commands.common import add_json_arg, add_log_args, setup_logging


def run(a: argparse.Namespace) -> int:
    setup_logging(a)
    from mtplib.runtime.lib import upstream_info

    print(json.dumps(upstream_info(), indent=None if a.json else 2))
    return 0


def register(sub) -> None:
    i = sub.add_parser("info", help="show the pinned upstream and check the loaded build",
                       description="Print the pinned upstream (llama-cpp-python version, "
                       "llama.cpp commit, build flags) next to what is installed and loaded "
                       "here (library folder, stock or patched build, upstream's system info "
                       "line), as indented JSON. A build that does not match the pins (version, "
                       "RPC library, MTP bindings) is an error (exit 2).")
    add_json_arg(i, "the same object on one line")
    add_log_args(i)
    i.set_defaults(fn=run)
