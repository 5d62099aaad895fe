"""Upstream's RPC backend (libggml-rpc) and ranged execution: layer-range shards.

This is the only module that touches libggml-rpc. A *shard* is an upstream RPC server
process serving one CPU device (`serve`); a *client* adds shards as devices
(`add_server`) and loads a trunk across them with split_mode LAYER and a tensor_split
that gives every shard exactly its layer range (`ShardPlan`, `open_ranged`).

Upstream facts this relies on (pinned source, ggml/src/ggml-rpc/ggml-rpc.cpp and
src/llama-model.cpp):

- The client aborts the whole process (GGML_ABORT, "Remote RPC server crashed or returned
  malformed response") when a shard connection fails: at connect, at the handshake and
  on any later command. `probe` does the handshake in Python first, so an unreachable
  shard is an exception, not an abort; a shard lost *later* still aborts the client
  process, which is why `mtplib.distributed.client.RangedRuntime` runs the client in a subprocess.
- A server serves one client connection at a time (accept loop); everything a client
  allocated on it is freed when that connection closes.
- Layer il of n_layer_all (the output layer is il = n_layer_all) goes to device
  upper_bound(cumsum(split)/sum(split), il / (n_layer_all + 1)); the input layer
  (token_embd) always stays on the client's CPU. Integer weights make the boundaries exact.
- RPC has no authentication: shards bind loopback; beyond it they serve through
  mtplib.distributed.gateway (mutual TLS) unless --insecure-plaintext is given.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import importlib.util
import ipaddress
import re
import socket
import struct
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from mtplib import envs
from mtplib.contract.labels import Placement
from mtplib.ownership.plan import PlanError, ShardPlan, check_endpoints
from mtplib.runtime import PATCHED_DIR, selected_upstream
from mtplib.runtime.lib import LOG_TAIL, UpstreamError, load
from mtplib.runtime.model import RuntimeInputError, check_threads

#: upstream's RPC client serves at most this many servers (ggml-rpc.cpp)
MAX_RPC_SERVERS = 16

RPC_PROTO_MAJOR = 7
#: the protocol minor of the stock pin; patches/0006 (graph slots) makes it 7.1, patches/0007
#: (the shard-to-shard seam) 7.2
RPC_PROTO_MINOR = 0
RPC_CMD_HELLO = 14
RPC_CONN_CAPS_SIZE = 24
GGML_BACKEND_DEVICE_TYPE_CPU = 0
GGML_BACKEND_DEVICE_TYPE_GPU = 1

# -- upstream's wire format (ggml/src/ggml-rpc/ggml-rpc.cpp at the pin) -----------------
# request: | cmd (1 byte) | size (8 bytes LE) | payload |; a reply: | size (8) | payload |
RPC_TENSOR_SIZE = 296  # sizeof(rpc_tensor), packed
GGML_MAX_SRC = 10
(RPC_ALLOC_BUFFER, RPC_GET_ALIGNMENT, RPC_GET_MAX_SIZE, RPC_BUFFER_GET_BASE, RPC_FREE_BUFFER,
 RPC_BUFFER_CLEAR, RPC_SET_TENSOR, RPC_SET_TENSOR_HASH, RPC_GET_TENSOR, RPC_COPY_TENSOR,
 RPC_GRAPH_COMPUTE, RPC_GET_DEVICE_MEMORY, RPC_INIT_TENSOR, RPC_GET_ALLOC_SIZE, _HELLO,
 RPC_DEVICE_COUNT, RPC_GRAPH_RECOMPUTE, RPC_MEMSET_TENSOR,
 RPC_GRAPH_COMPUTE_SLOT, RPC_GRAPH_RECOMPUTE_SLOT,
 RPC_PEER_EXPECT, RPC_PEER_CONNECT, RPC_PUSH_TENSOR, RPC_WAIT_TENSOR,
 RPC_PEER_HELLO, RPC_PEER_PUSH) = range(26)
#: each command's name (upstream's ``RPC_CMD_<name>``), for counts that say which commands
#: a client waited on
RPC_COMMAND_NAMES: dict[int, str] = dict(enumerate((
    "ALLOC_BUFFER", "GET_ALIGNMENT", "GET_MAX_SIZE", "BUFFER_GET_BASE", "FREE_BUFFER",
    "BUFFER_CLEAR", "SET_TENSOR", "SET_TENSOR_HASH", "GET_TENSOR", "COPY_TENSOR",
    "GRAPH_COMPUTE", "GET_DEVICE_MEMORY", "INIT_TENSOR", "GET_ALLOC_SIZE", "HELLO",
    "DEVICE_COUNT", "GRAPH_RECOMPUTE", "MEMSET_TENSOR", "GRAPH_COMPUTE_SLOT",
    "GRAPH_RECOMPUTE_SLOT", "PEER_EXPECT", "PEER_CONNECT", "PUSH_TENSOR", "WAIT_TENSOR",
    "PEER_HELLO", "PEER_PUSH")))
#: commands a client may send (RPC_CMD_NONE = 26 never goes on the wire); the two graph-slot
#: commands exist from protocol 7.1 (patches/0006): a client sends them only to a 7.1 server;
#: the four seam commands (PEER_EXPECT .. WAIT_TENSOR) from 7.2 (patches/0007)
RPC_N_COMMANDS = 24
#: protocol 7.2: what a shard sends another on a peer link (never a client): PEER_HELLO first
#: (answered), then PEER_PUSHes (| seq (8) | rpc_tensor dst | data |, unanswered)
RPC_PEER_COMMANDS = (RPC_PEER_HELLO, RPC_PEER_PUSH)
#: PEER_PUSH's payload before the data
PEER_PUSH_HEADER = 8 + 296
#: protocol 7.1: graphs a server keeps per device (GRAPH_COMPUTE_SLOT's slot is below it)
RPC_GRAPH_SLOTS = 8
#: request payload size of every fixed-size command (the rpc_msg_*_req structs)
REQUEST_SIZES = {
    RPC_ALLOC_BUFFER: 12, RPC_GET_ALIGNMENT: 4, RPC_GET_MAX_SIZE: 4, RPC_BUFFER_GET_BASE: 8,
    RPC_FREE_BUFFER: 8, RPC_BUFFER_CLEAR: 9, RPC_SET_TENSOR_HASH: RPC_TENSOR_SIZE + 16,
    RPC_GET_TENSOR: RPC_TENSOR_SIZE + 16, RPC_COPY_TENSOR: 2 * RPC_TENSOR_SIZE,
    RPC_GET_DEVICE_MEMORY: 4, RPC_INIT_TENSOR: RPC_TENSOR_SIZE,
    RPC_GET_ALLOC_SIZE: 4 + RPC_TENSOR_SIZE * (1 + GGML_MAX_SRC), RPC_CMD_HELLO: 24,
    RPC_DEVICE_COUNT: 0, RPC_GRAPH_RECOMPUTE: 4, RPC_MEMSET_TENSOR: RPC_TENSOR_SIZE + 17,
    RPC_GRAPH_RECOMPUTE_SLOT: 8,
    # protocol 7.2 (patches/0007): | link (4) | token (16) | [endpoint (128)] |, and
    # | link (4) | seq (8) | src | dst |, | link (4) | seq (8) | dst |
    RPC_PEER_EXPECT: 20, RPC_PEER_CONNECT: 148, RPC_PUSH_TENSOR: 12 + 2 * RPC_TENSOR_SIZE,
    RPC_WAIT_TENSOR: 12 + RPC_TENSOR_SIZE,
}
#: SET_TENSOR: | rpc_tensor | cache_flag (1) | offset (8) | data |
SET_TENSOR_HEADER = RPC_TENSOR_SIZE + 9
#: GRAPH_COMPUTE: | device (4) | n_nodes (4) | nodes | n_tensors (4) | tensors |
GRAPH_HEADER = 12
#: GRAPH_COMPUTE_SLOT: | slot (4) | the GRAPH_COMPUTE payload |
GRAPH_SLOT_HEADER = 4 + GRAPH_HEADER
#: reply payload size of every answered command except GET_TENSOR (the requested size)
REPLY_SIZES = {
    RPC_ALLOC_BUFFER: 16, RPC_GET_ALIGNMENT: 8, RPC_GET_MAX_SIZE: 8, RPC_BUFFER_GET_BASE: 8,
    RPC_SET_TENSOR_HASH: 1, RPC_COPY_TENSOR: 1, RPC_GET_DEVICE_MEMORY: 16,
    RPC_GET_ALLOC_SIZE: 8, RPC_CMD_HELLO: 4 + RPC_CONN_CAPS_SIZE, RPC_DEVICE_COUNT: 4,
    RPC_PEER_EXPECT: 1, RPC_PEER_CONNECT: 1, RPC_PEER_HELLO: 1,
}
#: what a sane shard answers: mtplib shards serve one device; alignments are powers of two
#: (ggml pads with them); a buffer can be at least 1 MiB; memory below 2**50 bytes (1 PiB)
MAX_ALIGNMENT = 1 << 16
MIN_MAX_SIZE = 1 << 20
MAX_MEMORY = 1 << 50


#: upstream's line for each server pair's seam, logged when the pair first copies
#: (patches/0007): "RPC seam A -> B: ring (link 1 to B)" or "... star (why)"
_SEAM_LINE = re.compile(r"RPC seam (\S+) -> (\S+): (ring|star) \((.*)\)")


def seam_links(lines: Iterable[str]) -> list[dict[str, str]]:
    """Each server pair's seam as upstream's client logged it, in the order first logged:
    ``{"from", "to", "seam", "why"}`` (``why``: the reason for a star, else "")."""
    out: dict[tuple[str, str], dict[str, str]] = {}
    for line in lines:
        m = _SEAM_LINE.search(line)
        if m:
            a, b, seam, why = m.groups()
            out[(a, b)] = {"from": a, "to": b, "seam": seam,
                           "why": why if seam == "star" else ""}
    return list(out.values())


class ShardError(UpstreamError):
    """A shard is unreachable, not an RPC server, or the wrong protocol version."""


@functools.cache
def client_proto_minor() -> int:
    """The RPC protocol minor of the upstream build this process loads, as its installed
    ggml-rpc.h declares it: 0 at the pin, 1 with patches/0006 (graph slots). Upstream's
    client aborts the process on a server of a newer minor, so the probe and the relays
    refuse one first; an older server is fine (the client then keeps one graph per device)."""
    if selected_upstream() == "patched":
        header = PATCHED_DIR / "include" / "ggml-rpc.h"
    else:
        spec = importlib.util.find_spec("llama_cpp")
        if spec is None or spec.origin is None:
            return RPC_PROTO_MINOR
        header = Path(spec.origin).parent.parent / "include" / "ggml-rpc.h"
    try:
        m = re.search(r"#define\s+RPC_PROTO_MINOR_VERSION\s+(\d+)", header.read_text())
    except OSError:
        return RPC_PROTO_MINOR
    return int(m.group(1)) if m else RPC_PROTO_MINOR


def check_reply(cmd: int, payload: bytes) -> str | None:
    """None if ``payload`` is a sane reply to ``cmd``, else why not. Upstream's client
    acts on these values unchecked (a device count of 67 million makes it build 67 million
    devices; alignment 0 or max size 0 break its buffer arithmetic), so the probe and the
    relays check every one before upstream reads it."""
    want = REPLY_SIZES.get(cmd)
    if want is not None and len(payload) != want:
        return f"reply of {len(payload)} bytes to command {cmd}, expected {want}"
    if cmd == RPC_CMD_HELLO:
        major, minor, patch = payload[0], payload[1], payload[2]
        ours = client_proto_minor()
        if major != RPC_PROTO_MAJOR or minor > ours:
            return (f"speaks RPC protocol {major}.{minor}.{patch}, this client "
                    f"{RPC_PROTO_MAJOR}.{ours}.x (a server may not be newer than its client: "
                    "run the same upstream build on both sides, e.g. both patched by "
                    "./dev.sh setup)")
        if any(payload[4:]):
            return "offers a transport upgrade (conn_caps) mtplib does not support"
    elif cmd == RPC_DEVICE_COUNT:
        (n,) = struct.unpack("<I", payload)
        if n != 1:
            return f"reports {n} devices; mtplib shards serve exactly one"
    elif cmd == RPC_GET_ALIGNMENT:
        (a,) = struct.unpack("<Q", payload)
        if a < 1 or a > MAX_ALIGNMENT or a & (a - 1):
            return f"reports buffer alignment {a} (want a power of two <= {MAX_ALIGNMENT})"
    elif cmd == RPC_GET_MAX_SIZE:
        (m,) = struct.unpack("<Q", payload)
        if m < MIN_MAX_SIZE:
            return f"reports a maximum buffer size of {m} bytes (want >= {MIN_MAX_SIZE})"
    elif cmd == RPC_GET_DEVICE_MEMORY:
        free, total = struct.unpack("<QQ", payload)
        if not 0 < total <= MAX_MEMORY or free > total:
            return f"reports device memory free {free} of total {total} bytes"
    elif cmd in (RPC_SET_TENSOR_HASH, RPC_COPY_TENSOR, RPC_PEER_EXPECT, RPC_PEER_CONNECT,
                 RPC_PEER_HELLO) and payload[0] > 1:
        return f"answers {payload[0]} to a yes/no command {cmd}"
    return None


@dataclass(frozen=True)
class ShardInfo:
    """What a shard answered in the handshake (checked by `check_reply`)."""

    version: tuple[int, int, int]
    n_devices: int
    alignment: int
    max_size: int
    memory_free: int
    memory_total: int
    #: the quickest of the handshake's five round trips (a measured RTT to the shard,
    #: without any WAN a relay emulates); None where not measured
    rtt_s: float | None = None


class PeerClosed(ConnectionError):
    """The peer closed the connection before `recv_exact` had all it asked for."""


def recv_exact(io, n: int, deadline: float | None = None) -> bytes:
    """Exactly ``n`` bytes from a socket-like ``io`` (PeerClosed, a ConnectionError, if it
    closes first); with ``deadline`` (time.monotonic()), TimeoutError once it has passed,
    the socket's timeout set to what is left before each read."""
    buf = b""
    while len(buf) < n:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError
            io.settimeout(left)
        chunk = io.recv(n - len(buf))
        if not chunk:
            raise PeerClosed(f"closed after {len(buf)} of {n} bytes")
        buf += chunk
    return buf


