"""Mutual TLS for shards: the quick-start PKI, the CLI options, the relay's TLS side and the
client's defences against hostile or broken shards (checked answers, a shard given twice).

Everything listens and connects on 127.0.0.1 only.
"""

from __future__ import annotations

import json
import os
import random
import socket
import stat
import struct
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from rpc_fakes import (
    FakeShard,
    bad_sessions,
    corpus,
    reply,
    request,
    send_and_time_close,
)

from mtplib.distributed.gateway import Gateway
from mtplib.distributed.probe import check_distinct, probe_shards
from mtplib.distributed.processes import LocalShards
from mtplib.distributed.relay import CountingRelay
from mtplib.distributed.tls import TlsConfig, connect, init_pki
from mtplib.errors import InputError, WouldOverwrite
from mtplib.ownership.plan import PlanError
from mtplib.runtime.rpc import (
    RPC_CMD_HELLO,
    RPC_DEVICE_COUNT,
    RPC_GET_ALIGNMENT,
    RPC_GET_DEVICE_MEMORY,
    RPC_GET_MAX_SIZE,
    ShardError,
    client_proto_minor,
    probe,
    recv_exact,
)

REPO = Path(__file__).resolve().parents[1]
CLI = [sys.executable, "-m", "mtplib.cli"]


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> TlsConfig:
    d = tmp_path_factory.mktemp("pki")
    init_pki(d, ["127.0.0.1", "myshard.example"])
    return TlsConfig.load(d)


# -- the PKI ----------------------------------------------------------------------------
def test_tls_init_writes_a_ca_and_both_sides_and_never_overwrites(tmp_path):
    r = subprocess.run([*CLI, "tls", "init", str(tmp_path / "pki"), "--host", "127.0.0.1",
                        "--host", "myshard.example", "--json"], capture_output=True, text=True,
                       timeout=60, cwd=REPO)
    assert r.returncode == 0, r.stderr
    files = json.loads(r.stdout)["files"]
    assert set(files) == {"ca.pem", "ca.key", "shard.pem", "shard.key", "client.pem",
                          "client.key"}
    for name, path in files.items():
        mode = stat.S_IMODE(os.stat(path).st_mode)
        assert (mode & 0o077 == 0) if name.endswith(".key") else True, (name, oct(mode))
    from cryptography import x509

    cert = x509.load_pem_x509_certificate(Path(files["shard.pem"]).read_bytes())
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert [str(i) for i in san.get_values_for_type(x509.IPAddress)] == ["127.0.0.1"]
    assert san.get_values_for_type(x509.DNSName) == ["myshard.example"]
    before = {n: Path(p).read_bytes() for n, p in files.items()}
    r = subprocess.run([*CLI, "tls", "init", str(tmp_path / "pki")], capture_output=True,
                       text=True, timeout=60, cwd=REPO)
    assert r.returncode == 2 and "exist already" in r.stderr and r.stderr.count("\n") == 1
    assert {n: Path(p).read_bytes() for n, p in files.items()} == before
    with pytest.raises(WouldOverwrite):
        init_pki(tmp_path / "pki")


def test_tls_config_names_what_is_missing(tmp_path, pki):
    with pytest.raises(InputError, match="not a directory"):
        TlsConfig.load(tmp_path / "nope")
    (tmp_path / "half").mkdir()
    for n in ("ca.pem", "client.pem", "client.key"):  # a client host's directory
        (tmp_path / "half" / n).write_bytes((pki.dir / n).read_bytes())
    half = TlsConfig.load(tmp_path / "half")
    half.client_context()
    with pytest.raises(InputError, match=r"missing shard\.pem, shard\.key"):
        half.server_context()
    (tmp_path / "half" / "client.key").write_bytes((pki.dir / "shard.key").read_bytes())
    with pytest.raises(InputError, match="cannot use"):
        half.client_context()


def test_the_client_checks_the_shards_address_against_its_certificate(tmp_path):
    init_pki(tmp_path, ["127.0.0.2"])  # the shard's certificate names another address
    cfg = TlsConfig.load(tmp_path)
    with FakeShard() as fake, Gateway(("127.0.0.1", 0), fake.addr, cfg,
                                      log=lambda s: None) as gw:
        host, port = gw.endpoint.split(":")
        with pytest.raises(ShardError, match="does not verify"):
            connect((host, int(port)), cfg)
        assert fake.n_connections == 0


