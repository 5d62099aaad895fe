"""Timing upstream's decodes on a `Context`, for the lab's cost measurements.

`timed(ctx)` stands in for the C library a context calls (``ctx.llama``) while it is active
and records the wall and the process CPU time (all threads: robust to preemption) of each
``llama_decode``; ``sync`` adds a ``llama_synchronize``, so work a GPU backend queues is
inside the measured time. The lab measures through this instead of touching the C library
itself (tests/test_layers.py: only the runtime and the llama adapter do).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any


class DecodeTimer:
    """Stands in for the llama_cpp module on one context: times ``llama_decode`` only."""

    def __init__(self, llama: Any, *, sync: bool = False) -> None:
        self._llama = llama
        self.sync = sync
        self.times: list[float] = []
        self.cpu: list[float] = []
        self.last = self.last_cpu = 0.0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._llama, name)

    def llama_decode(self, ctx: Any, batch: Any) -> Any:
        c0, t0 = time.process_time(), time.perf_counter()
        rc = self._llama.llama_decode(ctx, batch)
        if self.sync:
            self._llama.llama_synchronize(ctx)
        self.last = time.perf_counter() - t0
        self.last_cpu = time.process_time() - c0
        self.times.append(self.last)
        self.cpu.append(self.last_cpu)
        return rc


@contextmanager
def timed(ctx: Any, *, sync: bool = False) -> Iterator[DecodeTimer]:
    """Time ``ctx``'s decodes while the block runs; the context is as before afterwards."""
    timer = DecodeTimer(ctx.llama, sync=sync)
    ctx.llama = timer
    try:
        yield timer
    finally:
        ctx.llama = timer._llama


def synchronize(ctx: Any) -> None:
    """Wait until the backends finished the work ``ctx``'s last decode queued (upstream's
    decode returns with RPC shards or a GPU still computing)."""
    ctx.llama.llama_synchronize(ctx.ptr)
