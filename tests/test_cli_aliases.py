"""Issue 20 item 4: llama.cpp's spellings (-m -md -n -c -t -p, --n-predict --ctx-size
--model-draft --draft-max) next to mtplib's names, and an unknown option that names the
verb and the nearest valid one (also as JSON under --json)."""

from __future__ import annotations

import json

import pytest

from mtplib.cli import build_parser, main

SHORT = ["-m", "T.gguf", "-md", "S.gguf", "-n", "5", "-c", "64", "-t", "1",
         "--draft-max", "2"]
LONG = ["--model", "T.gguf", "--model-draft", "S.gguf", "--n-predict", "5", "--ctx-size",
        "64", "--threads", "1", "--draft", "2"]
OURS = ["--model", "T.gguf", "--mtp", "S.gguf", "--n", "5", "--ctx", "64", "--threads", "1",
        "--draft", "2"]


def _parse(*argv: str):
    return build_parser().parse_args(list(argv))


@pytest.mark.parametrize("verb", ["generate", "serve"])
@pytest.mark.parametrize("spelling", [SHORT, LONG, OURS], ids=["short", "long", "mtplib"])
def test_llama_cpp_spellings_set_the_same_options(verb, spelling):
    a = _parse(verb, *spelling)
    assert (a.model, a.mtp, a.n, a.ctx, a.threads, a.draft) == ("T.gguf", "S.gguf", 5, 64, 1, 2)


def test_prompt_alias_on_generate():
    assert _parse("generate", "-m", "T", "-p", "hello").prompt == "hello"


def test_md_is_not_m_with_a_value():
    """-md is its own option: it never reads as -m with the value "d"."""
    a = _parse("generate", "-md", "S.gguf", "-m", "T.gguf")
    assert (a.model, a.mtp) == ("T.gguf", "S.gguf")
    a = _parse("generate", "-m", "T.gguf")
    assert a.mtp is None
    a = _parse("generate", "-mT.gguf")  # a short option's attached value still works
    assert a.model == "T.gguf" and a.mtp is None


def test_compare_upstream_takes_the_same_spellings():
    a = _parse("compare-upstream", "-m", "T", "-md", "S", "-t", "1", "-c", "128", "-n", "9")
    assert (a.model, a.mtp, a.threads, a.ctx, a.n) == ("T", "S", 1, 128, 9)


def test_help_lists_the_aliases():
    text = " ".join(build_parser()._subparsers._group_actions[0].choices["generate"]
                    .format_help().split())
    for alias in ("-m", "-md", "--model-draft", "--draft-max", "-n", "--n-predict", "-c",
                  "--ctx-size", "-t", "-p"):
        assert f"{alias} " in text or f"{alias}," in text, alias


@pytest.mark.parametrize("argv,verb,near", [
    (["generate", "-m", "T", "--temperature", "1"], "generate", "--temp"),
    (["generate", "--modle", "T"], "generate", "--model"),  # a misspelt required option
    (["generate", "-m", "T", "--mod", "x"], "generate", "--model"),  # no abbreviations
    (["serve", "-m", "T", "--prot", "80"], "serve", "--port"),
    (["serve", "-m", "T", "--n-predcit=4"], "serve", "--n-predict"),
    (["shard", "serve", "--endpoit", "127.0.0.1:1"], "shard serve", "--endpoint"),
])
def test_unknown_option_names_the_verb_and_the_nearest(capsys, argv, verb, near):
    assert main(argv) == 2
    err = capsys.readouterr().err
    bad = argv[-2] if not argv[-1].startswith("-") else argv[-1].split("=")[0]
    assert f"mtplib {verb}: error: unknown option {bad.split('=')[0]}; did you mean {near}?" \
        in err, err


def test_unknown_option_as_json(capsys):
    assert main(["serve", "-m", "T", "--json", "--hots", "0.0.0.0"]) == 2
    out = json.loads(capsys.readouterr().out)
    assert out["command"] == "serve" and out["kind"] == "usage"
    assert out["error"] == "unknown option --hots; did you mean --host?"


def test_far_from_everything_points_to_help(capsys):
    assert main(["generate", "-m", "T", "--zzzzzzzz"]) == 2
    assert "unknown option --zzzzzzzz; see mtplib generate --help" in capsys.readouterr().err


def test_negative_numbers_are_values_not_options(capsys):
    """`--n -5` reaches the check (exit 2 naming --n), not the unknown-option path."""
    assert main(["generate", "-m", "no.gguf", "--tokens", "1", "--n", "-5"]) == 2
    err = capsys.readouterr().err
    assert "--n must be >= 0" in err and "unknown option" not in err
