"""Issue 43 point 3: llama-server's launch line on `mtplib serve`. Every option the pinned
llama-server takes (common/arg.cpp: the server's and the common ones) works, is accepted
with one logged line, or is refused in one line naming mtplib's equivalent; the chat
template options render with upstream's own formats or Jinja; docs/cli.md's table is the
one the parser renders; a copied launch line serves."""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from mtplib.cli import UsageError, build_parser, main
from mtplib.commands.chat_templates import ChatSetting, resolve_chat
from mtplib.commands.llama_server_args import (
    TABLE_BEGIN,
    classify,
    note_noop_flags,
    render_table,
    table_in,
)
from mtplib.commands.llama_server_flags import FLAGS, NOOP, REFUSED, SERVE_ALIASES, WORKS
from mtplib.errors import InputError

sys.path.insert(0, str(Path(__file__).parent))
from llama_arg_table import (  # noqa: E402
    ARG_CPP,
    LLAMA_CHAT_CPP,
    builtin_chat_templates,
    options,
    vendor_file,
)

REPO = Path(__file__).resolve().parent.parent
#: the flags the issue names, as a llama-server user writes them
ISSUE_LINE = ["--jinja", "--no-jinja", "--metrics", "--slots", "--no-slots", "--cont-batching",
              "--context-shift", "--no-context-shift", "--chat-template", "chatml",
              "--cache-reuse", "256", "--threads-http", "4", "--timeout", "600", "--no-webui",
              "--kv-unified", "--ctx-checkpoints", "8", "--reasoning-format", "none",
              "--swa-full"]


@pytest.fixture(scope="module")
def serve_parser() -> argparse.ArgumentParser:
    return build_parser()._subparsers._group_actions[0].choices["serve"]


def _values(flag) -> list[str]:
    return [] if flag.value is None else ["1"] * len(flag.value.split())


# -- the table against the pinned arg.cpp ---------------------------------------------------
def test_every_llama_server_option_of_the_pin_is_classified(serve_parser):
    src = vendor_file(ARG_CPP)
    if src is None:
        pytest.skip("the pinned sdist is not here")
    upstream = options(src, "SERVER")
    ours = {s: f.value is not None for f in FLAGS for s in f.spellings}
    assert set(upstream) - set(ours) == set(), "llama-server options missing from FLAGS"
    assert set(ours) - set(upstream) == set(), "FLAGS spellings llama-server does not take"
    assert {s for s in upstream if upstream[s] != ours[s]} == set(), "value or bare flag"
    kinds = {s: classify(serve_parser, s) for s in upstream}
    assert [s for s, k in kinds.items() if k is None] == []
    counts = {k: sum(1 for v in kinds.values() if v[0] == k) for k in (WORKS, NOOP, REFUSED)}
    assert all(counts.values()) and sum(counts.values()) == len(upstream) > 300, counts


def test_the_table_is_whole_and_its_works_are_serve_options(serve_parser):
    """Without the sdist too: each spelling once; a WORKS entry names options the parser
    really has (none registered here as a no-op or a refusal); every spelling is one of
    the three kinds on the parser."""
    spellings = [s for f in FLAGS for s in f.spellings]
    assert len(spellings) == len(set(spellings))
    for f in FLAGS:
        for s in f.spellings:
            kind, why = classify(serve_parser, s)
            assert kind in (WORKS, NOOP, REFUSED) and why, s
            if f.kind == WORKS:
                assert kind == WORKS, s
            elif kind != WORKS:  # unless serve took the option itself (e.g. --draft-p-min)
                assert (kind, why) == (f.kind, f.why), s
    for alias, target in SERVE_ALIASES.items():
        assert (serve_parser._option_string_actions[alias].dest
                == serve_parser._option_string_actions[target].dest), alias


# -- what each kind does ----------------------------------------------------------------------
def test_the_issues_launch_line_parses(serve_parser):
    a = serve_parser.parse_args(["-m", "T.gguf", *ISSUE_LINE])
    assert (a.jinja, a.chat_template, a.swa_full) == (False, "chatml", "on")
    assert a.header_timeout == a.body_timeout == 600
    noted = set(a.llama_noop)
    assert noted == {"--metrics", "--slots", "--no-slots", "--cont-batching",
                     "--context-shift", "--no-context-shift", "--cache-reuse",
                     "--threads-http", "--no-webui", "--kv-unified", "--ctx-checkpoints",
                     "--reasoning-format"}


