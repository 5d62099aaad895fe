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
a thread count against this machine's CPUs, a fixture preset against the presets, and
every other number against its stated range (`mtplib.lab.common.checks`: tokens per generation
and per prompt, repetitions, seeds, contexts, bandwidths), so that a lane with a typo
(``n_tokens: 100000000000``, ``reps: 1000000000``) stops before its run folder exists.

Values from ``papermill -p NAME VALUE`` arrive as a string, an int, a float, a bool or
None, so the notebook side is lenient (`Context.lenient`), with one rule for lists:
a string in brackets is read as YAML (``-p ks '[1, 2]'``, ``-p plans '["0-1,2-3"]'``);
otherwise a list of numbers or names is split on commas or whitespace (``-p ks 1,2``), and
a list of plans (which contain commas themselves) on ``;`` or whitespace (``-p plans
"whole;0-1,2-3"``); a single number or name becomes a one-item list (``-p ks 2``). A
string for a mapping is read as YAML (``-p bench '{ks: [1], n_new: 8}'``); ``papermill
-y``/``-f`` give typed values directly. Lanes are YAML with real lists and mappings, so
lane validation is strict: ``ks: 3`` is refused where a list is expected.

The rules themselves are the lab's primitives (`mtplib.lab.common.checks`), and the ``bench:`` and
WAN sections use the lab configs' own rule tables (`bench_rules`, `wan_rules`): a range or
a choice is declared once, next to its field, and this module only reads it.
"""

from __future__ import annotations

import ast
import typing
from collections.abc import Mapping
from dataclasses import dataclass

# the rule primitives are the lab's (`mtplib.lab.common.checks`): one rule per field, which
# the lab's configs check with too
from mtplib.lab.common.checks import (
    MAX_CONTEXT,
    MAX_NEW_TOKENS,
    MAX_PROMPT_TOKENS,
    MAX_REPEATS,
    MAX_SEED,
    MAX_SEQ,
    STRICT,
    Check,
    Context,
    ParameterError,
    Rule,
    boolean,
    context_size,
    drafts,
    fail,
    fields_of,
    integer,
    list_of,
    mapping,
    optional,
    plan,
    plans,
    preset,
    section,
    text,
    threads,
    token_id,
)


# -- the sections: a lane's bench: and wan: (notebooks 04 and 05) ------------------------------
def _bench_cross(d: dict, where: str, ctx: Context) -> None:
    """What `run_bench` would refuse only when it gets there: ranged plans without the
    whole model (their quality reference), and a generation that does not fit the
    context after the longest seeded prompt (a text's length is known once tokenized)."""
    from mtplib.lab.bench.config import BenchConfig, SamplingConfig

    plans = d.get("plans", ["whole"])
    if any(p != "whole" for p in plans) and "whole" not in plans:
        raise fail(f"{where}.plans", "'whole' among the plans when a ranged plan is listed "
                   "(the whole model is the quality reference)", plans)
    cfg = BenchConfig()
    longest = max((int(p.get("len", 12)) for p in d.get("prompts", cfg.prompts)
                   if isinstance(p, dict)), default=0)
    n_ctx = d.get("n_ctx", cfg.n_ctx)
    wants = {"n_new": d.get("n_new", cfg.n_new)}
    if d.get("sampling"):
        wants["sampling.n_new"] = d["sampling"].get("n_new", SamplingConfig().n_new)
    for key, n in wants.items():
        if n > n_ctx - longest:
            raise fail(f"{where}.{key}", f"an int <= {n_ctx - longest} (n_ctx {n_ctx} minus "
                       f"the longest prompt's {longest} tokens)", n)


def bench_rules() -> dict[str, Check]:
    """The checker of each ``bench:`` key: `BenchConfig`'s own rules
    (`mtplib.lab.bench.config.BENCH_RULES`, the objects its `validate` uses), read when
    called, never restated here."""
    from mtplib.lab.bench.config import BENCH_RULES, BenchConfig

    return fields_of(BenchConfig, BENCH_RULES)


def wan_rules() -> dict[str, Check]:
    """The checker of each WAN key: `WanConfig`'s own rules
    (`mtplib.lab.wan.config.WAN_RULES`, the objects its `__post_init__` uses)."""
    from mtplib.lab.wan.config import WAN_RULES, WanConfig

    return fields_of(WanConfig, WAN_RULES)


def bench_section() -> Check:
    """The ``bench:`` section (mtplib.lab.bench.config.BenchConfig), with its cross rule
    (`_bench_cross`)."""
    def check(v: object, where: str, ctx: Context) -> object:
        from mtplib.lab.bench.config import BenchConfig

        return section(BenchConfig, bench_rules(), after=_bench_cross)(v, where, ctx)
    return Rule("a mapping of BenchConfig fields", check)


def wan_section() -> Check:
    """A WAN run's fields (mtplib.lab.wan.config.WanConfig): the lane's ``wan:``, 05's ``target``
    and each build's ``overrides``."""
    def check(v: object, where: str, ctx: Context) -> object:
        from mtplib.lab.wan.config import WanConfig

        return section(WanConfig, wan_rules())(v, where, ctx)
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
    "dspark": _p("Optional[str]", _PATH),  # a DSpark draft of the trunk (notebooks 01, 02)
    "sbs_dir": _p("str", text(what="a folder (string)")),
    "threads": _p("int", threads()),
    "progress": _p("bool", boolean()),
    "preset": _p("str", preset()),
    "seed": _p("int", integer(0, MAX_SEED)),
    "prompt_tokens": _p("list[int]", list_of(token_id(), what="token ids",
                                             max_len=MAX_PROMPT_TOKENS)),
    "n_tokens": _p("int", integer(1, MAX_NEW_TOKENS)),
    "plan": _p("str", plan()),
    "ctx": _p("int", context_size()),
    "n_seq": _p("int", integer(1, MAX_SEQ)),
    "flash_shards": _p("list[int]", list_of(integer(1, 43), what="shard counts 1..43")),
    "flash_ctx": _p("int", integer(1, MAX_CONTEXT)),  # V4-Flash's own context_length
    "flash_ctxs": _p("list[int]", list_of(integer(1, MAX_CONTEXT),
                                          what=f"contexts 1..{MAX_CONTEXT}")),
    "seeds": _p("int", integer(1, MAX_REPEATS)),
    "ks": _p("list[int]", drafts(1)),
    "n_new": _p("int", integer(2, MAX_NEW_TOKENS)),
    "plans": _p("list[str]", plans()),
    "sampling_seeds": _p("int", integer(1, MAX_REPEATS)),
    "bench": _p("dict", bench_section()),
    "wan": _p("dict", wan_section()),
    "target": _p("Optional[dict]", optional(wan_section())),
    "builds": _p("list[str]", list_of(text(BUILDS), what="upstream builds (stock, patched)")),
    "overrides": _p("dict", mapping(wan_section(), keys=BUILDS,
                                    what="a mapping build -> WanConfig fields")),
}


def check_value(name: str, value: object, *, where: str | None = None,
                ctx: Context = STRICT) -> object:
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
