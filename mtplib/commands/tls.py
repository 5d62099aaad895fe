"""`mtplib tls init DIR`: a quick-start PKI for mutual TLS between clients and shards."""

from __future__ import annotations

import argparse
import json

from mtplib.commands.common import add_json_arg


def init(a: argparse.Namespace) -> int:
    from mtplib.distributed.tls import init_pki

    files = init_pki(a.dir, a.host, days=a.days)
    if a.json:
        print(json.dumps({"dir": a.dir, "files": files, "hosts": a.host or
                          ["127.0.0.1", "localhost"]}))
        return 0
    for name, path in files.items():
        print(f"{name:12s} {path}")
    print("shard hosts need ca.pem, shard.pem, shard.key; client hosts ca.pem, client.pem, "
          "client.key; keep ca.key off both (it issues certificates)")
    return 0


def register(sub) -> None:
    t = sub.add_parser("tls", help="certificates for mutual TLS between clients and shards",
                       description="Mutual TLS between the ranged client and its shards "
                       "(shard serve --tls DIR, generate/bench --tls DIR).")
    ts = t.add_subparsers(dest="tls_cmd", required=True, metavar="ACTION")
    i = ts.add_parser("init", help="make a CA, a shard and a client certificate in DIR",
                      description="Write DIR/ca.pem, ca.key, shard.pem, shard.key, client.pem, "
                      "client.key (ECDSA P-256, signed by the new CA). The shard certificate "
                      "names every --host (IP addresses and DNS names) the clients dial. "
                      "Refuses to replace existing files.")
    i.add_argument("dir", metavar="DIR", help="directory to write (created if missing)")
    i.add_argument("--host", action="append", default=None,
                   help="a shard address for the certificate's SANs; repeat for several "
                   "(default: 127.0.0.1 and localhost)")
    i.add_argument("--days", type=int, default=365, help="validity of the certificates")
    add_json_arg(i, "the files written")
    i.set_defaults(fn=init)