def test_every_noop_flag_logs_one_line_saying_why(serve_parser, caplog):
    noops = [(s, f) for f in FLAGS for s in f.spellings
             if classify(serve_parser, s)[0] == NOOP]
    argv = ["-m", "T.gguf"]
    for s, f in noops:
        argv += [s, *_values(f)]
    a = serve_parser.parse_args(argv + ["--metrics"])  # given twice: one line
    with caplog.at_level(logging.WARNING, logger="mtplib.serve"):
        note_noop_flags(a)
    lines = [r.getMessage() for r in caplog.records if r.name == "mtplib.serve"]
    assert len(lines) == len(noops) > 40
    for (s, f), line in zip(noops, lines, strict=True):
        shown = " ".join([s, *_values(f)])
        assert line == f"mtplib serve: note: {shown} changes nothing: {f.why}"


def test_every_refused_flag_is_one_line_naming_the_equivalent(serve_parser):
    refused = [(s, f) for f in FLAGS for s in f.spellings
               if classify(serve_parser, s)[0] == REFUSED]
    assert len(refused) > 100
    for s, f in refused:
        for argv in ([s, *_values(f)], [s]):  # with its value, and without (at the end)
            with pytest.raises(UsageError) as e:
                serve_parser.parse_args(["-m", "T.gguf", *argv])
            assert e.value.message == f"{s} is refused: {f.why}", argv


