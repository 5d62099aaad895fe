"""A counting TCP relay: the real bytes on a shard connection, per labelled step.

One `CountingRelay` sits in front of one shard (loopback only): the client connects to
``relay.endpoint`` instead of the shard, and every byte forwarded either way is counted
under the label that is current when it passes (``with relay.step("decode"): ...``).
Bytes outside any step count under ``"other"``. `RelaySet` labels several relays at once.

When either side closes, the relay closes the other side at once, so a lost shard is seen
by the client immediately (and a lost client frees the shard for the next one).

WAN emulation: a relay can hold every chunk for a one-way delay (each direction) and pace
it at a link rate (`WanLink`). Chunks are timestamped on arrival and released in order at
``max(arrival + delay, previous release) + size / rate``, so back-to-back messages travel
together (pipelined) as on a real link rather than one round trip each.

Besides bytes, the relay counts **waits**: round trips the client blocks on until the shard
answers (upstream's RPC client sends each answered command and waits for its reply on that
connection: ggml-rpc.cpp `send_rpc_cmd` with an output). An answered request that arrives
while an earlier one is still unanswered rides in the same round trip (pipelined, as the
patched client sends a split's boundary reads: patches/0002) and is not counted again. Over
a WAN each wait costs a round trip, so waits per step kind are what a WAN-bound loop pays
for. (Over plain loopback a reply can overtake a pipelined request in the relay; then that
request counts as a wait of its own.) Each wait is also counted under the command that
opened it (`RelaySet.waits_by_command`), so a step's waits say what they were for: a
boundary or output read (GET_TENSOR), or upstream asking a shard how much memory a tensor
shape needs (GET_ALLOC_SIZE, once per new shape per process) and the like.

Allocation-size queries to a shard that reported serving its CPU are answered by the relay
itself (``answer_alloc_sizes``: `_AllocSizeAnswers`, whose answer is, to the byte, the
shard's): they never cross the link, cost no wait, and are counted in ``answered_here``.

Checks: every reply a shard sends is checked (`mtplib.runtime.rpc.check_reply`: sizes,
device count, alignment, memory; a reply nobody asked for) before it is forwarded to
upstream's client, which would act on it unchecked; a bad one closes the connection and
is kept in ``violation``. With ``tls=`` (a `TlsConfig`) the relay speaks mutual TLS to the
shard's gateway (`mtplib.distributed.gateway`), so upstream's client still talks plain TCP,
on loopback, to the relay.

Peer links (the ring, patches/0007) into a shard pass its relay where they can, so that
they are counted apart (``peer_counts``) and get the peer link's emulated WAN: in the
clear, a loopback shard's peer link dials the relay's ``endpoint`` like the client (its
first request, PEER_HELLO, tells it apart). Under TLS a shard's gateway opens peer links in
mutual TLS only, so a relay in front of a loopback shard whose TLS directory also holds the
shard's certificate (one host holding both sides, as on loopback) opens ``peer_endpoint``:
it takes the other gateway's mutual TLS there (ALPN `PEER_ALPN`, as the shard's gateway
would), counts and delays the link like any other, and passes it on in mutual TLS to the
shard's gateway, as a peer. Elsewhere (a remote shard, or no shard certificate here) peer
links go gateway to gateway, past every relay, and are not counted here.
"""

from __future__ import annotations

import contextlib
import select
import socket
import ssl
import struct
import threading
import time
from collections import defaultdict, deque
from collections.abc import Iterator, Sequence

from mtplib.distributed.framing import HEADER, PART, PAYLOAD, Framer, RpcLimits
from mtplib.distributed.tls import PEER_ALPN, TlsConfig, TlsStream, connect_ready
from mtplib.errors import InputError
from mtplib.runtime.links import MAX_RTT_MS, WanLink, parse_wan  # noqa: F401 - their old home
from mtplib.runtime.rpc import (
    REPLY_SIZES,
    REQUEST_SIZES,
    RPC_COMMAND_NAMES,
    RPC_GET_ALLOC_SIZE,
    RPC_GET_TENSOR,
    RPC_GRAPH_COMPUTE,
    RPC_GRAPH_COMPUTE_SLOT,
    RPC_GRAPH_RECOMPUTE,
    RPC_GRAPH_RECOMPUTE_SLOT,
    RPC_PEER_HELLO,
    RPC_PEER_PUSH,
    RPC_SET_TENSOR,
    RPC_TENSOR_SIZE,
    ShardError,
    check_reply,
    parse_endpoint,
)

CHUNK = 1 << 20
#: the largest GET_TENSOR reply the relay forwards (the gateway's largest SET_TENSOR)
MAX_REPLY_BYTES = RpcLimits.max_tensor_bytes

