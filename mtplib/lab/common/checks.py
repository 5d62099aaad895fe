"""The rule primitives, one per kind of value: what a field or parameter accepts, said once.

Why here, in the lab: a rule is declared once, next to the field it checks (the tables
`mtplib.lab.wan.config.WAN_RULES`, `mtplib.lab.bench.config.BENCH_RULES`, ...), and both
readers use that one object: the configs check their values with it strictly
(`check_fields`, at construction), and `mtplib.records.parameters` checks a lane's or a
notebook's values with it (leniently for papermill's ``-p`` strings, see `Context`).
The lab cannot import records; records imports this.

A rule (`Rule`) is a checker with the words for what it accepts: (value, key path,
context) -> the value to use, or a `ParameterError` naming the key path, what was
expected and what was given.
"""

from __future__ import annotations

import dataclasses
import re
import types
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from mtplib.errors import InputError

#: a thread count beyond this is a typo on any machine (upstream's thread pool crashed at
#: 100000); the machine's own CPU count is checked where a lane's requirements are
MAX_THREADS = 1024

# -- the stated ranges of a lane's other numbers: beyond them a value is a typo that would
# fail inside a notebook (leaving a failed run) or run for days, so it is refused first
#: the longest context of any DeepSeek-V4 model (V4-Flash's context_length, 2**20): a
#: context size where the lane's model is not known (`context_size`)
MAX_CONTEXT = 1 << 20
#: the context the notebooks' and the CLI's runs get without one given
#: (`mtplib.runtime.request.DEFAULT_CTX`, `DecodeSettings.n_ctx`)
RUN_CONTEXT = 2048
#: tokens one generation makes, and tokens one prompt holds: half of `RUN_CONTEXT` each,
#: so that a prompt and its generation always fit the context they run in
MAX_NEW_TOKENS = RUN_CONTEXT // 2
MAX_PROMPT_TOKENS = RUN_CONTEXT // 2
#: repetitions, warm-ups, seeds to run and prompts to measure: 1000 of any is days of
#: decoding on the lanes' hosts (the committed lanes use at most 100)
MAX_REPEATS = 1000
#: a seed: numpy's and llama.cpp's seeds are 32-bit (`write_fixture` refuses more)
MAX_SEED = 2**32 - 1
#: a token id: llama_token is int32 (the model's vocabulary bounds it where it is known)
MAX_TOKEN_ID = 2**31 - 1
#: sequences of one context: upstream's LLAMA_MAX_SEQ (src/llama-cparams.h)
MAX_SEQ = 256
#: a link's bandwidth, Mbit/s: 100 Gbit/s (null is an unlimited link)
MAX_MBIT = 100_000
#: a sampling temperature: beyond it every logit gap the models have is flattened away
MAX_TEMPERATURE = 100.0


class ParameterError(InputError):
    """A notebook parameter (or a lane's value for one) that cannot be used."""

    def _render_traceback_(self) -> list[str]:
        """What IPython shows in place of a traceback (its hook for this method): the one
        line says it all, so the cell's error, and papermill's, is that line."""
        return [f"{type(self).__name__}: {self}"]


@dataclass(frozen=True)
class Context:
    """How to read values: ``lenient`` for papermill's ``-p`` strings and scalars (see the
    module docstring); where the model is known, ``n_layer`` bounds shard plans,
    ``n_ctx_train`` context sizes and ``n_vocab`` token ids."""

    lenient: bool = False
    n_layer: int | None = None
    n_ctx_train: int | None = None
    n_vocab: int | None = None


#: a checker: (value, key path, context) -> the value to use; raises ParameterError
Check = Callable[[object, str, Context], object]


@dataclass(frozen=True)
class Rule:
    """A checker with the words for what it accepts (nested rules quote them); ``says``:
    other words for a config's error (`check_fields`), where its message is older."""

    expected: str
    check: Check
    says: str = ""

    def __call__(self, v: object, where: str, ctx: Context) -> object:
        return self.check(v, where, ctx)


def fail(where: str, expected: str, got: object, why: str = "") -> ParameterError:
    """The one-line error: key path, what is expected, what was given (and why not: kept
    as ``why`` for `check_fields`)."""
    e = ParameterError(f"{where}: expected {expected}, got {got!r}" + (f" ({why})" if why
                                                                        else ""))
    e.why = why
    return e


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _num(x: float) -> str:
    """A bound as written: an int in full (4294967295, not 4.29497e+09), a float short."""
    return str(x) if _is_int(x) else f"{x:g}"


def _bounds(lo: float | None, hi: float | None) -> str:
    if lo is not None and hi is not None:
        return f" {_num(lo)}..{_num(hi)}"
    if lo is not None:
        return f" >= {_num(lo)}"
    return f" <= {_num(hi)}" if hi is not None else ""


