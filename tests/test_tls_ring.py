"""The ring's peer links through the mutual-TLS gateways (issue 31 item 2), on loopback.

patches/0007's shard-to-shard pushes under ``--tls``: the client maps each shard's local
relay to an endpoint in mutual TLS (`GGML_RPC_PEER_ENDPOINTS`), the dialing shard's gateway
rewrites the client's PEER_CONNECT to a loopback forwarder of its own that opens mutual TLS
with the shard's certificate, and the receiving gateway admits the peer link next to its one
client with its stream checked. Tested here:

- without upstream (a fake RPC server behind each gateway): the RPC server only ever gets a
  forwarder of its own gateway to dial; a forwarder dials only the endpoint an authenticated
  client named, only for the connection that presents that PEER_CONNECT's PEER_HELLO, only
  in mutual TLS to a gateway of the same CA that takes peer links, and passes pushes only;
  a gateway says whether it carries peer links, which `resolve_seam` follows; `tls init`
  issues shard certificates that act as TLS clients;
- with the patched build: 2 and 3 shards behind their gateways, the ring under TLS gives the
  star's and MTP off's tokens at k = 0 and 2 with one client wait per step, its peer traffic
  counted per link at the relays (cache bytes 0); gateway to gateway (no relay counting)
  too.

(The corpus of hostile peer streams is in tests/test_gateway.py.)
"""

from __future__ import annotations

import datetime
import shutil
import socket
import struct
from pathlib import Path

import pytest
from rpc_fakes import (
    FakeShard,
    hello,
    peer_hello,
    peer_push,
    reply,
    request,
    wait_closed,
)
from test_gateway import _addr
from test_ring_patch import _run, whole_tokens

from mtplib.distributed.client import resolve_seam
from mtplib.distributed.framing import PeerChecker
from mtplib.distributed.gateway import Gateway
from mtplib.distributed.probe import probe_shards
from mtplib.distributed.processes import LocalShards
from mtplib.distributed.shard_report import ProbedShard
from mtplib.distributed.tls import GATEWAY_PEER, TlsConfig, connect, init_pki, read_status
from mtplib.errors import InputError
from mtplib.runtime.rpc import (
    RPC_PEER_CONNECT,
    RPC_PEER_EXPECT,
    RPC_PEER_HELLO,
    client_proto_minor,
    handshake,
    recv_exact,
)

needs_ring = pytest.mark.skipif(
    client_proto_minor() < 2, reason="the loaded build lacks patches/0007 (RPC protocol 7.2)")


def _loopback_pki(d: Path) -> TlsConfig:
    init_pki(d, ["127.0.0.1"])
    return TlsConfig.load(d)


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> TlsConfig:
    return _loopback_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def other_pki(tmp_path_factory) -> TlsConfig:
    return _loopback_pki(tmp_path_factory.mktemp("other-pki"))


@pytest.fixture(scope="module")
def whole() -> dict[int, list[int]]:
    return whole_tokens()




def _yes(i: int, cmd: int, payload: bytes) -> bytes | None:
    return reply(b"\x01") if cmd in (RPC_PEER_EXPECT, RPC_PEER_CONNECT, RPC_PEER_HELLO) \
        else None


class _Shard:
    """A gateway in front of a fake 7.2 RPC server (serving its connections at once)."""

    def __init__(self, tls: TlsConfig, **kw) -> None:
        self.fake = FakeShard(_yes, concurrent=True)
        self.lines: list[str] = []
        self.gw = Gateway(("127.0.0.1", 0), self.fake.addr, tls, log=self.lines.append,
                          **kw).start()

    def close(self) -> None:
        self.gw.close()
        self.fake.close()


@pytest.fixture
def shards_ab(pki):
    a, b = _Shard(pki), _Shard(pki)
    yield a, b
    a.close()
    b.close()


def _connect_req(link: int, token: bytes, endpoint: str | bytes) -> bytes:
    ep = endpoint.encode() if isinstance(endpoint, str) else endpoint
    return request(RPC_PEER_CONNECT, struct.pack("<I", link) + token + ep.ljust(128, b"\0"))


def _served(shard: _Shard, pki: TlsConfig):
    stream, st = connect(_addr(shard.gw), pki)
    assert st.ready
    assert handshake(stream, shard.gw.endpoint).n_devices == 1
    return stream


def _rewritten(shard: _Shard, n: int) -> str:
    """The endpoint of the n-th PEER_CONNECT the fake RPC server got (0-based)."""
    got = [p for conn in shard.fake.received for c, p in conn if c == RPC_PEER_CONNECT]
    return got[n][20:].split(b"\0", 1)[0].decode()


def _local(endpoint: str) -> socket.socket:
    host, port = endpoint.split(":")
    return socket.create_connection((host, int(port)), timeout=5)


