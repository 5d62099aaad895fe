"""Upstream's RPC framing, found once for every RPC byte stream mtplib watches, and the
checks a shard's fronts make of it.

A request is ``| cmd (1) | size (8 LE) | payload |``, a reply ``| size (8 LE) | payload |``
(ggml/src/ggml-rpc/ggml-rpc.cpp at the pin; `mtplib.runtime.rpc` holds the commands and
their sizes). TCP and TLS cut a stream anywhere, so a header can arrive split over several
chunks and one chunk can hold many messages: `Framer` finds the message boundaries of one
direction of one connection across any chunking. The shard's gateway
(`mtplib.distributed.gateway`) and the counting relay (`mtplib.distributed.relay`: sorts
the bytes, counts waits, checks replies) both read their streams through it, so the two
cannot disagree on where a message starts.

The checks, under the bounds of `RpcLimits`: `RequestChecker` (a client's stream) and
`PeerChecker` (a peer link's) hold every request header back until it is complete and
checked (`FrameChecker`); `first_request` judges a connection's first header by them (the
plaintext front, `mtplib.distributed.plain_front`).
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from mtplib.runtime.rpc import (
    GRAPH_HEADER,
    GRAPH_SLOT_HEADER,
    PEER_PUSH_HEADER,
    REQUEST_SIZES,
    RPC_CMD_HELLO,
    RPC_GRAPH_COMPUTE,
    RPC_GRAPH_COMPUTE_SLOT,
    RPC_N_COMMANDS,
    RPC_PEER_CONNECT,
    RPC_PEER_HELLO,
    RPC_PEER_PUSH,
    RPC_SET_TENSOR,
    SET_TENSOR_HEADER,
)

#: ``| cmd (1) | size (8 LE) |`` before every request's payload
REQUEST_HEADER = 9
#: ``| size (8 LE) |`` before every reply's payload
REPLY_HEADER = 8
#: the kinds of run `Framer.split` yields: header bytes of a header still incomplete, the
#: bytes that complete a header, payload bytes of the current message
PART, HEADER, PAYLOAD = "part", "header", "payload"
#: PEER_HELLO's payload (patches/0007): | link (4) | token (16) |
PEER_HELLO_SIZE = 20


@dataclass(frozen=True)
class RpcLimits:
    """Bounds on the variable-size requests (and a peer link's pushes). Legit traffic:
    upstream's client sends a whole tensor per SET_TENSOR; V4-Flash's largest tensors on a
    shard are the routed-expert stacks, 1140850688 bytes each in MXFP4 (``mtplib fixture
    --preset v4-flash``'s table; 4.3 GB if they were BF16; token_embd stays on the client).
    A graph is 12 bytes plus 8 per node and 296 per tensor: DeepSeek-V4's node limit keeps
    it far below 256 MiB. Above any bound the session is closed before the request is
    forwarded."""

    max_tensor_bytes: int = 16 << 30
    max_graph_bytes: int = 256 << 20
    #: the largest tensor one PEER_PUSH carries on a peer link (the ring, patches/0007):
    #: upstream's server refuses more (RPC_PEER_MAX_PENDING_BYTES, 1 GiB); a boundary value
    #: is a few hidden rows (V4-Flash: 4 x 4096 F32 per token)
    max_push_bytes: int = 1 << 30


#: the bounds a gateway checks unless given others
DEFAULT_LIMITS = RpcLimits()


class Framer:
    """The message boundaries of one direction of one RPC connection (``requests``: the
    client -> shard direction, else the replies). After `split` yields a HEADER run,
    ``cmd`` (requests only; -1 for replies), ``size`` and ``header`` describe the message
    whose payload follows."""

    def __init__(self, requests: bool) -> None:
        self.requests = requests
        self.header_len = REQUEST_HEADER if requests else REPLY_HEADER
        self.header = b""  # the current message's header bytes, complete or not
        self.cmd = -1
        self.size = 0
        self.left = 0  # payload bytes of the current message still to come

    def split(self, data: bytes) -> Iterator[tuple[str, int, int]]:
        """``(kind, start, end)``: consecutive runs covering ``data`` in order, each of one
        kind (PART, HEADER or PAYLOAD); a message's runs may span several calls. A consumer
        may stop early (the rest of ``data`` is then not framed)."""
        i, n = 0, len(data)
        while i < n:
            if self.left:
                take = min(self.left, n - i)
                self.left -= take
                yield PAYLOAD, i, i + take
                i += take
                continue
            if len(self.header) == self.header_len:  # the previous message is complete
                self.header = b""
            take = min(self.header_len - len(self.header), n - i)
            self.header += data[i:i + take]
            if len(self.header) < self.header_len:
                yield PART, i, i + take
            else:
                if self.requests:
                    self.cmd = self.header[0]
                (self.size,) = struct.unpack("<Q", self.header[-8:])
                self.left = self.size
                yield HEADER, i, i + take
            i += take


class FrameError(Exception):
    """A request that breaks upstream's framing or mtplib's bounds."""


class FrameChecker:
    """One direction of an RPC stream, checked frame by frame (framed by `Framer`);
    ``feed(data)`` returns the bytes that may be forwarded now (a header is held back until
    it is complete and checked) or raises FrameError, after which nothing more is
    forwarded. ``hold`` maps a command to a rewrite of its whole (fixed-size) payload: such
    a request is held back until its payload is complete, then forwarded rewritten."""

    def __init__(self, limits: RpcLimits = DEFAULT_LIMITS,
                 hold: dict[int, Callable[[bytes], bytes]] | None = None) -> None:
        self.limits = limits
        self.frames = Framer(requests=True)
        self.n_requests = 0
        self.hold = dict(hold or {})
        self._held: bytearray | None = None
        self._held_header = b""

    def check(self, cmd: int, size: int) -> None:
        raise NotImplementedError

    def feed(self, data: bytes) -> bytes:
        out = bytearray()
        for kind, i, j in self.frames.split(data):
            if kind == PAYLOAD:
                if self._held is None:
                    out += data[i:j]
                    continue
                self._held += data[i:j]
                if len(self._held) == self.frames.size:
                    new = self.hold[self.frames.cmd](bytes(self._held))
                    if len(new) != len(self._held):
                        raise FrameError("a rewrite changed a request's size")
                    out += self._held_header + new
                    self._held = None
            elif kind == HEADER:
                self.check(self.frames.cmd, self.frames.size)
                self.n_requests += 1
                if self.frames.cmd in self.hold and self.frames.size:
                    self._held, self._held_header = bytearray(), self.frames.header
                else:
                    out += self.frames.header
        return bytes(out)


class RequestChecker(FrameChecker):
    """Checks the client->shard byte stream (see `FrameChecker`): HELLO first and once,
    known commands (protocol 7.2's PEER_EXPECT, PEER_CONNECT, PUSH_TENSOR and WAIT_TENSOR
    with their exact sizes; never a peer's PEER_HELLO or PEER_PUSH), the bounds of the
    variable ones. ``peer_connect`` (the TLS gateway's): rewrites each PEER_CONNECT payload
    before it is forwarded (`mtplib.distributed.gateway.Gateway._forward`)."""

    def __init__(self, limits: RpcLimits = DEFAULT_LIMITS,
                 peer_connect: Callable[[bytes], bytes] | None = None) -> None:
        super().__init__(limits, {RPC_PEER_CONNECT: peer_connect} if peer_connect else None)

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


class PeerChecker(FrameChecker):
    """Checks a peer link's stream (shard -> shard, patches/0007; see `FrameChecker`):
    PEER_HELLO first with its exact size, then only PEER_PUSH frames of a header and at most
    ``limits.max_push_bytes`` of data."""

    def check(self, cmd: int, size: int) -> None:
        if self.n_requests == 0:
            if cmd != RPC_PEER_HELLO:
                raise FrameError(f"a peer link's first request is command {cmd}, not "
                                 "PEER_HELLO")
            if size != PEER_HELLO_SIZE:
                raise FrameError(f"PEER_HELLO with {size} payload bytes, expected "
                                 f"{PEER_HELLO_SIZE}")
            return
        if cmd != RPC_PEER_PUSH:
            raise FrameError(f"command {cmd} on a peer link (after PEER_HELLO only "
                             "PEER_PUSH)")
        hi = PEER_PUSH_HEADER + self.limits.max_push_bytes
        if not PEER_PUSH_HEADER <= size <= hi:
            raise FrameError(f"PEER_PUSH of {size} bytes (allowed {PEER_PUSH_HEADER}..{hi})")


def first_request(header: bytes) -> int:
    """The command of a connection's first request header (`REQUEST_HEADER` bytes), if it
    opens a client session (HELLO) or a peer link (PEER_HELLO) with its exact size, as the
    checkers judge it; FrameError otherwise."""
    cmd, size = header[0], struct.unpack_from("<Q", header, 1)[0]
    (PeerChecker() if cmd == RPC_PEER_HELLO else RequestChecker()).check(cmd, size)
    return cmd
