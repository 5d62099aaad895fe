"""`mtplib shard serve`: one shard, an upstream RPC server process with a CPU (or GPU)
device."""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading

from mtplib.commands.common import add_json_arg, add_log_args, setup_logging


def serve(a: argparse.Namespace) -> int:
    setup_logging(a)
    from mtplib.runtime.model import check_threads
    from mtplib.runtime.rpc import parse_endpoint, serve, shard_device

    parse_endpoint(a.endpoint, allow_remote=a.allow_remote)  # refuse before anything starts
    check_threads(a.threads, "--threads")
    shard_device(a.device)  # a GPU asked of a CPU build: refused here, not in the thread
    host, _ = a.endpoint.split(":")
    if a.allow_remote and not host.startswith("127."):
        print(f"mtplib shard serve: WARNING: serving {a.endpoint} beyond loopback. Upstream's "
              "RPC protocol has NO authentication: anyone who can reach this port can read "
              "and write this process's memory buffers and run graphs on it.", file=sys.stderr)
    if a.parent_pid:  # started by LocalShards: never outlive it
        from mtplib.distributed.processes import die_with_parent

        die_with_parent(a.parent_pid)
    done = threading.Event()
    result: dict = {}

    def run() -> None:
        try:
            serve(a.endpoint, threads=a.threads, cache_dir=a.cache_dir,
                  allow_remote=a.allow_remote, device=a.device)
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
    while not done.wait(0.5):
        pass
    if "error" in result:
        raise result["error"]
    # start_server only returns when it could not serve (e.g. the port is taken)
    msg = (f"upstream could not serve {a.endpoint} (port in use or not bindable; see its "
           "message above)")
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
                      "SIGTERM). Loopback only unless --allow-remote: upstream's RPC has no "
                      "authentication.")
    v.add_argument("--endpoint", required=True, help="HOST:PORT to bind, e.g. 127.0.0.1:50052")
    v.add_argument("--threads", type=int, default=1, help="CPU threads for graphs")
    v.add_argument("--device", choices=("cpu", "gpu"), default=None,
                   help="what to serve: this process's CPU, or the first local GPU of a CUDA "
                   "build (default: $MTPLIB_SHARD_DEVICE, else cpu)")
    v.add_argument("--cache-dir", help="upstream's tensor cache dir (large weights by hash)")
    v.add_argument("--allow-remote", action="store_true",
                   help="allow a non-loopback endpoint (UNAUTHENTICATED; a warning is printed)")
    v.add_argument("--parent-pid", type=int, default=0, help=argparse.SUPPRESS)
    add_json_arg(v, "errors (serving itself prints nothing)")
    add_log_args(v)
    v.set_defaults(fn=serve)
