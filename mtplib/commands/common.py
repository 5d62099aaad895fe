"""Arguments several commands share."""

from __future__ import annotations

import argparse
import logging
import re

from mtplib.errors import InputError


def add_log_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--verbose", action="store_true",
                   help="show upstream's log lines, and mtplib's debug lines")
    p.add_argument("--log-file", help="append upstream's log lines to this file")


def setup_logging(a: argparse.Namespace) -> None:
    from mtplib import logs
    from mtplib.runtime.lib import configure_logging

    if a.verbose:
        logs.configure(logging.DEBUG)
    configure_logging(verbose=a.verbose, log_file=a.log_file)


def comma_list(text: str, option: str, example: str) -> list[str]:
    """``text`` split at its commas, each element stripped. An empty element ("1,,2", "1,",
    ",1") is refused, not dropped: the list run would not be the one written. Raises
    `InputError` (one line, exit 2); an argparse ``type`` re-raises it as its
    ArgumentTypeError (argparse would replace a ValueError's message by "invalid value")."""
    parts = [x.strip() for x in text.split(",")]
    if parts == [""]:
        raise InputError(f"{option} is empty: give {example}")
    if "" in parts:
        raise InputError(f"{option} {text!r}: element {parts.index('') + 1} is empty; "
                         f"give {example}")
    return parts


def int_list(text: str, option: str, example: str) -> list[int]:
    """Comma-separated integers (`comma_list`); "1 2" or "x" is refused naming it."""
    parts = comma_list(text, option, example)
    bad = next((x for x in parts if not re.fullmatch(r"[+-]?[0-9]+", x)), None)
    if bad is not None:
        raise InputError(f"{option} {text!r}: {bad!r} is not an integer; give {example}")
    return [int(x) for x in parts]


def parse_tokens(s: str) -> list[int]:
    """--tokens: token ids, e.g. 1,2,3 (generate checks it with its other input: one line,
    exit 2)."""
    return int_list(s, "--tokens", "comma-separated token ids, e.g. 1,2,3")


#: llama.cpp's spellings (llama-cli, llama-server) of mtplib's options, registered next to
#: mtplib's own names on every verb that has the option: {mtplib name: aliases}
LLAMA_ALIASES: dict[str, tuple[str, ...]] = {
    "--model": ("-m",),
    "--mtp": ("-md", "--model-draft"),
    "--draft": ("--draft-max", "--spec-draft-n-max"),
    "--draft-p-min": ("--spec-draft-p-min",),
    "--n": ("-n", "--n-predict"),
    "--ctx": ("-c", "--ctx-size"),
    "--threads": ("-t",),
    "--prompt": ("-p",),
    "--batch": ("-b", "--batch-size"),
    "--ubatch": ("-ub", "--ubatch-size"),
    "--flash-attn": ("-fa",),
    "--endpoints": ("--rpc",),
    "--parallel": ("-np",),
}

#: every llama.cpp option spelt with one dash and more than one letter (common/arg.cpp at
#: the pinned commit; tests/test_cli_aliases.py checks the list against the sdist when it
#: is here): argparse would read ``-ngl 99`` as ``-n gl`` and ``-ctk`` as ``-c tk``, so a
#: verb refuses any of these it does not take by name (`Parser.parse_known_args`)
LLAMA_SHORT_SPELLINGS = frozenset("""
-Cb -Cbd -Cd -Cr -Crb -Crbd -Crd -ag -bf -bs -cb -cl -cmoe -cmoed -cms -cnv -co -cram -ctk
-ctkd -ctv -ctvd -ctxcp -decay-epochs -dev -devd -dr -dt -epochs -fa -fit -fitc -fitp -fitt
-gan -gaw -hf -hfd -hff -hfr -hfrd -hft -if -jf -kvo -kvu -lcd -lcs -lm -lr -lr-min -lv -lzm
-md -mg -mli -mm -mmdev -mmu -mu -ncffn -ncmoe -ncmoed -ngl -ngld -nkvo -no-ag -no-cnv
-no-kvu -nocb -np -npl -npp -nr -ns -ntg -ofreq -opt -ot -otd -pps -ptc -rea -sm -sp -sps
-st -sys -sysf -tb -tbd -td -tgs -to -ts -ub -val-split -wd
""".split())

