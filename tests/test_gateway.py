"""The shard's mutual-TLS gateway against hostile peers (loopback only, no upstream).

A corpus of malformed streams is generated here (never committed) and sent to the
gateway's public port without a client certificate, and with one: without, no connection
ever reaches the RPC server behind it and each peer is closed within 5 s; with one, only
well-framed requests within the bounds are forwarded. The gateway keeps serving after all.
The same for peer links (patches/0007's shard-to-shard pushes, ALPN PEER_ALPN): admitted
only with a certificate and next to a served client, and of their streams only PEER_HELLO
then pushes within the bounds reach the RPC server, while the client's session goes on.
"""

from __future__ import annotations

import contextlib
import random
import socket
import ssl
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from rpc_fakes import (
    FakeShard,
    bad_peer_sessions,
    bad_sessions,
    client_hello,
    corpus,
    hello,
    peer_hello,
    peer_push,
    peer_stream,
    reply,
    request,
    send_and_time_close,
    wait_closed,
)

from mtplib.distributed.framing import FrameError, PeerChecker, RequestChecker, RpcLimits
from mtplib.distributed.gateway import Gateway
from mtplib.distributed.tls import (
    GATEWAY_PEER,
    PEER_ALPN,
    TlsConfig,
    TlsStream,
    connect,
    init_pki,
)
from mtplib.runtime.rpc import (
    GRAPH_HEADER,
    REQUEST_SIZES,
    RPC_CMD_HELLO,
    RPC_DEVICE_COUNT,
    RPC_GET_ALIGNMENT,
    RPC_GRAPH_COMPUTE,
    RPC_PEER_CONNECT,
    RPC_PEER_EXPECT,
    RPC_PEER_HELLO,
    RPC_SET_TENSOR,
    SET_TENSOR_HEADER,
    ShardError,
    handshake,
    recv_exact,
)


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> TlsConfig:
    d = tmp_path_factory.mktemp("pki")
    init_pki(d, ["127.0.0.1"])
    return TlsConfig.load(d)


@pytest.fixture(scope="module")
def other_pki(tmp_path_factory) -> TlsConfig:
    d = tmp_path_factory.mktemp("other-pki")
    init_pki(d, ["127.0.0.1"])
    return TlsConfig.load(d)


@pytest.fixture
def shard(pki):
    """A FakeShard behind a Gateway on 127.0.0.1 (both closed after the test)."""
    fake = FakeShard()
    gw = Gateway(("127.0.0.1", 0), fake.addr, pki, log=lambda s: None).start()
    yield fake, gw
    gw.close()
    fake.close()


def _addr(gw: Gateway) -> tuple[str, int]:
    host, port = gw.endpoint.split(":")
    return host, int(port)


def test_strangers_never_reach_the_rpc_server_and_are_closed_within_5_s(shard, pki):
    fake, gw = shard
    streams = corpus()
    t0 = time.monotonic()
    with ThreadPoolExecutor(16) as ex:
        times = list(ex.map(lambda d: send_and_time_close(_addr(gw), d), streams))
    assert max(times) < 5.0, max(times)
    assert fake.n_connections == 0  # not one byte, not one connection reached it
    st = gw.stats
    assert st["sessions"] == 0
    assert st["handshake_failed"] + st["handshake_timeout"] + st["pre_tls_timeout"] \
        + st["evicted"] == len(streams)
    # and it still serves an authenticated client
    stream, status = connect(_addr(gw), pki)
    with stream:
        assert status.ready and status.instance == gw.instance
        assert handshake(stream, gw.endpoint).n_devices == 1
    assert fake.n_connections == 1
    assert time.monotonic() - t0 < 60


def test_idle_and_slow_peers_are_closed_by_the_handshake_deadline(shard):
    _, gw = shard
    with socket.create_connection(_addr(gw), timeout=5) as idle, \
            socket.create_connection(_addr(gw), timeout=5) as slow:
        ch = client_hello()
        slow.sendall(ch[:10])  # then nothing: a slowloris ClientHello
        t_idle, t_slow = wait_closed(idle, 6.0), wait_closed(slow, 6.0)
    assert t_idle < 5.0 and t_slow < 5.0
    assert gw.stats["pre_tls_timeout"] == 1 and gw.stats["handshake_timeout"] == 1