# -- no upstream: the forwarders ------------------------------------------------------------
def test_a_peer_connect_is_rewritten_to_the_gateways_own_forwarder(shards_ab, pki):
    """The RPC server gets a loopback port of its gateway to dial, never the endpoint the
    client named; that port dials the named gateway only for the connection presenting the
    PEER_HELLO of that PEER_CONNECT, and then passes pushes (one answer back)."""
    a, b = shards_ab
    with _served(b, pki) as at_b, _served(a, pki) as at_a:
        accepted = b.gw.stats["accepted"]
        tokens = [bytes([i]) * 16 for i in (1, 2)]
        for link, tok in zip((1, 2), tokens, strict=True):
            at_a.sendall(_connect_req(link, tok, b.gw.endpoint))
            assert recv_exact(at_a, 9) == reply(b"\x01")
        fw = [_rewritten(a, i) for i in (0, 1)]
        assert all(ep.startswith("127.0.0.1:") and ep != b.gw.endpoint for ep in fw)
        assert len(set(fw)) == 2
        assert b.gw.stats["accepted"] == accepted  # nothing dialed yet
        # link 1: a local connection with another token is closed; nothing is dialed
        with _local(fw[0]) as s:
            s.sendall(peer_hello(1, bytes(16)))
            assert wait_closed(s, 3.0) < 3.0
        assert a.gw.stats["peer_forward_refused"] == 1
        assert b.gw.stats["accepted"] == accepted
        # link 2: the right PEER_HELLO; B's RPC server gets it over mutual TLS, and pushes
        n_b = b.fake.n_connections
        with _local(fw[1]) as s:
            s.sendall(peer_hello(2, tokens[1]))
            assert recv_exact(s, 9) == reply(b"\x01")
            s.sendall(peer_push(1, 100) + peer_push(2, 3))
            s.sendall(hello())  # a client command: the forwarder closes the link
            assert wait_closed(s, 3.0) < 3.0
        assert b.fake.n_connections == n_b + 1
        assert bytes(b.fake.raw[-1]) == peer_hello(2, tokens[1]) + peer_push(1, 100) + \
            peer_push(2, 3)
        assert a.gw.stats["peer_links_out"] == 1 and a.gw.stats["peer_frame_errors"] == 1
        assert b.gw.stats["peer_sessions"] == 1
        # the client sessions go on
        for s in (at_a, at_b):
            s.sendall(request(15))  # DEVICE_COUNT
            assert recv_exact(s, 12)[8:9] == b"\x01"


def test_a_forwarder_dials_only_a_gateway_of_its_ca_that_takes_peers(shards_ab, pki, other_pki):
    """The named endpoint must be a gateway whose certificate the CA signed for that
    address and which settles ALPN PEER_ALPN: another CA's gateway, a gateway of the same
    CA that does not take peer links (no ALPN: an older mtplib) and a closed port each
    refuse the link, and nothing is sent to them; a bad endpoint ends the client's session
    before its PEER_CONNECT reaches the RPC server."""
    a, _ = shards_ab
    foreign, older = _Shard(other_pki), _Shard(pki)
    older.gw.ctx.set_alpn_protocols(["http/1.1"])  # as a gateway before peer links
    try:
        with _served(foreign, other_pki), _served(older, pki), _served(a, pki) as at_a:
            closed = socket.create_server(("127.0.0.1", 0))
            dead = f"127.0.0.1:{closed.getsockname()[1]}"
            closed.close()
            targets = (foreign.gw.endpoint, older.gw.endpoint, dead)
            for link, ep in enumerate(targets, start=1):
                at_a.sendall(_connect_req(link, bytes(16), ep))
                assert recv_exact(at_a, 9) == reply(b"\x01")
                with _local(_rewritten(a, link - 1)) as s:
                    s.sendall(peer_hello(link, bytes(16)))
                    assert wait_closed(s, 8.0) < 8.0
            assert a.gw.stats["peer_dial_failed"] == 3 and a.gw.stats["peer_links_out"] == 0
            for other in (foreign, older):  # their own client's connection only
                assert other.fake.n_connections == 1
                assert other.gw.stats["peer_sessions"] == 0
                assert other.gw.stats["sessions"] == 1
            assert any("TLS handshake failed" in line for line in a.lines)
            assert any("does not take peer links" in line for line in a.lines)
            n = len(a.fake.received[-1])
            at_a.sendall(_connect_req(4, bytes(16), "localhost:80"))
            assert wait_closed(at_a, 3.0) < 3.0
            assert a.gw.stats["frame_errors"] == 1 and len(a.fake.received[-1]) == n
    finally:
        foreign.close()
        older.close()


