"""CLI conventions (issue 16, item 5): every option documented with its default, --version,
--json on every verb with errors as one JSON object, --ctx bounded by the model's
context_length, defaults that resolve from the repo, lane typos refused before anything
runs."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tomllib
from pathlib import Path

import gguf_craft as C
import pytest

from mtplib import paths, pins
from mtplib.cli import build_parser, main
from mtplib.commands import COMMANDS

REPO = Path(__file__).resolve().parent.parent


def _parsers(p: argparse.ArgumentParser, name: str = "mtplib"):
    """(name, parser) for the top-level parser and every sub-parser, depth first."""
    yield name, p
    for act in p._actions:
        if isinstance(act, argparse._SubParsersAction):
            for sub_name, sp in act.choices.items():
                yield from _parsers(sp, f"{name} {sub_name}")


def _leaves(p: argparse.ArgumentParser):
    """The verbs: parsers that run something (they set `fn`)."""
    return [(n, sp) for n, sp in _parsers(p) if sp.get_default("fn") is not None]


@pytest.fixture
def wide(monkeypatch):
    """Help wrapped at 1000 columns: a default is never split across lines."""
    monkeypatch.setenv("COLUMNS", "1000")


def test_every_option_has_help_and_shows_its_default(wide):
    checked = 0
    for name, p in _parsers(build_parser()):
        assert p.description, f"{name}: no description"
        text = " ".join(p.format_help().split())
        for act in p._actions:
            if act.help == argparse.SUPPRESS or isinstance(act, argparse._SubParsersAction):
                continue
            label = "/".join(act.option_strings) or act.dest
            assert act.help and act.help.strip(), f"{name} {label}: no help"
            d = act.default
            if (not act.option_strings or d is None or d is argparse.SUPPRESS
                    or isinstance(d, bool)):
                continue
            shown = ",".join(map(str, d)) if isinstance(d, tuple | list) else str(d)
            assert f"(default: {shown})" in text, f"{name} {label}: default {shown} not shown"
            checked += 1
    assert checked > 40  # the walk saw the options (not an empty parser)


def test_issue_options_show_their_defaults(wide):
    """The options issue 16 named: their defaults (or how they are chosen) are in --help."""
    p = build_parser()
    helps = {n: " ".join(sp.format_help().split()) for n, sp in _parsers(p)}
    assert ("--batch N, -b N, --batch-size N n_batch (prefill chunk) (default: 512)"
            in helps["mtplib generate"])
    assert ("--ubatch N, -ub N, --ubatch-size N n_ubatch (micro-batch) (default: 512)"
            in helps["mtplib generate"])
    assert "(default: min(2048, the model's context_length))" in helps["mtplib generate"]
    for verb in ("run", "bench"):
        assert f"(default: {paths.DEFAULT_LANE})" in helps[f"mtplib {verb}"]
    cu = helps["mtplib compare-upstream"]
    assert "(default: 5)" in cu and "(default: 128)" in cu and "min(1024" in cu
    assert "no progress lines on stderr" in cu  # --quiet had no help


def test_every_verb_takes_json():
    leaves = _leaves(build_parser())
    assert {n.split()[1] for n, _ in leaves} == set(COMMANDS)
    for name, p in leaves:
        assert any("--json" in a.option_strings for a in p._actions), f"{name}: no --json"


def test_examples_kept_as_written_and_paragraphs_wrapped(monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")
    p = build_parser()
    top = p.format_help()
    assert "  mtplib run --params params/cpu-fixture.yaml        # every notebook" in top
    gen = dict(_parsers(p))["mtplib generate"].format_help()
    assert max(map(len, gen.splitlines())) <= 80  # the description is wrapped


def test_version_names_mtplib_and_the_pins(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    v = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    assert out.startswith(f"mtplib {v}\n")
    assert pins.LLAMA_CPP_PYTHON_VERSION in out and pins.LLAMA_CPP_COMMIT in out


# -- a model whose context_length (512) is below generate's default --ctx (2048) ------------
@pytest.fixture(scope="module")
def short(pair, tmp_path_factory):
    d = tmp_path_factory.mktemp("ctx512")
    trunk = C.set_scalar(pair.trunk, d / "t512.gguf", "deepseek4.context_length", 512)
    side = C.set_scalar(pair.sidecar, d / "mtp-t512.gguf", "deepseek4.context_length", 512)
    return trunk, side


def _cli(*args, cwd=None, timeout=300):
    return subprocess.run([sys.executable, "-m", "mtplib.cli", *map(str, args)],
                          capture_output=True, text=True, timeout=timeout, cwd=cwd)


def test_generate_default_ctx_fits_a_short_model(short, capsys):
    """Done-when of issue 16 (CLI): default options work on a context_length-512 model,
    plain and with MTP."""
    trunk, side = short
    assert main(["generate", "--model", str(trunk), "--tokens", "1,2,3", "--n", "4",
                 "--threads", "1", "--json"]) == 0
    plain = json.loads(capsys.readouterr().out)
    assert len(plain["tokens"]) == 4
    assert main(["generate", "--model", str(trunk), "--mtp", str(side), "--tokens", "1,2,3",
                 "--n", "4", "--threads", "1", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["tokens"] == plain["tokens"]


@pytest.mark.parametrize("mtp", [False, True])
def test_explicit_ctx_beyond_context_length_names_ctx_not_mtp(short, mtp):
    trunk, side = short
    r = _cli("generate", "--model", trunk, *(["--mtp", side] if mtp else []),
             "--tokens", "1,2,3", "--n", "4", "--ctx", "1024", timeout=120)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1, r.stderr
    assert "--ctx 1024 exceeds the model's context_length 512" in lines[0]
    assert "MTP" not in lines[0]


def test_inventory_ctx_capped_and_beyond_said(short, capsys):
    trunk, _ = short
    assert main(["inventory", str(trunk)]) == 0
    cap = capsys.readouterr()
    assert "caches for n_ctx 512," in cap.out and cap.err == ""
    assert main(["inventory", str(trunk), "--ctx", "1024", "--json"]) == 0
    cap = capsys.readouterr()
    notes = json.loads(cap.out)["notes"]
    assert len(notes) == 1 and "exceeds the model's context_length 512" in notes[0]
    assert "note:" in cap.err


# -- errors under --json: one JSON object on stdout, same exit codes -------------------------
def _bad_lane(tmp_path) -> Path:
    p = tmp_path / "typo.yaml"
    p.write_text("lane: t\nfixture: {preset: tiny, seed: 0}\nnotebooks:\n"
                 "  - notebook: 00_fixture_smoke.ipynb\n    parameters: {n_token: 8}\n")
    return p


def _error_cases(short, tmp_path) -> dict[str, tuple[list, int, str]]:
    """verb -> (argv with --json, exit code, text the error must contain)."""
    trunk, _ = short
    lane = _bad_lane(tmp_path)
    return {
        "fixture": (["fixture", "--out", "/proc/mtplib-x", "--json"], 2, "/proc/mtplib-x"),
        "inventory": (["inventory", tmp_path / "none.gguf", "--json"], 2, "not found"),
        "generate": (["generate", "--model", trunk, "--tokens", "1", "--ctx", "4096",
                      "--json"], 2, "context_length 512"),
        "serve": (["serve", "--model", trunk, "--ctx", "4096", "--json"], 2,
                  "context_length 512"),
        "shard": (["shard", "serve", "--endpoint", "8.8.8.8:1", "--json"], 2, "loopback"),
        "tls": (["tls", "init", "/proc/mtplib-x", "--json"], 2, "/proc/mtplib-x"),
        "run": (["run", "--params", lane, "--out", tmp_path / "runs", "--json"], 2,
                "n_token"),
        "bench": (["bench", "--params", lane, "--out", tmp_path / "b", "--json"], 2,
                  "declares no parameter 'n_token'"),
        "evidence": (["evidence", "--run", tmp_path / "none", "--json"], 2,
                     "not a run directory"),
        "info": (["info", "--json", "--no-such-option"], 2, "--no-such-option"),
        "check-hidden": (["check-hidden", tmp_path / "none.gguf", "--json"], 2, "not found"),
        "compare-upstream": (["compare-upstream", "--json"], 2, "--model and --mtp"),
        "layer-cost": (["layer-cost", "--fixtures", tmp_path / "fx", "--out",
                        tmp_path / "lc.json", "--steps", "5", "--json"], 2,
                       "steps must be an int >= 20"),
    }


def test_errors_are_one_json_object_under_json(short, tmp_path):
    cases = _error_cases(short, tmp_path)
    assert set(cases) == set(COMMANDS)
    results = C.run_many([[str(x) for x in argv] for argv, _, _ in cases.values()],
                         timeout=120, workers=2)
    for (verb, (_, code, says)), r in zip(cases.items(), results, strict=True):
        assert r.returncode == code, (verb, r.returncode, r.stdout, r.stderr)
        lines = r.stdout.strip().splitlines()
        assert len(lines) == 1, (verb, r.stdout)
        obj = json.loads(lines[0])
        assert obj["command"] == verb.split()[0] and obj["exit"] == code, (verb, obj)
        assert says in obj["error"] and obj["kind"], (verb, obj)
        assert "Traceback" not in r.stderr, (verb, r.stderr)
    for out in ("runs", "b"):  # the lane typo stopped run and bench before any folder
        assert not (tmp_path / out).exists() or not any((tmp_path / out).iterdir())


def test_usage_errors_plain_and_json(capsys):
    assert main(["generate", "--model", "m.gguf", "--ctx", "abc"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: mtplib generate") and "invalid int value: 'abc'" in err
    assert main(["generate", "--model", "m.gguf", "--ctx", "abc", "--json"]) == 2
    cap = capsys.readouterr()
    obj = json.loads(cap.out)
    assert obj["kind"] == "usage" and obj["command"] == "generate" and cap.err == ""


# -- defaults resolve from the repo; lane typos refused before anything runs ----------------
def test_default_lane_resolves_from_any_directory(tmp_path):
    for verb in ("run", "bench"):
        lane = Path(build_parser().parse_args([verb]).params)
        assert lane.is_absolute() and lane.exists() and lane == paths.DEFAULT_LANE
    # from outside the repo the default lane loads (and alpha then refuses the bench)
    r = _cli("bench", "--policy", "alpha", cwd=tmp_path, timeout=120)
    assert r.returncode == 2 and "refused under policy 'alpha'" in r.stderr, r.stderr
    assert "not found" not in r.stderr and not any(tmp_path.iterdir())


def test_lane_parameter_typo_refused_before_anything_runs(tmp_path):
    lane = _bad_lane(tmp_path)
    r = _cli("run", "--params", lane, "--out", tmp_path / "runs", "--no-progress", timeout=120)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1, r.stderr
    assert "declares no parameter 'n_token'" in lines[0] and r.stdout == ""
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir())


def test_library_mtp_runtime_names_the_context_length_not_mtp(short):
    """The library path too: MTPRuntime with n_ctx above context_length blames n_ctx."""
    from mtplib.runtime.model import RuntimeInputError
    from mtplib.runtime.speculative import MTPRuntime

    trunk, side = short
    with pytest.raises(RuntimeInputError) as e:
        MTPRuntime(str(trunk), str(side), k=2, n_ctx=1024, n_threads=1)
    assert str(e.value).startswith("n_ctx 1024 exceeds the model's context_length 512")


@pytest.mark.parametrize(("argv", "unbuffered"), [
    (["info", "--json"], "1"), (["info", "--json"], ""), (["info"], "1"), (["info"], ""),
    (["--version"], ""), (["run", "--help"], ""),
    (["inventory", "{trunk}", "--mtp", "{sidecar}", "--json"], ""),
    (["generate", "--model", "{trunk}", "--tokens", "1,2,3", "--n", "4", "--json"], "1"),
    # an error under --json: its JSON cannot be written either
    (["generate", "--model", "/no/such.gguf", "--tokens", "1", "--json"], ""),
])
def test_output_to_a_full_device_is_one_line_exit_2(pair, argv, unbuffered):
    """Issue 39 item 4: `mtplib info --json > /dev/full` exited 1 with two chained
    tracebacks. Every command's output now fails alike, buffered or not: one line on
    stderr naming the problem, exit 2, and nothing from Python's flush at exit."""
    import os

    argv = [a.format(trunk=pair.trunk, sidecar=pair.sidecar) for a in argv]
    env = {**os.environ, "PYTHONUNBUFFERED": unbuffered}
    with open("/dev/full", "w") as full:
        r = subprocess.run([sys.executable, "-m", "mtplib.cli", *argv], stdout=full,
                           stderr=subprocess.PIPE, text=True, timeout=120, env=env)
    err = r.stderr.strip().splitlines()
    assert r.returncode == 2, r.stderr
    assert len(err) == 1 and "cannot write the output: No space left on device" in err[0], err