def test_a_certificate_from_another_ca_is_refused_both_ways(shard, pki, other_pki, tmp_path):
    fake, gw = shard
    # a client that trusts the shard but holds a certificate of another CA
    (tmp_path / "ca.pem").write_bytes((pki.dir / "ca.pem").read_bytes())
    for n in ("client.pem", "client.key"):
        (tmp_path / n).write_bytes((other_pki.dir / n).read_bytes())
    with pytest.raises(ShardError, match="refused this client's certificate"):
        connect(_addr(gw), TlsConfig.load(tmp_path))
    # the client reads the shard's alert before the gateway's thread has counted it
    _wait_for(lambda: gw.stats["handshake_failed"] >= 1)
    assert fake.n_connections == 0 and gw.stats["handshake_failed"] == 1
    # and a client that does not know the shard's CA refuses the shard
    other = Gateway(("127.0.0.1", 0), fake.addr, other_pki, log=lambda s: None).start()
    try:
        with pytest.raises(ShardError, match="does not verify"):
            connect(_addr(other), pki)
    finally:
        other.close()
    assert fake.n_connections == 0


def test_no_client_certificate_is_refused(shard, pki):
    fake, gw = shard
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.load_verify_locations(str(pki.dir / "ca.pem"))
    with socket.create_connection(_addr(gw), timeout=5) as raw:
        s = TlsStream(raw, ctx, server_side=False, server_hostname="127.0.0.1")
        s.handshake(5)  # TLS 1.3: the client finishes first, the server then refuses
        with pytest.raises((ssl.SSLError, ConnectionError, OSError)):
            data = s.recv(100)
            if not data:
                raise ConnectionError("closed")
    assert fake.n_connections == 0


def test_a_second_client_is_told_busy_at_once(shard, pki):
    fake, gw = shard
    first, st1 = connect(_addr(gw), pki)
    with first:
        assert st1.ready
        t0 = time.monotonic()
        second, st2 = connect(_addr(gw), pki)
        with second:
            assert not st2.ready and st2.instance == gw.instance
            assert wait_closed(second, 5.0) < 5.0
        assert time.monotonic() - t0 < 2.0
        assert handshake(first, gw.endpoint).n_devices == 1  # the first is unaffected
    assert fake.n_connections == 1
    # once the first is gone the next one is served
    deadline = time.monotonic() + 3
    while True:
        third, st3 = connect(_addr(gw), pki)
        with third:
            if st3.ready:
                break
        assert time.monotonic() < deadline
        time.sleep(0.05)


def test_authenticated_malformed_requests_are_cut_before_forwarding(shard, pki):
    fake, gw = shard
    rng = random.Random(1)
    sessions = bad_sessions(rng)
    forwarded_before = 0
    for data in sessions:
        end = time.monotonic() + 3
        while True:
            stream, st = connect(_addr(gw), pki)
            if st.ready:
                break
            stream.close()
            assert time.monotonic() < end, "gateway stayed busy"
            time.sleep(0.02)
        with stream:
            _send_and_drain(stream, data)  # the fake answers HELLO; then the cut
        forwarded_before += 1
    deadline = time.monotonic() + 3
    while fake.n_connections < len(sessions) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert gw.stats["frame_errors"] >= len(sessions) - 10  # random tails may frame by chance
    for raw in fake.raw:  # whatever reached the RPC server is well-framed and in bounds
        RequestChecker().feed(bytes(raw))
    # still serving
    stream, st = connect(_addr(gw), pki)
    with stream:
        assert st.ready and handshake(stream, gw.endpoint).alignment == 32


def _send_and_drain(stream, data: bytes) -> None:
    """Send ``data`` and read until the other side closes (errors are a close too)."""
    try:
        stream.sendall(data)
        while stream.recv(65536):
            pass
    except OSError:
        pass


