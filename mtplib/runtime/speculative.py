"""MTP speculative decoding around upstream llama.cpp, implementing mtplib.contract.

One `Engine` owns a target context (and a drafter, e.g. the MTP block in its own context);
each `SpecSession` is one sequence id in them, with its own contract `Session` (state,
epoch, position). A step is: propose (DraftProposal) -> verify in one batched target
decode (VerifyResult) -> commit: roll back the rejected tail of the target's caches (tail
removal within n_rs_seq, else checkpoint restore + replay), feed the drafter the target's
rows for what was accepted. With k = 0 drafts a step is a plain one-token decode, so MTP
off and on run the same code.

This module builds engines: `build_engine` (contexts and an Engine over loaded models)
and `MTPRuntime` (load, route, build, generate). The rest lives by concern (import a name
from the module that defines it): the counts in `spec_metrics`, the engine and its
sessions in `engine`, the options in `engine_options`, the generation loop and `warm_up`
in `generation`.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

from mtplib.contract.capabilities import Policy
from mtplib.contract.types import NO_DRAFT
from mtplib.runtime import build_info
from mtplib.runtime.drafters import Drafter
from mtplib.runtime.engine import Engine, PhaseFn, RowFn, api_rows, no_phase
from mtplib.runtime.engine_options import EngineOptions
from mtplib.runtime.generation import Generation, generation_steps, warm_up
from mtplib.runtime.model import Context, RuntimeInputError, check_n_ctx
from mtplib.runtime.request import RunRequest, build_request, dspark_draft_max
from mtplib.runtime.results import GenerationMetrics
from mtplib.runtime.sampling import Sampler
from mtplib.runtime.settings import RowSource

if TYPE_CHECKING:
    from mtplib.runtime.batch import BatchRun


def build_engine(trunk, sidecar, opts: EngineOptions, *, drafter: Drafter | None = None,
                 rows: RowFn | None = None, phase: PhaseFn = no_phase) -> tuple[Engine, list]:
    """Contexts and an Engine over already-loaded models; returns (engine, contexts to
    close). The sidecar drafts when given and k > 0 (unless a drafter is given): an MTP
    `Model`, or a `DSparkModel` (its context beside the target's, reading the target's
    layer-input features instead of h_nextn rows)."""
    from mtplib.runtime.drafters import MTPDrafter
    from mtplib.runtime.model import ContextConfig, context_threads

    # the run's request decided k ("no sidecar means k=0": `build_request`, once); here
    # the MTP block drafts when those options draft and no drafter of the caller's does
    use_mtp = opts.draft.mtp and drafter is None
    if use_mtp and sidecar is None:
        raise RuntimeInputError(f"options with k={opts.k} and no MTP sidecar: build them "
                                "through build_request, which makes k 0 without one")
    if opts.head == "auto":
        raise RuntimeInputError("head='auto' must be resolved by the entry point "
                                "(EngineOptions.resolved) before the engine is built")
    client_head = opts.head == "client"
    dspark = use_mtp and getattr(sidecar, "kind", "mtp") == "dspark"
    if dspark and client_head:
        raise RuntimeInputError("--head client needs the target's h_nextn rows: DSpark "
                                "drafting runs with the head in upstream's graph")
    needs_rows = (use_mtp and not dspark) or (drafter is not None and drafter.needs_rows) \
        or client_head
    s = opts.settings
    owned: list = []
    # several sequences on the whole model: at least one position of tail removal, so a
    # batch can pad a lone one-token step (`Engine.pad_single`); on shards a stock build
    # would move compressor state across a seam for it, so ranged keeps k
    n_rs_seq = opts.n_rs_seq if opts.n_rs_seq is not None else \
        max(opts.k, 1) if opts.n_seq_max > 1 and not trunk.endpoints else opts.k
    tcfg = ContextConfig.from_settings(s, n_seq_max=opts.n_seq_max, n_rs_seq=n_rs_seq,
                                       nextn_rows="all" if needs_rows else "off")
    if trunk.endpoints:  # ranged: the client computes only the token lookup (context_threads)
        tcfg = replace(tcfg, n_threads=context_threads(trunk, s.n_threads))
    mode, capture = "off", None
    if needs_rows and rows is None:
        mode, capture = _row_source(trunk, tcfg, s.hidden_rows, reserve=opts.reserve)
        if mode == "captured":
            rows = lambda _ctx, n: capture.take(n)  # noqa: E731
    try:
        target = Context(trunk, tcfg, cb_eval=capture.callback if capture else None)
        owned.append(target)
        if needs_rows and opts.reserve:
            from mtplib.runtime.rows import force_reserve

            force_reserve(target)
        head = None
        if client_head:
            from mtplib.runtime.rows import client_head as head_of

            head = head_of(trunk.path).logits
        if dspark:
            drafter = _dspark_drafter(sidecar, target, opts, owned)
        elif use_mtp:
            # masked: the MTP graph's h_nextn has output rows only (unmasked aborts upstream)
            mtp_ctx = Context(sidecar, ContextConfig.from_settings(
                s, n_seq_max=opts.n_seq_max, mtp=True, nextn_rows="masked",
                n_threads=context_threads(sidecar, s.n_threads)))
            owned.append(mtp_ctx)
            drafter = MTPDrafter(mtp_ctx)
        engine = Engine(target, drafter or Drafter(), k=opts.k if drafter else NO_DRAFT,
                        sampler=opts.sampler, rows=rows or api_rows, trace=opts.trace,
                        phase=phase, head=head, checkpoints=opts.checkpoints)
        if not dspark:  # DSpark's engine says "layer_inp" itself
            engine.hidden_rows = mode if needs_rows else "off"
    except BaseException:
        for c in reversed(owned):
            c.close()
        raise
    return engine, owned


def _dspark_drafter(sidecar, target: Context, opts: EngineOptions, owned: list) -> Drafter:
    """The DSpark drafter on a fresh target: its features enabled before the target's first
    decode, its context created with ``ctx_other`` = the target."""
    from mtplib.runtime.dspark.context import DSparkContext, TargetFeatures
    from mtplib.runtime.dspark.drafter import DSparkDrafter

    features = TargetFeatures(target, sidecar.layer_ids, target.model.n_embd)
    dctx = DSparkContext(sidecar, target, opts.settings)
    owned.append(dctx)
    return DSparkDrafter(dctx, features, p_min=opts.p_min)


def _row_source(trunk, tcfg, want: RowSource, *, reserve: bool):
    """(mode, CapturedRows or None) for the target's rows; fail-closed on "unsupported".
    ``want`` was checked with the rest of the DecodeSettings."""
    from mtplib.runtime.row_source import choose_row_source
    from mtplib.runtime.rows import CapturedRows

    check_n_ctx(trunk, tcfg.n_ctx)  # the real reason, not "MTP is unsupported"
    mode = want
    if want == "auto":
        d = choose_row_source(trunk, tcfg, reserve=reserve)
        if d.mode == "unsupported":
            raise RuntimeInputError(f"MTP is unsupported for this context configuration: "
                                    f"{d.reason}")
        mode = d.mode
    return mode, (CapturedRows(trunk.n_embd_out) if mode == "captured" else None)


class MTPRuntime:
    """Load a trunk (+ optional `mtp-` sidecar), create the contexts, build the Engine.

    Without a sidecar (or k = 0) it decodes plainly through the same loop, so MTP off and
    on share every line of code except the drafter.

    ``policy`` (a Policy or its name; default $MTPLIB_POLICY, else beta) is negotiated
    before any model is loaded: with a sidecar and k > 0 a policy that disables MTP
    (alpha) raises RouteRefused naming it. Plain decoding is always allowed.

    Thread-safe by serializing: every method takes one lock while it calls upstream
    (`generate`, `stream` from its first step until it is exhausted or closed, the
    tokenizer, `memory`, `close`), so concurrent callers run one after another: upstream's
    context is not safe for concurrent decodes, even on different sequences (that crashed
    the process). ``engine`` and ``target`` used directly are not locked. After ``close()``
    every method raises RuntimeInputError. ``warm=True`` runs `warm_up` at load (``setup``
    in `generate`'s metrics), so no generation pays first-use graph allocation.
    """

    def __init__(self, trunk: str | RunRequest, sidecar: str | None = None, *,
                 opts: EngineOptions | None = None, rows: RowFn | None = None,
                 drafter: Drafter | None = None, trunk_kwargs: dict | None = None,
                 sidecar_kwargs: dict | None = None, policy: Policy | str | None = None,
                 warm: bool = False, **options) -> None:
        """``trunk``: the trunk's path, or a whole-model `RunRequest` (then nothing else
        that a request holds may be given). With a path, ``opts``: the request
        (`EngineOptions`); any of its fields, or of DecodeSettings', given as keywords
        replace those (`EngineOptions.build`), e.g. ``MTPRuntime(t, s, k=2, n_ctx=512,
        kv_type="f32")``: made into a RunRequest by `build_request`, which validates it
        and asks the policy once. Routed once, here."""
        from mtplib.runtime.model import Model
        from mtplib.runtime.routing import certified_recipes, route, routing_metrics

        trunk_kwargs, sidecar_kwargs = dict(trunk_kwargs or {}), dict(sidecar_kwargs or {})
        if isinstance(trunk, RunRequest):
            if sidecar is not None or opts is not None or policy is not None or options:
                raise TypeError("MTPRuntime(request): the request holds the sidecar, the "
                                "options and the policy; give them to build_request")
            req = trunk
        else:
            try:
                req = build_request(trunk, sidecar=sidecar, opts=opts, policy=policy,
                                    own_drafter=drafter is not None,
                                    headers=(trunk_kwargs.pop("header", None),
                                             sidecar_kwargs.pop("header", None)),
                                    **options)
            except TypeError as e:
                raise TypeError(f"MTPRuntime {e}") from None
        if req.ranged:
            raise RuntimeInputError(f"a ranged request (plan {req.plan}) runs in RangedMTP, "
                                    "not MTPRuntime")
        #: the run's request, as `build_request` checked it
        self.request = req
        self.opts = req.opts.resolved(ranged=False)
        self._owned: list = []
        self._lock = threading.RLock()  # serializes every call into upstream (class doc)
        self.closed = False
        self.setup: dict | None = None
        spec = req.draft  # negotiated by the request: k = 0 without a sidecar
        use_mtp = spec.mtp and drafter is None
        # each header was read and validated once, by the request: the Model takes it
        trunk_kwargs.update(header=req.trunk_header, validated=True)
        if req.sidecar is not None:
            sidecar_kwargs.update(header=req.sidecar_header, validated=True)
        self.policy = req.policy  # resolved and asked once (`policy_gate`, in the request)
        # a passing certification run for this exact pair (if recorded) makes the advert's
        # recipe certified, so a policy that wants certified can route it
        certified = certified_recipes(req.trunk, req.sidecar) if spec.mtp else frozenset()
        self.routing = routing_metrics(route(
            spec, policy=self.policy, certified=certified,
            dspark_block=dspark_draft_max(req.sidecar, req.sidecar_header) or 0),
            self.policy)
        try:
            self.trunk = Model(req.trunk, **trunk_kwargs)
            self._owned.append(self.trunk)
            self.sidecar = None
            if use_mtp and req.sidecar_kind == "dspark":
                from mtplib.runtime.dspark.context import DSparkModel

                self.sidecar = DSparkModel(req.sidecar, header=req.sidecar_header,
                                           trunk_header=req.trunk_header)
                self._owned.append(self.sidecar)
            elif use_mtp:
                self.sidecar = Model(req.sidecar, load_mtp=True, **sidecar_kwargs)
                self._owned.append(self.sidecar)
            self.engine, ctxs = build_engine(self.trunk, self.sidecar, self.opts,
                                             drafter=drafter, rows=rows)
            self._owned += ctxs
            self.target = self.engine.target
            self.mtp_ctx = ctxs[1] if len(ctxs) > 1 else None
            if warm:
                self.setup = warm_up(self.engine)
        except BaseException:
            self.close()
            raise

    @property
    def n_ctx(self) -> int:
        return self.target.n_ctx

    def stream(self, prompt: Sequence[int], n_new: int, *, seq_id: int | None = None,
               sampler: Sampler | None = None) -> Generation:
        """`generate` step by step: a `Generation` yielding each step's tokens; the lock is
        held from the first step until it is exhausted or closed. ``sampler`` replaces the
        runtime's for this generation only."""
        result: dict = {}
        return Generation(self._steps(list(prompt), n_new, seq_id, sampler, result), result)

    def _steps(self, prompt, n_new, seq_id, sampler, result) -> Iterator[list[int]]:
        with self._lock:
            self._live()
            e = self.engine
            saved = e.sampler
            e.sampler = sampler or saved
            try:
                yield from generation_steps(e, prompt, n_new, seq_id=seq_id,
                                            memory=self.memory, result=result)
            finally:
                e.sampler = saved
            result["metrics"] = replace(
                result["metrics"], routing=dict(self.routing), upstream=build_info(),
                setup=None if self.setup is None else dict(self.setup))

    def batch(self, *, warm: bool = False) -> BatchRun:
        """Continuous batching over this runtime's engine (`mtplib.runtime.batch`): slots
        join and leave between steps, every step decodes all of them together (up to
        ``n_seq_max`` slots); each call holds this runtime's lock. ``warm``: run every
        step shape once now (`warm_batch`)."""
        from mtplib.runtime.batch import BatchRun

        self._live()
        return BatchRun(self.engine, lock=self._lock, memory=self.memory, warm=warm)

    def generate(self, prompt: Sequence[int], n_new: int, *, seq_id: int | None = None,
                 sampler: Sampler | None = None) -> tuple[list[int], GenerationMetrics]:
        g = self.stream(prompt, n_new, seq_id=seq_id, sampler=sampler)
        for _ in g:
            pass
        return g.tokens, g.metrics

    def _live(self) -> None:
        if self.closed:
            raise RuntimeInputError("this MTPRuntime is closed: create a new one")

    def tokenize(self, text: str) -> list[int]:
        with self._lock:
            self._live()
            return self.trunk.tokenize(text)

    def detokenize(self, tokens: Sequence[int]) -> str:
        with self._lock:
            self._live()
            return self.trunk.detokenize(tokens)

    def memory(self, seq: int = 0) -> dict:
        """Process peak RSS and upstream's own sizes: weights and per-sequence cache state."""
        import resource

        with self._lock:
            self._live()
            mem = {"rss_peak_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                   "trunk_weights_bytes": self.trunk.size_bytes,
                   "target_seq_state_bytes": self.target.state_size(seq)}
            if self.mtp_ctx is not None:  # the drafter's: mtp_* or dspark_*
                kind = getattr(self.sidecar, "kind", "mtp")
                mem[f"{kind}_weights_bytes"] = self.sidecar.size_bytes
                mem[f"{kind}_seq_state_bytes"] = self.mtp_ctx.state_size(seq)
        return mem

    def close(self) -> None:
        """Free the contexts and models (waits for a generation in progress); idempotent."""
        with self._lock:
            self.closed = True
            for obj in reversed(self._owned):
                obj.close()
            self._owned.clear()

    def __enter__(self) -> MTPRuntime:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
