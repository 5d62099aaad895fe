"""A counting TCP relay: the real bytes on a shard connection, per labelled step.

One `CountingRelay` sits in front of one shard (loopback only): the client connects to
``relay.endpoint`` instead of the shard, and every byte forwarded either way is counted
under the label that is current when it passes (``with relay.step("decode"): ...``).
Bytes outside any step count under ``"other"``. `RelaySet` labels several relays at once.

When either side closes, the relay closes the other side at once, so a lost shard is seen
by the client immediately (and a lost client frees the shard for the next one).
"""

from __future__ import annotations

import contextlib
import select
import socket
import struct
import threading
import time
from collections import defaultdict, deque
from collections.abc import Iterator, Sequence

from mtplib.runtime.rpc import parse_endpoint

CHUNK = 1 << 20

# upstream's RPC framing (ggml/src/ggml-rpc/ggml-rpc.cpp at the pin): a request is
# | cmd (1 byte) | size (8) | payload |, a response | size (8) | payload |; only some
# commands are answered. Knowing this, the relay sorts the bytes it forwards into
#   data:    tensor contents (SET_TENSOR payload data, GET_TENSOR replies)
#   graph:   graph descriptions (GRAPH_COMPUTE / GRAPH_RECOMPUTE)
#   control: everything else (headers, tensor descriptors, buffers, handshake)
RPC_SET_TENSOR, RPC_GET_TENSOR = 6, 8
RPC_GRAPH = {10, 16}
RPC_ANSWERED = {0, 1, 2, 3, 7, 8, 9, 11, 13, 14, 15}
RPC_TENSOR_SIZE = 296  # sizeof(rpc_tensor), packed
RPC_TENSOR_NAME = slice(228, 292)  # rpc_tensor.name
CATEGORIES = ("data", "graph", "control", "unparsed")


class _RpcParser:
    """Sorts one direction of an RPC byte stream into CATEGORIES (see above)."""

    def __init__(self, up: bool, expect: deque) -> None:
        self.up, self.expect = up, expect
        self.desc = b""
        self.name = ""
        self.hdr_len = 9 if up else 8
        self.hdr = b""
        self.cmd = -1
        self.left = 0  # payload bytes still to come
        self.desc_left = 0  # of those, leading descriptor bytes (control)
        self.broken = False

    def feed(self, data: bytes, out: dict, names: dict) -> None:
        """Add this chunk's bytes to ``out`` by category and its tensor data to
        ``names[tensor name]``."""
        i, n = 0, len(data)
        if self.broken:
            out["unparsed"] += n
            return
        while i < n:
            if self.left == 0:
                take = min(self.hdr_len - len(self.hdr), n - i)
                self.hdr += data[i:i + take]
                i += take
                out["control"] += take
                if len(self.hdr) < self.hdr_len:
                    continue
                if self.up:
                    self.cmd = self.hdr[0]
                    (self.left,) = struct.unpack("<Q", self.hdr[1:9])
                    self.desc, self.name = b"", ""
                    self.desc_left = (RPC_TENSOR_SIZE + 9 if self.cmd == RPC_SET_TENSOR
                                      else RPC_TENSOR_SIZE if self.cmd == RPC_GET_TENSOR else 0)
                    if self.cmd in RPC_ANSWERED and self.cmd != RPC_GET_TENSOR:
                        self.expect.append((self.cmd, ""))
                    if self.cmd == RPC_GET_TENSOR and self.left < RPC_TENSOR_SIZE:
                        self.expect.append((self.cmd, "?"))
                else:
                    (self.left,) = struct.unpack("<Q", self.hdr)
                    try:
                        self.cmd, self.name = self.expect.popleft()
                    except IndexError:  # a reply nobody asked for: stop sorting
                        self.broken = True
                        out["unparsed"] += n - i
                        return
                self.hdr = b""
                continue
            take = min(self.left, n - i)
            if self.cmd in RPC_GRAPH:
                out["graph"] += take
            elif self.up and self.cmd in (RPC_SET_TENSOR, RPC_GET_TENSOR):
                d = min(self.desc_left, take)
                if len(self.desc) < RPC_TENSOR_SIZE:
                    self.desc += data[i:i + min(d, RPC_TENSOR_SIZE - len(self.desc))]
                    if len(self.desc) == RPC_TENSOR_SIZE:
                        raw = self.desc[RPC_TENSOR_NAME]
                        self.name = raw.split(b"\0", 1)[0].decode("utf-8", "replace")
                        if self.cmd == RPC_GET_TENSOR:
                            self.expect.append((self.cmd, self.name))
                if self.cmd == RPC_GET_TENSOR:  # the request is all descriptor
                    d = take
                self.desc_left -= min(d, self.desc_left)
                out["control"] += d
                if take > d:
                    out["data"] += take - d
                    names[self.name] = names.get(self.name, 0) + take - d
            elif self.cmd == RPC_GET_TENSOR and not self.up:
                out["data"] += take
                names[self.name] = names.get(self.name, 0) + take
            else:
                out["control"] += take
            self.left -= take
            i += take


