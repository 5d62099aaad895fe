"""The ranged client worker: its own process, where upstream's RPC client lives.

It loads the trunk across the shards (and the sidecar on the tail), creates contexts and
answers requests from `RangedRuntime` over a pipe. Functions run here through
``RangedRuntime.call`` label their steps with `worker_step`, so the relays in front of the
shards attribute every byte to a step kind.

Liveness: while a request runs, a heartbeat thread sends ``("alive", progress, busy_s)``
about once a second. ``progress`` counts finished work (requests, steps, decodes), not
time: a shard that stops answering leaves upstream's call blocked while this thread still
beats, so the parent fails a call when progress (and the shard bytes) stand still, not when
beats stop. Every send goes through one lock, so a beat never interleaves with a reply.
"""

from __future__ import annotations

import contextlib
import os
import socket
import struct
import sys
import threading
import time
from collections.abc import Iterator
from multiprocessing.connection import Connection

from mtplib.distributed.processes import die_with_parent
from mtplib.errors import InputError
from mtplib.runtime.lib import UpstreamError
from mtplib.runtime.timing import synchronize

# -- the worker (client side, in its own process) ---------------------------------------
_worker_conn: Connection | None = None
_send_lock = threading.Lock()
#: finished units of work (requests, step boundaries, decodes); sent with every heartbeat
_progress = 0
#: monotonic start of the request being handled, None between requests
_busy_since: float | None = None
HEARTBEAT_S = 1.0


def _send(conn: Connection, msg: tuple) -> None:
    with _send_lock:
        conn.send(msg)


#: (the fd names of this process when looked at, their loopback TCP connections)
_loopback: tuple[tuple[str, ...], list[int]] = ((), [])


def _loopback_sockets() -> list[int]:
    """File descriptors of this process's TCP connections to loopback peers: upstream's RPC
    client talks to the relays (and local shards) through them. Looked up again only when
    the process's descriptors change (connections open at load); [] without /proc."""
    global _loopback
    try:
        names = tuple(os.listdir("/proc/self/fd"))
    except OSError:
        return []
    if names == _loopback[0]:
        return _loopback[1]
    fds = []
    for name in names:
        try:
            fd = int(name)
            if not os.readlink(f"/proc/self/fd/{name}").startswith("socket:"):
                continue
            s = socket.socket(fileno=os.dup(fd))
        except (OSError, ValueError):
            continue
        try:
            if s.family in (socket.AF_INET, socket.AF_INET6) and s.type == socket.SOCK_STREAM:
                host = s.getpeername()[0]
                if host.startswith("127.") or host == "::1":
                    fds.append(fd)
        except OSError:  # not connected (e.g. listening)
            pass
        finally:
            s.close()
    _loopback = (names, fds)
    return fds


def flush_shard_sockets(timeout_s: float = 0.05) -> None:
    """Return once the loopback peers (the relays) have received every byte this process
    sent them (no unacknowledged bytes: Linux SIOCOUTQ), so a step boundary reported next
    finds the step's bytes in the relays' sockets; at most ``timeout_s``."""
    import fcntl
    import termios

    end = None
    for fd in _loopback_sockets():
        while True:
            try:
                unacked = struct.unpack("i", fcntl.ioctl(fd, termios.TIOCOUTQ, b"\0" * 4))[0]
            except OSError:
                break
            if unacked <= 0:
                break
            end = end or time.monotonic() + timeout_s
            if time.monotonic() >= end:
                return
            time.sleep(0.0001)


def _advance() -> None:
    global _progress
    _progress += 1


def _heartbeat(conn: Connection, period_s: float = HEARTBEAT_S) -> None:
    """Beat while a request runs (never between requests, so no stale beat is read as a
    reply); ends with the connection."""
    while True:
        time.sleep(period_s)
        with _send_lock:
            since = _busy_since
            if since is None:
                continue
            try:
                conn.send(("alive", _progress, time.monotonic() - since))
            except (OSError, ValueError):
                return


@contextlib.contextmanager
def worker_step(label: str, n_tokens: int | None = None) -> Iterator[None]:
    """Inside a function run by `RangedRuntime.call`: count the block's shard bytes under
    ``label`` (the parent switches the relays' label, synchronously). A no-op elsewhere."""
    conn = _worker_conn
    if conn is None:
        yield
        return
    _advance()
    flush_shard_sockets()
    _send(conn, ("step_begin", label))
    conn.recv()
    try:
        yield
    finally:
        _advance()
        flush_shard_sockets()
        _send(conn, ("step_end", label, n_tokens))
        conn.recv()


class Models:
    def __init__(self) -> None:
        self.trunk = self.sidecar = None
        self.contexts: dict = {}
        self._next = 1


