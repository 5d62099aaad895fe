"""The service through shard faults: what /health reports, and the recovery.

A ranged backend (`RangedMTP`) says what it sees wrong without a round trip
(`RangedMTP.faults`: a local shard gone, or stopped for the silence limit, a shard that
closed its connection, a failed session), so each /health call looks at it afresh; a hung
remote shard shows at the running request instead, within the silence limit
($MTPLIB_SHARD_SILENCE_S). A stall shorter than that limit (a shard stopped and continued,
a slow step) is no fault: /health stays 200 and nothing reconnects. Once a fault is
seen the service is degraded: /health answers 503 naming the shards, and the worker thread
reconnects (`RangedMTP.reconnect`: local shards restarted, external ones probed) with
doubling waits until the shards answer and their weights are loaded again; then it serves
as before. A request that arrives while degraded waits for an attempt made at once for it
(`wake`): answered if that attempt makes the service whole (so the first request after a
shard's return is served, not refused), a 503 naming the shards if it does not. A
whole-model backend has no shards: it is always whole.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from mtplib.errors import MtplibError
from mtplib.runtime.backend import Backend
from mtplib.runtime.rpc import ShardError
from mtplib.serve.errors import ApiError, error_of, unavailable

#: the worker looks at an idle backend this often (a fault seen between requests starts the
#: recovery without waiting for a request to fail)
RECHECK_S = 1.0
#: the first wait between reconnect attempts, doubled per failed attempt up to the second
BACKOFF_S, MAX_BACKOFF_S = 0.5, 5.0
#: attempts are at least this far apart, however many requests wake them
MIN_ATTEMPT_S = 0.5


class BackendHealth:
    """The backend's fault state: None while whole, else what /health and the refused
    requests report (message, shards at fault, since when). Read by the event loop,
    written by the worker thread and by `check`."""

    def __init__(self, backend: Backend, log: Callable[[str], None] = lambda s: None
                 ) -> None:
        self.backend, self.log = backend, log
        self.recoverable = callable(getattr(backend, "faults", None)) and \
            callable(getattr(backend, "reconnect", None))
        self._lock = threading.Lock()
        self.fault: dict | None = None
        #: completed recoveries since the start (/health reports them)
        self.recoveries = 0
        #: set by a request that waits while degraded: the next attempt starts now
        self.wake = threading.Event()

    def check(self) -> dict | None:
        """The fault now: the one being recovered from, else what the backend sees."""
        if self.fault is not None or not self.recoverable:
            return self.fault
        found = self.backend.faults()
        if found:
            self.mark("shard fault: " + "; ".join(_name(f) for f in found), found)
        return self.fault

    def mark(self, message: str, shards: list[dict]) -> None:
        """Degraded from now (the first fault's time and shards are kept)."""
        with self._lock:
            if self.fault is None:
                self.fault = {"message": message, "shards": shards,
                              "since": time.monotonic()}
                self.log(f"degraded: {message}; reconnecting the shards")
            else:
                self.fault["message"] = message

    def failure(self, e: BaseException) -> tuple[str, dict] | None:
        """A request's failure as a 503's (message, extra fields) when a shard caused it
        and the backend sees the fault (None otherwise); the service is then degraded."""
        if not isinstance(e, ShardError) or not self.recoverable:
            return None
        seen = self.backend.faults()
        if not seen:  # a shard error that left the session whole: an ordinary failure
            return None
        named = set(getattr(e, "shards", ()))
        shards = [f for f in seen if f["shard"] in named] if named else seen
        shards += [self.backend.describe(i, "failed")
                   for i in sorted(named - {f["shard"] for f in shards})]
        self.mark(str(e), shards)
        return (f"a shard failed; the service is reconnecting its shards (GET /health "
                f"says when it is whole again): {e}", {"shards": shards})

    def refusal(self) -> str:
        """The 503 message of a request that arrives while degraded."""
        f = self.fault or {}
        names = ", ".join(_name(s) for s in f.get("shards") or []) or "a shard"
        return (f"the service is degraded ({names}) and reconnecting its shards; retry "
                "later (GET /health says when it is whole)")

    def status(self) -> tuple[int, dict]:
        """/health's status code and body."""
        f = self.check()
        if f is None:
            return 200, {"status": "ok", "recoveries": self.recoveries}
        return 503, {"status": "degraded", "shards": f["shards"],
                     "degraded_s": round(time.monotonic() - f["since"], 3),
                     "recoveries": self.recoveries,
                     "error": {"message": f["message"], "type": "unavailable_error",
                               "param": None, "code": 503}}

    def recover(self, stopping: threading.Event,
                failed: Callable[[], None] = lambda: None) -> bool:
        """In the worker thread: reconnect until whole (True) or ``stopping`` (False).
        After each failed attempt ``failed()`` answers the requests that waited for it;
        the next attempt comes after the backoff, or at once when a request `wake`s it
        (at most every `MIN_ATTEMPT_S`)."""
        wait = BACKOFF_S
        while not stopping.is_set():
            self.wake.clear()
            t0 = time.monotonic()
            try:
                self.backend.reconnect()
            except (MtplibError, OSError) as e:
                self.mark(f"reconnecting: {e}; next try in {wait:.1f} s", [])
                failed()
                if stopping.wait(max(0.0, MIN_ATTEMPT_S - (time.monotonic() - t0))):
                    break
                self.wake.wait(wait)
                wait = min(2 * wait, MAX_BACKOFF_S)
                continue
            with self._lock:
                since = self.fault["since"] if self.fault else time.monotonic()
                self.fault = None
                self.recoveries += 1
            self.log(f"whole again after {time.monotonic() - since:.1f} s: the shards "
                     "answer and their weights are loaded; serving")
            return True
        return False


def _name(f: dict) -> str:
    if f.get("shard") is None:
        return str(f.get("cause"))
    return f"shard {f['shard']} ({f['endpoint']}, layers {f['layers']}): {f['cause']}"


def answer(health: BackendHealth, e: BaseException) -> ApiError:
    """A request's failure as its response: a shard fault is a 503 naming the shards (and
    the service degraded until it recovers), the rest as `error_of`."""
    shard = health.failure(e)
    if shard is None:
        return error_of(e)
    return unavailable(shard[0], shard[1])
