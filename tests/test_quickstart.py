"""The README's quick start runs as written: its code blocks for path 1 (the evidence lane)
and path 2 (`mtplib serve` on the trained pair, called with the `openai` client) are read
from README.md and executed from the repository root.

Path 1 runs its block with the arguments the README says go to `mtplib run`
(`--out DIR --run-id ID --no-progress`), so the run lands in a temporary folder instead of
`outputs/`; it is the whole default lane (minutes). Path 2 starts the block's `mtplib serve`
on 127.0.0.1 with a free port in place of the README's 8080, runs the client block against
it, and stops the service with SIGTERM. Path 3 needs two hosts and is not run here.

`PYTHONPATH` is this checkout, so a checkout whose `.venv` was made by another one (a git
worktree) runs its own package; on a fresh clone it is the same package either way."""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
README = REPO / "README.md"
LANE_S = 1800  # the default lane on a busy 2-core machine (1 min 45 s on a quiet one)
START_S = 300  # serve: a cold load and warm-up on a busy 2-core machine
STOP_S = 60


def quick_start_path(n: int) -> list[tuple[str, str]]:
    """The fenced code blocks (language, code) of the quick start's subsection `### n. ...`."""
    text = README.read_text()
    start = text.index("\n## Quick start")
    end = text.find("\n## ", start + 1)
    section = text[start:end if end != -1 else None]
    parts = re.split(r"^### ", section, flags=re.M)
    (sub,) = [p for p in parts if p.startswith(f"{n}. ")]
    return re.findall(r"^```(\w*)\n(.*?)^```", sub, flags=re.M | re.S)


def env() -> dict[str, str]:
    e = dict(os.environ)
    e["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), e.get("PYTHONPATH")]))
    return e


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_blocks_are_where_the_tests_read_them():
    (one,) = quick_start_path(1)
    assert one == ("bash", "./dev.sh run\n")
    two = quick_start_path(2)
    assert [lang for lang, _ in two] == ["bash", "python"]
    assert "mtplib serve" in two[0][1] and "--port 8080" in two[0][1]
    assert "from openai import OpenAI" in two[1][1] and ":8080/" in two[1][1]


@pytest.mark.slow
def test_path_1_the_evidence_lane(tmp_path):
    from mtplib.runtime import patched_installed

    if os.environ.get("MTPLIB_SKIP_PATCHED") and not patched_installed():
        pytest.skip("MTPLIB_SKIP_PATCHED and no patched build: the default lane runs ranged "
                    "MTP, which the stock build refuses (docs/wan.md); the quick start's "
                    "set-up builds the patched one")
    (_, code) = quick_start_path(1)[0]
    code = code.replace("./dev.sh run", f"./dev.sh run --out {tmp_path} --run-id quickstart "
                        "--no-progress")
    r = subprocess.run(["bash", "-ec", code], cwd=REPO, env=env(), capture_output=True,
                       text=True, timeout=LANE_S)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    run = tmp_path / "quickstart"
    rec = json.loads((run / "run_record.json").read_text())
    assert rec["status"] == "ok" and rec["lane"] == "cpu-fixture"
    for story in ("DGR-065", "DGR-066"):
        assert (run / "evidence" / story / "README.md").is_file(), story
    lane = (REPO / "params" / "cpu-fixture.yaml").read_text()
    for nb in re.findall(r"notebook: (\S+\.ipynb)", lane):
        assert (run / nb).is_file(), nb


def _gone(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return True
    return False


@pytest.mark.slow
def test_path_2_serve_the_trained_pair_and_call_it_with_openai(tmp_path):
    pytest.importorskip("openai")
    (_, serve), (_, client) = quick_start_path(2)
    port = free_port()
    serve = serve.replace("--port 8080", f"--port {port}")
    client = client.replace(":8080/", f":{port}/")
    log = tmp_path / "serve.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(["bash", "-ec", serve], cwd=REPO, env=env(), stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + START_S
        while f"listening on http://127.0.0.1:{port}" not in log.read_text():
            assert proc.poll() is None, log.read_text()[-4000:]
            assert time.monotonic() < deadline, f"not listening in {START_S} s: " \
                + log.read_text()[-4000:]
            time.sleep(0.5)
        ns: dict = {}
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed), contextlib.chdir(REPO):
            exec(compile(client, "README.md (quick start, path 2)", "exec"), ns)  # noqa: S102
        r = ns["r"]
        timings = r.model_extra["timings"]
        assert r.choices[0].text and timings["predicted_n"] > 0
        assert timings["draft_n"] > 0, timings  # MTP drafted
        assert "draft_n" in printed.getvalue()
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + STOP_S
        while not _gone(proc.pid) and time.monotonic() < deadline:
            proc.poll()
            time.sleep(0.2)
        if not _gone(proc.pid):
            os.killpg(proc.pid, signal.SIGKILL)
            pytest.fail(f"mtplib serve did not stop within {STOP_S} s of SIGTERM")
        proc.wait(10)
    assert re.search(r"^mtplib serve: stopped$", log.read_text(), re.M), log.read_text()[-2000:]
