"""Mutual TLS for shard connections: the files, the contexts, a thread-safe stream.

A TLS directory (``--tls DIR``) holds PEM files under fixed names (`TlsConfig`):

- ``ca.pem``: the CA certificate(s) both sides verify the peer against;
- ``shard.pem`` / ``shard.key``: the shard's certificate (SANs: the addresses clients dial)
  and key, needed where a shard serves (`mtplib shard serve --tls DIR`); `init_pki` makes
  it valid as a TLS client certificate too (extended key usage serverAuth and clientAuth),
  so that a shard's gateway presents it when it opens a peer link to another shard's
  gateway (the ring, patches/0007: `mtplib.distributed.gateway`);
- ``client.pem`` / ``client.key``: the client's certificate and key, needed where a client
  connects (`mtplib generate --tls DIR`, bench, lanes);
- ``ca.key``: written by `init_pki` only, to issue more certificates; no command reads it.

`init_pki` (`mtplib tls init DIR`) makes all of them with `cryptography`; any other PKI works
when it puts the same files under the same names. TLS 1.3 only, certificates checked both
ways: the shard against the endpoint's IP address (its certificate must carry it as an IP
SAN), the client against ``ca.pem`` (client-certificate authentication).

`TlsStream` is one TLS connection that one thread may read while another writes, as the
relays pump sockets. `ssl.SSLSocket` cannot promise that (OpenSSL forbids using one SSL
object from two threads at once), so the TLS state is an `ssl.SSLObject` over memory BIOs
behind a lock, and the raw socket does the I/O.

After the TLS handshake the gateway sends one status line (`GATEWAY_READY` or
`GATEWAY_BUSY`, then the gateway's instance id, and on a ready line the gateway's features,
words starting with "+": `GATEWAY_PEER`, it carries peer links), so that a client tells
"busy" and "the same shard twice" apart from a broken shard before upstream's client sends
a byte. A peer link (ALPN `PEER_ALPN`) and a report request (ALPN
`mtplib.distributed.report_wire.REPORT_ALPN`: the shard's report of its build, asked as in
plaintext) get no status line.
"""

from __future__ import annotations

import contextlib
import datetime
import ipaddress
import os
import socket
import ssl
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from mtplib.errors import InputError, WouldOverwrite
from mtplib.runtime.rpc import ShardError
from mtplib.runtime.tls_config import (  # noqa: F401 - their old home
    CA,
    CA_KEY,
    CLIENT_CERT,
    CLIENT_KEY,
    PEER_ALPN,
    SHARD_CERT,
    SHARD_KEY,
    TlsConfig,
)

#: the gateway's status line after the TLS handshake: b"mtplib-gateway 1 ready <id>\n"
GATEWAY_MAGIC = b"mtplib-gateway 1 "
GATEWAY_READY, GATEWAY_BUSY = b"ready", b"busy"
#: the feature word of a gateway that carries peer links both ways (dials other shards'
#: gateways with its shard certificate, admits theirs next to its client)
GATEWAY_PEER = "+peer"
STATUS_MAX = 512
RECV_CHUNK = 1 << 20
#: a gateway still closing the previous session (e.g. a probe's) says busy for a moment
BUSY_RETRY_S = 3.0


