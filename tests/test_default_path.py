"""Issue 20: the path users take. Defaults that are the contract-safe fast path (drafter and
head in the client, the patched build where it is installed, cache crossing refused), no
cold-process penalty (engines warmed at load), and generations step by step (`stream`)."""

from __future__ import annotations

import json
import subprocess
import sys
import threading

import pytest

import mtplib.runtime as R
from mtplib.distributed.ranged_mtp import (
    CacheCrossingRefused,
    RangedMTP,
    check_cache_locality,
    resolve_placement,
)
from mtplib.distributed.results import RangedMetrics
from mtplib.errors import InputError
from mtplib.lab.correctness import seeded_prompt
from mtplib.runtime.engine_options import EngineOptions, resolve_head
from mtplib.runtime.model import RuntimeInputError
from mtplib.runtime.sampling import Sampler
from mtplib.runtime.speculative import MTPRuntime

PROMPT = seeded_prompt(11, 12)
N_NEW = 14
patched = pytest.mark.skipif(not R.patched_installed(),
                             reason="the patched upstream is not built (MTPLIB_SKIP_PATCHED)")


# -- choices, without upstream -----------------------------------------------------------
def test_default_build_is_patched_where_installed(monkeypatch, tmp_path):
    monkeypatch.delenv("MTPLIB_UPSTREAM", raising=False)
    monkeypatch.setattr(R, "PATCHED_DIR", tmp_path / "none")
    assert R.selected_upstream() == "stock"
    (tmp_path / "p" / "llama_cpp").mkdir(parents=True)
    (tmp_path / "p" / "llama_cpp" / "MTPLIB_PATCHES").write_text("abc123\npatches/0001-x.patch\n")
    monkeypatch.setattr(R, "PATCHED_DIR", tmp_path / "p")
    assert R.selected_upstream() == "patched"
    assert R.build_info() == {"build": "patched", "patch_set_sha256": "abc123",
                              "patches": ["patches/0001-x.patch"]}
    monkeypatch.setenv("MTPLIB_UPSTREAM", "stock")  # an explicit choice wins
    assert R.selected_upstream() == "stock"
    assert R.build_info()["patches"] == []
    monkeypatch.setenv("MTPLIB_UPSTREAM", "fancy")
    with pytest.raises(InputError, match="MTPLIB_UPSTREAM must be one of"):
        R.selected_upstream()


def test_placement_and_head_defaults():
    assert resolve_placement("auto", has_sidecar=True) == "client"
    assert resolve_placement("tail", has_sidecar=True) == "tail"
    with pytest.raises(InputError, match="mtp_placement"):
        resolve_placement("moon", has_sidecar=True)
    assert resolve_head("auto", ranged=True, mtp=True) == "client"
    assert resolve_head("auto", ranged=True, mtp=False) == "upstream"
    assert resolve_head("auto", ranged=False, mtp=True) == "upstream"
    assert resolve_head("upstream", ranged=True, mtp=True) == "upstream"
    assert EngineOptions(k=2).resolved(ranged=True).head == "client"


def test_cache_crossing_refused_on_stock_unless_allowed(monkeypatch):
    monkeypatch.setenv("MTPLIB_UPSTREAM", "stock")
    with pytest.raises(CacheCrossingRefused) as e:
        check_cache_locality(EngineOptions(k=2), 2, allow=False)
    msg = str(e.value)  # names the cause and the remedy
    assert "compressor state" in msg and "patched" in msg and "--allow-cache-crossing" in msg
    check_cache_locality(EngineOptions(k=2), 2, allow=True)  # opted in
    check_cache_locality(EngineOptions(k=0), 2, allow=False)  # MTP off: n_rs_seq 0
    check_cache_locality(EngineOptions(k=2), 1, allow=False)  # one shard: no seam
    monkeypatch.setenv("MTPLIB_UPSTREAM", "patched")
    check_cache_locality(EngineOptions(k=2), 3, allow=False)


def _cli(*args: str, env: dict | None = None, timeout: int = 300):
    import os

    e = dict(os.environ, **(env or {}))
    return subprocess.run([sys.executable, "-m", "mtplib.cli", *args], capture_output=True,
                          text=True, timeout=timeout, env=e)