def _chunked(chk, stream: bytes, rng: random.Random, most: int) -> bytes:
    """What ``chk`` forwards of ``stream`` fed in random chunks of 1..``most`` bytes."""
    out, i = b"", 0
    while i < len(stream):
        n = rng.randint(1, most)
        out += chk.feed(stream[i:i + n])
        i += n
    return out


def test_request_checker_passes_legit_streams_in_any_chunking():
    rng = random.Random(2)
    frames = [hello(), request(RPC_DEVICE_COUNT), request(RPC_GET_ALIGNMENT, bytes(4)),
              request(RPC_SET_TENSOR, rng.randbytes(SET_TENSOR_HEADER + 1000)),
              request(RPC_GRAPH_COMPUTE, rng.randbytes(GRAPH_HEADER + 296 * 3))]
    frames += [request(c, bytes(n)) for c, n in REQUEST_SIZES.items() if c != RPC_CMD_HELLO]
    stream = b"".join(frames)
    for _ in range(50):
        assert _chunked(RequestChecker(), stream, rng, 700) == stream
    with pytest.raises(FrameError, match="HELLO"):
        RequestChecker().feed(request(RPC_DEVICE_COUNT))
    chk = RequestChecker()
    assert chk.feed(hello()[:5]) == b""  # a header is held back until complete and checked
    with pytest.raises(FrameError, match="second HELLO"):
        chk.feed(hello()[5:] + hello())


def test_gateway_survives_a_flood_of_connections(shard, pki):
    """More simultaneous strangers than it runs handshakes for: the extra ones are closed
    at once, and an authenticated client still gets through afterwards."""
    _, gw = shard
    socks = [socket.create_connection(_addr(gw), timeout=5) for _ in range(gw.max_pending + 8)]
    try:
        time.sleep(0.3)
        closed = 0
        for s in socks:
            s.settimeout(0.01)
            try:
                if s.recv(1) == b"":
                    closed += 1
            except TimeoutError:
                pass
            except OSError:
                closed += 1
        assert closed >= 8
    finally:
        for s in socks:
            s.close()
    end = time.monotonic() + 6
    while True:  # the held handshakes time out, then the slots are free again
        try:
            stream, st = connect(_addr(gw), pki, timeout_s=2)
            with stream:
                if st.ready:
                    break
        except ShardError:
            pass
        assert time.monotonic() < end
        time.sleep(0.1)


def test_tls_stream_one_reader_one_writer_thread(shard, pki):
    """Full duplex through one TlsStream from two threads (as the relays pump): a large
    SET_TENSOR-like stream up while replies come down, nothing lost or reordered."""
    fake, gw = shard
    stream, st = connect(_addr(gw), pki)
    with stream:
        assert st.ready
        stream.sendall(hello())
        assert len(recv_exact(stream, 8 + 28)) == 36
        n = 200
        got = []

        def read() -> None:
            for _ in range(n):
                got.append(recv_exact(stream, 8 + 4))

        t = threading.Thread(target=read)
        t.start()
        blob = request(RPC_SET_TENSOR, bytes(SET_TENSOR_HEADER + 100_000))
        for _ in range(n):
            stream.sendall(request(RPC_DEVICE_COUNT))
            stream.sendall(blob)
        t.join(timeout=30)
        assert len(got) == n and all(g == got[0] for g in got)
    assert sum(1 for c, _ in fake.received[0] if c == RPC_SET_TENSOR) == n


def test_the_bounds_let_the_largest_v4_flash_tensor_through():
    """SET_TENSOR's bound is chosen from legit traffic: every V4-Flash tensor a shard
    holds (token_embd stays on the client) passes, and with room for BF16 experts."""
    from mtplib.model.arch import ggml_nbytes, sidecar_tensors, trunk_tensors
    from mtplib.model.presets import get_preset

    cfg = get_preset("v4-flash")
    specs = [t for t in trunk_tensors(cfg) + sidecar_tensors(cfg) if t.kind != "token_embd"]
    biggest = max(specs, key=lambda t: t.nbytes)
    assert biggest.nbytes == 1140850688 and biggest.dtype == "MXFP4"  # routed experts
    chk = RequestChecker()
    chk.feed(hello())
    chk.check(RPC_SET_TENSOR, SET_TENSOR_HEADER + ggml_nbytes("BF16", biggest.ne))
    with pytest.raises(FrameError):
        chk.check(RPC_SET_TENSOR, SET_TENSOR_HEADER + RpcLimits().max_tensor_bytes + 1)