#: llama.cpp's spellings of what mtplib has under another verb or not at all: the one line
#: a verb without the option answers with (instead of difflib's nearest own option)
LLAMA_ELSEWHERE: dict[str, str] = {
    **dict.fromkeys(("-np", "--parallel"), "llama-server's slots; mtplib serve takes "
                    "-np/--parallel"),
    **dict.fromkeys(("-ngl", "--gpu-layers", "--n-gpu-layers"), "llama.cpp's GPU layer "
                    "count; mtplib generate and serve take it (a note), a shard serves a "
                    "GPU with `mtplib shard serve --device gpu`"),
    **dict.fromkeys(("-ctk", "--cache-type-k", "-ctv", "--cache-type-v"), "llama.cpp's "
                    "K/V cache type; mtplib generate and serve take it (or --kv-type)"),
    **dict.fromkeys(("-tb", "--threads-batch"), "llama.cpp's prompt threads; mtplib "
                    "generate and serve use --threads for both"),
    **dict.fromkeys(("--spec-type",), "llama.cpp's speculative type; mtplib generate and "
                    "serve take --spec-type draft-mtp (MTP with --mtp/-md SIDECAR)"),
    **dict.fromkeys(("--draft-min", "--draft-n-min", "--spec-draft-n-min"), "llama.cpp's "
                    "minimum draft; mtplib generate and serve take it (MTP drafts --draft "
                    "K every step)"),
    **dict.fromkeys(("--rpc",), "llama.cpp's RPC servers; mtplib generate and serve take "
                    "--rpc/--endpoints HOST:PORT,... with --plan"),
    **dict.fromkeys(("-fa", "-b", "-ub", "--batch-size", "--ubatch-size"),
                    "mtplib generate and serve take it"),
}


def llama_spelling_message(prog: str, flag: str) -> str | None:
    """The one line for a llama.cpp spelling ``prog`` does not take (None: not one)."""
    if flag in LLAMA_ELSEWHERE:
        return f"{flag} is not an option of {prog}: {LLAMA_ELSEWHERE[flag]}"
    if flag in LLAMA_SHORT_SPELLINGS:
        return (f"{flag} is llama.cpp's option; {prog} has no equivalent (see {prog} "
                "--help)")
    return None


def add_option(p: argparse.ArgumentParser, name: str, **kwargs) -> argparse.Action:
    """``p.add_argument(name, **kwargs)`` with llama.cpp's aliases of ``name`` (the first
    long name, mtplib's, stays the dest and leads in --help)."""
    kwargs.setdefault("dest", name.lstrip("-").replace("-", "_"))
    return p.add_argument(name, *LLAMA_ALIASES.get(name, ()), **kwargs)


def add_json_arg(p: argparse.ArgumentParser, what: str = "the result") -> None:
    """`--json`, the same on every verb (errors then come as JSON too, see mtplib.cli)."""
    p.add_argument("--json", action="store_true",
                   help=f"print {what} as one JSON object on stdout; errors too")


def resolve_ctx(a: argparse.Namespace, default: int, *models: str | None) -> None:
    """``a.ctx``: None becomes min(default, the models' context_length); an explicit value
    beyond it is refused here, naming --ctx, before any model loads (upstream refuses
    such a context, and the MTP check would otherwise report it as MTP unsupported)."""
    from mtplib.errors import InputError
    from mtplib.runtime.request import context_length, ctx_default

    n_train = context_length(*models)
    if a.ctx is None:
        a.ctx = ctx_default(n_train, default)
    elif n_train is not None and a.ctx > n_train:
        raise InputError(f"--ctx {a.ctx} exceeds the model's context_length {n_train}; "
                         f"give --ctx {n_train} or less (or leave --ctx out)")


def add_tls_args(p: argparse.ArgumentParser, what: str | None = None, *,
                 plaintext: bool = True) -> None:
    """``--tls DIR`` and (``plaintext``) ``--insecure-plaintext``, the same on every verb
    that talks to shards (generate, bench, shard serve, serve); read them with
    `tls_from_args`."""
    p.add_argument("--tls", metavar="DIR", default=None,
                   help=what or "mutual TLS to the shards with DIR's ca.pem, client.pem and "
                   "client.key (see `mtplib tls init`; shards serve with `shard serve --tls`); "
                   "needed for any non-loopback endpoint")
    if not plaintext:
        return
    p.add_argument("--insecure-plaintext", action="store_true",
                   help="allow non-loopback endpoints WITHOUT TLS: upstream's RPC has no "
                   "authentication or encryption (anyone on the path can read or write the "
                   "shard's memory)")


def tls_from_args(a: argparse.Namespace):
    """The `TlsConfig` of ``--tls`` (None without it); refuses it with
    ``--insecure-plaintext``."""
    from mtplib.errors import InputError

    if getattr(a, "tls", None) is None:
        return None
    if getattr(a, "insecure_plaintext", False):
        raise InputError("--tls and --insecure-plaintext contradict each other: give one")
    from mtplib.distributed.tls import TlsConfig

    return TlsConfig.load(a.tls)