def integer(lo: int | None = None, hi: int | None = None) -> Check:
    want = "an int" + _bounds(lo, hi)

    def check(v: object, where: str, ctx: Context) -> object:
        if not _is_int(v) or (lo is not None and v < lo) or (hi is not None and v > hi):
            raise fail(where, want, v)
        return v
    return Rule(want, check)


def context_size() -> Check:
    """A context size (n_ctx): 1 .. the model's context_length where it is known
    (`Context.n_ctx_train`), else 1 .. `MAX_CONTEXT`."""
    def check(v: object, where: str, ctx: Context) -> object:
        hi, whose = (ctx.n_ctx_train, "the model's context_length") if ctx.n_ctx_train \
            else (MAX_CONTEXT, "the longest context of any V4 model")
        if not _is_int(v) or not 1 <= v <= hi:
            raise fail(where, f"an int 1..{hi} ({whose})", v)
        return v
    return Rule(f"an int 1..{MAX_CONTEXT} (at most the model's context_length)", check)


def token_id() -> Check:
    """A token id: 0 .. the model's vocabulary - 1 where it is known (`Context.n_vocab`),
    else 0 .. `MAX_TOKEN_ID`."""
    def check(v: object, where: str, ctx: Context) -> object:
        hi, whose = (ctx.n_vocab - 1, "the model's vocabulary") if ctx.n_vocab \
            else (MAX_TOKEN_ID, "llama_token is int32")
        if not _is_int(v) or not 0 <= v <= hi:
            raise fail(where, f"a token id 0..{hi} ({whose})", v)
        return v
    return Rule(f"a token id 0..{MAX_TOKEN_ID}", check)


def number(lo: float | None = None, hi: float | None = None) -> Check:
    want = "a number" + _bounds(lo, hi)

    def check(v: object, where: str, ctx: Context) -> object:
        if not (_is_int(v) or isinstance(v, float)) or v != v \
                or (lo is not None and v < lo) or (hi is not None and v > hi):
            raise fail(where, want, v)
        return v
    return Rule(want, check)


def bandwidth() -> Check:
    """A link bandwidth: Mbit/s > 0 (at most `MAX_MBIT`), or None for an unlimited link
    (``null`` in YAML; in a -p string also ``null``, ``none`` or ``unlimited``)."""
    want = f"Mbit/s > 0 or null (unlimited), at most {MAX_MBIT}"

    def check(v: object, where: str, ctx: Context) -> object:
        if ctx.lenient and isinstance(v, str) and v.strip().lower() in (
                "null", "none", "unlimited"):
            return None
        if v is None:
            return v
        if not (_is_int(v) or isinstance(v, float)) or v != v or not 0 < v <= MAX_MBIT:
            raise fail(where, want, v)
        return v
    return Rule(want, check)


def threads() -> Check:
    """A thread count. Where the value is used (the notebook: lenient) at most this
    machine's CPUs (`mtplib.runtime.model.max_threads`, what the runtime refuses beyond);
    a lane file, which may be meant for another machine, at most `MAX_THREADS` (the
    machine's CPUs are checked by `mtplib.records.lanes.check_lane_requirements`)."""
    lane = integer(1, MAX_THREADS)

    def check(v: object, where: str, ctx: Context) -> object:
        if not ctx.lenient:
            return lane(v, where, ctx)
        from mtplib.runtime.model import max_threads

        n = max_threads()
        if not _is_int(v) or not 1 <= v <= n:
            raise fail(where, f"an int 1..{n} (this machine's CPUs)", v)
        return v
    return Rule("an int 1..(this machine's CPUs)", check)


def of_type(cls: type, expected: str) -> Check:
    """Any value of ``cls`` (bool is not an int here: see `integer`)."""
    def check(v: object, where: str, ctx: Context) -> object:
        if not isinstance(v, cls):
            raise fail(where, expected, v)
        return v
    return Rule(expected, check)


def boolean() -> Check:
    return of_type(bool, "True or False")


def text(choices: tuple[str, ...] | None = None, *, what: str = "a string",
         unknown: str = "") -> Check:
    """A string (one of ``choices`` where given; ``unknown``: the noun a refused choice is
    called, "unknown topology")."""
    want = f"one of {', '.join(choices)}" if choices else what

    def check(v: object, where: str, ctx: Context) -> object:
        if not isinstance(v, str):
            raise fail(where, want, v)
        if choices and v not in choices:
            raise fail(where, want, v, f"unknown {unknown}" if unknown else "")
        return v
    return Rule(want, check)


