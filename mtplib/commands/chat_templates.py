"""Which chat template `mtplib serve` renders a conversation with: the model's own
(tokenizer.chat_template, Jinja; ChatML without one), or llama-server's choices
``--chat-template NAME|JINJA``, ``--chat-template-file FILE`` and ``--no-jinja``.

A name upstream knows (chatml, llama3, deepseek3, ...) is rendered by upstream's own C++
format (`mtplib.runtime.chat_format`), not by a Jinja copy of it; any other text is a
Jinja template, as llama-server (which takes Jinja by default) reads it; ``--no-jinja``
keeps upstream's built-in formats only, for the model's template too. Every choice is
checked before the model loads: a template that cannot render one user message is refused
in one line, not on the first request.
"""

from __future__ import annotations

import argparse
import functools
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from mtplib.errors import InputError


@dataclass(frozen=True)
class ChatSetting:
    """``template``: the Jinja source the service renders (None: ChatML), or, with
    ``format``, the name or text upstream's built-in format was chosen by (what /props
    shows); ``format``: messages -> prompt text, upstream's formatter."""

    template: str | None
    format: Callable[[list[dict]], str] | None = None


def add_chat_args(s: argparse.ArgumentParser) -> None:
    """llama-server's chat template options (read by `resolve_chat`)."""
    s.add_argument("--chat-template", metavar="NAME|JINJA", default=None,
                   help="llama-server's: a built-in name (upstream's own format, e.g. "
                   "chatml, llama3, deepseek3; llama-server --help lists them) or a Jinja "
                   "template text (default: the model's tokenizer.chat_template, else "
                   "ChatML)")
    s.add_argument("--chat-template-file", metavar="FILE", default=None,
                   help="a Jinja chat template file (with --no-jinja: a template upstream's "
                   "built-in formats recognise)")
    s.add_argument("--jinja", action=argparse.BooleanOptionalAction, default=True,
                   help="render chat templates with Jinja, as llama-server by default; "
                   "--no-jinja: upstream's built-in formats only (a name, or a template "
                   "they recognise; the model's own is refused at start if they do not)")


def _read(path: str) -> str:
    try:
        return Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise InputError(f"--chat-template-file {path}: not UTF-8 text") from None
    except OSError as e:
        raise InputError(f"cannot read --chat-template-file {path}: "
                         f"{e.strerror or e}") from None


def check_jinja(source: str, what: str) -> None:
    """Refuse ``source`` in one line unless Jinja (sandboxed, as the service renders)
    compiles it and renders one user message with it."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def refuse(msg: str):
        raise ValueError(f"the template raised: {msg}")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    try:
        env.from_string(source).render(
            messages=[{"role": "user", "content": "test"}], add_generation_prompt=True,
            bos_token="", eos_token="", raise_exception=refuse)
    except Exception as e:  # noqa: BLE001 - any failure of a user's template is bad input
        line = getattr(e, "lineno", None)
        where = f" (line {line})" if line else ""
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise InputError(f"{what} is not a Jinja chat template that renders one user "
                         f"message: {msg}{where}") from None


def resolve_chat(a: argparse.Namespace, model_template: str | None) -> ChatSetting:
    """The template the arguments ask for, given the model's own (None: it has none),
    checked now; one line naming the option when it cannot serve."""
    from mtplib.runtime.chat_format import apply_template, builtin_templates, recognised

    name, path = getattr(a, "chat_template", None), getattr(a, "chat_template_file", None)
    jinja = getattr(a, "jinja", True)
    if name is not None and path is not None:
        raise InputError("--chat-template and --chat-template-file contradict each other: "
                         "give one")
    if path is not None:
        text, what = _read(path), f"--chat-template-file {path}"
    elif name is not None:
        text, what = name, "--chat-template"
    elif jinja or model_template is None:  # the model's (Jinja), or ChatML as llama-server
        return ChatSetting(model_template)
    else:
        text, what = model_template, "the model's tokenizer.chat_template"
    if not text.strip():
        raise InputError(f"{what} is empty: give a template (or leave it out for the "
                         "model's own)")
    names = builtin_templates()
    if text in names or not jinja:
        if not recognised(text):
            raise InputError(f"{what}: upstream's built-in chat formats do not recognise "
                             "it; without --jinja they take a name (" + ", ".join(names)
                             + ") or a template like one of theirs; leave --no-jinja out to "
                             "render it with Jinja")
        return ChatSetting(text, functools.partial(apply_template, text))
    if "{{" not in text and "{%" not in text:  # a misspelt name would render as itself
        raise InputError(f"{what} {text[:40]!r} is neither one of upstream's built-in names "
                         "(" + ", ".join(names) + ") nor a Jinja template (it has no {{ }} "
                         "or {% %})")
    check_jinja(text, what)
    return ChatSetting(text)
