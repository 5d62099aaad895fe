"""patches/0007 (RPC protocol 7.2): the shard-to-shard seam ("ring"), proven on loopback.

With ``GGML_RPC_SEAM=ring`` a boundary value goes from the shard that computes it straight to
the next shard (PUSH_TENSOR on the source's command stream, WAIT_TENSOR on the
destination's, neither answered), over a peer link the source opens to the endpoint the
client dials for the destination (here: that shard's counting relay). The client then
waits once per step, for the tail's output, instead of once per shard (the star of
patches/0002). Tested here:

- tokens identical to the star and to the whole model on 2 and 3 shards, k = 0 and 2, with
  one client wait per plain, verify and prefill step (the star: one per shard);
- per shard pair fallback: a pair with a 7.0 (stock) server stays on the star;
- a peer is a stranger until the client names it: wrong token, unannounced link, a second
  connection, out-of-bounds or foreign destinations, stale or repeated sequence numbers,
  truncated or random streams are refused without crashing the shard or touching its
  buffers, and a wait whose push cannot come fails (closes the session), never hangs;
- the patch applies and reverses against the pin after 0001-0006.

Everything but the patch check skips when the loaded build lacks 0007 (protocol < 7.2).
"""

from __future__ import annotations

import contextlib
import os
import random
import re
import shutil
import signal
import socket
import struct
import subprocess
import tarfile
import time
from pathlib import Path

import pytest
from rpc_fakes import hello, request, wait_closed

from mtplib.distributed.client import ShardLostError, resolve_seam
from mtplib.distributed.processes import LocalShards
from mtplib.distributed.ranged_mtp import RangedMTP
from mtplib.distributed.relay import WanLink
from mtplib.distributed.shard_report import ProbedShard
from mtplib.errors import InputError
from mtplib.model.trained import trained_paths
from mtplib.runtime.engine_options import EngineOptions
from mtplib.runtime.rpc import (
    RPC_ALLOC_BUFFER,
    RPC_BUFFER_GET_BASE,
    RPC_CMD_HELLO,
    RPC_GET_TENSOR,
    RPC_PEER_CONNECT,
    RPC_PEER_EXPECT,
    RPC_PEER_HELLO,
    RPC_PEER_PUSH,
    RPC_SET_TENSOR,
    RPC_TENSOR_SIZE,
    RPC_WAIT_TENSOR,
    client_proto_minor,
    seam_links,
)
from mtplib.runtime.settings import DecodeSettings
from mtplib.runtime.speculative import MTPRuntime

REPO = Path(__file__).resolve().parent.parent
PATCHES = sorted((REPO / "patches").glob("*.patch"))
RING_PATCH = REPO / "patches" / "0007-rpc-shard-to-shard-push.patch"
needs_ring = pytest.mark.skipif(
    client_proto_minor() < 2, reason="the loaded build lacks patches/0007 (RPC protocol 7.2)")

PROMPT = list(range(100, 132))
N_NEW = 12


# -- the patch itself -----------------------------------------------------------------------
def _sdist() -> Path | None:
    from mtplib.lab.upstream_tools import sdist_candidates

    return next((p for p in sdist_candidates() if p.is_file()), None)


