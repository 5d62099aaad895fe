"""The front of a plaintext shard: the TLS gateway's door without TLS.

`mtplib shard serve` without ``--tls`` binds upstream's RPC server to a free loopback port
and runs a `PlainFront` on the shard's endpoint in front of it (`mtplib.distributed.front`:
the same deadlines, pending bounds and eviction as the TLS gateway's): a connection must
send its first byte within ``first_byte_s`` and its first request header, HELLO (a client)
or PEER_HELLO (a peer link), within ``handshake_timeout_s``; only then is it connected to
upstream's RPC server and passed through unchanged. So a stranger that connects and stays
silent holds no upstream thread and is closed within 3 s. Whoever sends HELLO is a client:
plaintext RPC authenticates no one.

A connection whose first request is mtplib's report request (`mtplib.distributed.report_wire`)
gets the shard's report (``report``) and is closed, within the same deadlines; it never
reaches upstream. So the report travels wherever the shard's bytes do (a forward, a tunnel).
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Callable

from mtplib.distributed.framing import REQUEST_HEADER, FrameError, first_request
from mtplib.distributed.front import CHUNK, FIRST_BYTE_S, HANDSHAKE_S, Front
from mtplib.distributed.report_wire import (
    REPORT_CMD,
    REPORT_REQUEST,
    is_report_request,
    report_reply,
)
from mtplib.distributed.shard_report import ShardReport
from mtplib.runtime.rpc import RPC_PEER_HELLO


def _pass(src: socket.socket, dst: socket.socket) -> None:
    """Copy ``src`` to ``dst`` until either ends; then end both (the other direction's copy
    then ends too)."""
    buf = bytearray(CHUNK)
    view = memoryview(buf)
    try:
        while n := src.recv_into(buf):
            dst.sendall(view[:n])
    except OSError:
        pass
    for s in (src, dst):
        with contextlib.suppress(OSError):
            s.shutdown(socket.SHUT_RDWR)


class PlainFront(Front):
    """The front of a plaintext shard (see the module doc and `Front`): a connection is
    passed to upstream's RPC server at ``upstream`` (each direction copied as is, nothing
    checked) once its first request header opens a client session or a peer link within
    the deadlines; a silent, slow or foreign one is closed without reaching upstream (which
    serves every connection it accepts on a thread of its own, for as long as it stays
    open). Upstream not listening yet (the shard is starting) is waited for up to
    ``upstream_wait_s``. ``report``: what it answers mtplib's report request (None:
    it closes such a connection unanswered, as upstream's server would)."""

    kind = "front"
    silent = ("pre_hello_timeout", "no byte")
    slow = ("hello_timeout", "no first request")
    evicted_words = "evicted by newer connections before its first request"

    def __init__(self, public: tuple[str, int], upstream: tuple[str, int], *,
                 handshake_timeout_s: float = HANDSHAKE_S, first_byte_s: float = FIRST_BYTE_S,
                 max_pending: int = 64, max_per_source: int = 8,
                 upstream_wait_s: float = 5.0, report: ShardReport | None = None,
                 log: Callable[[str], None] | None = None) -> None:
        self.upstream_wait_s = upstream_wait_s
        self._reply = report_reply(report) if report is not None else None
        #: the connections passed through (client and upstream side), ended by close()
        self._open: set[tuple[socket.socket, socket.socket]] = set()
        super().__init__(public, upstream, handshake_timeout_s=handshake_timeout_s,
                         first_byte_s=first_byte_s, max_pending=max_pending,
                         max_per_source=max_per_source, log=log, counters=(
                             "pre_hello_timeout", "hello_timeout", "not_hello", "sessions",
                             "peer_sessions", "upstream_unreachable", "reports"))

    def _prove(self, sock: socket.socket, who: str, t0: float) -> bytes | None:
        """The connection's first request header, if it opens a client session or a peer
        link (`first_request`), or the whole report request if it is one (answered when
        this front has a report)."""
        header = b""
        while len(header) < REQUEST_HEADER:
            left = self.handshake_timeout_s - (time.monotonic() - t0)
            if left <= 0:
                raise TimeoutError
            sock.settimeout(left)
            chunk = sock.recv(REQUEST_HEADER - len(header))
            if not chunk:
                raise ConnectionError("closed within its first request")
            header += chunk
        if header[0] == REPORT_CMD and self._reply is not None:
            if is_report_request(sock, header, t0 + self.handshake_timeout_s):
                return REPORT_REQUEST
            self._count("not_hello")
            self.log(f"{who}: a malformed report request; closed, nothing forwarded")
            return None
        try:
            first_request(header)
        except FrameError as e:
            self._count("not_hello")
            self.log(f"{who}: {e}; closed, nothing forwarded")
            return None
        return header

    def _serve(self, sock: socket.socket, header: bytes, who: str) -> None:
        """Upstream gets the checked header, then both directions pass as they come; a
        report request gets the report instead (and the connection is closed after)."""
        if header == REPORT_REQUEST and self._reply is not None:
            self._count("reports")  # counted first: a client may act on it at once
            sock.settimeout(self.handshake_timeout_s)
            sock.sendall(self._reply)
            return
        up = self._upstream(who, wait_s=self.upstream_wait_s)
        if up is None:
            return
        pair = (sock, up)
        with self._lock:
            gone = self._stop.is_set()
            if not gone:
                self._open.add(pair)
        try:
            if gone:
                return
            self._count("peer_sessions" if header[0] == RPC_PEER_HELLO else "sessions")
            sock.settimeout(None)
            up.sendall(header)
            down = threading.Thread(target=_pass, args=(up, sock), daemon=True,
                                    name=f"front-down-{who}")
            down.start()
            _pass(sock, up)
            down.join(timeout=5)
        finally:
            with self._lock:
                self._open.discard(pair)
            with contextlib.suppress(OSError):
                up.close()

    def close(self) -> None:
        self._close_listener()
        with self._lock:
            pairs = list(self._open)
        for pair in pairs:
            for s in pair:
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)
        self._join()
