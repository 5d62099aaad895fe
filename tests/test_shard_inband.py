"""Issue 43 point 4: a shard says what it is in band, so a forward in between changes nothing.

The report of a shard's build (`mtplib.distributed.shard_report`) used to be a file on the
client's host keyed by the dialled endpoint: a shard reached through `ssh -L`, socat, a
container port mapping or any TCP forward was refused MTP. Now the shard's front answers
mtplib's report request on the endpoint itself (`mtplib.distributed.report_wire`), in
plaintext and TLS alike. Here: plain TCP forwards (tests/rpc_fakes.py `TcpForward`) to a
real `mtplib shard serve` (MTP runs, same tokens as direct), to upstream's own RPC server
(MTP refused in one line, the server unharmed), and to answers that are garbage or silence
(one line, bounded time); and the fronts against hostile report requests.
"""

from __future__ import annotations

import json
import os
import socket
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest
from rpc_fakes import FakeShard, TcpForward, hello, wait_closed

from mtplib import pins
from mtplib.contract.types import CONTRACT_VERSION
from mtplib.distributed.gateway import Gateway
from mtplib.distributed.plain_front import PlainFront
from mtplib.distributed.probe import probe_shards
from mtplib.distributed.processes import LocalShards, free_port
from mtplib.distributed.report_wire import (
    REPLY_MAX,
    REPORT_ALPN,
    REPORT_HEADER,
    REPORT_REQUEST,
    ask_report,
    report_reply,
)
from mtplib.distributed.shard_report import ShardReport
from mtplib.distributed.tls import TlsConfig, TlsStream, connect_ready_status, init_pki
from mtplib.runtime.rpc import ShardError, recv_exact

REPO = Path(__file__).resolve().parent.parent
CLI = [sys.executable, "-m", "mtplib.cli"]
GOOD = ShardReport(CONTRACT_VERSION, pins.LLAMA_CPP_PYTHON_VERSION, pins.LLAMA_CPP_COMMIT,
                   "patched", "ab" * 32, "cpu")
PROMPT = "5,9,14,3,77,41,8,120"


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> TlsConfig:
    d = tmp_path_factory.mktemp("pki")
    init_pki(d, ["127.0.0.1"])
    return TlsConfig.load(d)


def _addr(endpoint: str) -> tuple[str, int]:
    host, port = endpoint.split(":")
    return host, int(port)


def _gen(pair, endpoints: list[str], *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*CLI, "generate", "--model", str(pair.trunk), "--tokens", PROMPT, "--n", "6",
         "--plan", "0-1,2-3", "--endpoints", ",".join(endpoints), *extra],
        capture_output=True, text=True, timeout=300, cwd=REPO)


def _settled(cond, timeout_s: float = 3.0) -> bool:
    """``cond()`` within ``timeout_s`` (a front counts an answer just after sending it)."""
    end = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > end:
            return False
        time.sleep(0.02)
    return True


def _one_line_error(r: subprocess.CompletedProcess) -> str:
    """The error line of a CLI run that failed cleanly (exit 2, no traceback)."""
    assert r.returncode == 2, r.stderr[-2000:]
    assert "Traceback" not in r.stderr, r.stderr[-2000:]
    line = r.stderr.strip().splitlines()[-1]
    assert line.startswith("mtplib generate: error: "), r.stderr[-2000:]
    return line


# -- real shards through a forward ---------------------------------------------------------
def test_mtp_through_plain_tcp_forwards_runs_with_the_direct_runs_tokens(pair):
    """`generate --endpoints` through a plain TCP forward on another port to each of two
    plaintext `shard serve`: the report comes through, MTP routes, same tokens as direct."""
    mtp = ("--mtp", str(pair.sidecar), "--draft", "2", "--json")
    with LocalShards(2) as shards:
        direct = _gen(pair, shards.endpoints, *mtp)
        with TcpForward(_addr(shards.endpoints[0])) as f0, \
                TcpForward(_addr(shards.endpoints[1])) as f1:
            probed = probe_shards([f0.endpoint, f1.endpoint], timeout_s=5)
            forwarded = _gen(pair, [f0.endpoint, f1.endpoint], *mtp)
            assert f0.n_connections > 2 and f1.n_connections > 2  # it all went through
    for p in probed:
        assert p.report is not None, p.report_problem
        assert (p.report.contract_version, p.report.device) == (CONTRACT_VERSION, "cpu")
    assert direct.returncode == 0, direct.stderr[-2000:]
    assert forwarded.returncode == 0, forwarded.stderr[-2000:]
    a, b = json.loads(direct.stdout), json.loads(forwarded.stdout)
    assert b["metrics"]["routing"]["recipe"] == "mtp.v4.draft2"
    assert b["metrics"]["drafted"] > 0
    assert b["tokens"] == a["tokens"] and len(a["tokens"]) == 6
    assert [s["endpoint"] for s in b["metrics"]["routing"]["shards"]] == \
        [f0.endpoint, f1.endpoint]


