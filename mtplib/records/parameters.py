"""Notebook parameters: one checker per parameter name, for the notebooks and for lanes.

Each notebook's `parameters` cell declares its parameters as annotated assignments
(``ks: list[int] = [1, 2, 3]  # draft lengths``), which is what ``papermill
--help-notebook`` shows. The cell after it calls `checked`, which checks every declared
value with the rule registered here under its name (`PARAMETERS`), and `mtplib run`
checks a lane's values with the same rules (`check_value`) before the first notebook
runs. A bad value stops with one line naming the parameter (its key path in a lane), what
was expected and what was given; so does a ``-p`` name the notebook does not declare
(`injected_names`). In a kernel the error shows as that line, no traceback
(`ParameterError._render_traceback_`), and papermill's CLI prints it as one line too
(`mtplib.records.papermill_engine`). Each value is range-checked here, where it is read:
a thread count against this machine's CPUs, a fixture preset against the presets.

Values from ``papermill -p NAME VALUE`` arrive as a string, an int, a float, a bool or
None, so the notebook side is lenient (`Context.lenient`), with one rule for lists:
a string in brackets is read as YAML (``-p ks '[1, 2]'``, ``-p plans '["0-1,2-3"]'``);
otherwise a list of numbers or names is split on commas or whitespace (``-p ks 1,2``), and
a list of plans (which contain commas themselves) on ``;`` or whitespace (``-p plans
"whole;0-1,2-3"``); a single number or name becomes a one-item list (``-p ks 2``). A
string for a mapping is read as YAML (``-p bench '{ks: [1], n_new: 8}'``); ``papermill
-y``/``-f`` give typed values directly. Lanes are YAML with real lists and mappings, so
lane validation is strict: ``ks: 3`` is refused where a list is expected.
"""

from __future__ import annotations

import ast
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


class ParameterError(InputError):
    """A notebook parameter (or a lane's value for one) that cannot be used."""

    def _render_traceback_(self) -> list[str]:
        """What IPython shows in place of a traceback (its hook for this method): the one
        line says it all, so the cell's error, and papermill's, is that line."""
        return [f"{type(self).__name__}: {self}"]


@dataclass(frozen=True)
class Context:
    """How to read values: ``lenient`` for papermill's ``-p`` strings and scalars (see the
    module docstring); ``n_layer`` (when the model is known) bounds shard plans."""

    lenient: bool = False
    n_layer: int | None = None


#: a checker: (value, key path, context) -> the value to use; raises ParameterError
Check = Callable[[object, str, Context], object]


@dataclass(frozen=True)
class Rule:
    """A checker with the words for what it accepts (nested rules quote them)."""

    expected: str
    check: Check

    def __call__(self, v: object, where: str, ctx: Context) -> object:
        return self.check(v, where, ctx)


def fail(where: str, expected: str, got: object, why: str = "") -> ParameterError:
    """The one-line error: key path, what is expected, what was given (and why not)."""
    return ParameterError(f"{where}: expected {expected}, got {got!r}" + (f" ({why})" if why
                                                                           else ""))


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _bounds(lo: float | None, hi: float | None) -> str:
    if lo is not None and hi is not None:
        return f" {lo:g}..{hi:g}"
    if lo is not None:
        return f" >= {lo:g}"
    return f" <= {hi:g}" if hi is not None else ""


def integer(lo: int | None = None, hi: int | None = None) -> Check:
    want = "an int" + _bounds(lo, hi)

    def check(v: object, where: str, ctx: Context) -> object:
        if not _is_int(v) or (lo is not None and v < lo) or (hi is not None and v > hi):
            raise fail(where, want, v)
        return v
    return Rule(want, check)


def number(lo: float | None = None, hi: float | None = None) -> Check:
    want = "a number" + _bounds(lo, hi)

    def check(v: object, where: str, ctx: Context) -> object:
        if not (_is_int(v) or isinstance(v, float)) or v != v \
                or (lo is not None and v < lo) or (hi is not None and v > hi):
            raise fail(where, want, v)
        return v
    return Rule(want, check)


def bandwidth() -> Check:
    """A link bandwidth: Mbit/s > 0, or None for an unlimited link (``null`` in YAML; in a
    -p string also ``null``, ``none`` or ``unlimited``)."""
    want = "Mbit/s > 0 or null (unlimited)"

    def check(v: object, where: str, ctx: Context) -> object:
        if ctx.lenient and isinstance(v, str) and v.strip().lower() in (
                "null", "none", "unlimited"):
            return None
        if v is None:
            return v
        if not (_is_int(v) or isinstance(v, float)) or v != v or v <= 0 or v == float("inf"):
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


