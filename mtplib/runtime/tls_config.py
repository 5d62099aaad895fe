"""A TLS directory's files and the contexts made from them (`TlsConfig`): a run's TLS
setting, held by its request (`mtplib.runtime.request.RunRequest`); the streams, gateway
and certificate making live in `mtplib.distributed.tls`, which re-exports these names.
"""

from __future__ import annotations

import os
import ssl
from dataclasses import dataclass
from pathlib import Path

from mtplib.errors import InputError

CA, SHARD_CERT, SHARD_KEY = "ca.pem", "shard.pem", "shard.key"
CLIENT_CERT, CLIENT_KEY, CA_KEY = "client.pem", "client.key", "ca.key"
#: the ALPN protocol a shard's gateway offers when it dials another shard's gateway for a
#: peer link (the ring, patches/0007); a connection without it is a client's
PEER_ALPN = "mtplib-peer/1"


@dataclass(frozen=True)
class TlsConfig:
    """A TLS directory (see the module doc); `server_context` / `client_context` need only
    their side's files, so a shard host and a client host each hold just their own."""

    dir: Path

    @classmethod
    def load(cls, path: str | os.PathLike) -> TlsConfig:
        d = Path(path).expanduser()
        if not d.is_dir():
            raise InputError(f"--tls {path}: not a directory (make one with `mtplib tls init "
                             f"{path}`, or put {CA}, {SHARD_CERT}/{SHARD_KEY} or "
                             f"{CLIENT_CERT}/{CLIENT_KEY} there)")
        return cls(d.resolve())

    def _files(self, *names: str) -> list[str]:
        missing = [n for n in names if not (self.dir / n).is_file()]
        if missing:
            raise InputError(f"--tls {self.dir}: missing {', '.join(missing)} (see `mtplib tls "
                             "init`, or the README's bring-your-own PKI)")
        return [str(self.dir / n) for n in names]

    def _context(self, purpose: ssl.Purpose, cert: str, key: str) -> ssl.SSLContext:
        ca, cert_f, key_f = self._files(CA, cert, key)
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER if purpose is ssl.Purpose.CLIENT_AUTH
                             else ssl.PROTOCOL_TLS_CLIENT)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_3
        ctx.verify_mode = ssl.CERT_REQUIRED
        try:
            ctx.load_verify_locations(cafile=ca)
            ctx.load_cert_chain(cert_f, key_f)
        except (ssl.SSLError, OSError, ValueError) as e:
            raise InputError(f"--tls {self.dir}: cannot use {cert}/{key} with {CA}: "
                             f"{getattr(e, 'reason', None) or e}") from None
        return ctx

    def server_context(self) -> ssl.SSLContext:
        """The shard's side: its certificate, clients must present one signed by the CA."""
        return self._context(ssl.Purpose.CLIENT_AUTH, SHARD_CERT, SHARD_KEY)

    def client_context(self) -> ssl.SSLContext:
        """The client's side: its certificate; the shard's is checked against the CA and
        the endpoint's address (check_hostname)."""
        ctx = self._context(ssl.Purpose.SERVER_AUTH, CLIENT_CERT, CLIENT_KEY)
        ctx.check_hostname = True
        return ctx

    def peer_context(self) -> ssl.SSLContext:
        """A shard's side of a peer link it opens to another shard's gateway: the shard's
        own certificate as the TLS client's (`mtplib tls init` issues it for both uses),
        the other gateway's checked against the CA and the dialed address, ALPN
        `PEER_ALPN` (so that gateway takes it for a peer, not a client)."""
        ctx = self._context(ssl.Purpose.SERVER_AUTH, SHARD_CERT, SHARD_KEY)
        ctx.check_hostname = True
        ctx.set_alpn_protocols([PEER_ALPN])
        return ctx
