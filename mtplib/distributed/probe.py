"""Probing the shards of a plan before upstream's client connects to any of them.

`probe_shards` does upstream's handshake in Python with every shard (through its gateway
with ``tls=``) and checks every answer (`mtplib.runtime.rpc.handshake`), so a hostile or
broken shard is a clear ShardError within seconds instead of an abort, a hang or a client
that builds 67 million devices. It also finds one shard given twice:

- the same address and port (after normalizing, e.g. ``127.0.0.1:05000``): refused at once;
- one shard under two addresses (or behind two relays): each probe connection stays open
  while the later shards are probed, and a shard serves one client at a time, so the second
  probe of the same shard is not answered: a TLS gateway says ``busy`` with the instance id
  the first probe already saw (named at once), a plain RPC server stays silent (named
  after ``timeout_s``).

Each answer comes back with the shard's report of its build (`ProbedShard`: from a TLS
gateway's ready line, or a plaintext shard's report file on this host), which a ranged run
builds its adverts from (`mtplib.distributed.shard_report`). A missing or unreadable
report is not a probe failure: it refuses MTP later, by name.
"""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Sequence

from mtplib.distributed.shard_report import ProbedShard, with_report
from mtplib.distributed.tls import GATEWAY_PEER, TlsConfig, connect_ready_status
from mtplib.ownership.plan import PlanError
from mtplib.runtime.rpc import ShardError, handshake, parse_endpoint


def check_distinct(endpoints: Sequence[str], *, allow_remote: bool = False) -> None:
    """PlanError when two endpoints are the same address and port."""
    seen: dict[tuple[str, int], str] = {}
    for ep in endpoints:
        key = parse_endpoint(ep, allow_remote=allow_remote)
        if key in seen:
            raise PlanError(f"endpoints {seen[key]} and {ep} are the same shard "
                            f"({key[0]}:{key[1]}); every plan range needs its own shard")
        seen[key] = ep


def probe_shards(endpoints: Sequence[str], *, tls: TlsConfig | None = None,
                 timeout_s: float = 5.0, allow_remote: bool = False) -> list[ProbedShard]:
    """Handshake with every shard, holding each connection until all are done (see the
    module doc); returns what each answered. PlanError for a shard given twice,
    ShardError for one that is unreachable, busy, hung, or answers out of bounds."""
    allow = allow_remote or tls is not None
    check_distinct(endpoints, allow_remote=allow)
    ctx = tls.client_context() if tls is not None else None
    held: list = []
    instances: dict[str, str] = {}
    out = []
    try:
        for ep in endpoints:
            addr = parse_endpoint(ep, allow_remote=allow)
            token: str | None = None  # plaintext: the report file on this host
            peer_links = False
            if tls is None:
                try:
                    s = socket.create_connection(addr, timeout=timeout_s)
                except OSError as e:
                    raise ShardError(f"shard {ep} unreachable: {e.strerror or e}") from None
                held.append(s)
            else:
                def same(instance: str, ep: str = ep) -> None:
                    if instance in instances:
                        raise PlanError(f"endpoints {instances[instance]} and {ep} are the "
                                        f"same shard (gateway instance {instance}); every "
                                        "plan range needs its own shard")

                s, status = connect_ready_status(addr, tls, timeout_s=timeout_s, ctx=ctx,
                                                 on_busy=same)
                held.append(s)
                instances[status.instance], token = ep, status.report
                peer_links = GATEWAY_PEER in status.features
            try:
                out.append(with_report(handshake(s, ep, timeout_s=timeout_s), ep, token=token,
                                       peer_links=peer_links))
            except TimeoutError:
                others = list(endpoints[:len(out)])
                same = (f"; it may be {', '.join(others)} under another address (their "
                        "probe connections are open)" if others else "")
                raise ShardError(f"shard {ep} did not answer the handshake within "
                                 f"{timeout_s} s (busy with another client, or hung{same})"
                                 ) from None
            except OSError as e:
                raise ShardError(f"shard {ep}: connection lost during the handshake "
                                 f"({e.strerror or e})") from None
    finally:
        for s in held:
            with contextlib.suppress(OSError):
                s.close()
    return out