def text(choices: tuple[str, ...] | None = None, *, what: str = "a string") -> Check:
    want = f"one of {', '.join(choices)}" if choices else what

    def check(v: object, where: str, ctx: Context) -> object:
        if not isinstance(v, str) or (choices and v not in choices):
            raise fail(where, want, v)
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
_PLANS = re.compile(r"[;\s]+")


def list_of(item: Check, *, what: str, split: re.Pattern = _WORDS, min_len: int = 1
            ) -> Check:
    """A list whose items pass ``item`` (``where[i]`` in errors)."""
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
    keys = {"seed": integer(0), "len": integer(1)}

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


# -- the sections: a lane's bench: and wan: (notebooks 04 and 05) ------------------------------
def _bench_cross(d: dict, where: str, ctx: Context) -> None:
    """What `run_bench` would refuse only when it gets there: ranged plans without the
    whole model (their quality reference)."""
    plans = d.get("plans", ["whole"])
    if any(p != "whole" for p in plans) and "whole" not in plans:
        raise fail(f"{where}.plans", "'whole' among the plans when a ranged plan is listed "
                   "(the whole model is the quality reference)", plans)


def bench_section() -> Check:
    """The ``bench:`` section (mtplib.lab.bench_config.BenchConfig)."""
    def check(v: object, where: str, ctx: Context) -> object:
        from mtplib.contract.capabilities import POLICIES
        from mtplib.contract.labels import SEAM_CHOICES
        from mtplib.lab.bench_config import BenchConfig, SamplingConfig
        from mtplib.lab.sweep import SweepConfig

        sweep = section(SweepConfig, {"ks": drafts(1),
                                      "rates": list_of(number(0, 1), what="rates 0..1"),
                                      "reps": integer(1), "warmup": integer(0),
                                      "draft_cost": text(("mtp", "none"))})
        sampling = section(SamplingConfig, {"temperature": number(0), "top_p": number(0, 1),
                                            "seeds": integer(1), "n_new": integer(1)})
        rules = {"ks": drafts(1), "plans": list_of(plan(whole=True), what="plans",
                                                   split=_PLANS),
                 "prompts": list_of(prompt(), what="prompts"), "n_new": integer(2),
                 "reps": integer(1), "warmup": integer(0),
                 "threads": optional(threads()), "n_ctx": integer(1),
                 "backend": text(("cpu", "gpu")),
                 "sweep": optional(sweep, none=(None, False)), "sampling": optional(sampling),
                 "policy": optional(text(tuple(POLICIES))), "seam": text(SEAM_CHOICES)}
        return section(BenchConfig, rules, after=_bench_cross)(v, where, ctx)
    return Rule("a mapping of BenchConfig fields", check)


def wan_section() -> Check:
    """A WAN run's fields (mtplib.lab.wan.WanConfig): the lane's ``wan:``, 05's ``target``
    and each build's ``overrides``."""
    def check(v: object, where: str, ctx: Context) -> object:
        from mtplib.contract.labels import SEAM_CHOICES
        from mtplib.lab.wan import COLD_SHARDS, MODES, PLACEMENTS, TOPOLOGIES, WanConfig
        from mtplib.runtime.links import MAX_RTT_MS

        rtts = list_of(number(0, MAX_RTT_MS), what=f"RTTs in ms 0..{MAX_RTT_MS}")
        rules = {"ks": drafts(0), "cold_ks": drafts(0), "rtts_ms": rtts, "cold_rtts_ms": rtts,
                 "fit_rtts_ms": rtts,
                 "mbits": list_of(bandwidth(), what="link bandwidths (Mbit/s > 0 or null)"),
                 "cold_shards": text(COLD_SHARDS),
                 "plans": list_of(plan(), what="plans", split=_PLANS),
                 "topologies": list_of(text(TOPOLOGIES), what="topologies"),
                 "placements": list_of(text(PLACEMENTS), what="placements"),
                 "modes": list_of(text(MODES), what="modes"),
                 "n_prompts": integer(1), "prompt_len": integer(1), "n_new": integer(1),
                 "reps": integer(1), "warmup": integer(0), "n_ctx": optional(integer(1)),
                 "threads": threads(), "shard_threads": threads(),
                 "cost_model_tolerance": number(0), "seam": text(SEAM_CHOICES)}
        return section(WanConfig, rules)(v, where, ctx)
    return Rule("a mapping of WanConfig fields", check)


