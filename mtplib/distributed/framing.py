"""Upstream's RPC framing, found once for every RPC byte stream mtplib watches.

A request is ``| cmd (1) | size (8 LE) | payload |``, a reply ``| size (8 LE) | payload |``
(ggml/src/ggml-rpc/ggml-rpc.cpp at the pin; `mtplib.runtime.rpc` holds the commands and
their sizes). TCP and TLS cut a stream anywhere, so a header can arrive split over several
chunks and one chunk can hold many messages: `Framer` finds the message boundaries of one
direction of one connection across any chunking. The shard's gateway
(`mtplib.distributed.gateway.RequestChecker`: checks every request header before
forwarding it) and the counting relay (`mtplib.distributed.relay`: sorts the bytes, counts
waits, checks replies) both read their streams through it, so the two cannot disagree on
where a message starts.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator
from dataclasses import dataclass

#: ``| cmd (1) | size (8 LE) |`` before every request's payload
REQUEST_HEADER = 9
#: ``| size (8 LE) |`` before every reply's payload
REPLY_HEADER = 8
#: the kinds of run `Framer.split` yields: header bytes of a header still incomplete, the
#: bytes that complete a header, payload bytes of the current message
PART, HEADER, PAYLOAD = "part", "header", "payload"


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