class _Conn:
    def __init__(self, client: socket.socket, upstream: socket.socket) -> None:
        self.client, self.upstream = client, upstream
        self.busy = [False, False]
        expect: deque = deque()
        self.parsers = (_RpcParser(True, expect), _RpcParser(False, expect))
        self.closed = threading.Event()
        self.closed_by: str | None = None
        self.lock = threading.Lock()

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
                 allow_remote: bool = False) -> None:
        self.upstream = upstream
        self._up_addr = parse_endpoint(upstream, allow_remote=allow_remote)
        self.name = name or upstream
        self.label = "other"
        self.counts: dict[str, dict[str, int]] = defaultdict(
            lambda: {"up": 0, "down": 0, **dict.fromkeys(CATEGORIES, 0)})
        self.tensors: dict[str, dict[str, int]] = defaultdict(dict)  # label -> name -> data
        self.events: list[dict] = []  # connection opened / closed (by whom), with times
        self._lock = threading.Lock()
        self._conns: list[_Conn] = []
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

    def reset(self) -> None:
        """Zero the counters (between measured runs on the same connections)."""
        with self._lock:
            self.counts.clear()
            self.tensors.clear()

    def quiesce(self, timeout_s: float = 0.5) -> bool:
        """Wait until nothing is in flight (no socket readable, no pump mid-forward) on two
        checks in a row; True if reached within ``timeout_s``."""
        end = time.monotonic() + timeout_s
        calm = 0
        while time.monotonic() < end:
            with self._lock:
                conns = [c for c in self._conns if not c.closed.is_set()]
            socks = [s for c in conns for s in (c.client, c.upstream)]
            busy = any(any(c.busy) for c in conns)
            try:
                readable = select.select(socks, [], [], 0)[0] if socks else []
            except (OSError, ValueError):  # a socket closed under us: that is calm too
                readable = []
            calm = calm + 1 if not busy and not readable else 0
            if calm >= 2:
                return True
            time.sleep(0.001)
        return False

    # -- plumbing -----------------------------------------------------------------------
    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                client, _ = self._srv.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            client.settimeout(None)
            try:
                up = socket.create_connection(self._up_addr, timeout=5)
                up.settimeout(None)
            except OSError as e:
                self._event("upstream_unreachable", error=str(e))
                with contextlib.suppress(OSError):
                    client.close()
                continue
            for s in (client, up):
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn = _Conn(client, up)
            with self._lock:
                self._conns.append(conn)
            self._event("open")
            for i, (src, dst, key) in enumerate(((client, up, "up"), (up, client, "down"))):
                t = threading.Thread(target=self._pump, args=(conn, i, src, dst, key),
                                     daemon=True, name=f"relay-{self.endpoint}-{key}")
                t.start()
                self._threads.append(t)

    def _pump(self, conn: _Conn, i: int, src: socket.socket, dst: socket.socket,
              key: str) -> None:
        side = "client" if key == "up" else "shard"
        try:
            while True:
                data = src.recv(CHUNK)
                if not data:
                    break
                conn.busy[i] = True
                with self._lock:
                    c = self.counts[self.label]
                    c[key] += len(data)
                    conn.parsers[i].feed(data, c, self.tensors[self.label])
                dst.sendall(data)
                conn.busy[i] = False
        except OSError:
            pass
        conn.busy[i] = False
        if not conn.closed.is_set():
            self._event("closed", by=side)  # before closing: whoever sees EOF sees this
            conn.close(by=side)

    def _event(self, what: str, **kw) -> None:
        with self._lock:
            self.events.append({"t": time.time(), "event": what, **kw})

    def lost_by_shard(self) -> bool:
        """True if a connection was closed from the shard's side (the shard died)."""
        with self._lock:
            return any(e["event"] == "closed" and e.get("by") == "shard" for e in self.events)

    def close(self) -> None:
        self._stop.set()
        with contextlib.suppress(OSError):
            self._srv.shutdown(socket.SHUT_RDWR)  # wakes a blocked accept() on Linux
        with contextlib.suppress(OSError):
            self._srv.close()
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


class RelaySet:
    """Several relays labelled together (one per shard of a plan)."""

    def __init__(self, relays: Sequence[CountingRelay]) -> None:
        self.relays = list(relays)
        self._stack: list[str] = []

    @contextlib.contextmanager
    def step(self, label: str) -> Iterator[None]:
        """Count the bytes of the block under ``label`` (nested steps: innermost wins)."""
        self._quiesce()
        prev = [r.label for r in self.relays]
        for r in self.relays:
            r.label = label
        try:
            yield
        finally:
            self._quiesce()
            for r, p in zip(self.relays, prev, strict=True):
                r.label = p

    def _quiesce(self) -> None:
        for r in self.relays:
            r.quiesce()

    def by_label(self) -> dict[str, dict]:
        """label -> {"up", "down", "total", data/graph/control/unparsed,
        "per_shard": [total per relay]}."""
        out: dict[str, dict] = {}
        for i, r in enumerate(self.relays):
            for label, c in r.snapshot().items():
                o = out.setdefault(label, {"up": 0, "down": 0, "total": 0,
                                           **dict.fromkeys(CATEGORIES, 0),
                                           "per_shard": [0] * len(self.relays)})
                for k in ("up", "down", *CATEGORIES):
                    o[k] += c[k]
                o["total"] += c["up"] + c["down"]
                o["per_shard"][i] += c["up"] + c["down"]
        return out

    def total(self, label: str | None = None) -> int:
        return sum(r.total(label) for r in self.relays)

    def by_tensor(self, label: str) -> list[dict[str, int]]:
        """Per relay: tensor name -> data bytes moved under ``label``."""
        out = []
        for r in self.relays:
            with r._lock:
                out.append(dict(r.tensors.get(label, {})))
        return out

    def close(self) -> None:
        for r in self.relays:
            r.close()