# upstream's RPC framing (ggml/src/ggml-rpc/ggml-rpc.cpp at the pin; `Framer` finds the
# messages): a request is | cmd (1 byte) | size (8) | payload |, a response
# | size (8) | payload |; only some commands are answered. Knowing this, the relay sorts
# the bytes it forwards into
#   data:    tensor contents (SET_TENSOR payload data, GET_TENSOR replies)
#   graph:   graph descriptions (GRAPH_COMPUTE / GRAPH_RECOMPUTE)
#   control: everything else (headers, tensor descriptors, buffers, handshake)
#: GRAPH_COMPUTE, GRAPH_RECOMPUTE and (protocol 7.1, patches/0006) their slot forms
RPC_GRAPH = {RPC_GRAPH_COMPUTE, RPC_GRAPH_RECOMPUTE, RPC_GRAPH_COMPUTE_SLOT,
             RPC_GRAPH_RECOMPUTE_SLOT}
#: the commands that carry a whole graph description (the rest of RPC_GRAPH: a few bytes)
RPC_GRAPH_SENDS = {RPC_GRAPH_COMPUTE, RPC_GRAPH_COMPUTE_SLOT}
#: the commands upstream's server answers: those with a fixed-size reply, and GET_TENSOR
RPC_ANSWERED = {*REPLY_SIZES, RPC_GET_TENSOR}
RPC_TENSOR_NAME = slice(228, 292)  # rpc_tensor.name
CATEGORIES = ("data", "graph", "control", "unparsed")
#: graph_sends: whole graph descriptions (GRAPH_COMPUTE, GRAPH_COMPUTE_SLOT), by count
COUNTERS = ("up", "down", "waits", "graph_sends", *CATEGORIES)
#: PEER_PUSH (protocol 7.2, patches/0007): | seq (8) | rpc_tensor dst | data |
PEER_PUSH_SKIP = 8


class ReplyError(Exception):
    """A shard's reply that upstream's client must not read (see `check_reply`)."""


class _RpcParser:
    """Sorts one direction of an RPC byte stream (framed by `Framer`) into CATEGORIES (see
    above); on the way down, checks each reply (ReplyError) before the chunk holding it is
    forwarded. ``unanswered``: answered requests of the connection whose reply header has
    not come yet (shared by both directions' parsers, one element)."""

    def __init__(self, up: bool, expect: deque, unanswered: list[int],
                 check: bool = True) -> None:
        self.up, self.expect, self.unanswered, self.check = up, expect, unanswered, check
        self.frames = Framer(requests=up)
        self.broken = False  # unchecked streams only: a reply nobody asked for
        self.desc = b""
        self.name = ""
        self.cmd = -1  # the current request's command; down: that of the awaited reply
        self.desc_left = 0  # of the payload, leading descriptor bytes (control)
        self.desc_skip = 0  # of the descriptor, the bytes before its rpc_tensor
        self.reply = b""  # a fixed-size reply's payload, checked when complete

    def feed(self, data: bytes, out: dict, names: dict, waits: dict | None = None) -> None:
        """Add this chunk's bytes to ``out`` by category (and the requests the client will
        wait on to ``out["waits"]``, and by command to ``waits[cmd]``), and its tensor data
        to ``names[(direction, tensor name)]`` (direction "up": client -> shard, SET_TENSOR;
        "down": GET_TENSOR replies)."""
        if self.broken:
            out["unparsed"] += len(data)
            return
        for kind, i, j in self.frames.split(data):
            if kind == PAYLOAD:
                self._payload(data, i, j, out, names)
                continue
            out["control"] += j - i
            if kind == PART:
                continue
            if self.up:
                self._request(out, waits)
            elif not self._reply_header():
                self.broken = True  # not RPC: stop sorting
                out["unparsed"] += len(data) - j
                return

    def _request(self, out: dict, waits: dict | None) -> None:
        """A complete request header: what the client will wait for, what to name."""
        self.cmd, size = self.frames.cmd, self.frames.size
        if self.cmd in RPC_GRAPH_SENDS:
            out["graph_sends"] += 1
        self.desc, self.name = b"", ""
        self.desc_left = (RPC_TENSOR_SIZE + 9 if self.cmd == RPC_SET_TENSOR
                          else RPC_TENSOR_SIZE if self.cmd == RPC_GET_TENSOR
                          else PEER_PUSH_SKIP + RPC_TENSOR_SIZE if self.cmd == RPC_PEER_PUSH
                          else 0)
        # the bytes before the rpc_tensor in the payload
        self.desc_skip = PEER_PUSH_SKIP if self.cmd == RPC_PEER_PUSH else 0
        if self.cmd in RPC_ANSWERED:
            if self.unanswered[0] == 0:  # else pipelined: same round trip
                out["waits"] += 1
                if waits is not None:
                    waits[self.cmd] = waits.get(self.cmd, 0) + 1
            self.unanswered[0] += 1
        if self.cmd in RPC_ANSWERED and self.cmd != RPC_GET_TENSOR:
            self.expect.append((self.cmd, ""))
        if self.cmd == RPC_GET_TENSOR and size < RPC_TENSOR_SIZE:
            self.expect.append((self.cmd, "?"))

    def _reply_header(self) -> bool:
        """A complete reply header, matched to the request it answers and checked; False
        if no request awaits one (unchecked streams only)."""
        size = self.frames.size
        self.unanswered[0] = max(0, self.unanswered[0] - 1)
        try:
            self.cmd, self.name = self.expect.popleft()
        except IndexError:
            if self.check:
                raise ReplyError(f"a reply nobody asked for ({size} bytes)") from None
            return False
        want = REPLY_SIZES.get(self.cmd)
        if not self.check:
            want = None
        elif want is not None and size != want:
            raise ReplyError(f"a reply of {size} bytes to command {self.cmd}, expected {want}")
        elif size > MAX_REPLY_BYTES:
            raise ReplyError(f"a reply of {size} bytes (more than {MAX_REPLY_BYTES})")
        self.reply = b""
        if want == 0:
            self._check_reply()
        return True

    def _payload(self, data: bytes, i: int, j: int, out: dict, names: dict) -> None:
        """Payload bytes ``data[i:j]`` of the current message, by category."""
        take = j - i
        if self.cmd in RPC_GRAPH:
            out["graph"] += take
        elif self.up and self.cmd in (RPC_SET_TENSOR, RPC_GET_TENSOR, RPC_PEER_PUSH):
            d = min(self.desc_left, take)
            want = self.desc_skip + RPC_TENSOR_SIZE
            if len(self.desc) < want:
                self.desc += data[i:i + min(d, want - len(self.desc))]
                if len(self.desc) == want:
                    raw = self.desc[self.desc_skip:][RPC_TENSOR_NAME]
                    self.name = raw.split(b"\0", 1)[0].decode("utf-8", "replace")
                    if self.cmd == RPC_GET_TENSOR:
                        self.expect.append((self.cmd, self.name))
            if self.cmd == RPC_GET_TENSOR:  # the request is all descriptor
                d = take
            self.desc_left -= min(d, self.desc_left)
            out["control"] += d
            if take > d:
                out["data"] += take - d
                key = ("peer" if self.cmd == RPC_PEER_PUSH else "up", self.name)
                names[key] = names.get(key, 0) + take - d
        elif not self.up and self.check and self.cmd in REPLY_SIZES:
            self.reply += data[i:j]
            if len(self.reply) == REPLY_SIZES[self.cmd]:
                self._check_reply()
            out["control"] += take
        elif self.cmd == RPC_GET_TENSOR and not self.up:
            out["data"] += take
            key = ("down", self.name)
            names[key] = names.get(key, 0) + take
        else:
            out["control"] += take

    def _check_reply(self) -> None:
        bad = check_reply(self.cmd, self.reply)
        if bad:
            raise ReplyError(bad)