def optional(inner: Check, *, none: tuple[object, ...] = (None,)) -> Check:
    """``inner`` or None (or another 'off' value in ``none``, e.g. False)."""
    want = f"{_expected(inner)} or None"

    def check(v: object, where: str, ctx: Context) -> object:
        if any(v is n for n in none):
            return v
        if ctx.lenient and v == "":  # -p run_dir "" is papermill's way to say nothing
            return None
        return inner(v, where, ctx)
    return Rule(want, check)


def _expected(c: Check) -> str:
    return getattr(c, "expected", "a value")


def _yaml(v: str, where: str, want: str) -> object:
    import yaml

    try:
        return yaml.safe_load(v)
    except yaml.YAMLError as e:
        raise fail(where, want, v, f"not valid YAML: {' '.join(str(e).split())[:120]}") from None


def _as_mapping(v: object, where: str, want: str, ctx: Context) -> dict:
    """``v`` as a mapping (lenient: a YAML string, "" for an empty one) or the error."""
    if ctx.lenient and isinstance(v, str):
        v = _yaml(v, where, want) if v.strip() else {}
    if not isinstance(v, dict):
        raise fail(where, want, v)
    return v


_WORDS = re.compile(r"[,\s]+")
#: plans contain commas: a -p string of several is split on ";" or whitespace
PLAN_SEPARATORS = re.compile(r"[;\s]+")


def list_of(item: Check, *, what: str, split: re.Pattern = _WORDS, min_len: int = 1,
            max_len: int | None = None) -> Check:
    """A list whose items pass ``item`` (``where[i]`` in errors), of ``min_len`` ..
    ``max_len`` items."""
    want = f"a list of {what}"

    def check(v: object, where: str, ctx: Context) -> object:
        if ctx.lenient and isinstance(v, str):
            s = v.strip()
            v = _yaml(s, where, want) if s.startswith("[") else [
                _scalar(x) for x in split.split(s) if x]
        elif ctx.lenient and not isinstance(v, list | tuple | dict) and v is not None:
            v = [v]
        if not isinstance(v, list | tuple):
            raise fail(where, want + (" (-p NAME '[a, b]' or -y)" if ctx.lenient else ""), v)
        if len(v) < min_len:
            raise fail(where, f"{want} with at least {min_len} item(s)", v)
        if max_len is not None and len(v) > max_len:
            raise ParameterError(f"{where}: expected {want} with at most {max_len} items, "
                                 f"got {len(v)} items")
        return [item(x, f"{where}[{i}]", ctx) for i, x in enumerate(v)]
    return Rule(want, check)


def _scalar(s: str) -> object:
    """One item of a split string, typed as papermill types a -p value."""
    for conv in (int, float):
        try:
            return conv(s)
        except ValueError:
            pass
    return s


def any_list() -> Check:
    return of_type(list, "a list")


def plan(*, whole: bool = False) -> Check:
    """A shard plan: contiguous layer ranges from layer 0 ("0-1,2-3"); with ``whole`` also
    "whole" (the model in one process). Without a known model the last range's end is
    taken as the last layer; with ``Context.n_layer`` the ranges must cover the model."""
    want = ("'whole' or " if whole else "") + "a shard plan of contiguous layer ranges " \
        "from 0, e.g. '0-1,2-3'"

    def check(v: object, where: str, ctx: Context) -> object:
        from mtplib.ownership.plan import PlanError, parse_plan

        if whole and v == "whole":
            return v
        if not isinstance(v, str):
            raise fail(where, want, v)
        try:
            n = ctx.n_layer
            if n is None:
                last = re.findall(r"\d+", v)
                n = int(last[-1]) + 1 if last else 1
            parse_plan(v, n)
        except PlanError as e:
            raise fail(where, want, v, str(e)) from None
        return v
    return Rule(want, check)


def plans(*, whole: bool = False) -> Check:
    """A list of shard plans (`plan`; a -p string split on ";" or whitespace)."""
    return list_of(plan(whole=whole), what="plans", split=PLAN_SEPARATORS)


def preset() -> Check:
    """A fixture preset name (`mtplib.model.presets.PRESETS`)."""
    def check(v: object, where: str, ctx: Context) -> object:
        from mtplib.model.presets import PRESETS

        return text(tuple(PRESETS))(v, where, ctx)
    return Rule("a fixture preset name", check)


def drafts(lo: int) -> Check:
    """Draft lengths (0 = MTP off where ``lo`` is 0), each at most the longest draft the
    contract defines (its one draft spec)."""
    from mtplib.contract.types import MAX_DRAFT

    return list_of(integer(lo, MAX_DRAFT), what=f"draft lengths {lo}..{MAX_DRAFT} (ints)")


