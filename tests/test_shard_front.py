"""Issue 39 item 7: a plaintext shard (`shard serve` without --tls) bounds the connections
that never open an RPC session. Upstream's RPC server holds a thread for every connection
it accepts, for as long as it stays open: 400 idle connections were 403 threads, held
forever, and rapid connects waited for SYN retries. The shard's plaintext front
(`PlainFront`, the TLS gateway's door without TLS) closes a connection whose first request
header (HELLO, or a peer link's PEER_HELLO) does not come within 3 s, evicts the oldest
pending one beyond its bounds, and passes the rest to upstream unchanged.

The front runs first over a fake RPC server in seconds; then a real shard (slow)."""

from __future__ import annotations

import socket
import time
from pathlib import Path

import pytest
from rpc_fakes import FakeShard, hello, peer_hello, request, wait_closed

from mtplib.distributed.plain_front import PlainFront
from mtplib.distributed.processes import LocalShards
from mtplib.runtime.rpc import RPC_DEVICE_COUNT, handshake

PROMPT = [5, 6, 7, 8, 9]
N_NEW = 12


@pytest.fixture
def front():
    """A FakeShard (serving connections at once, as a 7.2 server) behind a PlainFront."""
    fake = FakeShard(concurrent=True)
    f = PlainFront(("127.0.0.1", 0), fake.addr, log=lambda s: None).start()
    yield fake, f
    f.close()
    fake.close()


def _addr(f: PlainFront) -> tuple[str, int]:
    host, port = f.endpoint.split(":")
    return host, int(port)


def test_silent_slow_and_foreign_connections_are_closed_without_reaching_the_server(front):
    fake, f = front
    with socket.create_connection(_addr(f), timeout=5) as idle, \
            socket.create_connection(_addr(f), timeout=5) as slow, \
            socket.create_connection(_addr(f), timeout=5) as foreign:
        slow.sendall(hello()[:4])  # then nothing: a header that never completes
        foreign.sendall(request(RPC_DEVICE_COUNT))  # not HELLO: closed at once
        assert wait_closed(foreign, 2.0) < 1.0
        assert wait_closed(idle, 5.0) < 3.5 and wait_closed(slow, 5.0) < 3.5
    st = f.stats
    assert (st["pre_hello_timeout"], st["hello_timeout"], st["not_hello"]) == (1, 1, 1), st
    assert fake.n_connections == 0  # not one of them reached the RPC server
    # a client and a peer link pass, their bytes unchanged
    with socket.create_connection(_addr(f), timeout=5) as c:
        assert handshake(c, f.endpoint).n_devices == 1
        with socket.create_connection(_addr(f), timeout=5) as p:
            p.sendall(peer_hello())
            deadline = time.monotonic() + 5
            while len(fake.raw) < 2 or bytes(fake.raw[1]) != peer_hello():
                assert time.monotonic() < deadline, fake.raw
                time.sleep(0.02)
    assert fake.received[0][0][0] == hello()[0] and fake.n_connections == 2
    assert (st["sessions"], st["peer_sessions"]) == (1, 1), st


def test_200_idle_connections_do_not_keep_a_client_out(front):
    """200 connections from one address that never send a byte: at most max_per_source
    wait at once (the rest are evicted, closed at once), and a client is served at once."""
    fake, f = front
    held = []
    try:
        for _ in range(200):
            held.append(socket.create_connection(_addr(f), timeout=5))
        t0 = time.monotonic()
        with socket.create_connection(_addr(f), timeout=5) as c:
            assert handshake(c, f.endpoint).n_devices == 1
        assert time.monotonic() - t0 < 3.0
        with f._lock:
            assert len(f._pending) <= f.max_per_source
        assert f.stats["evicted"] >= 200 - 2 * f.max_per_source
        assert fake.n_connections == 1
        for s in held:  # every one closed by the front, by eviction or its deadline
            assert wait_closed(s, 5.0) < 5.0
    finally:
        for s in held:
            s.close()


# -- a real shard ----------------------------------------------------------------------------
def _threads(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Threads:"):
            return int(line.split()[1])
    raise AssertionError(f"no Threads line for {pid}")


def _settled_threads(pid: int, timeout_s: float = 10.0) -> int:
    """The shard's thread count once it stopped changing for a second."""
    t0, last, since = time.monotonic(), _threads(pid), time.monotonic()
    while time.monotonic() - since < 1.0:
        assert time.monotonic() - t0 < timeout_s, "the thread count does not settle"
        time.sleep(0.1)
        now = _threads(pid)
        if now != last:
            last, since = now, time.monotonic()
    return last


@pytest.mark.slow
def test_400_idle_connections_to_a_plaintext_shard_are_closed_and_its_threads_return(pair):
    """400 idle connections to a real `shard serve` (plaintext): every connect is quick (no
    listen-queue wait), the shard closes every one within the 3 s deadline, its thread count
    comes back to its baseline, and a ranged generation through it afterwards (new
    connections, a ring's peer link where the build has one) gives the tokens it gave
    before."""
    from mtplib.distributed.ranged_mtp import RangedMTP

    with LocalShards(2) as sh:
        with RangedMTP(str(pair.trunk), plan="0-1,2-3", endpoints=sh.endpoints) as r:
            want, _ = r.generate(PROMPT, N_NEW)
        pid = sh.pids()[1]
        base = _settled_threads(pid)
        host, port = sh.endpoints[1].split(":")
        held, slowest = [], 0.0
        try:
            for _ in range(400):
                t0 = time.monotonic()
                held.append(socket.create_connection((host, int(port)), timeout=10))
                slowest = max(slowest, time.monotonic() - t0)
            deadline = time.monotonic() + 3.0 + 2.0  # the front's deadline, and a margin
            for s in held:
                wait_closed(s, max(0.1, deadline - time.monotonic()))
        finally:
            for s in held:
                s.close()
        assert slowest < 0.9, f"a connect waited {slowest:.2f} s (listen queue)"
        t0 = time.monotonic()
        while (n := _threads(pid)) > base:
            assert time.monotonic() - t0 < 5, f"{n} threads, {base} before the connections"
            time.sleep(0.1)
        assert all(sh.alive())
        with RangedMTP(str(pair.trunk), plan="0-1,2-3", endpoints=sh.endpoints) as r:
            got, _ = r.generate(PROMPT, N_NEW)
            seam = r.seam_summary()
        assert got == want
        if seam["seam"] == "ring":  # the peer link into shard 1 passed its front
            assert seam["links"] and all(x["seam"] == "ring" for x in seam["links"]), seam