def _ask(io, cmd: int, payload: bytes, deadline: float, endpoint: str) -> bytes:
    io.sendall(bytes([cmd]) + struct.pack("<Q", len(payload)) + payload)
    try:
        (size,) = struct.unpack("<Q", recv_exact(io, 8, deadline))
        if size != REPLY_SIZES[cmd]:  # never read a size the shard chose
            raise ShardError(f"shard {endpoint}: reply of {size} bytes to command {cmd}, "
                             f"expected {REPLY_SIZES[cmd]}")
        out = recv_exact(io, size, deadline)
    except PeerClosed:
        raise ShardError(f"shard {endpoint} closed the connection during the "
                         "handshake (not an RPC server?)") from None
    bad = check_reply(cmd, out)
    if bad:
        raise ShardError(f"shard {endpoint} {bad}")
    return out


def handshake(io, endpoint: str, *, timeout_s: float = 2.0) -> ShardInfo:
    """Upstream's client handshake in Python, on any connected socket-like ``io``
    (``sendall``/``recv``/``settimeout``): HELLO, DEVICE_COUNT, then each device's alignment,
    maximum buffer size and memory, every answer checked, all within ``timeout_s``. A
    shard answering absurdly raises ShardError here, before upstream's client acts on it."""
    deadline = time.monotonic() + timeout_s
    times: list[float] = []

    def ask(cmd: int, payload: bytes) -> bytes:
        t0 = time.perf_counter()
        out = _ask(io, cmd, payload, deadline, endpoint)
        times.append(time.perf_counter() - t0)
        return out

    hello = ask(RPC_CMD_HELLO, bytes(RPC_CONN_CAPS_SIZE))
    (n,) = struct.unpack("<I", ask(RPC_DEVICE_COUNT, b""))
    dev = struct.pack("<I", 0)
    (align,) = struct.unpack("<Q", ask(RPC_GET_ALIGNMENT, dev))
    (max_size,) = struct.unpack("<Q", ask(RPC_GET_MAX_SIZE, dev))
    free, total = struct.unpack("<QQ", ask(RPC_GET_DEVICE_MEMORY, dev))
    return ShardInfo((hello[0], hello[1], hello[2]), n, align, max_size, free, total,
                     rtt_s=min(times))