def _upstream_server(log: Path, build: str = "stock") -> tuple[subprocess.Popen, str]:
    """Upstream's own RPC server (no mtplib front) of ``build`` on a free loopback port,
    its output in ``log``."""
    ep = f"127.0.0.1:{free_port()}"
    with open(log, "w") as out:
        p = subprocess.Popen(
            [sys.executable, "-c", "import sys; from mtplib.runtime.rpc import serve; "
             "serve(sys.argv[1], threads=1)", ep],
            env=dict(os.environ, MTPLIB_UPSTREAM=build), cwd=REPO, stdout=out,
            stderr=subprocess.STDOUT)
    end = time.monotonic() + 60
    while True:
        try:
            socket.create_connection(_addr(ep), timeout=1).close()
            return p, ep
        except OSError:
            assert p.poll() is None and time.monotonic() < end, "upstream's server did not start"
            time.sleep(0.1)


def test_a_forward_to_upstreams_own_rpc_server_refuses_mtp_in_one_line(pair, tmp_path):
    """Stock upstream's server closes a connection whose first byte is not HELLO
    (ggml-rpc.cpp, rpc_serve_client): mtplib's report request gets no answer, MTP is
    refused in one line naming the shard, the server serves on (its handshake answers)."""
    servers = [_upstream_server(tmp_path / f"rpc{i}.log") for i in range(2)]
    try:
        with TcpForward(_addr(servers[0][1])) as f0, TcpForward(_addr(servers[1][1])) as f1:
            eps = [f0.endpoint, f1.endpoint]
            t0 = time.monotonic()
            probed = probe_shards(eps, timeout_s=5)
            assert time.monotonic() - t0 < 5
            r = _gen(pair, eps, "--mtp", str(pair.sidecar), "--draft", "2")
        assert all(p.poll() is None for p, _ in servers)  # unharmed
    finally:
        for p, _ in servers:
            p.kill()
            p.wait(timeout=10)
    for i in range(2):  # upstream's banner: its own server, protocol 7.0
        assert "Starting RPC server v7.0." in (tmp_path / f"rpc{i}.log").read_text()
    assert [p.version[:2] for p in probed] == [(7, 0), (7, 0)]  # served on, as stock
    for p in probed:
        assert p.report is None
        assert "closed the connection on the mtplib report request" in p.report_problem
    line = _one_line_error(r)
    assert line.startswith("mtplib generate: error: mtp.v4.draft2 refused under policy "
                           f"'beta': shard 0: contract_version expected '{CONTRACT_VERSION}', "
                           f"got 'none reported: {f0.endpoint} closed the connection on "
                           "the mtplib report request (a bare upstream RPC server"), line


GARBAGE = [
    b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n",  # a web server behind it
    struct.pack("<Q", REPLY_MAX + 1) + b"{}",
    struct.pack("<Q", 40) + b"not json at all",  # then closed: broken off
    struct.pack("<Q", 9) + b"not json!",
    struct.pack("<Q", 2) + b"\xff\xfe",
    struct.pack("<Q", 1500) + b"[" * 1500,  # nested past json's recursion limit
    struct.pack("<Q", 12) + b'{"report":2}',
    struct.pack("<Q", 25) + b'{"report":1,"build":"x"}',
    b"\x05",  # a byte, then closed
]


@pytest.mark.parametrize("answer", GARBAGE, ids=range(len(GARBAGE)))
def test_garbage_for_a_report_is_one_line_and_the_handshake_still_runs(answer):
    """A forward whose answer to the report request is garbage (the rest passes to a fake
    RPC server): no report, one line saying why, the probe goes on at once."""
    with FakeShard() as fake, TcpForward(fake.addr, on_first=lambda h: answer
                                         if h == REPORT_HEADER else None) as fw:
        t0 = time.monotonic()
        (got,) = probe_shards([fw.endpoint], timeout_s=2)
        assert time.monotonic() - t0 < 1.5
    assert got.report is None and got.n_devices == 1
    why = got.report_problem
    assert why.startswith(fw.endpoint) and "\n" not in why and len(why) < 400, why
    assert "report request" in why


def test_a_forward_that_answers_everything_with_garbage_fails_in_one_line(pair):
    garbage = b"HTTP/1.1 400 Bad Request\r\n\r\n"
    with TcpForward(None, on_first=lambda h: garbage) as fw, FakeShard() as fake:
        t0 = time.monotonic()
        with pytest.raises(ShardError, match=f"shard {fw.endpoint}: reply of "):
            probe_shards([fake.endpoint, fw.endpoint], timeout_s=2)
        assert time.monotonic() - t0 < 1.5
        r = _gen(pair, [fake.endpoint, fw.endpoint])
    assert fw.endpoint in _one_line_error(r)


def test_a_silent_forward_is_named_within_the_probe_timeout():
    with TcpForward(None, on_first=lambda h: time.sleep(10) or b"") as fw:
        t0 = time.monotonic()
        with pytest.raises(ShardError, match=f"shard {fw.endpoint} did not answer the mtplib "
                           "report request within 1 s"):
            probe_shards([fw.endpoint], timeout_s=1)
        assert time.monotonic() - t0 < 2


