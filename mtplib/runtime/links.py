"""Each shard connection's emulated WAN (`WanLink`, ``--wan``: `parse_wan`), the ring's
peer links' (``--peer-wan``: `parse_peer_wan`) and their one bound (`MAX_RTT_MS`). Pure
values: a run's request (`mtplib.runtime.request.RunRequest`) holds them, the relays in
`mtplib.distributed.relay` apply them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from mtplib.errors import InputError

#: the largest emulated RTT, ms: the one bound the CLI, lanes and the lab check against
MAX_RTT_MS = 10_000


@dataclass(frozen=True)
class WanLink:
    """One shard connection's emulated WAN: ``rtt_ms`` round trip (half of it each way)
    and an optional rate cap ``mbit`` (Mbit/s, each direction). RTT 0 without a cap is a
    plain loopback relay."""

    rtt_ms: float = 0.0
    mbit: float | None = None

    def __post_init__(self) -> None:
        if not (math.isfinite(self.rtt_ms) and 0 <= self.rtt_ms <= MAX_RTT_MS):
            raise InputError(f"WAN RTT must be in 0..{MAX_RTT_MS} ms, got {self.rtt_ms}")
        if self.mbit is not None and not (math.isfinite(self.mbit) and self.mbit > 0):
            raise InputError(f"WAN bandwidth must be > 0 Mbit/s, got {self.mbit}")

    @property
    def active(self) -> bool:
        return self.rtt_ms > 0 or self.mbit is not None

    @property
    def one_way_s(self) -> float:
        return self.rtt_ms / 2000.0

    def __str__(self) -> str:
        return f"{self.rtt_ms:g}" + (f":{self.mbit:g}" if self.mbit is not None else "")


def parse_wan(text: str | None, n_shards: int, *, option: str = "--wan",
              each: str = "shard") -> list[WanLink]:
    """``--wan``: ``RTT_MS[:MBIT]`` for every shard, or one entry per shard, comma-separated
    (``100,0``: shard 0 behind 100 ms, shard 1 co-located). Empty or None: no WAN.
    ``option`` / ``each``: how errors name the option and what it has one entry per
    (`parse_peer_wan` reuses it for the peer links)."""
    if text is None or not str(text).strip():
        return [WanLink()] * n_shards
    parts = [s.strip() for s in str(text).split(",")]
    if len(parts) not in (1, n_shards):
        raise InputError(f"{option} {text!r}: give one RTT_MS[:MBIT] for every {each} or one "
                         f"per {each} ({n_shards} {each}s), comma-separated")
    links = []
    for part in parts:
        rtt, _, mbit = part.partition(":")
        try:
            values = float(rtt), float(mbit) if mbit else None
        except ValueError:
            raise InputError(f"{option} {text!r}: {part!r} is not RTT_MS[:MBIT] "
                             "(numbers, e.g. 100 or 100:50)") from None
        try:
            links.append(WanLink(*values))
        except InputError as e:
            raise InputError(f"{option} {text!r}: {e}") from None
    return links * n_shards if len(links) == 1 else links


def default_peer_links(wan: Sequence[WanLink]) -> list[WanLink]:
    """The ring's peer links when ``--peer-wan`` is not given: link i (shard i -> i + 1)
    gets the longer RTT and the lower cap of the two shards' client links. Only the client's
    distances are known, and the pair is at least as far apart as their difference: a tail
    next to the client (``--wan 100,0``) is as far from the shard before it as that shard is
    from the client, so the receiver's link alone (0 there) would halve a step's time."""
    def pair(a: WanLink, b: WanLink) -> WanLink:
        caps = [m for m in (a.mbit, b.mbit) if m is not None]
        return WanLink(max(a.rtt_ms, b.rtt_ms), min(caps) if caps else None)

    return [pair(a, b) for a, b in zip(wan, wan[1:], strict=False)]


def parse_peer_wan(text: str, n_shards: int, *, option: str = "--peer-wan") -> list[WanLink]:
    """``--peer-wan``: the emulated WAN of the ring's shard-to-shard links (patches/0007),
    ``RTT_MS[:MBIT]`` for every peer link or one per link in plan order (link i: shard i
    -> shard i + 1, ``n_shards - 1`` of them). Without it a peer link gets the longer of
    its two shards' ``--wan`` links (`default_peer_links`): the deployments the ring is for
    have shards near each other and the client far away (client links 100 ms, peer links 10)."""
    if n_shards < 2:
        raise InputError(f"{option} needs at least 2 shards (a peer link joins two), the plan "
                         f"has {n_shards}")
    return parse_wan(text, n_shards - 1, option=option, each="peer link")