# -- endpoints --------------------------------------------------------------------------
def parse_endpoint(endpoint: str, *, allow_remote: bool = False) -> tuple[str, int]:
    """Validate ``HOST:PORT`` (IPv4 literal, as upstream's server needs); loopback only
    unless ``allow_remote`` (mutual TLS, or the explicit --insecure-plaintext)."""
    if not isinstance(endpoint, str) or endpoint.count(":") != 1:
        raise ShardError(f"endpoint {endpoint!r}: expected HOST:PORT, e.g. 127.0.0.1:50052")
    host, port_s = endpoint.split(":")
    try:
        addr = ipaddress.IPv4Address(host)
    except ValueError:
        raise ShardError(f"endpoint {endpoint!r}: host must be an IPv4 address "
                         "(upstream's server binds inet_addr(host))") from None
    if not port_s.isdigit() or not 1 <= int(port_s) <= 65535:
        raise ShardError(f"endpoint {endpoint!r}: port must be 1..65535")
    if not addr.is_loopback and not allow_remote:
        raise ShardError(f"endpoint {endpoint!r} is not loopback; upstream's RPC has no "
                         "authentication or encryption: give --tls DIR (mutual TLS, see "
                         "`mtplib tls init`), or --insecure-plaintext to send it in the clear")
    return str(addr), int(port_s)


