"""The service as a process (`launch`): bind the port, load the backend once, build the
worker (one slot, or ``--parallel N`` batched), serve until SIGTERM/SIGINT, close.

Why the socket first: it is bound before uvicorn starts (so --port 0 works: the chosen
port is printed, and a taken address is refused in one line before a long load); until
uvicorn takes SIGTERM over, a SIGTERM ends the load cleanly (exit 0)."""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import sys
import threading
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, replace

from mtplib.errors import InputError
from mtplib.runtime.backend import Backend
from mtplib.serve.app import create_app
from mtplib.serve.batch import GATHER_S
from mtplib.serve.config import ServeConfig
from mtplib.serve.deadlines import deadline_protocol
from mtplib.serve.logs import log_line
from mtplib.serve.server import graceful_server
from mtplib.serve.worker import BatchWorker, GenerationWorker

#: uvicorn cancels what still runs this long after --shutdown-timeout (the worker cuts the
#: running generation at --shutdown-timeout and answers it; a step that hangs is cancelled)
CUT_MARGIN_S = 5.0


@dataclass(frozen=True)
class LaunchOptions:
    """How the process serves (the command line's, checked)."""

    host: str
    port: int
    model: str
    #: the shard plan (None: the whole model); ranged backends gather joins (GATHER_S)
    plan: str | None = None
    parallel: int = 1
    shutdown_timeout: float = 10.0
    header_timeout: float = 10.0
    body_timeout: float = 30.0
    verbose: bool = False
    #: print the ready line as JSON on stdout
    json: bool = False


def bind(host: str, port: int) -> socket.socket:
    """The listening socket; refused with one line when the address is taken."""
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


class Terminated(BaseException):
    """SIGTERM arrived while the model was loading. A BaseException (like
    KeyboardInterrupt), so no ``except Exception`` on the load path (a GGUF parse wraps any
    Exception as a bad file, exit 2) turns the stop into an error."""


def terminate(signum, frame) -> None:
    raise Terminated


def launch(opts: LaunchOptions, load: Callable[[], AbstractContextManager[Backend]],
           config_of: Callable[[Backend], ServeConfig]) -> int:
    """Serve until stopped; the exit status. ``load()`` opens the backend (closed at the
    end), ``config_of(backend)`` says what the HTTP layer knows of it."""
    sock = bind(opts.host, opts.port)
    # until uvicorn takes SIGTERM over, it ends the load: what was loaded is closed (the
    # shards this process started stop) and the exit is 0, as for a stop while serving
    previous = signal.signal(signal.SIGTERM, terminate)
    log_line(f"loading {opts.model}" + (f" on plan {opts.plan}" if opts.plan else ""))
    try:
        return serve(opts, sock, load, config_of)
    except Terminated:
        log_line("stopped (SIGTERM before serving)")
        return 0
    finally:
        signal.signal(signal.SIGTERM, previous)


def make_worker(opts: LaunchOptions, backend: Backend, cfg: ServeConfig) -> GenerationWorker:
    """One slot, or ``opts.parallel`` slots over the backend's batch (every step shape run
    once, at load; each slot gets its share of the context)."""
    if opts.parallel > 1:
        batch = backend.batch(warm=True)
        cfg = replace(cfg, n_ctx=int(batch.n_ctx))
        return BatchWorker(backend, cfg, batch, opts.parallel, log=log_line,
                           gather_s=GATHER_S if opts.plan else 0.0)
    return GenerationWorker(backend, cfg, log=log_line)


def serve(opts: LaunchOptions, sock: socket.socket,
          load: Callable[[], AbstractContextManager[Backend]],
          config_of: Callable[[Backend], ServeConfig]) -> int:
    """Load the backend, serve until SIGTERM/SIGINT, close it."""
    import uvicorn

    with sock, load() as backend:
        worker = make_worker(opts, backend, config_of(backend))
        cfg = worker.cfg
        stopped: list[bool] = []

        def on_shutdown() -> None:
            stopped.append(worker.stop(timeout=max(opts.shutdown_timeout, 1.0) + 30.0))

        def on_signal(sig: int) -> None:
            # the waiting requests are answered 503 at once; the running one may finish
            # within --shutdown-timeout, else it is cut and answered 503 (before uvicorn's
            # own deadline, CUT_MARGIN_S later, cancels what is left)
            n = worker.begin_shutdown()
            log_line(f"{signal.Signals(sig).name}: stopping" + (
                f"; {n} waiting request(s) answered 503" if n else ""))
            cut = threading.Timer(opts.shutdown_timeout, worker.cut)
            cut.daemon = True
            cut.start()

        app = create_app(worker, on_shutdown=on_shutdown)
        server = graceful_server(uvicorn.Config(
            app, log_level="warning" if not opts.verbose else "info",
            access_log=opts.verbose,
            http=deadline_protocol(opts.header_timeout, opts.body_timeout),
            timeout_graceful_shutdown=opts.shutdown_timeout + CUT_MARGIN_S, lifespan="on"),
            on_signal)
        announce(opts, sock, cfg)
        server.run(sockets=[sock])
        if stopped and not stopped[0]:
            # upstream still runs a step in the worker thread: closing the models under it
            # could crash; the shards die with this process
            log_line("the running generation did not stop in time; exiting without "
                     "closing the model", logging.WARNING)
            sys.stderr.flush()
            os._exit(1)
    log_line("stopped")
    return 0


def announce(opts: LaunchOptions, sock: socket.socket, cfg: ServeConfig) -> None:
    """The ready line: on stderr, and as JSON on stdout with ``opts.json``."""
    port = sock.getsockname()[1]
    url = f"http://{opts.host if ':' not in opts.host else f'[{opts.host}]'}:{port}"
    ready = {"listening": url, "host": opts.host, "port": port, "model": cfg.model_id,
             "n_ctx": cfg.n_ctx, "parallel": opts.parallel, "draft": cfg.k,
             "plan": opts.plan, "upstream": cfg.meta["upstream"]}
    if opts.plan:
        ready["seam"] = cfg.meta["seam"]
    if opts.json:
        print(json.dumps(ready), flush=True)
    log_line(f"listening on {url} (model {cfg.model_id}, n_ctx {cfg.n_ctx}"
             + (f" per slot, {opts.parallel} slots" if opts.parallel > 1 else "") + ", "
             f"draft {cfg.k}{', plan ' + opts.plan if opts.plan else ''}"
             + (f", seam {cfg.meta['seam']['seam']}" if opts.plan else "")
             + "); SIGTERM or Ctrl-C stops it")
