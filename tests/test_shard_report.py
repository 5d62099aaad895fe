"""Adverts come from the shards: each reports its build at probe time, routing checks it.

A ranged run's adverts are built from what every shard reported about itself (contract
version, pin, build, patch set: `mtplib.distributed.shard_report`), asked in band on the
endpoint the client dials (`mtplib.distributed.report_wire`: a plaintext front or a TLS
gateway answers it), and negotiated against the client's own pin. Fake shards
(tests/rpc_fakes.py) report what a test tells them; a mismatched or silent one refuses MTP
with one line, and plain decoding still routes. The ranged tests at the end fail if the
adverts come from the client's own pin again. Forwards, stock shards and hostile answers:
tests/test_shard_inband.py.
"""

from __future__ import annotations

import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
from rpc_fakes import FakeShard, TcpForward

from mtplib import pins
from mtplib.contract.capabilities import BETA_POLICY, RouteRefused, Status
from mtplib.contract.types import CONTRACT_VERSION, MTP_OFF
from mtplib.distributed.gateway import Gateway
from mtplib.distributed.plain_front import PlainFront
from mtplib.distributed.probe import probe_shards
from mtplib.distributed.report_wire import REPORT_HEADER, report_reply
from mtplib.distributed.shard_report import (
    ProbedShard,
    ReportError,
    ShardReport,
    advert_summary,
    shard_adverts,
)
from mtplib.distributed.tls import TlsConfig, init_pki
from mtplib.runtime.routing import PIN, route

REPO = Path(__file__).resolve().parent.parent
GOOD = ShardReport(CONTRACT_VERSION, pins.LLAMA_CPP_PYTHON_VERSION, pins.LLAMA_CPP_COMMIT,
                   "patched", "ab" * 32)


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> TlsConfig:
    d = tmp_path_factory.mktemp("pki")
    init_pki(d, ["127.0.0.1"])
    return TlsConfig.load(d)


# -- the report itself ---------------------------------------------------------------------
def test_a_report_round_trips_and_names_the_pin_as_routing_does():
    assert ShardReport.from_fields(GOOD.fields()) == GOOD
    assert GOOD.pin == PIN
    stock = replace(GOOD, build="stock", patch_set="", device="cpu")
    assert stock.fields()["patches"] == "-" and stock.fields()["device"] == "cpu"
    assert ShardReport.from_fields(stock.fields()) == stock
    assert "device" not in GOOD.fields()  # unsaid: left out


def _with(**change) -> dict:
    return {k: v for k, v in {**GOOD.fields(), **change}.items() if v is not None}


@pytest.mark.parametrize("fields, why", [
    ([], "an object of fields"),
    (_with(build="debug"), "build='debug' is malformed"),
    (_with(patches=None), "report fields"),
    (_with(extra="1"), "report fields"),
    (_with(build="stock"), "build stock with patches"),
    (_with(**{"llama.cpp": "zz1e"}), "llama.cpp="),
    (_with(contract="é"), "contract='é' is malformed"),
    (_with(contract=7), "contract=7"),
    (_with(device="tpu"), "device='tpu' is malformed"),
])
def test_a_malformed_report_is_refused_naming_the_fault(fields, why):
    with pytest.raises(ReportError, match=why.replace("(", r"\(")):
        ShardReport.from_fields(fields)


# -- the channels: a plaintext front and a TLS gateway answer the same request ----------
def test_probe_gets_a_plaintext_fronts_report_in_band():
    with FakeShard() as a, FakeShard() as b, \
            PlainFront(("127.0.0.1", 0), a.addr, report=GOOD, log=lambda s: None) as front:
        got = probe_shards([front.endpoint, b.endpoint], timeout_s=2)
        assert front.stats["reports"] == 1 and front.stats["sessions"] == 1
    assert all(isinstance(g, ProbedShard) for g in got)
    assert got[0].report == GOOD and got[0].endpoint == front.endpoint
    assert got[0].version == (7, 0, 0)  # the handshake answer is still there
    assert a.n_connections == 1  # the report request never reached the RPC server
    assert got[1].report is None and b.refused == 1  # a bare RPC server closes on it
    assert "closed the connection on the mtplib report request" in got[1].report_problem
    assert advert_summary(got)[0] == {"endpoint": front.endpoint, **GOOD.to_dict()}
    assert "report_problem" in advert_summary(got)[1]


