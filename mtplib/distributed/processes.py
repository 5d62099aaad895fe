"""Local shard processes: start, probe, stop, and never leave one behind.

`LocalShards(n, threads)` starts n ``mtplib shard serve`` processes on free loopback ports,
waits until each answers upstream's RPC handshake, and kills them on exit, error, Ctrl-C
or interpreter exit (own process group each; atexit; and a parent-death safeguard:
PR_SET_PDEATHSIG plus a watchdog thread in the shard that exits when its parent is gone).
Every child is forked by one thread that lives as long as this process (`_Spawner`), so
PR_SET_PDEATHSIG (SIGKILL, which also ends a stopped child) holds for a shard restarted by a
fault recovery in a worker thread too, and never fires early when such a thread ends.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import queue
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from pathlib import Path

from mtplib import envs
from mtplib.distributed.probe import probe_shards
from mtplib.distributed.tls import TlsConfig
from mtplib.errors import InputError
from mtplib.runtime.libc import set_parent_death_signal
from mtplib.runtime.rpc import ShardError

#: a shard process stopped this long while starting is reported as stopped (s)
STOPPED_START_S = 2.0

# -- process hygiene --------------------------------------------------------------------
LIVE: weakref.WeakSet = weakref.WeakSet()


def die_with_parent(parent_pid: int) -> None:
    """In a child: exit when ``parent_pid`` is gone. PR_SET_PDEATHSIG with SIGKILL (if the
    spawner asked for it with MTPLIB_PDEATHSIG=1: it follows the spawning *thread*, so only
    a spawn from a thread that lives as long as the parent asks; `spawn_child` always does) plus
    a watchdog thread polling the parent pid (which cannot act while the child is stopped:
    only the SIGKILL ends a stopped orphan)."""
    if envs.pdeathsig():
        set_parent_death_signal(signal.SIGKILL)
    if os.getppid() != parent_pid:  # the parent died before we got here
        os._exit(3)

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(0.2)
        os._exit(3)

    threading.Thread(target=watch, daemon=True, name="parent-watchdog").start()


class _Spawner:
    """The one thread that forks every child of this process. PR_SET_PDEATHSIG fires when
    the *thread* that forked the child ends, not the process: a shard restarted by `mtplib
    serve`'s recovery (a worker thread) or by any short-lived thread would otherwise either
    go without it (and outlive a SIGKILL'ed parent while stopped) or die with that thread.
    This thread is a daemon that lives until the process exits (started again after a
    fork, where it does not exist)."""

    def __init__(self) -> None:
        self._reset()
        # a forked child has no spawner thread, and the lock may have been held at the fork
        os.register_at_fork(after_in_child=self._reset)

    def _reset(self) -> None:
        self._lock = threading.Lock()
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    @staticmethod
    def _run(jobs: queue.SimpleQueue) -> None:
        while True:
            fn, fut = jobs.get()
            if fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(fn())
                except BaseException as e:  # noqa: BLE001 - raised in the caller's thread
                    fut.set_exception(e)

    def call(self, fn: Callable[[], subprocess.Popen]) -> subprocess.Popen:
        """``fn()`` run in the spawner thread; its result, or its exception re-raised."""
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, args=(self._jobs,),
                                                daemon=True, name="mtplib-spawner")
                self._thread.start()
            if threading.current_thread() is self._thread:
                return fn()
            fut: Future = Future()
            self._jobs.put((fn, fut))
        try:
            return fut.result()
        except BaseException:  # e.g. Ctrl-C while waiting: a child started late is killed
            fut.add_done_callback(_kill_late)
            raise


def _kill_late(fut: Future) -> None:
    if not fut.cancelled() and fut.exception() is None:
        kill_group(fut.result(), grace_s=1.0)


_SPAWNER = _Spawner()


def spawn_child(argv: list[str], *, log_path: Path, env: Mapping[str, str] | None = None,
                pass_fds: Sequence[int] = (), cwd: str | Path | None = None) -> subprocess.Popen:
    """A child in its own process group (killable as a whole), output to a file (never a
    pipe that could fill); forked by `_SPAWNER`'s long-lived thread, whatever thread asks,
    so the child's `die_with_parent` may set PR_SET_PDEATHSIG."""
    env = dict(os.environ if env is None else env)
    env[envs.PDEATHSIG] = "1"
    log = open(log_path, "ab")  # noqa: SIM115 - the child keeps it
    try:
        return _SPAWNER.call(lambda: subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True, env=env, pass_fds=tuple(pass_fds), close_fds=True,
            cwd=cwd))
    finally:
        log.close()