def test_a_gateway_without_peer_credentials_says_so_and_refuses(pki, tmp_path):
    """A shard certificate that cannot act as a TLS client (an older `tls init`: extended
    key usage serverAuth only): the gateway dials no peers and its ready line carries no
    +peer, so `auto` stays on the star and `ring` is refused; peers=False the same."""
    old = _server_auth_only(pki, tmp_path)
    for tls, shard in ((old, _Shard(old)), (pki, _Shard(pki, peers=False))):
        try:
            assert shard.gw.features == () and shard.gw.peer_problem
            (info,) = probe_shards([shard.gw.endpoint], tls=tls)
            assert info.peer_links is False
            with _served(shard, tls) as s:
                s.sendall(_connect_req(1, bytes(16), "127.0.0.1:9"))
                assert recv_exact(s, 9) == reply(b"\x01")
                with _local(_rewritten(shard, 0)) as loc:
                    loc.sendall(peer_hello(1, bytes(16)))
                    assert wait_closed(loc, 3.0) < 3.0
            assert shard.gw.stats["peer_forward_refused"] == 1
            assert ("not valid as a TLS client certificate" in shard.gw.peer_problem
                    if tls is old else shard.gw.peer_problem == "peer links turned off")
        finally:
            shard.close()


def test_the_ready_line_and_resolve_seam_under_tls(pki):
    shard = _Shard(pki)
    try:
        stream, st = connect(_addr(shard.gw), pki)
        with stream:
            assert st.ready and st.features == frozenset({GATEWAY_PEER})
        (info,) = probe_shards([shard.gw.endpoint], tls=pki)
        assert info.peer_links is True
    finally:
        shard.close()

    def probed(peer: bool, minor: int = 2) -> ProbedShard:
        return ProbedShard((7, minor, 0), 1, 32, 1 << 40, 1 << 30, 2 << 30, peer_links=peer)

    yes, no = probed(True), probed(False)
    assert resolve_seam("auto", [yes, yes, yes], tls=True, client_minor=2) == (
        "ring", "every shard speaks RPC 7.2")
    assert resolve_seam("ring", [yes, yes], tls=True, client_minor=2)[0] == "ring"
    seam, why = resolve_seam("auto", [yes, no, no], tls=True, client_minor=2)
    assert seam == "star" and why.startswith("the TLS gateways of shards 1, 2 carry no peer")
    with pytest.raises(InputError, match="seam ring: the TLS gateway of shard 0 carries no"):
        resolve_seam("ring", [no, yes], tls=True, client_minor=2)
    seam, why = resolve_seam("auto", [yes, probed(True, 1)], tls=True, client_minor=2)
    assert seam == "star" and "shard 1 speaks RPC 7.1" in why
    assert resolve_seam("auto", [no, no], tls=False, client_minor=2)[0] == "ring"


def test_read_status_takes_features_and_refuses_garbage():
    from mtplib.distributed.tls import GATEWAY_MAGIC

    class Line:
        def __init__(self, data: bytes) -> None:
            self.data = data

        def recv(self, n: int) -> bytes:
            out, self.data = self.data[:n], self.data[n:]
            return out

        def settimeout(self, t) -> None:
            pass

    st = read_status(Line(GATEWAY_MAGIC + b"ready abc +peer\n"), "x", 1.0)
    assert (st.ready, st.instance, st.features) == (True, "abc", frozenset({"+peer"}))
    st = read_status(Line(GATEWAY_MAGIC + b"busy abc\n"), "x", 1.0)
    assert (st.ready, st.features) == (False, frozenset())
    # the shard's report is asked in band (report_wire), never read off this line
    for bad in (b"ready abc rep=1 +peer\n", b"ready abc r1 r2\n", b"maybe abc\n",
                b"ready\n"):
        with pytest.raises(Exception, match="unexpected gateway status"):
            read_status(Line(GATEWAY_MAGIC + bad), "x", 1.0)


def test_tls_init_issues_shard_certificates_for_both_ends(pki):
    from cryptography import x509
    from cryptography.x509.oid import ExtendedKeyUsageOID

    def eku(name: str) -> set:
        cert = x509.load_pem_x509_certificate((pki.dir / name).read_bytes())
        return set(cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value)

    assert eku("shard.pem") == {ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH}
    assert eku("client.pem") == {ExtendedKeyUsageOID.CLIENT_AUTH}


