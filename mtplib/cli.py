"""`mtplib` command line. Each sub-command lives in mtplib/commands/<name>.py.

Errors that come from bad input print one line saying what is wrong and what to do, and
exit 2 (so does a file the machine refuses to write: a full or read-only disk); upstream
is never reached with an input it would abort on. The exit codes are `EXIT_CODES`, shown
in every --help. Every verb takes ``--json``: its result is then one JSON object on
stdout, and so is any error (``{"error", "kind", "type", "command", "exit"}``), with the
same exit codes. Output that cannot be written (stdout on a full or failing device) is one
line on stderr, exit 2, with or without --json (stdout cannot carry its JSON); a reader
that left the pipe (``| head``) ends it quietly, exit 0. `main` writes and flushes every
command's output inside its guard (`_Output`), never in Python's flush at exit.
Diagnostics are `logging` lines (`mtplib.logs`), configured here once: on stderr, from
$MTPLIB_LOG_LEVEL (default INFO) up, a verb's ``--verbose`` down to DEBUG.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import sys
from collections.abc import Iterable
from typing import TextIO

from mtplib import logs, paths, pins
from mtplib.commands import COMMANDS
from mtplib.commands.common import llama_spelling_message
from mtplib.errors import CheckFailed, InputError, MtplibError, UpstreamFault

EPILOG = """examples:
  mtplib fixture --out fixtures                      # tiny V4 trunk + mtp- sidecar
  mtplib generate --model fixtures/v4-tiny-s0.gguf --tokens 1,2,3 --n 32 --json
  mtplib serve -m TRUNK -md SIDECAR --draft 2 --port 8080  # OpenAI-compatible HTTP service
  mtplib run --params params/cpu-fixture.yaml        # every notebook, into outputs/<run-id>/
  mtplib info                                        # pinned upstream and what is loaded
"""

EXIT_CODES = """exit codes:
  0    done
  1    a check ran and found a fault (check failed)
  2    bad input, a refusal, or a file that cannot be read or written
       (one line; with --json one JSON object whose "exit" says 2)
  3    generate --plan: the ranged run moved cache state across a shard
       connection (only with --allow-cache-crossing; the output is printed
       first and metrics.wire_violations names each crossing)
  4    shard serve: upstream could not serve the endpoint (port taken)
  130  interrupted (Ctrl-C); a shard stopped by signal N exits 128 + N
"""


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """One formatter for every parser: each option's default is shown (unless it is None,
    a flag's False, or the help already says it), and text with its own line breaks (the
    examples) is kept as written while plain paragraphs are wrapped."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        d = action.default
        if ("%(default)" in text or not action.option_strings or d is None
                or d is argparse.SUPPRESS or isinstance(d, bool)):
            return text
        shown = ",".join(map(str, d)) if isinstance(d, tuple | list) else str(d)
        return f"{text} (default: {shown.replace('%', '%%')})"

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        if "\n" in text:
            return "".join(indent + line for line in text.splitlines(keepends=True))
        return super()._fill_text(text, width, indent)


class UsageError(Exception):
    """argparse refused the command line; main() prints it (as JSON under --json)."""

    def __init__(self, parser: argparse.ArgumentParser, message: str) -> None:
        super().__init__(message)
        self.parser, self.message = parser, message


class Parser(argparse.ArgumentParser):
    """ArgumentParser whose sub-parsers share HelpFormatter and whose usage errors reach
    main() as UsageError instead of exiting, so that --json can answer them in JSON."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str):  # type: ignore[override]
        raise UsageError(self, message)

    def parse_known_args(self, args=None, namespace=None):  # type: ignore[override]
        """A verb (a parser without sub-commands) refuses an unknown option itself, so that
        the message names the verb and the nearest valid option, instead of the top-level
        parser's bare "unrecognized arguments"."""
        if self._subparsers is not None:
            return super().parse_known_args(args, namespace)
        args = sys.argv[1:] if args is None else list(args)
        self._refuse_llama_spellings(args)
        try:
            ns, extras = super().parse_known_args(args, namespace)
        except UsageError:  # e.g. a required option missing because it was misspelt
            self._refuse_unknown(self._extras_without_required(args))
            raise
        self._refuse_unknown(extras)
        return ns, extras

    def _refuse_llama_spellings(self, args: list[str]) -> None:
        """A llama.cpp spelling this verb does not take is refused by name, before argparse
        could split it into a short option and a value (``-ngl 99`` as ``-n gl``, ``-ctk``
        as ``-c tk``); a multi-letter one with its value attached (``-np4``) too."""
        for arg in args:
            if arg == "--":
                return
            if not arg.startswith("-") or self._negative_number_matcher.match(arg):
                continue
            flag = arg.split("=", 1)[0]
            if flag in self._option_string_actions:
                continue
            msg = llama_spelling_message(self.prog, flag)
            if msg is None and not arg.startswith("--"):
                head = flag.rstrip("0123456789")
                if head != flag and len(head) > 2 and (
                        head in self._option_string_actions
                        or llama_spelling_message(self.prog, head)):
                    msg = (f"{flag}: llama.cpp's {head} takes its value as the next "
                           f"argument: write {head} {flag[len(head):]}")
            if msg is not None:
                self.error(msg)

    def _refuse_unknown(self, extras: list[str]) -> None:
        for arg in extras:
            if arg.startswith("-") and not self._negative_number_matcher.match(arg):
                self.error(unknown_option_message(self, arg))

    def _extras_without_required(self, args: list[str]) -> list[str]:
        """What this parser would leave unparsed if no option were required."""
        saved = [(act, act.required) for act in self._actions]
        try:
            for act, _ in saved:
                act.required = False
            return super().parse_known_args(args, argparse.Namespace())[1]
        except UsageError:
            return []
        finally:
            for act, req in saved:
                act.required = req