def prompt() -> Check:
    """A bench prompt: a text, or {seed: N, len: L} (random token ids)."""
    want = "a prompt text or {seed: N, len: L}"
    keys = {"seed": integer(0, MAX_SEED), "len": integer(1, MAX_PROMPT_TOKENS)}

    def check(v: object, where: str, ctx: Context) -> object:
        if isinstance(v, str) and v:
            return v
        if not isinstance(v, dict) or "seed" not in v or set(v) - set(keys):
            raise fail(where, want, v)
        for k, c in keys.items():
            if k in v:
                c(v[k], f"{where}.{k}", ctx)
        return v
    return Rule(want, check)


def section(cls: type, overrides: Mapping[str, Check] | None = None,
            after: Callable[[dict, str, Context], None] | None = None) -> Check:
    """A mapping of the dataclass ``cls``'s fields (every key optional): unknown keys are
    refused, each value is checked by ``overrides[key]`` or by the field's type hint."""
    want = f"a mapping of {cls.__name__} fields"

    def check(v: object, where: str, ctx: Context) -> object:
        v = _as_mapping(v, where, want, ctx)
        rules = fields_of(cls, overrides)
        unknown = sorted(str(k) for k in v if k not in rules)
        if unknown:
            raise ParameterError(f"{where}: unknown keys {unknown} (known: {sorted(rules)})")
        out = {k: rules[k](x, f"{where}.{k}", ctx) for k, x in v.items()}
        if after is not None:
            after(out, where, ctx)
        return out
    return Rule(want, check)


def fields_of(cls: type, overrides: Mapping[str, Check] | None = None) -> dict[str, Check]:
    """A checker per field of the dataclass ``cls``, from its type hints."""
    hints = typing.get_type_hints(cls)
    return {f.name: (overrides or {}).get(f.name) or from_hint(hints[f.name])
            for f in dataclasses.fields(cls)}


def from_hint(hint: object) -> Check:
    """The checker of a type hint: int, float, str, bool, list, list[X], dict, X | None,
    a dataclass (a mapping of its fields)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        rest = [a for a in args if a is not type(None)]
        inner = from_hint(rest[0]) if len(rest) == 1 else _anything
        return optional(inner) if type(None) in args else inner
    if hint is bool:
        return boolean()
    if hint is int:
        return integer()
    if hint is float:
        return number()
    if hint is str:
        return text()
    if hint is list or (origin is list and not args):
        return any_list()
    if origin is list:
        return list_of(from_hint(args[0]), what=_expected(from_hint(args[0])) + " items")
    if hint is dict or origin is dict:
        return mapping()
    if dataclasses.is_dataclass(hint):
        return section(hint)  # type: ignore[arg-type]
    return _anything


def _anything(v: object, where: str, ctx: Context) -> object:
    return v


def mapping(values: Check | None = None, *, keys: tuple[str, ...] | None = None,
            what: str = "a mapping") -> Check:
    """A mapping (lenient: a YAML string); with ``values`` each value passes it; with
    ``keys`` only those keys."""
    def check(v: object, where: str, ctx: Context) -> object:
        v = _as_mapping(v, where, what, ctx)
        if keys is not None and set(v) - set(keys):
            raise ParameterError(f"{where}: unknown keys {sorted(map(str, set(v) - set(keys)))}"
                                 f" (known: {list(keys)})")
        return v if values is None else {k: values(x, f"{where}.{k}", ctx)
                                         for k, x in v.items()}
    return Rule(what, check)


def says(rule: Check, words: str) -> Check:
    """``rule`` with ``words`` for a config's error (`Rule.says`): the same check."""
    return dataclasses.replace(rule, says=words)


#: how a config checks its own fields: typed values, nothing parsed
STRICT = Context()


def check_fields(obj: object, rules: Mapping[str, Check], label: str, *,
                 nested: Mapping[str, Mapping[str, Check]] | None = None,
                 error: type[InputError] = InputError, prefix: str = "") -> None:
    """Check the dataclass ``obj``'s fields with their ``rules`` (strict): the first bad
    one raises ``error`` "LABEL: NAME must be WORDS, got VALUE (why)", in the rule's
    words (`Rule.says`, else its `expected`). A field whose value is a dataclass and that
    ``nested`` names is checked field by field with those rules ("sweep.rates")."""
    for name, rule in rules.items():
        v = getattr(obj, name)
        if nested and name in nested and dataclasses.is_dataclass(v):
            check_fields(v, nested[name], label, error=error, prefix=f"{prefix}{name}.")
            continue
        try:
            rule(v, f"{label}.{prefix}{name}", STRICT)
        except ParameterError as e:
            why = getattr(e, "why", "")
            words = getattr(rule, "says", "") or _expected(rule)
            raise error(f"{label}: {prefix}{name} must be {words}, got {v!r}"
                        + (f" ({why})" if why else "")) from None