def probe_info(endpoint: str, *, timeout_s: float = 2.0, allow_remote: bool = False
               ) -> ShardInfo:
    """`handshake` with the plain RPC server at ``endpoint``. Raises ShardError instead of
    letting upstream's client abort the process. A server busy with another client accepts
    the TCP connection but does not answer: that is a timeout here ("busy or hung")."""
    host, port = parse_endpoint(endpoint, allow_remote=allow_remote)
    try:
        with socket.create_connection((host, port), timeout=timeout_s) as s:
            return handshake(s, endpoint, timeout_s=timeout_s)
    except TimeoutError:
        raise ShardError(f"shard {endpoint} did not answer the handshake within {timeout_s} s "
                         "(busy with another client, or hung)") from None
    except OSError as e:
        raise ShardError(f"shard {endpoint} unreachable: {e.strerror or e}") from None


def probe(endpoint: str, *, timeout_s: float = 2.0, allow_remote: bool = False) -> tuple:
    """`probe_info`, returning the server's (major, minor, patch)."""
    return probe_info(endpoint, timeout_s=timeout_s, allow_remote=allow_remote).version


# -- the libraries ----------------------------------------------------------------------
_libs: dict = {}


def libs() -> dict:
    """libggml (devices), libggml-base (buffers, abort hook), libggml-rpc, bound once."""
    if not _libs:
        load()
        import llama_cpp

        d = Path(llama_cpp.__file__).parent / "lib"
        ggml = ctypes.CDLL(str(d / "libggml.so"))
        base = ctypes.CDLL(str(d / "libggml-base.so"))
        rpc = ctypes.CDLL(str(d / "libggml-rpc.so"))
        vp, cp, sz = ctypes.c_void_p, ctypes.c_char_p, ctypes.c_size_t
        for lib, fn, args, res in (
            (ggml, "ggml_backend_dev_by_type", [ctypes.c_int], vp),
            (ggml, "ggml_backend_dev_count", [], sz),
            (ggml, "ggml_backend_dev_get", [sz], vp),
            (ggml, "ggml_backend_dev_name", [vp], cp),
            (ggml, "ggml_backend_dev_description", [vp], cp),
            (ggml, "ggml_backend_reg_dev_count", [vp], sz),
            (ggml, "ggml_backend_reg_dev_get", [vp, sz], vp),
            (base, "ggml_backend_buffer_name", [vp], cp),
            (rpc, "ggml_backend_rpc_start_server", [cp, cp, sz, sz, ctypes.POINTER(vp)], None),
            (rpc, "ggml_backend_rpc_add_server", [cp], vp),
        ):
            f = getattr(lib, fn)
            f.argtypes, f.restype = args, res
        _libs.update(ggml=ggml, base=base, rpc=rpc)
    return _libs


