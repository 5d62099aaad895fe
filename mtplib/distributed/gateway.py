"""The shard's TLS gateway: the only thing a shard exposes beyond loopback.

`mtplib shard serve --endpoint HOST:PORT --tls DIR` binds upstream's RPC server to a free
loopback port and runs a `Gateway` on HOST:PORT in front of it:

- **Mutual TLS 1.3**: a peer must send its first TLS byte within ``first_byte_s``
  (default 2 s) and finish the TLS handshake with a certificate signed by the shard's CA
  within ``handshake_timeout_s`` (default 3 s) of its connection, else it is closed. The
  gateway opens its connection to the RPC server only after that: no byte from an
  unauthenticated peer ever reaches upstream.
- **Strangers cannot keep a client out**: at most ``max_pending`` handshakes run at once
  and at most ``max_per_source`` from one address; a new connection beyond either bound
  evicts the oldest pending handshake (of its own address first), never the newcomer. An
  idle or slow stranger is thus closed by its deadline or by the next arrival, and a
  client whose handshake takes milliseconds gets through however many are connected
  (tests/test_gateway.py: 200 idle and slow strangers on loopback).
- **One client at a time** (upstream serves one): an authenticated client arriving while
  another is served gets the status line ``busy`` at once and is closed; the served one
  gets ``ready`` (both lines carry the gateway's random instance id, so a client that
  reaches one shard under two addresses can tell; ``ready`` also carries the shard's
  ``report`` of its build, `mtplib.distributed.shard_report`, which only an authenticated
  client sees). TCP keepalive drops a vanished client.
- **Checked framing** (`RequestChecker`): every request header is parsed and checked before
  any byte of it is forwarded: HELLO first and only once, known commands, the exact size of
  every fixed-size request, and bounds on the two variable ones (SET_TENSOR: the largest
  tensor `RpcLimits.max_tensor_bytes` plus its header; GRAPH_COMPUTE:
  `RpcLimits.max_graph_bytes`). A violation closes the session (nothing of that request
  is forwarded); the gateway itself keeps serving whatever bytes arrive.

An authenticated client is trusted: upstream's RPC lets it allocate buffers up to the
device's memory, read and write them and run any graph on them; malformed tensor or graph
descriptors inside well-framed requests can still crash upstream's server (then the shard
process ends). Mutual TLS keeps strangers out; it does not make a client harmless.
"""

from __future__ import annotations

import contextlib
import secrets
import socket
import ssl
import sys
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from mtplib.distributed.framing import DEFAULT_LIMITS, HEADER, PAYLOAD, Framer, RpcLimits
from mtplib.distributed.tls import (
    GATEWAY_BUSY,
    GATEWAY_MAGIC,
    GATEWAY_READY,
    TlsConfig,
    TlsStream,
)
from mtplib.runtime.rpc import (
    GRAPH_HEADER,
    GRAPH_SLOT_HEADER,
    REQUEST_SIZES,
    RPC_CMD_HELLO,
    RPC_GRAPH_COMPUTE,
    RPC_GRAPH_COMPUTE_SLOT,
    RPC_N_COMMANDS,
    RPC_SET_TENSOR,
    SET_TENSOR_HEADER,
)

#: an unauthenticated peer is closed after this long (the target: within 5 s)
HANDSHAKE_S = 3.0
#: a peer that sends no byte at all (no ClientHello) is closed after this long
FIRST_BYTE_S = 2.0
CHUNK = 1 << 20
#: the longest report of its build a ready line carries (the status line stays < STATUS_MAX)
REPORT_MAX = 400
LOG_LINES, LOG_WINDOW_S = 20, 10.0


class FrameError(Exception):
    """A request that breaks upstream's framing or mtplib's bounds."""


