"""Fake RPC peers on loopback for the TLS, gateway and hostile-shard tests (no upstream).

`FakeShard` speaks upstream's RPC framing well enough for the handshake: it answers
HELLO, DEVICE_COUNT, GET_ALIGNMENT, GET_MAX_SIZE and GET_DEVICE_MEMORY, each answer
replaceable per connection (a hostile shard), and records every request it received; with
``concurrent`` it serves every connection at once (as a 7.2 server takes peer links next to
its client). Like upstream's server it closes a connection whose first request is neither
HELLO nor PEER_HELLO (mtplib's report request, say) at once, and counts it in ``refused``,
not as a connection. `peer_stream` opens a peer link (a shard's gateway's side) through a
gateway. `TcpForward` is a plain TCP forward (as ``ssh -L`` or socat would be).
"""

from __future__ import annotations

import contextlib
import random
import socket
import ssl
import struct
import threading
import time
from collections.abc import Callable

from mtplib.distributed.framing import RpcLimits
from mtplib.distributed.tls import PEER_ALPN, TlsConfig, TlsStream
from mtplib.runtime.rpc import (
    GRAPH_HEADER,
    PEER_PUSH_HEADER,
    REQUEST_SIZES,
    RPC_CMD_HELLO,
    RPC_DEVICE_COUNT,
    RPC_GET_ALIGNMENT,
    RPC_GET_DEVICE_MEMORY,
    RPC_GET_MAX_SIZE,
    RPC_GRAPH_COMPUTE,
    RPC_N_COMMANDS,
    RPC_PEER_HELLO,
    RPC_PEER_PUSH,
    RPC_SET_TENSOR,
    SET_TENSOR_HEADER,
)


def reply(payload: bytes) -> bytes:
    return struct.pack("<Q", len(payload)) + payload


SANE = {
    RPC_CMD_HELLO: reply(bytes([7, 0, 0, 0]) + bytes(24)),
    RPC_DEVICE_COUNT: reply(struct.pack("<I", 1)),
    RPC_GET_ALIGNMENT: reply(struct.pack("<Q", 32)),
    RPC_GET_MAX_SIZE: reply(struct.pack("<Q", 1 << 40)),
    RPC_GET_DEVICE_MEMORY: reply(struct.pack("<QQ", 1 << 30, 2 << 30)),
}


def request(cmd: int, payload: bytes = b"") -> bytes:
    return bytes([cmd]) + struct.pack("<Q", len(payload)) + payload


def hello() -> bytes:
    return request(RPC_CMD_HELLO, bytes(24))


def peer_hello(link: int = 1, token: bytes = bytes(16)) -> bytes:
    """A peer link's first request (patches/0007): | link (4) | token (16) |."""
    return request(RPC_PEER_HELLO, struct.pack("<I", link) + token)


def peer_push(seq: int = 1, n: int = 64) -> bytes:
    """A PEER_PUSH frame: | seq (8) | rpc_tensor dst (296, zeros here) | n data bytes |."""
    return request(RPC_PEER_PUSH, struct.pack("<Q", seq) + bytes(PEER_PUSH_HEADER - 8 + n))


def peer_stream(addr: tuple[str, int], tls: TlsConfig, *, timeout_s: float = 5.0
                ) -> TlsStream:
    """A peer link into the gateway at ``addr`` as a shard's gateway opens one: mutual TLS
    with the shard's certificate (`TlsConfig.peer_context`), ALPN PEER_ALPN settled."""
    sock = socket.create_connection(addr, timeout=timeout_s)
    s = TlsStream(sock, tls.peer_context(), server_side=False, server_hostname=addr[0])
    s.handshake(timeout_s)
    assert s.alpn() == PEER_ALPN
    return s