def cpu_device() -> int:
    dev = libs()["ggml"].ggml_backend_dev_by_type(GGML_BACKEND_DEVICE_TYPE_CPU)
    if not dev:
        raise UpstreamError("upstream has no CPU device")
    return dev


#: What a shard can serve: its process's CPU, or the first local GPU (a CUDA build).
SHARD_DEVICES = ("cpu", "gpu")
#: The default of `mtplib shard serve --device` (so that LocalShards' children, which a
#: lane starts, serve the GPU on a GPU machine: the device run sets it).
SHARD_DEVICE_ENV = envs.SHARD_DEVICE


def shard_device_kind(kind: str | None = None) -> str:
    """The kind of device a shard serves: ``kind`` (default $MTPLIB_SHARD_DEVICE, else
    cpu), one of SHARD_DEVICES."""
    kind = kind or envs.shard_device() or "cpu"
    if kind not in SHARD_DEVICES:
        raise RuntimeInputError(f"shard device must be one of {', '.join(SHARD_DEVICES)}, "
                                f"got {kind!r} (--device or ${SHARD_DEVICE_ENV})")
    return kind


def shard_device(kind: str | None = None) -> int:
    """The device a shard serves: ``kind`` (default $MTPLIB_SHARD_DEVICE, else cpu)."""
    kind = shard_device_kind(kind)
    if kind == "cpu":
        return cpu_device()
    dev = libs()["ggml"].ggml_backend_dev_by_type(GGML_BACKEND_DEVICE_TYPE_GPU)
    if not dev:
        raise UpstreamError("this llama.cpp build has no GPU device to serve (a CUDA build "
                            "is needed for --device gpu)")
    return dev


