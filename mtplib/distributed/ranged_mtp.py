"""Ranged MTP: the speculative loop with the trunk's layers on RPC shards, MTP on the tail.

The loop runs inside the ranged runtime's client worker (upstream's RPC client aborts its
process when a shard is lost, so it never runs in the caller's process). Each step kind
is labelled (prefill, draft, verify, decode, feed, rollback) so the counting relays in
front of the shards attribute every byte on every shard connection to it.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Sequence
from dataclasses import replace

from mtplib.contract.capabilities import Policy
from mtplib.distributed.relay import WanLink, parse_wan
from mtplib.runtime.routing import resolve_policy, route, routing_metrics
from mtplib.runtime.speculative import EngineOptions


def _worker_generate(models, opts: EngineOptions, prompt: list[int], n_new: int) -> tuple:
    """Runs in the worker (`RangedRuntime.call`): build the Engine on the ranged models."""
    from mtplib.distributed.worker import worker_step
    from mtplib.runtime.speculative import build_engine, run_generation

    engine, owned = build_engine(models.trunk, models.sidecar if opts.k else None, opts,
                                 phase=worker_step)
    try:
        llama = models.trunk.llama

        def memory(seq: int) -> dict:
            mem = {"trunk_weights_bytes": models.trunk.size_bytes,
                   "target_seq_state_bytes": int(llama.llama_state_seq_get_size(
                       engine.target.ptr, seq))}
            if len(owned) > 1:
                mem["mtp_weights_bytes"] = models.sidecar.size_bytes
            return mem

        return run_generation(engine, prompt, n_new, memory=memory)
    finally:
        for c in reversed(owned):
            c.close()


class RangedMTP:
    """A trunk on RPC shards by ``plan`` (+ the sidecar on the tail shard) for several
    measured generations; local shards are started and stopped when no endpoints are
    given. ``generate`` returns (tokens, metrics) with that run's seam bytes.

    Each generation negotiates its recipe under ``policy`` (default $MTPLIB_POLICY, else
    beta) with the shards' adverts (the tail's says whether the MTP block was placed on it):
    MTP under alpha raises RouteRefused naming the policy; k = 0 always runs.
    ``silence_timeout_s``: see `RangedRuntime` (None: $MTPLIB_SHARD_SILENCE_S, else 15 s).

    Thread-safe by serializing: ``generate`` holds one lock from resetting the byte
    counters to reading them, so each result's seam bytes are its own generation's (two
    threads at once would count each other's traffic)."""

    def __init__(self, trunk: str, *, plan: str, sidecar: str | None = None,
                 endpoints: Sequence[str] | None = None, shard_threads: int = 1,
                 allow_remote: bool = False, wan: str | Sequence[WanLink] | None = None,
                 mtp_placement: str = "tail", policy: Policy | str | None = None,
                 silence_timeout_s: float | None = None) -> None:
        from mtplib.distributed.client import RangedRuntime
        from mtplib.distributed.processes import LocalShards
        from mtplib.model.gguf_header import read_header
        from mtplib.ownership.plan import PlanError, ShardPlan
        from mtplib.runtime.model import check_pair

        self._lock = threading.RLock()  # one generation at a time: counters are per runtime
        self.closed = False
        self.policy = resolve_policy(policy)
        from mtplib.model.validate import validate_header

        h = read_header(trunk)
        validate_header(h)  # before anything reads a key or upstream loads the file
        if sidecar is not None:
            check_pair(h, read_header(sidecar))
        self.n_vocab = h.n_vocab
        self.plan = ShardPlan.parse(plan, int(h.kv["deepseek4.block_count"]))
        if endpoints is not None and len(endpoints) != self.plan.n_shards:
            raise PlanError(f"plan {self.plan} has {self.plan.n_shards} shards but "
                            f"{len(endpoints)} endpoints were given")
        links = wan if wan is None or not isinstance(wan, str) else parse_wan(wan,
                                                                             self.plan.n_shards)
        self._stack = contextlib.ExitStack()
        try:
            self.shards = None
            if endpoints is None:
                self.shards = self._stack.enter_context(
                    LocalShards(self.plan.n_shards, shard_threads))
            self.rt = self._stack.enter_context(RangedRuntime(
                trunk, self.plan, endpoints, shards=self.shards, allow_remote=allow_remote,
                sidecar=sidecar, wan=links, mtp_placement=mtp_placement,
                silence_timeout_s=silence_timeout_s))
        except BaseException:
            self._stack.close()
            raise
        self.has_sidecar = sidecar is not None

    def generate(self, prompt: Sequence[int] | str, n_new: int,
                 opts: EngineOptions | None = None) -> tuple[list[int], dict]:
        from mtplib.runtime.model import RuntimeInputError, check_n_new, check_tokens

        n_new = check_n_new(n_new)
        if not isinstance(prompt, str):
            prompt = check_tokens(prompt, self.n_vocab)
        with self._lock:
            if self.closed:
                raise RuntimeInputError("this RangedMTP is closed: create a new one")
            return self._generate(prompt, n_new, opts)

    def _generate(self, prompt: Sequence[int] | str, n_new: int,
                  opts: EngineOptions | None) -> tuple[list[int], dict]:
        from mtplib.distributed.worker import tokenize

        opts = opts or EngineOptions(k=3 if self.has_sidecar else 0)
        if not self.has_sidecar:
            opts = replace(opts, k=0)
        # caches are shard-local: a rollback beyond n_rs_seq replays, it never moves state
        opts = replace(opts, checkpoints="replay")
        rt = self.rt
        decision = route(opts.k, policy=self.policy, n_shards=self.plan.n_shards,
                         has_sidecar=self.mtp_on_tail)
        toks = rt.call(tokenize, prompt) if isinstance(prompt, str) else list(prompt)
        rt.reset_counts()
        tokens, metrics = rt.call(_worker_generate, opts, toks, n_new)
        metrics.update(rt.seam_metrics())
        metrics["seam_report"] = rt.seam_report()
        metrics["plan"] = str(self.plan)
        metrics["endpoints"] = list(rt.endpoints)
        metrics["local_shards"] = self.shards is not None
        metrics["routing"] = routing_metrics(decision, self.policy)
        metrics["placement"] = {str(k): v for k, v in rt.trunk["placement"].items()}
        metrics["wan"] = [str(r.link) for r in rt.relays.relays]
        metrics["head"] = opts.head
        if rt.sidecar:
            metrics["mtp_placement"] = rt.mtp_placement
            metrics["mtp_endpoints"] = sorted(set(rt.sidecar["placement"].values()))
        return tokens, metrics

    @property
    def mtp_on_tail(self) -> bool:
        """The advert of the party next to the sampler: the MTP block was loaded, and
        upstream placed all of it on the tail shard (placement "tail") or it runs in this
        client process (placement "client", on the client's CPU)."""
        side = self.rt.sidecar
        if not side:
            return False
        if self.rt.mtp_placement == "client":
            return True
        return set(side["placement"].values()) == {self.rt.endpoints[-1]}

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
                    allow_remote: bool = False, wan: str | Sequence[WanLink] | None = None,
                    mtp_placement: str = "tail", policy: Policy | str | None = None) -> dict:
    """One generation with the trunk split over shards by ``plan`` (MTP on the tail shard
    when a sidecar is given and k > 0). Returns {"tokens", "metrics"(, "text")}. A policy
    that refuses the recipe is refused before any shard starts."""
    from mtplib.distributed.worker import detokenize

    pol = resolve_policy(policy)
    k = 0 if sidecar is None else (3 if opts is None else opts.k)
    route(k, policy=pol)  # the policy gate; each generation negotiates with the shards too
    with RangedMTP(trunk, plan=plan, sidecar=sidecar if (opts is None or opts.k) else None,
                   endpoints=endpoints, shard_threads=shard_threads,
                   allow_remote=allow_remote, wan=wan, mtp_placement=mtp_placement,
                   policy=pol) as r:
        tokens, metrics = r.generate(prompt, n_new, opts)
        out = {"tokens": tokens, "metrics": metrics}
        if isinstance(prompt, str):
            out["text"] = r.rt.call(detokenize, tokens)
        return out