class TlsStream:
    """A TLS connection over a connected socket, safe for one reader and one writer thread
    at once; ``recv``/``sendall``/``settimeout``/``shutdown``/``close``/``fileno`` like a
    socket. ``pending()``: decrypted or undecrypted bytes already here (the relay's
    quiesce must not call that calm)."""

    def __init__(self, sock: socket.socket, ctx: ssl.SSLContext, *, server_side: bool,
                 server_hostname: str | None = None) -> None:
        self.sock = sock
        self._in, self._out = ssl.MemoryBIO(), ssl.MemoryBIO()
        self._obj = ctx.wrap_bio(self._in, self._out, server_side=server_side,
                                 server_hostname=server_hostname)
        self._lock = threading.Lock()  # the SSL object and its BIOs
        self._send_lock = threading.Lock()  # the order of TLS bytes on the raw socket
        self._eof = False

    def handshake(self, timeout_s: float) -> None:
        """The TLS handshake within ``timeout_s`` (TimeoutError), else ssl.SSLError /
        ConnectionError; on the server side a client without a valid certificate fails."""
        deadline = time.monotonic() + timeout_s
        while True:
            failed: ssl.SSLError | None = None
            with self._lock:
                try:
                    self._obj.do_handshake()
                    done = True
                except ssl.SSLWantReadError:
                    done = False
                except ssl.SSLError as e:
                    failed = e
            if failed is not None:  # send the alert, so the peer learns why
                with contextlib.suppress(OSError):
                    self._flush()
                raise failed
            self._flush()
            if done:
                self.sock.settimeout(None)
                return
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("TLS handshake deadline")
            self.sock.settimeout(left)
            data = self.sock.recv(65536)
            if not data:
                raise ConnectionError("closed during the TLS handshake")
            with self._lock:
                self._in.write(data)

    def _flush(self) -> None:
        with self._send_lock:
            with self._lock:
                out = self._out.read()
            if out:
                self.sock.sendall(out)

    def _read_plain(self, n: int) -> bytes | None:
        """Decrypted bytes already available (up to n), b"" at a TLS close, None if none."""
        chunks, total = [], 0
        with self._lock:
            try:
                while total < n:
                    d = self._obj.read(n - total)
                    if not d:
                        self._eof = True
                        break
                    chunks.append(d)
                    total += len(d)
            except ssl.SSLWantReadError:
                pass
            except (ssl.SSLZeroReturnError, ssl.SSLEOFError):
                self._eof = True
        if chunks:
            return b"".join(chunks)
        return b"" if self._eof else None

    def recv(self, n: int) -> bytes:
        while True:
            data = self._read_plain(n)
            if self._out.pending:
                self._flush()
            if data is not None:
                return data
            raw = self.sock.recv(RECV_CHUNK)
            with self._lock:
                if raw:
                    self._in.write(raw)
                else:
                    self._in.write_eof()

    def sendall(self, data: bytes) -> None:
        with self._send_lock:
            with self._lock:
                self._obj.write(data)
                out = self._out.read()
            self.sock.sendall(out)

    def pending(self) -> bool:
        with self._lock:
            return bool(self._in.pending or self._obj.pending())

    def peer_certificate(self) -> dict:
        return self._obj.getpeercert() or {}

    def peer_certificate_der(self) -> bytes:
        return self._obj.getpeercert(binary_form=True) or b""

    def alpn(self) -> str | None:
        """The ALPN protocol the handshake settled (None: none)."""
        return self._obj.selected_alpn_protocol()

    def settimeout(self, t: float | None) -> None:
        self.sock.settimeout(t)

    def setsockopt(self, *args) -> None:
        self.sock.setsockopt(*args)

    def fileno(self) -> int:
        return self.sock.fileno()

    def shutdown(self, how: int) -> None:
        self.sock.shutdown(how)

    def close(self) -> None:
        self.sock.close()

    def __enter__(self) -> TlsStream:
        return self

    def __exit__(self, *exc) -> None:
        with contextlib.suppress(OSError):
            self.close()


@dataclass(frozen=True)
class GatewayStatus:
    ready: bool
    instance: str
    #: the gateway's feature words (e.g. `GATEWAY_PEER`); empty for an older gateway
    features: frozenset[str] = frozenset()


def read_status(stream: TlsStream, endpoint: str, timeout_s: float) -> GatewayStatus:
    """The gateway's status line (bounded, within ``timeout_s``); ShardError otherwise."""
    deadline = time.monotonic() + timeout_s
    buf = b""
    try:
        while not buf.endswith(b"\n"):
            left = deadline - time.monotonic()
            if left <= 0 or len(buf) > STATUS_MAX:
                raise ShardError(f"shard {endpoint}: no gateway status line (not an mtplib "
                                 "TLS shard?)")
            stream.settimeout(left)
            chunk = stream.recv(STATUS_MAX + 1 - len(buf))
            if not chunk:
                raise ShardError(f"shard {endpoint} closed the TLS connection before its "
                                 "status line (did it refuse this client's certificate?)")
            buf += chunk
    except ssl.SSLError as e:
        raise ShardError(f"shard {endpoint} refused this client's certificate or the TLS "
                         f"session ({e.reason or e})") from None
    except TimeoutError:
        raise ShardError(f"shard {endpoint}: no gateway status line within {timeout_s} s"
                         ) from None
    finally:
        with contextlib.suppress(OSError):
            stream.settimeout(None)
    parts = buf[len(GATEWAY_MAGIC):].split()
    words = [w.decode("ascii", "replace") for w in parts[2:]]
    features = frozenset(words)
    if not buf.startswith(GATEWAY_MAGIC) or len(parts) < 2 or len(words) > 8 \
            or not all(w.startswith("+") for w in words) \
            or parts[0] not in (GATEWAY_READY, GATEWAY_BUSY):
        raise ShardError(f"shard {endpoint}: unexpected gateway status {buf[:STATUS_MAX]!r}")
    return GatewayStatus(parts[0] == GATEWAY_READY, parts[1].decode("ascii", "replace"),
                         features)


