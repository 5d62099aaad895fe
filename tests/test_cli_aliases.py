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


# -- issue 30 item 5: the rest of llama.cpp's spellings ----------------------------------
def _usage_error(*argv: str) -> str:
    """The message argparse (mtplib's Parser) refuses ``argv`` with."""
    from mtplib.cli import UsageError

    with pytest.raises(UsageError) as e:
        build_parser().parse_args(list(argv))
    return e.value.message


@pytest.mark.parametrize("verb", ["generate", "serve"])
def test_llama_cpp_spellings_of_batch_flash_attn_rpc_and_draft(verb):
    a = _parse(verb, "-m", "T", "-b", "64", "-ub", "32", "-fa", "off", "--rpc",
               "127.0.0.1:1,127.0.0.1:2", "--spec-draft-n-max", "2")
    assert (a.batch, a.ubatch, a.flash_attn, a.endpoints, a.draft) == (
        64, 32, "off", "127.0.0.1:1,127.0.0.1:2", 2)
    a = _parse(verb, "-m", "T", "--batch-size", "16", "--ubatch-size", "8")
    assert (a.batch, a.ubatch) == (16, 8)


@pytest.mark.parametrize("verb", ["generate", "serve"])
def test_multi_letter_short_options_are_not_split(verb):
    """-ngl, -ctk, -ctv, -tb are their own options: never -n gl, -c tk, -t b."""
    a = _parse(verb, "-m", "T", "-ngl", "99", "-ctk", "q8_0", "-ctv", "q8_0", "-tb", "1")
    assert (a.n_gpu_layers, a.cache_type_k, a.cache_type_v, a.threads_batch) == (
        "99", "q8_0", "q8_0", 1)
    assert a.n == 32 and a.ctx is None and a.threads is None  # untouched


def _leaf_parsers():
    import argparse

    def walk(p):
        for act in p._actions:
            if isinstance(act, argparse._SubParsersAction):
                for sp in act.choices.values():
                    if sp.get_default("fn") is not None:
                        yield sp
                    yield from walk(sp)

    return list(walk(build_parser()))


def test_every_llama_short_spelling_is_an_option_or_refused_by_name():
    """No verb ever reads a llama.cpp multi-letter short option as a short option of its
    own plus a value: it is the verb's option, or refused naming it (and llama.cpp)."""
    from mtplib.cli import UsageError
    from mtplib.commands.common import LLAMA_SHORT_SPELLINGS

    checked = 0
    for p in _leaf_parsers():
        for flag in sorted(LLAMA_SHORT_SPELLINGS):
            if flag in p._option_string_actions:
                continue
            with pytest.raises(UsageError) as e:
                p.parse_args([flag, "1"])
            assert e.value.message.startswith(f"{flag} is "), (p.prog, flag, e.value.message)
            assert "llama" in e.value.message or "mtplib" in e.value.message
            checked += 1
    assert checked > 1000


