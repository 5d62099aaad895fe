"""llama-server's launch line on the `mtplib serve` parser (`llama_server_flags.FLAGS`).

`add_llama_server_args` gives the parser llama-server's spellings of serve's own options
and its chat template options, then registers every other llama-server option the parser
lacks: a NOOP one is accepted and logged once at start (`apply_server_flags`), a REFUSED
one stops the parse with one line naming mtplib's equivalent. An option the parser
already has is left alone, so options added to serve elsewhere count as working
(`classify`). `render_table` writes the docs/cli.md table from the same parser.
"""

from __future__ import annotations

import argparse
import logging
import re
from pathlib import Path

from mtplib.commands.chat_templates import add_chat_args, resolve_chat
from mtplib.commands.llama_server_flags import (
    FLAGS,
    NOOP,
    REFUSED,
    SERVE_ALIASES,
    WORKS,
    ServerFlag,
)

log = logging.getLogger("mtplib.serve")

#: where the parse keeps the no-op flags given: {spelling: (value, why)}
NOOP_DEST = "llama_noop"


class NoopFlag(argparse.Action):
    """A llama-server option that changes nothing here: kept for one logged line."""

    def __init__(self, option_strings, dest, why: str = "", **kw) -> None:
        super().__init__(option_strings, dest, **kw)
        self.why = why

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        seen = dict(getattr(namespace, self.dest, None) or {})
        seen[option_string] = (values, self.why)
        setattr(namespace, self.dest, seen)


class RefusedFlag(argparse.Action):
    """A llama-server option mtplib does not take: the parse stops naming the equivalent."""

    def __init__(self, option_strings, dest, why: str = "", **kw) -> None:
        super().__init__(option_strings, dest, **kw)
        self.why = why

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        parser.error(f"{option_string} is refused: {self.why}")


class BothTimeouts(argparse.Action):
    """llama-server's -to/--timeout N: mtplib's --header-timeout and --body-timeout."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        namespace.header_timeout = namespace.body_timeout = values


class ApiKeyFile(argparse.Action):
    """llama-server's --api-key-file: one key (lines starting with # are comments), read
    at the parse, as --api-key KEY."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        try:
            text = Path(values).read_text(encoding="utf-8")
        except UnicodeDecodeError:
            parser.error(f"{option_string} {values}: not UTF-8 text")
        except OSError as e:
            parser.error(f"cannot read {option_string} {values}: {e.strerror or e}")
        keys = [x.strip() for x in text.splitlines()
                if x.strip() and not x.strip().startswith("#")]
        if len(keys) != 1:
            parser.error(f"{option_string} {values} holds {len(keys)} keys: mtplib serve "
                         "takes exactly one (one line; # lines are comments)")
        namespace.api_key = keys[0]


def _nargs(flag: ServerFlag, refused: bool) -> int | str | None:
    if flag.value is None:
        return 0
    n = len(flag.value.split())
    if refused:  # the refusal, not argparse's "expected one argument", when it is missing
        return "?" if n == 1 else "*"
    return None if n == 1 else n


def _add_aliases(s: argparse.ArgumentParser) -> None:
    """SERVE_ALIASES: each spelling stores into its serve option's destination."""
    for spelling, target in SERVE_ALIASES.items():
        t = s._option_string_actions.get(target)
        if t is None or spelling in s._option_string_actions:
            continue
        kw = {} if t.nargs == 0 else {"type": t.type, "choices": t.choices,
                                      "metavar": t.metavar, "nargs": t.nargs}
        s.add_argument(spelling, action=type(t), dest=t.dest, default=argparse.SUPPRESS,
                       help=argparse.SUPPRESS, **kw)


