"""Issue 22, item 4: crash, data-loss and silent-wrong-output defects, one test each.

Library calls that used to crash the process run in a child process, so a regression
kills the child (and fails the test) rather than the test run.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import threading

import pytest

from mtplib.lab.correctness import seeded_prompt
from mtplib.runtime.model import RuntimeInputError, check_n_new, check_tokens

PROMPT = seeded_prompt(7, 10)


def _child(script: str, *args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(script), *args],
                          capture_output=True, text=True, timeout=timeout)


# -- closed runtime ------------------------------------------------------------------------
CLOSED = """
    import json, sys
    from mtplib.errors import InputError
    from mtplib.runtime.speculative import MTPRuntime

    rt = MTPRuntime(sys.argv[1], sys.argv[2], k=2, n_ctx=256, n_threads=1)
    before = rt.memory()["target_seq_state_bytes"] >= 0
    rt.close()
    rt.close()  # idempotent
    out = {"before": before}
    for name, fn in (("memory", rt.memory), ("memory(1)", lambda: rt.memory(1)),
                     ("generate", lambda: rt.generate([1, 2, 3], 2))):
        try:
            fn()
            out[name] = "accepted"
        except InputError as e:
            out[name] = "ok: " + str(e)
    print(json.dumps(out))
"""


def test_closed_runtime_memory_raises_not_segfaults(pair):
    """memory() after close() read a freed context (rc 139): now a clear error."""
    r = _child(CLOSED, str(pair.trunk), str(pair.sidecar))
    assert r.returncode == 0, (r.returncode, r.stderr[-2000:])
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["before"] is True
    for name in ("memory", "memory(1)", "generate"):
        assert out[name].startswith("ok: ") and "closed" in out[name], (name, out[name])


# -- threads on one runtime ------------------------------------------------------------------
THREADS = """
    import json, sys, threading, time
    from mtplib.runtime import model as M
    from mtplib.runtime.speculative import MTPRuntime

    # count the threads inside upstream's decode at once (a short sleep widens the window)
    inside, peak, guard, decode = [0], [0], threading.Lock(), M.Context.decode

    def counted(self, *a, **kw):
        with guard:
            inside[0] += 1
            peak[0] = max(peak[0], inside[0])
        try:
            time.sleep(0.0005)
            return decode(self, *a, **kw)
        finally:
            with guard:
                inside[0] -= 1

    M.Context.decode = counted
    prompts = [[1 + i, 5, 9, 2 + i, 7] for i in range(4)]
    with MTPRuntime(sys.argv[1], sys.argv[2], k=2, n_seq_max=2, n_ctx=256,
                    n_threads=1) as rt:
        want = [rt.generate(p, 12)[0] for p in prompts]
        got, errors = {}, []

        def work(i):
            try:
                for _ in range(3):
                    got.setdefault(i, []).append(rt.generate(prompts[i], 12)[0])
            except BaseException as e:  # noqa: BLE001
                errors.append(repr(e))

        ts = [threading.Thread(target=work, args=(i,)) for i in range(4)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
    print(json.dumps({"equal": all(g == [want[i]] * 3 for i, g in got.items()),
                      "n": sum(len(g) for g in got.values()), "errors": errors,
                      "most_threads_in_decode": peak[0]}))
"""


def test_concurrent_generate_on_one_runtime_is_serialized(pair):
    """4 threads x 3 generations on one MTPRuntime (n_seq_max 2) crashed the process in 11
    of 12 runs (SIGSEGV / SIGABRT) where the reporter ran them: the runtime's lock
    serializes them (never two threads inside upstream's decode at once), and each result
    equals the same generation run alone."""
    r = _child(THREADS, str(pair.trunk), str(pair.sidecar))
    assert r.returncode == 0, (r.returncode, r.stderr[-2000:])
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out == {"equal": True, "n": 12, "errors": [], "most_threads_in_decode": 1}


# -- n_new and token ids -----------------------------------------------------------------
def test_check_n_new_and_tokens():
    assert check_n_new(0) == 0 and check_n_new(5) == 5
    for bad in (-3, -1, 1.0, 2.5, True, "3", None):
        with pytest.raises(RuntimeInputError, match="n_new"):
            check_n_new(bad)
    assert check_tokens([1, 2], 10) == [1, 2]
    for bad, msg in (([1, 2.0], "not an integer"), ([1.5], "not an integer"),
                     ([True], "not an integer"), ([10], "out of range"), ([-1], "out of range"),
                     ("123", "sequence"), (5, "sequence")):
        with pytest.raises(RuntimeInputError, match=msg):
            check_tokens(bad, 10)


@pytest.fixture(scope="module")
def mtp_runtime(pair):
    from mtplib.runtime.speculative import MTPRuntime

    with MTPRuntime(str(pair.trunk), str(pair.sidecar), k=2, n_ctx=256, n_threads=1) as rt:
        yield rt


@pytest.mark.parametrize("k", [0, 2])
def test_n_zero_generates_nothing(pair, mtp_runtime, k):
    """n_new 0 used to emit the prefill's first token (whole, MTP on and off)."""
    from mtplib.runtime.speculative import MTPRuntime

    if k:
        toks, m = mtp_runtime.generate(PROMPT, 0)
    else:
        with MTPRuntime(str(pair.trunk), k=0, n_ctx=256, n_threads=1) as rt:
            toks, m = rt.generate(PROMPT, 0)
    assert toks == [] and m.n_generated == 0 and m.n_prompt == len(PROMPT)
    assert m.memory and m.routing
    assert len(mtp_runtime.generate(PROMPT, 1)[0]) == 1  # one is still one


@pytest.mark.parametrize("prompt, n_new, msg", [
    (PROMPT, -3, "n_new"), (PROMPT, 2.0, "n_new"), ([1, 2.5, 3], 2, "not an integer"),
    ([1.0, 2.0], 2, "not an integer"), ([1, 10**6], 2, "out of range"), ([], 2, "empty")])
def test_generate_refuses_bad_arguments(mtp_runtime, prompt, n_new, msg):
    with pytest.raises(RuntimeInputError, match=msg):
        mtp_runtime.generate(prompt, n_new)


def test_decode_refuses_float_token_ids(mtp_runtime):
    with pytest.raises(RuntimeInputError, match="not an integer"):
        mtp_runtime.target.decode([1, 2.5], [0, 1])


def test_cli_n_zero_prints_no_tokens(pair):
    r = subprocess.run([sys.executable, "-m", "mtplib.cli", "generate", "--model",
                        str(pair.trunk), "--mtp", str(pair.sidecar), "--tokens", "1,2,3",
                        "--n", "0", "--ctx", "256", "--json"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert json.loads(r.stdout)["tokens"] == []


# -- --ctx below upstream's padding ------------------------------------------------------
def test_ctx_is_honoured_below_upstream_padding(pair):
    """Upstream pads n_ctx to a multiple of 256; a context asked for 64 bounds positions at
    64 (it silently held 256 before)."""
    from mtplib.runtime.speculative import MTPRuntime

    with MTPRuntime(str(pair.trunk), k=0, n_ctx=64, n_threads=1) as rt:
        assert rt.target.n_ctx == 64 and rt.target.n_ctx_upstream == 256
        assert len(rt.generate(PROMPT, 64 - len(PROMPT))[0]) == 64 - len(PROMPT)
        with pytest.raises(RuntimeInputError, match="context of 64"):
            rt.generate(PROMPT, 64 - len(PROMPT) + 1)
        with pytest.raises(RuntimeInputError, match="outside the context"):
            rt.target.decode([1], [64])


def test_ctx_per_sequence_with_several_sequences(pair):
    """n_seq_max 2 splits the cache: one sequence holds n_ctx_seq positions, refused up
    front instead of failing mid-generation ("no KV slot")."""
    from mtplib.runtime.speculative import MTPRuntime

    with MTPRuntime(str(pair.trunk), k=0, n_seq_max=2, n_ctx=512, n_threads=1) as rt:
        assert rt.target.n_ctx == rt.target.n_ctx_seq == 256
        with pytest.raises(RuntimeInputError, match="context of 256"):
            rt.generate([1, 2, 3], 400)
        assert len(rt.generate([1, 2, 3], 253)[0]) == 253


def test_cli_ctx_64_refuses_what_does_not_fit(pair):
    r = subprocess.run([sys.executable, "-m", "mtplib.cli", "generate", "--model",
                        str(pair.trunk), "--tokens", "1,2,3", "--n", "100", "--ctx", "64"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "context of 64" in r.stderr, r.stderr[-2000:]
    assert "Traceback" not in r.stderr


# -- ranged --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def ranged(pair):
    from mtplib.distributed.ranged_mtp import RangedMTP

    # a generous silence limit: on a loaded 2-core machine a step can stall past 15 s
    with RangedMTP(str(pair.trunk), plan="0-1,2-3", sidecar=str(pair.sidecar),
                   silence_timeout_s=120) as r:
        yield r


def test_ranged_n_zero_and_bad_arguments(ranged):
    from mtplib.runtime.engine_options import EngineOptions

    toks, m = ranged.generate(PROMPT, 0, EngineOptions(k=2))
    assert toks == [] and m.n_generated == 0
    for prompt, n_new, msg in ((PROMPT, -3, "n_new"), ([1, 2.5], 2, "not an integer"),
                               ([1, 10**6], 2, "out of range")):
        with pytest.raises(RuntimeInputError, match=msg):
            ranged.generate(prompt, n_new, EngineOptions(k=2))


def test_ranged_threads_count_their_own_seam_bytes(ranged):
    """Two threads on one RangedMTP counted each other's traffic (seam_bytes doubled):
    generations are serialized from reset_counts to the metrics."""
    from mtplib.runtime.engine_options import EngineOptions

    opts = EngineOptions(k=0)
    # the first prefill of a prompt length asks the shards for its new shapes' allocation
    # sizes (bytes of its own); compare generations that all find them cached
    ranged.generate(PROMPT, 6, opts)
    alone = _non_graph_bytes(ranged.generate(PROMPT, 6, opts)[1])
    results: list = []
    ts = [threading.Thread(target=lambda: results.append(ranged.generate(PROMPT, 6, opts)))
          for _ in range(2)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert len(results) == 2
    for toks, m in results:
        assert len(toks) == 6
        # the same generation alone moves the same bytes, give or take a little protocol noise
        assert abs(_non_graph_bytes(m) - alone) <= 0.1 * alone, (_non_graph_bytes(m), alone)


def _non_graph_bytes(m) -> int:
    """A generation's bytes without graph descriptions: with graph slots (patches/0006) a
    later generation may send a rebuilt graph whole once (evidence/graph-reuse/README.md), so
    two identical generations differ by whole graphs; a doubled count doubles these too."""
    return sum(r["bytes"] - r["graph"] for lab, r in m.seam_report["steps"].items()
               if lab not in ("load", "other"))


def test_ranged_closed_raises(pair):
    from mtplib.distributed.ranged_mtp import RangedMTP

    r = RangedMTP(str(pair.trunk), plan="0-1,2-3", silence_timeout_s=120)
    r.close()
    with pytest.raises(RuntimeInputError, match="closed"):
        r.generate(PROMPT, 2)


# -- shard serve --json: stdout is JSON only ----------------------------------------------
def test_shard_serve_json_stdout_is_only_json(tmp_path):
    """Upstream printf()s its banner to stdout: under --json it preceded the JSON error (a
    taken port, exit 4, now listed in --help)."""
    import os
    import socket
    import time

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        out, err = tmp_path / "out", tmp_path / "err"
        with out.open("w") as o, err.open("w") as e:  # files: C stdio buffers them fully
            r = subprocess.run([sys.executable, "-m", "mtplib.cli", "shard", "serve",
                                "--endpoint", f"127.0.0.1:{port}", "--json"],
                               stdout=o, stderr=e, timeout=120, env={**os.environ})
    assert r.returncode == 4
    lines = out.read_text().splitlines()
    assert len(lines) == 1, lines
    assert json.loads(lines[0])["exit"] == 4
    # the port is taken before upstream starts (the shard's front binds ENDPOINT, issue 39
    # item 7): upstream's banner, from a shard that serves, goes to stderr, never stdout
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    with out.open("w") as o, err.open("w") as e:
        p = subprocess.Popen([sys.executable, "-m", "mtplib.cli", "shard", "serve",
                              "--endpoint", f"127.0.0.1:{port}", "--json"],
                             stdout=o, stderr=e, env={**os.environ})
        try:
            deadline = time.monotonic() + 60
            while "Starting RPC server" not in err.read_text():
                assert p.poll() is None and time.monotonic() < deadline, err.read_text()
                time.sleep(0.1)
        finally:
            p.terminate()
            p.wait(timeout=30)
    assert out.read_text() == ""
    help_text = subprocess.run([sys.executable, "-m", "mtplib.cli", "shard", "serve", "--help"],
                               capture_output=True, text=True, timeout=60).stdout
    assert "exit codes:" in help_text and "  4 " in help_text


# -- run folders -----------------------------------------------------------------------------
HEAD = "lane: t\nfixture: {preset: tiny, seed: 0}\n"
SMOKE = "notebooks: [00_fixture_smoke.ipynb]\n"


@pytest.fixture
def lane_file(tmp_path):
    p = tmp_path / "lane.yaml"
    p.write_text(HEAD + SMOKE)
    return p


@pytest.fixture
def fake_papermill(monkeypatch):
    """Notebooks 'run' by writing their output file (no kernel starts)."""
    import papermill as pm

    def fake_execute(src, dst, **kw):
        open(dst, "w").write("{}")

    monkeypatch.setattr(pm, "execute_notebook", fake_execute)


def test_two_runs_in_one_second_get_their_own_folders(tmp_path, lane_file, fake_papermill,
                                                      monkeypatch):
    """Two `mtplib run` of one lane in the same second shared one folder (one overwrote the
    other's record and notebooks): the second now gets NAME-2."""
    from mtplib.records import lanes as L

    monkeypatch.setattr(L, "run_stamp", lambda: "20261201T000000Z")
    a = L.run_lane(lane_file, out_root=tmp_path / "out", progress=False)
    b = L.run_lane(lane_file, out_root=tmp_path / "out", progress=False)
    assert a != b and b.name == a.name + "-2"
    for d in (a, b):
        rec = json.loads((d / "run_record.json").read_text())
        assert rec["status"] == "ok" and rec["run_dir"] == str(d)


@pytest.mark.parametrize("unique", [True, False])
def test_run_folder_claims_are_atomic(tmp_path, unique):
    """Claimed at the same moment by 8 threads: a generated name gives 8 folders; an
    explicit one is given to exactly one claimant, the others are refused."""
    from mtplib.records.lanes import LaneError, claim_run_dir

    got, refused, go = [], [], threading.Barrier(8)

    def claim():
        go.wait()
        try:
            got.append(claim_run_dir(tmp_path / "run", unique=unique)[0])
        except LaneError as e:
            refused.append(str(e))

    ts = [threading.Thread(target=claim) for _ in range(8)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    if unique:
        assert len(set(got)) == 8 and not refused
    else:
        assert len(got) == 1 and len(refused) == 7
        assert all("pick another --run-id" in r for r in refused)


@pytest.mark.parametrize("run_id", ["../../x", "../x", "/tmp/abs-run", "a/b", "..", ".",
                                    ".hidden", "", "a\\b", "x\x00y"])
def test_run_id_stays_inside_out(tmp_path, lane_file, fake_papermill, run_id, capsys):
    """`--run-id ../../x` or an absolute path wrote outside --out."""
    from mtplib.cli import main

    out = tmp_path / "a" / "b" / "out"
    before = set(tmp_path.rglob("*"))
    rc = main(["run", "--params", str(lane_file), "--out", str(out), "--run-id", run_id,
               "--no-progress", "--json"])
    err = json.loads(capsys.readouterr().out)
    assert rc == 2 and err["kind"] == "input" and "--run-id" in err["error"]
    assert set(tmp_path.rglob("*")) == before  # nothing made anywhere
    assert not __import__("pathlib").Path("/tmp/abs-run").exists()


def test_plain_run_id_still_works(tmp_path, lane_file, fake_papermill):
    from mtplib.records.lanes import run_lane

    d = run_lane(lane_file, out_root=tmp_path / "out", run_id="my-run_1.2", progress=False)
    assert d == tmp_path / "out" / "my-run_1.2"


def _enospc_after(monkeypatch, module, name: str, n_ok: int) -> None:
    """``module.name`` fails like a full disk after ``n_ok`` calls (root ignores
    permissions, so a read-only folder cannot be simulated with chmod here); a call that
    fails has done its work first, so what it wrote is on disk."""
    import errno

    real, calls = getattr(module, name), []

    def fail(*a, **kw):
        calls.append(1)
        out = real(*a, **kw)
        if len(calls) > n_ok:
            raise OSError(errno.ENOSPC, "No space left on device")
        return out

    monkeypatch.setattr(module, name, fail)


def _full_disk_at_sidecar(monkeypatch) -> None:
    """The disk fills while the fixture's second file (the sidecar) is written: its
    temporary file holds every tensor when the write fails."""
    import gguf

    _enospc_after(monkeypatch, gguf.GGUFWriter, "write_tensors_to_file", 1)


@pytest.mark.parametrize("where", ["record", "fixture"])
def test_full_disk_in_a_run_is_one_line_and_leaves_nothing(tmp_path, lane_file,
                                                           fake_papermill, monkeypatch,
                                                           capsys, where):
    """A full --out gave a traceback (no JSON under --json) and left run_record.json without
    a status and models/*.gguf.new.tmp: now one JSON error, exit 2, and no run folder."""
    from mtplib import files
    from mtplib.cli import main

    if where == "record":
        _enospc_after(monkeypatch, files, "write_text_atomic", 0)
    else:  # the disk fills while the sidecar's tensors are written (116 trunk tensors)
        _full_disk_at_sidecar(monkeypatch)
    out = tmp_path / "out"
    rc = main(["run", "--params", str(lane_file), "--out", str(out), "--no-progress", "--json"])
    lines = capsys.readouterr().out.strip().splitlines()
    assert rc == 2 and len(lines) == 1, lines
    err = json.loads(lines[0])
    assert err["exit"] == 2 and "No space left on device" in err["error"]
    assert list(tmp_path.rglob("*.tmp")) == [] and list(tmp_path.rglob("*.new")) == []
    assert not out.exists() or list(out.iterdir()) == []


def test_out_under_a_regular_file_is_one_line(tmp_path, lane_file, fake_papermill, capsys):
    """A path whose parent is a regular file fails as root too (unlike chmod)."""
    from mtplib.cli import main

    (tmp_path / "file").write_text("x")
    rc = main(["run", "--params", str(lane_file), "--out", str(tmp_path / "file" / "out"),
               "--run-id", "r", "--no-progress"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "file" in err[0], err
    assert (tmp_path / "file").read_text() == "x"


@pytest.mark.parametrize("how", ["full", "file-parent"])
def test_fixture_failure_is_one_line_and_leaves_nothing(tmp_path, monkeypatch, capsys, how):
    from mtplib.cli import main

    if how == "full":
        _full_disk_at_sidecar(monkeypatch)
        out = tmp_path / "new" / "fx"
    else:
        (tmp_path / "file").write_text("x")
        out = tmp_path / "file" / "fx"
    rc = main(["fixture", "--out", str(out), "--json"])
    lines = capsys.readouterr().out.strip().splitlines()
    assert rc == 2 and len(lines) == 1 and json.loads(lines[0])["exit"] == 2, lines
    left = sorted(p.name for p in tmp_path.rglob("*"))
    assert left == (["file"] if how == "file-parent" else []), left


def test_fixture_failure_keeps_files_that_were_there(tmp_path, monkeypatch):
    """A fixture folder with a valid trunk already: a failure while writing the sidecar
    removes only what this call created."""
    from mtplib.model import fixture as F

    F.write_fixture(tmp_path, seed=0)
    (tmp_path / "mtp-v4-tiny-s0.gguf").unlink()
    keep = (tmp_path / "v4-tiny-s0.gguf").read_bytes()
    _full_disk_at_sidecar(monkeypatch)
    with pytest.raises(OSError):
        F.write_fixture(tmp_path, seed=0)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["v4-tiny-s0.gguf"]
    assert (tmp_path / "v4-tiny-s0.gguf").read_bytes() == keep


def test_lane_threads_beyond_the_machine_stop_before_a_folder(tmp_path, fake_papermill):
    import os

    from mtplib.records.lanes import LaneError, load_lane, run_lane

    p = tmp_path / "lane.yaml"
    p.write_text(HEAD + SMOKE + f"threads: {(os.cpu_count() or 1) + 1}\n")
    with pytest.raises(LaneError, match="CPUs"):
        run_lane(p, out_root=tmp_path / "out", run_id="r", progress=False)
    assert not (tmp_path / "out").exists()
    p.write_text(HEAD + SMOKE + "threads: 100000\n")
    with pytest.raises(LaneError, match="threads"):
        load_lane(p)


# -- evidence ------------------------------------------------------------------------------
@pytest.fixture
def story(monkeypatch):
    """A story whose README writer needs nothing from the run (copy_run's rules only)."""
    from mtplib.records import evidence as E

    monkeypatch.setitem(E.WRITERS, "T", lambda run_dir, raw, links: "# T evidence\n")
    return "T"


def _run_dir(root, name="run", status="ok", notebooks=("00_a.ipynb", "01_b.ipynb")):
    d = root / name
    d.mkdir(parents=True)
    for nb in notebooks:
        (d / nb).write_text(json.dumps({"nb": nb}))
    rec = {"status": status, "notebooks": [{"notebook": n, "status": "ok"} for n in notebooks]}
    if status == "failed":
        rec["failed_notebook"] = notebooks[-1]
    (d / "run_record.json").write_text(json.dumps(rec))
    return d


def test_evidence_refuses_a_failed_run(tmp_path, story, capsys):
    """A run whose record says failed was copied with a README that did not say so."""
    from mtplib.cli import main
    from mtplib.errors import InputError
    from mtplib.records.evidence import copy_run

    for status in ("failed", "running"):
        run = _run_dir(tmp_path, f"run-{status}", status)
        with pytest.raises(InputError, match=f"status '{status}'.*--allow-failed"):
            copy_run(run, story, tmp_path / "ev")
        assert not (tmp_path / "ev").exists()
    rc = main(["evidence", "--run", str(tmp_path / "run-failed"), "--story", "DGR-066",
               "--dest", str(tmp_path / "ev")])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "failed" in err[0] and "01_b.ipynb" in err[0], err
    # opted in: the README opens with the warning
    readme = copy_run(tmp_path / "run-failed", story, tmp_path / "ev", allow_failed=True)
    first = readme.read_text().splitlines()[0]
    assert "WARNING" in first and "did not complete" in first and "`failed`" in first


@pytest.mark.parametrize("text", ['{"status": "ok", "noteb', "", "[1, 2]", "\xff\xfe"])
def test_evidence_damaged_run_record_is_one_line(tmp_path, story, capsys, text):
    from mtplib.cli import main

    run = _run_dir(tmp_path)
    (run / "run_record.json").write_text(text, encoding="latin-1")
    rc = main(["evidence", "--run", str(run), "--story", "DGR-066", "--dest",
               str(tmp_path / "ev"), "--json"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 2 and out["kind"] == "input" and "run_record.json" in out["error"], out
    assert not (tmp_path / "ev").exists()


def test_evidence_force_removes_the_replaced_evidence_only(tmp_path, story):
    """--force left the replaced evidence's notebooks: now removed (files added by hand
    stay); without --force the replacement is refused, nothing written."""
    import shutil

    from mtplib.records.evidence import copy_run

    long = _run_dir(tmp_path, "long", notebooks=("00_a.ipynb", "01_b.ipynb", "02_c.ipynb"))
    ev = tmp_path / "ev"
    copy_run(long, story, ev)
    (ev / story / "notes.md").write_text("mine")
    (ev / story / "extra.json").write_text("{}")
    # a run that lacks 02_c and is otherwise identical: only the stale notebook differs
    short = tmp_path / "short"
    shutil.copytree(long, short)
    (short / "02_c.ipynb").unlink()
    before = {p.name: p.read_bytes() for p in (ev / story).iterdir()}
    with pytest.raises(FileExistsError, match="not in this run.*02_c.ipynb.*--force"):
        copy_run(short, story, ev)
    assert {p.name: p.read_bytes() for p in (ev / story).iterdir()} == before
    copy_run(short, story, ev, force=True)
    names = sorted(p.name for p in (ev / story).iterdir())
    assert names == ["00_a.ipynb", "01_b.ipynb", "README.md", "extra.json", "notes.md",
                     "run_record.json"]


def test_evidence_same_run_twice_is_fine(tmp_path, story):
    from mtplib.records.evidence import copy_run

    run = _run_dir(tmp_path)
    assert copy_run(run, story, tmp_path / "ev") == copy_run(run, story, tmp_path / "ev")


def test_json_records_are_written_atomically(tmp_path, monkeypatch):
    """A write that fails (a kill, a full disk) leaves the previous record whole, and no
    temporary file; run records, raw metrics and READMEs share the one writer."""
    import os

    from mtplib import files
    from mtplib.records import raw_metrics
    from mtplib.records.run_record import write_json

    p = tmp_path / "run_record.json"
    write_json(p, {"status": "ok", "n": 1})
    old = p.read_bytes()

    def boom(*a):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(files.os, "replace", boom)
    with pytest.raises(OSError):
        write_json(p, {"status": "ok", "n": 2})
    with pytest.raises(OSError):
        raw_metrics._write(tmp_path, "run_record.json", {"x": 1}, indent=1)
    assert p.read_bytes() == old
    assert sorted(os.listdir(tmp_path)) == ["run_record.json"]


# -- issue 39 ----------------------------------------------------------------------------------
def _full_statvfs(monkeypatch, free_blocks: int) -> None:
    """The file system holding the output reports ``free_blocks`` of 4 KiB left."""
    import os

    from mtplib import files

    st = os.statvfs("/")

    class Full:
        f_frsize, f_bfree, f_bavail = 4096, free_blocks, free_blocks

        def __getattr__(self, name):
            return getattr(st, name)

    monkeypatch.setattr(files.os, "statvfs", lambda p: Full())


def _short_write(monkeypatch) -> None:
    """gguf's writer fails as numpy's ``tofile`` does on a full disk: no errno, no file."""
    import gguf

    def short(*a, **kw):
        raise OSError("32768 requested and 22144 written")

    monkeypatch.setattr(gguf.GGUFWriter, "write_tensors_to_file", short)


@pytest.mark.parametrize("free_blocks, cause", [
    (0, "No space left on device"),
    (10**9, "the write stopped short and the system gave no reason")])
def test_a_short_write_names_the_file_and_its_cause(tmp_path, monkeypatch, capsys,
                                                    free_blocks, cause):
    """Issue 39 item 9: numpy's short write reached the user as "32768 requested and 22144
    written" (no file, no cause); now one line names the file and the cause."""
    from mtplib.cli import main

    _short_write(monkeypatch)
    _full_statvfs(monkeypatch, free_blocks)
    out = tmp_path / "fx"
    assert main(["fixture", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    want = (f"cannot write {out / 'v4-tiny-s0.gguf'}: {cause} (32768 bytes requested, "
            "22144 written)")
    assert len(err) == 1 and want in err[0], err
    assert list(tmp_path.rglob("*.tmp")) == []


def test_a_short_write_in_a_run_names_the_file(tmp_path, lane_file, fake_papermill,
                                               monkeypatch, capsys):
    """The red team's case: `mtplib run` onto a full disk (the fixture is written into the
    run folder); one line naming the file, exit 2, and still no run folder left."""
    from mtplib.cli import main

    _short_write(monkeypatch)
    _full_statvfs(monkeypatch, 0)
    out = tmp_path / "out"
    assert main(["run", "--params", str(lane_file), "--out", str(out), "--run-id", "r",
                 "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert (f"cannot write {out / 'r' / 'models' / 'v4-tiny-s0.gguf'}: No space left on "
            "device (32768 bytes requested, 22144 written)") in err[0], err
    assert not out.exists() or list(out.iterdir()) == []


def test_a_failed_record_write_names_the_record(tmp_path, monkeypatch):
    """Python's own write error (ENOSPC at the flush) carries no file name either."""
    from mtplib import files
    from mtplib.records.run_record import write_json

    def full(fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(files.os, "fsync", full)
    p = tmp_path / "run_record.json"
    with pytest.raises(OSError, match=f"cannot write {p}: No space left on device$"):
        write_json(p, {"status": "ok"})
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("target", ["empty", "missing", "file"])
def test_a_run_folder_that_is_a_symlink_is_refused(tmp_path, lane_file, fake_papermill,
                                                   capsys, target):
    """Issue 39 item 10: `--out D --run-id X` with D/X a symbolic link to an empty folder
    elsewhere wrote the run there; any link is refused now, and nothing is written or
    removed on either side of it."""
    import os

    from mtplib.cli import main

    elsewhere = tmp_path / "elsewhere"
    if target == "empty":
        elsewhere.mkdir()
    elif target == "file":
        elsewhere.write_text("x")
    out = tmp_path / "out"
    out.mkdir()
    os.symlink(elsewhere, out / "X")
    before = {p: p.is_file() and p.read_bytes() for p in tmp_path.rglob("*")}
    rc = main(["run", "--params", str(lane_file), "--out", str(out), "--run-id", "X",
               "--no-progress"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1, err
    assert "is a symbolic link" in err[0] and "--run-id" in err[0], err
    assert {p: p.is_file() and p.read_bytes() for p in tmp_path.rglob("*")} == before
    assert (out / "X").is_symlink()


def test_an_existing_run_folder_is_kept(tmp_path, lane_file, fake_papermill, capsys):
    """What the user gave is never lost: an empty folder is used (and kept), a non-empty
    one or a file is refused untouched."""
    from mtplib.cli import main

    out = tmp_path / "out"
    (out / "empty").mkdir(parents=True)
    (out / "full").mkdir()
    (out / "full" / "mine.txt").write_text("mine")
    (out / "file").write_text("mine")
    args = ["run", "--params", str(lane_file), "--out", str(out), "--no-progress",
            "--run-id"]
    assert main([*args, "empty"]) == 0
    assert (out / "empty" / "run_record.json").exists()
    capsys.readouterr()
    for name, says in (("full", "is not empty"), ("file", "is not a folder")):
        assert main([*args, name]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and says in err[0], err
    assert (out / "full" / "mine.txt").read_text() == "mine"
    assert sorted(p.name for p in (out / "full").iterdir()) == ["mine.txt"]
    assert (out / "file").read_text() == "mine"