class FakeShard:
    """A loopback RPC server that, like upstream's, serves one connection at a time (the
    next waits in the listen backlog); ``answer(conn_index, cmd, payload)`` returns the raw
    reply bytes (None: the sane one, b"": none). ``received[i]``: connection i's requests;
    ``raw[i]``: every byte it received."""

    def __init__(self, answer: Callable[[int, int, bytes], bytes | None] | None = None,
                 host: str = "127.0.0.1", concurrent: bool = False) -> None:
        self.answer = answer or (lambda i, cmd, payload: None)
        self.concurrent = concurrent
        self.srv = socket.create_server((host, 0))
        self.srv.settimeout(0.2)
        self.endpoint = f"{host}:{self.srv.getsockname()[1]}"
        self.addr = (host, self.srv.getsockname()[1])
        self.received: list[list[tuple[int, bytes]]] = []
        self.raw: list[bytearray] = []
        #: connections accepted, and those closed on a first request that is neither HELLO
        #: nor PEER_HELLO (``received`` and ``raw`` hold the others, once their first byte
        #: came, in that order)
        self.accepted = self.refused = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._conns: list[socket.socket] = []
        self.t = threading.Thread(target=self._run, daemon=True)
        self.t.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                c, _ = self.srv.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            self._conns.append(c)
            with self._lock:
                self.accepted += 1
            if self.concurrent:
                threading.Thread(target=self._serve, args=(c,), daemon=True).start()
            else:
                self._serve(c)

    def _first(self, c: socket.socket) -> int | None:
        """The connection's index once its first byte is HELLO or PEER_HELLO (as upstream's
        server judges it); None for anything else (counted in ``refused``) or for a
        connection closed without a byte (recorded, with nothing received)."""
        try:
            first = c.recv(1)
        except OSError:
            first = b""
        with self._lock:
            if first and first not in (bytes([RPC_CMD_HELLO]), bytes([RPC_PEER_HELLO])):
                self.refused += 1
                return None
            self.received.append([])
            self.raw.append(bytearray(first))
            return len(self.received) - 1 if first else None

    def _serve(self, c: socket.socket) -> None:
        i = self._first(c)
        if i is None:
            with contextlib.suppress(OSError):
                c.close()
            return
        raw = self.raw[i]
        pending = bytearray(raw)  # the first byte, already taken

        def take(n: int) -> bytes:
            buf = bytes(pending[:n])
            del pending[:n]
            while len(buf) < n:
                chunk = c.recv(min(n - len(buf), 1 << 20))
                if not chunk:
                    raise ConnectionError("closed")
                raw.extend(chunk)  # everything that reached this server, as it came
                buf += chunk
            return buf

        try:
            while True:
                hdr = take(9)
                (size,) = struct.unpack("<Q", hdr[1:])
                payload = take(size) if size <= 1 << 24 else b""
                if size > 1 << 24:  # not a request this fake handles: just keep reading
                    while c.recv(1 << 20):
                        pass
                    return
                self.received[i].append((hdr[0], payload))
                out = self.answer(i, hdr[0], payload)
                if out is None:
                    out = SANE.get(hdr[0], b"")
                if out:
                    c.sendall(out)
        except OSError:
            pass
        finally:
            with contextlib.suppress(OSError):
                c.close()

    @property
    def n_connections(self) -> int:
        """Connections that reached this server and were not refused (one still waiting
        for its first byte counts)."""
        with self._lock:
            return self.accepted - self.refused

    def close(self) -> None:
        self._stop.set()
        for c in self._conns:
            with contextlib.suppress(OSError):
                c.shutdown(socket.SHUT_RDWR)
        with contextlib.suppress(OSError):
            self.srv.close()
        self.t.join(timeout=2)

    def __enter__(self) -> FakeShard:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class TcpForward:
    """A plain TCP forward on a loopback port of its own to ``target`` (as ``ssh -L``,
    socat or a container's port mapping would be), each connection in threads of its own.
    ``on_first(header)``: called with a connection's first 9 bytes; bytes returned are
    sent back instead and the connection is closed (nothing reaches ``target``: a forward
    that answers itself, garbage or a tampered report), None passes it on. ``target``
    None: every connection gets ``on_first``'s answer."""

    def __init__(self, target: tuple[str, int] | None,
                 on_first: Callable[[bytes], bytes | None] | None = None) -> None:
        self.target, self.on_first = target, on_first
        self.srv = socket.create_server(("127.0.0.1", 0))
        self.srv.settimeout(0.2)
        self.addr = ("127.0.0.1", self.srv.getsockname()[1])
        self.endpoint = f"127.0.0.1:{self.addr[1]}"
        self.n_connections = 0
        self._stop = threading.Event()
        self._socks: list[socket.socket] = []
        self.t = threading.Thread(target=self._run, daemon=True)
        self.t.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                c, _ = self.srv.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            self.n_connections += 1
            self._socks.append(c)
            threading.Thread(target=self._serve, args=(c,), daemon=True).start()

    def _serve(self, c: socket.socket) -> None:
        try:
            first = b""
            if self.on_first is not None:
                c.settimeout(5)
                while len(first) < 9 and (chunk := c.recv(9 - len(first))):
                    first += chunk
                answer = self.on_first(first)
                if answer is not None or self.target is None:
                    c.sendall(answer or b"")
                    return
            up = socket.create_connection(self.target, timeout=5)
            self._socks.append(up)
            c.settimeout(None)
            up.settimeout(None)
            up.sendall(first)
            threading.Thread(target=self._pump, args=(up, c), daemon=True).start()
            self._pump(c, up)
        except OSError:
            pass
        finally:
            with contextlib.suppress(OSError):
                c.shutdown(socket.SHUT_WR)

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(1 << 20):
                dst.sendall(data)
        except OSError:
            pass
        for s in (src, dst):
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        self._stop.set()
        for s in (self.srv, *self._socks):
            with contextlib.suppress(OSError):
                s.close()
        self.t.join(timeout=2)

    def __enter__(self) -> TcpForward:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def wait_closed(s, timeout_s: float) -> float:
    """Seconds until the peer closed ``s`` (reading and dropping what it sends);
    raises AssertionError if it stays open past ``timeout_s``."""
    t0 = time.monotonic()
    s.settimeout(0.1)
    while time.monotonic() - t0 < timeout_s:
        try:
            if not s.recv(65536):
                return time.monotonic() - t0
        except TimeoutError:
            continue
        except OSError:
            return time.monotonic() - t0
    raise AssertionError(f"still open after {timeout_s} s")


