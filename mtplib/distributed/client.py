"""The contained ranged runtime (parent side).

`RangedRuntime(trunk, plan, endpoints, sidecar=...)`: the ranged client, run in a worker
subprocess (`mtplib.distributed.worker`). Upstream's RPC client aborts its process
(GGML_ABORT "Remote RPC server crashed or returned malformed response") when a shard
connection is lost; in the worker that abort ends only the worker, and this side raises
`ShardLostError` naming the shard and marks the session failed. `RemoteContext` has the
methods of `mtplib.runtime.model.Context`, so `greedy()` and similar loops run on it
unchanged. A `CountingRelay` in front of every shard counts the real bytes per labelled
step (``with rt.step("verify", n_tokens=k + 1): ...``); `seam_report()` sets them next to
the contract's minimum. Code that must run next to the models (e.g. a whole speculative
loop) can run inside the worker with ``rt.call(module_level_fn, ...)`` and label its steps
there with `worker_step`.

Timeouts are by liveness, not total time: a call fails only after ``silence_timeout_s``
(default 15 s, or $MTPLIB_SHARD_SILENCE_S) without progress. Progress is any of: a step
boundary or a finished decode in the worker (its heartbeat carries a counter), bytes on a
shard connection (the relays), or CPU time used by a local shard process. A slow but
healthy shard keeps one of these moving; a stopped one (no bytes back to a pending
request) is named. A dead worker, an upstream assert in the worker, and a lost shard are
told apart (`_fail_lost`). Shards this process did not start show no CPU: for them one
shard computation longer than the limit reads as a hang (raise the limit for such shards).
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from multiprocessing.connection import Connection
from pathlib import Path

from mtplib import envs
from mtplib.contract.labels import PLACEMENTS, SEAM_CHOICES, Placement, Seam, StepKind
from mtplib.contract.types import NO_DRAFT
from mtplib.distributed.probe import probe_shards
from mtplib.distributed.processes import (
    LIVE,
    LocalShards,
    kill_group,
    log_tail,
    proc_cpu_state,
    spawn_child,
)
from mtplib.distributed.relay import WanLink, summed
from mtplib.distributed.shard_report import ProbedShard, answers_alloc_sizes, require_shard_mtp
from mtplib.distributed.tls import TlsConfig
from mtplib.distributed.worker import HEARTBEAT_S
from mtplib.errors import InputError
from mtplib.ownership.plan import PlanError, ShardPlan, check_endpoints
from mtplib.runtime.links import default_peer_links
from mtplib.runtime.request import DEFAULT_SEAM, RunRequest, build_request
from mtplib.runtime.rpc import ShardError, client_proto_minor, parse_endpoint

#: where the MTP block runs in a ranged run: on the tail shard (next to the output head) or
#: in the client process, next to the sampler (a draft then costs no shard round trip)
MTP_PLACEMENTS = PLACEMENTS  # mtplib.contract.labels.Placement


class SessionFault(ShardError):
    """A failure that ends the session. ``shards``: the plan indices of the shards at
    fault (empty when none is known: the client worker itself failed)."""

    def __init__(self, message: str, shards: Sequence[int] = ()) -> None:
        super().__init__(message)
        self.shards = tuple(shards)


class ShardLostError(SessionFault):
    """A shard connection was lost mid-session; the session is failed."""


class SessionFailedError(SessionFault):
    """The session already failed (a shard was lost or hung); open a new one
    (`RangedMTP.reconnect`)."""


#: default silence limit (s): a call fails after this long without progress
SILENCE_S = 15.0


def silence_default() -> float:
    """$MTPLIB_SHARD_SILENCE_S if set (seconds > 0), else SILENCE_S."""
    v = envs.shard_silence_s()
    return SILENCE_S if v is None else v


_CLK_TCK = os.sysconf("SC_CLK_TCK")





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

    def logits_all(self, n: int):
        return self._do("logits_all", n)

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


def resolve_seam(seam: str, shard_info: Sequence[ProbedShard], *, tls: bool,
                 client_minor: int) -> tuple[str, str]:
    """(the seam to run, why) for what was asked (`SEAM_CHOICES`). ``ring`` needs this
    build and every shard on RPC 7.2 (patches/0007), and with ``tls`` every shard's gateway
    carrying peer links (its ready line: `ProbedShard.peer_links`; the gateways then speak
    mutual TLS to each other); ``auto`` is the ring where all of that holds, else the star.
    An asked ``ring`` with an older shard runs: upstream keeps each pair that cannot ring
    on the star (the per-link report says which); one through a gateway that carries no
    peer links is refused (an older gateway would pass a peer link in the clear)."""
    if seam not in SEAM_CHOICES:
        raise InputError(f"seam must be one of {', '.join(SEAM_CHOICES)}, got {seam!r}")
    if seam == Seam.STAR:
        return Seam.STAR.value, "asked"
    old = [i for i, info in enumerate(shard_info) if info.version[1] < 2]
    closed = [i for i, info in enumerate(shard_info) if not info.peer_links]
    if client_minor < 2:
        why = f"this upstream build speaks RPC 7.{client_minor} (the ring is patches/0007, 7.2)"
    elif tls and closed:
        many = len(closed) > 1
        why = (f"the TLS gateway{'s' if many else ''} of shard{'s' if many else ''} "
               f"{', '.join(map(str, closed))} carr{'y' if many else 'ies'} no peer links (an "
               "older mtplib, or a shard.pem not valid as a TLS client certificate: `mtplib "
               "tls init` issues one that is)")
    elif len(shard_info) < 2:
        return (seam if seam == Seam.RING else Seam.STAR.value), "one shard: no seam"
    elif old:
        why = (f"shard{'s' if len(old) > 1 else ''} {', '.join(map(str, old))} speak"
               f"{'' if len(old) > 1 else 's'} RPC 7.{min(shard_info[i].version[1] for i in old)}"
               " (the ring needs 7.2)")
    else:
        return Seam.RING.value, "every shard speaks RPC 7.2"
    if seam == Seam.RING:
        if client_minor < 2 or (tls and closed):
            raise InputError(f"seam ring: {why}")
        return Seam.RING.value, why + ": those pairs stay on the star"
    return Seam.STAR.value, why


def seam_pairs(endpoints: Sequence[str], seam: str, why: str,
               links: Sequence[dict]) -> list[dict[str, str | None]]:
    """Each consecutive shard pair of the plan (``from`` -> ``to``, shard endpoints) with
    the seam that ran between them and why, so a result says it even where upstream logged
    nothing: under the star (``GGML_RPC_SEAM=star``) upstream's client sets up no link, and
    the pair ran the star for the runtime's reason (``why``, e.g. a shard on RPC 7.1);
    under the ring a pair is what upstream's client logged for it (``links``: a ring only
    where both shards speak 7.2 and the link opened, else the star and upstream's reason),
    and ``None`` until its first copy (not warmed)."""
    logged = {(x["from"], x["to"]): x for x in links}
    out: list[dict[str, str | None]] = []
    for a, b in zip(endpoints[:-1], endpoints[1:], strict=True):
        if seam == Seam.STAR:
            out.append({"from": a, "to": b, "seam": Seam.STAR.value, "why": why})
        elif (a, b) in logged:
            x = logged[(a, b)]
            out.append({"from": a, "to": b, "seam": x["seam"],
                        "why": x["why"] or "both shards speak RPC 7.2: the link opened"})
        else:
            out.append({"from": a, "to": b, "seam": None,
                        "why": "no boundary copy between them yet"})
    return out


class RangedRuntime:
    """A trunk (and optional MTP sidecar) on RPC shards, driven from a worker process.

    ``endpoints`` are the shards, one per plan range, in order; with ``shards=`` (a
    `LocalShards`) they default to its endpoints and a lost shard is diagnosed from its
    processes. ``relay=True`` puts a counting relay in front of every shard.

    ``trunk`` / ``sidecar`` (dicts) describe the loaded models: n_vocab, n_embd,
    n_embd_out, n_layer, placement (layer -> endpoint, from upstream's log), buffers.

    ``silence_timeout_s`` (default $MTPLIB_SHARD_SILENCE_S, else 15 s): a call fails after
    this long without progress (see the module doc); loading allows ``load_timeout_s``
    of silence. ``call_timeout_s``: an optional cap on a call's total time (None: none).

    ``tls`` (a `TlsConfig`): the relays speak mutual TLS to the shards' gateways
    (`mtplib shard serve --tls`); any address is allowed then. Without it endpoints are
    loopback only, unless ``insecure_plaintext`` (upstream's RPC in the clear). Every shard
    is probed first (`probe_shards`: answers checked, a shard given twice named).

    ``trunk``: a ranged `RunRequest` (`RangedMTP` gives its own: the plan, endpoints,
    sidecar, WAN links and TLS are read from it, checked when it was built), or the
    trunk's path with ``plan`` and the rest, made into one here by `build_request` (MTP
    off: the draft length belongs to the caller's contexts). The request goes to the
    worker pickled, as the object, with its headers, so the worker parses and reads none.
    ``headers`` (trunk, sidecar GGUFHeader): as the caller read them (path form only).

    ``seam`` (`SEAM_CHOICES`, default `DEFAULT_SEAM`, auto: the ring where this build and
    every shard speak RPC 7.2 and, under TLS, every shard's gateway carries peer links,
    else the star): how boundary values reach the next shard
    (`resolve_seam`; patches/0007's ring sends them shard to shard, each shard dialing the
    next at the endpoint the client dials for it: its relay on loopback, else the shard
    itself); `seam_summary` says what ran, per shard pair."""

    def __init__(self, trunk: str | Path | RunRequest, plan: ShardPlan | str | None = None,
                 endpoints: Sequence[str] | None = None, *, sidecar: str | Path | None = None,
                 shards: LocalShards | None = None, relay: bool = True,
                 silence_timeout_s: float | None = None,
                 call_timeout_s: float | None = None, load_timeout_s: float = 600.0,
                 probe_timeout_s: float = 5.0, insecure_plaintext: bool = False,
                 wan: Sequence[WanLink] | None = None, mtp_placement: str = Placement.TAIL,
                 tls: TlsConfig | None = None, headers: tuple | None = None,
                 seam: str | None = None) -> None:
        if mtp_placement not in MTP_PLACEMENTS:
            raise PlanError(f"mtp_placement must be one of {', '.join(MTP_PLACEMENTS)}, "
                            f"got {mtp_placement!r}")
        if endpoints is None and shards is None and not (
                isinstance(trunk, RunRequest) and trunk.endpoints is not None):
            raise PlanError("give endpoints or shards=LocalShards(...)")
        if isinstance(trunk, RunRequest):
            if any(v is not None for v in (plan, endpoints, sidecar, wan, tls, headers, seam)) \
                    or insecure_plaintext:
                raise TypeError("RangedRuntime(request): the request holds the plan, "
                                "endpoints, sidecar, WAN links, TLS and seam")
            request = trunk
        else:  # the path form: this runtime's own request, built (and checked) once here
            request = build_request(trunk, sidecar=sidecar, draft=NO_DRAFT, plan=plan,
                                    endpoints=endpoints, wan=wan, tls=tls,
                                    insecure_plaintext=insecure_plaintext,
                                    seam=DEFAULT_SEAM if seam is None else seam,
                                    headers=headers or (None, None))
        if not request.ranged:
            raise PlanError("a RangedRuntime needs a ranged request (one with a plan)")
        #: the run's request (sent to the worker as the object)
        self.request = request
        tls, self.plan = request.tls, request.plan
        if tls is not None and shards is not None and shards.tls != tls:
            raise PlanError("tls= differs from the local shards' TLS directory")
        if tls is not None and not relay:
            raise PlanError("TLS runs in the relays (relay=True)")
        self.tls = tls
        allow_remote = request.allow_remote
        self._allow_remote = allow_remote
        if request.endpoints is not None:  # checked with the request (`build_request`)
            self.endpoints = list(request.endpoints)
        else:  # the local shards': the run's one count check is this one
            self.endpoints = check_endpoints(self.plan, shards.endpoints)
            for ep in self.endpoints:
                parse_endpoint(ep, allow_remote=allow_remote)
        self.mtp_placement = mtp_placement
        wan = list(request.wan)
        if not relay and any(w.active for w in (*wan, *(request.peer_wan or ()))):
            raise PlanError("WAN emulation needs the relays (relay=True)")
        # a clear error naming the shard, before anything starts
        self.shard_info = probe_shards(self.endpoints, tls=tls, timeout_s=probe_timeout_s,
                                       allow_remote=allow_remote)
        self.seam_requested = request.seam
        self.seam, self.seam_why = resolve_seam(self.seam_requested, self.shard_info,
                                                tls=tls is not None,
                                                client_minor=client_proto_minor())
        self.shards = shards
        self.silence_timeout_s = (silence_default() if silence_timeout_s is None
                                  else float(silence_timeout_s))
        if not 0 < self.silence_timeout_s < float("inf"):
            raise InputError(f"silence_timeout_s must be > 0 s, got {silence_timeout_s}")
        self.call_timeout_s = call_timeout_s
        #: local shard index -> when `faults` first saw its process stopped (monotonic)
        self._stopped_since: dict[int, float] = {}
        self.failed: str | None = None
        #: the shards named when the session failed (plan indices)
        self.failed_shards: tuple[int, ...] = ()
        self.tokens: dict[str, int] = {}
        self.steps: dict[str, int] = {}
        self._frames: list[dict] = []
        self._worker: subprocess.Popen | None = None
        self._conn: Connection | None = None
        self._lock = threading.RLock()
        self._tmp = tempfile.TemporaryDirectory(prefix="mtplib-ranged-")
        self.worker_log = Path(self._tmp.name) / "worker.log"
        from mtplib.distributed.relay import CountingRelay, RelaySet

        # a CPU shard's allocation sizes are answered by its relay, not over the link
        answer = [answers_alloc_sizes(info) for info in self.shard_info]
        self.relays = RelaySet([CountingRelay(ep, allow_remote=allow_remote, tls=tls,
                                              answer_alloc_sizes=a)
                                for ep, a in zip(self.endpoints, answer, strict=True)]
                               if relay else [])
        client_eps = [r.endpoint for r in self.relays.relays] if relay else self.endpoints
        self.client_endpoints = client_eps
        LIVE.add(self)
        try:
            self._start_worker()
            with self.step("load"):
                # the request as the object: its plan parsed and its headers read once,
                # in this process; the worker parses and reads none of them
                info = self._request(("open", dict(
                    request=request, endpoints=client_eps,
                    allow_remote=allow_remote and not relay, mtp_placement=mtp_placement)),
                    timeout_s=load_timeout_s)
            back = dict(zip(client_eps, self.endpoints, strict=True))
            for m in (info["trunk"], info["sidecar"]):
                if m:
                    m["placement"] = {il: back.get(ep, ep) for il, ep in m["placement"].items()}
                    for b in m["buffers"]:
                        b["endpoint"] = back.get(b["endpoint"], b["endpoint"])
            self.trunk, self.sidecar = info["trunk"], info["sidecar"]
            # loading runs over loopback; the emulated WAN applies from here on
            # (the ring's peer link into shard i, from shard i - 1, passes shard i's relay)
            peers = [None, *(request.peer_wan or default_peer_links(wan))]
            for r, link, peer in zip(self.relays.relays, wan if relay else [],
                                     peers if relay else [], strict=True):
                r.set_link(link, peer)
        except BaseException:
            self.close()
            raise

    # -- worker plumbing ----------------------------------------------------------------
    def _start_worker(self) -> None:
        parent, child = socket.socketpair()
        # the parent's import path, so functions given to call() unpickle in the worker
        # (less the patched build's folder: the child's own mtplib.runtime puts it back
        # only when $MTPLIB_UPSTREAM says so, so the worker loads the build it reports)
        from mtplib.runtime import PATCHED_DIR

        path = os.pathsep.join(p for p in sys.path
                               if p and os.path.isdir(p) and Path(p) != PATCHED_DIR)
        env = dict(os.environ, GGML_NO_BACKTRACE="1", PYTHONUNBUFFERED="1", PYTHONPATH=path,
                   GGML_RPC_SEAM=self.seam)
        env.pop("GGML_RPC_PEER_ENDPOINTS", None)
        # a shard dials the next at the endpoint this client dials for it (a relay on
        # loopback: the peer link then passes it, with its WAN); a remote shard's relay is
        # local to this host, so there it dials the shard itself
        peer = [f"{c}={e}" for c, e in zip(self.client_endpoints, self.endpoints, strict=True)
                if c != e and not parse_endpoint(e, allow_remote=True)[0].startswith("127.")]
        if self.tls is not None:  # the shard's gateway dials, in mutual TLS: the shard's
            # public endpoint, or the relay's TLS peer port (a loopback shard, counted here)
            peer = [f"{r.endpoint}={r.peer_endpoint or e}"
                    for r, e in zip(self.relays.relays, self.endpoints, strict=True)]
        if peer:
            env["GGML_RPC_PEER_ENDPOINTS"] = ",".join(peer)
        try:
            self._worker = spawn_child(
                [sys.executable, "-c", "from mtplib.distributed.worker import main; main()",
                 str(child.fileno()), str(os.getpid())],
                log_path=self.worker_log, env=env, pass_fds=[child.fileno()])
        finally:
            child.close()
        self._conn = Connection(parent.detach())

    def _request(self, msg: tuple, *, timeout_s: float | None = None):
        """Send ``msg`` and wait for its reply while something makes progress; fail after
        ``timeout_s`` (default silence_timeout_s) of no progress."""
        with self._lock:
            if self.failed:
                raise SessionFailedError(f"session failed earlier: {self.failed}",
                                         self.failed_shards)
            if self._conn is None:
                raise ShardError("runtime is closed")
            silence = self.silence_timeout_s if timeout_s is None else timeout_s
            what = msg[2] if msg[0] == "ctx" else msg[0]
            t0 = last = last_beat = time.monotonic()
            seen: dict = {"flow": self._flows(), "beat": None}
            self._mark(seen, t0)
            try:
                self._conn.send(msg)
            except OSError:
                self._fail_lost(what)
            while True:
                try:
                    ready = self._conn.poll(0.2)
                    reply = self._conn.recv() if ready else None
                except (EOFError, OSError):
                    self._fail_lost(what)
                now = time.monotonic()
                if reply is None:
                    if self._worker.poll() is not None:
                        self._fail_lost(what)
                    if self._moved(seen, now):
                        last = now
                        self._mark(seen, now)
                    if now - last > silence:
                        self._fail_hung(what, silence, now - last_beat)
                    # a longer limit (loading) is for slow work, not for a stopped shard
                    if (silence > self.silence_timeout_s
                            and now - last > self.silence_timeout_s and self._stopped()):
                        self._fail_hung(what, self.silence_timeout_s, now - last_beat)
                    if self.call_timeout_s is not None and now - t0 > self.call_timeout_s:
                        self._fail(f"no reply to {what} within {self.call_timeout_s:.0f} s in "
                                   "total (call_timeout_s); the client process was killed; "
                                   "session failed", SessionFault)
                    continue
                kind = reply[0]
                if kind == "ok":
                    return reply[1]
                if kind == "err":
                    bad = [f"shard {i} ({self.endpoints[i]}) sent a malformed reply: {r.violation}"
                           for i, r in enumerate(self.relays.relays) if r.violation]
                    if bad:  # the relay cut it off; the worker only saw a closed connection
                        raise ShardError("; ".join(bad) + f" (during {what})") from reply[1]
                    raise self._named(reply[1])
                if kind == "alive":
                    last_beat = now
                    if reply[1] != seen["beat"]:
                        seen["beat"] = reply[1]
                        last = now
                        self._mark(seen, now)
                    continue  # beats are not acknowledged
                last = now
                self._mark(seen, now)
                if kind == "step_begin":
                    self._step_enter(reply[1])
                elif kind == "step_end":
                    self._step_exit(reply[1], reply[2])
                try:
                    self._conn.send(("ack",))
                except OSError:
                    self._fail_lost(what)

    def _flows(self) -> list[tuple[int, int, int]]:
        return [r.flow() for r in self.relays.relays]

    def _shard_cpu(self) -> list[tuple[int, str] | None]:
        if self.shards is None:
            return []
        return [None if p is None else proc_cpu_state(p.pid) for p in self.shards.procs]

    def _named(self, e: BaseException) -> BaseException:
        """``e`` with each relay address the worker saw replaced by the shard it stands for
        (``shard 1 (HOST:PORT)``: the address the user gave or the CLI started), and a
        stopped local shard said so."""
        if not isinstance(e, ShardError) or not e.args or not isinstance(e.args[0], str):
            return e
        msg = e.args[0]
        for i, (relay, ep) in enumerate(zip(self.client_endpoints, self.endpoints,
                                            strict=True)):
            if relay != ep and relay in msg:
                msg = msg.replace(f"shard {relay}", f"shard {i} ({ep})").replace(relay, ep)
                st = self._shard_cpu()[i] if self.shards is not None else None
                if st is not None and st[1] in "Tt":
                    msg += f"; shard {i}'s process is stopped (SIGSTOP?)"
        e.args = (msg, *e.args[1:])
        return e

    def _stopped(self) -> bool:
        """True when a local shard's process is stopped (SIGSTOP): it can make no progress."""
        return any(c is not None and c[1] in "Tt" for c in self._shard_cpu())

    def _worker_cpu(self) -> tuple[int, str] | None:
        return proc_cpu_state(self._worker.pid) if self._worker is not None else None

    def _moved(self, seen: dict, now: float) -> bool:
        """True if shard bytes flowed, a local shard computed, or the worker computed with
        no shard request pending, since the last check.

        Computing means CPU use of at least 5% of the time since the last progress (a
        shard's idle watchdog thread and the worker's heartbeat stay far below); with
        relays, only shards holding an unanswered request count (all shards if none does).
        The worker's own work (building contexts, checking the row source, the client's
        head) counts only while no shard holds a request: a worker blocked on a silent
        shard uses no CPU."""
        flow = self._flows()
        moved = [f[:2] for f in flow] != [f[:2] for f in seen["flow"]]
        seen["flow"] = flow
        if moved:
            return True
        span = max(now - seen["t"], 1e-3)

        def busy(c, p) -> bool:
            return bool(c and p and c[0] - p[0] >= 2 and (c[0] - p[0]) / _CLK_TCK >= 0.05 * span)

        cpu = self._shard_cpu()
        waiting = {i for i, f in enumerate(flow) if f[2] > 0}
        pending = waiting or set(range(len(cpu)))
        if any(i in pending and busy(c, p)
               for i, (c, p) in enumerate(zip(cpu, seen["cpu"], strict=False))):
            return True
        return not waiting and busy(self._worker_cpu(), seen.get("worker"))

    def _mark(self, seen: dict, now: float) -> None:
        """Progress now: CPU use is measured from here."""
        seen["cpu"], seen["worker"], seen["t"] = self._shard_cpu(), self._worker_cpu(), now

    def _fail_hung(self, what: str, silence: float, since_beat: float):
        """No progress for ``silence`` s: name the shard that holds a request unanswered
        (relays), or a local shard that is stopped/gone, else blame the worker."""
        hung = [i for i, f in enumerate(self._flows()) if f[2] > 0]
        states = self._shard_cpu()
        stopped = [i for i, c in enumerate(states) if c is None or c[1] in "TtZX"]
        cause = {i: "stopped (SIGSTOP?)" if states and states[i] and states[i][1] in "Tt"
                 else "no reply to a pending request" for i in hung}
        for i in stopped:
            cause.setdefault(i, "stopped (SIGSTOP?)" if states[i] and states[i][1] in "Tt"
                             else "gone")
        who = sorted(cause)
        label = self._frames[-1]["label"] if self._frames else None
        step = f" (step {getattr(label, 'value', label)!r})" if self._frames else ""
        limit = f"no progress for {silence:.0f} s during {what}{step}"
        if who:
            names = ", ".join(f"shard {i} ({self.endpoints[i]}): {cause[i]}" for i in who)
            self._fail(f"{names}, of plan {self.plan}: hung, {limit}; the client process was "
                       "killed; session failed: restart the shard and open a new session "
                       "(re-prefill) to resume", ShardLostError, who)
        w = proc_cpu_state(self._worker.pid) if self._worker is not None else None
        beats = ("its process is stopped (SIGSTOP?) and stopped sending heartbeats"
                 if w and w[1] in "Tt" else "and it stopped sending heartbeats"
                 if since_beat > 1.5 * HEARTBEAT_S else "while its heartbeat went on")
        tail = " | ".join(log_tail(self.worker_log, 600).splitlines()[-4:])
        self._fail(f"the client worker made {limit} ({beats}); no shard has a request "
                   f"pending; the client process was killed; session failed"
                   + (f"; worker log: {tail!r}" if tail else ""), SessionFault)

    def _fail(self, reason: str, exc_type: type[SessionFault] = ShardLostError,
              shards: Sequence[int] = ()):
        self.failed, self.failed_shards = reason, tuple(shards)
        self._stop_worker()
        raise exc_type(reason, self.failed_shards)

    def _fail_lost(self, what: str):
        """The worker ended: a lost shard (its process died, or it closed the connection),
        an upstream assert in the worker, or the worker itself dying, told apart."""
        rc = None
        if self._worker is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                rc = self._worker.wait(timeout=5)
        log = log_tail(self.worker_log, 4000)
        note = ""
        for line in log.splitlines():
            if any(k in line for k in ("GGML_ASSERT", "GGML_ABORT", "RPC server", "Error",
                                       "error")):
                note = line.strip()
        how = ("killed by signal " + signal.Signals(-rc).name if rc is not None and rc < 0
               else f"exit code {rc}")
        bad = [(i, r.violation) for i, r in enumerate(self.relays.relays) if r.violation]
        if bad:
            names = "; ".join(f"shard {i} ({self.endpoints[i]}) sent a malformed reply: {v}"
                              for i, v in bad)
            self._fail(f"{names}; the relay closed that connection before upstream's client "
                       f"read the reply (during {what}); session failed", ShardLostError,
                       [i for i, _ in bad])
        lost = self.lost_shards()
        client_assert = (("GGML_ASSERT" in note or "GGML_ABORT" in note)
                         and "RPC server" not in note)
        if lost and not client_assert:
            names = ", ".join(f"shard {i} ({self.endpoints[i]})" for i in lost)
            reason = (f"{names} of plan {self.plan} lost during {what}: the RPC client "
                      f"process ended ({how}"
                      + ("; upstream aborts its RPC client on a lost connection"
                         if rc == -signal.SIGABRT else "")
                      + (f": {note!r}" if note else "") + "); session failed: restart the "
                      "shard and open a new session (re-prefill) to resume")
            self._fail(reason, ShardLostError, lost)
        if client_assert:
            reason = (f"the client worker aborted during {what} on an upstream assert "
                      f"({how}): {note!r}; the shards are not at fault; session failed")
        else:
            tail = " | ".join(log.splitlines()[-4:])
            reason = (f"the client worker died during {what} ({how}); no shard was lost; "
                      "session failed" + (f"; worker log: {tail!r}" if tail else ""))
        self._fail(reason, SessionFault)

    def lost_shards(self) -> list[int]:
        """Indices of shards seen lost: dead local processes, relays closed by the shard,
        else endpoints that no longer answer."""
        if self.shards is not None:
            dead = [i for i, ok in enumerate(self.shards.alive()) if not ok]
            if dead:
                return dead
        by_relay = [i for i, r in enumerate(self.relays.relays) if r.closed_first_by_shard()]
        if by_relay:
            return by_relay
        out = []
        for i, ep in enumerate(self.endpoints):
            try:
                probe_shards([ep], tls=self.tls, timeout_s=0.5, allow_remote=self._allow_remote)
            except ShardError as e:  # "busy" is alive: it may still serve the dead worker
                if "unreachable" in str(e) or "closed the" in str(e):
                    out.append(i)
        return out

    def faults(self) -> list[tuple[int | None, str]]:
        """What is wrong now, seen without a round trip (cheap enough for every health
        check): (shard index, cause) for a local shard process gone, or stopped for the
        silence limit (seen stopped by the calls since then: a shorter stall, a shard
        stopped and continued, is not a fault, as it is not for a running call), and for a
        shard that closed its connection; (None, cause) for a dead client worker or a failed
        session. Empty: nothing seen wrong (a hung remote shard shows only at its next
        request, within the silence limit)."""
        out: list[tuple[int | None, str]] = []
        now = time.monotonic()
        if self.shards is not None:
            for i, p in enumerate(self.shards.procs):
                st = None if p is None or p.poll() is not None else proc_cpu_state(p.pid)
                if st is None or st[1] in "ZX":
                    out.append((i, "gone"))
                elif st[1] in "Tt":
                    since = self._stopped_since.setdefault(i, now)
                    if now - since >= self.silence_timeout_s:
                        out.append((i, "stopped (SIGSTOP?)"))
                    continue
                self._stopped_since.pop(i, None)
        seen = {i for i, _ in out}
        out += [(i, "closed its connection") for i, r in enumerate(self.relays.relays)
                if i not in seen and r.closed_first_by_shard()]
        seen = {i for i, _ in out}
        if self.failed:
            out += [(i, "failed") for i in self.failed_shards if i not in seen]
            if not out:
                out.append((None, f"session failed: {self.failed}"))
        elif self._worker is None or self._worker.poll() is not None:
            out.append((None, "the client worker is gone"))
        return out

    def _stop_worker(self) -> None:
        if self._conn is not None:
            with contextlib.suppress(OSError):
                self._conn.close()
            self._conn = None
        if self._worker is not None:
            kill_group(self._worker, grace_s=1.0)

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
        label = ("mtp_" if ctx.mtp else "") + (StepKind.PREFILL if n > 1 else StepKind.DECODE)
        with self.step(label, n_tokens=n):
            yield

    def reset_counts(self) -> None:
        """Start counting seam bytes afresh (e.g. per measured generation)."""
        self.relays._quiesce()
        for r in self.relays.relays:
            r.reset()
        self.tokens.clear()
        self.steps.clear()

    def seam_summary(self) -> dict:
        """Which seam ran: what was asked, what this runtime chose and why, each shard
        pair upstream's client set up so far (``links``: from/to as shard endpoints, "ring"
        or "star" and why, and for a ring pair what its peer link passes, ``peer_via``; a
        pair appears at its first copy, i.e. once warmed), each consecutive pair of the plan
        with the seam that ran there and why (``pairs``, `seam_pairs`: said under the star
        too, where upstream logs no link) and the emulated WAN of each pair's peer link
        (``peer_wan``)."""
        from mtplib.distributed.worker import seam_report

        back = dict(zip(self.client_endpoints, self.endpoints, strict=True))
        links = [dict(link, **{"from": back.get(link["from"], link["from"]),
                               "to": back.get(link["to"], link["to"])})
                 for link in self.call(seam_report)]
        via = self._peer_via()
        for link in links:
            if link["seam"] == "ring":
                link["peer_via"] = via.get(link["to"], "")
        # each shard pair's emulated peer link (``--peer-wan``, else the farther of its two
        # shards' ``--wan``: `default_peer_links`), in plan order; what a ring pair's pushes
        # passed
        peer_wan = [str(r.link_for("peer")) for r in self.relays.relays[1:]]
        return {"requested": self.seam_requested, "seam": self.seam, "why": self.seam_why,
                "links": links, "pairs": seam_pairs(self.endpoints, self.seam, self.seam_why,
                                                    links),
                "peer_wan": peer_wan}

    def _peer_via(self) -> dict[str, str]:
        """Per shard endpoint: what a peer link into that shard passes (and whether this
        client's relay counts it)."""
        out = {}
        relays = self.relays.relays or [None] * len(self.endpoints)
        for r, ep in zip(relays, self.endpoints, strict=True):
            if self.tls is not None:
                out[ep] = ("mutual TLS, gateway to this client's relay to gateway (counted)"
                           if r is not None and r.peer_endpoint else
                           "mutual TLS, gateway to gateway (not counted here)")
            elif r is not None and ep.startswith("127."):
                out[ep] = "plain RPC on loopback, through this client's relay (counted)"
            else:
                out[ep] = "plain RPC, shard to shard (not counted here)"
        return out

    def seam_report(self, dtype: str = "f32") -> dict:
        """Bytes and waits on all shard connections per step label, per token, next to the
        contract's minimum (mtplib.contract.seam_bytes_per_token x (n_shards - 1) seams);
        data bytes by class (mtplib.contract.wire) and the cache bytes that crossed."""
        from mtplib.contract import DType, ModelDims, seam_bytes_per_token
        from mtplib.contract.wire import (
            cache_tensors_on_wire,
            classify_step,
            seam_by_value,
            wire_violations,
        )

        dims = ModelDims(n_embd=self.trunk["n_embd"], n_vocab=self.trunk["n_vocab"])
        mins = seam_bytes_per_token(dims, DType(dtype))
        n_seams = self.plan.n_shards - 1
        per_label = self.relays.by_label()
        peer_label = self.relays.peer_by_label()
        n_relays = len(self.relays.relays)
        steps, classes, crossing, peer_classes = {}, {}, {}, {}
        for label in sorted(set(per_label) | set(peer_label) | set(self.steps)):
            c = per_label.get(label) or {"total": 0, "up": 0, "down": 0, "waits": 0,
                                         "data": 0, "graph": 0, "control": 0, "unparsed": 0,
                                         "graph_sends": 0,
                                         "per_shard": [0] * n_relays,
                                         "waits_per_shard": [0] * n_relays}
            per_dir = self.relays.by_tensor_dir(label)
            classes[label] = classify_step(per_dir)
            peer_dir = self.relays.peer_by_tensor_dir(label)
            peer_classes[label] = classify_step(peer_dir)
            # the contract's rule holds on every link: peer links too
            crossing[label] = cache_tensors_on_wire([*per_dir, *peer_dir])
            n_tok, n_steps = self.tokens.get(label, 0), self.steps.get(label, 0)
            key = {"prefill": "prefill_token", "decode": "decode_token"}.get(label)
            row = {"bytes": c["total"], "up": c["up"], "down": c["down"],
                   "data": c["data"], "graph": c["graph"], "control": c["control"],
                   "graph_sends": c["graph_sends"],
                   "unparsed": c["unparsed"], "per_shard": c["per_shard"],
                   "waits": c["waits"], "waits_per_shard": c["waits_per_shard"],
                   "waits_per_step": c["waits"] / n_steps if n_steps else None,
                   # what the waits were for: the command that opened each round trip
                   "waits_by_command": summed(self.relays.waits_by_command(label)),
                   # allocation-size queries the relays answered (no round trip)
                   "alloc_sizes_answered_here": sum(self.relays.answered_here(label)),
                   "classes": classes[label], "seam_values": seam_by_value(per_dir),
                   "steps": n_steps, "tokens": n_tok,
                   "bytes_per_token": c["total"] / n_tok if n_tok else None,
                   "data_bytes_per_token": c["data"] / n_tok if n_tok else None}
            if self.request.sidecar_kind == "dspark":  # its features' bytes, by direction
                from mtplib.distributed.dspark_ranged import feature_rows

                row["features"] = feature_rows(self.relays, label)
            pc = peer_label.get(label)
            if pc is not None:
                # peer links (the ring, patches/0007): shard -> shard, counted at the relay
                # of the shard they push into (per_shard[i]: into shard i), not in the
                # client's figures above
                row["peer"] = {"bytes": pc["total"], "data": pc["data"],
                               "control": pc["control"], "per_shard": pc["per_shard"],
                               "classes": peer_classes[label]}
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
            "cache_bytes_crossing": sum(classes[k]["cache"] + peer_classes[k]["cache"]
                                        for k in run_labels),
            "cache_tensors_crossing": {k: v for k, v in crossing.items()
                                       if v and k in run_labels},
            "wire_violations": wire_violations(
                {k: {c: classes[k][c] + peer_classes[k][c] for c in classes[k]}
                 for k in run_labels}),
            "links": [str(r.link) for r in self.relays.relays],
            # the link each shard's peer link from the shard before it passes (the head
            # has none): ``--peer-wan``, else that shard's own link
            "peer_links": [str(r.link_for("peer")) for r in self.relays.relays[1:]],
            "steps": steps,
        }

    def seam_metrics(self) -> dict:
        """The compact form `mtplib generate --plan` reports: total bytes on the shard
        connections while generating, per token per step kind, waits per step, data bytes
        by class, the contract's minimum for the same plan, and the cache bytes that
        crossed a shard connection (must be 0)."""
        rep = self.seam_report()
        out = {"seam_bytes": rep["seam_bytes"], "seam_bytes_per_token": {},
               "seam_data_bytes_per_token": {}, "seam_contract_min_per_token": {},
               "seam_ratio": {}, "waits_per_step": {}, "wire_bytes_by_class": {},
               "seam_bytes_by_value": {}, "steps_by_label": {},
               "cache_bytes_crossing": rep["cache_bytes_crossing"],
               "wire_violations": rep["wire_violations"], "wan": rep["links"]}
        for label, row in rep["steps"].items():
            if label in ("load", "setup", "other"):
                continue
            if row["steps"]:
                out["steps_by_label"][label] = row["steps"]
                out["waits_per_step"][label] = row["waits_per_step"]
                out["wire_bytes_by_class"][label] = row["classes"]
                out["seam_bytes_by_value"][label] = row["seam_values"]
            if row["tokens"]:
                out["seam_bytes_per_token"][label] = row["bytes_per_token"]
                out["seam_data_bytes_per_token"][label] = row["data_bytes_per_token"]
                if "contract_min_per_token" in row:
                    out["seam_contract_min_per_token"][label] = row["contract_min_per_token"]
                    out["seam_ratio"][label] = row["ratio"]
        return out

    # -- contexts and calls -------------------------------------------------------------
    def context(self, cfg=None, *, mtp: bool = False, policy=None) -> RemoteContext:
        """A context on the trunk (or, ``mtp=True``, on the sidecar: an MTP context, which
        ``policy`` must route with the shards' own reports: default $MTPLIB_POLICY, else
        beta)."""
        from dataclasses import asdict

        from mtplib.runtime.model import ContextConfig

        cfg = cfg or ContextConfig()
        if mtp and not cfg.mtp:
            cfg = ContextConfig(**{**asdict(cfg), "mtp": True})
        if cfg.mtp and not self.sidecar:
            raise ShardError("no MTP sidecar was loaded (RangedRuntime(..., sidecar=...))")
        if cfg.mtp:
            require_shard_mtp("an MTP context on the shards", lambda: self.shard_info,
                              policy=policy)
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

    def close(self) -> None:
        if self._conn is not None and not self.failed and self._worker is not None \
                and self._worker.poll() is None:
            with contextlib.suppress(Exception):
                self._conn.send(("close",))
                if self._conn.poll(5):
                    self._conn.recv()
        self._stop_worker()
        self.relays.close()
        LIVE.discard(self)
        with contextlib.suppress(OSError):
            self._tmp.cleanup()

    def __enter__(self) -> RangedRuntime:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