def test_a_flood_does_not_flood_the_log(pki):
    lines: list[str] = []
    with FakeShard() as fake, Gateway(("127.0.0.1", 0), fake.addr, pki,
                                      log=lines.append) as gw:
        for _ in range(60):
            send_and_time_close(_addr(gw), b"\x00" * 16)
        assert gw.stats["handshake_failed"] == 60
    assert 1 <= len(lines) <= 21


def test_strangers_cannot_hold_the_shard(shard, pki):
    """Upstream serves one client and never times out, so one idle connection used to hold
    a shard: behind the gateway, idle and half-handshaken strangers do not take the slot."""
    _, gw = shard
    with socket.create_connection(_addr(gw), timeout=5) as idle, \
            socket.create_connection(_addr(gw), timeout=5) as half:
        half.sendall(client_hello()[:20])
        stream, st = connect(_addr(gw), pki)
        with stream:
            assert st.ready
            assert handshake(stream, gw.endpoint).n_devices == 1
        assert idle.fileno() >= 0 and half.fileno() >= 0



# -- issue 30 item 4: no number of idle or slow strangers keeps a client out -------------
def _strangers(gw: Gateway, n: int, *, slow_every: int = 0, source: str = "127.0.0.1"
               ) -> list[socket.socket]:
    """``n`` connections that never finish a handshake (loopback only): idle ones, and
    with ``slow_every`` every k-th has sent the start of a ClientHello and stalls."""
    ch, out = client_hello(), []
    for i in range(n):
        s = socket.create_connection(_addr(gw), timeout=5, source_address=(source, 0))
        if slow_every and i % slow_every == 0:
            with contextlib.suppress(OSError):
                s.sendall(ch[:7])
        out.append(s)
    return out


def _served(gw: Gateway, pki: TlsConfig) -> float:
    """Seconds for an authenticated client to be served (ready + upstream's HELLO)."""
    t0 = time.monotonic()
    stream, st = connect(_addr(gw), pki, timeout_s=5)
    with stream:
        assert st.ready and handshake(stream, gw.endpoint).n_devices == 1
    return time.monotonic() - t0


def test_200_idle_and_slow_strangers_do_not_keep_the_client_out(shard, pki):
    """200 connections on loopback that never send a byte (every 4th: a stalled
    ClientHello), all held open by the stranger: the client is served at once, twice (the
    second time with more strangers arriving after the first), and none of them is ever
    handed to the RPC server."""
    fake, gw = shard
    held: list[socket.socket] = []
    try:
        held += _strangers(gw, 100, slow_every=4)
        assert _served(gw, pki) < 3.0
        held += _strangers(gw, 100, slow_every=4)
        assert _served(gw, pki) < 3.0
        assert fake.n_connections == 2  # the client's two sessions, no stranger's
        with gw._lock:
            assert len(gw._pending) <= gw.max_per_source  # all from one address
        assert gw.stats["evicted"] >= 200 - 2 * gw.max_per_source
    finally:
        for s in held:
            s.close()


def test_a_flood_from_one_address_evicts_only_its_own(shard, pki):
    """Strangers from 127.0.0.2 hold at most max_per_source handshakes, however many
    connect; a client on 127.0.0.1 whose handshake is pending is not the one evicted."""
    fake, gw = shard
    held: list[socket.socket] = []
    try:
        own = socket.create_connection(_addr(gw), timeout=5)  # 127.0.0.1, idle, pending
        held.append(own)
        held += _strangers(gw, 60, source="127.0.0.2")
        time.sleep(0.2)
        with gw._lock:
            by_source = [p.source for p in gw._pending.values()]
        assert by_source.count("127.0.0.2") <= gw.max_per_source
        assert "127.0.0.1" in by_source  # not evicted by the other address's flood
        assert _served(gw, pki) < 3.0
    finally:
        for s in held:
            s.close()