def test_ring_patch_applies_and_reverses_after_the_set(tmp_path):
    """The files the patch set touches, from the pinned sdist: 0001-0006 apply, then 0007
    applies and reverses (what ./dev.sh setup checks before building)."""
    sdist = _sdist()
    if sdist is None or shutil.which("git") is None:
        pytest.skip("the pinned sdist (or git) is not here")
    assert RING_PATCH in PATCHES and PATCHES.index(RING_PATCH) == len(PATCHES) - 1
    files = {m for p in PATCHES for m in re.findall(r"^diff --git a/(\S+) ", p.read_text(), re.M)}
    root = sdist.name.removesuffix(".tar.gz") + "/vendor/llama.cpp/"
    with tarfile.open(sdist) as t:
        members = [t.getmember(root + f) for f in sorted(files)]
        t.extractall(tmp_path, members=members, filter="data")
    tree = tmp_path / root

    def git_apply(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(["git", "apply", *args], cwd=tree, capture_output=True, text=True)

    for p in PATCHES[:-1]:
        assert git_apply(str(p)).returncode == 0, p.name
    assert git_apply("--check", str(RING_PATCH)).returncode == 0
    assert git_apply(str(RING_PATCH)).returncode == 0
    assert git_apply("--check", "--reverse", str(RING_PATCH)).returncode == 0
    assert "RPC_PROTO_MINOR_VERSION    2" in (tree / "ggml/include/ggml-rpc.h").read_text()


# -- mtplib's choice and report (no upstream) ----------------------------------------------
def _info(minor: int) -> ProbedShard:
    return ProbedShard((7, minor, 0), 1, 32, 1 << 40, 1 << 30, 2 << 30)


def test_resolve_seam_rings_only_where_everything_speaks_it():
    new, old = _info(2), _info(1)
    assert resolve_seam("star", [new, new], tls=False, client_minor=2) == ("star", "asked")
    assert resolve_seam("auto", [new, new, new], tls=False, client_minor=2)[0] == "ring"
    assert resolve_seam("ring", [new, new], tls=False, client_minor=2)[0] == "ring"
    seam, why = resolve_seam("auto", [new, old, new], tls=False, client_minor=2)
    assert seam == "star" and why == "shard 1 speaks RPC 7.1 (the ring needs 7.2)"
    seam, why = resolve_seam("ring", [old, new, old], tls=False, client_minor=2)
    assert seam == "ring" and why.startswith("shards 0, 2 speak RPC 7.1")
    assert resolve_seam("auto", [new, new], tls=False, client_minor=1)[0] == "star"
    assert resolve_seam("auto", [new, new], tls=True, client_minor=2)[0] == "star"
    assert resolve_seam("auto", [new], tls=False, client_minor=2) == ("star", "one shard: no seam")
    for tls, minor in ((True, 2), (False, 1)):
        with pytest.raises(InputError, match="seam ring: "):
            resolve_seam("ring", [new, new], tls=tls, client_minor=minor)
    with pytest.raises(InputError, match="seam must be one of auto, star, ring"):
        resolve_seam("rnig", [new, new], tls=False, client_minor=2)


def test_seam_links_read_upstreams_lines():
    lines = ["llama_model_load: x\n",
             "RPC seam 127.0.0.1:1 -> 127.0.0.1:2: ring (link 1 to 127.0.0.1:2)\n",
             "RPC seam 127.0.0.1:2 -> 127.0.0.1:3: star (a server speaks protocol 7.1 or older)\n"]
    assert seam_links(lines) == [
        {"from": "127.0.0.1:1", "to": "127.0.0.1:2", "seam": "ring", "why": ""},
        {"from": "127.0.0.1:2", "to": "127.0.0.1:3", "seam": "star",
         "why": "a server speaks protocol 7.1 or older"}]
    assert seam_links(["RPC seam a -> b: maybe (x)\n"]) == []


# -- generation over the ring ---------------------------------------------------------------
def _run(seam: str, plan: str, k: int, endpoints: list[str] | None = None,
         tls=None) -> dict:
    """One warm generation of the trained pair over ``plan`` with ``seam`` (RangedMTP sets
    GGML_RPC_SEAM for its client worker), every shard link at 20 ms after loading (so a
    pipelined request is one wait, as over a WAN); ``tls``: through the shards' gateways
    (tests/test_tls_ring.py)."""
    p = trained_paths()
    with RangedMTP(str(p.trunk), plan=plan, sidecar=str(p.sidecar) if k else None,
                   endpoints=endpoints, seam=seam, tls=tls) as r:
        opts = EngineOptions(k=k, settings=DecodeSettings(n_ctx=256, n_threads=1),
                             head="client")
        r.generate(PROMPT, 4, opts)
        for relay in r.rt.relays.relays:
            relay.set_link(WanLink(20))
        toks, m = r.generate(PROMPT, N_NEW, opts)
        opened = [sum(e["event"] == "open" for e in relay.events) for relay in r.rt.relays.relays]
        # peer links that passed a relay in mutual TLS (its peer port: opened as peers)
        tls_peers = [sum(e["event"] == "open" and e.get("link") == "peer" for e in relay.events)
                     for relay in r.rt.relays.relays]
        eps = list(r.rt.endpoints)
    return {"tokens": toks, "waits": m.waits_per_step, "bytes": m.wire_bytes_by_class,
            "opened": opened, "seam": m.seam, "endpoints": eps, "report": m.seam_report,
            "crossing": m.cache_bytes_crossing, "tls_peers": tls_peers}


def whole_tokens() -> dict[int, list[int]]:
    """The whole model's tokens for PROMPT at k = 0 and 2 (also tests/test_tls_ring.py's)."""
    p = trained_paths()
    out = {}
    for k in (0, 2):
        with MTPRuntime(str(p.trunk), str(p.sidecar) if k else None, k=k) as rt:
            out[k] = rt.generate(PROMPT, N_NEW)[0]
    return out


@pytest.fixture(scope="module")
def whole() -> dict[int, list[int]]:
    return whole_tokens()


@needs_ring
@pytest.mark.slow
@pytest.mark.parametrize("k", [0, 2])
@pytest.mark.parametrize("plan,n_shards", [("0-1,2-3", 2), ("0-0,1-2,3-3", 3)])
def test_ring_gives_the_star_and_whole_tokens_with_one_wait_per_step(whole, plan, n_shards, k):
    """Same tokens as the star and the whole model; the star waits once per shard and step
    (plain, verify and prefill), the ring once (the tail's output) and moves no boundary
    value through the client; every shard but the head got a peer link at its relay."""
    star = _run("star", plan, k)
    ring = _run("auto", plan, k)
    assert star["tokens"] == ring["tokens"] == whole[k] == whole[0]
    step = "verify" if k else "decode"
    assert star["waits"][step] == star["waits"]["prefill"] == n_shards
    assert ring["waits"][step] == ring["waits"]["prefill"] == 1
    if not k:
        assert star["bytes"]["decode"]["seam"] > 0
        assert ring["bytes"]["decode"]["seam"] == 0
        assert ring["bytes"]["decode"]["cache"] == star["bytes"]["decode"]["cache"] == 0
    # one more connection at each relay but the head's: the peer link from the shard before
    extra = [r - s for r, s in zip(ring["opened"], star["opened"], strict=True)]
    assert extra == [0] + [1] * (n_shards - 1)
    # the results say so: auto chose the ring, each consecutive pair rang
    eps = ring["endpoints"]
    assert ring["seam"]["requested"] == "auto" and ring["seam"]["seam"] == "ring"
    assert [(x["from"], x["to"], x["seam"]) for x in ring["seam"]["links"]] == [
        (a, b, "ring") for a, b in zip(eps[:-1], eps[1:], strict=True)]
    assert star["seam"]["seam"] == "star" and star["seam"]["links"] == []
    # the peer links' bytes, at the relay of the shard they push into: each boundary value
    # once (the star moves it twice: out of one shard, into the next), all of it seam
    peer = ring["report"]["steps"][step]["peer"]
    assert peer["per_shard"][0] == 0 and all(peer["per_shard"][1:])
    assert "peer" not in star["report"]["steps"][step]
    assert peer["classes"]["seam"] == peer["data"] > 0
    assert peer["classes"]["cache"] == ring["crossing"] == 0
    if not k:
        assert 2 * peer["classes"]["seam"] == star["bytes"]["decode"]["seam"]


@needs_ring
@pytest.mark.slow
def test_peer_wan_gives_the_peer_links_their_own_rtt():
    """--wan 120 --peer-wan 0 on 3 shards: a ring step pays one client round trip (client
    -> head, tail -> client) and peer hops of ~0, where with the peer links at the client
    links' RTT it pays two (4 one-way hops of 60 ms); the tokens do not change and the
    result names each pair's peer link."""
    p = trained_paths()
    opts = EngineOptions(k=0, settings=DecodeSettings(n_ctx=256, n_threads=1))
    out = {}
    for peer in (None, "0"):
        with RangedMTP(str(p.trunk), plan="0-0,1-2,3-3", seam="ring", wan="120",
                       peer_wan=peer) as r:
            r.generate(PROMPT, 2, opts)
            toks, m = r.generate(PROMPT, 8, opts)
            out[peer] = (toks, m.decode_s / (m.n_generated - 1), m.seam["peer_wan"],
                         r.rt.seam_report()["peer_links"])
    (same, slow, same_links, rep_same), (near, fast, near_links, rep_near) = out.values()
    assert same == near
    assert same_links == rep_same == ["120", "120"] and near_links == rep_near == ["0", "0"]
    assert 0.235 <= slow < 0.4, slow  # 2 round trips
    assert 0.118 <= fast < 0.2, fast  # 1 round trip


@needs_ring
@pytest.mark.slow
def test_a_tail_next_to_the_client_keeps_its_peer_link_far():
    """--wan 120,0 on the ring (the tail co-located with the client): without --peer-wan
    the peer link into the tail gets 120 ms, the farther of its two shards, so a step pays
    one 120 ms round trip (client -> head 60, head -> tail 60), as the star does, not the
    60 ms the tail's own link would give."""
    p = trained_paths()
    opts = EngineOptions(k=0, settings=DecodeSettings(n_ctx=256, n_threads=1))
    with RangedMTP(str(p.trunk), plan="0-1,2-3", seam="ring", wan="120,0") as r:
        r.generate(PROMPT, 2, opts)
        _, m = r.generate(PROMPT, 8, opts)
        assert m.seam["peer_wan"] == r.rt.seam_report()["peer_links"] == ["120"]
    per_token = m.decode_s / (m.n_generated - 1)
    assert 0.118 <= per_token < 0.2, per_token


def _shards(build: str, n: int) -> LocalShards:
    return LocalShards(n, env=dict(os.environ, MTPLIB_UPSTREAM=build), cwd=REPO,
                       start_timeout_s=60)


@needs_ring
@pytest.mark.slow
def test_ring_falls_back_to_the_star_per_pair():
    """GGML_RPC_SEAM=ring over shards [7.2, 7.2, 7.0 (stock)]: the first pair rings, the
    pair into the stock shard stays on the star (one more wait); all stock: the star
    throughout. Same tokens every time."""
    plan = "0-0,1-2,3-3"
    with _shards("patched", 2) as new, _shards("stock", 1) as old:
        mixed = _run("ring", plan, 0, endpoints=new.endpoints + old.endpoints)
        auto = _run("auto", plan, 0, endpoints=new.endpoints + old.endpoints)
        log = new.log_path(1).read_text()
    with _shards("stock", 3) as old:
        stock = _run("ring", plan, 0, endpoints=old.endpoints)
    ring = _run("ring", plan, 0)
    assert mixed["tokens"] == stock["tokens"] == ring["tokens"] == auto["tokens"]
    assert ring["waits"]["decode"] == 1
    assert mixed["waits"]["decode"] == 2
    assert stock["waits"]["decode"] == 3
    extra = [m - s for m, s in zip(mixed["opened"], stock["opened"], strict=True)]
    assert extra == [0, 1, 0]  # only the pair that rings has a peer link
    assert "Accepted peer link" in log
    links = [(x["seam"], x["why"]) for x in mixed["seam"]["links"]]
    assert links == [("ring", ""), ("star", "a server speaks protocol 7.1 or older")]
    assert [x["seam"] for x in stock["seam"]["links"]] == ["star", "star"]
    # each plan pair says which seam ran there and why (seam.pairs)
    assert [(x["seam"], x["why"]) for x in mixed["seam"]["pairs"]] == [
        ("ring", "both shards speak RPC 7.2: the link opened"),
        ("star", "a server speaks protocol 7.1 or older")]
    # auto: the ring only where every shard speaks it
    assert auto["seam"]["seam"] == "star" and "shard 2 speaks RPC 7.0" in auto["seam"]["why"]
    assert [(x["seam"], x["why"]) for x in auto["seam"]["pairs"]] == [
        ("star", auto["seam"]["why"])] * 2
    assert auto["waits"]["decode"] == 3


@needs_ring
@pytest.mark.slow
@pytest.mark.parametrize("victim,how", [(0, "kill"), (1, "kill"), (0, "stop")])
def test_a_shard_lost_mid_generation_over_the_ring_is_named_and_reconnects(pair, monkeypatch,
                                                                          victim, how):
    """Over the ring a lost shard fails the running generation naming it (the pusher
    killed or stopped: the next shard's wait fails or its session ends with the client's,
    no hang), and `reconnect` restarts it: the ring again, the tokens given before."""
    monkeypatch.setenv("MTPLIB_SHARD_SILENCE_S", "2")
    prompt = [5, 6, 7, 8, 9]
    with RangedMTP(str(pair.trunk), plan="0-1,2-3", seam="ring") as r:
        want, m = r.generate(prompt, 12)
        assert [x["seam"] for x in m.seam["links"]] == ["ring"]
        pid = r.shards.pids()[victim]
        t0 = time.monotonic()
        with pytest.raises(ShardLostError) as ei, r.stream(prompt, 12) as gen:
            for i, _chunk in enumerate(gen):
                if i == 0:
                    if how == "kill":
                        r.shards.kill(victim)
                    else:
                        os.killpg(pid, signal.SIGSTOP)
        assert time.monotonic() - t0 < 20
        assert victim in ei.value.shards, (ei.value.shards, str(ei.value))
        r.reconnect()
        assert r.shards.pids()[victim] != pid
        toks, m = r.generate(prompt, 12)
        assert toks == want and [x["seam"] for x in m.seam["links"]] == ["ring"]


# -- hostile peers against a real 7.2 shard -------------------------------------------------
def rpc_tensor(buffer: int, data: int, n: int, *, type_: int = 0, name: bytes = b"t") -> bytes:
    """A packed rpc_tensor (ggml-rpc.cpp): an F32 vector of ``n`` elements at ``data``."""
    ne = (n, 1, 1, 1)
    nb = (4, 4 * n, 4 * n, 4 * n)
    t = struct.pack("<QIQ4I4II16ii10QQQQ64si", 1, type_, buffer, *ne, *nb, 0, *([0] * 16), 0,
                    *([0] * 10), 0, 0, data, name, 0)
    assert len(t) == RPC_TENSOR_SIZE
    return t


def _recv_exact(s: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk = s.recv(n - len(buf))
        if not chunk:
            raise ConnectionError(f"closed after {len(buf)} of {n} bytes")
        buf += chunk
    return buf


class Client:
    """A client session on a real shard, in Python: one buffer of ``size`` bytes, filled
    with a known pattern."""

    def __init__(self, endpoint: str, size: int = 4096) -> None:
        host, port = endpoint.rsplit(":", 1)
        self.s = socket.create_connection((host, int(port)), timeout=10)
        self.s.sendall(hello())
        assert _recv_exact(self.s, 8 + 28)[8:10] == bytes([7, 2])
        self.size = size
        self.buffer = struct.unpack("<QQ", self.ask(RPC_ALLOC_BUFFER,
                                                    struct.pack("<IQ", 0, size), 16))[0]
        assert self.buffer
        (self.base,) = struct.unpack("<Q", self.ask(RPC_BUFFER_GET_BASE,
                                                    struct.pack("<Q", self.buffer), 8))
        self.pattern = random.Random(1).randbytes(size)
        self.send(RPC_SET_TENSOR, self.tensor() + b"\0" + struct.pack("<Q", 0) + self.pattern)

    def tensor(self, offset: int = 0, n: int | None = None) -> bytes:
        n = (self.size - offset) // 4 if n is None else n
        return rpc_tensor(self.buffer, self.base + offset, n)

    def send(self, cmd: int, payload: bytes) -> None:
        self.s.sendall(request(cmd, payload))

    def ask(self, cmd: int, payload: bytes, size: int) -> bytes:
        self.send(cmd, payload)
        (got,) = struct.unpack("<Q", _recv_exact(self.s, 8))
        assert got == size, (cmd, got, size)
        return _recv_exact(self.s, size)

    def contents(self) -> bytes:
        return self.ask(RPC_GET_TENSOR, self.tensor() + struct.pack("<QQ", 0, self.size),
                        self.size)

    def expect(self, link: int, token: bytes) -> int:
        return self.ask(RPC_PEER_EXPECT, struct.pack("<I", link) + token, 1)[0]

    def wait(self, link: int, seq: int, dst: bytes) -> None:
        self.send(RPC_WAIT_TENSOR, struct.pack("<IQ", link, seq) + dst)

    def close(self) -> None:
        self.s.close()


def peer(endpoint: str, link: int, token: bytes) -> tuple[socket.socket, int | None]:
    """A peer connection presenting ``token`` for ``link``: (socket, the shard's answer, or
    None if it closed without one)."""
    host, port = endpoint.rsplit(":", 1)
    s = socket.create_connection((host, int(port)), timeout=10)
    s.sendall(request(RPC_PEER_HELLO, struct.pack("<I", link) + token))
    try:
        head = _recv_exact(s, 9)
    except (ConnectionError, OSError):
        return s, None
    assert struct.unpack("<Q", head[:8])[0] == 1
    return s, head[8]


def push(seq: int, dst: bytes, data: bytes) -> bytes:
    return request(RPC_PEER_PUSH, struct.pack("<Q", seq) + dst + data)


class Links:
    """Fresh peer links into one client session (each announced with its own token)."""

    def __init__(self, client: Client, endpoint: str) -> None:
        self.client, self.endpoint, self.n = client, endpoint, 0
        self.rng = random.Random(7)

    def open(self) -> tuple[int, socket.socket]:
        self.n += 1
        token = self.rng.randbytes(16)
        assert self.client.expect(self.n, token) == 1
        s, ok = peer(self.endpoint, self.n, token)
        assert ok == 1
        return self.n, s


@pytest.fixture
def shard():
    """One 7.2 shard; a wait gives up after 1 s."""
    env = dict(os.environ, MTPLIB_UPSTREAM="patched", GGML_RPC_PEER_TIMEOUT="1")
    with LocalShards(1, env=env, cwd=REPO, start_timeout_s=60) as sh:
        yield sh


def _alive(sh: LocalShards) -> bool:
    """The shard process runs and serves a new client session."""
    if not sh.alive()[0]:
        return False
    c = Client(sh.endpoints[0], size=64)
    try:
        return c.contents() == c.pattern
    finally:
        c.close()


@needs_ring
def test_a_peer_is_accepted_only_as_the_client_named_it(shard):
    ep = shard.endpoints[0]
    c = Client(ep)
    token = bytes(range(16))
    assert c.expect(1, token) == 1
    assert c.expect(1, token) == 0  # a link id once
    for link, tok in ((1, bytes(16)), (1, token[:-1] + b"\0"), (2, token)):  # wrong / unannounced
        s, ok = peer(ep, link, tok)
        assert ok == 0
        wait_closed(s, 5)
    s, ok = peer(ep, 1, token)
    assert ok == 1
    again, ok = peer(ep, 1, token)  # the token is spent
    assert ok == 0
    wait_closed(again, 5)
    assert c.contents() == c.pattern
    s.close()
    c.close()
    assert _alive(shard)
    # a peer with no client session to join
    s, ok = peer(ep, 1, token)
    assert ok == 0


@needs_ring
def test_malformed_pushes_are_refused_and_touch_nothing(shard):
    """Each bad push closes its link; the buffer keeps its contents; a good push then lands
    where the client's WAIT names it (so the refusals are not vacuous)."""
    ep = shard.endpoints[0]
    c = Client(ep)
    links = Links(c, ep)
    rng = random.Random(3)
    good = c.tensor(0, 16)
    data = rng.randbytes(64)
    bad = {
        "beyond the buffer": push(1, c.tensor(c.size - 32, 16), data),
        "before the buffer": push(1, rpc_tensor(c.buffer, c.base - 64, 16), data),
        "a buffer it does not own": push(1, rpc_tensor(c.buffer ^ 0x1000, c.base, 16), data),
        "no buffer": push(1, rpc_tensor(0, c.base, 16), data),
        "bad type": push(1, rpc_tensor(c.buffer, c.base, 16, type_=999), data),
        "sequence number 0": push(0, good, data),
        "repeated sequence number": push(1, good, data) + push(1, good, data),
        "going back": push(2, good, data) + push(1, good, data),
        "not a push": request(RPC_SET_TENSOR, good + bytes(9) + data),
        "a client command": request(RPC_PEER_CONNECT, bytes(148)),
        "short header": request(RPC_PEER_PUSH, bytes(100)),
        "huge size": bytes([RPC_PEER_PUSH]) + struct.pack("<Q", 1 << 62) + bytes(400),
        "truncated data": push(1, good, data)[:-10],
        "truncated header": push(1, good, data)[:20],
        "random bytes": rng.randbytes(777),
    }
    for what, stream in bad.items():
        _, s = links.open()
        with contextlib.suppress(OSError):  # the shard may close it before all is sent
            s.sendall(stream)
            if what.startswith("truncated"):
                s.shutdown(socket.SHUT_WR)
        assert wait_closed(s, 5) < 5, what
        assert c.contents() == c.pattern, what
    assert shard.alive()[0]
    link, s = links.open()
    s.sendall(push(1, good, data))
    c.wait(link, 1, good)
    assert c.contents() == data + c.pattern[64:]
    s.close()
    c.close()
    assert _alive(shard)


@needs_ring
@pytest.mark.parametrize("case", ["lost peer", "silent peer", "no such link", "stale wait",
                                  "other destination"])
def test_a_wait_that_cannot_be_met_fails_fast(shard, case):
    """A WAIT_TENSOR whose push never comes ends the session (the connection closes, as for
    every refused command) within the 1 s timeout or at once, never hangs; a push is only
    taken for the destination the wait names; the shard serves the next client."""
    ep = shard.endpoints[0]
    c = Client(ep)
    links = Links(c, ep)
    good = c.tensor(0, 16)
    link, s = links.open()
    if case == "lost peer":
        s.close()
    elif case == "no such link":
        link = 99
    elif case == "stale wait":
        s.sendall(push(1, good, bytes(64)))
        c.wait(link, 1, good)
        assert c.contents()[:64] == bytes(64)
    elif case == "other destination":
        s.sendall(push(1, good, bytes(64)))
    dst = c.tensor(4, 16) if case == "other destination" else good
    c.wait(link, 1, dst)
    t = wait_closed(c.s, 5)
    assert t < (2.5 if case == "silent peer" else 0.9), (case, t)
    if case == "silent peer":
        assert t > 0.5
    s.close()
    assert _alive(shard)


@needs_ring
def test_a_waiting_session_ends_when_its_client_goes():
    """A session blocked in WAIT_TENSOR on a silent peer whose client disconnects ends
    within a fraction of a second, not after the wait's timeout (30 s here): the next
    client is served at once."""
    env = dict(os.environ, MTPLIB_UPSTREAM="patched", GGML_RPC_PEER_TIMEOUT="30")
    with LocalShards(1, env=env, cwd=REPO, start_timeout_s=60) as sh:
        ep = sh.endpoints[0]
        c = Client(ep)
        link, s = Links(c, ep).open()
        c.wait(link, 1, c.tensor(0, 16))
        time.sleep(0.3)  # the session is waiting now
        c.close()
        t0 = time.monotonic()
        nxt = Client(ep, size=64)  # answers only once the previous session ended
        assert time.monotonic() - t0 < 3
        assert nxt.contents() == nxt.pattern
        nxt.close()
        s.close()


@needs_ring
def test_random_peer_streams_never_crash_the_shard(shard):
    """Seeded random streams, on announced links and as unannounced connections, while a
    client session is live: the shard stays up and the session's buffer intact."""
    ep = shard.endpoints[0]
    c = Client(ep)
    links = Links(c, ep)
    rng = random.Random(11)
    host, port = ep.rsplit(":", 1)
    for i in range(40):
        stream = rng.randbytes(rng.randint(1, 2048))
        if stream[0] == RPC_CMD_HELLO:  # a client: it would queue behind the live session
            stream = b"\0" + stream[1:]
        if i % 4 == 0:  # a push header with a random tail
            stream = bytes([RPC_PEER_PUSH]) + struct.pack("<Q", rng.randint(0, 5000)) + stream
        if i % 2:
            _, s = links.open()
        else:
            s = socket.create_connection((host, int(port)), timeout=10)
        with contextlib.suppress(OSError):  # the shard may have closed it already
            s.sendall(stream)
            s.shutdown(socket.SHUT_WR)
        wait_closed(s, 5)
        s.close()
    time.sleep(0.2)
    assert c.contents() == c.pattern
    assert shard.alive()[0]
    c.close()
    assert _alive(shard)


# -- a peer address that never answers: PEER_CONNECT's own timeout ---------------------------
CONNECT_TIMEOUT_S = 2.0


class _VerboseShards(LocalShards):
    """Local shards whose logs hold upstream's log lines too (`shard serve --verbose`): the
    errors and warnings these tests read."""

    def _argv(self, endpoint: str) -> list[str]:
        return [*super()._argv(endpoint), "--verbose"]


@contextlib.contextmanager
def _blackhole():
    """A loopback endpoint that drops SYNs, as a firewall or a vanished host does: a listener
    with backlog 0 whose one accept-queue place is taken (Linux drops a SYN to a full accept
    queue; a blocking connect then retries for its SYN retries, about 127 s). Skips where this
    host answers such a connect within 1 s instead."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(0)
    addr = srv.getsockname()
    fill = socket.create_connection(addr, timeout=5)
    probe = socket.socket()
    probe.settimeout(1.0)
    try:
        probe.connect(addr)
        blocked = False
    except TimeoutError:
        blocked = True
    finally:
        probe.close()
    try:
        if not blocked:
            pytest.skip("this host does not drop SYNs to a full accept queue")
        yield f"{addr[0]}:{addr[1]}"
    finally:
        fill.close()
        srv.close()


@contextlib.contextmanager
def _silent():
    """A loopback endpoint that completes the connection and then never answers (the kernel
    queues it; nothing accepts or reads)."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(8)
    host, port = srv.getsockname()
    try:
        yield f"{host}:{port}"
    finally:
        srv.close()


def _peer_connect(c: Client, link: int, endpoint: str) -> int:
    """PEER_CONNECT on ``c``'s session: | link (4) | token (16) | endpoint (128, NUL-padded) |;
    the shard's answer (1: the link is open)."""
    payload = struct.pack("<I", link) + bytes(16) + endpoint.encode().ljust(128, b"\0")
    return c.ask(RPC_PEER_CONNECT, payload, 1)[0]


def _blocking_connect_s(endpoint: str, limit_s: float, out: list) -> None:
    """How long a plain connect (patches/0007 before its connect timeout) blocks, up to
    ``limit_s``: appends (seconds, connected?) to ``out``."""
    host, port = endpoint.rsplit(":", 1)
    s = socket.socket()
    s.settimeout(limit_s)
    t0 = time.monotonic()
    try:
        s.connect((host, int(port)))
        out.append((time.monotonic() - t0, True))
    except OSError:
        out.append((time.monotonic() - t0, False))
    finally:
        s.close()


@needs_ring
@pytest.mark.parametrize("peer", ["drops SYNs", "never answers PEER_HELLO"])
def test_peer_connect_gives_up_after_its_connect_timeout(peer):
    """GGML_RPC_PEER_CONNECT_TIMEOUT=2 (the peer timeout 30 s): a PEER_CONNECT to an address
    that drops SYNs, or to one that accepts and never answers PEER_HELLO, is answered 0
    (refused: the client keeps that pair on the star) after about 2 s, and the shard's log
    names the endpoint and the timeout; the session goes on. Before the connect timeout the
    first blocked in the OS's connect (SYN retries, about 127 s on Linux; a plain connect to
    the same address, run beside it, is still blocked 3 s after the answer) and the second
    waited for the peer timeout (here 30 s: this test's 10 s socket timeout would fail)."""
    env = dict(os.environ, MTPLIB_UPSTREAM="patched", GGML_RPC_PEER_TIMEOUT="30",
               GGML_RPC_PEER_CONNECT_TIMEOUT=str(CONNECT_TIMEOUT_S))
    target = _blackhole() if peer == "drops SYNs" else _silent()
    with target as ep, _VerboseShards(1, env=env, cwd=REPO, start_timeout_s=60) as sh:
        c = Client(sh.endpoints[0])
        plain: list = []
        beside = None
        if peer == "drops SYNs":
            import threading

            beside = threading.Thread(target=_blocking_connect_s,
                                      args=(ep, CONNECT_TIMEOUT_S + 3, plain))
            beside.start()
        t0 = time.monotonic()
        answer = _peer_connect(c, 1, ep)
        took = time.monotonic() - t0
        assert answer == 0
        assert CONNECT_TIMEOUT_S - 0.2 <= took < CONNECT_TIMEOUT_S + 2, took
        assert c.contents() == c.pattern  # a refused link is an answer, not an error
        c.close()
        if beside is not None:
            beside.join(10)
            assert plain and not plain[0][1] and plain[0][0] >= CONNECT_TIMEOUT_S + 2.9, plain
        log = sh.log_path(0).read_text()
        assert _alive(sh)
    if peer == "drops SYNs":
        want = f"link 1: no connection to {ep} within 2 s (GGML_RPC_PEER_CONNECT_TIMEOUT)"
    else:
        want = (f"link 1: {ep} closed the link or gave no answer to PEER_HELLO within 2 s "
                "(GGML_RPC_PEER_CONNECT_TIMEOUT)")
    assert want in log, log[-2000:]


@needs_ring
def test_malformed_peer_timeouts_are_warned_and_the_defaults_used():
    """GGML_RPC_PEER_CONNECT_TIMEOUT=soon and GGML_RPC_PEER_TIMEOUT=-1: each is warned about
    in the shard's log with the default it uses (10 s, 300 s); a connect to a closed port is
    still answered 0 at once, naming the endpoint."""
    env = dict(os.environ, MTPLIB_UPSTREAM="patched", GGML_RPC_PEER_CONNECT_TIMEOUT="soon",
               GGML_RPC_PEER_TIMEOUT="-1")
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    ep = f"127.0.0.1:{closed.getsockname()[1]}"
    closed.close()  # nothing listens there: refused
    with _VerboseShards(1, env=env, cwd=REPO, start_timeout_s=60) as sh:
        c = Client(sh.endpoints[0])
        t0 = time.monotonic()
        assert _peer_connect(c, 1, ep) == 0
        assert time.monotonic() - t0 < 1.5
        link, s = Links(c, sh.endpoints[0]).open()  # the first wait reads the peer timeout
        s.close()
        c.wait(link, 1, c.tensor(0, 16))
        assert wait_closed(c.s, 5) < 1.5  # the lost peer fails the wait at once
        log = sh.log_path(0).read_text()
        assert _alive(sh)
    for line in (f"link 1: cannot connect to {ep}",
                 "GGML_RPC_PEER_CONNECT_TIMEOUT=soon: expected seconds in (0, 1e6), using 10",
                 "GGML_RPC_PEER_TIMEOUT=-1: expected seconds in (0, 1e6), using 300"):
        assert line in log, (line, log[-2000:])


@needs_ring
@pytest.mark.slow
def test_a_generation_whose_peer_drops_syns_runs_that_pair_on_the_star(monkeypatch):
    """GGML_RPC_SEAM=ring on plan 0-1,2-3 with shard 1's peer address dropping SYNs
    (GGML_RPC_PEER_ENDPOINTS points shard 0 at a black hole) and
    GGML_RPC_PEER_CONNECT_TIMEOUT=2 on the shards: the pair falls back to the star, the
    run costs about those 2 s more than the star's and gives the star's tokens and waits.
    Without the connect timeout the first step would have waited for the OS's connect
    (about 127 s on Linux, SYN retries) before the pair fell back."""
    import mtplib.distributed.client as client_mod

    p = trained_paths()
    opts = EngineOptions(k=0, settings=DecodeSettings(n_ctx=256, n_threads=1))
    env = dict(os.environ, MTPLIB_UPSTREAM="patched",
               GGML_RPC_PEER_CONNECT_TIMEOUT=str(CONNECT_TIMEOUT_S))
    real_spawn = client_mod.spawn_child
    real_start = client_mod.RangedRuntime._start_worker
    with _blackhole() as hole, _VerboseShards(2, env=env, cwd=REPO, start_timeout_s=60) as sh:

        def start(rt) -> None:  # the client worker: shard 1's peer endpoint is the hole
            def spawn(argv, **kw):
                kw["env"] = dict(kw["env"],
                                 GGML_RPC_PEER_ENDPOINTS=f"{rt.client_endpoints[1]}={hole}")
                return real_spawn(argv, **kw)

            monkeypatch.setattr(client_mod, "spawn_child", spawn)
            try:
                real_start(rt)
            finally:
                monkeypatch.setattr(client_mod, "spawn_child", real_spawn)

        out = {}
        for seam in ("star", "ring"):
            if seam == "ring":
                monkeypatch.setattr(client_mod.RangedRuntime, "_start_worker", start)
            t0 = time.monotonic()
            with RangedMTP(str(p.trunk), plan="0-1,2-3", endpoints=sh.endpoints,
                           seam=seam) as r:
                toks, m = r.generate(PROMPT, N_NEW, opts)
            out[seam] = (toks, m, time.monotonic() - t0)
        log = sh.log_path(0).read_text()
    (star, star_m, star_s), (ring, ring_m, ring_s) = out["star"], out["ring"]
    assert ring == star
    why = "the source could not connect to the destination"
    assert [(x["seam"], x["why"]) for x in ring_m.seam["links"]] == [("star", why)]
    assert [(x["seam"], x["why"]) for x in ring_m.seam["pairs"]] == [("star", why)]
    assert ring_m.waits_per_step["decode"] == star_m.waits_per_step["decode"] == 2
    assert f"no connection to {hole} within 2 s (GGML_RPC_PEER_CONNECT_TIMEOUT)" in log
    assert ring_s - star_s < CONNECT_TIMEOUT_S + 8, (ring_s, star_s)