def model_info(m, placement: dict, buffers: list) -> dict:
    """What the client learns of a model the worker loaded (sizes, placement, buffers)."""
    from mtplib.runtime.rpc import endpoint_of_buffer

    return {"n_vocab": m.n_vocab, "n_embd": m.n_embd,
            # a DSpark draft (`DSparkModel`) has no hc rows and no trunk layers
            "n_embd_out": getattr(m, "n_embd_out", m.n_embd),
            "n_layer": getattr(m, "n_layer", 0), "kind": getattr(m, "kind", "mtp"),
            "size_bytes": m.size_bytes, "placement": placement,
            "buffers": [dict(b, endpoint=endpoint_of_buffer(b["buffer"])) for b in buffers]}


def _handle(models: Models, msg: tuple):
    from mtplib.runtime.model import Context, ContextConfig
    from mtplib.runtime.rpc import (
        buffer_lines,
        cache_placement,
        endpoint_of_buffer,
        log_capture,
        open_ranged,
    )


    op = msg[0]
    if op == "open":
        kw = msg[1]
        req = kw["request"]  # the run's RunRequest, pickled: plan parsed, headers read
        t, s = open_ranged(req.trunk, req.plan, kw["endpoints"], sidecar=req.sidecar,
                           allow_remote=kw["allow_remote"], mtp_placement=kw["mtp_placement"],
                           header=req.trunk_header, sidecar_header=req.sidecar_header)
        models.trunk, models.sidecar = t, s
        side = None if s is None else model_info(s, s.placement, s.load_buffers)
        return {"trunk": model_info(t, t.placement, t.load_buffers), "sidecar": side}
    if op == "context":
        cfg = ContextConfig(**msg[1])
        model = models.sidecar if cfg.mtp else models.trunk
        with log_capture() as lines:
            ctx = Context(model, cfg)
        h = models._next
        models._next += 1
        models.contexts[h] = ctx
        names = getattr(models.trunk, "device_endpoints", {})
        info = {k: getattr(ctx, k) for k in ("n_ctx", "n_batch", "n_ubatch", "n_seq_max",
                                             "n_rs_seq", "n_vocab", "width")}
        info.update(mtp=cfg.mtp, cfg=msg[1], caches=cache_placement(lines, names),
                    buffers=[dict(b, endpoint=endpoint_of_buffer(b["buffer"]))
                             for b in buffer_lines(lines)])
        return h, info
    if op == "ctx":
        _, h, method, args, kwargs = msg
        ctx = models.contexts[h]
        out = getattr(ctx, method)(*args, **kwargs)
        if method == "decode":
            # upstream's decode returns with the shards still computing (the logits are
            # fetched at the next read): wait here, so a step's bytes are all in the step
            synchronize(ctx)
            _advance()
            return ctx.last_n_outputs, ctx.last_decode_len
        return out
    if op == "free":
        models.contexts.pop(msg[1]).close()
        return None
    if op == "call":
        _, fn, args, kwargs = msg
        return fn(models, *args, **kwargs)
    raise InputError(f"unknown request {op!r}")


def main() -> None:
    """Entry point of the client worker: ``python -c ... FD PARENT_PID``."""
    global _worker_conn, _busy_since
    fd, parent = int(sys.argv[1]), int(sys.argv[2])
    die_with_parent(parent)
    conn = _worker_conn = Connection(fd)
    threading.Thread(target=_heartbeat, args=(conn,), daemon=True, name="heartbeat").start()
    models = Models()
    import pickle

    while True:
        try:
            raw = conn.recv_bytes()
        except (EOFError, OSError):
            break
        try:
            msg = pickle.loads(raw)
        except Exception as e:  # noqa: BLE001 - e.g. a function this process cannot import
            _send(conn, ("err", UpstreamError(f"the client worker cannot unpickle the request: "
                                            f"{type(e).__name__}: {e}")))
            continue
        if msg[0] == "close":
            for c in models.contexts.values():
                c.close()
            for m in (models.sidecar, models.trunk):
                if m is not None:
                    m.close()
            with contextlib.suppress(OSError):
                _send(conn, ("ok", None))
            break
        _busy_since = time.monotonic()
        try:
            reply = ("ok", _handle(models, msg))
        except Exception as e:  # noqa: BLE001 - every error goes back to the caller
            try:
                pickle.dumps(e)
                reply = ("err", e)
            except Exception:  # noqa: BLE001
                reply = ("err", UpstreamError(f"{type(e).__name__}: {e}"))
        flush_shard_sockets()  # the parent may close a step when it reads the reply
        with _send_lock:  # no beat after the reply: the parent reads it as the answer
            _busy_since = None
            _advance()
            conn.send(reply)
    os._exit(0)


# -- text, for `generate --prompt` on ranged models -------------------------------------
def seam_report(models: Models) -> list[dict[str, str]]:
    """Each shard pair's seam as upstream's client logged it here (patches/0007)."""
    from mtplib.runtime.lib import SEAM_LINES
    from mtplib.runtime.rpc import seam_links

    return seam_links(SEAM_LINES)


def tokenize(models: Models, text: str) -> list[int]:
    return models.trunk.tokenize(text)


def detokenize(models: Models, tokens: list[int]) -> str:
    return models.trunk.detokenize(tokens)