class _AllocSizeAnswers:
    """Upstream's allocation-size queries to a CPU shard, answered in the relay.

    Why: upstream's RPC client asks the shard, in a blocking round trip, how much memory
    every new shape of some tensors needs (ggml-rpc.cpp
    `ggml_backend_rpc_buffer_type_get_alloc_size`: MUL_MAT, MUL_MAT_ID, FLASH_ATTN_EXT,
    TOP_K, ARGSORT, CUMSUM outputs, some quantized tensors), cached per process: 22-31
    round trips per new prompt width, the best part of a cold generation's time to first
    token over a WAN. A CPU shard's answer is always ``ggml_nbytes(tensor)`` (the CPU buffer
    types have no ``get_alloc_size``: ggml-backend.cpp, ggml-cpu), and the client uses
    ``max(answer, ggml_nbytes(tensor))``, so an answer of 0 given here is, to the byte, what
    the shard would say. Only for a shard that reported serving its CPU
    (`ShardReport.device`), only a query on device 0 of the size upstream sends, and only
    when no answer of the shard's is still owed (else the reply would overtake it): any
    other query goes to the shard as before.

    `take` runs on the client-to-shard bytes before they are counted: it holds a query's
    bytes back until the query is complete, then drops it and counts an answer to give."""

    REPLY = struct.pack("<QQ", REPLY_SIZES[RPC_GET_ALLOC_SIZE], 0)

    def __init__(self) -> None:
        self.frames = Framer(requests=True)
        self.held = bytearray()  # the current query's bytes, while it may be answered here
        self.holding = False

    def take(self, data: bytes, owed: int) -> tuple[bytes, int]:
        """``data`` less the queries answered here, and how many of those it completed;
        ``owed``: the shard's answers still owed before ``data``."""
        out: list[bytes | memoryview] = []
        answered = 0
        changed = self.holding  # bytes held from an earlier chunk
        view = memoryview(data)
        for kind, i, j in self.frames.split(data):
            run = view[i:j]
            if kind != PAYLOAD and len(self.frames.header) == j - i:  # a request starts
                self.holding = data[i] == RPC_GET_ALLOC_SIZE and owed == 0
            if self.holding:
                self.held += run
                changed = True
            else:
                out.append(run)
            if kind == HEADER:
                if self.holding and self.frames.size != REQUEST_SIZES[RPC_GET_ALLOC_SIZE]:
                    self._release(out)  # not the query upstream sends: the shard's to answer
                    owed += 1
                elif not self.holding and self.frames.cmd in RPC_ANSWERED:
                    owed += 1
            if self.holding and kind != PART and self.frames.left == 0:
                if self.held[9:13] == bytes(4):  # device 0: the one an mtplib shard serves
                    answered += 1
                    self.held.clear()
                    self.holding = False
                else:
                    self._release(out)
                    owed += 1
        if not changed:
            return data, 0  # nothing held or dropped: the chunk as it came, uncopied
        return b"".join(out), answered

    def _release(self, out: list) -> None:
        """Forward the held bytes after all (the shard answers this query)."""
        out.append(bytes(self.held))
        self.held.clear()
        self.holding = False


