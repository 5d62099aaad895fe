"""The one RPC framing parser (`mtplib.distributed.framing.Framer`, read by the relay and the
gateway) and the one `recv_exact` (mtplib.runtime.rpc), on their own."""

from __future__ import annotations

import random
import struct
import time

import pytest

from mtplib.distributed.framing import HEADER, PART, PAYLOAD, Framer
from mtplib.runtime.rpc import PeerClosed, ShardError, handshake, recv_exact


def _messages(rng: random.Random, requests: bool, n: int) -> list[tuple[int, bytes]]:
    sizes = [0, 1, 7, 8, 9, 296, 1000]
    return [(rng.randrange(20) if requests else -1, rng.randbytes(rng.choice(sizes)))
            for _ in range(n)]


def _wire(msgs: list[tuple[int, bytes]], requests: bool) -> bytes:
    return b"".join((bytes([c]) if requests else b"") + struct.pack("<Q", len(p)) + p
                    for c, p in msgs)


@pytest.mark.parametrize("requests", [True, False])
def test_framer_finds_every_message_in_any_chunking(requests):
    rng = random.Random(7)
    msgs = _messages(rng, requests, 60)
    wire = _wire(msgs, requests)
    for _ in range(30):
        fr = Framer(requests)
        got: list[tuple[int, bytearray]] = []
        covered = 0
        i = 0
        while i < len(wire):
            chunk = wire[i:i + rng.choice([1, 2, 5, 9, 40, 700, 5000])]
            i += len(chunk)
            at = 0
            for kind, a, b in fr.split(chunk):
                assert a == at and b > a  # consecutive runs, in order, covering the chunk
                at = b
                if kind == HEADER:
                    assert fr.header == wire[covered + b - fr.header_len:covered + b]
                    got.append((fr.cmd, bytearray()))
                    assert fr.size == fr.left
                elif kind == PAYLOAD:
                    got[-1][1].extend(chunk[a:b])
                else:
                    assert kind == PART
            assert at == len(chunk)
            covered += len(chunk)
        assert [(c, bytes(p)) for c, p in got] == msgs
        assert fr.left == 0


def test_framer_can_be_left_early_and_holds_a_split_header():
    fr = Framer(requests=True)
    wire = bytes([14]) + struct.pack("<Q", 24) + bytes(24)
    assert list(fr.split(wire[:4])) == [(PART, 0, 4)]
    runs = fr.split(wire[4:])
    assert next(runs) == (HEADER, 0, 5) and (fr.cmd, fr.size) == (14, 24)
    assert fr.header == wire[:9]


class _Io:
    """A socket-like object handing out ``parts`` one recv at a time (then EOF)."""

    def __init__(self, *parts: bytes) -> None:
        self.parts, self.timeouts = list(parts), []

    def recv(self, n: int) -> bytes:
        return self.parts.pop(0)[:n] if self.parts else b""

    def settimeout(self, t: float) -> None:
        self.timeouts.append(t)

    def sendall(self, data: bytes) -> None:
        pass


def test_recv_exact_closes_and_deadlines():
    io = _Io(b"ab", b"cd", b"e")
    assert recv_exact(io, 5) == b"abcde" and io.timeouts == []  # no deadline: untouched
    with pytest.raises(PeerClosed, match="closed after 2 of 4 bytes"):
        recv_exact(_Io(b"ab"), 4)
    assert issubclass(PeerClosed, ConnectionError)
    io = _Io(b"ab", b"cd")
    assert recv_exact(io, 4, time.monotonic() + 5) == b"abcd"
    assert len(io.timeouts) == 2 and all(0 < t <= 5 for t in io.timeouts)
    with pytest.raises(TimeoutError):
        recv_exact(_Io(b"ab"), 2, time.monotonic() - 1)


def test_a_peer_closing_in_the_handshake_is_a_shard_error():
    with pytest.raises(ShardError, match="closed the connection during the handshake"):
        handshake(_Io(), "127.0.0.1:1")
    with pytest.raises(ShardError, match="not an RPC server"):  # mid-reply
        handshake(_Io(struct.pack("<Q", 28), b"\7\0"), "127.0.0.1:1")