def test_probe_gets_a_tls_gateways_report_in_band(pki):
    with FakeShard() as fake, FakeShard() as bare:
        gws = [Gateway(("127.0.0.1", 0), f.addr, pki, log=lambda s: None, report=r).start()
               for f, r in ((fake, GOOD), (bare, None))]
        try:
            got = probe_shards([g.endpoint for g in gws], tls=pki, timeout_s=3)
            stats = [dict(g.stats) for g in gws]
        finally:
            for g in gws:
                g.close()
    assert got[0].report == GOOD and got[0].peer_links
    assert got[1].report is None and "closed the connection" in got[1].report_problem
    assert (stats[0]["reports"], stats[1]["report_refused"]) == (1, 1)
    assert [s["sessions"] for s in stats] == [1, 1]  # the report took no client slot
    assert (fake.n_connections, bare.n_connections) == (1, 1)


# -- routing on the shards' reports ---------------------------------------------------------
def _probed(*reports: ShardReport | None) -> list[ProbedShard]:
    base = dict(version=(3, 0, 0), n_devices=1, alignment=32, max_size=1 << 40,
                memory_free=1, memory_total=2)
    return [ProbedShard(**base, endpoint=f"127.0.0.1:{5000 + i}", report=r,
                        report_problem="" if r else "no report")
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
           "no report'"),
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


def _tampered(endpoint: str, **change) -> TcpForward:
    """A TCP forward to the real shard at ``endpoint`` that answers mtplib's report request
    itself with that shard's report changed (everything else passes as it is)."""
    host, port = endpoint.split(":")
    (real,) = probe_shards([endpoint], timeout_s=5)
    answer = report_reply(replace(real.report, **change))
    return TcpForward((host, int(port)),
                      on_first=lambda head: answer if head == REPORT_HEADER else None)


def test_ranged_mtp_routes_on_what_real_shards_report(pair):
    from mtplib.distributed.processes import LocalShards
    from mtplib.distributed.ranged_mtp import RangedMTP
    from mtplib.runtime.engine_options import EngineOptions

    with LocalShards(2) as shards:
        with RangedMTP(str(pair.trunk), plan="0-1,2-3", sidecar=str(pair.sidecar),
                       endpoints=shards.endpoints, opts=EngineOptions(k=0)) as r:
            assert r.mtp_placed and not r.mtp_on_tail  # auto: the client holds the block
            toks, m = r.generate(PROMPT, 4, EngineOptions(k=2))
            assert m.routing["recipe"] == "mtp.v4.draft2"
            reported = m.routing["shards"]
            assert [s["endpoint"] for s in reported] == shards.endpoints
            assert {s["contract_version"] for s in reported} == {CONTRACT_VERSION}
            assert {s["pin"] for s in reported} == {PIN}
        # shard 1 reached through a forward that reports another contract for it
        with _tampered(shards.endpoints[1], contract_version="mtp-contract/1") as fw, \
                RangedMTP(str(pair.trunk), plan="0-1,2-3", sidecar=str(pair.sidecar),
                          endpoints=[shards.endpoints[0], fw.endpoint],
                          opts=EngineOptions(k=0)) as r:
            with pytest.raises(RouteRefused, match="^mtp.v4.draft2 refused under policy "
                               "'beta': shard 1: contract_version expected "
                               f"'{CONTRACT_VERSION}', got 'mtp-contract/1'"):
                r.generate(PROMPT, 4, EngineOptions(k=2))
            plain, m = r.generate(PROMPT, 4, EngineOptions(k=0))
            assert plain == toks and m.routing["recipe"] == MTP_OFF
        # the CLI: one line, exit 2, before a token is generated
        with _tampered(shards.endpoints[1], llama_cpp_commit="3" * 40) as fw:
            out = subprocess.run(
                [sys.executable, "-m", "mtplib.cli", "generate", "--model", str(pair.trunk),
                 "--mtp", str(pair.sidecar), "--draft", "2", "--tokens", "5,9,14", "--n", "2",
                 "--plan", "0-1,2-3", "--endpoints", f"{shards.endpoints[0]},{fw.endpoint}"],
                capture_output=True, text=True, timeout=300, cwd=REPO)
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert lines[-1].startswith("mtplib generate: error: mtp.v4.draft2 refused under "
                                "policy 'beta': shard 1: pin expected"), out.stderr
    assert "(as the client)" in lines[-1] and "Traceback" not in out.stderr
