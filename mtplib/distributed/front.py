"""The door of a shard's RPC server: what its two fronts share (the mutual-TLS `Gateway`
of `mtplib.distributed.gateway`, the plaintext `PlainFront` of
`mtplib.distributed.plain_front`).

Upstream's RPC server listens on a loopback port only; a front listens on the shard's
endpoint and connects a connection to upstream only once it has proved itself: its first
byte within ``first_byte_s`` (default 2 s), the rest of its proof (a TLS handshake, a
first request header) within ``handshake_timeout_s`` (default 3 s) of its connection, else
it is closed. **Strangers cannot keep a client out**: at most ``max_pending`` connections
prove themselves at once and at most ``max_per_source`` from one address; a new connection
beyond either bound evicts the oldest pending one (of its own address first), never the
newcomer. An idle or slow stranger is thus closed by its deadline or by the next arrival,
and a client that proves itself in milliseconds gets through however many are connected
(tests/test_gateway.py, tests/test_shard_front.py). TCP keepalive drops a vanished peer.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Self

from mtplib.logs import RateLimited

log = logging.getLogger(__name__)

#: an unauthenticated peer is closed after this long (the target: within 5 s)
HANDSHAKE_S = 3.0
#: a peer that sends no byte at all (no ClientHello) is closed after this long
FIRST_BYTE_S = 2.0
#: connections the kernel holds for a front's accept loop (a burst beyond it would wait
#: for SYN retries, a second and more each)
BACKLOG = 1024
#: the most bytes one read of a front's copy loops takes
CHUNK = 1 << 20
LOG_LINES, LOG_WINDOW_S = 20, 10.0


@dataclass(eq=False)
class _Pending:
    """A connection still proving itself (a front's eviction order holds these)."""

    key: int
    sock: socket.socket
    source: str
    evicted: bool = False


def keepalive(s: socket.socket) -> None:
    """TCP keepalive on ``s``: a peer that vanishes is dropped within about a minute."""
    s.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for opt, v in (("TCP_KEEPIDLE", 30), ("TCP_KEEPINTVL", 10), ("TCP_KEEPCNT", 3)):
        if hasattr(socket, opt):
            s.setsockopt(socket.IPPROTO_TCP, getattr(socket, opt), v)


def _log_warning(kind: str, line: str) -> None:
    log.warning("mtplib %s: %s", kind, line)


class Front:
    """What both fronts of a shard's RPC server share (the TLS `Gateway`, the plaintext
    `PlainFront`): ``public`` bound at construction (OSError if it cannot be), an accept
    loop (``start()``: in a thread; ``close()`` stops it) giving every connection a thread
    (`_handle`) in which it must prove itself by its deadlines (``first_byte_s`` for its
    first byte, ``handshake_timeout_s`` for the rest: `_prove`) before it is served
    (`_serve`), and the bound on connections still proving themselves: at most
    ``max_pending`` at once and ``max_per_source`` from one address, a new one beyond
    either evicting the oldest (`_make_room`), never the newcomer. ``stats`` counts what
    happened (``accepted``, ``evicted`` and the subclass's ``counters``); ``log`` gets one
    line per notable event, rate-limited (`mtplib.logs.RateLimited`); by default they are
    this module logger's warnings, "mtplib <kind>: ..."."""

    #: the accept thread's name and the log's prefix
    kind = "front"
    #: (the stats counter, the log's words) for a connection that sent no byte within
    #: ``first_byte_s``, and for one that spoke but did not prove itself within
    #: ``handshake_timeout_s``
    silent: tuple[str, str]
    slow: tuple[str, str]
    #: the log's words for a connection evicted while it proved itself
    evicted_words: str

    def __init__(self, public: tuple[str, int], upstream: tuple[str, int], *,
                 handshake_timeout_s: float, first_byte_s: float, max_pending: int,
                 max_per_source: int, log: Callable[[str], None] | None,
                 counters: tuple[str, ...]) -> None:
        self.upstream = upstream
        self.handshake_timeout_s, self.first_byte_s = handshake_timeout_s, first_byte_s
        self.max_pending, self.max_per_source = max_pending, max_per_source
        self.log = RateLimited(log or (lambda s: _log_warning(self.kind, s)),
                               LOG_LINES, LOG_WINDOW_S)
        self.stats = dict.fromkeys(("accepted", "evicted", *counters), 0)
        self._lock = threading.Lock()
        #: the connections still proving themselves, oldest first
        self._pending: OrderedDict[int, _Pending] = OrderedDict()
        self._n_accepted = 0
        self._stop = threading.Event()
        # a deep backlog: a burst of connections waits in the kernel, not in SYN retries
        self._srv = socket.create_server(public, backlog=BACKLOG)
        self._srv.settimeout(0.2)
        self.endpoint = "{}:{}".format(*self._srv.getsockname()[:2])
        self._thread: threading.Thread | None = None

    def _count(self, key: str) -> None:
        with self._lock:
            self.stats[key] += 1

    def start(self) -> Self:
        self._thread = threading.Thread(target=self.serve_forever, daemon=True,
                                        name=f"{self.kind}-{self.endpoint}")
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
                             name=f"{self.kind}-conn-{peer[0]}:{peer[1]}").start()

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

    def _handle(self, sock: socket.socket, peer: tuple, me: _Pending) -> None:
        """One connection, in its own thread: its first byte within ``first_byte_s``, then
        `_prove` within ``handshake_timeout_s`` of its connection, then (unless it failed or
        was evicted meanwhile) `_serve`; a failure is counted and logged, and the
        connection is closed at the end."""
        who = f"{peer[0]}:{peer[1]}"
        proof = None
        spoke = False
        t0 = time.monotonic()
        try:
            try:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                keepalive(sock)
                sock.settimeout(min(self.first_byte_s, self.handshake_timeout_s))
                if not sock.recv(1, socket.MSG_PEEK):  # the first-byte deadline
                    raise ConnectionError("closed before sending a byte")
                spoke = True
                proof = self._prove(sock, who, t0)
            except TimeoutError:
                if me.evicted:
                    self._count("evicted")
                else:
                    key, words = self.slow if spoke else self.silent
                    limit = self.handshake_timeout_s if spoke else self.first_byte_s
                    self._count(key)
                    self.log(f"{who}: {words} within {limit:g} s; closed")
            except OSError as e:  # ssl.SSLError is one
                if me.evicted:
                    self._count("evicted")
                    self.log(f"{who}: {self.evicted_words}; closed")
                else:
                    self._failed(who, e)
        finally:
            if not self._settled(me):
                proof = None  # evicted as it finished: its socket is shut down
        try:
            if proof is not None:
                self._serve(sock, proof, who)
        except Exception as e:  # noqa: BLE001 - one peer never ends the front
            self.log(f"{who}: session ended on {type(e).__name__}: {e}")
        finally:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            with contextlib.suppress(OSError):
                sock.close()

    def _prove(self, sock: socket.socket, who: str, t0: float) -> Any:
        """(After the connection's first byte.) What `_serve` gets once the connection has
        proved itself by ``t0 + handshake_timeout_s`` (``t0``: when it was taken up), or
        None where it was refused (counted and logged); TimeoutError past the deadline,
        another OSError where the proof failed."""
        raise NotImplementedError

    def _failed(self, who: str, e: OSError) -> None:
        """A connection's proof failed on ``e`` (not a timeout, not an eviction): by
        default, nothing counted, nothing logged."""

    def _serve(self, sock: socket.socket, proof: Any, who: str) -> None:
        """Serve a connection that proved itself (`_prove`'s answer); it is closed after."""
        raise NotImplementedError

    def _settled(self, me: _Pending) -> bool:
        """``me`` is no longer pending (it proved itself or failed); False if it was
        evicted meanwhile (its socket is shut down: it must not be served)."""
        with self._lock:
            self._pending.pop(me.key, None)
            return not me.evicted

    def _upstream(self, who: str, wait_s: float = 0.0) -> socket.socket | None:
        """A connection to the RPC server (None, counted under ``upstream_unreachable`` and
        logged, if it is unreachable); one refused (not listening yet: the shard is
        starting) is tried again for up to ``wait_s``."""
        end = time.monotonic() + wait_s
        while True:
            try:
                up = socket.create_connection(self.upstream, timeout=5)
            except OSError as e:
                if isinstance(e, ConnectionRefusedError) and time.monotonic() < end \
                        and not self._stop.is_set():  # not listening yet: starting
                    time.sleep(0.05)
                    continue
                self._count("upstream_unreachable")
                self.log(f"{who}: the RPC server at {self.upstream} is unreachable ({e})")
                return None
            up.settimeout(None)
            up.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            return up

    def _close_listener(self) -> None:
        self._stop.set()
        with contextlib.suppress(OSError):
            self._srv.shutdown(socket.SHUT_RDWR)
        with contextlib.suppress(OSError):
            self._srv.close()

    def _join(self) -> None:
        if self._thread is not None:
            self._thread.join(timeout=2)

    def close(self) -> None:
        self._close_listener()
        self._join()

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()