def unknown_option_message(parser: argparse.ArgumentParser, arg: str) -> str:
    """``unknown option --temperature; did you mean --temp?`` (difflib's nearest of the
    verb's own option strings, when one is near enough)."""
    import difflib

    flag = arg.split("=", 1)[0]
    known = [o for act in parser._actions for o in act.option_strings
             if act.help != argparse.SUPPRESS]
    near = difflib.get_close_matches(flag, known, n=1, cutoff=0.6)
    hint = f"; did you mean {near[0]}?" if near else f"; see {parser.prog} --help"
    return f"unknown option {flag}{hint}"


def version() -> str:
    """mtplib's version (this checkout's pyproject.toml, else the installed metadata) and
    the pinned upstream it is built against (two lines: kept as written by the formatter)."""
    v = "unknown"
    try:
        import tomllib

        v = tomllib.loads((paths.REPO / "pyproject.toml").read_text())["project"]["version"]
    except (OSError, KeyError, ValueError):
        from importlib import metadata

        with contextlib.suppress(metadata.PackageNotFoundError):
            v = metadata.version("mtplib")
    return (f"mtplib {v}\npinned: llama-cpp-python {pins.LLAMA_CPP_PYTHON_VERSION}, "
            f"llama.cpp {pins.LLAMA_CPP_COMMIT}, CMAKE_ARGS {pins.CMAKE_ARGS}")


def build_parser() -> argparse.ArgumentParser:
    p = Parser(
        prog="mtplib", description="DeepSeek-V4 multi-token prediction (MTP) on upstream "
        "llama.cpp: tiny V4 fixtures, the ownership contract, the MTP runtime, and "
        "papermill evidence runs. Every command takes --json: one JSON object on stdout, "
        "errors included.", epilog=EPILOG + "\n" + EXIT_CODES)
    p.add_argument("--version", action="version", version=version(),
                   help="print mtplib's version and the pinned llama-cpp-python/llama.cpp")
    sub = p.add_subparsers(dest="cmd", required=True, metavar="COMMAND")
    for name in COMMANDS:
        importlib.import_module(f"mtplib.commands.{name.replace('-', '_')}").register(sub)
    _add_exit_codes(p)
    return p


def _add_exit_codes(p: argparse.ArgumentParser) -> None:
    """Every sub-command's --help ends with the exit codes (after its own epilog)."""
    for action in p._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child in action.choices.values():
                child.epilog = (child.epilog + "\n\n" if child.epilog else "") + EXIT_CODES
                _add_exit_codes(child)


def _command(argv: list[str]) -> str | None:
    """The sub-command named in argv (for errors raised before parsing finished)."""
    return next((a for a in argv if a in COMMANDS), None)


def _kind(e: BaseException) -> str:
    if isinstance(e, CheckFailed):
        return "check-failed"
    if isinstance(e, InputError):
        return "input"
    if isinstance(e, UpstreamFault):
        return "upstream"
    if isinstance(e, OSError):
        return "file"
    return "error"


def _fail(cmd: str | None, as_json: bool, code: int, kind: str, etype: str, msg: str,
          prefix: str = "error") -> int:
    """Report a failure once: one line on stderr, or one JSON object on stdout."""
    if as_json:
        print(json.dumps({"error": msg, "kind": kind, "type": etype, "command": cmd,
                          "exit": code}), flush=True)
    else:
        print(f"mtplib {cmd}: {prefix}: {msg}" if cmd else f"mtplib: {prefix}: {msg}",
              file=sys.stderr)
    return code