def test_the_oldest_pending_handshake_is_evicted_first(pki):
    with FakeShard() as fake, Gateway(("127.0.0.1", 0), fake.addr, pki, log=lambda s: None,
                                      max_pending=4, max_per_source=4) as gw:
        socks = [socket.create_connection(_addr(gw), timeout=5) for _ in range(6)]
        try:
            assert wait_closed(socks[0], 2.0) < 2.0 and wait_closed(socks[1], 2.0) < 2.0
            for s in socks[2:]:  # the four newest still wait for their handshake
                s.settimeout(0.2)
                with pytest.raises(TimeoutError):
                    s.recv(1)
            assert gw.stats["evicted"] == 2
        finally:
            for s in socks:
                s.close()



# -- issue 31 item 2: peer links through the gateway ------------------------------------
def _answer_peers(i: int, cmd: int, payload: bytes) -> bytes | None:
    """A 7.2 server's yes to PEER_EXPECT, PEER_CONNECT and PEER_HELLO."""
    return reply(b"\x01") if cmd in (RPC_PEER_EXPECT, RPC_PEER_CONNECT, RPC_PEER_HELLO) \
        else None


@pytest.fixture
def shard72(pki):
    """A FakeShard that serves its connections at once (a client and peer links), behind
    a Gateway."""
    fake = FakeShard(_answer_peers, concurrent=True)
    gw = Gateway(("127.0.0.1", 0), fake.addr, pki, log=lambda s: None).start()
    yield fake, gw
    gw.close()
    fake.close()


def _client(gw: Gateway, pki: TlsConfig) -> TlsStream:
    """A served client session (its HELLO answered), held open by the caller."""
    stream, st = connect(_addr(gw), pki)
    assert st.ready and GATEWAY_PEER in st.features
    assert handshake(stream, gw.endpoint).n_devices == 1
    return stream


def _still_served(stream: TlsStream) -> None:
    stream.sendall(request(RPC_DEVICE_COUNT))
    assert recv_exact(stream, 12)[8:] == b"\x01\x00\x00\x00"


def _wait_for(cond, timeout_s: float = 3.0) -> None:
    end = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < end
        time.sleep(0.02)


def test_peer_checker_passes_hello_then_pushes_in_any_chunking():
    rng = random.Random(4)
    stream = peer_hello(3, rng.randbytes(16)) + b"".join(peer_push(i, rng.randint(0, 900))
                                                         for i in range(1, 30))
    for _ in range(30):
        assert _chunked(PeerChecker(), stream, rng, 500) == stream
    for bad, why in ((hello(), "not PEER_HELLO"), (peer_push(), "not PEER_HELLO"),
                     (request(RPC_PEER_HELLO, bytes(21)), "PEER_HELLO with 21"),
                     (peer_hello() + peer_hello(), "after PEER_HELLO only PEER_PUSH"),
                     (peer_hello() + request(RPC_DEVICE_COUNT), "command 15 on a peer"),
                     (peer_hello() + request(25, bytes(10)), "PEER_PUSH of 10 bytes")):
        with pytest.raises(FrameError, match=why):
            PeerChecker().feed(bad)
    chk = PeerChecker(RpcLimits(max_push_bytes=100))
    chk.feed(peer_hello() + peer_push(1, 100))
    with pytest.raises(FrameError, match="PEER_PUSH of"):
        chk.feed(peer_push(2, 101))


def test_the_client_path_refuses_a_peers_commands():
    for cmd in (RPC_PEER_HELLO, 25):  # PEER_HELLO, PEER_PUSH: a shard's, never a client's
        with pytest.raises(FrameError, match=f"unknown command {cmd}"):
            RequestChecker().feed(hello() + request(cmd, bytes(20)))