def test_a_refusal_through_main_is_one_line_also_as_json(capsys):
    assert main(["serve", "-m", "T.gguf", "--top-k", "40", "-np", "4"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("mtplib serve: error: --top-k is refused: the launch line sets "
                          "only the defaults") and "give top_k in each request" in err
    assert main(["serve", "-m", "T.gguf", "--json", "-hf", "org/model"]) == 2
    out = json.loads(capsys.readouterr().out)
    assert out["kind"] == "usage" and "give -m/--model PATH" in out["error"]


def test_llama_server_spellings_of_serve_options(serve_parser, tmp_path, capsys):
    a = serve_parser.parse_args(
        ["-m", "T", "-s", "3", "--temperature", "0.5", "-a", "name", "-v", "--predict", "7",
         "--spec-draft-model", "S", "--draft-n", "2", "-to", "60", "--header-timeout", "5"])
    assert (a.seed, a.temp, a.alias, a.verbose, a.n, a.mtp, a.draft) == (
        3, 0.5, "name", True, 7, "S", 2)
    assert (a.header_timeout, a.body_timeout) == (5, 60)  # the later one wins
    assert serve_parser.parse_args(["-m", "T", "--log-verbose"]).verbose is True
    assert serve_parser.parse_args(["-m", "T"]).swa_full == "on"
    assert serve_parser.parse_args(["-m", "T", "--swa-full", "off"]).swa_full == "off"
    assert serve_parser.parse_args(["-m", "T", "--swa-full", "-c", "64"]).swa_full == "on"
    with pytest.raises(SystemExit) as e:
        serve_parser.parse_args(["--usage"])
    assert e.value.code == 0 and "--chat-template" in capsys.readouterr().out


def test_api_key_file(serve_parser, tmp_path):
    f = tmp_path / "keys"
    f.write_text("# the service's key\n\n  sekret  \n")
    assert serve_parser.parse_args(["-m", "T", "--api-key-file", str(f)]).api_key == "sekret"
    f.write_text("one\ntwo\n")
    with pytest.raises(UsageError, match="holds 2 keys: mtplib serve takes exactly one"):
        serve_parser.parse_args(["-m", "T", "--api-key-file", str(f)])
    with pytest.raises(UsageError, match="cannot read --api-key-file .*: No such file"):
        serve_parser.parse_args(["-m", "T", "--api-key-file", str(tmp_path / "none")])


# -- chat templates -----------------------------------------------------------------------------
def _chat(*argv: str, model: str | None = None) -> ChatSetting:
    a = build_parser().parse_args(["serve", "-m", "T", *argv])
    return resolve_chat(a, model)


MSGS = [{"role": "system", "content": "S"}, {"role": "user", "content": "hi"}]
LLAMA3 = ("<|start_header_id|>system<|end_header_id|>\n\nS<|eot_id|><|start_header_id|>user"
          "<|end_header_id|>\n\nhi<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n")


def test_builtin_names_are_upstreams():
    from mtplib.runtime.chat_format import builtin_templates

    names = set(builtin_templates())
    src = vendor_file(LLAMA_CHAT_CPP)
    if src is not None:
        assert names == builtin_chat_templates(src)
    assert {"chatml", "llama3", "deepseek3"} <= names


def test_a_builtin_name_renders_upstreams_format():
    c = _chat("--chat-template", "llama3")
    assert c.template == "llama3" and c.format(MSGS) == LLAMA3
    c = _chat("--chat-template", "chatml", model="{{ 'the model' }}")
    assert c.format(MSGS).endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")


def test_a_jinja_template_and_file(tmp_path):
    src = "{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}>"
    assert _chat("--chat-template", src) == ChatSetting(src)
    f = tmp_path / "t.jinja"
    f.write_text(src)
    assert _chat("--chat-template-file", str(f)) == ChatSetting(src)
    assert _chat(model=src) == ChatSetting(src)  # the model's own, unchanged
    assert _chat() == ChatSetting(None)  # ChatML, as before


@pytest.mark.parametrize("argv,model,msg", [
    (["--chat-template", "lama3"], None, "'lama3' is neither one of upstream's built-in "
     "names (bailing"),
    (["--chat-template", "{% for %}"], None, "--chat-template is not a Jinja chat template "
     "that renders one user message: "),
    (["--chat-template", "{{ raise_exception('no') }}"], None, "the template raised: no"),
    (["--chat-template", " "], None, "--chat-template is empty"),
    (["--chat-template", "chatml", "--chat-template-file", "x"], None, "contradict"),
    (["--chat-template-file", "/no/such.jinja"], None,
     "cannot read --chat-template-file /no/such.jinja: No such file"),
    (["--no-jinja"], "{{ messages }}", "the model's tokenizer.chat_template: upstream's "
     "built-in chat formats do not recognise it"),
    (["--no-jinja", "--chat-template", "{{ x }}"], None, "do not recognise it"),
])
def test_a_template_that_cannot_serve_is_one_line(argv, model, msg):
    with pytest.raises(InputError) as e:
        _chat(*argv, model=model)
    assert msg in str(e.value) and "\n" not in str(e.value)


def test_no_jinja_uses_upstreams_formats():
    assert _chat("--no-jinja") == ChatSetting(None)  # no template: ChatML, as llama-server
    c = _chat("--no-jinja", model="{% for m in messages %}<|im_start|>{{ m }}{% endfor %}")
    assert c.format is not None and c.format(MSGS).startswith("<|im_start|>system\nS")


def test_a_nul_is_refused_not_cut():
    from mtplib.runtime.chat_format import ChatFormatError, apply_template

    with pytest.raises(ChatFormatError, match="message 1 content contains a NUL"):
        apply_template("llama3", [MSGS[0], {"role": "user", "content": "a\x00b"}])


# -- docs ----------------------------------------------------------------------------------------
def test_docs_table_is_the_rendered_one(serve_parser):
    doc = (REPO / "docs" / "cli.md").read_text()
    assert TABLE_BEGIN in doc
    assert table_in(doc) == render_table(serve_parser), (
        "regenerate: .venv/bin/python -c \"from pathlib import Path; from mtplib.cli import "
        "build_parser; from mtplib.commands.llama_server_args import write_table; "
        "write_table(build_parser()._subparsers._group_actions[0].choices['serve'], "
        "Path('docs/cli.md'))\"")


# -- a copied launch line serves --------------------------------------------------------------
def _get(url: str, body: dict | None = None) -> tuple[int, dict]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return r.status, json.loads(r.read())


def test_a_llama_server_launch_line_serves(pair, tmp_path):
    """`--jinja -np 4 --metrics --slots -fa on -c 2048` (and a built-in template): the
    notes are logged, /health and a short completion answer, SIGTERM stops it (exit 0)."""
    err = tmp_path / "stderr"
    cmd = [sys.executable, "-m", "mtplib.cli", "serve", "-m", str(pair.trunk), "--jinja",
           "-np", "4", "--metrics", "--slots", "-fa", "on", "-c", "2048", "-t", "1",
           "--chat-template", "llama3", "--port", "0", "--json"]
    with err.open("w") as e:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=e, text=True,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        line = proc.stdout.readline()  # the listening line (or nothing: it failed)
        assert line, err.read_text()
        ready = json.loads(line)
        url = ready["listening"]
        assert ready["parallel"] == 4 and ready["n_ctx"] == 512  # 2048 over 4 slots
        assert _get(url + "/health")[0] == 200
        status, out = _get(url + "/v1/completions",
                           {"prompt": [1, 2, 3], "max_tokens": 3, "ignore_eos": True})
        assert status == 200 and out["usage"]["completion_tokens"] == 3
        _, tmpl = _get(url + "/apply-template",
                       {"messages": [{"role": "system", "content": "S"},
                                     {"role": "user", "content": "hi"}]})
        assert tmpl["prompt"] == LLAMA3
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        try:
            code = proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            code = proc.wait(10)
    log = err.read_text()
    assert code == 0, log
    assert "mtplib serve: note: --metrics changes nothing: /metrics is always served" in log
    assert "mtplib serve: note: --slots changes nothing: /slots is always served" in log
