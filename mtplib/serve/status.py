"""What the service says about itself, without HTTP: /health, /v1/models, /props, /slots
and /metrics, as plain functions of the worker.

Why read-only functions: they run on the event loop while a generation runs in the worker
thread; each reads the worker's state (under its locks) and never touches the backend."""

from __future__ import annotations

import time

from mtplib.serve.errors import unavailable
from mtplib.serve.intake import default_settings
from mtplib.serve.native import metrics_text, props, slot
from mtplib.serve.worker import GenerationWorker


def health(worker: GenerationWorker) -> tuple[int, dict]:
    """(status, body): 503 naming the shards while degraded."""
    code, body = worker.health.status()
    return code, {**body, "model": worker.cfg.model_id, "pending": worker.pending()}


def model_card(worker: GenerationWorker) -> dict:
    cfg = worker.cfg
    return {"id": cfg.model_id, "object": "model", "created": int(time.time()),
            "owned_by": "mtplib", "meta": {"n_ctx": cfg.n_ctx, "n_vocab": cfg.n_vocab,
                                           "draft": cfg.k, **cfg.meta}}


def props_of(worker: GenerationWorker) -> dict:
    states = worker.slot_states()
    return props(worker.cfg, default_settings(worker.cfg),
                 next((r for r in states if r), None), total_slots=len(states))


def slots_of(worker: GenerationWorker, fail_on_no_slot: bool = False) -> list[dict]:
    """/slots; ``fail_on_no_slot``: 503 when every slot is taken (llama-server's)."""
    states = worker.slot_states()
    if fail_on_no_slot and worker.pending() >= len(states):
        raise unavailable("no available slots")
    defaults = default_settings(worker.cfg)
    return [slot(worker.cfg, defaults, r, i) for i, r in enumerate(states)]


def metrics_of(worker: GenerationWorker) -> str:
    return metrics_text(worker.stats, worker.jobs.qsize(), worker.n_busy(),
                        len(worker.slot_states()))