class _Conn:
    def __init__(self, client: socket.socket, upstream, check: bool = True) -> None:
        self.client, self.upstream = client, upstream
        self.busy = [False, False]
        # delayed forwarding (WAN): per direction, (release time, chunk); None ends it
        self.queues: tuple[deque, deque] = (deque(), deque())
        self.ready = (threading.Condition(), threading.Condition())
        expect: deque = deque()
        unanswered = [0]
        #: the shard's answers still owed (both parsers' count)
        self.unanswered = unanswered
        #: allocation-size queries answered in the relay (made on the first client bytes)
        self.answers: _AllocSizeAnswers | None = None
        self.parsers = (_RpcParser(True, expect, unanswered, check),
                        _RpcParser(False, expect, unanswered, check))
        self.closed = threading.Event()
        self.closed_by: str | None = None
        self.lock = threading.Lock()
        #: "client" (upstream's client) or "peer" (another shard's peer link, protocol 7.2:
        #: its first request is PEER_HELLO); None until its first bytes
        self.kind: str | None = None

    def close(self, by: str) -> None:
        with self.lock:
            if self.closed_by is None:
                self.closed_by = by
            for s in (self.client, self.upstream):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)
                with contextlib.suppress(OSError):
                    s.close()
            self.closed.set()


class CountingRelay:
    """Forward 127.0.0.1:<ephemeral> to ``upstream`` and count the bytes per step label.

    ``counts[label] = {"up": client->shard bytes, "down": shard->client bytes,
    "data"/"graph"/"control"/"unparsed": the same bytes by RPC content}``."""

    def __init__(self, upstream: str, *, name: str | None = None,
                 allow_remote: bool = False, link: WanLink | None = None,
                 tls: TlsConfig | None = None, check_replies: bool = True,
                 answer_alloc_sizes: bool = False) -> None:
        self.upstream = upstream
        self.check_replies = check_replies
        #: answer the client's allocation-size queries here (a CPU shard: `_AllocSizeAnswers`)
        self.answer_alloc_sizes = answer_alloc_sizes
        #: label -> allocation-size queries answered here (never crossed the link)
        self.answered_here: dict[str, int] = defaultdict(int)
        self.link = link or WanLink()
        #: the link a peer connection into this shard gets (the ring's shard-to-shard hop,
        #: ``--peer-wan``); None: the same as the client's (``link``)
        self.peer_link: WanLink | None = None
        self.tls = tls
        self._tls_ctx = tls.client_context() if tls is not None else None
        self._up_addr = parse_endpoint(upstream, allow_remote=allow_remote or tls is not None)
        #: the first bad reply the shard sent (the connection was closed), else None
        self.violation: str | None = None
        #: the gateway's instance id (TLS), once connected
        self.shard_instance: str | None = None
        self.name = name or upstream
        self.label = "other"
        self.counts: dict[str, dict[str, int]] = defaultdict(lambda: dict.fromkeys(COUNTERS, 0))
        #: label -> (direction, tensor name) -> data bytes
        self.tensors: dict[str, dict[tuple[str, str], int]] = defaultdict(dict)
        self.events: list[dict] = []  # connection opened / closed (by whom), with times
        #: the same for peer links into this shard (patches/0007: another shard pushing
        #: boundary values here), kept apart so the client's figures stay the client's;
        #: their tensor data is under direction "peer"
        self.peer_counts: dict[str, dict[str, int]] = defaultdict(
            lambda: dict.fromkeys(COUNTERS, 0))
        self.peer_tensors: dict[str, dict[tuple[str, str], int]] = defaultdict(dict)
        #: label -> command -> waits (the command whose request opened the round trip),
        #: on the client's connections and on peer links into this shard
        self.waits_by_cmd: dict[str, dict[int, int]] = defaultdict(dict)
        self.peer_waits_by_cmd: dict[str, dict[int, int]] = defaultdict(dict)
        self._lock = threading.Lock()
        self._conns: list[_Conn] = []
        self._opening = False  # a connection accepted, its pumps not started yet
        self._threads: list[threading.Thread] = []
        self._stop = threading.Event()
        self._srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._srv.bind(("127.0.0.1", 0))
        self._srv.listen(4)
        self._srv.settimeout(0.2)  # the accept loop notices close() within that
        self.endpoint = f"127.0.0.1:{self._srv.getsockname()[1]}"
        t = threading.Thread(target=self._accept, daemon=True, name=f"relay-{self.endpoint}")
        t.start()
        self._threads.append(t)
        #: TLS: where another shard's gateway opens its peer link into this shard through
        #: this relay (see the module doc); None: peer links do not pass this relay in TLS
        self.peer_endpoint: str | None = None
        self._peer_srv: socket.socket | None = None
        self._peer_opening = 0
        if tls is not None and self._up_addr[0].startswith("127."):
            self._open_peer_port(tls)

    def _open_peer_port(self, tls: TlsConfig) -> None:
        """The TLS peer port (`peer_endpoint`), where this host holds a shard certificate."""
        try:
            self._peer_in_ctx = tls.server_context()
            self._peer_out_ctx = tls.peer_context()
        except InputError:
            return  # a client-only TLS directory: peer links go gateway to gateway
        self._peer_in_ctx.num_tickets = 0
        self._peer_in_ctx.set_alpn_protocols([PEER_ALPN])
        srv = socket.create_server(("127.0.0.1", 0), backlog=4)
        srv.settimeout(0.2)
        self._peer_srv = srv
        self.peer_endpoint = f"127.0.0.1:{srv.getsockname()[1]}"
        t = threading.Thread(target=self._accept_peers, daemon=True,
                             name=f"relay-peers-{self.peer_endpoint}")
        t.start()
        self._threads.append(t)

    def set_link(self, link: WanLink, peer: WanLink | None = None) -> None:
        """Change the emulated WAN (e.g. after loading over loopback): ``link`` for the
        client's connections, ``peer`` for peer links into this shard (None: ``link``);
        chunks already queued keep their release times and order."""
        self.link, self.peer_link = link, peer

    def link_for(self, kind: str | None) -> WanLink:
        """The emulated link a connection of this kind ("client" / "peer") passes."""
        return self.peer_link if kind == "peer" and self.peer_link is not None else self.link

    # -- counting -----------------------------------------------------------------------
    @contextlib.contextmanager
    def step(self, label: str) -> Iterator[None]:
        with RelaySet([self]).step(label):
            yield

    def total(self, label: str | None = None) -> int:
        with self._lock:
            items = [self.counts[label]] if label is not None else list(self.counts.values())
            return sum(c["up"] + c["down"] for c in items)

    def snapshot(self) -> dict[str, dict[str, int]]:
        with self._lock:
            return {k: dict(v) for k, v in self.counts.items()}

    def peer_snapshot(self) -> dict[str, dict[str, int]]:
        """`snapshot` of the peer links into this shard."""
        with self._lock:
            return {k: dict(v) for k, v in self.peer_counts.items()}

    def reset(self) -> None:
        """Zero the counters (between measured runs on the same connections)."""
        with self._lock:
            self.counts.clear()
            self.tensors.clear()
            self.peer_counts.clear()
            self.peer_tensors.clear()
            self.waits_by_cmd.clear()
            self.peer_waits_by_cmd.clear()
            self.answered_here.clear()

    def quiesce(self, timeout_s: float = 0.5) -> bool:
        """Wait until nothing is in flight: everything counted (`settled`) and no chunk held
        for the emulated delay, on two checks in a row; True if reached within ``timeout_s``."""
        end = time.monotonic() + timeout_s
        calm = 0
        while time.monotonic() < end:
            with self._lock:
                held = any(c.queues[0] or c.queues[1] for c in self._conns
                           if not c.closed.is_set())
            calm = calm + 1 if self.settled() and not held else 0
            if calm >= 2:
                return True
            time.sleep(0.001)
        return False

    def settled(self) -> bool:
        """True if every byte that reached this relay is counted: no socket holds unread
        bytes, then no pump holds read but uncounted ones (in that order: a pump marks itself
        busy before it takes bytes out). Chunks held for the emulated delay are counted
        already, so unlike `quiesce` this does not wait for them: one check, microseconds."""
        if self._opening:
            return False
        with self._lock:
            conns = [c for c in self._conns if not c.closed.is_set()]
            if self._peer_opening:
                return False
        socks = [s for c in conns for s in (c.client, c.upstream)]
        listening = [self._srv, *([self._peer_srv] if self._peer_srv is not None else [])]
        try:  # the listening sockets too: a connection not yet accepted holds bytes
            if select.select([*listening, *socks], [], [], 0)[0]:
                return False
        except (OSError, ValueError):  # a socket closed under us: nothing more comes
            pass
        if any(s.pending() for s in socks if hasattr(s, "pending")):
            return False
        return not any(any(c.busy) for c in conns)

    # -- plumbing -----------------------------------------------------------------------
    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                client, _ = self._srv.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            self._opening = True
            client.settimeout(None)
            try:
                up = self._connect()
            except (OSError, ShardError) as e:
                self._event("upstream_unreachable", error=str(e))
                with contextlib.suppress(OSError):
                    client.close()
                self._opening = False
                continue
            for s in (client, up):
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._start(_Conn(client, up, self.check_replies))
            self._opening = False

    def _start(self, conn: _Conn) -> None:
        """Count and forward a connection from here on (its two pumps and releases)."""
        with self._lock:
            self._conns.append(conn)
        self._event("open", **({"link": "peer"} if conn.kind == "peer" else {}))
        client, up = conn.client, conn.upstream
        for i, (src, dst, key) in enumerate(((client, up, "up"), (up, client, "down"))):
            t = threading.Thread(target=self._pump, args=(conn, i, src, dst, key),
                                 daemon=True, name=f"relay-{self.endpoint}-{key}")
            t.start()
            self._threads.append(t)
            t = threading.Thread(target=self._release, args=(conn, i, dst),
                                 daemon=True, name=f"relay-{self.endpoint}-{key}-out")
            t.start()
            self._threads.append(t)

    def _accept_peers(self) -> None:
        assert self._peer_srv is not None
        while not self._stop.is_set():
            try:
                sock, _ = self._peer_srv.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            with self._lock:
                self._peer_opening += 1
            threading.Thread(target=self._open_peer, args=(sock,), daemon=True,
                             name=f"relay-peer-{self.peer_endpoint}").start()

    def _open_peer(self, sock: socket.socket) -> None:
        """One TLS peer link into this shard: mutual TLS with the dialing gateway (its
        certificate checked against the CA, ALPN `PEER_ALPN`), then mutual TLS on to the
        shard's gateway as a peer; closed if either fails."""
        inner = up = None
        started = False
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            inner = TlsStream(sock, self._peer_in_ctx, server_side=True)
            inner.handshake(3.0)
            if inner.alpn() != PEER_ALPN:
                raise ConnectionError("a TLS connection without ALPN "
                                      f"{PEER_ALPN} at the peer port")
            raw = socket.create_connection(self._up_addr, timeout=5)
            raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            up = TlsStream(raw, self._peer_out_ctx, server_side=False,
                           server_hostname=self._up_addr[0])
            up.handshake(5.0)
            if up.alpn() != PEER_ALPN:
                raise ConnectionError("the shard's gateway does not take peer links")
            conn = _Conn(inner, up, self.check_replies)
            conn.kind = "peer"
            self._start(conn)
            started = True
        except (OSError, ssl.SSLError) as e:
            self._event("peer_refused", error=str(e))
        finally:
            if not started:
                for s in (up, sock):
                    if s is not None:
                        with contextlib.suppress(OSError):
                            s.close()
            with self._lock:
                self._peer_opening -= 1

    def _connect(self):
        """The shard connection: plain TCP, or mutual TLS to its gateway (retrying "busy"
        for BUSY_RETRY_S while the gateway closes the previous session)."""
        if self.tls is None:
            up = socket.create_connection(self._up_addr, timeout=5)
            up.settimeout(None)
            return up
        stream, self.shard_instance = connect_ready(self._up_addr, self.tls, ctx=self._tls_ctx)
        return stream

    def _pump(self, conn: _Conn, i: int, src: socket.socket, dst: socket.socket,
              key: str) -> None:
        free_at = 0.0  # when the emulated link finishes sending the previous chunk
        q, ready = conn.queues[i], conn.ready[i]
        # a plain socket is peeked first, so `busy` is set while the bytes still sit in it:
        # `settled` (no socket readable, then no pump busy) cannot miss bytes in between.
        # TLS streams cannot be peeked (they only carry replies, all awaited within a step)
        peek = isinstance(src, socket.socket)
        try:
            while True:
                if peek:
                    if not src.recv(1, socket.MSG_PEEK):
                        break
                    conn.busy[i] = True
                data = src.recv(CHUNK)
                if not data:
                    break
                conn.busy[i] = True
                if conn.kind is None and i == 0:
                    conn.kind = "peer" if data[0] == RPC_PEER_HELLO else "client"
                peer = conn.kind == "peer"
                answered = 0
                try:
                    with self._lock:
                        if i == 0 and not peer and self.answer_alloc_sizes:
                            if conn.answers is None:
                                conn.answers = _AllocSizeAnswers()
                            data, answered = conn.answers.take(data, conn.unanswered[0])
                            self.answered_here[self.label] += answered
                        c = (self.peer_counts if peer else self.counts)[self.label]
                        c[key] += len(data)
                        conn.parsers[i].feed(
                            data, c, (self.peer_tensors if peer else self.tensors)[self.label],
                            (self.peer_waits_by_cmd if peer else self.waits_by_cmd)[self.label])
                except ReplyError as e:  # never forwarded: upstream's client would act on it
                    with self._lock:
                        self.violation = self.violation or str(e)
                    self._event("malformed_reply", error=str(e))
                    conn.close(by="relay")
                    break
                link = self.link_for(conn.kind)  # may change between steps (set_link)
                if not data:
                    pass
                elif not link.active and not q:
                    dst.sendall(data)
                else:
                    start = max(time.monotonic() + link.one_way_s, free_at)
                    free_at = start + (len(data) * 8 / (link.mbit * 1e6) if link.mbit else 0.0)
                    with ready:
                        q.append((free_at, data))
                        ready.notify()
                if answered:  # behind anything the shard sent before (none is owed)
                    back, back_ready = conn.queues[1], conn.ready[1]
                    with back_ready:
                        back.append((max([time.monotonic(), *(t for t, _ in back)]),
                                     _AllocSizeAnswers.REPLY * answered))
                        back_ready.notify()
                conn.busy[i] = False
        except OSError:
            pass
        conn.busy[i] = False
        with ready:  # what is in flight still arrives, then the close
            q.append((max(time.monotonic() + self.link_for(conn.kind).one_way_s, free_at),
                      None))
            ready.notify()

    def _release(self, conn: _Conn, i: int, dst: socket.socket) -> None:
        """Forward each queued chunk at its release time, in arrival order; then close."""
        side = "client" if i == 0 else "shard"
        q, ready = conn.queues[i], conn.ready[i]
        try:
            while True:
                with ready:
                    while not q:
                        ready.wait()
                    due, data = q[0]
                wait = due - time.monotonic()
                if wait > 0:
                    time.sleep(wait)
                if data is None:
                    break
                dst.sendall(data)
                with ready:
                    q.popleft()
        except OSError:
            pass
        with ready:
            q.clear()
        if not conn.closed.is_set():
            self._event("closed", by=side, **({"link": "peer"} if conn.kind == "peer" else {}))
            conn.close(by=side)

    def _event(self, what: str, **kw) -> None:
        with self._lock:
            self.events.append({"t": time.time(), "event": what, **kw})

    def flow(self) -> tuple[int, int, int]:
        """(bytes client->shard, bytes shard->client, requests awaiting the shard's reply)
        now; read-only, for liveness checks (byte totals restart at `reset`)."""
        with self._lock:
            counts = [*self.counts.values(), *self.peer_counts.values()]
            up = sum(c["up"] for c in counts)
            down = sum(c["down"] for c in counts)
            pending = sum(len(c.parsers[0].expect) for c in self._conns
                          if not c.closed.is_set())
        return up, down, pending

    def closed_first_by_shard(self) -> bool:
        """True if a client connection was closed by the shard's side first (the shard died
        or hung up), not as the echo of the client closing; read-only. Peer links do not
        count: a shard closes them when a session ends or a peer misbehaves."""
        with self._lock:
            return any(c.closed_by == "shard" and c.kind != "peer" for c in self._conns)

    def lost_by_shard(self) -> bool:
        """True if a client connection was closed from the shard's side (the shard died)."""
        with self._lock:
            return any(e["event"] == "closed" and e.get("by") == "shard"
                       and e.get("link") != "peer" for e in self.events)

    def close(self) -> None:
        self._stop.set()
        for srv in (self._srv, self._peer_srv):
            if srv is None:
                continue
            with contextlib.suppress(OSError):
                srv.shutdown(socket.SHUT_RDWR)  # wakes a blocked accept() on Linux
            with contextlib.suppress(OSError):
                srv.close()
        with self._lock:
            conns = list(self._conns)
        for c in conns:
            c.close(by="relay")
        for t in self._threads:
            t.join(timeout=2)

    def __enter__(self) -> CountingRelay:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def summed(per_relay: Sequence[dict[str, int]]) -> dict[str, int]:
    """Per-relay counts (e.g. `RelaySet.waits_by_command`) added up over the relays."""
    out: dict[str, int] = {}
    for d in per_relay:
        for k, n in d.items():
            out[k] = out.get(k, 0) + n
    return dict(sorted(out.items()))