def serve(endpoint: str, *, threads: int, cache_dir: str | None = None,
          allow_remote: bool = False, device: str | None = None) -> None:
    """Serve one device (the CPU unless ``device``/$MTPLIB_SHARD_DEVICE says gpu) on
    ``endpoint`` until the process ends (blocks in upstream's accept loop; returns only if
    upstream gives up, e.g. the port is taken)."""
    parse_endpoint(endpoint, allow_remote=allow_remote)
    check_threads(threads, "--threads")  # thousands of threads crash upstream's thread pool
    dev = shard_device(device)
    if cache_dir is not None:
        Path(cache_dir).mkdir(parents=True, exist_ok=True)
    devs = (ctypes.c_void_p * 1)(dev)
    with _c_stdout_to_stderr():
        libs()["rpc"].ggml_backend_rpc_start_server(
            endpoint.encode(), cache_dir.encode() if cache_dir else None, threads, 1, devs)


@contextlib.contextmanager
def _c_stdout_to_stderr() -> Iterator[None]:
    """Upstream's RPC server printf()s its banner and connection lines to stdout: point
    file descriptor 1 at stderr meanwhile, so stdout carries only mtplib's own output (one
    JSON object under --json). C's buffer is flushed before fd 1 is restored, so nothing
    of upstream's reaches the real stdout later."""
    import os
    import sys

    sys.stdout.flush()
    libc = ctypes.CDLL(None)
    saved = os.dup(1)
    try:
        os.dup2(2, 1)
        yield
    finally:
        libc.fflush(None)
        os.dup2(saved, 1)
        os.close(saved)


def add_server(endpoint: str, *, timeout_s: float = 5.0, allow_remote: bool = False) -> list:
    """Register a shard with upstream's client (after a Python handshake, so an
    unreachable shard raises instead of aborting); returns its device pointers."""
    probe(endpoint, timeout_s=timeout_s, allow_remote=allow_remote)
    lb = libs()
    reg = lb["rpc"].ggml_backend_rpc_add_server(endpoint.encode())
    if not reg:
        raise ShardError(f"shard {endpoint} reports no devices")
    n = lb["ggml"].ggml_backend_reg_dev_count(reg)
    return [lb["ggml"].ggml_backend_reg_dev_get(reg, i) for i in range(n)]


def device_name(dev: int) -> str:
    return libs()["ggml"].ggml_backend_dev_name(dev).decode()


# -- what upstream's log says -----------------------------------------------------------
_ASSIGN = re.compile(r"load_tensors: layer\s+(\d+) assigned to device (\S+?),")
_BUF = re.compile(r"^(?P<fn>\w+):\s+(?P<buf>\S+)\s+(?P<what>.*?)\s*buffer size =\s*"
                  r"(?P<mib>[\d.]+) MiB")


def layer_devices(lines: Iterable[str]) -> dict[int, str]:
    """``layer N assigned to device NAME`` lines (LLAMA_LOG_DEBUG in load_tensors; the
    last such line per layer wins). Layer n_layer_all is the output layer."""
    out: dict[int, str] = {}
    for s in lines:
        m = _ASSIGN.search(s)
        if m:
            out[int(m.group(1))] = m.group(2)
    return out


def buffer_lines(lines: Iterable[str]) -> list[dict]:
    """Per-buffer sizes upstream prints: model (load_tensors), KV / DSV4 state
    (context creation), output and compute buffers. ``buf`` names the device, e.g.
    ``RPC0[127.0.0.1:50052]`` or ``CPU``."""
    out = []
    for s in lines:
        m = _BUF.search(s.strip())
        if m:
            out.append({"fn": m.group("fn"), "buffer": m.group("buf"),
                        "what": m.group("what").strip(), "mib": float(m.group("mib"))})
    return out


