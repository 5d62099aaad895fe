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

Before its handshake every shard is asked for its report of its build on a connection of
its own to the same endpoint (`mtplib.distributed.report_wire.ask_report`: in band, so a
forward or a tunnel in between changes nothing), closed before the handshake's opens (a
stock server serves one connection at a time). The report comes back with the handshake's
answer (`ProbedShard`), and a ranged run builds its adverts from it
(`mtplib.distributed.shard_report`). A missing or unreadable report is not a probe
failure: it refuses MTP later, by name; a shard that answers the report request not at
all within ``timeout_s`` fails as a silent handshake does.
"""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Sequence

from mtplib.distributed.report_wire import ask_report, report_context
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
    report_ctx = report_context(tls) if tls is not None else None
    held: list = []
    instances: dict[str, str] = {}
    out = []
    try:
        for ep in endpoints:
            addr = parse_endpoint(ep, allow_remote=allow)
            what = "the mtplib report request"
            try:
                report, problem = ask_report(addr, ep, timeout_s=timeout_s, tls=tls,
                                             ctx=report_ctx)
                what = "the handshake"
                s, peer_links = _connect(addr, ep, tls, ctx, timeout_s, instances)
                held.append(s)
                out.append(with_report(handshake(s, ep, timeout_s=timeout_s), ep,
                                       report=report, problem=problem, peer_links=peer_links))
            except TimeoutError:
                others = list(endpoints[:len(out)])
                same = (f"; it may be {', '.join(others)} under another address (their "
                        "probe connections are open)" if others else "")
                raise ShardError(f"shard {ep} did not answer {what} within {timeout_s} s "
                                 f"(busy with another client, or hung{same})") from None
            except OSError as e:
                raise ShardError(f"shard {ep}: connection lost during {what} "
                                 f"({e.strerror or e})") from None
    finally:
        for s in held:
            with contextlib.suppress(OSError):
                s.close()
    return out


def _connect(addr: tuple[str, int], ep: str, tls: TlsConfig | None, ctx,
             timeout_s: float, instances: dict[str, str]) -> tuple:
    """The probe's connection for the handshake (plain, or through the gateway once it
    says ready: PlanError for a gateway instance already probed under another endpoint)
    and whether the gateway carries peer links."""
    if tls is None:
        try:
            return socket.create_connection(addr, timeout=timeout_s), False
        except OSError as e:
            raise ShardError(f"shard {ep} unreachable: {e.strerror or e}") from None

    def same(instance: str) -> None:
        if instance in instances:
            raise PlanError(f"endpoints {instances[instance]} and {ep} are the same shard "
                            f"(gateway instance {instance}); every plan range needs its own "
                            "shard")

    s, status = connect_ready_status(addr, tls, timeout_s=timeout_s, ctx=ctx, on_busy=same)
    instances[status.instance] = ep
    return s, GATEWAY_PEER in status.features