class RequestChecker:
    """Checks the client->shard byte stream (framed by `Framer`); ``feed(data)`` returns the
    bytes that may be forwarded now (a header is held back until it is complete and
    checked) or raises FrameError, after which nothing more is forwarded."""

    def __init__(self, limits: RpcLimits = DEFAULT_LIMITS) -> None:
        self.limits = limits
        self.frames = Framer(requests=True)
        self.n_requests = 0

    def check(self, cmd: int, size: int) -> None:
        if self.n_requests == 0 and cmd != RPC_CMD_HELLO:
            raise FrameError(f"first request is command {cmd}, not HELLO")
        if self.n_requests > 0 and cmd == RPC_CMD_HELLO:
            raise FrameError("a second HELLO")
        if cmd >= RPC_N_COMMANDS:
            raise FrameError(f"unknown command {cmd}")
        if cmd == RPC_SET_TENSOR:
            hi = SET_TENSOR_HEADER + self.limits.max_tensor_bytes
            if not SET_TENSOR_HEADER <= size <= hi:
                raise FrameError(f"SET_TENSOR of {size} bytes (allowed {SET_TENSOR_HEADER}.."
                                 f"{hi})")
        elif cmd in (RPC_GRAPH_COMPUTE, RPC_GRAPH_COMPUTE_SLOT):
            lo = GRAPH_HEADER if cmd == RPC_GRAPH_COMPUTE else GRAPH_SLOT_HEADER
            if not lo <= size <= self.limits.max_graph_bytes:
                raise FrameError(f"GRAPH_COMPUTE{'_SLOT' if lo != GRAPH_HEADER else ''} of "
                                 f"{size} bytes (allowed {lo}..{self.limits.max_graph_bytes})")
        elif size != REQUEST_SIZES[cmd]:
            raise FrameError(f"command {cmd} with {size} payload bytes, expected "
                             f"{REQUEST_SIZES[cmd]}")

    def feed(self, data: bytes) -> bytes:
        out = bytearray()
        for kind, i, j in self.frames.split(data):
            if kind == PAYLOAD:
                out += data[i:j]
            elif kind == HEADER:
                self.check(self.frames.cmd, self.frames.size)
                out += self.frames.header
                self.n_requests += 1
        return bytes(out)


@dataclass(eq=False)
class _Pending:
    """A connection whose TLS handshake runs (the gateway's eviction order holds these)."""

    key: int
    sock: socket.socket
    source: str
    evicted: bool = False


def _keepalive(s: socket.socket) -> None:
    s.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for opt, v in (("TCP_KEEPIDLE", 30), ("TCP_KEEPINTVL", 10), ("TCP_KEEPCNT", 3)):
        if hasattr(socket, opt):
            s.setsockopt(socket.IPPROTO_TCP, getattr(socket, opt), v)