class RelaySet:
    """Several relays labelled together (one per shard of a plan)."""

    def __init__(self, relays: Sequence[CountingRelay]) -> None:
        self.relays = list(relays)
        self._stack: list[str] = []

    @contextlib.contextmanager
    def step(self, label: str) -> Iterator[None]:
        """Count the bytes of the block under ``label`` (nested steps: innermost wins).

        The label switches once every byte sent before it is counted (`settle`): the client
        has handed its bytes to the relays' sockets by then (`mtplib.distributed.worker`
        flushes its shard sockets before it reports a step boundary)."""
        self.settle()
        prev = [r.label for r in self.relays]
        for r in self.relays:
            r.label = label
        try:
            yield
        finally:
            self.settle()
            for r, p in zip(self.relays, prev, strict=True):
                r.label = p

    def settle(self, timeout_s: float = 0.5) -> bool:
        """Wait until every relay has counted what reached it (`CountingRelay.settled`);
        one pass when idle. At a step boundary nothing is left to arrive: the step's answered
        requests were answered inside it, the rest are in the relays' sockets already."""
        end = time.monotonic() + timeout_s
        while not all(r.settled() for r in self.relays):
            if time.monotonic() >= end:
                return False
            time.sleep(0.0001)
        return True

    def _quiesce(self) -> None:
        """Wait until nothing is in flight at all, delayed chunks included (between runs)."""
        for r in self.relays:
            r.quiesce()

    def by_label(self) -> dict[str, dict]:
        """label -> {"up", "down", "total", data/graph/control/unparsed,
        "per_shard": [total per relay]}."""
        out: dict[str, dict] = {}
        for i, r in enumerate(self.relays):
            for label, c in r.snapshot().items():
                o = out.setdefault(label, {**dict.fromkeys(COUNTERS, 0), "total": 0,
                                           "per_shard": [0] * len(self.relays),
                                           "waits_per_shard": [0] * len(self.relays)})
                for k in COUNTERS:
                    o[k] += c[k]
                o["total"] += c["up"] + c["down"]
                o["per_shard"][i] += c["up"] + c["down"]
                o["waits_per_shard"][i] += c["waits"]
        return out

    def total(self, label: str | None = None) -> int:
        return sum(r.total(label) for r in self.relays)

    def peer_by_label(self) -> dict[str, dict]:
        """`by_label` of the peer links (patches/0007): per label, the bytes other shards
        pushed into each shard (``per_shard``: into shard i, through its relay)."""
        out: dict[str, dict] = {}
        for i, r in enumerate(self.relays):
            for label, c in r.peer_snapshot().items():
                o = out.setdefault(label, {**dict.fromkeys(COUNTERS, 0), "total": 0,
                                           "per_shard": [0] * len(self.relays)})
                for k in COUNTERS:
                    o[k] += c[k]
                o["total"] += c["up"] + c["down"]
                o["per_shard"][i] += c["up"] + c["down"]
        return out

    def peer_by_tensor_dir(self, label: str) -> list[dict[tuple[str, str], int]]:
        """Per relay: ("peer", tensor name) -> data bytes pushed into that shard."""
        out = []
        for r in self.relays:
            with r._lock:
                out.append(dict(r.peer_tensors.get(label, {})))
        return out

    def answered_here(self, label: str) -> list[int]:
        """Per relay: allocation-size queries under ``label`` answered in the relay (no
        round trip; `_AllocSizeAnswers`)."""
        out = []
        for r in self.relays:
            with r._lock:
                out.append(r.answered_here.get(label, 0))
        return out

    def waits_by_command(self, label: str, *, peer: bool = False) -> list[dict[str, int]]:
        """Per relay: the waits under ``label`` by the command that opened each round trip
        (upstream's name, e.g. ``GET_TENSOR``, ``GET_ALLOC_SIZE``), on the client's
        connections (``peer``: on the peer links into that shard)."""
        out = []
        for r in self.relays:
            with r._lock:
                d = (r.peer_waits_by_cmd if peer else r.waits_by_cmd).get(label, {})
                out.append({RPC_COMMAND_NAMES.get(c, str(c)): n for c, n in sorted(d.items())})
        return out

    def by_tensor(self, label: str) -> list[dict[str, int]]:
        """Per relay: tensor name -> data bytes moved under ``label`` (both directions)."""
        out = []
        for per_dir in self.by_tensor_dir(label):
            d: dict[str, int] = {}
            for (_, name), n in per_dir.items():
                d[name] = d.get(name, 0) + n
            out.append(d)
        return out

    def by_tensor_dir(self, label: str) -> list[dict[tuple[str, str], int]]:
        """Per relay: (direction, tensor name) -> data bytes moved under ``label``."""
        out = []
        for r in self.relays:
            with r._lock:
                out.append(dict(r.tensors.get(label, {})))
        return out

    def labels(self) -> list[str]:
        with contextlib.ExitStack() as st:
            for r in self.relays:
                st.enter_context(r._lock)
            return sorted({lb for r in self.relays for lb in (*r.counts, *r.peer_counts)})

    def close(self) -> None:
        for r in self.relays:
            r.close()
