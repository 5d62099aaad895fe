"""Notebook parameters (issue 23, item 6): typed for papermill (`--help-notebook` shows each
type and help), checked at the top of every notebook by `mtplib.records.parameters.checked`
with one line naming a bad one, and papermill's ``-p`` strings parsed by one rule."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import jupytext
import pytest
from papermill.translators import PythonTranslator

from mtplib.errors import InputError
from mtplib.lab.common.checks import STRICT, Context, ParameterError
from mtplib.records import parameters as NP

REPO = Path(__file__).resolve().parent.parent
NB = REPO / "notebooks"
PAIRS = sorted(NB.glob("[0-9]*.py"))
LENIENT = Context(lenient=True)


def _cells(src: Path) -> tuple[str, str]:
    """(the parameters cell, the cell right after it) of a notebook's source."""
    cells = jupytext.read(src).cells
    (i,) = [i for i, c in enumerate(cells) if "parameters" in c.metadata.get("tags", [])]
    return cells[i].source, cells[i + 1].source


def _namespace(src: Path, injected: dict | None = None) -> dict:
    """What a kernel holds after the parameters cell and papermill's injected cell."""
    ns: dict = {}
    exec(compile(_cells(src)[0], str(src), "exec"), ns)
    if injected:
        exec(PythonTranslator.codify(injected), ns)
    return ns


@pytest.mark.parametrize("src", PAIRS, ids=lambda p: p.stem)
def test_help_notebook_shows_every_type_and_help(src):
    """papermill infers each parameter's type from the annotation (no "Unknown type"), the
    one the rule for that name declares, and its help from the comment."""
    import papermill as pm

    params = pm.inspect_notebook(str(src.with_suffix(".ipynb")))
    declared = _namespace(src)["__annotations__"]
    assert list(params) == list(declared), "papermill could not parse every parameter"
    for name, info in params.items():
        assert name in NP.PARAMETERS, f"{src.stem}: no rule for parameter {name!r}"
        assert info["inferred_type_name"] == NP.PARAMETERS[name].annotation, name
        assert info["help"], f"{src.stem}: {name} has no help comment"