# -- hostile or broken shards -------------------------------------------------------------
HOSTILE = [
    (RPC_DEVICE_COUNT, reply(struct.pack("<I", 67_000_000)), "67000000 devices"),
    (RPC_DEVICE_COUNT, reply(struct.pack("<I", 0)), "0 devices"),
    (RPC_CMD_HELLO, reply(bytes([9, 0, 0, 0]) + bytes(24)), "protocol 9.0.0"),
    (RPC_CMD_HELLO, reply(bytes([7, 0, 0, 0]) + b"\x01" + bytes(23)), "transport upgrade"),
    (RPC_CMD_HELLO, struct.pack("<Q", 1 << 40), "reply of 1099511627776 bytes"),
    (RPC_GET_ALIGNMENT, reply(struct.pack("<Q", 0)), "alignment 0"),
    (RPC_GET_ALIGNMENT, reply(struct.pack("<Q", 48)), "alignment 48"),
    (RPC_GET_MAX_SIZE, reply(struct.pack("<Q", 0)), "maximum buffer size of 0"),
    (RPC_GET_DEVICE_MEMORY, reply(struct.pack("<QQ", 5, 4)), "free 5 of total 4"),
    (RPC_GET_DEVICE_MEMORY, reply(struct.pack("<QQ", 0, 1 << 62)), "total 4611686018427387904"),
]


@pytest.mark.parametrize("cmd,answer,msg", HOSTILE, ids=[h[2] for h in HOSTILE])
def test_probe_refuses_absurd_handshake_answers_at_once(cmd, answer, msg):
    with FakeShard(lambda i, c, p: answer if c == cmd else None) as fake:
        t0 = time.monotonic()
        with pytest.raises(ShardError, match=msg):
            probe_shards([fake.endpoint], timeout_s=2)
        assert time.monotonic() - t0 < 2.5


def test_probe_bounds_a_slow_or_silent_shard():
    def drip(i, cmd, payload):
        time.sleep(5)  # never answers in time
        return None

    with FakeShard(drip) as fake:
        t0 = time.monotonic()
        with pytest.raises(ShardError, match="did not answer the handshake within 1"):
            probe_shards([fake.endpoint], timeout_s=1)
        assert time.monotonic() - t0 < 2


def test_the_relay_never_forwards_a_bad_reply():
    """A shard that answers the probe sanely and lies later: the relay checks every reply
    before upstream's client could read it, closes, and keeps the reason."""
    bad = reply(struct.pack("<I", 67_000_000))
    with FakeShard(lambda i, c, p: bad if c == RPC_DEVICE_COUNT else None) as fake, \
            CountingRelay(fake.endpoint) as r:
        host, port = r.endpoint.split(":")
        with socket.create_connection((host, int(port)), timeout=5) as s:
            s.sendall(request(RPC_CMD_HELLO, bytes(24)))
            assert len(recv_exact(s, 36)) == 36  # a sane HELLO passes
            s.sendall(request(RPC_DEVICE_COUNT))
            s.settimeout(5)
            assert s.recv(100) == b""  # closed, none of the bad reply forwarded
        assert "67000000 devices" in r.violation
        assert [e["event"] for e in r.events][-2:] == ["malformed_reply", "closed"] or \
            "malformed_reply" in [e["event"] for e in r.events]


def test_the_relay_refuses_a_reply_nobody_asked_for():
    with FakeShard(lambda i, c, p: reply(bytes(4)) * 2 if c == RPC_DEVICE_COUNT else None
                   ) as fake, CountingRelay(fake.endpoint) as r:
        host, port = r.endpoint.split(":")
        with socket.create_connection((host, int(port)), timeout=5) as s:
            s.sendall(request(RPC_CMD_HELLO, bytes(24)) + request(RPC_DEVICE_COUNT))
            s.settimeout(5)
            got = b""
            while chunk := s.recv(1000):
                got += chunk
        assert len(got) < 36 + 12 * 2
        assert "nobody asked for" in r.violation or "0 devices" in r.violation


def test_the_same_shard_twice_is_named_within_seconds(pki):
    with FakeShard() as fake:
        ep = fake.endpoint
        host, port = ep.split(":")
        with pytest.raises(PlanError, match="same shard"):
            check_distinct([ep, f"{host}:0{port}"])
        # the same shard behind two relays (plain): the second probe is not answered while
        # the first probe's connection is open
        with CountingRelay(ep, check_replies=False) as r1, \
                CountingRelay(ep, check_replies=False) as r2:
            t0 = time.monotonic()
            with pytest.raises(ShardError, match=f"may be {r1.endpoint}"):
                probe_shards([r1.endpoint, r2.endpoint], timeout_s=2)
            assert time.monotonic() - t0 < 4
        # behind a gateway, reached through two forwarders: named by its instance id at once
        with Gateway(("127.0.0.1", 0), fake.addr, pki, log=lambda s: None) as gw, \
                CountingRelay(gw.endpoint, check_replies=False) as f1, \
                CountingRelay(gw.endpoint, check_replies=False) as f2:
            init_pki_dir = pki  # the forwarders' addresses are 127.0.0.1: the SAN matches
            t0 = time.monotonic()
            with pytest.raises(PlanError, match=f"same shard \\(gateway instance {gw.instance}"):
                probe_shards([f1.endpoint, f2.endpoint], tls=init_pki_dir, timeout_s=2)
            assert time.monotonic() - t0 < 2


