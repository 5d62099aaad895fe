"""The counting relay on its own: byte counts per step, RPC framing, close propagation.

Relays fed bytes that are not RPC run with ``check_replies=False`` (the reply checks have
their tests in test_tls.py)."""

import socket
import struct
import threading
import time

import pytest

from mtplib.distributed.relay import (
    RPC_TENSOR_SIZE,
    CountingRelay,
    RelaySet,
    WanLink,
    parse_wan,
    summed,
)
from mtplib.errors import InputError
from mtplib.runtime import rpc
from mtplib.runtime.links import default_peer_links, parse_peer_wan
from mtplib.runtime.rpc import RPC_PEER_HELLO, ShardError, recv_exact


class Echo:
    """A loopback server answering every chunk with ``reply(chunk)`` (on up to
    ``n_conns`` connections, one after another accepted, each served on its own thread)."""

    def __init__(self, reply=lambda b: b, n_conns: int = 1) -> None:
        self.srv = socket.create_server(("127.0.0.1", 0))
        self.srv.settimeout(5)
        self.endpoint = f"127.0.0.1:{self.srv.getsockname()[1]}"
        self.reply = reply
        self.conns: list[socket.socket] = []
        self.n_conns = n_conns
        self.t = threading.Thread(target=self._run, daemon=True)
        self.t.start()

    def _run(self) -> None:
        for _ in range(self.n_conns - 1):
            try:
                c, _ = self.srv.accept()
            except OSError:
                return
            self.conns.append(c)
            threading.Thread(target=self._serve, args=(c,), daemon=True).start()
        try:
            c, _ = self.srv.accept()
        except OSError:
            return
        self.conns.append(c)
        self._serve(c)

    def _serve(self, c: socket.socket) -> None:
        c.settimeout(5)
        try:
            while data := c.recv(65536):
                out = self.reply(data)
                if out:
                    c.sendall(out)
        except OSError:
            pass

    def close(self) -> None:
        for c in self.conns:
            try:
                c.shutdown(socket.SHUT_RDWR)  # wakes the blocked recv
            except OSError:
                pass
            c.close()
        self.srv.close()
        self.t.join(timeout=5)


def test_counts_per_step_and_both_directions():
    echo = Echo()
    with CountingRelay(echo.endpoint, check_replies=False) as r:
        s = socket.create_connection(("127.0.0.1", int(r.endpoint.split(":")[1])), timeout=5)
        with r.step("a"):
            s.sendall(b"x" * 1000)
            recv_exact(s, 1000)
        with r.step("b"):
            s.sendall(b"y" * 10)
            recv_exact(s, 10)
        snap = r.snapshot()
        assert (snap["a"]["up"], snap["a"]["down"]) == (1000, 1000)
        assert (snap["b"]["up"], snap["b"]["down"]) == (10, 10)
        assert r.total() == 2020
        s.close()
    echo.close()


def test_rpc_framing_is_sorted_into_data_graph_control():
    # a SET_TENSOR (no reply) with 100 data bytes, then a GET_TENSOR answered with 64
    desc = bytearray(RPC_TENSOR_SIZE)
    desc[228:228 + 5] = b"t_in\0"
    set_payload = bytes(desc) + b"\0" + struct.pack("<Q", 0) + b"d" * 100
    get_desc = bytearray(RPC_TENSOR_SIZE)
    get_desc[228:228 + 6] = b"t_out\0"
    get_payload = bytes(get_desc) + struct.pack("<QQ", 0, 64)
    graph_payload = b"g" * 50
    msgs = (bytes([6]) + struct.pack("<Q", len(set_payload)) + set_payload
            + bytes([10]) + struct.pack("<Q", len(graph_payload)) + graph_payload
            + bytes([8]) + struct.pack("<Q", len(get_payload)) + get_payload)
    seen = bytearray()

    def reply(b: bytes) -> bytes:
        seen.extend(b)
        return struct.pack("<Q", 64) + b"r" * 64 if len(seen) == len(msgs) else b""

    echo = Echo(reply)
    with CountingRelay(echo.endpoint) as r:
        s = socket.create_connection(("127.0.0.1", int(r.endpoint.split(":")[1])), timeout=5)
        with RelaySet([r]).step("s"):
            for i in range(0, len(msgs), 7):  # framing must survive arbitrary chunking
                s.sendall(msgs[i:i + 7])
            recv_exact(s, 72)
        c = r.snapshot()["s"]
        assert c["data"] == 100 + 64 and c["graph"] == 50 and c["unparsed"] == 0
        assert c["data"] + c["graph"] + c["control"] == c["up"] + c["down"]
        assert r.tensors["s"] == {("up", "t_in"): 100, ("down", "t_out"): 64}
        assert c["waits"] == 1  # the GET is answered; SET and GRAPH_COMPUTE are not
        s.close()
    echo.close()


