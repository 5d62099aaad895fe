"""`mtplib shard serve`: one shard, an upstream RPC server process with a CPU (or GPU)
device.

Upstream's server binds a free loopback port and a front serves ENDPOINT: with ``--tls
DIR`` the mutual-TLS gateway (mtplib.distributed.gateway); without it the plaintext front
(mtplib.distributed.plain_front), which closes a connection that does not open with
upstream's HELLO (or a peer link's PEER_HELLO) within 3 s and bounds those still pending,
then passes the rest through unchanged. Without TLS, ENDPOINT must be loopback, unless
``--insecure-plaintext`` exposes upstream's unauthenticated RPC there.

The shard reports its build (contract version, pin, stock/patched, patch set, device:
`mtplib.distributed.shard_report.local_report`) to clients at probe time, in band: its
front (gateway or plaintext) answers mtplib's report request on ENDPOINT
(`mtplib.distributed.report_wire`), so forwards and tunnels in between change nothing.
Clients build the adverts they route MTP on from that report."""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading

from mtplib.commands.common import (
    add_json_arg,
    add_log_args,
    add_tls_args,
    setup_logging,
    tls_from_args,
)


def serve(a: argparse.Namespace) -> int:
    setup_logging(a)
    from mtplib.errors import InputError
    from mtplib.runtime.model import check_threads
    from mtplib.runtime.rpc import parse_endpoint, serve, shard_device, shard_device_kind

    if a.allow_remote:
        raise InputError("--allow-remote is gone: give --tls DIR (mutual TLS, see `mtplib tls "
                         "init`), or --insecure-plaintext to expose upstream's "
                         "unauthenticated RPC")
    tls = tls_from_args(a)
    remote_ok = tls is not None or a.insecure_plaintext
    host, port = parse_endpoint(a.endpoint, allow_remote=remote_ok)  # refuse before starting
    check_threads(a.threads, "--threads")
    shard_device(a.device)  # a GPU asked of a CPU build: refused here, not in the thread
    from mtplib.distributed.shard_report import local_report

    # what this process loaded and serves, told to every client
    report = local_report(shard_device_kind(a.device))
    if tls is None and a.insecure_plaintext and not host.startswith("127."):
        print(f"mtplib shard serve: WARNING: --insecure-plaintext: serving {a.endpoint} beyond "
              "loopback without TLS. Upstream's RPC protocol has NO authentication and NO "
              "encryption: anyone who can reach this port can read and write this process's "
              "memory buffers, run graphs on it, crash it or hold it.", file=sys.stderr)
    from mtplib.distributed.gateway import Gateway
    from mtplib.distributed.plain_front import PlainFront
    from mtplib.distributed.processes import free_port

    # upstream's server on a loopback port behind a front on ENDPOINT: with TLS the
    # gateway, else the plaintext front, which passes only connections that open with
    # HELLO (or a peer's PEER_HELLO) in time: upstream holds a thread per connection
    rpc_endpoint = f"127.0.0.1:{free_port()}"
    front: Gateway | PlainFront
    try:
        front = Gateway((host, port), parse_endpoint(rpc_endpoint), tls,
                        report=report) if tls is not None else \
            PlainFront((host, port), parse_endpoint(rpc_endpoint), report=report)
    except OSError as e:
        return _cannot_serve(a, f"could not serve {a.endpoint}: cannot bind it "
                             f"({e.strerror or e})")
    if a.parent_pid:  # started by LocalShards: never outlive it
        from mtplib.distributed.processes import die_with_parent

        die_with_parent(a.parent_pid)
    done = threading.Event()
    result: dict = {}

    def run() -> None:
        try:
            serve(rpc_endpoint, threads=a.threads, cache_dir=a.cache_dir,
                  allow_remote=a.insecure_plaintext, device=a.device)
        except BaseException as e:  # noqa: BLE001 - reported by the main thread
            result["error"] = e
        finally:
            done.set()

    # upstream's accept loop never returns and cannot see signals: run it in a thread and
    # keep the main thread free to act on Ctrl-C / SIGTERM (exit at once, no cleanup to do)
    def stop(signum, _frame) -> None:
        sys.stdout.flush()
        os._exit(128 + signum)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    threading.Thread(target=run, daemon=True, name="rpc-server").start()
    front.start()
    if isinstance(front, Gateway):
        print(f"mtplib shard serve: mutual-TLS gateway on {front.endpoint} (instance "
              f"{front.instance}) -> upstream's RPC server on {rpc_endpoint}", file=sys.stderr,
              flush=True)
    while not done.wait(0.5):
        pass
    front.close()
    if "error" in result:
        raise result["error"]
    # start_server only returns when it could not serve (e.g. the port is taken)
    return _cannot_serve(a, f"upstream could not serve {rpc_endpoint} (port in use or not "
                         "bindable; see its message above)")


def _cannot_serve(a: argparse.Namespace, msg: str) -> int:
    """Exit 4: the endpoint could not be served (LocalShards then tries another port)."""
    if a.json:
        print(json.dumps({"error": msg, "kind": "upstream", "type": "ServeFailed",
                          "command": "shard", "exit": 4}), flush=True)
    else:
        print(f"mtplib shard serve: error: {msg}", file=sys.stderr)
    return 4


def register(sub) -> None:
    s = sub.add_parser("shard", help="run a layer-range shard (upstream RPC server)",
                       description="Shards for ranged execution: each is an upstream "
                       "llama.cpp RPC server process with one CPU device. A client "
                       "(mtplib generate --plan) places contiguous layer ranges on them.")
    ss = s.add_subparsers(dest="shard_cmd", required=True, metavar="ACTION")
    v = ss.add_parser("serve", help="serve one CPU device over upstream's RPC protocol",
                      description="Serve one CPU device on ENDPOINT until killed (Ctrl-C or "
                      "SIGTERM). Upstream's RPC server listens on loopback only, behind a "
                      "front on ENDPOINT. With --tls DIR: a mutual-TLS 1.3 gateway (any "
                      "address). Without it: upstream's RPC passed through as is once a "
                      "connection opens with HELLO (within 3 s, else it is closed); ENDPOINT "
                      "must be loopback unless --insecure-plaintext (no authentication, no "
                      "encryption). Exit code 4: "
                      "ENDPOINT could not be served (e.g. the port is taken).")
    v.add_argument("--endpoint", required=True, help="HOST:PORT to bind, e.g. 127.0.0.1:50052")
    v.add_argument("--threads", type=int, default=1, help="CPU threads for graphs")
    v.add_argument("--device", choices=("cpu", "gpu"), default=None,
                   help="what to serve: this process's CPU, or the first local GPU of a CUDA "
                   "build (default: $MTPLIB_SHARD_DEVICE, else cpu)")
    v.add_argument("--cache-dir", help="upstream's tensor cache dir (large weights by hash)")
    add_tls_args(v, "serve ENDPOINT through the mutual-TLS gateway with DIR's ca.pem, "
                 "shard.pem and shard.key (see `mtplib tls init`)")
    v.add_argument("--allow-remote", action="store_true", help=argparse.SUPPRESS)
    v.add_argument("--parent-pid", type=int, default=0, help=argparse.SUPPRESS)
    add_json_arg(v, "errors (serving itself prints nothing)")
    add_log_args(v)
    v.set_defaults(fn=serve)