def test_generate_refuses_remote_endpoints_without_tls_and_names_the_options(pair):
    r = subprocess.run([*CLI, "generate", "--model", str(pair.trunk), "--tokens", "1,2",
                        "--plan", "0-1,2-3", "--endpoints", "192.0.2.1:5000,192.0.2.2:5000"],
                       capture_output=True, text=True, timeout=60, cwd=REPO)
    assert r.returncode == 2
    assert "--tls DIR" in r.stderr and "--insecure-plaintext" in r.stderr
    assert "--allow-remote" not in r.stderr
    r = subprocess.run([*CLI, "generate", "--model", str(pair.trunk), "--tokens", "1,2",
                        "--tls", "/nonexistent-dir"], capture_output=True, text=True,
                       timeout=60, cwd=REPO)
    assert r.returncode == 2 and "need --plan" in r.stderr


def test_shard_serve_needs_tls_or_the_loud_opt_in_beyond_loopback(pki):
    run = [*CLI, "shard", "serve", "--endpoint"]
    r = subprocess.run([*run, "192.0.2.1:50052"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "--tls DIR" in r.stderr
    r = subprocess.run([*run, "192.0.2.1:50052", "--allow-remote"], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 2 and "--allow-remote is gone" in r.stderr
    r = subprocess.run([*run, "127.0.0.1:50052", "--tls", str(pki.dir),
                        "--insecure-plaintext"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "contradict" in r.stderr


# -- a real shard behind its gateway ------------------------------------------------------
def test_local_tls_shards_serve_only_authenticated_clients(pki):
    """`shard serve --tls` on 127.0.0.1: the public port speaks TLS only (a plain probe gets
    nothing), the client's TLS probe is answered by upstream, and after a corpus of
    strangers' streams and malformed authenticated sessions the shard still serves."""
    with LocalShards(1, tls=pki) as sh:
        ep = sh.endpoints[0]
        host, port = ep.split(":")
        info = probe_shards([ep], tls=pki)[0]
        assert info.version == (7, client_proto_minor(), 0) and info.n_devices == 1
        with pytest.raises(ShardError):
            probe(ep, timeout_s=4)  # plain RPC to the public port: never answered
        with ThreadPoolExecutor(16) as ex:
            times = list(ex.map(lambda d: send_and_time_close((host, int(port)), d),
                                corpus()))
        assert max(times) < 5.0
        for data in bad_sessions(random.Random(3))[:25]:  # the fixed ones: each cut
            end = time.monotonic() + 5
            while True:
                stream, st = connect((host, int(port)), pki)
                if st.ready:
                    break
                stream.close()
                assert time.monotonic() < end
                time.sleep(0.05)
            with stream:
                try:
                    stream.sendall(data)
                    stream.settimeout(6)
                    while stream.recv(65536):
                        pass
                except OSError:
                    pass
        assert sh.alive() == [True]
        assert probe_shards([ep], tls=pki, timeout_s=5)[0].n_devices == 1


def test_a_shard_lying_to_upstreams_client_is_named_not_a_19_gb_worker(pair):
    """The shard answers the probes sanely, then tells upstream's client it has 67 million
    devices: the relay cuts that reply off, the worker (not this process) ends, and the
    error names the shard and the reply within seconds."""
    from mtplib.distributed.client import RangedRuntime, ShardLostError

    bad = reply(struct.pack("<I", 67_000_000))
    with FakeShard(lambda i, c, p: bad if i >= 2 and c == RPC_DEVICE_COUNT else None) as fake:
        t0 = time.monotonic()
        with pytest.raises(ShardError, match="sent a malformed reply: reports 67000000 "
                           "devices") as ei:
            RangedRuntime(pair.trunk, "0-3", [fake.endpoint], load_timeout_s=30)
        assert time.monotonic() - t0 < 20
        assert isinstance(ei.value, ShardLostError) or "during open" in str(ei.value)
        assert fake.n_connections == 3


def _gen(pair, *extra) -> dict:
    r = subprocess.run([*CLI, "generate", "--model", str(pair.trunk), "--tokens", "1,2,3,4",
                        "--n", "6", "--plan", "0-1,2-3", "--json", *extra],
                       capture_output=True, text=True, timeout=300, cwd=REPO)
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout)


def test_generate_through_tls_equals_plaintext(pair, pki):
    """Local shards behind their gateways (`shard serve --tls`), the relays speaking TLS:
    the same tokens and the same waits per step as in plaintext on the same seam (both ask
    for the star). With TLS the default seam (auto) is the ring where this build speaks RPC
    7.2 (the gateways carry the peer links in mutual TLS: tests/test_tls_ring.py), and the
    result says so per pair."""
    plain = _gen(pair, "--seam", "star")
    secure = _gen(pair, "--tls", str(pki.dir), "--seam", "star")
    assert secure["tokens"] == plain["tokens"]
    assert secure["metrics"]["waits_per_step"] == plain["metrics"]["waits_per_step"]
    from mtplib.runtime.rpc import client_proto_minor

    auto = _gen(pair, "--tls", str(pki.dir))
    assert auto["tokens"] == plain["tokens"]
    seam = auto["metrics"]["seam"]
    if client_proto_minor() >= 2:
        assert (seam["requested"], seam["seam"]) == ("auto", "ring")
        assert [p["seam"] for p in seam["pairs"]] == ["ring"]
    else:
        why = f"this upstream build speaks RPC 7.{client_proto_minor()} (the ring is " \
            "patches/0007, 7.2)"
        assert (seam["requested"], seam["seam"], seam["why"]) == ("auto", "star", why)
        assert [(p["seam"], p["why"]) for p in seam["pairs"]] == [("star", why)]
    assert secure["metrics"]["transport"] == "tls" and plain["metrics"]["transport"] == \
        "plaintext"


def test_generate_connects_to_running_tls_shards(pair, pki):
    with LocalShards(2, tls=pki) as sh:
        out = _gen(pair, "--endpoints", ",".join(sh.endpoints), "--tls", str(pki.dir))
        assert out["metrics"]["endpoints"] == sh.endpoints
        # the same shard twice: named at once, not a 602 s hang
        ep = sh.endpoints[0]
        r = subprocess.run([*CLI, "generate", "--model", str(pair.trunk), "--tokens", "1,2",
                            "--plan", "0-1,2-3", "--endpoints", f"{ep},{ep}", "--tls",
                            str(pki.dir)], capture_output=True, text=True, timeout=60,
                           cwd=REPO)
        assert r.returncode == 2 and "same shard" in r.stderr, r.stderr
        # plaintext RPC to a TLS shard: a clear error, not an abort
        r = subprocess.run([*CLI, "generate", "--model", str(pair.trunk), "--tokens", "1,2",
                            "--plan", "0-3", "--endpoints", ep], capture_output=True,
                           text=True, timeout=60, cwd=REPO)
        assert r.returncode == 2 and ep in r.stderr, r.stderr
        assert sh.alive() == [True, True]


def test_a_lanes_bench_tls_is_checked_before_anything_runs(tmp_path, pki):
    from mtplib.lab.bench.config import BenchConfig, BenchConfigError

    cfg = BenchConfig.from_dict({"plans": ["0-1,2-3"], "tls": str(pki.dir)}, threads=1)
    assert cfg.tls_config().dir == pki.dir
    with pytest.raises(BenchConfigError, match="bench: tls: .*not a directory"):
        BenchConfig.from_dict({"plans": ["0-1,2-3"], "tls": str(tmp_path / "nope")})
    (tmp_path / "client-only").mkdir()
    (tmp_path / "client-only" / "ca.pem").write_bytes((pki.dir / "ca.pem").read_bytes())
    with pytest.raises(BenchConfigError, match=r"missing shard\.pem"):
        BenchConfig.from_dict({"plans": ["0-1,2-3"], "tls": str(tmp_path / "client-only")})
    r = subprocess.run([*CLI, "bench", "--tls", str(tmp_path / "nope"), "--out",
                        str(tmp_path / "b"), "--quiet"], capture_output=True, text=True,
                       timeout=120, cwd=REPO)
    assert r.returncode == 2 and "bench: tls:" in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "b").exists()


def test_a_tls_shard_lost_mid_session_is_named(pair, pki):
    """The shard process dies behind its gateway: the relay's TLS side sees the close, the
    session fails with the shard named, within seconds."""
    from mtplib.distributed.client import RangedRuntime, ShardLostError
    from mtplib.runtime.generate import greedy, prefill
    from mtplib.runtime.model import ContextConfig

    cfg = ContextConfig(n_ctx=64, n_batch=64, n_ubatch=64)
    with LocalShards(2, tls=pki) as sh, \
            RangedRuntime(pair.trunk, "0-1,2-3", shards=sh, tls=pki) as rt:
        ctx = rt.context(cfg)
        want = greedy(ctx, [1, 2, 3, 4], 3).tokens
        assert len(want) == 3
        ctx.clear()
        prefill(ctx, [1, 2, 3, 4])
        sh.kill(1)
        t0 = time.monotonic()
        with pytest.raises(ShardLostError, match=f"shard 1 \\({sh.endpoints[1]}\\)"):
            for i in range(20):
                ctx.decode([5], [4 + i], logits=True)
        assert time.monotonic() - t0 < 10