def test_llama_spelling_on_a_verb_without_it_names_where_it_is(capsys):
    assert main(["generate", "-m", "T", "--tokens", "1", "-np", "4"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err == ("mtplib generate: error: -np is not an option of mtplib generate: "
                   "llama-server's slots; mtplib serve takes -np/--parallel")
    msg = _usage_error("bench", "--spec-type", "draft-mtp")
    assert "did you mean" not in msg and "--spec-type draft-mtp" in msg
    msg = _usage_error("shard", "serve", "--endpoint", "127.0.0.1:1", "--rpc", "x")
    assert "--trace" not in msg and "--rpc/--endpoints" in msg


def test_an_attached_value_of_a_multi_letter_option_is_refused_by_name():
    assert _usage_error("serve", "-m", "T", "-np4").endswith("write -np 4")
    assert _usage_error("generate", "-m", "T", "-ngl99").endswith("write -ngl 99")
    assert _parse("generate", "-m", "T", "-n5", "-c64").n == 5  # one-letter ones still work


def _checked(pair, *argv: str):
    """The arguments after `check_engine_args`, which also builds their run request (so
    the files must be real: ``S.gguf`` stands for the pair's sidecar)."""
    from mtplib.commands.generate import check_engine_args

    argv = tuple(str(pair.sidecar) if x == "S.gguf" else x for x in argv)
    a = _parse("generate", "-m", str(pair.trunk), "--tokens", "1", "-t", "1", *argv)
    check_engine_args(a)
    return a


def _refused(capsys, *argv: str, model: str = "no-such.gguf") -> str:
    assert main(["generate", "-m", model, "--tokens", "1", "-t", "1", *argv]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    return lines[0]


def test_cache_types_map_onto_kv_type_or_are_refused(pair, capsys):
    assert _checked(pair, "-ctk", "q8_0", "-ctv", "q8_0").kv_type == "q8_0"
    assert _checked(pair, "-ctk", "f16").kv_type == "f16"  # -ctv defaults to f16, as upstream's
    assert "mtplib's K and V caches share one type" in _refused(capsys, "-ctk", "q8_0")
    assert "contradicts" in _refused(capsys, "--kv-type", "bf16", "-ctk", "q8_0", "-ctv",
                                     "q8_0")


def test_threads_batch_only_as_threads(pair, capsys):
    assert _checked(pair, "-tb", "1").threads == 1
    line = _refused(capsys, "-tb", "2")
    assert "-tb/--threads-batch 2" in line and "give -t 2" in line


def test_spec_type(pair, capsys):
    assert _checked(pair, "--spec-type", "draft-mtp", "-md", "S.gguf").mtp == str(pair.sidecar)
    assert _checked(pair, "--spec-type", "none").mtp is None
    assert "needs -md/--mtp SIDECAR" in _refused(capsys, "--spec-type", "draft-mtp")
    assert "contradicts -md/--mtp" in _refused(capsys, "--spec-type", "none", "-md", "S")
    assert "only with the model's MTP block" in _refused(capsys, "--spec-type", "ngram-mod",
                                                         "-md", "S")


def test_draft_min_is_a_note_up_to_draft(pair, capsys):
    _checked(pair, "-md", "S.gguf", "--draft", "2", "--draft-min", "2")
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["mtplib generate: note: --draft-min 2 changes nothing: mtplib's MTP "
                   "drafts --draft 2 tokens every step (fewer only at the end of the "
                   "context)"]
    # checked against the run request's draft length: after the files are read
    assert "--draft-min must be in 0..--draft (2)" in _refused(
        capsys, "-md", str(pair.sidecar), "--draft", "2", "--draft-min", "3",
        model=str(pair.trunk))
    assert "needs -md/--mtp" in _refused(capsys, "--draft-min", "1")


def test_n_gpu_layers_is_a_one_line_note(pair, capsys):
    from mtplib.runtime.devices import gpu_devices

    _checked(pair, "-ngl", "99")
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("mtplib generate: note: -ngl 99 changes "
                                               "nothing: ")
    if not gpu_devices():  # the CPU build: says so
        assert err[0].endswith("this llama.cpp build has no GPU device: every layer runs on "
                               "the CPU")
    _checked(pair, "--n-gpu-layers", "all", "--plan", "0-1,2-3")
    assert "the shards --plan names" in capsys.readouterr().err
    assert "takes a number >= -1, auto or all" in _refused(capsys, "-ngl", "lots")


@pytest.mark.parametrize("value,want", [("1", 1), ("-1", 1), ("2", 2), ("4", 4),
                                        ("256", 256), ("0", None), ("257", None),
                                        ("-2", None)])
def test_parallel_range(capsys, value, want):
    from mtplib.commands.serve import check_parallel

    if want is not None:
        a = _parse("serve", "-m", "T", "-np", value)
        check_parallel(a)
        assert a.parallel == want
        return
    assert main(["serve", "-m", "no-such.gguf", "--parallel", value]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1
    assert "--parallel must be in 1..256 (or -1: auto)" in lines[0]


def test_serve_help_lists_the_new_spellings():
    text = " ".join(build_parser()._subparsers._group_actions[0].choices["serve"]
                    .format_help().split())
    for alias in ("-np", "--parallel", "-ngl", "--n-gpu-layers", "-fa", "-b", "-ub", "-ctk",
                  "-ctv", "--draft-min", "--spec-type", "-tb", "--rpc"):
        assert f"{alias} " in text or f"{alias}," in text, alias


def test_the_short_spellings_are_those_of_the_pinned_llama_cpp():
    """LLAMA_SHORT_SPELLINGS is every one-dash multi-letter option of the pinned
    common/arg.cpp (read from the sdist where it is here)."""
    import re
    import tarfile

    from mtplib.commands.common import LLAMA_SHORT_SPELLINGS
    from mtplib.lab.upstream_tools import sdist_candidates

    sdist = next((p for p in sdist_candidates() if p.is_file()), None)
    if sdist is None:
        pytest.skip("the pinned sdist is not here")
    with tarfile.open(sdist) as t:
        member = next(m for m in t.getmembers()
                      if m.name.endswith("vendor/llama.cpp/common/arg.cpp"))
        src = t.extractfile(member).read().decode()
    opts = set()
    for m in re.finditer(r'\{(\s*"-[^"]*"(?:\s*,\s*"-[^"]*")*\s*)\}', src):
        opts.update(re.findall(r'"(-[^"]+)"', m.group(1)))
    assert {o for o in opts if not o.startswith("--") and len(o) > 2} == LLAMA_SHORT_SPELLINGS
