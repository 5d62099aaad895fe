"""Structured output requests -> one `GrammarSpec` (GBNF text and its root rule).

Why one spec: a GBNF grammar, a JSON schema, and the OpenAI / llama-server request forms
(``response_format`` json_object or json_schema, llama-server's top-level ``json_schema``
and ``grammar``) all end as one upstream grammar sampler (`mtplib.runtime.grammar`). The
spec is plain text, so a `Sampler` carrying it pickles to a ranged worker, which builds the
sampler there from its own vocabulary. A schema is converted by llama-cpp-python's port of
upstream's ``json-schema-to-grammar`` (`llama_cpp.llama_grammar.json_schema_to_gbnf`); the
GBNF itself is parsed by upstream only (`mtplib.runtime.grammar.check_grammar`).

The port lags upstream's C++ converter at the pin in two ways that matter for a response
that must validate; both are handled here, not left to the client. Its string ``char``
admits raw control characters (no JSON parser takes a raw newline in a string); upstream's
excludes 0x00-0x1F and 0x7F, and so does the rule put in its place here. It leaves numeric
bounds unenforced (a TODO in the port; upstream bounds integers), so a schema with
``minimum``, ``maximum``, ``exclusiveMinimum``, ``exclusiveMaximum`` or ``multipleOf`` is
refused naming the keyword (as OpenAI's strict mode refuses keywords it cannot enforce).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from mtplib.errors import InputError

ROOT = "root"
#: a longer grammar is refused: upstream's parser and its stack walk recurse once per
#: nesting level or chained rule, and a deep enough grammar overflows the C stack (a
#: crash, not an error; measured at the pin: ~15k nested groups or ~50k chained rules)
MAX_GBNF_CHARS = 128 * 1024
#: nested groups a grammar may open (counted outside literals, classes and comments)
MAX_GBNF_DEPTH = 512
#: schema keywords the converter would leave unenforced: refused (see the module doc)
UNENFORCED = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf")
#: upstream's string character at the pin (common/json-schema-to-grammar.cpp): no control
#: characters
UPSTREAM_CHAR = r'[^"\\\x7F\x00-\x1F]'


@dataclass(frozen=True)
class GrammarSpec:
    """A grammar to constrain the target's sampling with: GBNF text and its root rule;
    ``source`` names where it came from (``grammar`` or ``json_schema``) for messages."""

    gbnf: str
    root: str = ROOT
    source: str = "grammar"

    def __post_init__(self) -> None:
        if not isinstance(self.gbnf, str) or not self.gbnf.strip():
            raise InputError(f"{self.source}: the grammar is empty")
        if not isinstance(self.root, str) or not self.root:
            raise InputError(f"{self.source}: the root rule name must be a non-empty string")
        for name, text in (("grammar", self.gbnf), ("root rule", self.root)):
            if "\0" in text:
                raise InputError(f"{self.source}: the {name} contains a NUL character")
            try:
                text.encode("utf-8")
            except UnicodeEncodeError as e:
                raise InputError(f"{self.source}: the {name} is not valid UTF-8 text "
                                 f"(character {e.start})") from None
        if len(self.gbnf) > MAX_GBNF_CHARS:
            raise InputError(f"{self.source}: the grammar has {len(self.gbnf)} characters, "
                             f"more than the {MAX_GBNF_CHARS} accepted")
        depth = gbnf_depth(self.gbnf)
        if depth > MAX_GBNF_DEPTH:
            raise InputError(f"{self.source}: the grammar nests {depth} groups deep, more "
                             f"than the {MAX_GBNF_DEPTH} accepted")


def gbnf_depth(text: str) -> int:
    """The deepest nesting of ( ) groups in GBNF ``text``, skipping "..." literals, [...]
    classes (with their backslash escapes) and # comments. Not a parser (upstream's
    parses): a bound checked before upstream's recursive parser sees the text."""
    depth = deepest = 0
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if c in "\"[":
            close = '"' if c == '"' else "]"
            i += 1
            while i < n and text[i] != close:
                i += 2 if text[i] == "\\" else 1
        elif c == "#":
            while i < n and text[i] not in "\r\n":
                i += 1
        elif c == "(":
            depth += 1
            deepest = max(deepest, depth)
        elif c == ")":
            depth = max(0, depth - 1)
        i += 1
    return deepest


def grammar_spec(gbnf: str, *, root: str = ROOT, what: str = "grammar") -> GrammarSpec:
    """A GBNF grammar as given (upstream parses it when it is checked or used); ``what``
    names it in messages."""
    if not isinstance(gbnf, str):
        raise InputError(f"{what} must be a GBNF string, got {type(gbnf).__name__}")
    return GrammarSpec(gbnf, root, what)


