"""`mtplib serve`: a long-lived OpenAI-compatible HTTP service over one loaded model.

The model is loaded once (whole, or ranged on shards with --plan) with exactly generate's
options (`generate.add_engine_args`, `check_engine_args`, `open_backend`), so setup is
paid once and not per request; the HTTP layer is `serve_app`.
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import math
import os
import signal
import socket
import sys
import threading
from pathlib import Path

from mtplib.commands.common import add_json_arg, add_log_args, add_option, setup_logging
from mtplib.commands.generate import (
    add_engine_args,
    add_sampling_args,
    check_engine_args,
    draft_k,
    open_backend,
)
from mtplib.errors import InputError

#: --header-timeout / --body-timeout defaults, seconds (`serve_app.deadline_protocol`)
HEADER_TIMEOUT_S, BODY_TIMEOUT_S = 10.0, 30.0

#: the environment variable read for --api-key when the flag is not given (keeps the key
#: out of the process list)
API_KEY_ENV = "MTPLIB_API_KEY"
#: the most --parallel slots: upstream's LLAMA_MAX_SEQ (src/llama-cparams.h)
PARALLEL_MAX = 256
#: what --parallel -1 (llama-server's auto) runs: one slot, the default, until more is
#: measured better on the hosts mtplib serves from
PARALLEL_AUTO = 1


def add_parallel_arg(s: argparse.ArgumentParser) -> None:
    """``--parallel N`` / llama-server's ``-np N``: the number of slots (sequences decoded
    together). The one definition; `check_parallel` says which values run."""
    add_option(s, "--parallel", type=int, default=1, metavar="N",
               help="slots decoded together, continuous batching (llama-server's -np); "
               "each slot gets --ctx / N positions, as llama-server's; default 1")


def check_parallel(a: argparse.Namespace) -> None:
    """Refuse a --parallel outside 1..PARALLEL_MAX in one line; -1 (llama-server's auto)
    is PARALLEL_AUTO."""
    if a.parallel == -1:
        a.parallel = PARALLEL_AUTO
    if not 1 <= a.parallel <= PARALLEL_MAX:
        raise InputError(f"--parallel must be in 1..{PARALLEL_MAX} (or -1: auto), got "
                         f"{a.parallel}")


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _check_serve_args(a: argparse.Namespace) -> None:
    check_parallel(a)
    if not 0 <= a.port <= 65535:
        raise InputError(f"--port must be in 0..65535, got {a.port}")
    if not _is_loopback(a.host) and not a.allow_remote:
        raise InputError(f"--host {a.host} is not a loopback address: the service has no "
                         "authentication unless --api-key is given; add --allow-remote to "
                         "serve beyond this machine")
    for opt, v, lo in (("--queue", a.queue, 0), ("--max-body-bytes", a.max_body_bytes, 1024),
                       ("--shutdown-timeout", a.shutdown_timeout, 0)):
        if v < lo:
            raise InputError(f"{opt} must be >= {lo}, got {v}")
    if not math.isfinite(a.shutdown_timeout):
        raise InputError(f"--shutdown-timeout must be a finite number of seconds, got "
                         f"{a.shutdown_timeout}")
    for opt, v in (("--header-timeout", a.header_timeout), ("--body-timeout", a.body_timeout)):
        if not (math.isfinite(v) and v > 0):
            raise InputError(f"{opt} must be a finite number of seconds > 0, got {v}")
    source = "--api-key"
    if a.api_key is None and API_KEY_ENV in os.environ:
        # set but empty is a mistake (a key that did not expand), not "no key": refused
        # like --api-key '' rather than served without authentication
        a.api_key, source = os.environ[API_KEY_ENV], f"${API_KEY_ENV}"
    if a.api_key is not None and not a.api_key.strip():
        raise InputError(f"{source} is empty: give a key, or unset {API_KEY_ENV} and leave "
                         "--api-key out to serve without one")


def _config(a: argparse.Namespace, backend):
    """What the HTTP layer needs of the model: its name, context, vocabulary size, end of
    generation tokens and chat template (read from the GGUF header, not from upstream)."""
    from mtplib.commands.serve_app import ServeConfig

    h = a.request.trunk_header  # read once, by the request: with the token list (bos/eos)
    kv = h.kv
    toks = kv.get("tokenizer.ggml.tokens")
    eog = {kv.get(f"tokenizer.ggml.{n}_token_id") for n in ("eos", "eot", "eom")}
    eog = frozenset(int(t) for t in eog if isinstance(t, int) and not isinstance(t, bool))

    def text(key: str) -> str:
        t = kv.get(f"tokenizer.ggml.{key}_token_id")
        return str(toks[t]) if isinstance(toks, list) and isinstance(t, int) \
            and 0 <= t < len(toks) else ""

    from mtplib.runtime import build_info

    template = kv.get("tokenizer.chat_template")
    meta = {"plan": a.plan, "head": a.head, "upstream": build_info()}
    if a.plan:
        meta["mtp_placement"] = a.mtp_placement
        # which seam the loaded (and warmed) session runs, asked, chosen and why, per
        # shard pair: /v1/models' meta and the ready line say it
        meta["seam"] = backend.seam_summary()
    return ServeConfig(
        model_id=a.alias or Path(a.model).name, n_ctx=int(backend.n_ctx), n_vocab=h.n_vocab,
        eog=eog, k=draft_k(a), default_n=a.n, default_temperature=a.temp,
        default_top_p=a.top_p, default_seed=a.seed, queue_max=a.queue,
        max_body_bytes=a.max_body_bytes, api_key=a.api_key,
        chat_template=template if isinstance(template, str) else None,
        bos_token=text("bos"), eos_token=text("eos"), meta=meta, model_path=str(a.model),
        fingerprint=_fingerprint(meta["upstream"]), bos_id=_bos_id(backend))


def _bos_id(backend) -> int | None:
    """The token the backend's tokenize puts before any text (its BOS), None if none:
    read from the backend itself (an empty text), not guessed from the header."""
    try:
        toks = backend.tokenize("")
    except Exception:  # noqa: BLE001 - a tokenizer that refuses "" adds nothing we know of
        return None
    return int(toks[0]) if len(toks) == 1 else None


def _fingerprint(upstream: dict) -> str:
    """system_fingerprint and /props' build_info: the upstream build mtplib runs on."""
    up = upstream or {}
    return f"mtplib-{up.get('build', '?')}-{str(up.get('patch_set_sha256', '?'))[:12]}"


def _bind(host: str, port: int) -> socket.socket:
    """The listening socket, bound before uvicorn starts (so --port 0 works: the chosen
    port is printed) and refused with one line when the address is taken."""
    fam = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(fam, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise InputError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    sock.listen(128)
    sock.set_inheritable(True)
    return sock


def run(a: argparse.Namespace) -> int:
    setup_logging(a)
    _check_serve_args(a)
    check_engine_args(a)
    from mtplib.commands.serve_app import log_line

    if not _is_loopback(a.host):
        log_line(f"WARNING: serving on {a.host}, beyond loopback. "
                 + ("Requests need the API key (Authorization: Bearer)." if a.api_key else
                    "There is NO authentication: anyone who can reach this port can run "
                    "generations; give --api-key (or $MTPLIB_API_KEY)."))
    sock = _bind(a.host, a.port)
    # until uvicorn takes SIGTERM over, it ends the load: what was loaded is closed (the
    # shards this process started stop) and the exit is 0, as for a stop while serving
    previous = signal.signal(signal.SIGTERM, _terminate)
    log_line(f"loading {a.model}" + (f" on plan {a.plan}" if a.plan else ""))
    try:
        return _serve(a, sock)
    except _Terminated:
        log_line("stopped (SIGTERM before serving)")
        return 0
    finally:
        signal.signal(signal.SIGTERM, previous)


class _Terminated(BaseException):
    """SIGTERM arrived while the model was loading. A BaseException (like
    KeyboardInterrupt), so no ``except Exception`` on the load path (a GGUF parse wraps any
    Exception as a bad file, exit 2) turns the stop into an error."""


def _terminate(signum, frame) -> None:
    raise _Terminated


def _serve(a: argparse.Namespace, sock: socket.socket) -> int:
    """Load the backend, serve until SIGTERM/SIGINT, close it."""
    import uvicorn

    from mtplib.commands.serve_app import (
        GenerationWorker,
        create_app,
        deadline_protocol,
        log_line,
    )

    # the request check_engine_args built (its sampler: the defaults of a request that
    # gives none), loaded once
    with sock, open_backend(a, warm=True) as backend:
        cfg = _config(a, backend)
        if a.parallel > 1:
            from dataclasses import replace

            from mtplib.commands.serve_batch import GATHER_S, BatchWorker

            batch = backend.batch(warm=True)  # every step shape run once, at load
            cfg = replace(cfg, n_ctx=int(batch.n_ctx))  # each slot's share
            worker = BatchWorker(backend, cfg, batch, a.parallel, log=log_line,
                                 gather_s=GATHER_S if a.plan else 0.0)
        else:
            worker = GenerationWorker(backend, cfg, log=log_line)
        stopped: list[bool] = []

        def on_shutdown() -> None:
            stopped.append(worker.stop(timeout=max(a.shutdown_timeout, 1.0) + 30.0))

        def on_signal(sig: int) -> None:
            # the waiting requests are answered 503 at once; the running one may finish
            # within --shutdown-timeout, else it is cut and answered 503 (before uvicorn's
            # own deadline, CUT_MARGIN_S later, cancels what is left)
            n = worker.begin_shutdown()
            log_line(f"{signal.Signals(sig).name}: stopping" + (
                f"; {n} waiting request(s) answered 503" if n else ""))
            cut = threading.Timer(a.shutdown_timeout, worker.cut)
            cut.daemon = True
            cut.start()

        app = create_app(worker, on_shutdown=on_shutdown)
        server = _server(uvicorn.Config(
            app, log_level="warning" if not a.verbose else "info", access_log=a.verbose,
            http=deadline_protocol(a.header_timeout, a.body_timeout),
            timeout_graceful_shutdown=a.shutdown_timeout + CUT_MARGIN_S, lifespan="on"),
            on_signal)
        port = sock.getsockname()[1]
        url = f"http://{a.host if ':' not in a.host else f'[{a.host}]'}:{port}"
        ready = {"listening": url, "host": a.host, "port": port, "model": cfg.model_id,
                 "n_ctx": cfg.n_ctx, "parallel": a.parallel, "draft": cfg.k, "plan": a.plan,
                 "upstream": cfg.meta["upstream"]}
        if a.plan:
            ready["seam"] = cfg.meta["seam"]
        if a.json:
            print(json.dumps(ready), flush=True)
        log_line(f"listening on {url} (model {cfg.model_id}, n_ctx {cfg.n_ctx}"
                 + (f" per slot, {a.parallel} slots" if a.parallel > 1 else "") + ", "
                 f"draft {cfg.k}{', plan ' + a.plan if a.plan else ''}"
                 + (f", seam {cfg.meta['seam']['seam']}" if a.plan else "")
                 + "); SIGTERM or Ctrl-C stops it")
        server.run(sockets=[sock])
        if stopped and not stopped[0]:
            # upstream still runs a step in the worker thread: closing the models under it
            # could crash; the shards die with this process
            log_line("the running generation did not stop in time; exiting without "
                     "closing the model")
            sys.stderr.flush()
            os._exit(1)
    log_line("stopped")
    return 0


#: uvicorn cancels what still runs this long after --shutdown-timeout (the worker cuts the
#: running generation at --shutdown-timeout and answers it; a step that hangs is cancelled)
CUT_MARGIN_S = 5.0


def _server(config, on_signal=lambda sig: None):
    """uvicorn's Server whose SIGTERM/SIGINT end the serve loop gracefully and are not
    re-raised afterwards (uvicorn >= 0.29 re-raises a captured signal once it has shut
    down, which would end the process with the signal's status instead of 0). The first
    signal also starts ``on_signal`` in a thread (never in the handler: it takes locks the
    interrupted main thread may hold)."""
    import contextlib

    import uvicorn

    class Server(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self):
            old = {sig: signal.signal(sig, self.handle_exit)
                   for sig in (signal.SIGINT, signal.SIGTERM)}
            try:
                yield
            finally:
                for sig, h in old.items():
                    signal.signal(sig, h)

        def handle_exit(self, sig, frame) -> None:
            if self.should_exit and sig == signal.SIGINT:
                self.force_exit = True  # a second Ctrl-C: stop waiting for requests
            if not self.should_exit:
                threading.Thread(target=on_signal, args=(sig,), daemon=True,
                                 name="serve-stop").start()
            self.should_exit = True

    return Server(config)


def register(sub) -> None:
    s = sub.add_parser(
        "serve", help="an OpenAI-compatible HTTP service over one loaded model",
        allow_abbrev=False,
        description="Load the model once (the same options as generate: whole, or ranged "
        "on shards with --plan [--endpoints]) and serve OpenAI's API on HOST:PORT: "
        "POST /v1/completions and /v1/chat/completions (stream: true gives server-sent "
        "events), GET /v1/models and /health. Requests run one at a time in arrival order "
        "(--parallel N: N at once, stepped together in one batch); up to --queue wait, "
        "more get 503. Each response carries llama-server's timings "
        "(prompt_n, prompt_ms, predicted_n, predicted_ms, predicted_per_second, draft_n, "
        "draft_n_accepted). Bad requests get a 4xx JSON error and the service keeps "
        "serving. Each connection must send its headers within --header-timeout and its body "
        "within --body-timeout (else 408, closed). SIGTERM or Ctrl-C: stop accepting, "
        "answer the waiting requests 503, let the running one finish up to "
        "--shutdown-timeout (then cut it, 503), close the model and shards, exit 0. A "
        "shard lost, hung or restarted fails the running request with a 503 naming it; "
        "/health is 503 until the service has reconnected its shards (restarting its own, "
        "re-probing --endpoints with backoff), then it serves again. --n, "
        "--temp, --top-p and "
        "--seed are the defaults of a request that leaves them out.")
    add_engine_args(s)
    add_sampling_args(s)
    add_parallel_arg(s)
    s.add_argument("--host", default="127.0.0.1",
                   help="address to listen on; beyond loopback only with --allow-remote")
    s.add_argument("--port", type=int, default=8080, help="port to listen on (0: any free "
                   "one, printed when listening)")
    s.add_argument("--allow-remote", action="store_true",
                   help="allow a non-loopback --host (a warning is printed; without "
                   "--api-key anyone who reaches the port can use it)")
    s.add_argument("--api-key", default=None, metavar="KEY",
                   help=f"require 'Authorization: Bearer KEY' on every endpoint but /health "
                   f"(default: ${API_KEY_ENV}, else no key)")
    s.add_argument("--alias", default=None,
                   help="the model's id in the API (default: the trunk's file name)")
    s.add_argument("--queue", type=int, default=8,
                   help="requests that may wait behind the running one; more get 503")
    s.add_argument("--max-body-bytes", type=int, default=1 << 20,
                   help="largest request body; larger ones get 413")
    s.add_argument("--shutdown-timeout", type=float, default=10.0,
                   help="seconds SIGTERM lets the running request finish before cutting it "
                   "(answered 503; waiting requests get 503 at once)")
    s.add_argument("--header-timeout", type=float, default=HEADER_TIMEOUT_S, metavar="S",
                   help="a connection's request line and headers must arrive within S "
                   "seconds (of connecting, or of the previous response), else 408 and "
                   "closed")
    s.add_argument("--body-timeout", type=float, default=BODY_TIMEOUT_S, metavar="S",
                   help="a request's body must arrive within S seconds of its headers, "
                   "else 408 and closed")
    add_json_arg(s, 'the "listening" line (url, port, model)')
    add_log_args(s)
    s.set_defaults(fn=run)