#: the attribute `_Output` sets on an OSError of the output (stdout), whichever layer
#: raised it: a print (unbuffered stdout) or the flush at the end of `main`
_OUTPUT_MARK = "mtplib_output_error"


class _Output:
    """``sys.stdout`` while a command runs: the same stream, whose failed write or flush is
    marked (`_OUTPUT_MARK`), so that `main` tells the output's failure ("cannot write the
    output", one line, exit 2) from a file a command writes, and never tries to print an
    error (--json's) to the stream that just failed."""

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream

    def write(self, s: str) -> int:
        try:
            return self._stream.write(s)
        except OSError as e:
            setattr(e, _OUTPUT_MARK, True)
            raise

    def writelines(self, lines: Iterable[str]) -> None:
        for line in lines:
            self.write(line)

    def flush(self) -> None:
        try:
            self._stream.flush()
        except OSError as e:
            setattr(e, _OUTPUT_MARK, True)
            raise

    def __getattr__(self, name: str) -> object:  # fileno, isatty, encoding, buffer, ...
        return getattr(self._stream, name)


def _output_error(e: BaseException) -> OSError | None:
    """The output's OSError behind ``e`` (itself, or what it was raised while handling:
    an error whose JSON could not be printed), None when the output did not fail."""
    seen: BaseException | None = e
    while seen is not None:
        if isinstance(seen, OSError) and getattr(seen, _OUTPUT_MARK, False):
            return seen
        seen = seen.__context__
    return None


def _drop_output() -> None:
    """Send what is left of stdout to devnull: Python's flush of stdout at exit would
    otherwise fail again ("Exception ignored ... No space left on device")."""
    with contextlib.suppress(OSError):
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - flushed at exit, not read


def main(argv: list[str] | None = None) -> int:
    """Run one command with its output guarded: the output is flushed here, not at exit,
    and a failure to write it is one line on stderr, exit 2 (a reader that left a pipe:
    exit 0, quietly), never a traceback."""
    argv = sys.argv[1:] if argv is None else list(argv)
    stream = sys.stdout
    if stream is not None:
        sys.stdout = _Output(stream)  # type: ignore[assignment]
    try:
        try:
            code = _main(argv)
        except SystemExit:  # --help, --version: argparse printed, then exits
            sys.stdout.flush()
            raise
        sys.stdout.flush()
        return code
    except OSError as e:
        out = _output_error(e)
        if out is None:
            raise
        _drop_output()
        if isinstance(out, BrokenPipeError):  # `mtplib ... | head`: the reader left
            return 0
        return _fail(_command(argv), False, 2, "output", type(out).__name__,
                     f"cannot write the output: {out.strerror or out}")
    finally:
        if isinstance(sys.stdout, _Output):
            sys.stdout = stream


def _main(argv: list[str]) -> int:
    as_json = "--json" in argv
    try:
        args = build_parser().parse_args(argv)
    except UsageError as e:
        if as_json:
            return _fail(_command(argv), True, 2, "usage", "UsageError", e.message)
        e.parser.print_usage(sys.stderr)
        print(f"{e.parser.prog}: error: {e.message}", file=sys.stderr)
        return 2
    as_json = bool(getattr(args, "json", False))
    cmd = args.cmd
    logs.configure()  # mtplib's log lines on stderr, from $MTPLIB_LOG_LEVEL (INFO) up
    try:
        return int(args.fn(args) or 0)
    except CheckFailed as e:  # a check ran and found a fault
        return _fail(cmd, as_json, 1, _kind(e), type(e).__name__, str(e), "check failed")
    except MtplibError as e:  # bad input, or upstream/a shard/a tool refused: one line
        return _fail(cmd, as_json, 2, _kind(e), type(e).__name__, str(e))
    except OSError as e:
        if _output_error(e) is not None:  # main() says it: stdout cannot carry an error
            raise
        return _file_error(cmd, as_json, e)
    except KeyboardInterrupt:
        if as_json:
            return _fail(cmd, True, 130, "interrupted", "KeyboardInterrupt", "interrupted")
        print(f"mtplib {cmd}: interrupted", file=sys.stderr)
        return 130


def _file_error(cmd: str | None, as_json: bool, e: OSError) -> int:
    """A file a command read or wrote failed (not its output): one line naming it (a
    path the user gave, or the machine's refusal: a full or read-only disk, a quota; an
    error without a filename names its file itself, `mtplib.files.write_error`)."""
    if isinstance(e, BrokenPipeError):  # a reader that left: not an error of ours
        _drop_output()
        return 0
    where = f": {e.filename}" if e.filename else ""
    return _fail(cmd, as_json, 2, "file", type(e).__name__, f"{e.strerror or e}{where}")


if __name__ == "__main__":
    sys.exit(main())
