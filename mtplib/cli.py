"""`mtplib` command line. Each sub-command lives in mtplib/commands/<name>.py.

Errors that come from bad input print one line saying what is wrong and what to do, and
exit 2; upstream is never reached with an input it would abort on.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import sys

from mtplib.commands import COMMANDS
from mtplib.errors import CheckFailed, MtplibError

EPILOG = """examples:
  mtplib fixture --out fixtures                      # tiny V4 trunk + mtp- sidecar
  mtplib generate --model fixtures/v4-tiny-s0.gguf --tokens 1,2,3 --n 32 --json
  mtplib run --params params/cpu-fixture.yaml        # every notebook, into outputs/<run-id>/
  mtplib info                                        # pinned upstream and what is loaded
"""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="mtplib", description="DeepSeek-V4 multi-token prediction (MTP) on upstream "
        "llama.cpp: tiny V4 fixtures, the ownership contract, the MTP runtime, and "
        "papermill evidence runs.",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True, metavar="COMMAND")
    for name in COMMANDS:
        importlib.import_module(f"mtplib.commands.{name.replace('-', '_')}").register(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.fn(args) or 0)
    except CheckFailed as e:  # a check ran and found a fault
        print(f"mtplib {args.cmd}: check failed: {e}", file=sys.stderr)
        return 1
    except MtplibError as e:  # bad input, or upstream/a shard/a tool refused: one line
        print(f"mtplib {args.cmd}: error: {e}", file=sys.stderr)
        return 2
    except (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError,
            FileExistsError) as e:  # a path the user gave: say which, and why
        print(f"mtplib {args.cmd}: error: {e.strerror or e}: {e.filename}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # `mtplib ... | head`: the reader left; not an error of ours
        with contextlib.suppress(OSError):
            sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - flushed at exit, not read
        return 0
    except KeyboardInterrupt:
        print(f"mtplib {args.cmd}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