def connect(addr: tuple[str, int], tls: TlsConfig, *, timeout_s: float = 5.0,
            ctx: ssl.SSLContext | None = None) -> tuple[TlsStream, GatewayStatus]:
    """A verified TLS connection to the gateway at ``addr`` and its status line; the
    caller closes it (also when the status says busy). ShardError on any failure."""
    stream = open_tls(addr, tls, timeout_s=timeout_s, ctx=ctx)
    try:
        return stream, read_status(stream, f"{addr[0]}:{addr[1]}", timeout_s)
    except BaseException:
        with contextlib.suppress(OSError):
            stream.close()
        raise


def open_tls(addr: tuple[str, int], tls: TlsConfig, *, timeout_s: float = 5.0,
             ctx: ssl.SSLContext | None = None) -> TlsStream:
    """A verified TLS connection to the gateway at ``addr`` (``ctx``: the client's
    context, by default `TlsConfig.client_context`), nothing read yet; ShardError naming
    the shard on any failure."""
    endpoint = f"{addr[0]}:{addr[1]}"
    ctx = ctx or tls.client_context()
    try:
        sock = socket.create_connection(addr, timeout=timeout_s)
    except OSError as e:
        raise ShardError(f"shard {endpoint} unreachable: {e.strerror or e}") from None
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    stream = TlsStream(sock, ctx, server_side=False, server_hostname=addr[0])
    try:
        try:
            stream.handshake(timeout_s)
        except ssl.SSLCertVerificationError as e:
            raise ShardError(f"shard {endpoint}: its certificate does not verify against "
                             f"{tls.dir / CA} for {addr[0]} ({e.verify_message})") from None
        except ssl.SSLError as e:
            raise ShardError(f"shard {endpoint}: TLS handshake failed ({e.reason or e}); "
                             "is it an mtplib TLS shard (shard serve --tls)?") from None
        except TimeoutError:
            raise ShardError(f"shard {endpoint}: no TLS handshake within {timeout_s} s"
                             ) from None
        except OSError as e:
            raise ShardError(f"shard {endpoint}: connection lost during the TLS handshake "
                             f"({e.strerror or e}); is it an mtplib TLS shard?") from None
        return stream
    except BaseException:
        with contextlib.suppress(OSError):
            stream.close()
        raise


def connect_ready(addr: tuple[str, int], tls: TlsConfig, *, timeout_s: float = 5.0,
                  ctx: ssl.SSLContext | None = None, retry_s: float = BUSY_RETRY_S,
                  on_busy=None) -> tuple[TlsStream, str]:
    """`connect` until the gateway says ready (retrying "busy" for ``retry_s``); returns the
    stream and the gateway's instance id. ``on_busy(instance)`` may raise on a busy
    answer (e.g. when that instance is one the caller already holds)."""
    stream, status = connect_ready_status(addr, tls, timeout_s=timeout_s, ctx=ctx,
                                          retry_s=retry_s, on_busy=on_busy)
    return stream, status.instance


def connect_ready_status(addr: tuple[str, int], tls: TlsConfig, *, timeout_s: float = 5.0,
                         ctx: ssl.SSLContext | None = None, retry_s: float = BUSY_RETRY_S,
                         on_busy=None) -> tuple[TlsStream, GatewayStatus]:
    """`connect_ready`, returning the whole ready status (with the shard's report)."""
    end = time.monotonic() + retry_s
    endpoint = f"{addr[0]}:{addr[1]}"
    while True:
        stream, status = connect(addr, tls, timeout_s=timeout_s, ctx=ctx)
        if status.ready:
            return stream, status
        with contextlib.suppress(OSError):
            stream.close()
        if on_busy is not None:
            on_busy(status.instance)
        if time.monotonic() > end:
            raise ShardError(f"shard {endpoint} is busy with another client (its gateway "
                             "serves one at a time)")
        time.sleep(0.05)


# -- a quick-start PKI ------------------------------------------------------------------
def _san(hosts: list[str]):
    from cryptography import x509

    names = []
    for h in hosts:
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(h)))
        except ValueError:
            names.append(x509.DNSName(h))
    return x509.SubjectAlternativeName(names)


