"""Corpus items of issue 15: inputs checked before long work, file-system errors on paths the
user gave as one line (exit 2), never a traceback."""

import subprocess
import sys

import pytest


@pytest.mark.parametrize("argv, says", [
    (["compare-upstream", "--model", "/no/such.gguf", "--mtp", "/no/mtp.gguf", "--out",
      "/tmp/never.json"], "not found"),  # before the 9-minute build of upstream's tools
    (["fixture", "--out", "/proc/mtplib-x"], "/proc/mtplib-x"),
])
def test_bad_paths_are_one_line_errors(argv, says):
    r = subprocess.run([sys.executable, "-m", "mtplib.cli", *argv], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr and says in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("tokens, says", [
    ("1,,2", "element 2 is empty"), ("1,", "element 2 is empty"),
    (",1", "element 1 is empty"), ("1, x", "'x' is not an integer"),
    ("1 2", "'1 2' is not an integer"), ("", "--tokens is empty"),
])
def test_a_malformed_token_list_is_one_line_exit_2(capsys, tokens, says):
    """Issue 39 item 11d: "1,,2" was read as [1, 2]; every malformed list is refused in
    one line, before the model is opened (it does not exist here)."""
    from mtplib.cli import main

    assert main(["generate", "--model", "/no/such.gguf", "--tokens", tokens]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and says in err[0] and "--tokens" in err[0], err


def test_the_other_comma_lists_refuse_an_empty_element(capsys):
    import argparse

    from mtplib.cli import main
    from mtplib.commands.common import parse_tokens
    from mtplib.commands.generate import endpoints
    from mtplib.errors import InputError

    assert parse_tokens(" 1, 2 ,3") == [1, 2, 3]
    with pytest.raises(InputError, match="--endpoints .* element 2 is empty"):
        endpoints(argparse.Namespace(endpoints="127.0.0.1:1,,127.0.0.1:2"))
    assert endpoints(argparse.Namespace(endpoints="h:1, h:2")) == ["h:1", "h:2"]
    assert main(["generate", "--model", "/no/such.gguf", "--tokens", "1",
                 "--spec-type", "none,"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--spec-type 'none,': element 2 is empty" in err[0], err
    assert main(["compare-upstream", "--k", "1,,2"]) == 2  # an argparse type: usage error
    assert "--k '1,,2': element 2 is empty" in capsys.readouterr().err
