"""Local shard processes and the contained ranged runtime.

- `LocalShards(n, threads)`: starts n ``mtplib shard serve`` processes on free loopback
  ports, waits until each answers upstream's RPC handshake, and kills them on exit, error,
  Ctrl-C or interpreter exit (own process group each; atexit; and a parent-death
  safeguard: PR_SET_PDEATHSIG plus a watchdog thread in the shard that exits when its
  parent is gone).
- `RangedRuntime(trunk, plan, endpoints, sidecar=...)`: the ranged client, run in a
  worker subprocess. Upstream's RPC client aborts its process (GGML_ABORT "Remote RPC
  server crashed or returned malformed response") when a shard connection is lost; in
  the worker that abort ends only the worker, and this side raises `ShardLostError`
  naming the shard and marks the session failed. `RemoteContext` has the methods of
  `mtplib.runtime.model.Context`, so `greedy()` and similar loops run on it unchanged.
  A `CountingRelay` in front of every shard counts the real bytes per labelled step
  (``with rt.step("verify", n_tokens=k + 1): ...``); `seam_report()` sets them next to the
  contract's minimum. Code that must run next to the models (e.g. a whole speculative
  loop) can run inside the worker with ``rt.call(module_level_fn, ...)`` and label its
  steps there with `worker_step`.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from multiprocessing.connection import Connection
from pathlib import Path

from mtplib.runtime.lib import UpstreamError
from mtplib.runtime.rpc import PlanError, ShardError, ShardPlan, parse_endpoint, probe

PR_SET_PDEATHSIG = 1


class ShardLostError(ShardError):
    """A shard connection was lost mid-session; the session is failed."""


class SessionFailedError(ShardError):
    """The session already failed (a shard was lost or hung); open a new one."""


# -- process hygiene --------------------------------------------------------------------
_live: weakref.WeakSet = weakref.WeakSet()


def die_with_parent(parent_pid: int) -> None:
    """In a child: exit when ``parent_pid`` is gone. PR_SET_PDEATHSIG (if the spawner
    asked for it with MTPLIB_PDEATHSIG=1: it follows the spawning *thread*, so only a
    main-thread spawn asks) plus a watchdog thread polling the parent pid."""
    if os.environ.get("MTPLIB_PDEATHSIG") == "1":
        with contextlib.suppress(Exception):
            ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent_pid:  # the parent died before we got here
        os._exit(3)

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(0.2)
        os._exit(3)

    threading.Thread(target=watch, daemon=True, name="parent-watchdog").start()


def _spawn(argv: list[str], *, log_path: Path, env: dict | None = None,
           pass_fds: Sequence[int] = ()) -> subprocess.Popen:
    """A child in its own process group (killable as a whole), output to a file (never a
    pipe that could fill); the child calls `die_with_parent`."""
    env = dict(os.environ if env is None else env)
    in_main = threading.current_thread() is threading.main_thread()
    env["MTPLIB_PDEATHSIG"] = "1" if in_main else "0"
    log = open(log_path, "ab")  # noqa: SIM115 - the child keeps it
    try:
        return subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True, env=env, pass_fds=tuple(pass_fds), close_fds=True)
    finally:
        log.close()


def _kill_group(p: subprocess.Popen, grace_s: float = 2.0) -> None:
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
    for obj in list(_live):
        with contextlib.suppress(Exception):
            obj.close()


def _tail(path: Path, n: int = 2000) -> str:
    try:
        data = path.read_bytes()[-n:]
    except OSError:
        return ""
    return data.decode("utf-8", "replace").strip()


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- local shards -----------------------------------------------------------------------
class LocalShards:
    """n local shard processes on free loopback ports; a context manager.

    ``endpoints`` lists them in order; ``kill(i)`` / ``restart(i)`` exist for fault
    handling (restart reuses the endpoint)."""

    def __init__(self, n: int, threads: int = 1, *, cache_dir: str | None = None,
                 start_timeout_s: float = 30.0, log_dir: str | Path | None = None) -> None:
        if not 1 <= n <= 16:
            raise ValueError(f"LocalShards: n must be in 1..16, got {n}")
        if threads < 1:
            raise ValueError("LocalShards: threads must be >= 1")
        self.n, self.threads, self.cache_dir = n, threads, cache_dir
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
        return argv

    def log_path(self, i: int) -> Path:
        return self.log_dir / f"shard{i}.log"

    def _launch(self, i: int, endpoint: str) -> subprocess.Popen:
        return _spawn(self._argv(endpoint), log_path=self.log_path(i))

    def start(self) -> LocalShards:
        if self._started:
            return self
        self._started = True
        _live.add(self)
        try:
            for i in range(self.n):
                ep = f"127.0.0.1:{_free_port()}"
                self.endpoints.append(ep)
                self.procs.append(self._launch(i, ep))
            deadline = time.monotonic() + self.start_timeout_s
            for i in range(self.n):
                for _attempt in range(3):
                    if self._wait_ready(i, deadline):
                        break
                    # the port was taken between choosing and binding: another one
                    self.endpoints[i] = f"127.0.0.1:{_free_port()}"
                    self.procs[i] = self._launch(i, self.endpoints[i])
                else:
                    raise ShardError(f"shard {i} could not bind a port; log: "
                                     f"{_tail(self.log_path(i), 500)}")
        except BaseException:
            self.close()
            raise
        return self

    def _wait_ready(self, i: int, deadline: float) -> bool:
        """True when shard i answers the handshake; False if it exited because its port
        was taken; ShardError on any other failure or timeout."""
        p, ep = self.procs[i], self.endpoints[i]
        while True:
            rc = p.poll()
            if rc is not None:
                if rc == 4:
                    return False
                raise ShardError(f"shard {i} ({ep}) exited with code {rc} while starting; "
                                 f"log: {_tail(self.log_path(i), 800)}")
            try:
                probe(ep, timeout_s=1.0)
                return True
            except ShardError:
                if time.monotonic() > deadline:
                    raise ShardError(f"shard {i} ({ep}) did not answer within "
                                     f"{self.start_timeout_s} s; log: "
                                     f"{_tail(self.log_path(i), 800)}") from None
                time.sleep(0.05)

    def alive(self) -> list[bool]:
        return [p is not None and p.poll() is None for p in self.procs]

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
            _kill_group(p, grace_s=1.0)
        self.procs[i] = self._launch(i, self.endpoints[i])
        if not self._wait_ready(i, time.monotonic() + self.start_timeout_s):
            raise ShardError(f"shard {i}: endpoint {self.endpoints[i]} is taken by another "
                             "process; cannot restart on it")
        return self.endpoints[i]

    def close(self) -> None:
        for p in self.procs:
            if p is not None:
                _kill_group(p)
        _live.discard(self)
        if self._tmp is not None:
            with contextlib.suppress(OSError):
                self._tmp.cleanup()
            self._tmp = None

    def __enter__(self) -> LocalShards:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()


# -- the contained ranged runtime (parent side) ---------------------------------------
class RemoteContext:
    """A `Context` living in the worker: same methods, same validation (done there)."""

    def __init__(self, rt: RangedRuntime, handle: int, info: dict) -> None:
        self.rt, self.handle = rt, handle
        self.info = info
        for k in ("n_ctx", "n_batch", "n_ubatch", "n_seq_max", "n_rs_seq", "n_vocab", "width"):
            setattr(self, k, info[k])
        from mtplib.runtime.model import ContextConfig

        self.mtp = info["mtp"]
        self.cfg = ContextConfig(**info["cfg"])
        self.last_n_outputs = 0
        self.last_decode_len = 0
        self.closed = False

    def _do(self, method: str, *args, **kwargs):
        if self.closed:
            raise ShardError("context is closed")
        return self.rt._request(("ctx", self.handle, method, args, kwargs))

    def decode(self, tokens, positions, *, seq_id: int = 0, logits=False, rows=None) -> None:
        tokens, positions = list(tokens), list(positions)
        if not isinstance(logits, bool):
            logits = list(logits)
        with self.rt._auto_step(self, len(tokens)):
            self.last_n_outputs, self.last_decode_len = self._do(
                "decode", tokens, positions, seq_id=seq_id, logits=logits, rows=rows)

    def logits(self, i: int):
        return self._do("logits", i)

    def nextn_rows(self, n: int):
        return self._do("nextn_rows", n)

    def seq_rm(self, seq_id: int, p0: int, p1: int = -1) -> bool:
        return self._do("seq_rm", seq_id, p0, p1)

    def seq_pos_max(self, seq_id: int) -> int:
        return self._do("seq_pos_max", seq_id)

    def clear(self) -> None:
        self._do("clear")

    def state_get(self, seq_id: int) -> bytes:
        return self._do("state_get", seq_id)

    def state_set(self, seq_id: int, data: bytes) -> None:
        self._do("state_set", seq_id, data)

    def close(self) -> None:
        if not self.closed and not self.rt.failed and self.rt._worker is not None:
            with contextlib.suppress(ShardError):
                self.rt._request(("free", self.handle))
        self.closed = True

    def __enter__(self) -> RemoteContext:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class RangedRuntime:
    """A trunk (and optional MTP sidecar) on RPC shards, driven from a worker process.

    ``endpoints`` are the shards, one per plan range, in order; with ``shards=`` (a
    `LocalShards`) they default to its endpoints and a lost shard is diagnosed from its
    processes. ``relay=True`` puts a counting relay in front of every shard.

    ``trunk`` / ``sidecar`` (dicts) describe the loaded models: n_vocab, n_embd,
    n_embd_out, n_layer, placement (layer -> endpoint, from upstream's log), buffers."""

    def __init__(self, trunk: str | Path, plan: ShardPlan | str,
                 endpoints: Sequence[str] | None = None, *, sidecar: str | Path | None = None,
                 shards: LocalShards | None = None, relay: bool = True,
                 call_timeout_s: float = 120.0, load_timeout_s: float = 600.0,
                 probe_timeout_s: float = 5.0, allow_remote: bool = False) -> None:
        if endpoints is None:
            if shards is None:
                raise PlanError("give endpoints or shards=LocalShards(...)")
            endpoints = shards.endpoints
        self.endpoints = list(endpoints)
        for ep in self.endpoints:
            parse_endpoint(ep, allow_remote=allow_remote)
        self.plan = plan if isinstance(plan, ShardPlan) else ShardPlan.parse(plan)
        if len(self.endpoints) != self.plan.n_shards:
            raise PlanError(f"plan {self.plan} has {self.plan.n_shards} shards but "
                            f"{len(self.endpoints)} endpoints were given")
        for ep in self.endpoints:  # a clear error naming the shard, before anything starts
            probe(ep, timeout_s=probe_timeout_s, allow_remote=allow_remote)
        self.shards = shards
        self.call_timeout_s = call_timeout_s
        self.failed: str | None = None
        self.tokens: dict[str, int] = {}
        self.steps: dict[str, int] = {}
        self._frames: list[dict] = []
        self._worker: subprocess.Popen | None = None
        self._conn: Connection | None = None
        self._lock = threading.RLock()
        self._tmp = tempfile.TemporaryDirectory(prefix="mtplib-ranged-")
        self.worker_log = Path(self._tmp.name) / "worker.log"
        from mtplib.relay import CountingRelay, RelaySet

        self.relays = RelaySet([CountingRelay(ep, allow_remote=allow_remote)
                                for ep in self.endpoints] if relay else [])
        client_eps = [r.endpoint for r in self.relays.relays] if relay else self.endpoints
        self.client_endpoints = client_eps
        _live.add(self)
        try:
            self._start_worker()
            with self.step("load"):
                info = self._request(("open", dict(
                    trunk=str(trunk), plan=str(self.plan), endpoints=client_eps,
                    sidecar=str(sidecar) if sidecar is not None else None,
                    allow_remote=allow_remote)), timeout_s=load_timeout_s)
            back = dict(zip(client_eps, self.endpoints, strict=True))
            for m in (info["trunk"], info["sidecar"]):
                if m:
                    m["placement"] = {il: back.get(ep, ep) for il, ep in m["placement"].items()}
                    for b in m["buffers"]:
                        b["endpoint"] = back.get(b["endpoint"], b["endpoint"])
            self.trunk, self.sidecar = info["trunk"], info["sidecar"]
        except BaseException:
            self.close()
            raise

    # -- worker plumbing ----------------------------------------------------------------
    def _start_worker(self) -> None:
        parent, child = socket.socketpair()
        # the parent's import path, so functions given to call() unpickle in the worker
        path = os.pathsep.join(p for p in sys.path if p and os.path.isdir(p))
        env = dict(os.environ, GGML_NO_BACKTRACE="1", PYTHONUNBUFFERED="1", PYTHONPATH=path)
        try:
            self._worker = _spawn(
                [sys.executable, "-c", "from mtplib.shards import _worker_main; _worker_main()",
                 str(child.fileno()), str(os.getpid())],
                log_path=self.worker_log, env=env, pass_fds=[child.fileno()])
        finally:
            child.close()
        self._conn = Connection(parent.detach())

    def _request(self, msg: tuple, *, timeout_s: float | None = None):
        with self._lock:
            if self.failed:
                raise SessionFailedError(f"session failed earlier: {self.failed}")
            if self._conn is None:
                raise ShardError("runtime is closed")
            timeout_s = self.call_timeout_s if timeout_s is None else timeout_s
            what = msg[2] if msg[0] == "ctx" else msg[0]
            deadline = time.monotonic() + timeout_s
            try:
                self._conn.send(msg)
            except OSError:
                self._fail_lost(what)
            while True:
                try:
                    ready = self._conn.poll(min(0.2, max(deadline - time.monotonic(), 0)))
                    reply = self._conn.recv() if ready else None
                except (EOFError, OSError):
                    self._fail_lost(what)
                if reply is None:
                    if self._worker.poll() is not None:
                        self._fail_lost(what)
                    if time.monotonic() > deadline:
                        self._fail(f"no reply to {what} within {timeout_s:.0f} s (a shard hung?); "
                                   "the client process was killed; session failed", ShardError)
                    continue
                kind = reply[0]
                if kind == "ok":
                    return reply[1]
                if kind == "err":
                    raise reply[1]
                if kind == "step_begin":
                    self._step_enter(reply[1])
                elif kind == "step_end":
                    self._step_exit(reply[1], reply[2])
                try:
                    self._conn.send(("ack",))
                except OSError:
                    self._fail_lost(what)

    def _fail(self, reason: str, exc_type=ShardLostError):
        self.failed = reason
        self._stop_worker()
        raise exc_type(reason)

    def _fail_lost(self, what: str):
        rc = None
        if self._worker is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                rc = self._worker.wait(timeout=5)
        lost = self.lost_shards()
        note = ""
        for line in _tail(self.worker_log, 4000).splitlines():
            if any(k in line for k in ("GGML_ASSERT", "GGML_ABORT", "RPC server", "Error",
                                       "error")):
                note = line.strip()
        how = ("killed by signal " + signal.Signals(-rc).name if rc is not None and rc < 0
               else f"exit code {rc}")
        if lost:
            names = ", ".join(f"shard {i} ({self.endpoints[i]})" for i in lost)
            reason = (f"{names} of plan {self.plan} lost during {what}: the RPC client "
                      f"process ended ({how}"
                      + ("; upstream aborts its RPC client on a lost connection"
                         if rc == -signal.SIGABRT else "")
                      + (f": {note!r}" if note else "") + "); session failed: restart the "
                      "shard and open a new session (re-prefill) to resume")
        else:
            reason = (f"the RPC client process died during {what} ({how}"
                      + (f": {note!r}" if note else "") + "); every shard still answers; "
                      "session failed")
        self._fail(reason, ShardLostError if lost else ShardError)

    def lost_shards(self) -> list[int]:
        """Indices of shards seen lost: dead local processes, relays closed by the shard,
        else endpoints that no longer answer."""
        if self.shards is not None:
            dead = [i for i, ok in enumerate(self.shards.alive()) if not ok]
            if dead:
                return dead
        by_relay = [i for i, r in enumerate(self.relays.relays) if r.lost_by_shard()]
        if by_relay:
            return by_relay
        out = []
        for i, ep in enumerate(self.endpoints):
            try:
                probe(ep, timeout_s=0.5)
            except ShardError:
                out.append(i)
        return out

    def _stop_worker(self) -> None:
        if self._conn is not None:
            with contextlib.suppress(OSError):
                self._conn.close()
            self._conn = None
        if self._worker is not None:
            _kill_group(self._worker, grace_s=1.0)

    # -- steps and bytes ----------------------------------------------------------------
    def _step_enter(self, label: str) -> None:
        stack = contextlib.ExitStack()
        stack.enter_context(self.relays.step(label))
        self._frames.append({"label": label, "decoded": 0, "stack": stack})

    def _step_exit(self, label: str, n_tokens: int | None) -> None:
        f = self._frames.pop()
        f["stack"].close()
        n = f["decoded"] if n_tokens is None else int(n_tokens)
        self.steps[label] = self.steps.get(label, 0) + 1
        self.tokens[label] = self.tokens.get(label, 0) + n

    @contextlib.contextmanager
    def step(self, label: str, n_tokens: int | None = None) -> Iterator[None]:
        """Count the shard bytes of the block under ``label`` (the innermost step wins);
        per-token figures divide by ``n_tokens``, else by the tokens decoded inside."""
        self._step_enter(label)
        try:
            yield
        finally:
            self._step_exit(label, n_tokens)

    @contextlib.contextmanager
    def _auto_step(self, ctx: RemoteContext, n: int) -> Iterator[None]:
        """A decode outside any step is labelled by itself: (mtp_)prefill for a batch of
        several tokens, (mtp_)decode for one."""
        if self._frames:
            self._frames[-1]["decoded"] += n
            yield
            return
        label = ("mtp_" if ctx.mtp else "") + ("prefill" if n > 1 else "decode")
        with self.step(label, n_tokens=n):
            yield

    def reset_counts(self) -> None:
        """Start counting seam bytes afresh (e.g. per measured generation)."""
        self.relays._quiesce()
        for r in self.relays.relays:
            r.reset()
        self.tokens.clear()
        self.steps.clear()

    def seam_report(self, dtype: str = "f32") -> dict:
        """Bytes on all shard connections per step label, per token, next to the
        contract's minimum (mtplib.contract.seam_bytes_per_token x (n_shards - 1) seams)."""
        from mtplib.contract import DType, ModelDims, seam_bytes_per_token

        dims = ModelDims(n_embd=self.trunk["n_embd"], n_vocab=self.trunk["n_vocab"])
        mins = seam_bytes_per_token(dims, DType(dtype))
        n_seams = self.plan.n_shards - 1
        per_label = self.relays.by_label()
        zero = {"total": 0, "up": 0, "down": 0, "data": 0, "graph": 0, "control": 0,
                "unparsed": 0, "per_shard": [0] * len(self.relays.relays)}
        steps = {}
        for label in sorted(set(per_label) | set(self.steps)):
            c = per_label.get(label, zero)
            n_tok = self.tokens.get(label, 0)
            key = {"prefill": "prefill_token", "decode": "decode_token"}.get(label)
            row = {"bytes": c["total"], "up": c["up"], "down": c["down"],
                   "data": c["data"], "graph": c["graph"], "control": c["control"],
                   "unparsed": c["unparsed"], "per_shard": c["per_shard"],
                   "steps": self.steps.get(label, 0), "tokens": n_tok,
                   "bytes_per_token": c["total"] / n_tok if n_tok else None,
                   "data_bytes_per_token": c["data"] / n_tok if n_tok else None}
            if key:
                m = mins[key] * n_seams
                row["contract_min_per_token"] = m
                row["ratio"] = (row["bytes_per_token"] / m) if m and n_tok else None
                row["data_ratio"] = (row["data_bytes_per_token"] / m) if m and n_tok else None
            steps[label] = row
        run_labels = [k for k in steps if k not in ("load", "other")]
        return {
            "plan": str(self.plan), "n_seams": n_seams, "dtype": dtype,
            "contract_min_per_seam": {k: mins[k] for k in ("prefill_token", "decode_token")},
            "seam_bytes": sum(steps[k]["bytes"] for k in run_labels),
            "load_bytes": steps.get("load", {}).get("bytes", 0),
            "steps": steps,
        }

    def seam_metrics(self) -> dict:
        """The compact form `mtplib generate --plan` reports: total bytes on the shard
        connections while generating, per token per step kind, and the contract's
        minimum for the same plan."""
        rep = self.seam_report()
        out = {"seam_bytes": rep["seam_bytes"], "seam_bytes_per_token": {},
               "seam_data_bytes_per_token": {}, "seam_contract_min_per_token": {},
               "seam_ratio": {}}
        for label, row in rep["steps"].items():
            if row["tokens"] and label not in ("load", "setup", "other"):
                out["seam_bytes_per_token"][label] = row["bytes_per_token"]
                out["seam_data_bytes_per_token"][label] = row["data_bytes_per_token"]
                if "contract_min_per_token" in row:
                    out["seam_contract_min_per_token"][label] = row["contract_min_per_token"]
                    out["seam_ratio"][label] = row["ratio"]
        return out

    # -- contexts and calls -------------------------------------------------------------
    def context(self, cfg=None, *, mtp: bool = False) -> RemoteContext:
        """A context on the trunk (or, ``mtp=True``, on the sidecar: an MTP context)."""
        from dataclasses import asdict

        from mtplib.runtime.model import ContextConfig

        cfg = cfg or ContextConfig()
        if mtp and not cfg.mtp:
            cfg = ContextConfig(**{**asdict(cfg), "mtp": True})
        if cfg.mtp and not self.sidecar:
            raise ShardError("no MTP sidecar was loaded (RangedRuntime(..., sidecar=...))")
        with self.step("setup"):
            handle, info = self._request(("context", asdict(cfg.validate())))
        for c in info["caches"]:
            c["endpoint"] = self._back(c["endpoint"])
        for b in info["buffers"]:
            b["endpoint"] = self._back(b["endpoint"])
        return RemoteContext(self, handle, info)

    def _back(self, ep: str | None) -> str | None:
        return dict(zip(self.client_endpoints, self.endpoints, strict=True)).get(ep, ep)

    def call(self, fn: Callable, *args, timeout_s: float | None = None, **kwargs):
        """Run module-level ``fn(models, *args, **kwargs)`` in the worker, where
        ``models`` has ``.trunk``, ``.sidecar`` (Model) and ``.contexts`` (handle ->
        Context); label steps inside with `worker_step`."""
        return self._request(("call", fn, args, kwargs), timeout_s=timeout_s)

    def log_tail(self, n: int = 200) -> list[str]:
        return self._request(("log", n))

    def close(self) -> None:
        if self._conn is not None and not self.failed and self._worker is not None \
                and self._worker.poll() is None:
            with contextlib.suppress(Exception):
                self._conn.send(("close",))
                if self._conn.poll(5):
                    self._conn.recv()
        self._stop_worker()
        self.relays.close()
        _live.discard(self)
        with contextlib.suppress(OSError):
            self._tmp.cleanup()

    def __enter__(self) -> RangedRuntime:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# -- the worker (client side, in its own process) ---------------------------------------
_worker_conn: Connection | None = None


@contextlib.contextmanager
def worker_step(label: str, n_tokens: int | None = None) -> Iterator[None]:
    """Inside a function run by `RangedRuntime.call`: count the block's shard bytes under
    ``label`` (the parent switches the relays' label, synchronously). A no-op elsewhere."""
    conn = _worker_conn
    if conn is None:
        yield
        return
    conn.send(("step_begin", label))
    conn.recv()
    try:
        yield
    finally:
        conn.send(("step_end", label, n_tokens))
        conn.recv()


class _Models:
    def __init__(self) -> None:
        self.trunk = self.sidecar = None
        self.contexts: dict = {}
        self._next = 1


def _model_info(m, placement: dict, buffers: list) -> dict:
    from mtplib.runtime.rpc import endpoint_of_buffer

    return {"n_vocab": m.n_vocab, "n_embd": m.n_embd, "n_embd_out": m.n_embd_out,
            "n_layer": m.n_layer, "size_bytes": m.size_bytes, "placement": placement,
            "buffers": [dict(b, endpoint=endpoint_of_buffer(b["buffer"])) for b in buffers]}


def _handle(models: _Models, msg: tuple):
    from mtplib.runtime.model import Context, ContextConfig
    from mtplib.runtime.rpc import (
        buffer_lines,
        cache_placement,
        endpoint_of_buffer,
        log_capture,
        open_ranged,
    )


    op = msg[0]
    if op == "open":
        kw = msg[1]
        t, s = open_ranged(kw["trunk"], kw["plan"], kw["endpoints"], sidecar=kw["sidecar"],
                           allow_remote=kw["allow_remote"])
        models.trunk, models.sidecar = t, s
        side = None if s is None else _model_info(s, s.placement, s.load_buffers)
        return {"trunk": _model_info(t, t.placement, t.load_buffers), "sidecar": side}
    if op == "context":
        cfg = ContextConfig(**msg[1])
        model = models.sidecar if cfg.mtp else models.trunk
        with log_capture() as lines:
            ctx = Context(model, cfg)
        h = models._next
        models._next += 1
        models.contexts[h] = ctx
        names = getattr(models.trunk, "device_endpoints", {})
        info = {k: getattr(ctx, k) for k in ("n_ctx", "n_batch", "n_ubatch", "n_seq_max",
                                             "n_rs_seq", "n_vocab", "width")}
        info.update(mtp=cfg.mtp, cfg=msg[1], caches=cache_placement(lines, names),
                    buffers=[dict(b, endpoint=endpoint_of_buffer(b["buffer"]))
                             for b in buffer_lines(lines)])
        return h, info
    if op == "ctx":
        _, h, method, args, kwargs = msg
        ctx = models.contexts[h]
        out = getattr(ctx, method)(*args, **kwargs)
        if method == "decode":
            # upstream's decode returns with the shards still computing (the logits are
            # fetched at the next read): wait here, so a step's bytes are all in the step
            ctx.llama.llama_synchronize(ctx.ptr)
            return ctx.last_n_outputs, ctx.last_decode_len
        return out
    if op == "free":
        models.contexts.pop(msg[1]).close()
        return None
    if op == "call":
        _, fn, args, kwargs = msg
        return fn(models, *args, **kwargs)
    if op == "log":
        from mtplib.runtime.lib import LOG_TAIL

        return list(LOG_TAIL)[-int(msg[1]):]
    raise ValueError(f"unknown request {op!r}")


def _worker_main() -> None:
    """Entry point of the client worker: ``python -c ... FD PARENT_PID``."""
    global _worker_conn
    fd, parent = int(sys.argv[1]), int(sys.argv[2])
    die_with_parent(parent)
    conn = _worker_conn = Connection(fd)
    models = _Models()
    import pickle

    while True:
        try:
            raw = conn.recv_bytes()
        except (EOFError, OSError):
            break
        try:
            msg = pickle.loads(raw)
        except Exception as e:  # noqa: BLE001 - e.g. a function this process cannot import
            conn.send(("err", UpstreamError(f"the client worker cannot unpickle the request: "
                                            f"{type(e).__name__}: {e}")))
            continue
        if msg[0] == "close":
            for c in models.contexts.values():
                c.close()
            for m in (models.sidecar, models.trunk):
                if m is not None:
                    m.close()
            with contextlib.suppress(OSError):
                conn.send(("ok", None))
            break
        try:
            reply = ("ok", _handle(models, msg))
        except Exception as e:  # noqa: BLE001 - every error goes back to the caller
            try:
                pickle.dumps(e)
                reply = ("err", e)
            except Exception:  # noqa: BLE001
                reply = ("err", UpstreamError(f"{type(e).__name__}: {e}"))
        conn.send(reply)
    os._exit(0)


# -- `mtplib generate --plan` -----------------------------------------------------------
def _tokenize(models: _Models, text: str) -> list[int]:
    return models.trunk.tokenize(text)


def _detokenize(models: _Models, tokens: list[int]) -> str:
    return models.trunk.detokenize(tokens)


def run_generate_command(a) -> int:
    """`mtplib generate --plan PLAN [--endpoints ...]` (called from commands/generate)."""
    import json

    from mtplib.ranged import generate_ranged as generate_ranged_mtp
    from mtplib.runtime.sampling import Sampler
    from mtplib.runtime.speculative import EngineOptions

    eps = None
    if a.endpoints:
        eps = [e.strip() for e in a.endpoints.split(",") if e.strip()]
        for e in eps:
            parse_endpoint(e, allow_remote=getattr(a, "allow_remote", False))
    k = (3 if a.draft is None else a.draft) if a.mtp else 0
    opts = EngineOptions(k=k, n_ctx=a.ctx, n_batch=a.batch, n_ubatch=a.ubatch,
                         n_threads=a.threads, kv_type=a.kv_type, flash_attn=a.flash_attn,
                         swa_full=a.swa_full == "on",
                         sampler=Sampler(a.temp, a.top_p, a.seed), trace=a.trace)
    prompt = a.tokens if a.tokens is not None else a.prompt
    out = generate_ranged_mtp(a.model, prompt, a.n, plan=a.plan, sidecar=a.mtp, opts=opts,
                              endpoints=eps, shard_threads=a.shard_threads,
                              allow_remote=getattr(a, "allow_remote", False))
    if a.json:
        print(json.dumps(out))
        return 0
    m = out["metrics"]
    print("tokens:", " ".join(map(str, out["tokens"])))
    if "text" in out:
        print("text:  ", out["text"])
    print(f"ttft {m['ttft_s']:.4f} s, decode {m['decode_tok_s'] or 0:.1f} tok/s, plan {m['plan']}")
    per = ", ".join(f"{k} {v:.0f}" for k, v in m["seam_bytes_per_token"].items())
    print(f"seam bytes {m['seam_bytes']} (per token: {per}; contract minimum "
          + ", ".join(f"{k} {v}" for k, v in m["seam_contract_min_per_token"].items()) + ")")
    return 0