def init_pki(out: str | os.PathLike, hosts: list[str] | None = None, *,
             days: int = 365) -> dict[str, str]:
    """Write a CA and a shard and a client certificate (ECDSA P-256) into ``out`` under the
    names of the module doc; the shard's SANs are ``hosts`` (default 127.0.0.1 and
    localhost), its extended key usage serverAuth and clientAuth (its gateway serves clients
    and dials other shards' gateways for peer links); the client's clientAuth only.
    Refuses to replace any existing file; keys are written mode 0600."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    hosts = list(hosts or ["127.0.0.1", "localhost"])
    for h in hosts:
        if not h or len(h) > 253 or any(c.isspace() for c in h):
            raise InputError(f"--host {h!r}: give an IP address or a DNS name")
    if not 1 <= days <= 3650:
        raise InputError(f"--days must be in 1..3650, got {days}")
    d = Path(out)
    names = [CA, CA_KEY, SHARD_CERT, SHARD_KEY, CLIENT_CERT, CLIENT_KEY]
    taken = [n for n in names if (d / n).exists()]
    if taken:
        raise WouldOverwrite(f"{d}: {', '.join(taken)} exist already; nothing was written "
                             "(choose an empty directory)")
    now = datetime.datetime.now(datetime.UTC)
    start, end = now - datetime.timedelta(minutes=5), now + datetime.timedelta(days=days)

    def name(cn: str) -> x509.Name:
        return x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "mtplib"),
                          x509.NameAttribute(NameOID.COMMON_NAME, cn)])

    def builder(subject, issuer, key) -> x509.CertificateBuilder:
        return (x509.CertificateBuilder().subject_name(subject).issuer_name(issuer)
                .public_key(key.public_key()).serial_number(x509.random_serial_number())
                .not_valid_before(start).not_valid_after(end)
                .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()),
                               critical=False))

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = name("mtplib shard CA")
    ca = (builder(ca_name, ca_name, ca_key)
          .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
          .add_extension(x509.KeyUsage(digital_signature=False, content_commitment=False,
                                       key_encipherment=False, data_encipherment=False,
                                       key_agreement=False, key_cert_sign=True, crl_sign=True,
                                       encipher_only=False, decipher_only=False), critical=True)
          .sign(ca_key, hashes.SHA256()))
    aki = x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key())
    leaf_usage = x509.KeyUsage(digital_signature=True, content_commitment=False,
                               key_encipherment=False, data_encipherment=False,
                               key_agreement=False, key_cert_sign=False, crl_sign=False,
                               encipher_only=False, decipher_only=False)

    def leaf(cn: str, usage, san=None):
        key = ec.generate_private_key(ec.SECP256R1())
        b = (builder(name(cn), ca_name, key)
             .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
             .add_extension(leaf_usage, critical=True)
             .add_extension(x509.ExtendedKeyUsage(usage), critical=False)
             .add_extension(aki, critical=False))
        if san is not None:
            b = b.add_extension(san, critical=False)
        return key, b.sign(ca_key, hashes.SHA256())

    shard_key, shard = leaf("mtplib shard", [ExtendedKeyUsageOID.SERVER_AUTH,
                                             ExtendedKeyUsageOID.CLIENT_AUTH], _san(hosts))
    client_key, client = leaf("mtplib client", [ExtendedKeyUsageOID.CLIENT_AUTH])

    def pem_key(k) -> bytes:
        return k.private_bytes(serialization.Encoding.PEM,
                               serialization.PrivateFormat.PKCS8,
                               serialization.NoEncryption())

    def pem(c) -> bytes:
        return c.public_bytes(serialization.Encoding.PEM)

    files = {CA: (pem(ca), 0o644), CA_KEY: (pem_key(ca_key), 0o600),
             SHARD_CERT: (pem(shard), 0o644), SHARD_KEY: (pem_key(shard_key), 0o600),
             CLIENT_CERT: (pem(client), 0o644), CLIENT_KEY: (pem_key(client_key), 0o600)}
    written: list[Path] = []
    try:
        d.mkdir(parents=True, exist_ok=True)
        for n, (data, mode) in files.items():
            fd = os.open(d / n, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
            written.append(d / n)
            with os.fdopen(fd, "wb") as f:
                f.write(data)
    except OSError as e:  # nothing half-made is left behind
        for p in written:
            with contextlib.suppress(OSError):
                p.unlink()
        raise InputError(f"{d}: cannot write the certificates: {e.strerror or e}") from None
    return {n: str(d / n) for n in files}