def kill_group(p: subprocess.Popen, grace_s: float = 2.0) -> None:
    """End ``p``'s whole process group: SIGTERM, ``grace_s`` to go, then SIGKILL."""
    if p.poll() is None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(p.pid, signal.SIGTERM)
        try:
            p.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            pass
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(p.pid, signal.SIGKILL)  # anything left in the group
    with contextlib.suppress(subprocess.TimeoutExpired):
        p.wait(timeout=grace_s)


@atexit.register
def _close_all() -> None:
    for obj in list(LIVE):
        with contextlib.suppress(Exception):
            obj.close()


def log_tail(path: Path, n: int = 2000) -> str:
    """The last ``n`` bytes of a child's log as text ("" where it cannot be read)."""
    try:
        data = path.read_bytes()[-n:]
    except OSError:
        return ""
    return data.decode("utf-8", "replace").strip()


def proc_cpu_state(pid: int) -> tuple[int, str] | None:
    """(utime + stime in ticks, state letter) of a local process, None if unreadable."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12]), fields[0]


def free_port() -> int:
    """A loopback TCP port free right now (the OS's pick)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- local shards -----------------------------------------------------------------------
class LocalShards:
    """n local shard processes on free loopback ports; a context manager.

    ``endpoints`` lists them in order; ``kill(i)`` / ``restart(i)`` exist for fault
    handling (restart reuses the endpoint). With ``tls`` each serves through its mutual-TLS
    gateway (``shard serve --tls``), its RPC server on another loopback port. ``env``: the
    shards' environment (None: this process's), e.g. ``MTPLIB_UPSTREAM`` for the build they
    load; ``cwd``: the folder they start in (None: this one), which with ``PYTHONPATH`` in
    ``env`` picks the checkout whose mtplib they run (``python -m`` looks there first)."""

    def __init__(self, n: int, threads: int = 1, *, cache_dir: str | None = None,
                 start_timeout_s: float = 30.0, log_dir: str | Path | None = None,
                 tls: TlsConfig | None = None, env: Mapping[str, str] | None = None,
                 cwd: str | Path | None = None) -> None:
        if not 1 <= n <= 16:
            raise InputError(f"LocalShards: n must be in 1..16, got {n}")
        if threads < 1:
            raise InputError("LocalShards: threads must be >= 1")
        self.n, self.threads, self.cache_dir = n, threads, cache_dir
        self.tls = tls
        self.env = None if env is None else dict(env)
        self.cwd = cwd
        self.start_timeout_s = start_timeout_s
        self._tmp = None
        if log_dir is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="mtplib-shards-")
            log_dir = self._tmp.name
        self.log_dir = Path(log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.endpoints: list[str] = []
        self.procs: list[subprocess.Popen | None] = []
        self._started = False

    def _argv(self, endpoint: str) -> list[str]:
        argv = [sys.executable, "-m", "mtplib.cli", "shard", "serve", "--endpoint", endpoint,
                "--threads", str(self.threads), "--parent-pid", str(os.getpid())]
        if self.cache_dir:
            argv += ["--cache-dir", str(self.cache_dir)]
        if self.tls is not None:
            argv += ["--tls", str(self.tls.dir)]
        return argv

    def log_path(self, i: int) -> Path:
        return self.log_dir / f"shard{i}.log"

    def _launch(self, i: int, endpoint: str) -> subprocess.Popen:
        return spawn_child(self._argv(endpoint), log_path=self.log_path(i), env=self.env,
                           cwd=self.cwd)

    def start(self) -> LocalShards:
        if self._started:
            return self
        self._started = True
        LIVE.add(self)
        try:
            for i in range(self.n):
                ep = f"127.0.0.1:{free_port()}"
                self.endpoints.append(ep)
                self.procs.append(self._launch(i, ep))
            deadline = time.monotonic() + self.start_timeout_s
            for i in range(self.n):
                for _attempt in range(3):
                    if self._wait_ready(i, deadline):
                        break
                    # the port was taken between choosing and binding: another one
                    self.endpoints[i] = f"127.0.0.1:{free_port()}"
                    self.procs[i] = self._launch(i, self.endpoints[i])
                else:
                    raise ShardError(f"shard {i} could not bind a port; log: "
                                     f"{log_tail(self.log_path(i), 500)}")
        except BaseException:
            self.close()
            raise
        return self

    def _wait_ready(self, i: int, deadline: float) -> bool:
        """True when shard i answers the handshake; False if it exited because its port
        was taken; ShardError on any other failure or timeout."""
        p, ep = self.procs[i], self.endpoints[i]
        stopped_since: float | None = None
        while True:
            if self.stopped(i):  # SIGSTOP'd while starting: say so, not a 30 s timeout
                stopped_since = stopped_since or time.monotonic()
                if time.monotonic() - stopped_since >= STOPPED_START_S:
                    raise ShardError(f"shard {i} ({ep}): stopped (SIGSTOP?) while starting; "
                                     "continue it (SIGCONT) or restart it")
                time.sleep(0.05)
                continue
            stopped_since = None
            rc = p.poll()
            if rc is not None:
                if rc == 4:
                    return False
                raise ShardError(f"shard {i} ({ep}) exited with code {rc} while starting; "
                                 f"log: {log_tail(self.log_path(i), 800)}")
            try:
                probe_shards([ep], tls=self.tls, timeout_s=1.0)
                return True
            except ShardError:
                if time.monotonic() > deadline:
                    raise ShardError(f"shard {i} ({ep}) did not answer within "
                                     f"{self.start_timeout_s} s; log: "
                                     f"{log_tail(self.log_path(i), 800)}") from None
                time.sleep(0.05)

    def alive(self) -> list[bool]:
        return [p is not None and p.poll() is None for p in self.procs]

    def stopped(self, i: int) -> bool:
        """True when shard i's process is stopped (SIGSTOP): alive, but it answers nothing."""
        p = self.procs[i]
        st = None if p is None or p.poll() is not None else proc_cpu_state(p.pid)
        return st is not None and st[1] in "Tt"

    def pids(self) -> list[int]:
        return [p.pid for p in self.procs if p is not None]

    def kill(self, i: int, sig: int = signal.SIGKILL) -> None:
        """Kill shard i (fault injection / operator action)."""
        p = self.procs[i]
        if p is not None and p.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, sig)
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=5)

    def restart(self, i: int) -> str:
        """Start shard i again on the same endpoint (killing it first if it still runs)."""
        p = self.procs[i]
        if p is not None:
            kill_group(p, grace_s=1.0)
        self.procs[i] = self._launch(i, self.endpoints[i])
        if not self._wait_ready(i, time.monotonic() + self.start_timeout_s):
            raise ShardError(f"shard {i}: endpoint {self.endpoints[i]} is taken by another "
                             "process; cannot restart on it")
        return self.endpoints[i]

    def close(self) -> None:
        for p in self.procs:
            if p is not None:
                kill_group(p)
        LIVE.discard(self)
        if self._tmp is not None:
            with contextlib.suppress(OSError):
                self._tmp.cleanup()
            self._tmp = None

    def __enter__(self) -> LocalShards:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()
