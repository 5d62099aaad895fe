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
  (tests/test_gateway.py: 200 idle and slow strangers on loopback). This door (deadlines,
  bounds, eviction) is `mtplib.distributed.front.Front`, shared with the plaintext front.
- **One client at a time** (upstream serves one): an authenticated client arriving while
  another is served gets the status line ``busy`` at once and is closed; the served one
  gets ``ready`` (both lines carry the gateway's random instance id, so a client that
  reaches one shard under two addresses can tell). TCP keepalive drops a vanished client.
- **The shard's report** of its build (`mtplib.distributed.shard_report`): an
  authenticated connection offering ALPN `REPORT_ALPN` gets no status line and takes no
  client slot; its first request must be mtplib's report request (within
  ``handshake_timeout_s``), answered with the report, then it is closed; it never reaches
  upstream (`mtplib.distributed.report_wire`: the same request a plaintext front answers).
- **Checked framing** (`RequestChecker`, in `mtplib.distributed.framing`): every request
  header is parsed and checked before any byte of it is forwarded: HELLO first and only
  once, known commands, the exact size of every fixed-size request, and bounds on the two
  variable ones (SET_TENSOR: the largest tensor `RpcLimits.max_tensor_bytes` plus its
  header; GRAPH_COMPUTE: `RpcLimits.max_graph_bytes`). A violation closes the session
  (nothing of that request is forwarded); the gateway itself keeps serving whatever bytes
  arrive.

**Peer links** (the ring, patches/0007: boundary values pushed from shard to shard) pass
the gateways too, in mutual TLS, so no plaintext RPC byte leaves a host:

- **Out** (this shard dials another): a client's PEER_CONNECT names the endpoint its shard
  should dial; the checker holds it back and the gateway rewrites that endpoint to a
  loopback port of its own (`PeerForwarder`), so upstream's RPC server dials only this
  gateway. The forwarder takes one connection, and only one that starts with the very
  PEER_HELLO (link and token) of that PEER_CONNECT (so only the RPC server the client told
  can use it); then it opens mutual TLS to the endpoint the client named, with this shard's
  certificate (`TlsConfig.peer_context`, ALPN `PEER_ALPN`), the other gateway's certificate
  checked against the CA and that address, and passes pushes only (`PeerChecker`) and one
  PEER_HELLO answer back. A gateway thus dials only endpoints an authenticated client
  named, and never in the clear.
- **In** (another shard dials this one): a TLS connection offering ALPN `PEER_ALPN` is a
  peer, not a client: the same first-byte, handshake and eviction deadlines and CA check
  first; then it is admitted only while a client is served (at most ``max_peers`` at once),
  gets no status line, and its stream is checked (`PeerChecker`): PEER_HELLO first with its
  exact size, then only PEER_PUSH frames within `RpcLimits.max_push_bytes`; anything else
  closes it (nothing of that frame forwarded) and the client's session goes on. Upstream's
  RPC server then accepts the link only with the token the client announced
  (PEER_EXPECT): that check stays the last word. A peer link ends with the client session.