def test_a_tls_gateway_answers_the_report_through_a_forward_even_while_busy(pki):
    with FakeShard() as fake, \
            Gateway(("127.0.0.1", 0), fake.addr, pki, report=GOOD, log=lambda s: None) as gw, \
            TcpForward(_addr(gw.endpoint)) as fw:
        (got,) = probe_shards([fw.endpoint], tls=pki, timeout_s=3)
        assert got.report == GOOD and got.peer_links
        # a client being served holds the gateway: a report is still answered at once
        held, _ = connect_ready_status(_addr(gw.endpoint), pki)
        with held:
            t0 = time.monotonic()
            assert ask_report(_addr(fw.endpoint), fw.endpoint, timeout_s=3, tls=pki) == \
                (GOOD, "")
            assert time.monotonic() - t0 < 1.5
        assert _settled(lambda: gw.stats["reports"] == 2) and gw.stats["busy"] == 0


# -- the fronts against hostile report requests --------------------------------------------
@pytest.fixture
def front():
    fake = FakeShard(concurrent=True)
    f = PlainFront(("127.0.0.1", 0), fake.addr, report=GOOD, log=lambda s: None).start()
    yield fake, f
    f.close()
    fake.close()


def _closed_unanswered(s: socket.socket, timeout_s: float) -> float:
    """Seconds until the peer closed ``s`` without sending a byte."""
    s.settimeout(timeout_s)
    t0 = time.monotonic()
    try:
        assert s.recv(1 << 16) == b""
    except ConnectionResetError:  # closed with our bytes unread
        pass
    return time.monotonic() - t0


def test_the_plain_front_answers_a_report_request_and_nothing_else(front):
    fake, f = front
    addr = _addr(f.endpoint)
    with socket.create_connection(addr, timeout=5) as s:
        s.sendall(REPORT_REQUEST)  # the report, then closed: the connection is spent
        assert recv_exact(s, len(report_reply(GOOD)), time.monotonic() + 3) == \
            report_reply(GOOD)
        assert wait_closed(s, 3.0) < 1.0
    cases = {
        "oversized": REPORT_HEADER[:1] + struct.pack("<Q", 1 << 40),
        "wrong size": REPORT_HEADER[:1] + struct.pack("<Q", 17) + bytes(17),
        "wrong magic": REPORT_HEADER + bytes(16),
    }
    for what, data in cases.items():
        with socket.create_connection(addr, timeout=5) as s:
            s.sendall(data)
            assert _closed_unanswered(s, 3.0) < 1.0, what
    with socket.create_connection(addr, timeout=5) as truncated, \
            socket.create_connection(addr, timeout=5) as slow:
        truncated.sendall(REPORT_REQUEST[:12])
        truncated.shutdown(socket.SHUT_WR)
        slow.sendall(REPORT_REQUEST[:20])  # then nothing
        assert _closed_unanswered(truncated, 3.0) < 1.0
        assert _closed_unanswered(slow, 5.0) < 3.5  # the front's 3 s deadline
    st = f.stats
    assert _settled(lambda: (st["reports"], st["not_hello"], st["hello_timeout"]) == (1, 3, 1)
                    ), st
    assert fake.n_connections == 0 and fake.refused == 0  # none of it reached upstream
    assert ask_report(addr, f.endpoint, timeout_s=2) == (GOOD, "")  # and it still serves


def test_the_gateway_answers_a_report_request_and_nothing_else(pki):
    ctx = pki.client_context()
    ctx.set_alpn_protocols([REPORT_ALPN])

    def dial(gw: Gateway) -> TlsStream:
        s = TlsStream(socket.create_connection(_addr(gw.endpoint), timeout=5), ctx,
                      server_side=False, server_hostname="127.0.0.1")
        s.handshake(5)
        assert s.alpn() == REPORT_ALPN
        return s

    with FakeShard() as fake, \
            Gateway(("127.0.0.1", 0), fake.addr, pki, report=GOOD, log=lambda s: None) as gw:
        for data in (REPORT_HEADER[:1] + struct.pack("<Q", 1 << 40), REPORT_HEADER + bytes(16),
                     hello(), b""):
            with dial(gw) as s:
                if data:
                    s.sendall(data)
                t0 = time.monotonic()
                s.settimeout(5)
                assert s.recv(1 << 16) == b""  # closed, unanswered
                assert time.monotonic() - t0 < (3.5 if not data else 1.0)
        with dial(gw) as s:
            s.sendall(REPORT_REQUEST)
            assert recv_exact(s, len(report_reply(GOOD)), time.monotonic() + 3) == \
                report_reply(GOOD)
        assert _settled(lambda: (gw.stats["reports"], gw.stats["report_refused"]) == (1, 4)), \
            gw.stats
        assert fake.n_connections == 0 and gw.stats["sessions"] == 0