def schema_spec(schema: object, *, what: str = "json_schema") -> GrammarSpec:
    """A JSON schema (a dict, or its JSON text) as the GBNF grammar of its language,
    converted by llama-cpp-python's port of upstream's json-schema-to-grammar. An empty
    schema means any JSON object (llama-server's rule)."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as e:
            raise InputError(f"{what}: not valid JSON ({e})") from None
    if not isinstance(schema, Mapping):
        raise InputError(f"{what} must be a JSON object (a schema), got "
                         f"{type(schema).__name__}")
    if not schema:
        schema = {"type": "object"}
    where = unenforced_keyword(schema)
    if where is not None:
        raise InputError(f"{what}: {where} is not supported (the schema converter would "
                         "not enforce it); remove it")
    try:
        text = json.dumps(schema, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise InputError(f"{what}: not a JSON value ({e})") from None
    from mtplib.runtime.lib import load

    load()  # the pinned llama_cpp (its grammar module imports the library)
    from llama_cpp.llama_grammar import PRIMITIVE_RULES, json_schema_to_gbnf

    try:
        gbnf = json_schema_to_gbnf(text)
    except RecursionError:
        raise InputError(f"{what}: the schema nests too deep to convert") from None
    except Exception as e:  # noqa: BLE001 - the converter asserts and raises freely
        reason = str(e) or type(e).__name__
        raise InputError(f"{what}: unsupported or invalid schema ({reason})") from None
    port = f"char ::= {PRIMITIVE_RULES['char'].content}"
    ours = port.replace(r'[^"\\]', UPSTREAM_CHAR, 1)
    gbnf = "\n".join(ours if line == port else line for line in gbnf.split("\n"))
    return GrammarSpec(gbnf, ROOT, what)


def unenforced_keyword(schema: object, path: str = "$") -> str | None:
    """Where ``schema`` uses a keyword of `UNENFORCED` (a JSON path), or None; walks the
    subschemas (properties, items, prefixItems, additionalProperties, anyOf, oneOf, allOf,
    not, $defs, definitions), never a property's name."""
    if isinstance(schema, list):
        for i, sub in enumerate(schema):
            found = unenforced_keyword(sub, f"{path}[{i}]")
            if found:
                return found
        return None
    if not isinstance(schema, Mapping):
        return None
    for kw in UNENFORCED:
        if kw in schema:
            return f"{path}.{kw}"
    for key in ("items", "prefixItems", "additionalProperties", "anyOf", "oneOf", "allOf",
                "not"):
        found = unenforced_keyword(schema.get(key), f"{path}.{key}")
        if found:
            return found
    for key in ("properties", "$defs", "definitions"):
        subs = schema.get(key)
        if isinstance(subs, Mapping):
            for name, sub in subs.items():
                found = unenforced_keyword(sub, f"{path}.{key}.{name}")
                if found:
                    return found
    return None


def read_text(path: str | Path, what: str) -> str:
    """A grammar or schema file's text (UTF-8), or one line naming what is wrong."""
    try:
        return Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise InputError(f"{what} {path}: not UTF-8 text (byte {e.start})") from None
    except OSError as e:
        raise InputError(f"{what} {path}: cannot read it ({e.strerror or e})") from None


def constraint_from_request(*, grammar: object = None, json_schema: object = None,
                            response_format: object = None) -> GrammarSpec | None:
    """The constraint of a request's fields, or None (unconstrained), as llama-server reads
    them: ``grammar`` (GBNF text; "" is none), llama-server's top-level ``json_schema``,
    ``response_format`` {"type": "text"}, {"type": "json_object"} (llama-server: with an
    optional "schema"; none: any JSON object) or {"type": "json_schema", "json_schema":
    {"name", "schema", "strict"}} (OpenAI's; no schema: any JSON object). A grammar and a
    schema together are refused (llama-server's "Cannot use both json_schema and
    grammar"). The schema is converted here; the GBNF is parsed by upstream when checked
    (`mtplib.runtime.grammar.check_grammar`)."""
    if grammar is not None and not isinstance(grammar, str):
        raise InputError(f"grammar must be a GBNF string, got {type(grammar).__name__}")
    schema, where = json_schema, "json_schema"
    if response_format is not None:
        schema, where = _response_format(response_format, schema, where)
    if grammar and schema is not None:
        raise InputError(f"give one of grammar and {where}, not both (a grammar and a "
                         "JSON schema cannot constrain one response together)")
    if grammar:
        return grammar_spec(grammar)
    if schema is None:
        return None
    return schema_spec(schema, what=where)


def _response_format(rf: object, schema: object, where: str) -> tuple[object, str]:
    """(schema, its name for messages) after ``response_format``; the top-level
    ``json_schema`` stands unless the format brings its own."""
    if not isinstance(rf, Mapping):
        raise InputError(f"response_format must be an object, got {type(rf).__name__}")
    kind = rf.get("type", "text")
    if kind in ("text", ""):  # llama-server: an empty type is text
        return schema, where
    if kind == "json_object":
        if "schema" in rf or not schema:
            return rf.get("schema") or {}, "response_format.schema"
        return schema, where
    if kind == "json_schema":
        wrapper = rf.get("json_schema", {})
        if not isinstance(wrapper, Mapping):
            raise InputError(f"response_format.json_schema must be an object, got "
                             f"{type(wrapper).__name__}")
        strict = wrapper.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise InputError(f"response_format.json_schema.strict must be true or false, "
                             f"got {strict!r}")
        name = wrapper.get("name")
        if name is not None and not isinstance(name, str):
            raise InputError(f"response_format.json_schema.name must be a string, got "
                             f"{type(name).__name__}")
        got = wrapper.get("schema")
        return ({} if got is None else got), "response_format.json_schema.schema"
    shown = kind if isinstance(kind, str) else repr(kind)
    raise InputError(f"response_format type must be text, json_object or json_schema, got "
                     f"{shown}")