def add_llama_server_args(s: argparse.ArgumentParser) -> None:
    """Register llama-server's launch line on serve's parser ``s`` (after its own
    options: an option it has is kept as it is)."""
    add_chat_args(s)
    s.add_argument("-to", "--timeout", type=float, metavar="S", action=BothTimeouts,
                   default=argparse.SUPPRESS, help="llama-server's: sets --header-timeout "
                   "and --body-timeout to S seconds (a later one of those wins)")
    s.add_argument("--api-key-file", metavar="FILE", action=ApiKeyFile,
                   default=argparse.SUPPRESS, help="llama-server's: the key in FILE, as "
                   "--api-key (one key; lines starting with # are comments)")
    s.add_argument("--usage", action="help", help=argparse.SUPPRESS)
    _add_aliases(s)
    for flag in FLAGS:
        missing = [x for x in flag.spellings if x not in s._option_string_actions]
        if not missing or flag.kind == WORKS:
            continue
        refused = flag.kind == REFUSED
        s.add_argument(*missing, action=RefusedFlag if refused else NoopFlag,
                       dest=NOOP_DEST, nargs=_nargs(flag, refused), why=flag.why,
                       default=argparse.SUPPRESS, help=argparse.SUPPRESS)


def note_noop_flags(a: argparse.Namespace) -> None:
    """One logged line per no-op flag given, saying why it changes nothing."""
    for spelling, (value, why) in (getattr(a, NOOP_DEST, None) or {}).items():
        shown = " ".join([spelling, *([value] if isinstance(value, str) else value or [])])
        log.warning("mtplib serve: note: %s changes nothing: %s", shown, why)


def apply_server_flags(a: argparse.Namespace) -> None:
    """After the engine's arguments are checked, before the model loads: the chat template
    the arguments ask for (``a.chat``, checked now), then one line per no-op flag."""
    template = a.request.trunk_header.kv.get("tokenizer.chat_template")
    a.chat = resolve_chat(a, template if isinstance(template, str) else None)
    note_noop_flags(a)


def classify(s: argparse.ArgumentParser, spelling: str) -> tuple[str, str] | None:
    """(kind, why) of a llama-server spelling on serve's parser ``s``: WORKS for an
    option of its own, NOOP or REFUSED for one registered here; None: unknown to it."""
    act = s._option_string_actions.get(spelling)
    if act is None:
        return None
    if isinstance(act, NoopFlag | RefusedFlag):
        return (NOOP if isinstance(act, NoopFlag) else REFUSED), act.why
    entry = next((f for f in FLAGS if spelling in f.spellings), None)
    if entry is not None and entry.kind == WORKS:
        return WORKS, entry.why
    return WORKS, act.option_strings[0]


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def render_table(s: argparse.ArgumentParser) -> str:
    """docs/cli.md's table: every llama-server option, what serve's parser ``s`` does with
    it and why (rows of one option split where its spellings differ)."""
    out = ["| llama-server | mtplib serve | what mtplib does, or its equivalent |",
           "|---|---|---|"]
    for flag in FLAGS:
        groups: dict[tuple[str, str], list[str]] = {}
        for spelling in flag.spellings:
            kind, why = classify(s, spelling) or ("unknown", "not registered")
            groups.setdefault((kind, why), []).append(spelling)
        for (kind, why), spellings in groups.items():
            names = ", ".join(f"`{x}`" for x in spellings)
            value = f" `{flag.value}`" if flag.value else ""
            out.append(f"| {_cell(names + value)} | {kind} | {_cell(why)} |")
    return "\n".join(out) + "\n"


#: the markers around the generated table in docs/cli.md
TABLE_BEGIN = ("<!-- llama-server flags: generated by "
               "mtplib.commands.llama_server_args.render_table; do not edit -->")
TABLE_END = "<!-- end of llama-server flags -->"


def table_in(doc: str) -> str | None:
    """The generated table between the markers of ``doc`` (None: no markers)."""
    m = re.search(re.escape(TABLE_BEGIN) + r"\n(.*?)" + re.escape(TABLE_END), doc, re.S)
    return m.group(1) if m else None


def write_table(s: argparse.ArgumentParser, doc: Path) -> None:
    """Replace the table in ``doc`` by `render_table`'s (after a parser change)."""
    text = doc.read_text()
    if table_in(text) is None:
        raise ValueError(f"{doc} has no {TABLE_BEGIN} ... {TABLE_END} markers")
    start = text.index(TABLE_BEGIN) + len(TABLE_BEGIN) + 1
    doc.write_text(text[:start] + render_table(s) + text[text.index(TABLE_END, start):])
