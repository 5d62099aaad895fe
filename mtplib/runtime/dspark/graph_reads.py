"""What upstream's DSpark graphs read and what the draft context allocates, compared with
the ownership derived from the headers (`mtplib.ownership.dspark`).

The same check as `mtplib.runtime.graph_reads` does for MTP, on the draft's two graphs
(src/models/dflash.cpp graph_dsv4): one **embd batch** (the target's features injected as
each stage's K) and one **token batch** (a noise block through the stages and the Markov
and confidence heads). An eval callback (cb_eval) on the draft context records every
weight any graph node reads (through views) and every cache tensor it touches. A weight is
the trunk's when its buffer is one the target's own decode read weights from (recorded the
same way on the target context), so the token embedding and output head read through
``ctx_other`` are told apart from the draft's tensors of the same name (``output_norm``).

The draft context is the runtime's own (`mtplib.runtime.dspark.context.DSparkContext`, made by
the same code, with the callback added to its parameters), so what is observed is what a
run allocates. DSpark drafting is gated by the policy like MTP (`routing.require_mtp` with
the dspark recipe): refused under alpha before anything loads.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from dataclasses import asdict

from mtplib.contract.capabilities import Policy
from mtplib.contract.types import DSPARK_DRAFTER, MAX_DRAFT
from mtplib.errors import InputError
from mtplib.model.dspark.validate import validate_dspark
from mtplib.model.gguf_header import read_header
from mtplib.ownership.derivation import CacheParams
from mtplib.ownership.dspark import (
    DSPARK_GRAPHS,
    DSparkOwnership,
    dspark_cache_tensors,
    part_contradictions,
)
from mtplib.runtime import ggml_tensor as gt
from mtplib.runtime.graph_reads import (
    CACHE_NAME_RE,
    GGML_TYPE_NAMES,
    PROMPT,
    Observation,
    ObservedCache,
    buffer_size,
    check_caches,
)
from mtplib.runtime.model import Context, ContextConfig, Model
from mtplib.runtime.routing import require_mtp
from mtplib.runtime.settings import ContextSettings


class _Holder:
    """The observation the callbacks write to now (one per decoded graph)."""

    def __init__(self) -> None:
        self.obs: Observation | None = None
        self.trunk_buffers: set[int] = set()


def _weight_base(t: gt.GGMLTensor) -> gt.GGMLTensor:
    while t.view_src:
        t = t.view_src.contents
    return t


def _trunk_collector(h: _Holder) -> Callable:
    """Every weight buffer the target's own decode reads: the trunk's buffers."""

    def fn(t: gt.GGMLTensor, ask: bool) -> bool:
        if ask:
            for s in (t, *gt.sources(t)):
                b = _weight_base(s)
                if b.buffer and gt.is_weight(b):
                    h.trunk_buffers.add(int(b.buffer))
        return False

    return gt.eval_callback(fn)


def _draft_collector(h: _Holder) -> Callable:
    """Weights as "<file>:<name>" (file: trunk where the buffer is the trunk's, else
    dspark) and cache tensors, into the current observation."""
    lib = gt.ggml()

    def fn(t: gt.GGMLTensor, ask: bool) -> bool:
        obs = h.obs
        if not ask or obs is None:
            return False
        for s in (t, *gt.sources(t)):
            b = _weight_base(s)
            if not b.buffer:
                continue
            nm = gt.name(b)
            if gt.is_weight(b):
                file = "trunk" if int(b.buffer) in h.trunk_buffers else "dspark"
                obs.weights.add(f"{file}:{nm}")
            elif CACHE_NAME_RE.match(nm):
                key = (nm, int(b.buffer))
                if key not in obs.caches:
                    obs.caches[key] = ObservedCache(
                        nm, int(b.buffer), tuple(int(x) for x in b.ne[:3]),
                        GGML_TYPE_NAMES.get(b.type, str(b.type)),
                        int(lib.ggml_nbytes(ctypes.addressof(b))))
        return False

    return gt.eval_callback(fn)


class _LlamaWithCallback:
    """The bindings as the draft context sees them, with ``cb_eval`` in the default
    context parameters (every other call passes through)."""

    def __init__(self, llama, cb: Callable) -> None:
        self._llama = llama
        self._cb = llama.ggml_backend_sched_eval_callback(cb)

    def __getattr__(self, name: str):
        return getattr(self._llama, name)

    def llama_context_default_params(self):
        cp = self._llama.llama_context_default_params()
        cp.cb_eval = self._cb
        return cp


class _ObservedModel:
    """A loaded DSparkModel whose contexts get the eval callback."""

    def __init__(self, model, cb: Callable) -> None:
        self._model = model
        self.llama = _LlamaWithCallback(model.llama, cb)

    def __getattr__(self, name: str):
        return getattr(self._model, name)


def observe_dspark(trunk: str, draft: str, params: CacheParams, *, n_tokens: int = 8,
                   flash_attn: str = "auto", n_threads: int = 1,
                   policy: Policy | str | None = None) -> dict[str, Observation]:
    """One embd batch (``n_tokens`` feature rows of the trunk's decode of PROMPT) and one
    noise block of the draft's block size through the runtime's DSpark context: graph ->
    what it read (``inject``, ``block``), plus ``caches`` (graph "dspark": the caches
    both touched, with each cache buffer's size). RouteRefused under a policy that
    disables drafting."""
    from mtplib.runtime.dspark.context import DSparkContext, DSparkModel, TargetFeatures

    if not 1 <= n_tokens <= len(PROMPT):
        raise InputError(f"n_tokens must be in 1..{len(PROMPT)}, got {n_tokens!r}")
    th, dh = read_header(trunk), read_header(draft)
    cfg = validate_dspark(dh, th)
    k = min(cfg.block_size, MAX_DRAFT)
    require_mtp("the DSpark graph check", (k,), policy=policy, drafter=DSPARK_DRAFTER,
                dspark_block=k)
    eff = params.effective()
    meta = {**asdict(params), **eff, "flash_attn": flash_attn}
    obs = {g: Observation(g, draft, meta) for g in DSPARK_GRAPHS}
    obs["caches"] = Observation("dspark", draft, meta)  # the draft context's, both graphs
    h = _Holder()
    settings = ContextSettings(n_ctx=params.n_ctx, n_batch=params.n_batch,
                               n_ubatch=params.n_ubatch, n_threads=n_threads,
                               kv_type=params.type_k, flash_attn=flash_attn,
                               swa_full=params.swa_full)
    ccfg = ContextConfig.from_settings(settings, n_seq_max=params.n_seq)
    with Model(trunk, header=th) as tm, Context(tm, ccfg, cb_eval=_trunk_collector(h)) as tc, \
            DSparkModel(draft, header=dh, trunk_header=th) as dm:
        feats = TargetFeatures(tc, cfg.target_layers, tm.n_embd)
        with DSparkContext(_ObservedModel(dm, _draft_collector(h)), tc, settings,  # type: ignore[arg-type]
                           n_threads=n_threads) as dc:
            toks = list(PROMPT[:n_tokens])
            tc.decode(toks, range(n_tokens), logits=True)
            rows = feats.rows(tc, n_tokens)
            h.obs = obs["inject"]
            dc.inject(rows, list(range(n_tokens)), [0] * n_tokens)
            h.obs = obs["block"]
            block = [toks[-1]] + [cfg.mask_token_id] * (k - 1)
            dc.block(block, list(range(n_tokens, n_tokens + k)), [0] * k, 1)
            h.obs = None
            for g in DSPARK_GRAPHS:
                obs["caches"].caches.update(obs[g].caches)
            for c in obs["caches"].caches.values():
                obs["caches"].buffer_bytes.setdefault(c.buffer, buffer_size(c.buffer))
    return obs


def check_dspark_reads(own: DSparkOwnership, obs: Observation) -> dict:
    """The derived readers of ``obs.graph`` against the weights upstream's graph read
    ("<file>:<name>")."""
    want = {f"{t.file}:{t.name}" for t in own.tensors if obs.graph in t.read_by}
    got = set(obs.weights)
    return {"graph": obs.graph, "derived": len(want), "observed": len(got),
            "missing_in_upstream": sorted(want - got),
            "unexpected_in_upstream": sorted(got - want), "equal": want == got}


def check_dspark(own: DSparkOwnership, params: CacheParams, *, flash_attn: str = "auto",
                 policy: Policy | str | None = None) -> dict:
    """Both graphs' reads and the draft context's caches against ``own`` (derived from
    the same files); JSON-serialisable."""
    obs = observe_dspark(own.paths["trunk"], own.paths["dspark"], params,
                         flash_attn=flash_attn, policy=policy)
    reads = [check_dspark_reads(own, obs[g]) for g in DSPARK_GRAPHS]
    caches = check_caches(dspark_cache_tensors(own.config, params), obs["caches"])
    parts = part_contradictions(own, {g: obs[g].weights for g in DSPARK_GRAPHS})
    return {"params": obs["caches"].params, "reads": reads, "caches": caches,
            "part_contradictions": parts, "parts_consistent": not parts,
            "reads_equal": all(r["equal"] for r in reads), "caches_equal": caches["equal"]}
