"""uvicorn's server with the service's signal handling (`graceful_server`).

Why a subclass: uvicorn >= 0.29 re-raises a captured SIGTERM/SIGINT once it has shut down,
which would end the process with the signal's status instead of 0 after a clean stop; and
the service must start its own shutdown (answer the waiting requests, cut the running one
later) at the first signal."""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Callable
from typing import Any


def graceful_server(config: Any, on_signal: Callable[[int], None] = lambda sig: None) -> Any:
    """uvicorn's Server for ``config`` whose SIGTERM/SIGINT end the serve loop gracefully
    and are not re-raised afterwards. The first signal also starts ``on_signal`` in a
    thread (never in the handler: it takes locks the interrupted main thread may hold); a
    second Ctrl-C stops waiting for requests."""
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
