"""Each shard connection's emulated WAN (`WanLink`, ``--wan``: `parse_wan`) and its one
bound (`MAX_RTT_MS`). Pure values: a run's request (`mtplib.runtime.request.RunRequest`)
holds them, the relays in `mtplib.distributed.relay` apply them.
"""

from __future__ import annotations

import math
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


def parse_wan(text: str | None, n_shards: int) -> list[WanLink]:
    """``--wan``: ``RTT_MS[:MBIT]`` for every shard, or one entry per shard, comma-separated
    (``100,0``: shard 0 behind 100 ms, shard 1 co-located). Empty or None: no WAN."""
    if text is None or not str(text).strip():
        return [WanLink()] * n_shards
    parts = [s.strip() for s in str(text).split(",")]
    if len(parts) not in (1, n_shards):
        raise InputError(f"--wan {text!r}: give one RTT_MS[:MBIT] for every shard or one per "
                         f"shard ({n_shards} shards), comma-separated")
    links = []
    for part in parts:
        rtt, _, mbit = part.partition(":")
        try:
            values = float(rtt), float(mbit) if mbit else None
        except ValueError:
            raise InputError(f"--wan {text!r}: {part!r} is not RTT_MS[:MBIT] "
                             "(numbers, e.g. 100 or 100:50)") from None
        links.append(WanLink(*values))
    return links * n_shards if len(links) == 1 else links
