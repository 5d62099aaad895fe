"""Adverts come from the shards: each reports its build at probe time, routing checks it.

A ranged run's adverts are built from what every shard reported about itself (contract
version, pin, build, patch set: `mtplib.distributed.shard_report`), through the channel
the shard has (a TLS gateway's ready line; a plaintext shard's report file on this host),
and negotiated against the client's own pin. Fake shards (tests/rpc_fakes.py) report
what a test tells them; a mismatched or silent one refuses MTP with one line, and plain
decoding still routes. The ranged tests at the end fail if the adverts come from the
client's own pin again.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
from rpc_fakes import FakeShard

from mtplib import pins
from mtplib.contract.capabilities import BETA_POLICY, RouteRefused, Status
from mtplib.contract.types import CONTRACT_VERSION, MTP_OFF
from mtplib.distributed.gateway import Gateway
from mtplib.distributed.probe import probe_shards
from mtplib.distributed.shard_report import (
    REPORT_DIR_ENV,
    ProbedShard,
    ReportError,
    ShardReport,
    advert_summary,
    read_report_file,
    remove_report_file,
    shard_adverts,
    write_report_file,
)
from mtplib.distributed.tls import TlsConfig, init_pki
from mtplib.runtime.routing import PIN, route

REPO = Path(__file__).resolve().parent.parent
GOOD = ShardReport(CONTRACT_VERSION, pins.LLAMA_CPP_PYTHON_VERSION, pins.LLAMA_CPP_COMMIT,
                   "patched", "ab" * 32)


@pytest.fixture(autouse=True)
def reports(tmp_path, monkeypatch) -> Path:
    """Every test gets its own report directory (children inherit it)."""
    d = tmp_path / "reports"
    monkeypatch.setenv(REPORT_DIR_ENV, str(d))
    return d


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> TlsConfig:
    d = tmp_path_factory.mktemp("pki")
    init_pki(d, ["127.0.0.1"])
    return TlsConfig.load(d)


# -- the report itself ---------------------------------------------------------------------
def test_a_report_round_trips_and_names_the_pin_as_routing_does():
    assert ShardReport.parse(GOOD.token()) == GOOD
    assert GOOD.pin == PIN
    stock = replace(GOOD, build="stock", patch_set="")
    assert "patches=-" in stock.token() and ShardReport.parse(stock.token()) == stock
    assert len(GOOD.token().split()) == 1 and GOOD.token().isascii()


@pytest.mark.parametrize("token, why", [
    ("", "empty report"),
    ("x" * 401, "at most 400"),
    (GOOD.token().replace("build=patched", "build=debug"), "build='debug' is malformed"),
    (GOOD.token().replace(";patches=" + "ab" * 32, ""), "report fields"),
    (GOOD.token() + ";extra=1", "report fields"),
    (GOOD.token().replace("contract=", "contract"), "report fields"),
    (GOOD.token().replace("build=patched", "build=stock"), "build stock with patches"),
    (GOOD.token().replace("llama.cpp=0c1e", "llama.cpp=zz1e"), "llama.cpp="),
    ("contract=é", "not ASCII"),
])
def test_a_malformed_report_is_refused_naming_the_fault(token, why):
    with pytest.raises(ReportError, match=why.replace("(", r"\(")):
        ShardReport.parse(token)


def test_a_gateway_refuses_a_report_that_would_break_its_status_line(pki):
    with pytest.raises(ValueError, match="one ASCII word"):
        Gateway(("127.0.0.1", 0), ("127.0.0.1", 1), pki, report="two words")


# -- the plaintext channel ----------------------------------------------------------------
def test_report_file_round_trip_and_its_refusals(reports):
    ep = "127.0.0.1:05123"
    path = write_report_file(ep, GOOD)
    assert path.parent == reports and oct(reports.stat().st_mode & 0o777) == "0o700"
    assert read_report_file("127.0.0.1:5123") == GOOD  # the endpoint normalized
    with pytest.raises(ReportError, match="no report file"):
        read_report_file("127.0.0.1:5124")
    path.chmod(0o666)
    with pytest.raises(ReportError, match="not this user's alone"):
        read_report_file(ep)
    path.chmod(0o600)
    rec = json.loads(path.read_text())
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    path.write_text(json.dumps({**rec, "pid": dead.pid}))
    with pytest.raises(ReportError, match=f"stale \\(its process {dead.pid} is gone\\)"):
        read_report_file(ep)
    path.write_text(json.dumps({**rec, "pid": os.getppid()}))  # a live process holds it
    with pytest.raises(ReportError, match="belongs to the live shard process"):
        write_report_file(ep, GOOD)
    remove_report_file(path)
    assert path.exists()  # not this process's: left alone
    path.write_text(json.dumps({**rec, "pid": os.getpid()}))
    remove_report_file(path)
    assert not path.exists()


def test_probe_reads_a_plaintext_fake_shards_report_file():
    with FakeShard() as a, FakeShard() as b:
        write_report_file(a.endpoint, GOOD)
        got = probe_shards([a.endpoint, b.endpoint], timeout_s=2)
    assert all(isinstance(g, ProbedShard) for g in got)
    assert got[0].report == GOOD and got[0].endpoint == a.endpoint
    assert got[0].version == (7, 0, 0)  # the handshake answer is still there
    assert got[1].report is None and "no report file" in got[1].report_problem
    assert advert_summary(got)[0] == {"endpoint": a.endpoint, **GOOD.to_dict()}
    assert "report_problem" in advert_summary(got)[1]


def test_probe_reads_the_report_on_a_tls_gateways_ready_line(pki):
    with FakeShard() as fake, FakeShard() as bare:
        gws = [Gateway(("127.0.0.1", 0), f.addr, pki, log=lambda s: None, report=r).start()
               for f, r in ((fake, GOOD.token()), (bare, ""))]
        try:
            got = probe_shards([g.endpoint for g in gws], tls=pki, timeout_s=3)
        finally:
            for g in gws:
                g.close()
    assert got[0].report == GOOD
    assert got[1].report is None and "carries no report" in got[1].report_problem


# -- routing on the shards' reports ---------------------------------------------------------
def _probed(*reports: ShardReport | None) -> list[ProbedShard]:
    base = dict(version=(3, 0, 0), n_devices=1, alignment=32, max_size=1 << 40,
                memory_free=1, memory_total=2)
    return [ProbedShard(**base, endpoint=f"127.0.0.1:{5000 + i}", report=r,
                        report_problem="" if r else "no report file")
            for i, r in enumerate(reports)]


def _route(k: int, shards, **kw):
    adverts = shard_adverts(shards, mtp_placed=kw.pop("mtp_placed", True),
                            policy=BETA_POLICY)
    return route(k, policy=BETA_POLICY, adverts=adverts, pin=PIN, **kw)


def test_matching_reports_route_and_a_build_difference_is_only_recorded():
    stock = replace(GOOD, build="stock", patch_set="")
    d = _route(3, _probed(GOOD, stock))
    assert d.recipe_routed == "mtp.v4.draft3" and d.reason == "all 2 shards implement mtp.v4.draft3"
    assert [v.status for v in d.per_shard] == [Status.IMPLEMENTED] * 2
    assert [s["build"] for s in advert_summary(_probed(GOOD, stock))] == ["patched", "stock"]


@pytest.mark.parametrize("bad, reason", [
    (replace(GOOD, contract_version="mtp-contract/1"),
     f"shard 1: contract_version expected {CONTRACT_VERSION!r}, got 'mtp-contract/1'"),
    (replace(GOOD, llama_cpp_commit="1" * 40),
     f"shard 1: pin expected {PIN!r} (as the client), got "
     f"'llama-cpp-python=={pins.LLAMA_CPP_PYTHON_VERSION}@111111111'"),
    (None, f"shard 1: contract_version expected {CONTRACT_VERSION!r}, got 'none reported: "
           "no report file'"),
])
def test_a_mismatched_or_silent_shard_refuses_mtp_in_one_line(bad, reason):
    shards = _probed(GOOD, bad)
    with pytest.raises(RouteRefused) as e:
        _route(2, shards)
    msg = str(e.value)
    assert msg == (f"mtp.v4.draft2 refused under policy 'beta': {reason} (plain decoding, "
                   "mtp.off, is always allowed)")
    assert "\n" not in msg
    assert _route(0, shards).recipe_routed == MTP_OFF  # plain decoding does not negotiate


def test_shards_that_agree_on_another_pin_are_refused_too():
    """The reference is the client's pin, not shard 0's: two shards of another mtplib
    agree with each other and are still refused."""
    other = replace(GOOD, llama_cpp_commit="2" * 40)
    with pytest.raises(RouteRefused, match=r"shard 0: pin expected .* \(as the client\)"):
        _route(1, _probed(other, other))


def test_the_tail_advert_says_whether_the_mtp_block_was_placed():
    with pytest.raises(RouteRefused, match="shard 1: tail shard has no MTP sidecar"):
        _route(1, _probed(GOOD, GOOD), mtp_placed=False)


# -- the ranged run: fails if the adverts come from the client again ------------------------
PROMPT = [5, 9, 14, 3, 77, 41, 8, 120]


def _tamper(endpoint: str, **change) -> None:
    """Make the shard at ``endpoint`` report something else (its file, same process)."""
    path = next(p for p in Path(os.environ[REPORT_DIR_ENV]).glob("*.json")
                if json.loads(p.read_text())["endpoint"] == endpoint)
    rec = json.loads(path.read_text())
    rec["report"] = replace(ShardReport.parse(rec["report"]), **change).token()
    path.write_text(json.dumps(rec))


def test_ranged_mtp_routes_on_what_real_shards_report(pair, reports):
    from mtplib.distributed.processes import LocalShards
    from mtplib.distributed.ranged_mtp import RangedMTP
    from mtplib.runtime.speculative import EngineOptions

    with LocalShards(2) as shards:
        files = sorted(reports.glob("*.json"))
        assert len(files) == 2  # each `mtplib shard serve` wrote its own
        with RangedMTP(str(pair.trunk), plan="0-1,2-3", sidecar=str(pair.sidecar),
                       endpoints=shards.endpoints, opts=EngineOptions(k=0)) as r:
            assert r.mtp_placed and not r.mtp_on_tail  # auto: the client holds the block
            toks, m = r.generate(PROMPT, 4, EngineOptions(k=2))
            assert m.routing["recipe"] == "mtp.v4.draft2"
            reported = m.routing["shards"]
            assert [s["endpoint"] for s in reported] == shards.endpoints
            assert {s["contract_version"] for s in reported} == {CONTRACT_VERSION}
            assert {s["pin"] for s in reported} == {PIN}
        _tamper(shards.endpoints[1], contract_version="mtp-contract/1")
        with RangedMTP(str(pair.trunk), plan="0-1,2-3", sidecar=str(pair.sidecar),
                       endpoints=shards.endpoints, opts=EngineOptions(k=0)) as r:
            with pytest.raises(RouteRefused, match="^mtp.v4.draft2 refused under policy "
                               "'beta': shard 1: contract_version expected "
                               f"'{CONTRACT_VERSION}', got 'mtp-contract/1'"):
                r.generate(PROMPT, 4, EngineOptions(k=2))
            plain, m = r.generate(PROMPT, 4, EngineOptions(k=0))
            assert plain == toks and m.routing["recipe"] == MTP_OFF
        # the CLI: one line, exit 2, before a token is generated
        _tamper(shards.endpoints[1], contract_version=CONTRACT_VERSION,
                llama_cpp_commit="3" * 40)
        out = subprocess.run(
            [sys.executable, "-m", "mtplib.cli", "generate", "--model", str(pair.trunk),
             "--mtp", str(pair.sidecar), "--draft", "2", "--tokens", "5,9,14", "--n", "2",
             "--plan", "0-1,2-3", "--endpoints", ",".join(shards.endpoints)],
            capture_output=True, text=True, timeout=300, cwd=REPO)
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert lines[-1].startswith("mtplib generate: error: mtp.v4.draft2 refused under "
                                "policy 'beta': shard 1: pin expected"), out.stderr
    assert "(as the client)" in lines[-1] and "Traceback" not in out.stderr