def _get_request(name: bytes, size: int) -> bytes:
    desc = bytearray(RPC_TENSOR_SIZE)
    desc[228:228 + len(name) + 1] = name + b"\0"
    payload = bytes(desc) + struct.pack("<QQ", 0, size)
    return bytes([8]) + struct.pack("<Q", len(payload)) + payload


def test_pipelined_gets_are_one_wait_sequential_gets_two():
    """Two GET_TENSORs sent before either is answered (the patched client's batched
    boundary reads, patches/0002) cost one round trip; one after the other's reply, two."""
    one = _get_request(b"a", 8)
    seen = bytearray()

    def reply(b: bytes) -> bytes:  # one 8-byte answer per complete request
        before = len(seen) // len(one)
        seen.extend(b)
        return (len(seen) // len(one) - before) * (struct.pack("<Q", 8) + b"r" * 8)

    echo = Echo(reply)
    with CountingRelay(echo.endpoint, link=WanLink(20)) as r:
        s = socket.create_connection(("127.0.0.1", int(r.endpoint.split(":")[1])), timeout=5)
        with r.step("pipelined"):
            s.sendall(one + one)
            recv_exact(s, 32)
        with r.step("sequential"):
            for _ in range(2):
                s.sendall(one)
                recv_exact(s, 16)
        snap = r.snapshot()
        assert (snap["pipelined"]["waits"], snap["sequential"]["waits"]) == (1, 2)
        assert snap["pipelined"]["data"] == snap["sequential"]["data"] == 16
        # each wait under the command that opened it, by upstream's name
        rs = RelaySet([r])
        assert rs.waits_by_command("pipelined") == [{"GET_TENSOR": 1}]
        assert rs.waits_by_command("sequential") == [{"GET_TENSOR": 2}]
        assert rs.waits_by_command("sequential", peer=True) == [{}]
        assert rs.waits_by_command("never") == [{}]
        r.reset()
        assert rs.waits_by_command("sequential") == [{}]
        assert summed([{"GET_TENSOR": 1}, {"GET_TENSOR": 2, "GET_ALLOC_SIZE": 5}]) == {
            "GET_ALLOC_SIZE": 5, "GET_TENSOR": 3}
        s.close()
    echo.close()


def test_command_names_are_the_command_numbers():
    """Each name RPC_COMMAND_NAMES gives is the module's constant of that number."""
    names = rpc.RPC_COMMAND_NAMES
    assert len(names) == len(set(names.values())) == rpc.RPC_N_COMMANDS + 2
    assert names[rpc.RPC_CMD_HELLO] == "HELLO"
    for i, n in names.items():
        if n != "HELLO":
            assert getattr(rpc, "RPC_" + n) == i, n


def test_upstream_close_closes_client_and_is_recorded():
    echo = Echo()
    with CountingRelay(echo.endpoint, check_replies=False) as r:
        s = socket.create_connection(("127.0.0.1", int(r.endpoint.split(":")[1])), timeout=5)
        s.sendall(b"hi")
        recv_exact(s, 2)
        echo.close()  # the "shard" dies
        assert s.recv(10) == b""  # the client sees EOF at once, no hang
        assert r.lost_by_shard()
        s.close()


def test_relay_refuses_non_loopback_upstream():
    with pytest.raises(ShardError, match="not loopback"):
        CountingRelay("192.0.2.1:5000")


# -- WAN emulation ---------------------------------------------------------------------------
def _round_trip(relay_endpoint: str, payload: bytes) -> float:
    s = socket.create_connection(("127.0.0.1", int(relay_endpoint.split(":")[1])), timeout=5)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    t0 = time.monotonic()
    s.sendall(payload)
    recv_exact(s, len(payload))
    dt = time.monotonic() - t0
    s.close()
    return dt


def test_wan_delay_adds_one_rtt_per_round_trip():
    echo = Echo()
    with CountingRelay(echo.endpoint, check_replies=False, link=WanLink(80.0)) as r:
        dt = _round_trip(r.endpoint, b"x" * 100)
    echo.close()
    assert 0.078 <= dt < 0.3, dt


def test_wan_back_to_back_chunks_are_pipelined_not_serialised():
    """Ten messages sent at once arrive after about one RTT, not ten."""
    echo = Echo()
    with CountingRelay(echo.endpoint, check_replies=False, link=WanLink(60.0)) as r:
        s = socket.create_connection(("127.0.0.1", int(r.endpoint.split(":")[1])), timeout=5)
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        t0 = time.monotonic()
        for _ in range(10):
            s.sendall(b"m" * 50)
            time.sleep(0.002)
        recv_exact(s, 500)
        dt = time.monotonic() - t0
        s.close()
    echo.close()
    assert 0.058 <= dt < 0.2, dt


def test_wan_bandwidth_cap_paces_bytes():
    """1 MB at 80 Mbit/s takes at least 0.1 s to pass the link (the echo streams it back as it
    arrives, so the two directions overlap); uncapped it takes a few ms."""
    echo = Echo()
    with CountingRelay(echo.endpoint, check_replies=False, link=WanLink(0.0, 80.0)) as r:
        dt = _round_trip(r.endpoint, b"b" * 1_000_000)
    echo.close()
    echo = Echo()
    with CountingRelay(echo.endpoint, check_replies=False) as r:
        fast = _round_trip(r.endpoint, b"b" * 1_000_000)
    echo.close()
    assert 0.099 <= dt < 1.0, dt
    assert fast < dt / 2, (fast, dt)


def test_parse_wan():
    assert parse_wan(None, 2) == [WanLink(), WanLink()]
    assert parse_wan("100", 3) == [WanLink(100.0)] * 3
    assert parse_wan("100:50,0", 2) == [WanLink(100.0, 50.0), WanLink(0.0)]
    assert not WanLink().active and WanLink(0, 10).active
    for bad, msg in [("1,2,3", "one per shard"), ("x", "not RTT_MS"), ("-5", "0..10000"),
                     ("10:0", "> 0 Mbit"), ("nan", "0..10000")]:
        with pytest.raises(InputError, match=msg):
            parse_wan(bad, 2)


def test_parse_peer_wan():
    assert parse_peer_wan("10", 3) == [WanLink(10.0)] * 2
    assert parse_peer_wan("10,20:50", 3) == [WanLink(10.0), WanLink(20.0, 50.0)]
    for bad, n, msg in [("1,2,3", 3, "^--peer-wan '1,2,3': .* one per peer link \\(2 peer"),
                        ("x", 2, "^--peer-wan 'x': 'x' is not RTT_MS"),
                        ("-5", 2, "^--peer-wan '-5': WAN RTT must be in 0..10000"),
                        ("10", 1, "needs at least 2 shards")]:
        with pytest.raises(InputError, match=msg):
            parse_peer_wan(bad, n)


def test_a_peer_link_defaults_to_the_farther_of_its_two_shards():
    """Without --peer-wan a peer link gets the longer RTT and the lower cap of its two
    shards' client links: a tail next to the client (--wan 100,0) is 100 ms from the shard
    before it, not 0 (which would halve a ring step's time)."""
    assert default_peer_links(parse_wan("100,0", 2)) == [WanLink(100.0)]
    assert default_peer_links(parse_wan("0,100", 2)) == [WanLink(100.0)]
    assert default_peer_links(parse_wan("100:20,50,0:5", 3)) == [WanLink(100.0, 20.0),
                                                                 WanLink(50.0, 5.0)]
    assert default_peer_links(parse_wan("30", 3)) == [WanLink(30.0)] * 2
    assert default_peer_links(parse_wan(None, 1)) == []


def test_a_peer_link_gets_its_own_wan_and_a_client_link_keeps_its_own():
    """A connection whose first byte is PEER_HELLO (patches/0007's peer link) passes the
    relay's ``peer`` link; the client's connection its ``link``. Both at once, on one relay:
    the client at 200 ms, the peer at 20 ms (as --wan 200 --peer-wan 20)."""
    echo = Echo(n_conns=2)
    port = None
    with CountingRelay(echo.endpoint, check_replies=False) as r:
        r.set_link(WanLink(200.0), WanLink(20.0))
        port = int(r.endpoint.split(":")[1])
        client = _round_trip(r.endpoint, b"\x00" * 64)
        s = socket.create_connection(("127.0.0.1", port), timeout=5)
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        t0 = time.monotonic()
        s.sendall(bytes([RPC_PEER_HELLO]) + b"\x00" * 63)
        recv_exact(s, 64)
        peer = time.monotonic() - t0
        s.close()
        assert r.link_for("peer") == WanLink(20.0) and r.link_for("client") == WanLink(200.0)
        r.set_link(WanLink(30.0))  # no peer link given: a peer gets the shard's own
        assert r.link_for("peer") == WanLink(30.0)
    echo.close()
    assert 0.198 <= client < 0.5, client
    assert 0.019 <= peer < 0.15, peer


def test_step_counts_unanswered_bytes_sent_just_before_it_ends():
    """Bytes a step sends without waiting for an answer (upstream's SET_TENSOR, graph
    compute) are counted under that step, however soon the step ends: the boundary settles
    the relay (no socket readable, then no pump busy) before the label switches."""
    sink = Echo(reply=lambda b: b"")  # never answers
    with CountingRelay(sink.endpoint, check_replies=False) as r:
        s = socket.create_connection(("127.0.0.1", int(r.endpoint.split(":")[1])), timeout=5)
        for i in range(200):
            with r.step("a"):
                s.sendall(b"x" * (1 + i % 7))
            with r.step("b"):
                pass
        snap = r.snapshot()
        assert snap["a"]["up"] == sum(1 + i % 7 for i in range(200))
        assert "b" not in snap or snap["b"]["up"] == 0
        s.close()
    sink.close()


def test_step_boundary_does_not_wait_for_delayed_chunks():
    """Chunks held for the emulated WAN delay are counted on arrival, so closing a step
    costs microseconds, not the one-way delay (that was a measured 1 ms per relay per
    boundary, a third of a step's time on three local shards)."""
    sink = Echo(reply=lambda b: b"")
    with CountingRelay(sink.endpoint, check_replies=False, link=WanLink(400.0)) as r:
        s = socket.create_connection(("127.0.0.1", int(r.endpoint.split(":")[1])), timeout=5)
        t0 = time.monotonic()
        for _ in range(20):
            with r.step("a"):
                s.sendall(b"x" * 100)
        took = time.monotonic() - t0
        assert r.snapshot()["a"]["up"] == 2000
        assert took < 0.15, took  # one delayed chunk alone is held 200 ms
        s.close()
    sink.close()


def test_worker_flush_finds_loopback_connections_only():
    from mtplib.distributed import worker

    srv = socket.create_server(("127.0.0.1", 0))
    c = socket.create_connection(srv.getsockname(), timeout=5)
    a, _ = srv.accept()
    try:
        fds = worker._loopback_sockets()
        assert c.fileno() in fds and a.fileno() in fds
        assert srv.fileno() not in fds  # listening: no peer
        c.sendall(b"x" * 4096)
        t0 = time.monotonic()
        worker.flush_shard_sockets()
        assert time.monotonic() - t0 < 0.05
    finally:
        for s in (c, a, srv):
            s.close()


# -- allocation-size queries answered in the relay (a CPU shard) ---------------------------
def _alloc_size_query(device: int = 0) -> bytes:
    payload = struct.pack("<I", device) + bytes(RPC_TENSOR_SIZE * (1 + rpc.GGML_MAX_SRC))
    return bytes([rpc.RPC_GET_ALLOC_SIZE]) + struct.pack("<Q", len(payload)) + payload


def _set_tensor(n: int = 10) -> bytes:
    payload = bytes(RPC_TENSOR_SIZE) + b"\0" + struct.pack("<Q", 0) + b"d" * n
    return bytes([rpc.RPC_SET_TENSOR]) + struct.pack("<Q", len(payload)) + payload


@pytest.mark.parametrize("chunk", [1, 7, 4096])
def test_a_cpu_shards_alloc_size_queries_never_reach_it_and_cost_no_wait(chunk):
    """A relay told its shard serves the CPU answers GET_ALLOC_SIZE itself (0: upstream's
    client takes max(answer, ggml_nbytes), the CPU shard's own answer), across any chunking,
    over an emulated WAN; the requests around it reach the shard unchanged."""
    seen = bytearray()
    echo = Echo(lambda b: seen.extend(b) or b"")
    msgs = _set_tensor() + _alloc_size_query()
    with CountingRelay(echo.endpoint, link=WanLink(1000), answer_alloc_sizes=True) as r:
        s = socket.create_connection(("127.0.0.1", int(r.endpoint.split(":")[1])), timeout=5)
        t0 = time.monotonic()
        with r.step("q"):
            for i in range(0, len(msgs), chunk):
                s.sendall(msgs[i:i + chunk])
            assert recv_exact(s, 16) == struct.pack("<QQ", 8, 0)
        assert time.monotonic() - t0 < 0.5  # no round trip of the 1 s link
        s.sendall(_set_tensor(3))
        r.quiesce(3.0)
        assert bytes(seen) == _set_tensor() + _set_tensor(3)
        c = r.snapshot()["q"]
        assert c["waits"] == 0 and r.answered_here["q"] == 1
        assert c["up"] == len(_set_tensor()) and c["down"] == 0
        assert RelaySet([r]).answered_here("q") == [1]
        s.close()
    echo.close()


class _Shard:
    """Answers each complete request in order: a GET_TENSOR with its 8 bytes, a
    GET_ALLOC_SIZE with 4096; records what reached it."""

    def __init__(self) -> None:
        from mtplib.distributed.framing import HEADER, Framer

        self.frames, self.header, self.seen, self.cmds = Framer(requests=True), HEADER, \
            bytearray(), []

    def __call__(self, b: bytes) -> bytes:
        self.seen.extend(b)
        out = b""
        for kind, _, _ in self.frames.split(b):
            if kind == self.header:
                self.cmds.append(self.frames.cmd)
            if kind != "part" and self.frames.left == 0 and self.cmds:
                cmd = self.cmds[-1]
                out += (struct.pack("<Q", 8) + b"r" * 8 if cmd == rpc.RPC_GET_TENSOR
                        else struct.pack("<QQ", 8, 4096) if cmd == rpc.RPC_GET_ALLOC_SIZE
                        else b"")
        return out


@pytest.mark.parametrize("case", ["not a cpu shard", "device 1", "an answer owed",
                                  "another size"])
def test_alloc_size_queries_go_to_the_shard_unless_the_relay_may_answer(case):
    """Not told the shard is a CPU one, a device other than 0, a request of another size
    than upstream's, or an answer of the shard still owed (the reply would overtake it):
    the query goes to the shard, which answers it (a wait), in order."""
    shard = _Shard()
    echo = Echo(shard)
    query = _alloc_size_query(1 if case == "device 1" else 0)
    if case == "another size":  # not the query upstream sends: the shard's to judge
        query = bytes([rpc.RPC_GET_ALLOC_SIZE]) + struct.pack("<Q", 4) + bytes(4)
    first = _get_request(b"a", 8) if case == "an answer owed" else b""
    with CountingRelay(echo.endpoint, answer_alloc_sizes=case != "not a cpu shard") as r:
        s = socket.create_connection(("127.0.0.1", int(r.endpoint.split(":")[1])), timeout=5)
        with r.step("q"):
            s.sendall(first + query)  # pipelined: the query sent before the GET's answer
            if first:
                assert recv_exact(s, 16) == struct.pack("<Q", 8) + b"r" * 8
            assert recv_exact(s, 16) == struct.pack("<QQ", 8, 4096)
        r.quiesce(2.0)
        assert bytes(shard.seen) == first + query
        assert r.snapshot()["q"]["waits"] == 1 and r.answered_here["q"] == 0
        s.close()
    echo.close()
