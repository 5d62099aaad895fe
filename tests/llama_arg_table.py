"""The pinned llama.cpp's option table, read from the sdist's common/arg.cpp (as
tests/test_cli_aliases.py reads it): which options an example gets, and whether each takes
a value. None where the sdist is not here (the tests that need it skip)."""

from __future__ import annotations

import re
import tarfile

ARG_CPP = "vendor/llama.cpp/common/arg.cpp"
LLAMA_CHAT_CPP = "vendor/llama.cpp/src/llama-chat.cpp"

#: a C string or char literal (kept whole), or a // comment (dropped)
_TOKENS = re.compile(r'"(?:\\.|[^"\\])*"|\'(?:\\.|[^\'\\])\'|//[^\n]*')


def vendor_file(rel: str) -> str | None:
    """``rel`` of the pinned sdist (a path under llama_cpp_python-VERSION/), or None."""
    from mtplib.lab.upstream_tools import sdist_candidates

    sdist = next((p for p in sdist_candidates() if p.is_file()), None)
    if sdist is None:
        return None
    with tarfile.open(sdist) as t:
        member = next(m for m in t.getmembers() if m.name.endswith(rel))
        return t.extractfile(member).read().decode()


def _without_comments(src: str) -> str:
    return _TOKENS.sub(lambda m: "" if m.group(0).startswith("//") else m.group(0), src)


def _calls(body: str, opener: str) -> list[str]:
    """The text of each ``opener(...)`` call in ``body``, up to its closing parenthesis
    (strings and char literals skipped)."""
    out = []
    for start in [m.end() for m in re.finditer(re.escape(opener), body)]:
        depth, i = opener.count("("), start
        while depth:
            m = _TOKENS.match(body, i)
            if m:
                i = m.end()
                continue
            depth += {"(": 1, ")": -1}.get(body[i], 0)
            i += 1
        out.append(body[start:i])
    return out


def options(src: str, example: str) -> dict[str, bool]:
    """{spelling: takes a value} of every option ``LLAMA_EXAMPLE_<example>`` gets: arg.cpp's
    add_opt keeps an option whose examples include the example or COMMON and whose
    excludes do not name it; preset-only options are no command-line options."""
    start = src.index("common_params_context common_params_parser_init")
    body = _without_comments(src[start:])
    out: dict[str, bool] = {}
    for call in _calls(body, "add_opt(common_arg("):
        lists = re.match(r'\s*\{([^}]*)\}\s*,\s*(?:\{([^}]*)\}\s*,)?', call)
        spellings = re.findall(r'"(-[^"]+)"', lists.group(1) + (lists.group(2) or ""))
        ex = re.search(r"\.set_examples\(\{([^}]*)\}\)", call)
        exc = re.search(r"\.set_excludes\(\{([^}]*)\}\)", call)
        examples = set(re.findall(r"LLAMA_EXAMPLE_(\w+)", ex.group(1))) if ex else {"COMMON"}
        excludes = set(re.findall(r"LLAMA_EXAMPLE_(\w+)", exc.group(1))) if exc else set()
        if (not examples & {example, "COMMON"} or example in excludes
                or ".set_preset_only()" in call):
            continue
        handler = re.search(r"\[\]\s*\(\s*common_params\s*&[^,)]*(,[^)]*)?\)", call)
        params = handler.group(1) or "" if handler else ""
        takes_value = bool(params) and "bool" not in params
        for s in spellings:
            out[s] = takes_value
    return out


def builtin_chat_templates(src: str) -> set[str]:
    """The names in src/llama-chat.cpp's LLM_CHAT_TEMPLATES map."""
    table = src[src.index("LLM_CHAT_TEMPLATES = {"):]
    table = table[:table.index("};")]
    return set(re.findall(r'\{\s*"([^"]+)"\s*,\s*LLM_CHAT_TEMPLATE_', table))