class Gateway:
    """Mutual-TLS front of one RPC server (see the module doc). ``public`` is bound at
    construction (OSError if it cannot be); ``start()`` serves in a thread, ``close()``
    stops. ``stats`` counts what happened; ``log`` gets one line per notable event."""

    def __init__(self, public: tuple[str, int], upstream: tuple[str, int], tls: TlsConfig, *,
                 handshake_timeout_s: float = HANDSHAKE_S, first_byte_s: float = FIRST_BYTE_S,
                 max_pending: int = 64, max_per_source: int = 8,
                 limits: RpcLimits = DEFAULT_LIMITS,
                 log: Callable[[str], None] | None = None, report: str = "") -> None:
        if len(report) > REPORT_MAX or not report.isascii() or len(report.split()) > 1:
            raise ValueError(f"gateway report: one ASCII word of at most {REPORT_MAX} "
                             f"characters, got {report[:80]!r}")
        self.upstream, self.limits = upstream, limits
        self.report = report
        self.ctx = tls.server_context()
        self.ctx.num_tickets = 0  # no resumption: every session proves its certificate
        self.handshake_timeout_s, self.first_byte_s = handshake_timeout_s, first_byte_s
        self.max_pending, self.max_per_source = max_pending, max_per_source
        self.instance = secrets.token_hex(8)
        self._log = log or (lambda s: print(f"mtplib gateway: {s}", file=sys.stderr,
                                            flush=True))
        self._log_window, self._log_lines, self._log_dropped = 0.0, 0, 0
        self.stats = dict.fromkeys(("accepted", "evicted", "pre_tls_timeout",
                                    "handshake_failed", "handshake_timeout", "busy",
                                    "sessions", "frame_errors", "upstream_unreachable"), 0)
        self._lock = threading.Lock()
        #: the handshakes running, oldest first
        self._pending: OrderedDict[int, _Pending] = OrderedDict()
        self._n_accepted = 0
        self._active: tuple[TlsStream, socket.socket] | None = None
        self._stop = threading.Event()
        self._srv = socket.create_server(public, backlog=64)
        self._srv.settimeout(0.2)
        self.endpoint = "{}:{}".format(*self._srv.getsockname()[:2])
        self._thread: threading.Thread | None = None

    def log(self, line: str) -> None:
        """At most LOG_LINES lines per LOG_WINDOW_S (a flood of strangers must not fill the
        shard's log), then one line saying how many were dropped."""
        now = time.monotonic()
        with self._lock:
            if now - self._log_window > LOG_WINDOW_S:
                dropped, self._log_dropped = self._log_dropped, 0
                self._log_window, self._log_lines = now, 0
            else:
                dropped = 0
            self._log_lines += 1
            if self._log_lines > LOG_LINES:
                self._log_dropped += 1
                return
        if dropped:
            self._log(f"({dropped} similar lines dropped in the last {LOG_WINDOW_S:g} s)")
        self._log(line)

    def _count(self, key: str) -> None:
        with self._lock:
            self.stats[key] += 1

    def start(self) -> Gateway:
        self._thread = threading.Thread(target=self.serve_forever, daemon=True,
                                        name=f"gateway-{self.endpoint}")
        self._thread.start()
        return self

    def serve_forever(self) -> None:
        while not self._stop.is_set():
            try:
                sock, peer = self._srv.accept()
            except TimeoutError:
                continue
            except OSError:
                if self._stop.is_set():
                    return
                time.sleep(0.05)  # e.g. out of file descriptors: keep serving
                continue
            with self._lock:
                self.stats["accepted"] += 1
                self._n_accepted += 1
                victim = self._make_room(peer[0])
                me = self._pending[self._n_accepted] = _Pending(self._n_accepted, sock,
                                                                 peer[0])
            if victim is not None:  # wakes its handshake thread, which then closes it
                with contextlib.suppress(OSError):
                    victim.sock.shutdown(socket.SHUT_RDWR)
            threading.Thread(target=self._handle, args=(sock, peer, me), daemon=True,
                             name=f"gateway-conn-{peer[0]}:{peer[1]}").start()

    def _make_room(self, source: str) -> _Pending | None:
        """(Under the lock.) The pending handshake a connection from ``source`` evicts, or
        None: the oldest of its own address at ``max_per_source``, else the oldest of all
        at ``max_pending``."""
        same = [k for k, p in self._pending.items() if p.source == source]
        if len(same) >= self.max_per_source:
            key = same[0]
        elif len(self._pending) >= self.max_pending:
            key = next(iter(self._pending))
        else:
            return None
        victim = self._pending.pop(key)
        victim.evicted = True
        return victim

    def _status(self, stream: TlsStream, what: bytes) -> None:
        extra = b" " + self.report.encode() if what == GATEWAY_READY and self.report else b""
        stream.sendall(GATEWAY_MAGIC + what + b" " + self.instance.encode() + extra + b"\n")

    def _handle(self, sock: socket.socket, peer: tuple, me: _Pending) -> None:
        who = f"{peer[0]}:{peer[1]}"
        stream = TlsStream(sock, self.ctx, server_side=True)
        authed = spoke = False
        t0 = time.monotonic()
        try:
            try:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                _keepalive(sock)
                sock.settimeout(min(self.first_byte_s, self.handshake_timeout_s))
                if not sock.recv(1, socket.MSG_PEEK):  # the pre-TLS deadline
                    raise ConnectionError("closed before sending a byte")
                spoke = True
                stream.handshake(self.handshake_timeout_s - (time.monotonic() - t0))
                authed = True
            except TimeoutError:
                if me.evicted:
                    self._count("evicted")
                elif spoke:
                    self._count("handshake_timeout")
                    self.log(f"{who}: no TLS handshake within "
                             f"{self.handshake_timeout_s:g} s; closed")
                else:
                    self._count("pre_tls_timeout")
                    self.log(f"{who}: no TLS byte within {self.first_byte_s:g} s; closed")
            except (ssl.SSLError, OSError) as e:
                if me.evicted:
                    self._count("evicted")
                    self.log(f"{who}: pending handshake evicted by newer connections; "
                             "closed")
                else:
                    self._count("handshake_failed")
                    self.log(f"{who}: TLS handshake failed "
                             f"({getattr(e, 'reason', None) or e}); closed")
        finally:
            with self._lock:
                self._pending.pop(me.key, None)
                if me.evicted:
                    authed = False  # evicted as it finished: its socket is shut down
        try:
            if authed:
                self._session(stream, who)
        except Exception as e:  # noqa: BLE001 - one peer never ends the gateway
            self.log(f"{who}: session ended on {type(e).__name__}: {e}")
        finally:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            with contextlib.suppress(OSError):
                sock.close()

    def _session(self, stream: TlsStream, who: str) -> None:
        with self._lock:
            busy = self._active is not None or self._stop.is_set()
            if not busy:
                self._active = (stream, None)  # type: ignore[assignment]
        if busy:
            self._count("busy")
            self.log(f"{who}: authenticated, but another client is being served: told busy")
            with contextlib.suppress(OSError):
                self._status(stream, GATEWAY_BUSY)
            return
        up = None
        try:
            try:
                up = socket.create_connection(self.upstream, timeout=5)
            except OSError as e:
                self._count("upstream_unreachable")
                self.log(f"{who}: the RPC server at {self.upstream} is unreachable ({e})")
                return
            up.settimeout(None)
            up.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self._lock:
                self._active = (stream, up)
            self._count("sessions")
            self._status(stream, GATEWAY_READY)
            down = threading.Thread(target=self._copy_down, args=(up, stream), daemon=True,
                                    name=f"gateway-down-{who}")
            down.start()
            checker = RequestChecker(self.limits)
            try:
                while True:
                    data = stream.recv(CHUNK)
                    if not data:
                        break
                    out = checker.feed(data)
                    if out:
                        up.sendall(out)
            except FrameError as e:
                self._count("frame_errors")
                self.log(f"{who}: {e}; session closed, nothing of it forwarded")
            except OSError:
                pass
            finally:
                self._end(stream, up)
                down.join(timeout=5)
        finally:
            if up is not None:
                with contextlib.suppress(OSError):
                    up.close()
            with self._lock:
                self._active = None

    @staticmethod
    def _end(stream: TlsStream, up: socket.socket) -> None:
        for s in (stream, up):
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)

    def _copy_down(self, up: socket.socket, stream: TlsStream) -> None:
        try:
            while data := up.recv(CHUNK):
                stream.sendall(data)
        except OSError:
            pass
        self._end(stream, up)

    def close(self) -> None:
        self._stop.set()
        with contextlib.suppress(OSError):
            self._srv.shutdown(socket.SHUT_RDWR)
        with contextlib.suppress(OSError):
            self._srv.close()
        with self._lock:
            active = self._active
        if active is not None and active[1] is not None:
            self._end(*active)
        if self._thread is not None:
            self._thread.join(timeout=2)

    def __enter__(self) -> Gateway:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()