- A gateway whose shard certificate cannot act as a TLS client (an older PKI: extended key
  usage serverAuth only) cannot dial peers: its forwarders refuse, so each of its links
  stays on the star; its ready line says whether it carries peer links (`GATEWAY_PEER`),
  which a client's `resolve_seam` reads. A client certificate equal to this shard's own
  certificate is refused a client session (a shard's credentials open peer links only).

**Plaintext shards** (`shard serve` without ``--tls``) get the same door without TLS:
`mtplib.distributed.plain_front.PlainFront`.

An authenticated client is trusted: upstream's RPC lets it allocate buffers up to the
device's memory, read and write them and run any graph on them; malformed tensor or graph
descriptors inside well-framed requests can still crash upstream's server (then the shard
process ends). Mutual TLS keeps strangers out; it does not make a client harmless.
"""

from __future__ import annotations

import contextlib
import hmac
import secrets
import socket
import ssl
import struct
import threading
import time
from collections.abc import Callable

from mtplib.distributed.framing import (
    DEFAULT_LIMITS,
    PEER_HELLO_SIZE,
    FrameChecker,
    FrameError,
    PeerChecker,
    RequestChecker,
    RpcLimits,
)
from mtplib.distributed.front import CHUNK, FIRST_BYTE_S, HANDSHAKE_S, Front, keepalive
from mtplib.distributed.report_wire import REPORT_ALPN, is_report_request, report_reply
from mtplib.distributed.shard_report import ShardReport
from mtplib.distributed.tls import (
    GATEWAY_BUSY,
    GATEWAY_MAGIC,
    GATEWAY_PEER,
    GATEWAY_READY,
    PEER_ALPN,
    SHARD_CERT,
    TlsConfig,
    TlsStream,
)
from mtplib.errors import InputError
from mtplib.runtime.rpc import (
    REQUEST_SIZES,
    RPC_PEER_CONNECT,
    RPC_PEER_HELLO,
    ShardError,
    parse_endpoint,
)

#: PEER_CONNECT's payload: | link (4) | token (16) | endpoint (128, NUL-padded) |
PEER_CONNECT_SIZE = REQUEST_SIZES[RPC_PEER_CONNECT]
PEER_ENDPOINT_SIZE = PEER_CONNECT_SIZE - PEER_HELLO_SIZE
#: the one reply a peer link carries back: PEER_HELLO's | size (8) | result (1) |
PEER_REPLY_BYTES = 8 + 1
#: peer links one client session may open (upstream's client serves at most 16 servers)
MAX_PEER_LINKS = 16
#: a forwarder waits this long for the RPC server to dial it, and for the other gateway
FORWARD_ACCEPT_S, FORWARD_DIAL_S = 10.0, 5.0


def _checked_copy(src, dst, checker: FrameChecker) -> None:
    """Copy ``src`` to ``dst`` through ``checker`` until ``src`` ends (FrameError: stop)."""
    while data := src.recv(CHUNK):
        out = checker.feed(data)
        if out:
            dst.sendall(out)


def peer_hello(payload: bytes) -> bytes:
    """The PEER_HELLO request (header and payload) that carries ``payload``'s link and
    token (the first PEER_HELLO_SIZE bytes of a PEER_CONNECT payload)."""
    return bytes([RPC_PEER_HELLO]) + struct.pack("<Q", PEER_HELLO_SIZE) + \
        payload[:PEER_HELLO_SIZE]


def peer_credentials(tls: TlsConfig) -> tuple[ssl.SSLContext | None, str]:
    """(the context this shard dials peers with, "") if its certificate works as a TLS
    client certificate against its own CA (checked by a handshake in memory, so any PKI
    is judged as OpenSSL will judge it), else (None, why not)."""
    try:
        ctx = tls.peer_context()
        probe = tls.peer_context()
        probe.check_hostname = False
        server = tls.server_context()
    except InputError as e:
        return None, str(e)
    c_in, c_out, s_in, s_out = (ssl.MemoryBIO() for _ in range(4))
    client = probe.wrap_bio(c_in, c_out, server_side=False)
    srv = server.wrap_bio(s_in, s_out, server_side=True)
    done = [False, False]
    try:
        for _ in range(8):
            for k, obj in enumerate((client, srv)):
                if not done[k]:
                    try:
                        obj.do_handshake()
                        done[k] = True
                    except ssl.SSLWantReadError:
                        pass
            s_in.write(c_out.read())
            c_in.write(s_out.read())
            if all(done):  # the server side has judged the client's certificate
                return ctx, ""
    except ssl.SSLError as e:
        return None, (f"{SHARD_CERT} is not valid as a TLS client certificate for this CA "
                      f"({e.reason or e}); `mtplib tls init` issues one that is")
    return None, "the in-memory TLS handshake of the peer credentials did not finish"


class PeerForwarder:
    """One peer link out of this shard: a loopback port upstream's RPC server dials instead
    of the endpoint the client named (see the module doc). It takes one connection within
    ``accept_s``, only if that starts with ``hello`` (the PEER_HELLO of the client's
    PEER_CONNECT), then opens mutual TLS to ``target`` with ``ctx`` and passes pushes
    (`PeerChecker`) one way and one PEER_HELLO answer the other. ``ctx`` None: this shard
    cannot dial peers; the connection is closed (the link stays on the star)."""

    def __init__(self, hello: bytes, target: tuple[str, int], ctx: ssl.SSLContext | None, *,
                 limits: RpcLimits, log: Callable[[str], None],
                 count: Callable[[str], None], accept_s: float = FORWARD_ACCEPT_S) -> None:
        self.hello, self.target, self.ctx = hello, target, ctx
        self.limits, self._log, self._count = limits, log, count
        self.accept_s = accept_s
        self._srv = socket.create_server(("127.0.0.1", 0))
        self._srv.settimeout(0.2)
        self.endpoint = "{}:{}".format(*self._srv.getsockname()[:2])
        self._socks: list = []
        self._lock = threading.Lock()
        self._closed = False
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name=f"gateway-peer-{self.endpoint}")
        self._thread.start()

    def _keep(self, s) -> bool:
        with self._lock:
            if self._closed:
                return False
            self._socks.append(s)
            return True

    def _accept(self) -> socket.socket | None:
        end = time.monotonic() + self.accept_s
        try:
            while time.monotonic() < end and not self._closed:
                try:
                    local, _ = self._srv.accept()
                    return local
                except TimeoutError:
                    continue
        except OSError:
            pass
        finally:
            with contextlib.suppress(OSError):
                self._srv.close()
        return None

    def _run(self) -> None:
        target = "{}:{}".format(*self.target)
        local = self._accept()
        if local is None or not self._keep(local):
            if local is not None:
                local.close()
            return
        try:
            local.settimeout(FORWARD_DIAL_S)
            got = b""
            while len(got) < len(self.hello):
                chunk = local.recv(len(self.hello) - len(got))
                if not chunk:
                    break
                got += chunk
            if not hmac.compare_digest(got, self.hello):
                self._count("peer_forward_refused")
                self._log(f"peer link to {target}: the local connection did not present "
                          "its PEER_HELLO; closed, nothing dialed")
                return self.close()
            if self.ctx is None:
                self._count("peer_forward_refused")
                return self.close()
            remote = self._dial()
            if remote is None:
                return self.close()
            local.settimeout(None)
            local.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            checker = PeerChecker(self.limits)
            remote.sendall(checker.feed(got))
            self._count("peer_links_out")
            down = threading.Thread(target=self._down, args=(remote, local), daemon=True,
                                    name=f"gateway-peer-down-{target}")
            down.start()
            try:
                _checked_copy(local, remote, checker)
            except FrameError as e:
                self._count("peer_frame_errors")
                self._log(f"peer link to {target}: this shard sent {e}; closed")
        except OSError:
            pass
        self.close()

    def _dial(self) -> TlsStream | None:
        target = "{}:{}".format(*self.target)
        try:
            sock = socket.create_connection(self.target, timeout=FORWARD_DIAL_S)
        except OSError as e:
            self._count("peer_dial_failed")
            self._log(f"peer link to {target}: unreachable ({e.strerror or e})")
            return None
        if not self._keep(sock):
            sock.close()
            return None
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        keepalive(sock)
        stream = TlsStream(sock, self.ctx, server_side=False, server_hostname=self.target[0])
        try:
            stream.handshake(FORWARD_DIAL_S)
        except (ssl.SSLError, OSError) as e:  # TimeoutError is an OSError
            self._count("peer_dial_failed")
            self._log(f"peer link to {target}: TLS handshake failed "
                      f"({getattr(e, 'verify_message', None) or getattr(e, 'reason', None) or e})"
                      "; nothing sent")
            return None
        if stream.alpn() != PEER_ALPN:
            self._count("peer_dial_failed")
            self._log(f"peer link to {target}: that gateway does not take peer links (no "
                      f"ALPN {PEER_ALPN}); nothing sent")
            return None
        return stream

    def _down(self, remote: TlsStream, local: socket.socket) -> None:
        """The other shard's answers: its PEER_HELLO reply, nothing more."""
        n = 0
        try:
            while data := remote.recv(CHUNK):
                n += len(data)
                if n > PEER_REPLY_BYTES:
                    self._log("peer link to {}:{}: the other side sent more than its "
                              "PEER_HELLO answer; closed".format(*self.target))
                    break
                local.sendall(data)
        except OSError:
            pass
        self.close()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            socks, self._socks = self._socks, []
        with contextlib.suppress(OSError):
            self._srv.close()
        for s in socks:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            with contextlib.suppress(OSError):
                s.close()


