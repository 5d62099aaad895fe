"""mtplib's report request: a shard says what it runs on the endpoint the client dials.

Why in band: the report (`mtplib.distributed.shard_report`) must reach the client through
whatever carries the shard's bytes (a TCP forward, an SSH tunnel, a container port
mapping, NAT), so it travels on a connection to the endpoint the client will use, in
plaintext and TLS alike; nothing depends on the host the client runs on.

The request is framed as an upstream request that upstream never sends:
``| REPORT_CMD (1) | size (8 LE) = 16 | REPORT_MAGIC (16) |``; REPORT_CMD (0xF0) lies far
beyond upstream's command numbers (0..25 at the pin, patches included). A shard's front
answers it with one reply framed as upstream's, ``| size (8 LE) | JSON |`` (at most
REPLY_MAX bytes: ``{"report": 1, ...}`` with the report's fields, `ShardReport.fields`),
then closes that connection; the request never reaches upstream's server. In plaintext it
is a connection's first request (`PlainFront`); under TLS, the first request of a
connection that offers ALPN REPORT_ALPN (the `Gateway` answers it without its status line
and without taking its one-client slot, so a report never says busy).

Upstream's own RPC server (ggml-rpc.cpp at the pin: stock ``rpc_serve_client``, and
patches/0007's ``rpc_serve_connection``) reads a connection's first byte and, unless it is
HELLO (or PEER_HELLO), logs "Expected HELLO command, update client" and closes it: a stock
shard answers nothing and serves on. `ask_report` bounds the answer in size and time: a
connection closed unanswered, or an answer that is not a report, is "no report: why" (one
line; MTP is refused later, naming the shard: `shard_adverts`); a shard that answers
nothing within the deadline raises TimeoutError, as its handshake would.
"""

from __future__ import annotations

import contextlib
import json
import socket
import ssl
import struct
import time

from mtplib.distributed.shard_report import ReportError, ShardReport
from mtplib.distributed.tls import TlsConfig, TlsStream, open_tls
from mtplib.runtime.rpc import PeerClosed, ShardError, recv_exact

REPORT_CMD = 0xF0
REPORT_MAGIC = b"mtplib-report/1\n"
#: the whole request; its first 9 bytes are a request header as upstream frames one
REPORT_REQUEST = bytes([REPORT_CMD]) + struct.pack("<Q", len(REPORT_MAGIC)) + REPORT_MAGIC
REPORT_HEADER = REPORT_REQUEST[:9]
#: the ALPN protocol of a TLS connection that asks for the report (a client's context)
REPORT_ALPN = "mtplib-report/1"
#: the longest answer read (a report is a few hundred bytes)
REPLY_MAX = 2048
WIRE_VERSION = 1


def report_reply(report: ShardReport) -> bytes:
    """The front's answer to a report request: ``| size (8 LE) | JSON |``."""
    body = json.dumps({"report": WIRE_VERSION, **report.fields()},
                      separators=(",", ":")).encode()
    if len(body) > REPLY_MAX:
        raise ValueError(f"a report of {len(body)} bytes (at most {REPLY_MAX})")
    return struct.pack("<Q", len(body)) + body


def is_report_request(io, got: bytes, deadline: float) -> bool:
    """Whether ``io``'s first request, of which ``got`` (at most the request's length) has
    come, is exactly REPORT_REQUEST. False as soon as its header differs (nothing more is
    read); TimeoutError past ``deadline`` (time.monotonic()), PeerClosed (an OSError) if it
    closes first."""
    n = len(REPORT_HEADER)
    if len(got) < n:
        if not REPORT_HEADER.startswith(got):
            return False
        got += recv_exact(io, n - len(got), deadline)
    if got[:n] != REPORT_HEADER:
        return False
    if len(got) < len(REPORT_REQUEST):
        got += recv_exact(io, len(REPORT_REQUEST) - len(got), deadline)
    return got == REPORT_REQUEST


def report_context(tls: TlsConfig) -> ssl.SSLContext:
    """The client's TLS context for a report request: its certificate, ALPN REPORT_ALPN."""
    ctx = tls.client_context()
    ctx.set_alpn_protocols([REPORT_ALPN])
    return ctx


def _dial(addr: tuple[str, int], endpoint: str, timeout_s: float, tls: TlsConfig | None,
          ctx: ssl.SSLContext | None) -> socket.socket | TlsStream:
    if tls is not None:
        return open_tls(addr, tls, timeout_s=timeout_s, ctx=ctx or report_context(tls))
    try:
        s = socket.create_connection(addr, timeout=timeout_s)
    except OSError as e:
        raise ShardError(f"shard {endpoint} unreachable: {e.strerror or e}") from None
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return s


def ask_report(addr: tuple[str, int], endpoint: str, *, timeout_s: float,
               tls: TlsConfig | None = None, ctx: ssl.SSLContext | None = None
               ) -> tuple[ShardReport | None, str]:
    """The report of the shard at ``addr`` (``endpoint`` names it), asked on a connection
    of its own (mutual TLS with ``tls``; ``ctx``: `report_context`'s, made once per probe):
    ``(report, "")``, or ``(None, why there is none)``. ShardError where the shard is
    unreachable or refuses this client's TLS; TimeoutError where it answers nothing within
    ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    io = _dial(addr, endpoint, timeout_s, tls, ctx)
    head = b""
    try:
        if isinstance(io, TlsStream) and io.alpn() != REPORT_ALPN:
            return None, (f"the gateway of {endpoint} does not answer the mtplib report "
                          f"request (no ALPN {REPORT_ALPN}: an older mtplib?)")
        closed = (f"{endpoint} closed the connection on the mtplib report request "
                  "(a bare upstream RPC server, or a forward to one: not an `mtplib shard "
                  "serve`)")
        try:
            try:
                io.settimeout(max(deadline - time.monotonic(), 0.001))
                io.sendall(REPORT_REQUEST)
                head = io.recv(1)  # b"": closed unanswered (a stock server's way)
            except (ConnectionResetError, BrokenPipeError):
                return None, closed
            if not head:
                return None, closed
            head += recv_exact(io, 7, deadline)
            (size,) = struct.unpack("<Q", head)
            if size > REPLY_MAX:
                return None, (f"{endpoint} answered the mtplib report request with "
                              f"{_shown(head)}, not a report")
            body = recv_exact(io, size, deadline)
        except ssl.SSLError as e:
            raise ShardError(f"shard {endpoint} refused this client's certificate or the "
                             f"TLS session ({e.reason or e})") from None
        except (PeerClosed, ConnectionResetError):
            return None, (f"{endpoint} broke off its answer to the mtplib report request "
                          f"after {_shown(head)}")
        try:
            rec = json.loads(body.decode("ascii"))
        except (UnicodeDecodeError, ValueError, RecursionError):
            return None, (f"{endpoint} answered the mtplib report request with "
                          f"{_shown(head + body)}, not a report")
        try:
            if not isinstance(rec, dict) or rec.get("report") != WIRE_VERSION:
                raise ReportError(f"not a version-{WIRE_VERSION} report: "
                                  f"{_shown(head + body)}")
            return ShardReport.from_fields({k: v for k, v in rec.items() if k != "report"}), ""
        except ReportError as e:
            return None, f"{endpoint} answered the mtplib report request with a bad report: {e}"
    finally:
        with contextlib.suppress(OSError):
            io.close()


def _shown(data: bytes) -> str:
    """The first bytes of an answer, for a one-line message."""
    return repr(data[:48]) + ("..." if len(data) > 48 else "")