def test_cli_refuses_stock_cache_crossing_before_any_shard(pair):
    p = _cli("generate", "--model", str(pair.trunk), "--mtp", str(pair.sidecar), "--plan",
             "0-1,2-3", "--tokens", "1,2,3", "--n", "4", "--json",
             env={"MTPLIB_UPSTREAM": "stock"}, timeout=120)
    assert p.returncode == 2, p.stderr
    err = json.loads(p.stdout)
    assert err["type"] == "CacheCrossingRefused" and "--allow-cache-crossing" in err["error"]


@pytest.mark.slow
def test_cli_opted_in_cache_crossing_exits_3(pair):
    p = _cli("generate", "--model", str(pair.trunk), "--mtp", str(pair.sidecar), "--draft", "2",
             "--plan", "0-1,2-3", "--tokens", "1,2,3,4,5", "--n", "6", "--json",
             "--allow-cache-crossing", env={"MTPLIB_UPSTREAM": "stock"})
    assert p.returncode == 3, p.stderr[-2000:]
    out = json.loads(p.stdout)
    m = RangedMetrics.from_dict(out["metrics"])  # the CLI's JSON reads back typed
    assert m.wire_violations and m.cache_bytes_crossing > 0
    assert m.upstream["build"] == "stock" and len(out["tokens"]) == 6


# -- the default path on the pin -----------------------------------------------------------
@patched
@pytest.mark.slow
def test_cli_default_ranged_mtp_is_the_safe_fast_path(pair):
    """`mtplib generate --plan --mtp` with no other option: drafter and head in the client,
    the patched build, the default seam (auto: the ring on this build's local shards, where
    0007 is in), setup reported apart, no cache bytes, and a verify step waits as often as
    a plain step (once over the ring), over the whole cold generation."""
    base = ["generate", "--model", str(pair.trunk), "--plan", "0-1,2-3", "--tokens",
            ",".join(map(str, PROMPT)), "--n", str(N_NEW), "--json"]
    off = _cli(*base)
    on = _cli(*base, "--mtp", str(pair.sidecar), "--draft", "2")
    assert off.returncode == 0 and on.returncode == 0, (off.stderr[-1500:], on.stderr[-1500:])
    m_off = RangedMetrics.from_dict(json.loads(off.stdout)["metrics"])
    out_on = json.loads(on.stdout)
    m = RangedMetrics.from_dict(out_on["metrics"])
    assert out_on["tokens"] == json.loads(off.stdout)["tokens"]
    assert m.mtp_placement == "client" and m.head == "client"
    assert m.upstream["build"] == "patched" and m.upstream["patches"]
    assert m.cache_bytes_crossing == 0 and m.wire_violations == []
    assert m.setup["setup_s"] > 0 and m.setup["widths"] == [1, 2, 3]
    assert m.verify_steps > 0 and m.drafted > 0
    from conftest import decode_waits

    assert m.waits_per_step["verify"] == m_off.waits_per_step["decode"] == decode_waits(2)
    assert m.waits_per_step.get("draft", 0) == 0  # the drafter is in the client
    from mtplib.runtime.rpc import client_proto_minor

    want = "ring" if client_proto_minor() >= 2 else "star"
    for run in (m, m_off):
        assert run.seam["requested"] == "auto" and run.seam["seam"] == want
        assert [p["seam"] for p in run.seam["pairs"]] == [want]


@patched
@pytest.mark.slow
def test_ranged_stream_and_warm_setup(pair):
    """Setup at load; every generation waits as a warm one does; `stream` yields what
    `generate` returns; closing a stream early frees the sequence."""
    opts = EngineOptions(k=2)
    with MTPRuntime(str(pair.trunk), str(pair.sidecar), k=2) as whole:
        ref, _ = whole.generate(PROMPT, N_NEW)
    with RangedMTP(str(pair.trunk), plan="0-1,2-3", sidecar=str(pair.sidecar), opts=opts) as r:
        toks1, m1 = r.generate(PROMPT, N_NEW)
        toks2, m2 = r.generate(PROMPT, N_NEW)
        assert toks1 == toks2 == ref
        assert m1.setup["widths"] == [1, 2, 3] and m2.setup is None
        assert m1.waits_per_step["verify"] == m2.waits_per_step["verify"]
        g = r.stream(PROMPT, N_NEW)
        chunks = list(g)
        assert [t for c in chunks for t in c] == g.tokens == ref and len(chunks) > 1
        assert g.metrics.seam_bytes > 0
        with r.stream(PROMPT, N_NEW) as g2:
            next(iter(g2))
        with pytest.raises(RuntimeInputError, match="not finished"):
            _ = g2.tokens
        assert r.generate(PROMPT, N_NEW)[0] == ref  # the early close left nothing behind
        toks = r.tokenize("abc")  # in the worker (the tiny fixture's test tokenizer)
        assert toks and all(isinstance(t, int) for t in toks)
        assert isinstance(r.detokenize(toks), str)


