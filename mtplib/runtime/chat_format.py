"""Upstream's built-in chat formats (src/llama-chat.cpp), as llama-server's
``--chat-template NAME`` and ``--no-jinja`` use them.

llama.cpp formats a conversation for a named template (chatml, llama3, deepseek3, ...) or
for a template text it recognises with hand-written C++ (`llama_chat_apply_template`), not
Jinja. mtplib calls that function rather than rewriting the formats, so a name gives the
bytes upstream gives. It needs no model: the name (or text) picks the format.
"""

from __future__ import annotations

import ctypes
from collections.abc import Mapping, Sequence

from mtplib.errors import InputError
from mtplib.runtime.lib import load


class ChatFormatError(InputError):
    """Upstream has no built-in format for the template, or a message cannot reach C."""


def builtin_templates() -> tuple[str, ...]:
    """The names `llama_chat_builtin_templates` lists (llama-server's --help prints them)."""
    llama, _ = load()
    n = int(llama.llama_chat_builtin_templates(None, 0))
    out = (ctypes.c_char_p * max(n, 1))()
    n = int(llama.llama_chat_builtin_templates(out, n))
    return tuple(out[i].decode() for i in range(n))


def _c_text(text: str, what: str) -> bytes:
    """UTF-8 for a C string; a NUL would cut the text short in C, so it is refused."""
    if "\x00" in text:
        raise ChatFormatError(f"{what} contains a NUL character, which upstream's built-in "
                              "chat formats cannot carry")
    return text.encode("utf-8")


def apply_template(template: str, messages: Sequence[Mapping[str, str]], *,
                   add_assistant: bool = True) -> str:
    """The prompt text upstream's built-in format ``template`` (a name, or a template text
    it recognises) makes of ``messages`` ({"role", "content"}), the assistant's turn opened
    when ``add_assistant``. Raises `ChatFormatError` where upstream has no such format."""
    llama, _ = load()
    tmpl = _c_text(template, "the chat template")
    keep = [(_c_text(str(m["role"]), f"message {i} role"),
             _c_text(str(m["content"]), f"message {i} content"))
            for i, m in enumerate(messages)]
    chat = (llama.llama_chat_message * max(len(keep), 1))()
    for i, (role, content) in enumerate(keep):
        chat[i].role, chat[i].content = role, content
    n = int(llama.llama_chat_apply_template(tmpl, chat, len(keep), add_assistant, None, 0))
    if n < 0:
        raise ChatFormatError("upstream has no built-in chat format for this template "
                              f"({template[:40]!r}{'...' if len(template) > 40 else ''})")
    buf = ctypes.create_string_buffer(n + 1)
    n = int(llama.llama_chat_apply_template(tmpl, chat, len(keep), add_assistant, buf, n + 1))
    return buf.raw[:n].decode("utf-8", errors="replace")


def recognised(template: str) -> bool:
    """Does upstream have a built-in format for ``template`` (a name or a text)?"""
    try:
        apply_template(template, [{"role": "user", "content": "test"}])
    except ChatFormatError:
        return False
    return True