def test_a_peer_link_needs_a_certificate_and_a_served_client(shard72, pki, other_pki):
    """No client served: a peer with a good certificate is refused before anything reaches
    the RPC server. A client served: peers without a certificate, or with another CA's,
    are refused at the handshake; none of them reaches the RPC server."""
    fake, gw = shard72
    s = peer_stream(_addr(gw), pki)
    with s:
        s.sendall(peer_hello())
        assert wait_closed(s, 3.0) < 3.0
    assert gw.stats["peer_refused"] == 1 and fake.n_connections == 0
    client = _client(gw, pki)
    with client:
        ctxs = []
        for cert in (None, other_pki.dir):  # no certificate; one of another CA
            ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
            ctx.load_verify_locations(str(pki.dir / "ca.pem"))  # it trusts this shard
            if cert is not None:
                ctx.load_cert_chain(str(cert / "shard.pem"), str(cert / "shard.key"))
            ctx.set_alpn_protocols([PEER_ALPN])
            ctxs.append(ctx)
        for ctx in ctxs:
            with socket.create_connection(_addr(gw), timeout=5) as raw:
                t = TlsStream(raw, ctx, server_side=False, server_hostname="127.0.0.1")
                with contextlib.suppress(ssl.SSLError, OSError):
                    t.handshake(5)  # TLS 1.3: the client finishes, the server then refuses
                    t.sendall(peer_hello())
                    while t.recv(100):
                        pass
        _wait_for(lambda: gw.stats["handshake_failed"] == 2)
        assert fake.n_connections == 1  # the client's, nothing of the peers'
        _still_served(client)


def test_a_shards_own_certificate_opens_no_client_session(shard72, pki):
    """The shard certificate acts as a TLS client (for peer links) but is refused the
    client path: a shard cannot become another shard's client."""
    fake, gw = shard72
    sock = socket.create_connection(_addr(gw), timeout=5)
    ctx = pki.peer_context()
    ctx.set_alpn_protocols(["http/1.1"])  # no PEER_ALPN: the client path
    with TlsStream(sock, ctx, server_side=False, server_hostname="127.0.0.1") as s:
        s.handshake(5)
        assert s.alpn() is None
        assert wait_closed(s, 3.0) < 3.0
    assert gw.stats["shard_cert_as_client"] == 1 and fake.n_connections == 0


def test_authenticated_malformed_peer_streams_are_cut_before_forwarding(shard72, pki):
    """The corpus for the peer path: anything but PEER_HELLO first, a client command, a
    push out of bounds or random bytes closes that peer link, nothing of the bad frame is
    forwarded, and the served client's session goes on."""
    fake, gw = shard72
    sessions = bad_peer_sessions(random.Random(5))
    client = _client(gw, pki)
    with client:
        for data in sessions:
            with peer_stream(_addr(gw), pki) as s:
                _send_and_drain(s, data)  # the fake answers PEER_HELLO; then the cut
        _wait_for(lambda: fake.n_connections == 1 + len(sessions)
                  and gw.stats["peer_sessions"] == len(sessions))
        assert gw.stats["peer_frame_errors"] >= len(sessions) - 10
        for raw in fake.raw[1:]:  # whatever reached the RPC server from peers is well-framed
            PeerChecker().feed(bytes(raw))
        assert not any(raw[:1] == bytes([RPC_CMD_HELLO]) for raw in fake.raw[1:])
        _still_served(client)
        # and a good peer link is forwarded whole
        good = peer_hello(9, bytes(range(16))) + peer_push(1, 1000) + peer_push(2, 10)
        with peer_stream(_addr(gw), pki) as s:
            s.sendall(good)
            assert recv_exact(s, 9) == reply(b"\x01")
            _wait_for(lambda: fake.n_connections == 2 + len(sessions)
                      and len(fake.raw[-1]) == len(good))
        assert bytes(fake.raw[-1]) == good
    # the client gone, its peer links end with it and new ones are refused
    _wait_for(lambda: gw._active is None)
    with peer_stream(_addr(gw), pki) as s:
        s.sendall(peer_hello())
        assert wait_closed(s, 3.0) < 3.0