def test_help_notebook_cli_has_no_unknown_type():
    r = subprocess.run([sys.executable, "-m", "papermill", "--help-notebook",
                        str(NB / "03_correctness.ipynb")], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    assert "Unknown type" not in r.stdout
    assert "ks: list[int] (default [1, 2, 3])" in r.stdout and "draft lengths" in r.stdout


@pytest.mark.parametrize("src", PAIRS, ids=lambda p: p.stem)
def test_every_notebook_checks_its_parameters_first(src):
    """The cell after `parameters` (where papermill injects its own) checks them; every
    default passes its own rule unchanged."""
    assert "globals().update(checked(globals()))" in _cells(src)[1]
    ns = _namespace(src)
    got = NP.checked(ns)
    assert set(got) == set(ns["__annotations__"])
    assert got == {k: ns[k] for k in got}


@pytest.mark.parametrize("value,want", [
    (2, [2]), ("1,2", [1, 2]), ("1 2 3", [1, 2, 3]), ("[1, 2]", [1, 2]), ([3], [3])])
def test_ks_from_papermill_p(value, want):
    """`-p ks 2` (papermill gives an int), `-p ks 1,2`, `-p ks '[1, 2]'`."""
    ns = _namespace(NB / "03_correctness.py", {"ks": value})
    assert NP.checked(ns)["ks"] == want


@pytest.mark.parametrize("value,want", [
    ("0-1,2-3", ["0-1,2-3"]), ("0-1,2-3;0-0,1-2,3-3", ["0-1,2-3", "0-0,1-2,3-3"]),
    ("0-1,2-3 0-0,1-2,3-3", ["0-1,2-3", "0-0,1-2,3-3"]), ('["0-1,2-3"]', ["0-1,2-3"])])
def test_plans_from_papermill_p(value, want):
    """A plan contains commas: plans are split on ';' or whitespace, never on commas (the
    string used to be iterated character by character)."""
    ns = _namespace(NB / "03_correctness.py", {"plans": value})
    assert NP.checked(ns)["plans"] == want


@pytest.mark.parametrize("name,value,pattern", [
    ("ks", "x", r"^ks\[0\]: expected an int 1\.\.8, got 'x'$"),
    ("ks", 0, r"^ks\[0\]: expected an int 1\.\.8, got 0$"),
    ("ks", "[1, 2", r"^ks: expected a list of draft lengths .*not valid YAML"),
    ("plans", "0-1,3-4", r"^plans\[0\]: expected a shard plan .*gap before range 1"),
    ("plans", "0-1;2-3", r"^plans\[1\]: expected a shard plan .*gap before range 0"),
    ("seeds", "many", r"^seeds: expected an int 1\.\.1000, got 'many'$"),
    ("progress", "yes", r"^progress: expected True or False, got 'yes'$"),
    ("threads", 0, r"^threads: expected an int 1\.\.\d+ \(this machine's CPUs\), got 0$"),
])
def test_bad_papermill_values_are_named_in_one_line(name, value, pattern):
    ns = _namespace(NB / "03_correctness.py", {name: value})
    with pytest.raises(ParameterError, match=pattern) as e:
        NP.checked(ns)
    assert "\n" not in str(e.value)


def test_sections_from_papermill_p_are_yaml():
    ns = _namespace(NB / "04_benchmark.py", {"bench": "{ks: 2, n_new: 8}"})
    assert NP.checked(ns)["bench"] == {"ks": [2], "n_new": 8}
    ns = _namespace(NB / "04_benchmark.py", {"bench": "{ks: [1], kz: 3}"})
    with pytest.raises(ParameterError, match=r"^bench: unknown keys \['kz'\]"):
        NP.checked(ns)
    ns = _namespace(NB / "05_wan.py", {"builds": "patched", "target": "", "run_dir": ""})
    got = NP.checked(ns)
    assert (got["builds"], got["target"], got["run_dir"]) == (["patched"], None, None)


def test_strict_context_refuses_what_lenient_parses():
    """Lanes are YAML with real lists: no guessing there."""
    with pytest.raises(ParameterError, match=r"^x\.ks: expected a list of draft"):
        NP.check_value("ks", 3, where="x.ks")
    with pytest.raises(ParameterError, match=r"^plans: expected a list of plans"):
        NP.check_value("plans", "0-1,2-3")
    assert NP.check_value("ks", 3, ctx=LENIENT) == [3]


def test_plans_against_a_known_model():
    ctx = Context(n_layer=4)
    assert NP.check_value("plan", "0-1,2-3", ctx=ctx) == "0-1,2-3"
    with pytest.raises(ParameterError, match="layers 2-3 belong to no shard"):
        NP.check_value("plan", "0-1", ctx=ctx)
    assert NP.check_value("plan", "0-1") == "0-1"  # model unknown: 2 layers, fine


@pytest.mark.slow
def test_papermill_run_stops_at_the_check_naming_the_parameter(tmp_path, monkeypatch):
    """`papermill 03_correctness.ipynb -p plans 0-1,3-4` stops in the check cell, before any
    model is made or decoded, with the parameter's name in papermill's error."""
    import papermill as pm
    from papermill.exceptions import PapermillExecutionError

    from mtplib.records.jupyter import KERNEL, papermill_options
    from mtplib.records.lanes import kernel_env

    for k, v in kernel_env().items():
        monkeypatch.setenv(k, v)
    t0 = time.monotonic()
    with pytest.raises(PapermillExecutionError) as e:
        pm.execute_notebook(str(NB / "03_correctness.ipynb"), str(tmp_path / "out.ipynb"),
                            parameters={"plans": "0-1,3-4", "run_dir": str(tmp_path / "run")},
                            kernel_name=KERNEL, cwd=str(tmp_path), progress_bar=False,
                            **papermill_options())
    assert e.value.ename == "ParameterError"
    assert e.value.evalue.startswith("plans[0]: expected a shard plan")
    assert not (tmp_path / "run").exists()  # nothing ran
    assert time.monotonic() - t0 < 60


# -- issue 32 item 5: unknown names refused, every value range-checked where it is read ------
def _papermill_namespace(src: Path, injected: dict) -> dict:
    """A kernel's namespace after papermill's injected cell, with IPython's input history
    (``In``) holding that cell's source, as `checked` sees it in a papermill run."""
    ns = _namespace(src, injected)
    ns["In"] = ["", _cells(src)[0], PythonTranslator.codify(injected)]
    return ns


def test_an_unknown_papermill_name_is_refused_in_one_line():
    ns = _papermill_namespace(NB / "00_fixture_smoke.py", {"thread": 2, "n_tokens": 4})
    with pytest.raises(ParameterError, match=r"^unknown parameter 'thread': this "
                       r"notebook's are trunk, sidecar, .*threads, run_dir$") as e:
        NP.checked(ns)
    assert "\n" not in str(e.value)
    ns = _papermill_namespace(NB / "00_fixture_smoke.py", {"a": 1, "b": 2})
    with pytest.raises(ParameterError, match=r"^unknown parameters 'a', 'b'"):
        NP.checked(ns)
    ok = _papermill_namespace(NB / "00_fixture_smoke.py", {"n_tokens": 4, "threads": 1})
    assert NP.checked(ok)["n_tokens"] == 4
    assert NP.injected_names({"In": ["x = 1"]}) == []  # no papermill cell: nothing injected


def test_a_fixture_preset_is_one_of_the_presets():
    ns = _namespace(NB / "00_fixture_smoke.py", {"preset": "tinyy"})
    with pytest.raises(ParameterError, match=r"^preset: expected one of tiny, .*got 'tinyy'$"):
        NP.checked(ns)
    ok = _namespace(NB / "00_fixture_smoke.py", {"preset": "tiny"})
    assert NP.checked(ok)["preset"] == "tiny"


def test_threads_are_bounded_by_this_machines_cpus(monkeypatch):
    """`-p threads 99` stops at the check (before: it passed and the runtime refused it);
    a lane file is bounded by MAX_THREADS only (its machine is checked apart)."""
    import mtplib.runtime.model as RMOD

    monkeypatch.setattr(RMOD, "max_threads", lambda: 2)
    for name, inj in (("00_fixture_smoke", {"threads": 99}),
                      ("04_benchmark", {"bench": "{threads: 3}"}),
                      ("05_wan", {"wan": "{shard_threads: 3}"})):
        with pytest.raises(ParameterError, match=r"threads: expected an int 1\.\.2 "
                           r"\(this machine's CPUs\), got (99|3)$"):
            NP.checked(_namespace(NB / f"{name}.py", inj))
    assert NP.checked(_namespace(NB / "00_fixture_smoke.py", {"threads": 2}))["threads"] == 2
    assert NP.check_value("threads", 99) == 99  # a lane's value: MAX_THREADS
    with pytest.raises(ParameterError, match=r"1\.\.1024"):
        NP.check_value("threads", 2000)


def test_a_parameter_error_shows_as_one_line_in_a_kernel():
    """IPython renders `_render_traceback_` in place of the traceback."""
    e = ParameterError("threads: expected an int 1..2, got 99")
    assert e._render_traceback_() == ["ParameterError: threads: expected an int 1..2, got 99"]


def test_papermill_cli_prints_a_refused_parameter_as_one_line(capsys):
    """papermill imports the engine module at start (an entry point), whose hook prints a
    notebook's ParameterError as its line; anything else goes to the hook before."""
    from papermill.exceptions import PapermillExecutionError

    from mtplib.records import papermill_engine as PE

    seen = []
    hook = PE.one_line_errors(lambda *a: seen.append(a))
    err = PapermillExecutionError(1, 2, "checked(globals())", "ParameterError",
                                  "threads: expected an int 1..2, got 99", ["tb"] * 60)
    hook(type(err), err, None)
    assert capsys.readouterr().err == "ParameterError: threads: expected an int 1..2, got 99\n"
    other = PapermillExecutionError(1, 2, "x", "ValueError", "boom", ["tb"])
    hook(type(other), other, None)
    assert seen == [(type(other), other, None)]
    assert getattr(sys.excepthook, "one_line_errors", False)  # installed on import


@pytest.mark.slow
@pytest.mark.parametrize("engine, args, line", [
    ([], ["-p", "thread", "2"], "ParameterError: unknown parameter 'thread': this notebook's "
                                "are trunk, sidecar, preset, seed, prompt_tokens, n_tokens, "
                                "threads, run_dir"),
    (["--engine", "mtplib"], ["-p", "n_tokens", "abc"],
     "ParameterError: n_tokens: expected an int 1..1024, got 'abc'"),
], ids=["unknown-bare", "bad-value-engine"])
def test_papermill_cli_refuses_in_one_line(tmp_path, engine, args, line):
    """The papermill command itself: exit 1, the refusal as the last line of its output,
    no traceback (before: an unknown name exited 0, a bad value printed 69 lines)."""
    import os

    from mtplib.records.lanes import kernel_env

    env = {**os.environ, **kernel_env(), "PYTHONPATH": str(REPO)}
    papermill = Path(sys.executable).parent / "papermill"
    r = subprocess.run([str(papermill), str(NB / "00_fixture_smoke.ipynb"),
                        str(tmp_path / "out.ipynb"), "--cwd", str(tmp_path), "--kernel",
                        "mtplib", *engine, *args, "-p", "run_dir", str(tmp_path / "run")],
                       capture_output=True, text=True, timeout=300, env=env)
    out = r.stdout + r.stderr
    assert r.returncode == 1, out
    assert out.rstrip().splitlines()[-1] == line
    assert "Traceback" not in out and "---------" not in out
    assert not (tmp_path / "run").exists()  # stopped at the check cell


def test_wan_bandwidths_and_cold_shards():
    """``mbits``: Mbit/s > 0 or null (unlimited), from a lane and from -p; ``cold_shards``
    one of WanConfig's choices; anything else named with its place."""
    assert NP.check_value("wan", {"mbits": [20, 100, None], "cold_shards": "endpoints"}) == {
        "mbits": [20, 100, None], "cold_shards": "endpoints"}
    ns = _namespace(NB / "05_wan.py", {"wan": "{mbits: [20, null]}",
                                       "target": "{mbits: 20 100 unlimited}"})
    got = NP.checked(ns)
    assert got["wan"]["mbits"] == [20, None] and got["target"]["mbits"] == [20, 100, None]
    for bad, pattern in [({"mbits": [0]}, r"^wan\.mbits\[0\]: expected Mbit/s > 0 or null"),
                         ({"mbits": [20, "fast"]}, r"^wan\.mbits\[1\]: expected Mbit/s > 0"),
                         ({"mbits": []}, r"^wan\.mbits: expected a list .* at least 1"),
                         ({"cold_shards": "remote"},
                          r"^wan\.cold_shards: expected one of local, endpoints")]:
        with pytest.raises(ParameterError, match=pattern):
            NP.check_value("wan", bad)


# -- each rule lives once: the lab configs' tables are what the parameters check with ------
def _tables():
    from mtplib.lab.bench import config as BC
    from mtplib.lab.common import acceptance_sweep as sweep
    from mtplib.lab.wan import config as wan_config

    return {wan_config.WanConfig: wan_config.WAN_RULES, BC.BenchConfig: BC.BENCH_RULES,
            sweep.SweepConfig: sweep.SWEEP_RULES, BC.SamplingConfig: BC.SAMPLING_RULES}


def test_every_config_field_has_one_rule_and_the_parameters_use_that_object():
    import dataclasses

    from mtplib.lab.bench.config import BenchConfig
    from mtplib.lab.wan.config import WanConfig

    for cls, rules in _tables().items():
        assert list(rules) == [f.name for f in dataclasses.fields(cls)], cls.__name__
    for cls, used in ((WanConfig, NP.wan_rules()), (BenchConfig, NP.bench_rules())):
        table = _tables()[cls]
        assert set(used) == set(table)
        assert all(used[name] is table[name] for name in table), cls.__name__


@pytest.mark.parametrize(("section", "key", "table", "value", "config_error"), [
    ("wan", "n_new", "wan", 24, r"^wan: n_new must be an int >= 30, got 24$"),
    ("wan", "topologies", "wan", ["remote"], r"^wan: topologies must be a list of "
     r"topologies, got \['remote'\] \(unknown topology\)$"),
    ("bench", "n_new", "bench", 16, r"^bench: n_new must be an int >= 30, got 16$"),
    ("bench", "reps", "sweep", 2, r"^bench: sweep\.reps must be an int >= 30, got 2$"),
    ("bench", "seeds", "sampling", 4, r"^bench: sampling\.seeds must be an int >= 30, got 4$"),
])
def test_one_rule_changed_changes_the_config_and_the_parameters_alike(
        monkeypatch, section, key, table, value, config_error):
    """A rule changed in its one table is what the config refuses with (strict, its own
    message) and what the lane/notebook check refuses with (the parameter's message):
    neither path keeps a copy of it."""
    from mtplib.lab.bench import config as BC
    from mtplib.lab.common import acceptance_sweep as sweep
    from mtplib.lab.common import checks as C
    from mtplib.lab.wan import config as wan_config

    tables = {"wan": wan_config.WAN_RULES, "bench": BC.BENCH_RULES,
              "sweep": sweep.SWEEP_RULES, "sampling": BC.SAMPLING_RULES}
    d = {key: value}
    if table in ("sweep", "sampling"):
        d = {table: d}
    if section == "wan":
        build = lambda: wan_config.WanConfig.from_dict(d)  # noqa: E731
    else:
        build = lambda: BC.BenchConfig.from_dict(d, threads=1)  # noqa: E731
    build()  # passes with the rule as declared
    NP.check_value(section, d)
    stricter = (C.list_of(C.text(("tail_local",), unknown="topology"), what="topologies")
                if key == "topologies" else C.integer(30))
    monkeypatch.setitem(tables[table], key, stricter)
    with pytest.raises(InputError, match=config_error):
        build()
    with pytest.raises(ParameterError, match=rf"^{section}\.(\w+\.)?{key}"):
        NP.check_value(section, d)


def test_every_numeric_value_has_a_stated_range():
    """Issue 39 item 8: `n_tokens: 100000000000` passed the lane check (and failed in the
    notebook), `bench.reps: 1000000000` ran on. Every rule that takes a number (or a list
    of numbers) refuses one far beyond any use, and a negative one, naming the key."""
    from mtplib.lab.bench.config import SAMPLING_RULES
    from mtplib.lab.common.acceptance_sweep import SWEEP_RULES

    tables = {"": {n: p.check for n, p in NP.PARAMETERS.items()},
              "bench.": NP.bench_rules(), "bench.sweep.": SWEEP_RULES,
              "bench.sampling.": SAMPLING_RULES, "wan.": NP.wan_rules()}
    shapes = [(lambda x: x, 2), (lambda x: [x], 2), (lambda x: x, 0.5), (lambda x: [x], 0.5)]
    numeric = []
    for prefix, rules in tables.items():
        for name, rule in rules.items():
            for shape, small in shapes:
                try:
                    rule(shape(small), prefix + name, STRICT)
                except ParameterError:
                    continue
                numeric.append(prefix + name)
                for bad in (10**12, -(10**12)):
                    with pytest.raises(ParameterError,
                                       match=rf"^{prefix + name}(\[0\])?: expected "):
                        rule(shape(type(small)(bad)), prefix + name, STRICT)
                break
    assert len(numeric) >= 30, numeric
    for bad in ({"seed": 0, "len": 10**12}, {"seed": 10**12}, {"seed": -1}):
        with pytest.raises(ParameterError, match=r"^bench\.prompts\[0\]\.(len|seed): "):
            NP.check_value("bench", {"prompts": [bad]})


def test_the_stated_ranges_are_the_runtimes_own():
    """The ranges quote what they stand for: the default context, V4-Flash's context,
    upstream's most sequences."""
    from mtplib.commands.serve import PARALLEL_MAX
    from mtplib.lab.common import checks as C
    from mtplib.model.presets import PRESETS
    from mtplib.runtime.request import DEFAULT_CTX
    from mtplib.runtime.settings import DecodeSettings

    assert C.RUN_CONTEXT == DEFAULT_CTX == DecodeSettings().n_ctx
    assert C.MAX_NEW_TOKENS + C.MAX_PROMPT_TOKENS <= C.RUN_CONTEXT
    assert C.MAX_CONTEXT == max(p.n_ctx_train for p in PRESETS.values())
    assert C.MAX_SEQ == PARALLEL_MAX