_CREATING = re.compile(r"creating (?P<what>.+?)(?:, size = (?P<cells>\d+) cells)?\s*$")
_LAYER_DEV = re.compile(r"^(?P<fn>\w+): layer\s+(?P<il>\d+): dev = (?P<dev>\S+)")


def cache_placement(lines: Iterable[str], names: dict[str, str] | None = None) -> list[dict]:
    """Which device holds each layer of each cache a context creates, from upstream's own
    lines (``creating DSV4 CSA compressed KV cache`` ... ``layer N: dev = RPCk``).
    ``names`` maps device names to endpoints. One dict per (cache, layer)."""
    names = names or {}
    out: list[dict] = []
    section, outer = None, None
    for s in lines:
        s = s.strip()
        m = _CREATING.search(s)
        if m and "creating" in s:
            what = " ".join(m.group("what").split())
            if s.startswith("llama_kv_cache_iswa"):  # the raw cache's two halves
                section = f"{outer}: {what}" if outer else what
            else:
                section = outer = what
            continue
        m = _LAYER_DEV.search(s)
        if m and section:
            dev = m.group("dev")
            out.append({"cache": section, "layer": int(m.group("il")), "device": dev,
                        "endpoint": names.get(dev)})
    return out


def endpoint_of_buffer(name: str) -> str | None:
    m = re.fullmatch(r"RPC\d+\[(.+)\]", name)
    return m.group(1) if m else None


# -- opening a ranged model -------------------------------------------------------------
def open_ranged(trunk: str | Path, plan: ShardPlan | str, endpoints: Sequence[str], *,
                sidecar: str | Path | None = None, allow_remote: bool = False,
                verify: bool = True, mtp_placement: str = Placement.TAIL,
                header=None, sidecar_header=None):
    """Load ``trunk`` across RPC shards (one endpoint per plan range, in order) and the
    MTP ``sidecar`` (if given) on the tail shard only (``mtp_placement="tail"``) or on this
    process's CPU (``"client"``: next to the sampler, so drafting costs no shard traffic).
    Returns (trunk Model, sidecar Model | None); the trunk Model carries ``.plan``,
    ``.endpoints`` and ``.placement`` (layer -> endpoint, read back from upstream's own
    load log).

    ``header``/``sidecar_header``: the files' headers as the caller already read them
    (`RangedMTP` reads each once per run and its worker gets them pickled), else read here.

    In-process: a shard lost later aborts THIS process (upstream's client); use
    mtplib.distributed.client.RangedRuntime to contain that."""
    from mtplib.model.gguf_header import read_header
    from mtplib.runtime.model import Model, check_pair

    th = header or read_header(trunk)
    if th.is_mtp_only:
        raise PlanError(f"{trunk} is an MTP sidecar, not a trunk")
    n_layer = int(th.kv["deepseek4.block_count"])
    if isinstance(plan, str):
        plan = ShardPlan.parse(plan, n_layer)
    if plan.n_layer != n_layer:
        raise PlanError(f"plan {plan} covers layers 0-{plan.n_layer - 1}, the trunk has "
                        f"{n_layer} (0-{n_layer - 1})")
    if plan.n_shards > MAX_RPC_SERVERS:
        raise PlanError(f"upstream's RPC client supports at most {MAX_RPC_SERVERS} servers")
    endpoints = check_endpoints(plan, endpoints)
    if len(set(endpoints)) != len(endpoints):
        raise PlanError("every shard needs its own endpoint (a server serves one range)")
    sh = None if sidecar is None else sidecar_header or read_header(sidecar)
    if sh is not None and sh.arch == "dflash":  # a DSpark draft: checked against the trunk
        from mtplib.model.dspark.validate import validate_dspark

        validate_dspark(sh, th)
    elif sh is not None:
        check_pair(th, sh)
    devices = []
    for ep in endpoints:
        devs = add_server(ep, allow_remote=allow_remote)
        if len(devs) != 1:
            raise ShardError(f"shard {ep} serves {len(devs)} devices; mtplib shards serve one")
        devices.append(devs[0])
    names = {device_name(d): ep for d, ep in zip(devices, endpoints, strict=True)}
    with log_capture() as lines:
        model = Model(trunk, header=th, devices=devices, tensor_split=plan.tensor_split(),
                      validated=sh is not None)  # check_pair validated both
    try:
        placement = {il: names.get(dev, dev) for il, dev in layer_devices(lines).items()}
        model.plan, model.endpoints, model.placement = plan, endpoints, placement
        model.device_endpoints = names
        model.load_buffers = [b for b in buffer_lines(lines) if b["fn"] == "load_tensors"]
        if verify:
            check_placement(plan, endpoints, placement)
        model.devices = devices  # a sidecar placed later (`load_sidecar`) needs the tail's
        side = None
        if sh is not None:
            side = load_sidecar(model, sidecar, mtp_placement, header=sh, verify=verify)
        return model, side
    except BaseException:
        model.close()
        raise