def _first_cert_der(path) -> bytes:
    """The DER of the first certificate in a PEM file (b"" if there is none)."""
    try:
        pem = path.read_text()
    except (OSError, UnicodeDecodeError):
        return b""
    begin, end = "-----BEGIN CERTIFICATE-----", "-----END CERTIFICATE-----"
    if begin not in pem or end not in pem:
        return b""
    try:
        return ssl.PEM_cert_to_DER_cert(pem[pem.index(begin):pem.index(end) + len(end)])
    except ValueError:
        return b""


class Gateway(Front):
    """Mutual-TLS front of one RPC server (see the module doc and `Front`). ``public`` is
    bound at construction (OSError if it cannot be); ``start()`` serves in a thread,
    ``close()`` stops. ``stats`` counts what happened; ``log`` gets one line per notable
    event. ``peers=False``: this gateway dials no peer links (its forwarders refuse) and
    says so; ``peer_problem`` says why it dials none ("" where it does). ``report``: what
    it answers mtplib's report request (None: it closes such a connection unanswered)."""

    kind = "gateway"
    silent = ("pre_tls_timeout", "no TLS byte")
    slow = ("handshake_timeout", "no TLS handshake")
    evicted_words = "pending handshake evicted by newer connections"

    def __init__(self, public: tuple[str, int], upstream: tuple[str, int], tls: TlsConfig, *,
                 handshake_timeout_s: float = HANDSHAKE_S, first_byte_s: float = FIRST_BYTE_S,
                 max_pending: int = 64, max_per_source: int = 8, max_peers: int = 16,
                 limits: RpcLimits = DEFAULT_LIMITS,
                 log: Callable[[str], None] | None = None,
                 report: ShardReport | None = None, peers: bool = True) -> None:
        self.limits = limits
        self._reply = report_reply(report) if report is not None else None
        self.ctx = tls.server_context()
        self.ctx.num_tickets = 0  # no resumption: every session proves its certificate
        # a peer link offers PEER_ALPN, a report request REPORT_ALPN, a client neither
        self.ctx.set_alpn_protocols([PEER_ALPN, REPORT_ALPN])
        self.peer_ctx, self.peer_problem = (peer_credentials(tls) if peers
                                            else (None, "peer links turned off"))
        self.features = (GATEWAY_PEER,) if self.peer_ctx is not None else ()
        #: this shard's own certificate: a client presenting it is refused (peers only)
        self._own_cert = _first_cert_der(tls.dir / SHARD_CERT)
        self.max_peers = max_peers
        self.instance = secrets.token_hex(8)
        self._active: tuple[TlsStream, socket.socket] | None = None
        #: the peer links admitted into this shard (their TLS stream and upstream socket)
        self._peers: list[list] = []
        #: the peer links out of the client session being served
        self._forwarders: list[PeerForwarder] = []
        super().__init__(public, upstream, handshake_timeout_s=handshake_timeout_s,
                         first_byte_s=first_byte_s, max_pending=max_pending,
                         max_per_source=max_per_source, log=log, counters=(
                             "pre_tls_timeout", "handshake_failed", "handshake_timeout",
                             "busy", "sessions", "frame_errors", "upstream_unreachable",
                             "shard_cert_as_client", "peer_sessions", "peer_refused",
                             "peer_frame_errors", "peer_links_out", "peer_forward_refused",
                             "peer_dial_failed", "reports", "report_refused"))

    def _status(self, stream: TlsStream, what: bytes) -> None:
        words = list(self.features) if what == GATEWAY_READY else []
        extra = b"".join(b" " + w.encode() for w in words if w)
        stream.sendall(GATEWAY_MAGIC + what + b" " + self.instance.encode() + extra + b"\n")

    def _prove(self, sock: socket.socket, who: str, t0: float) -> TlsStream:
        stream = TlsStream(sock, self.ctx, server_side=True)
        stream.handshake(self.handshake_timeout_s - (time.monotonic() - t0))
        return stream

    def _failed(self, who: str, e: OSError) -> None:
        self._count("handshake_failed")
        self.log(f"{who}: TLS handshake failed ({getattr(e, 'reason', None) or e}); closed")

    def _serve(self, sock: socket.socket, stream: TlsStream, who: str) -> None:
        if stream.alpn() == PEER_ALPN:
            self._peer_session(stream, who)
        elif stream.alpn() == REPORT_ALPN:
            self._report(stream, who)
        else:
            self._session(stream, who)

    def _report(self, stream: TlsStream, who: str) -> None:
        """A report request (see the module doc): answered, or closed unanswered when this
        gateway has no report or the request is not exactly one within the deadline."""
        if self._reply is None:
            self._count("report_refused")
            self.log(f"{who}: asked for the shard's report; this gateway has none: closed")
            return
        deadline = time.monotonic() + self.handshake_timeout_s
        try:
            ok = is_report_request(stream, b"", deadline)
        except OSError:  # TimeoutError, PeerClosed and ssl.SSLError are OSErrors
            ok = False
        self._count("reports" if ok else "report_refused")  # first: a client acts at once
        if not ok:
            self.log(f"{who}: no report request within {self.handshake_timeout_s:g} s, or "
                     "not one; closed")
            return
        with contextlib.suppress(OSError):
            stream.settimeout(self.handshake_timeout_s)
            stream.sendall(self._reply)

    def _session(self, stream: TlsStream, who: str) -> None:
        if self._own_cert and hmac.compare_digest(stream.peer_certificate_der(),
                                                  self._own_cert):
            self._count("shard_cert_as_client")
            self.log(f"{who}: presented this shard's own certificate as a client's (a "
                     "shard's certificate opens peer links only); closed")
            return
        with self._lock:
            busy = self._active is not None or self._stop.is_set()
            if not busy:
                self._active = (stream, None)  # type: ignore[assignment]
                self._forwarders = []
        if busy:
            self._count("busy")
            self.log(f"{who}: authenticated, but another client is being served: told busy")
            with contextlib.suppress(OSError):
                self._status(stream, GATEWAY_BUSY)
            return
        up = None
        try:
            up = self._upstream(who)
            if up is None:
                return
            with self._lock:
                self._active = (stream, up)
            self._count("sessions")
            self._status(stream, GATEWAY_READY)
            checker = RequestChecker(self.limits, peer_connect=lambda payload: self._forward(
                payload, who))
            self._pipe(stream, up, checker, who, "frame_errors", "session closed")
        finally:
            if up is not None:
                with contextlib.suppress(OSError):
                    up.close()
            with self._lock:
                self._active = None
                forwarders, self._forwarders = self._forwarders, []
                peers, self._peers = self._peers, []
            for f in forwarders:  # the session's peer links end with it, both ways
                f.close()
            for p in peers:
                self._end(*p)

    def _forward(self, payload: bytes, who: str) -> bytes:
        """A PEER_CONNECT's payload as upstream's RPC server gets it: the endpoint the
        client named replaced by a `PeerForwarder` of this gateway's own (FrameError for an
        endpoint that is not an IPv4 HOST:PORT, or one link too many)."""
        raw = payload[PEER_HELLO_SIZE:PEER_CONNECT_SIZE].split(b"\0", 1)[0]
        try:
            target = parse_endpoint(raw.decode("ascii"), allow_remote=True)
        except (UnicodeDecodeError, ShardError) as e:
            raise FrameError(f"PEER_CONNECT to {raw[:64]!r}: {e}") from None
        with self._lock:
            if len(self._forwarders) >= MAX_PEER_LINKS:
                raise FrameError(f"more than {MAX_PEER_LINKS} peer links in one session")
            fw = PeerForwarder(peer_hello(payload), target, self.peer_ctx,
                               limits=self.limits, log=self.log, count=self._count)
            self._forwarders.append(fw)
        self.log(f"{who}: peer link to {raw.decode()} through {fw.endpoint}"
                 + ("" if self.peer_ctx is not None else
                    f" refused ({self.peer_problem}): that pair stays on the star"))
        ep = fw.endpoint.encode()
        return payload[:PEER_HELLO_SIZE] + ep + bytes(PEER_ENDPOINT_SIZE - len(ep))

    def _peer_session(self, stream: TlsStream, who: str) -> None:
        """A peer link into this shard (see the module doc): admitted only next to a
        client session, its stream checked by `PeerChecker`."""
        entry: list = [stream, None]
        with self._lock:
            why = ("no client is being served" if self._active is None or self._stop.is_set()
                   else f"{self.max_peers} peer links are open" if len(self._peers)
                   >= self.max_peers else "")
            if not why:
                self._peers.append(entry)
        if why:
            self._count("peer_refused")
            self.log(f"{who}: peer link refused ({why}); closed")
            return
        try:
            up = self._upstream(who)
            if up is None:
                return
            with self._lock:
                entry[1] = up
                gone = entry not in self._peers  # the client session ended meanwhile
            if gone:
                return
            self._count("peer_sessions")
            self._pipe(stream, up, PeerChecker(self.limits), f"{who}: peer link",
                       "peer_frame_errors", "closed")
        finally:
            with self._lock:
                if entry in self._peers:
                    self._peers.remove(entry)
            if entry[1] is not None:
                with contextlib.suppress(OSError):
                    entry[1].close()

    def _pipe(self, stream: TlsStream, up: socket.socket, checker: FrameChecker, who: str,
              errors: str, closed: str) -> None:
        """Forward ``stream`` to the RPC server through ``checker`` (its answers straight
        back) until either side ends or a frame breaks the rules (counted under
        ``errors``); then end both."""
        down = threading.Thread(target=self._copy_down, args=(up, stream), daemon=True,
                                name=f"gateway-down-{who}")
        down.start()
        try:
            _checked_copy(stream, up, checker)
        except FrameError as e:
            self._count(errors)
            self.log(f"{who}: {e}; {closed}, nothing of it forwarded")
        except OSError:
            pass
        finally:
            self._end(stream, up)
            down.join(timeout=5)

    @staticmethod
    def _end(stream: TlsStream, up: socket.socket | None) -> None:
        for s in (stream, up):
            if s is not None:
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
        self._close_listener()
        with self._lock:
            active = self._active
            peers, forwarders = list(self._peers), list(self._forwarders)
        if active is not None and active[1] is not None:
            self._end(*active)
        for p in peers:
            self._end(*p)
        for f in forwarders:
            f.close()
        self._join()