def test_whole_stream_sampler_and_threads(pair):
    """Whole model: `stream` == `generate`, a per-generation sampler, and concurrent callers
    serialized by the runtime's lock (each result equal to the sequential one)."""
    with MTPRuntime(str(pair.trunk), str(pair.sidecar), k=2, warm=True) as rt:
        assert rt.setup["widths"] == [1, 2, 3]
        ref, m = rt.generate(PROMPT, N_NEW)
        assert m.setup["widths"] == [1, 2, 3] and m.upstream["build"] in ("stock",
                                                                               "patched")
        g = rt.stream(PROMPT, N_NEW)
        assert [t for c in g for t in c] == ref == g.tokens
        hot = Sampler(temperature=0.9, seed=5)
        s1, _ = rt.generate(PROMPT, N_NEW, sampler=hot)
        assert rt.generate(PROMPT, N_NEW, sampler=hot)[0] == s1
        assert rt.generate(PROMPT, N_NEW)[0] == ref  # the runtime's own sampler again
        got: list = [None] * 4
        errors: list = []

        def work(i: int) -> None:
            try:
                got[i] = rt.generate(PROMPT, N_NEW)[0]
            except Exception as e:  # noqa: BLE001 - reported below
                errors.append(e)

        threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert not errors and got == [ref] * 4


@patched
def test_every_entry_package_loads_the_default_build_first():
    """Importing `mtplib.llama` first (it imports llama_cpp's draft-model base class) must
    not load the stock llama_cpp before the build is chosen; other modules load nothing at
    import (tests/test_envs.py), and the first `load` chooses the build before it imports
    llama_cpp."""
    env = {k: v for k, v in __import__("os").environ.items() if k != "MTPLIB_UPSTREAM"}
    for mod, first in (("mtplib.llama", ""),
                       ("mtplib.runtime.lib", "mtplib.runtime.lib.load(); "),
                       ("mtplib.distributed.ranged_mtp", "mtplib.runtime.lib.load(); ")):
        p = subprocess.run([sys.executable, "-c", f"import sys, {mod}, mtplib.runtime.lib; "
                            + ("assert 'llama_cpp' not in sys.modules; " if first else "")
                            + f"{first}import llama_cpp; print(llama_cpp.__file__)"],
                           capture_output=True, text=True, timeout=120, env=env)
        assert p.returncode == 0, (mod, p.stderr[-800:])
        assert p.stdout.strip().startswith(str(R.PATCHED_DIR)), (mod, p.stdout)


def _llama_file(models) -> str:
    """Runs in the ranged worker: which llama_cpp it imported."""
    import llama_cpp

    return llama_cpp.__file__


@patched
def test_ranged_worker_loads_the_build_it_is_told(pair, monkeypatch):
    """The worker's import path is this process's, less the patched build's folder: a
    worker started with MTPLIB_UPSTREAM=stock imported the patched llama_cpp (and reported
    stock) before."""
    for build in ("stock", "patched"):
        monkeypatch.setenv("MTPLIB_UPSTREAM", build)
        with RangedMTP(str(pair.trunk), plan="0-1,2-3", warm=False) as r:
            where = r.rt.call(_llama_file)
        assert where.startswith(str(R.PATCHED_DIR)) == (build == "patched"), (build, where)


def test_run_records_name_the_build():
    from mtplib.paths import REPO
    from mtplib.records.run_record import base_record

    rec = base_record(REPO, argv=["mtplib", "run"])
    assert rec["upstream"] == R.build_info() and rec["upstream"]["build"] in ("stock", "patched")