def load_sidecar(trunk, sidecar: str | Path, mtp_placement: str, *, header=None,
                 verify: bool = True):
    """The MTP ``sidecar`` of a ranged ``trunk`` (`open_ranged`'s Model) on this process's
    CPU (``"client"``) or wholly on the tail shard (``"tail"``); its Model carries
    ``.endpoints``, ``.placement`` and ``.load_buffers`` as the trunk's does. Used at open
    and when ``--mtp-placement auto`` moves the drafter after timing it."""
    from mtplib.model.gguf_header import read_header
    from mtplib.runtime.model import Model

    sh = header or read_header(sidecar)
    if sh.arch == "dflash":  # a DSpark draft (`mtplib.runtime.dspark.ranged`)
        from mtplib.runtime.dspark.ranged import load_dspark

        with log_capture() as lines:
            side = load_dspark(trunk, sidecar, mtp_placement, header=sh)
        shard_bufs = [b for b in buffer_lines(lines) if b["fn"] == "load_tensors"
                      and endpoint_of_buffer(b["buffer"]) and b["mib"] > 0]
        if shard_bufs:  # its weights belong in the client: only the backend is the tail's
            side.close()
            raise ShardError(f"upstream put DSpark weights on a shard: {shard_bufs}")
        return side
    names, endpoints = trunk.device_endpoints, trunk.endpoints
    if mtp_placement == Placement.CLIENT:
        # explicit CPU device: with devices=NULL upstream would spread it over the shards
        side = Model(sidecar, load_mtp=True, header=sh, devices=[cpu_device()],
                     validated=True)
        side.endpoints, side.device_endpoints, side.load_buffers = [], names, []
        side.placement = {}
        return side
    with log_capture() as lines:
        side = Model(sidecar, load_mtp=True, header=sh, devices=[trunk.devices[-1]],
                     validated=True)
    side.endpoints = [endpoints[-1]]
    side.device_endpoints = names
    side.placement = {il: names.get(dev, dev) for il, dev in layer_devices(lines).items()}
    side.load_buffers = [b for b in buffer_lines(lines) if b["fn"] == "load_tensors"]
    if verify and (not side.placement or set(side.placement.values()) != {endpoints[-1]}):
        side.close()
        raise ShardError(f"upstream did not place the whole MTP sidecar on the tail "
                         f"shard {endpoints[-1]}: {side.placement}")
    return side


def check_placement(plan: ShardPlan, endpoints: Sequence[str], placement: dict) -> None:
    """Every trunk layer and the output layer are on the shard the plan gives them."""
    want = {il: endpoints[plan.owner(il)] for il in range(plan.n_layer + 1)}
    if placement != want:
        bad = {il: (placement.get(il), want[il]) for il in want if placement.get(il) != want[il]}
        raise ShardError(f"upstream placed layers differently from plan {plan}: "
                         f"layer -> (got, wanted) {bad}" + (
                             "" if placement else " (no 'assigned to device' log lines seen)"))


class log_capture:  # noqa: N801 - used as a context manager
    """Collect the upstream log lines emitted inside the block (from LOG_TAIL)."""

    _n = 0

    def __enter__(self) -> list[str]:
        log_capture._n += 1
        self.marker = f"\x00mtplib-mark-{id(self)}-{log_capture._n}\x00"
        LOG_TAIL.append(self.marker)
        self.lines: list[str] = []
        return self.lines

    def __exit__(self, *exc) -> None:
        tail = list(LOG_TAIL)
        try:
            i = len(tail) - 1 - tail[::-1].index(self.marker)
            self.lines.extend(tail[i + 1:])
        except ValueError:  # the marker scrolled out: keep everything there is
            self.lines.extend(tail)