# -- malformed streams, generated (never committed) ---------------------------------------
def client_hello(alpn: str | None = None) -> bytes:
    """A real TLS 1.3 ClientHello (no certificate involved yet), for truncation/corruption;
    ``alpn``: offering that protocol (a peer link's: PEER_ALPN)."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE
    if alpn:
        ctx.set_alpn_protocols([alpn])
    i, o = ssl.MemoryBIO(), ssl.MemoryBIO()
    obj = ctx.wrap_bio(i, o, server_hostname="127.0.0.1")
    try:
        obj.do_handshake()
    except ssl.SSLWantReadError:
        pass
    return o.read()


def corpus(seed: int = 0) -> list[bytes]:
    """Malformed streams: empty, RPC frames in the clear (every command, wrong and huge
    sizes), random bytes, TLS records with garbage, truncated and corrupted ClientHellos."""
    rng = random.Random(seed)
    ch = client_hello()
    peer = client_hello(PEER_ALPN)  # a peer link's ClientHello, cut short
    out = [b"", b"\x00", hello(), hello() + request(RPC_DEVICE_COUNT),
           b"\x16\x03\x01", b"\x16\x03\x01\xff\xff" + bytes(64), b"\x17\x03\x03\x00\x10" * 50,
           ch[:5], ch[: len(ch) // 2], ch[:-1], b"GET / HTTP/1.1\r\nHost: x\r\n\r\n",
           peer_hello(), peer_hello() + peer_push(), peer[: len(peer) // 2], peer[:-1]]
    for cmd in range(256):
        size = rng.choice([0, 1, 24, 296, 1 << 32, (1 << 64) - 1])
        out.append(bytes([cmd]) + struct.pack("<Q", size) + rng.randbytes(rng.randint(0, 64)))
    for _ in range(20):
        out.append(rng.randbytes(rng.randint(1, 8192)))
    for _ in range(10):  # a ClientHello with a few flipped bytes
        b = bytearray(ch)
        for _ in range(3):
            b[rng.randrange(5, len(b))] ^= 1 << rng.randrange(8)
        out.append(bytes(b))
    return out


def send_and_time_close(addr, data: bytes) -> float:
    """Connect, send ``data``, and return the seconds until the peer closed."""
    with socket.create_connection(addr, timeout=5) as s:
        try:
            s.sendall(data)
        except OSError:
            return 0.0
        return wait_closed(s, 6.0)


def bad_sessions(rng: random.Random) -> list[bytes]:
    """Byte streams an authenticated client could send that break framing or bounds: the
    first 25 are fixed (each cut at its header), then 10 random tails after a HELLO."""
    big = SET_TENSOR_HEADER + RpcLimits().max_tensor_bytes + 1
    out = [request(RPC_DEVICE_COUNT),  # not HELLO first
           hello() + hello(),  # HELLO twice
           request(RPC_CMD_HELLO, bytes(25)),
           hello() + bytes([RPC_N_COMMANDS]) + struct.pack("<Q", 0),
           hello() + bytes([255]) + struct.pack("<Q", 0),
           hello() + bytes([RPC_SET_TENSOR]) + struct.pack("<Q", big),
           hello() + bytes([RPC_SET_TENSOR]) + struct.pack("<Q", 10),
           hello() + bytes([RPC_GRAPH_COMPUTE]) + struct.pack("<Q", (1 << 64) - 1),
           hello() + bytes([RPC_GRAPH_COMPUTE]) + struct.pack("<Q", GRAPH_HEADER - 1)]
    for cmd, size in REQUEST_SIZES.items():
        if cmd != RPC_CMD_HELLO:
            out.append(hello() + bytes([cmd]) + struct.pack("<Q", size + rng.choice([1, 999])))
    for _ in range(10):
        out.append(hello() + rng.randbytes(rng.randint(9, 4096)))
    return out


def bad_peer_sessions(rng: random.Random) -> list[bytes]:
    """Byte streams an authenticated peer link could send that are not PEER_HELLO then
    pushes within the bounds: the fixed ones first (each cut at its bad header: anything
    first but PEER_HELLO, a wrong PEER_HELLO, pushes out of bounds, every client command at
    its exact size after a good push), then 10 random tails after a PEER_HELLO."""
    big = PEER_PUSH_HEADER + RpcLimits().max_push_bytes + 1
    out = [hello(), request(RPC_DEVICE_COUNT), peer_push(),
           request(RPC_PEER_HELLO, bytes(21)), request(RPC_PEER_HELLO, bytes(19)),
           peer_hello() + peer_hello(),
           peer_hello() + bytes([RPC_PEER_PUSH]) + struct.pack("<Q", PEER_PUSH_HEADER - 1),
           peer_hello() + bytes([RPC_PEER_PUSH]) + struct.pack("<Q", big),
           peer_hello() + bytes([RPC_PEER_PUSH]) + struct.pack("<Q", (1 << 64) - 1),
           peer_hello() + peer_push() + bytes([255]) + struct.pack("<Q", 0),
           peer_hello() + peer_push() + request(RPC_SET_TENSOR, bytes(SET_TENSOR_HEADER + 4)),
           peer_hello() + peer_push() + request(RPC_GRAPH_COMPUTE, bytes(GRAPH_HEADER))]
    for cmd, size in REQUEST_SIZES.items():
        out.append(peer_hello() + peer_push() + request(cmd, bytes(size)))
    for _ in range(10):
        out.append(peer_hello() + rng.randbytes(rng.randint(9, 4096)))
    return out