BUILDS = ("stock", "patched")


@dataclass(frozen=True)
class Param:
    """A notebook parameter: the annotation its `parameters` cell writes (what ``papermill
    --help-notebook`` shows) and the rule its values pass."""

    annotation: str
    check: Check


def _p(annotation: str, check: Check) -> Param:
    return Param(annotation, check)


_PATH = optional(text(what="a path (string)"))
#: every parameter of notebooks/*.ipynb, by name (one meaning per name across notebooks;
#: tests/test_parameters.py checks each notebook declares exactly these annotations)
PARAMETERS: dict[str, Param] = {
    "trunk": _p("Optional[str]", _PATH),
    "sidecar": _p("Optional[str]", _PATH),
    "run_dir": _p("Optional[str]", _PATH),
    "flash_dir": _p("Optional[str]", _PATH),
    "golden_dir": _p("Optional[str]", _PATH),
    "sbs_dir": _p("str", text(what="a folder (string)")),
    "threads": _p("int", threads()),
    "progress": _p("bool", boolean()),
    "preset": _p("str", preset()),
    "seed": _p("int", integer(0)),
    "prompt_tokens": _p("list[int]", list_of(integer(0), what="token ids (ints >= 0)")),
    "n_tokens": _p("int", integer(1)),
    "plan": _p("str", plan()),
    "ctx": _p("int", integer(1)),
    "n_seq": _p("int", integer(1)),
    "flash_shards": _p("list[int]", list_of(integer(1, 43), what="shard counts 1..43")),
    "flash_ctx": _p("int", integer(1)),
    "flash_ctxs": _p("list[int]", list_of(integer(1), what="contexts (ints >= 1)")),
    "seeds": _p("int", integer(1)),
    "ks": _p("list[int]", drafts(1)),
    "n_new": _p("int", integer(2)),
    "plans": _p("list[str]", list_of(plan(), what="plans", split=_PLANS)),
    "sampling_seeds": _p("int", integer(1)),
    "bench": _p("dict", bench_section()),
    "wan": _p("dict", wan_section()),
    "target": _p("Optional[dict]", optional(wan_section())),
    "builds": _p("list[str]", list_of(text(BUILDS), what="upstream builds (stock, patched)")),
    "overrides": _p("dict", mapping(wan_section(), keys=BUILDS,
                                    what="a mapping build -> WanConfig fields")),
}


def check_value(name: str, value: object, *, where: str | None = None,
                ctx: Context = Context()) -> object:
    """``value`` for the parameter ``name`` checked (and, lenient, parsed): the value to
    use. A name without a rule passes unchanged. Errors name ``where`` (default: name)."""
    param = PARAMETERS.get(name)
    return value if param is None else param.check(value, where or name, ctx)


#: the first line of papermill's injected-parameters cell (its Python translator's comment)
INJECTED_HEADER = "# Parameters\n"


def injected_names(namespace: Mapping[str, object]) -> list[str]:
    """The names papermill's injected-parameters cell assigned (``-p NAME VALUE``), read
    from IPython's input history (``In``) in ``namespace``; [] outside a papermill run."""
    history = namespace.get("In")
    if not isinstance(history, list):
        return []
    src = next((c for c in reversed(history)
                if isinstance(c, str) and c.startswith(INJECTED_HEADER)), None)
    if src is None:
        return []
    try:
        body = ast.parse(src).body
    except SyntaxError:
        return []
    return [t.id for node in body if isinstance(node, ast.Assign)
            for t in node.targets if isinstance(t, ast.Name)]


def checked(namespace: Mapping[str, object]) -> dict[str, object]:
    """Every parameter the notebook's `parameters` cell declares (its annotated names),
    checked and parsed as papermill ``-p`` values are: the values to put back, as in
    ``globals().update(checked(globals()))``. A papermill parameter the cell does not
    declare (a typo: ``-p thread 2``), or the first bad value, raises ParameterError."""
    names = typing.cast(Mapping[str, object], namespace.get("__annotations__", {}))
    unknown = [n for n in injected_names(namespace) if n not in names]
    if unknown:
        raise ParameterError(f"unknown parameter{'s' if len(unknown) > 1 else ''} "
                             f"{', '.join(map(repr, unknown))}: this notebook's are "
                             f"{', '.join(names)}")
    lenient = Context(lenient=True)
    return {n: check_value(n, namespace[n], ctx=lenient) for n in names if n in namespace}
