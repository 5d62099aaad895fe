"""Ranged MTP: the speculative loop with the trunk's layers on RPC shards.

The loop runs inside the ranged runtime's client worker (upstream's RPC client aborts its
process when a shard is lost, so it never runs in the caller's process). Each step kind
is labelled (prefill, draft, verify, decode, feed, rollback) so the counting relays in
front of the shards attribute every byte on every shard connection to it.

The worker keeps its engines (contexts on the shards plus the drafter) between
generations and warms each one at build (`mtplib.runtime.speculative.warm_up`), so no
decode, draft, feed or verify step pays upstream's first-use graph allocation on the
shards: that is setup, paid once per process (or per `mtplib serve`), reported apart from
TTFT. A prefill of a width the process has not run before makes upstream ask each shard
the allocation size of its new tensor shapes (GET_ALLOC_SIZE, a blocking query per shape):
the relay in front of a CPU shard answers those itself (no round trip:
`mtplib.distributed.relay._AllocSizeAnswers`); a GPU shard, or one that reported nothing,
still answers them over its link, in the prefill's waits.

Defaults are the contract-safe fast path: the MTP block and the output head run in the
client next to the sampler unless the costs measured at load say otherwise (placement and
head ``auto``: `mtplib.distributed.auto_placement`, decision and inputs in each result's
``routing["placement"]``), and a build that would move V4
cache state across a seam is refused before the first token (`check_cache_locality`).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

from mtplib.contract.capabilities import Decision, Policy
from mtplib.contract.labels import PLACEMENT_CHOICES, Placement
from mtplib.distributed.relay import WanLink
from mtplib.distributed.results import SEAM_KEYS, RangedGeneration, RangedMetrics
from mtplib.distributed.shard_report import advert_summary, shard_adverts
from mtplib.distributed.tls import TlsConfig
from mtplib.distributed.worker_engine import (  # noqa: F401 - MAX_ENGINES: its old home
    MAX_ENGINES,
    engine_for,
    engine_key,
    worker_memory,
)
from mtplib.errors import InputError
from mtplib.ownership.plan import ShardPlan
from mtplib.runtime import build_info
from mtplib.runtime.engine_options import EngineOptions
from mtplib.runtime.generation import Generation
from mtplib.runtime.model import RuntimeInputError, check_n_new, check_tokens
from mtplib.runtime.request import DEFAULT_SEAM, RunRequest, build_request
from mtplib.runtime.routing import (
    PIN,
    certified_recipes,
    check_policy,
    route,
    routing_metrics,
)
from mtplib.runtime.sampling import Sampler

if TYPE_CHECKING:
    from mtplib.distributed.ranged_batch import RangedBatch



class CacheCrossingRefused(InputError):
    """This configuration would move V4 cache state across a shard connection."""


def resolve_placement(placement: str, *, has_sidecar: bool) -> str:
    """``auto``: the MTP block in the client first, next to the sampler (the contract allows
    it: its input is ``sampler_hidden``, which the client holds), so a draft costs no round
    trip; once loaded it is timed and `RangedMTP` moves it to the tail when the measured
    costs say the tail drafts faster (`mtplib.distributed.auto_placement`); ``tail`` stays
    available explicitly."""
    if placement not in PLACEMENT_CHOICES:
        raise InputError(f"mtp_placement must be one of {', '.join(PLACEMENT_CHOICES)}, "
                         f"got {placement!r}")
    if placement != "auto":
        return placement
    return Placement.CLIENT if has_sidecar else Placement.TAIL


def check_cache_locality(opts: EngineOptions, n_shards: int, *, allow: bool) -> None:
    """Refuse, before anything runs, what would move cache state over a seam: the stock
    build with ``n_rs_seq > 0`` (MTP's tail rollback) on more than one shard places a
    compressor-state restore next to the previous layer (patches/0001 fixes it)."""
    n_rs = opts.k if opts.n_rs_seq is None else opts.n_rs_seq
    build = build_info()["build"]
    if allow or n_shards < 2 or n_rs <= 0 or build != "stock":
        return
    raise CacheCrossingRefused(
        f"the stock upstream build with n_rs_seq={n_rs} (MTP k={opts.k}) on {n_shards} "
        "shards moves V4 compressor state across a shard connection every step, which the "
        "contract forbids (caches are shard-local). Remedy: build the patched upstream "
        "(./dev.sh setup; it is then the default, or set MTPLIB_UPSTREAM=patched), or run "
        "MTP off; to measure the stock behaviour anyway, opt in with --allow-cache-crossing "
        "(allow_cache_crossing=True)")


# -- the worker side (run through RangedRuntime.call) -----------------------------------
def _worker_begin(models, opts: EngineOptions, warm: bool, prompt: list[int], n_new: int
                  ) -> tuple[dict | None, list[int] | None]:
    """Start a generation (the engine for ``opts``, built if needed); returns (setup report
    if the engine was built now, the prefill's tokens, or None when there are none)."""
    from mtplib.runtime.generation import generation_steps

    setup = engine_for(models, opts, warm)
    engine, owned, _ = models.engines[engine_key(opts)]
    engine.sampler = opts.sampler or Sampler()
    engine.trace = opts.trace
    result: dict = {}
    steps = generation_steps(engine, prompt, n_new, memory=worker_memory(models, engine,
                                                                           owned),
                             result=result)
    models.generation = (steps, result)
    return setup, _worker_next(models)


def _worker_next(models) -> list[int] | None:
    """The next step's tokens; None once the generation is over."""
    steps, _ = models.generation
    try:
        return next(steps)
    except StopIteration:
        return None


def _worker_run(models) -> None:
    """Every remaining step, here (no round trip to the parent per step)."""
    steps, _ = models.generation
    for _ in steps:
        pass


def _worker_end(models) -> tuple[list[int], dict] | None:
    """Close the generation (its session); its (tokens, metrics) if it finished."""
    gen = models.__dict__.pop("generation", None)
    if gen is None:
        return None
    steps, result = gen
    steps.close()
    return (result["tokens"], result["metrics"]) if "metrics" in result else None


# -- the caller's side -------------------------------------------------------------------
class RangedMTP:
    """A trunk on RPC shards by ``plan`` (+ the sidecar in the client or on the tail) for
    several measured generations; local shards are started and stopped when no endpoints
    are given. ``generate`` returns (tokens, metrics) with that run's seam bytes; ``stream``
    yields the tokens step by step.

    ``opts``: the generations' default EngineOptions (default: k = DEFAULT_DRAFT with a
    sidecar, else 0); its engine is built and warmed here, at load (``warm``), and reported
    as ``setup`` in the first generation's metrics. Another configuration passed to
    ``generate`` builds and warms its own engine then (also reported as setup).

    ``trunk``: a ranged `RunRequest` (`build_request`: what `mtplib generate` and `serve`
    pass), or the trunk's path with ``plan`` and the other keywords, made into one here
    by the same function; either way every setting is checked once, there, and ``policy``
    (default $MTPLIB_POLICY, else beta) is asked once (`policy_gate`): MTP under alpha
    raises RouteRefused naming the policy, before any shard starts; k = 0 always runs.
    A generation's own options (another draft length) are held to that verdict
    (`check_policy`, the same message), not asked again. Each configuration's recipe is
    negotiated once with the shards' adverts, built from what each shard reported at
    probe time (`shard_report.shard_adverts`: its contract version and pin must be this
    process's; the tail's says whether the MTP block was placed where its placement
    says). A configuration that would move cache state across a seam raises
    CacheCrossingRefused unless ``allow_cache_crossing``.
    ``silence_timeout_s``: see `RangedRuntime` (None: $MTPLIB_SHARD_SILENCE_S, else 15 s).
    ``tls`` (a `TlsConfig`): mutual TLS to the shards (local ones then serve through their
    gateways too); ``insecure_plaintext``: allow non-loopback endpoints without it.
    ``mtp_placement`` / ``opts.head`` ``auto``: decided from the costs timed at load
    (`auto_placement`); ``placement_costs`` (seconds, `placement.COST_FIELDS`) replace
    measured ones, e.g. a GPU tail's known draft time.
    ``seam`` (auto, ring, star; default `DEFAULT_SEAM`, auto: the ring where this build and
    every shard speak RPC 7.2 and, under TLS, every shard's gateway carries peer links,
    else the star): boundary
    values through the client or shard to shard (patches/0007: one client wait per step);
    see `RangedRuntime`; every generation's metrics say which ran and why, per shard pair
    (``seam``: ``pairs``).

    Thread-safe by serializing: one generation at a time per object (a second caller waits),
    held from resetting the byte counters to reading them, so each result's seam bytes are
    its own generation's. After ``close()`` every method raises RuntimeInputError.

    Faults: a shard lost, hung or restarted fails the running call with a `SessionFault`
    (`ShardLostError` naming the shard) and every later call with `SessionFailedError`,
    until ``reconnect()`` opens a new session (local shards that are gone or stopped are
    restarted; running endpoints are probed, with backoff up to ``timeout_s``) and
    reloads the weights; greedy generations then give the tokens they gave before.
    ``faults()`` says, without a round trip, what is seen wrong now."""

    def __init__(self, trunk: str | RunRequest, *, plan: str | ShardPlan | None = None,
                 sidecar: str | None = None,
                 endpoints: Sequence[str] | None = None, shard_threads: int = 1,
                 insecure_plaintext: bool = False,
                 wan: str | Sequence[WanLink] | None = None,
                 mtp_placement: str = "auto", policy: Policy | str | None = None,
                 silence_timeout_s: float | None = None, opts: EngineOptions | None = None,
                 warm: bool = True, allow_cache_crossing: bool = False,
                 tls: TlsConfig | None = None,
                 placement_costs: Mapping[str, float] | None = None,
                 seam: str = DEFAULT_SEAM, peer_wan: str | Sequence[WanLink] | None = None) -> None:
        from mtplib.distributed.client import RangedRuntime
        from mtplib.distributed.processes import LocalShards

        if isinstance(trunk, RunRequest):
            asked = dict(plan=plan, sidecar=sidecar, endpoints=endpoints, wan=wan, opts=opts,
                         policy=policy, tls=tls, peer_wan=peer_wan)
            if any(v is not None for v in asked.values()) or shard_threads != 1 or \
                    insecure_plaintext or mtp_placement != "auto" or allow_cache_crossing or \
                    seam != DEFAULT_SEAM:
                raise TypeError("RangedMTP(request): the request holds the plan, files, "
                                "shards and options; give them to build_request")
            req = trunk
        else:
            if plan is None:
                raise InputError("RangedMTP needs plan= (contiguous layer ranges, one per "
                                 "shard, e.g. '0-1,2-3'); a whole model runs in MTPRuntime")
            # the one build of this run's request: every field checked once, the policy
            # asked once, each header read and validated once (before any shard starts)
            req = build_request(trunk, sidecar=sidecar, opts=opts, plan=plan,
                                endpoints=endpoints, wan=wan, mtp_placement=mtp_placement,
                                shard_threads=shard_threads, tls=tls,
                                insecure_plaintext=insecure_plaintext,
                                allow_cache_crossing=allow_cache_crossing, seam=seam,
                                peer_wan=peer_wan, policy=policy)
        if not req.ranged:
            raise InputError("a whole-model request (no plan) runs in MTPRuntime, not "
                             "RangedMTP")
        #: the run's request, as `build_request` checked it (sent to the worker as is)
        self.request = req
        self._lock = threading.RLock()  # one generation at a time: counters are per runtime
        self.closed = False
        #: the run's policy verdict (`policy_gate`, once, in the request); a generation's
        #: own options are held to it (`check_policy`), never asked again
        self.policy = req.policy
        self.n_vocab = req.trunk_header.n_vocab
        #: the routing decision of each engine configuration, negotiated once with the
        #: shards' adverts (they do not change while this object lives)
        self._routed: dict[tuple, Decision] = {}
        self._certified = certified_recipes(req.trunk, req.sidecar) if req.sidecar \
            else frozenset()
        #: parsed once, by the request: the endpoints were checked against it there
        self.plan = req.plan
        self.has_sidecar = req.sidecar is not None
        #: "no sidecar means k=0" as the request decided it, for a generation's own options
        self.draft_rule = req.draft_rule
        self.warm, self.allow_cache_crossing = warm, req.allow_cache_crossing
        #: the measured costs ``auto`` decides from (`auto_placement`); set after load
        self._place_inputs = None
        self.placement_record: dict | None = None
        #: what `generate` runs without options: the request's (its k decided there)
        self.opts = req.opts
        load = self._resolve(self.opts)  # refuses a cache-moving default before any shard
        placement = resolve_placement(req.mtp_placement, has_sidecar=self.has_sidecar)
        self._load = load
        self._given = list(req.endpoints) if req.endpoints is not None else None
        self._stack = contextlib.ExitStack()
        self.rt = None
        try:
            self.shards = None
            if req.endpoints is None:
                self.shards = self._stack.enter_context(
                    LocalShards(self.plan.n_shards, req.shard_threads, tls=req.tls))
            #: how each session's runtime is opened (again by `reconnect`): from the
            #: request, whose headers the worker gets with it (it reads none)
            self._open_rt = lambda: RangedRuntime(
                req, shards=self.shards, mtp_placement=placement,
                silence_timeout_s=silence_timeout_s)
            #: what `auto` placement asked (decided again by each session: `_open`)
            self._placement_request = (req.mtp_placement, placement_costs)
            self._stack.callback(self._close_rt)
            self._setup = self._open()
        except BaseException:
            self._stack.close()
            raise

    def _place(self, load: EngineOptions, requested: str,
               costs: Mapping[str, float] | None) -> None:
        """Time the loaded drafter and head and the tail link (`auto_placement.measure`),
        decide what ``auto`` asked (`mtplib.runtime.placement`), and act on it: move the
        sidecar to the tail (once, over the links without their emulated WAN) and rebuild
        the load engine when the decision differs from how it was built. The decision and
        its inputs go into every generation's ``routing["placement"]``."""
        from mtplib.distributed import auto_placement as ap
        from mtplib.distributed.relay import WanLink

        if self.request.sidecar_kind == "dspark":  # its own decision: nothing to move
            from mtplib.distributed.dspark_ranged import placement_record

            self.placement_record = placement_record(self.rt, load.k, requested, costs)
            return
        inp, timings = ap.measure(self.rt, engine_key(load), load.k,
                                  placement=self.rt.mtp_placement)
        inp = inp.forced(costs)
        pc, hc = ap.decide(inp, placement=requested if self.has_sidecar else "",
                           head=self.opts.head, running=self.rt.mtp_placement)
        moved = pc is not None and pc.chosen != self.rt.mtp_placement
        if moved:
            rt = self.rt
            links = [r.link for r in rt.relays.relays]
            for r in rt.relays.relays:
                r.set_link(WanLink())
            try:
                with rt.step("load"):
                    info = rt.call(ap.worker_move_sidecar, pc.chosen)
            finally:
                for r, link in zip(rt.relays.relays, links, strict=True):
                    r.set_link(link)
            back = dict(zip(rt.client_endpoints, rt.endpoints, strict=True))
            info["placement"] = {il: back.get(ep, ep) for il, ep in info["placement"].items()}
            for b in info["buffers"]:
                b["endpoint"] = back.get(b["endpoint"], b["endpoint"])
            rt.sidecar, rt.mtp_placement = info, pc.chosen
            self._routed.clear()  # the tail's advert changed
        self._place_inputs = inp
        self.placement_record = ap.record(inp, timings, pc, hc, moved=moved, requested={
            "mtp_placement": requested, "head": self.opts.head})
        again = self._resolve(self.opts)
        if moved or engine_key(again) != engine_key(load):
            first, self._setup = self._setup, self._build(again)
            if first and self._setup:  # both engines were set up at load
                self._setup = {**self._setup,
                               "setup_s": first["setup_s"] + self._setup["setup_s"]}
    def _open(self) -> dict | None:
        """A new session: the runtime (every shard probed, the weights loaded) and the
        load-time engine built and warmed; its setup report."""
        self._close_rt()
        self._routed.clear()  # negotiated again with the adverts of this session's shards
        self.rt = self._open_rt()
        self._setup = self._build(self._load)
        self._place(self._load, *self._placement_request)
        return self._setup

    def _close_rt(self) -> None:
        rt, self.rt = self.rt, None
        if rt is not None:
            rt.close()

    @property
    def failed(self) -> str | None:
        """Why the session failed (a shard lost or hung), None while it works."""
        rt = self.rt
        return "no session (reconnect() failed)" if rt is None else rt.failed

    def faults(self) -> list[dict]:
        """What is seen wrong now, without a round trip (cheap: a health check may call it
        each time): one entry per shard at fault, ``{"shard", "endpoint", "layers",
        "cause"}`` (shard None: the client worker or the session itself). Empty: whole."""
        rt = self.rt
        if rt is None:
            return [{"shard": None, "endpoint": None, "layers": None,
                     "cause": "no session: reconnect() did not succeed yet"}]
        return [self.describe(i, cause) for i, cause in rt.faults()]

    def describe(self, i: int | None, cause: str = "") -> dict:
        """Shard ``i`` of the plan as a fault report names it: its index, endpoint and
        layer range."""
        if i is None:
            return {"shard": None, "endpoint": None, "layers": None, "cause": cause}
        a, b = self.plan.ranges[i]
        eps = self.rt.endpoints if self.rt is not None else self._endpoints()
        return {"shard": i, "endpoint": eps[i] if i < len(eps) else None,
                "layers": f"{a}-{b}", "cause": cause}

    def _endpoints(self) -> list[str]:
        return list(self.shards.endpoints) if self.shards is not None else self._given or []

    def reconnect(self, timeout_s: float = 0.0, *, backoff_s: float = 0.5,
                  max_backoff_s: float = 5.0) -> dict | None:
        """Open a new session after a fault (also when none happened): the old session is
        closed, local shards that are gone, stopped or do not answer are restarted (on their
        endpoints), every shard is probed and the weights are loaded again, the default
        engine is built and warmed (its setup is reported by the next generation). Shards
        that do not answer yet are retried with doubling waits (``backoff_s`` up to
        ``max_backoff_s``) until ``timeout_s`` has passed; then the last ShardError is
        raised (``faults()`` says so until a later reconnect succeeds). Returns the
        setup report."""
        from mtplib.runtime.rpc import ShardError

        end = time.monotonic() + timeout_s
        wait = backoff_s
        with self._lock:
            if self.closed:
                raise RuntimeInputError("this RangedMTP is closed: create a new one")
            while True:
                try:
                    self._close_rt()
                    self._restart_local()
                    self._setup = self._open()
                    return self._setup
                except ShardError:
                    self._close_rt()
                    left = end - time.monotonic()
                    if left <= 0:
                        raise
                    time.sleep(min(wait, left))
                    wait = min(2 * wait, max_backoff_s)

    def _restart_local(self) -> None:
        """Restart the local shards that are gone, stopped (SIGSTOP) or do not answer a
        probe (no session holds them now)."""
        from mtplib.distributed.probe import probe_shards
        from mtplib.runtime.rpc import ShardError

        sh = self.shards
        if sh is None:
            return
        for i, ep in enumerate(sh.endpoints):
            ok = sh.alive()[i] and not sh.stopped(i)
            if ok:
                try:
                    probe_shards([ep], tls=sh.tls, timeout_s=2.0)
                except ShardError:
                    ok = False
            if not ok:
                sh.restart(i)

    def _resolve(self, opts: EngineOptions) -> EngineOptions:
        """The options a ranged generation really runs with, checked before anything runs
        (k already decided: the request's, or `_options`): rollback beyond n_rs_seq
        replays (caches are shard-local, a sequence's state never moves);
        ``head="auto"`` resolved; cache locality."""
        opts = replace(opts, checkpoints="replay")
        if (opts.head == "auto" and self._place_inputs is not None  # measured at load
                and self.rt is not None):  # (no session: the generation refuses later)
            from mtplib.distributed.auto_placement import with_k
            from mtplib.runtime.placement import choose_head

            opts = replace(opts, head=choose_head(with_k(self._place_inputs, opts.k),
                                                  placement=self.rt.mtp_placement).chosen)
        if self.request.sidecar_kind == "dspark" and opts.head == "auto":
            opts = replace(opts, head="upstream")  # DSpark reads no h_nextn rows
        opts = opts.resolved(ranged=True)
        check_cache_locality(opts, self.plan.n_shards, allow=self.allow_cache_crossing)
        return opts

    def _build(self, opts: EngineOptions) -> dict | None:
        """Route ``opts``, then build (and warm) the worker's engine for it unless it has
        one; returns the setup report, or None when it was already set up (labelled
        "setup" in the worker). The routing decision is negotiated once per configuration,
        with the shards' adverts (`shard_adverts`, from each shard's own report; the
        tail's says whether the MTP block was placed next to the sampler) against this
        process's pin, and kept in ``_routed``; RouteRefused unless routed."""
        key = engine_key(opts)
        if key not in self._routed:
            adverts = shard_adverts(self.rt.shard_info, mtp_placed=self.mtp_placed,
                                    policy=self.policy, certified=self._certified)
            self._routed[key] = route(opts.draft, policy=self.policy, adverts=adverts,
                                      pin=PIN)
        return self.rt.call(engine_for, opts, self.warm)

    @property
    def n_ctx(self) -> int:
        return self.opts.settings.n_ctx

    def _live(self) -> None:
        if self.closed:
            raise RuntimeInputError("this RangedMTP is closed: create a new one")
        if self.rt is None:
            from mtplib.distributed.client import SessionFailedError

            raise SessionFailedError("no session: the last reconnect() did not succeed; "
                                     "call reconnect() again")

    def seam_summary(self) -> dict:
        """Which seam the session runs, asked, chosen and why, per shard pair
        (`RangedRuntime.seam_summary`), without a generation: what `mtplib serve` reports
        at load (each generation's metrics carry their own, ``seam``)."""
        with self._lock:
            self._live()
            return self.rt.seam_summary()

    def tokenize(self, text: str) -> list[int]:
        from mtplib.distributed.worker import tokenize

        with self._lock:
            self._live()
            return self.rt.call(tokenize, text)

    def detokenize(self, tokens: Sequence[int]) -> str:
        from mtplib.distributed.worker import detokenize

        with self._lock:
            self._live()
            return self.rt.call(detokenize, list(tokens))

    def stream(self, prompt: Sequence[int] | str, n_new: int,
               opts: EngineOptions | None = None, *, sampler: Sampler | None = None
               ) -> Generation:
        """A `Generation` yielding each step's tokens as the worker emits them (one local
        pipe round trip per step; no extra shard traffic). ``sampler`` replaces the options'
        for this generation only."""
        result: dict = {}
        return Generation(self._steps(prompt, n_new, opts, sampler, result, stream=True),
                          result)

    def generate(self, prompt: Sequence[int] | str, n_new: int,
                 opts: EngineOptions | None = None, *, sampler: Sampler | None = None
                 ) -> tuple[list[int], RangedMetrics]:
        result: dict = {}
        for _ in self._steps(prompt, n_new, opts, sampler, result, stream=False):
            pass
        return result["tokens"], result["metrics"]

    def _steps(self, prompt, n_new, opts, sampler, result: dict, *, stream: bool
               ) -> Iterator[list[int]]:
        from mtplib.distributed.worker import tokenize

        n_new = check_n_new(n_new)
        if not isinstance(prompt, str):
            prompt = check_tokens(prompt, self.n_vocab)
        # the policy's verdict first (its refusal names it; the policy was asked once, by
        # the request), then what the options would move; the routing decision itself is
        # the configuration's, negotiated once (`_build`)
        opts = self._options(opts)
        check_policy(opts.draft, self.policy)
        opts = self._resolve(opts)
        if sampler is not None:
            opts = replace(opts, sampler=sampler)
        with self._lock:
            self._live()
            rt = self.rt
            toks = rt.call(tokenize, prompt) if isinstance(prompt, str) else list(prompt)
            built = self._build(opts)  # before counting: setup is not the generation's
            decision = self._routed[engine_key(opts)]
            # the load-time setup is reported by the first generation; later ones report a
            # setup only when their configuration needed an engine of its own
            setup = self._setup if self._setup is not None else built
            self._setup = None
            rt.reset_counts()
            finished = False
            try:
                _, first = rt.call(_worker_begin, opts, self.warm, toks, n_new)
                if stream:
                    chunk = first
                    while chunk is not None:
                        yield chunk
                        chunk = rt.call(_worker_next)
                else:
                    if first is not None:
                        yield first
                    rt.call(_worker_run)
                done = rt.call(_worker_end)
                finished = True
            finally:
                if not finished and not rt.failed:
                    with contextlib.suppress(Exception):
                        rt.call(_worker_end)
            tokens, metrics = done
            seam = rt.seam_metrics()
            result["tokens"] = tokens
            routing = routing_metrics(decision, self.policy)
            if self.placement_record is not None:
                routing["placement"] = self.placement_record
            result["metrics"] = RangedMetrics(
                **{**metrics.fields_dict(),
                   "routing": {**routing, "shards": advert_summary(rt.shard_info)},
                   "upstream": build_info(),
                   "setup": setup},  # None: set up for an earlier generation
                **{key: seam[key] for key in SEAM_KEYS}, seam_report=rt.seam_report(),
                plan=str(self.plan), endpoints=list(rt.endpoints),
                local_shards=self.shards is not None,
                placement={str(k): v for k, v in rt.trunk["placement"].items()},
                wan=[str(r.link) for r in rt.relays.relays],
                transport="tls" if rt.tls is not None else "plaintext", head=opts.head,
                mtp_placement=rt.mtp_placement if rt.sidecar else None,
                mtp_endpoints=sorted(set(rt.sidecar["placement"].values()))
                if rt.sidecar else None, seam=rt.seam_summary())

    def batch(self, opts: EngineOptions | None = None, *, warm: bool | None = None
              ) -> RangedBatch:
        """Continuous batching in the worker (`mtplib.distributed.ranged_batch`): up to
        ``n_seq_max`` slots stepped together, one shard step for all of them. ``warm``
        (default: this object's): run every step shape once now."""
        from mtplib.distributed.ranged_batch import RangedBatch

        opts = self._options(opts)
        check_policy(opts.draft, self.policy)  # the run's verdict, as in `_steps`
        return RangedBatch(self, self._resolve(opts),
                           warm=self.warm if warm is None else warm)

    def _options(self, opts: EngineOptions | None) -> EngineOptions:
        """A generation's options: the request's (decided when it was built), or the
        caller's own with k held to the request's `DraftRule` (decided once, at build).
        Either is then held to the run's policy verdict (`check_policy`: the message
        `policy_gate` gives; the policy is not asked again)."""
        return self.opts if opts is None else opts.under(self.draft_rule)

    @property
    def mtp_on_tail(self) -> bool:
        """The MTP block runs on the tail shard: placement "tail" and upstream placed all
        of it there (False for placement "client", where it runs in this process)."""
        side = self.rt.sidecar
        return bool(side) and self.rt.mtp_placement == Placement.TAIL \
            and set(side["placement"].values()) == {self.rt.endpoints[-1]}

    @property
    def mtp_placed(self) -> bool:
        """The advert of the party next to the sampler: the MTP block was loaded where its
        placement says, in this client process (placement "client", on the client's CPU)
        or all of it on the tail shard (`mtp_on_tail`)."""
        side = self.rt.sidecar
        return bool(side) and (self.rt.mtp_placement == Placement.CLIENT or self.mtp_on_tail)

    def close(self) -> None:
        """Stop the worker and the local shards (after a generation in progress)."""
        with self._lock:
            self.closed = True
            self._stack.close()

    def __enter__(self) -> RangedMTP:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def generate_ranged(trunk: str, prompt: Sequence[int] | str, n_new: int, *, plan: str,
                    sidecar: str | None = None, opts: EngineOptions | None = None,
                    endpoints: Sequence[str] | None = None, shard_threads: int = 1,
                    insecure_plaintext: bool = False,
                    wan: str | Sequence[WanLink] | None = None,
                    mtp_placement: str = "auto", policy: Policy | str | None = None,
                    allow_cache_crossing: bool = False, warm: bool = True,
                    tls: TlsConfig | None = None, seam: str = DEFAULT_SEAM
                    ) -> RangedGeneration:
    """One generation with the trunk split over shards by ``plan`` (MTP when a sidecar is
    given and k > 0), over ``seam`` (as `RangedMTP`'s). A policy that refuses the
    recipe, or a configuration that would move cache state (RangedMTP), is refused before any
    shard starts; the engine is built and warmed at load (``metrics.setup``)."""
    from mtplib.distributed.worker import detokenize

    # MTP off (k = 0 asked): the sidecar is not loaded at all
    use_sidecar = sidecar if opts is None or opts.k else None
    req = build_request(trunk, sidecar=use_sidecar, opts=opts, plan=plan,
                        endpoints=endpoints, wan=wan, mtp_placement=mtp_placement,
                        shard_threads=shard_threads, tls=tls,
                        insecure_plaintext=insecure_plaintext,
                        allow_cache_crossing=allow_cache_crossing, seam=seam,
                        policy=policy)
    with RangedMTP(req, warm=warm) as r:  # the policy was asked before any shard starts
        tokens, metrics = r.generate(prompt, n_new)
        text = r.rt.call(detokenize, tokens) if isinstance(prompt, str) else None
        return RangedGeneration(tokens, metrics, text)
