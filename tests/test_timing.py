"""`mtplib.runtime.timing`: the lab times decodes through it, not through the C library."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from mtplib.runtime.timing import DecodeTimer, synchronize, timed


class FakeLlama:
    """The two C functions the timer wraps, recording their calls."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def llama_decode(self, ctx, batch):
        self.calls.append(f"decode {ctx} {batch}")
        return 0

    def llama_synchronize(self, ctx):
        self.calls.append(f"sync {ctx}")

    def llama_n_ctx(self, ctx):
        return 64


def test_timed_records_each_decode_and_restores_the_context():
    lib = FakeLlama()
    ctx = SimpleNamespace(llama=lib, ptr="P")
    with timed(ctx) as t:
        assert ctx.llama is t and isinstance(t, DecodeTimer)
        assert ctx.llama.llama_decode("P", "b1") == 0 and ctx.llama.llama_decode("P", "b2") == 0
        assert ctx.llama.llama_n_ctx("P") == 64  # everything else passes through
    assert ctx.llama is lib
    assert lib.calls == ["decode P b1", "decode P b2"]  # no synchronize unless asked
    assert len(t.times) == len(t.cpu) == 2 and t.last == t.times[-1] >= 0.0


def test_sync_waits_inside_the_timed_region_and_errors_restore():
    lib = FakeLlama()
    ctx = SimpleNamespace(llama=lib, ptr="P")
    with pytest.raises(RuntimeError), timed(ctx, sync=True) as t:
        ctx.llama.llama_decode("P", "b")
        raise RuntimeError("a failed step")
    assert ctx.llama is lib and lib.calls == ["decode P b", "sync P"] and len(t.times) == 1
    synchronize(ctx)
    assert lib.calls[-1] == "sync P"