def _server_auth_only(pki: TlsConfig, tmp_path: Path) -> TlsConfig:
    """``pki`` with its shard certificate re-issued for serverAuth only (as `tls init` did
    before peer links), signed by the same CA."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.x509.oid import ExtendedKeyUsageOID

    d = tmp_path / "old-pki"
    d.mkdir()
    for n in ("ca.pem", "client.pem", "client.key", "shard.key"):
        shutil.copy(pki.dir / n, d / n)
    ca = x509.load_pem_x509_certificate((pki.dir / "ca.pem").read_bytes())
    ca_key = serialization.load_pem_private_key((pki.dir / "ca.key").read_bytes(), None)
    shard = x509.load_pem_x509_certificate((pki.dir / "shard.pem").read_bytes())
    b = (x509.CertificateBuilder().subject_name(shard.subject).issuer_name(ca.subject)
         .public_key(shard.public_key()).serial_number(x509.random_serial_number())
         .not_valid_before(datetime.datetime.now(datetime.UTC) - datetime.timedelta(minutes=5))
         .not_valid_after(datetime.datetime.now(datetime.UTC) + datetime.timedelta(days=1)))
    for ext in shard.extensions:
        if isinstance(ext.value, x509.ExtendedKeyUsage):
            b = b.add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]),
                                critical=ext.critical)
        else:
            b = b.add_extension(ext.value, critical=ext.critical)
    cert = b.sign(ca_key, hashes.SHA256())
    (d / "shard.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return TlsConfig.load(d)


# -- with upstream: generation over the ring, through the gateways ----------------------------
@needs_ring
@pytest.mark.slow
@pytest.mark.parametrize("k", [0, 2])
@pytest.mark.parametrize("plan,n_shards", [("0-1,2-3", 2), ("0-0,1-2,3-3", 3)])
def test_the_ring_through_tls_gives_the_stars_tokens_with_one_wait(whole, pki, plan,
                                                                    n_shards, k):
    """Under TLS `auto` picks the ring (every gateway carries peer links): the star's and
    MTP off's tokens; the star waits once per shard and step, the ring once; each pair's
    peer link passes the receiving shard's relay in mutual TLS and is counted there, all of
    it seam values, no cache byte on any link."""
    star = _run("star", plan, k, tls=pki)
    ring = _run("auto", plan, k, tls=pki)
    assert star["tokens"] == ring["tokens"] == whole[k] == whole[0]
    step = "verify" if k else "decode"
    assert star["waits"][step] == star["waits"]["prefill"] == n_shards
    assert ring["waits"][step] == ring["waits"]["prefill"] == 1
    assert ring["seam"]["seam"] == "ring" and ring["seam"]["why"] == "every shard speaks RPC 7.2"
    eps = ring["endpoints"]
    assert [(x["from"], x["to"], x["seam"]) for x in ring["seam"]["links"]] == [
        (a, b, "ring") for a, b in zip(eps[:-1], eps[1:], strict=True)]
    assert all("mutual TLS" in x["peer_via"] and "relay" in x["peer_via"]
               for x in ring["seam"]["links"])
    assert ring["tls_peers"] == [0] + [1] * (n_shards - 1)
    assert star["tls_peers"] == [0] * n_shards
    peer = ring["report"]["steps"][step]["peer"]
    assert peer["per_shard"][0] == 0 and all(peer["per_shard"][1:])
    assert peer["classes"]["seam"] == peer["data"] > 0
    assert peer["classes"]["cache"] == ring["crossing"] == star["crossing"] == 0
    if not k:
        assert ring["bytes"]["decode"]["seam"] == 0
        assert 2 * peer["classes"]["seam"] == star["bytes"]["decode"]["seam"]


@needs_ring
@pytest.mark.slow
def test_the_ring_gateway_to_gateway(whole, pki, tmp_path):
    """A client whose TLS directory holds no shard certificate (a client-only host): the
    peer links go from gateway to gateway, past the relays (not counted there), with the
    same tokens and one wait per step; the shards' logs name the links."""
    client = tmp_path / "client-only"
    client.mkdir()
    for n in ("ca.pem", "client.pem", "client.key"):
        shutil.copy(pki.dir / n, client / n)
    with LocalShards(2, tls=pki, start_timeout_s=60) as sh:
        ring = _run("ring", "0-1,2-3", 0, sh.endpoints, tls=TlsConfig.load(client))
        logs = [sh.log_path(i).read_text() for i in range(2)]
    assert ring["tokens"] == whole[0]
    assert ring["waits"]["decode"] == ring["waits"]["prefill"] == 1
    assert [x["seam"] for x in ring["seam"]["links"]] == ["ring"]
    assert "gateway to gateway" in ring["seam"]["links"][0]["peer_via"]
    assert "peer" not in ring["report"]["steps"]["decode"]
    assert ring["tls_peers"] == [0, 0]
    assert "peer link to" in logs[0] and "Accepted peer link" in logs[1]


def test_peer_checker_is_what_the_fake_got():
    """(A guard on this file's fakes: the streams it sends pass the gateway's checker.)"""
    PeerChecker().feed(peer_hello(2, bytes(16)) + peer_push(1, 100) + peer_push(2, 3))
