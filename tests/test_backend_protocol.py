"""`MTPRuntime` and `RangedMTP` implement the declared `Backend` interface (and `RangedMTP`
the `Recoverable` one) that serve types against: every member exists, and every parameter
the protocol names is accepted under that name and kind (checked on the classes: no model
is loaded)."""

from __future__ import annotations

import inspect

import pytest

from mtplib.distributed.ranged_mtp import RangedMTP
from mtplib.runtime.backend import Backend, Recoverable
from mtplib.runtime.speculative import MTPRuntime
from mtplib.serve import faults, worker


def _members(proto: type) -> list[str]:
    return sorted(n for n in proto.__dict__ if not n.startswith("_"))


def _params(fn) -> dict[str, inspect.Parameter]:
    return {n: p for n, p in inspect.signature(fn).parameters.items() if n != "self"}


def _check(cls: type, proto: type) -> list[str]:
    bad = []
    for name in _members(proto):
        want = inspect.getattr_static(proto, name)
        got = inspect.getattr_static(cls, name, None)
        if got is None:
            bad.append(f"{cls.__name__}.{name} missing")
        elif isinstance(want, property):
            if not isinstance(got, property):
                bad.append(f"{cls.__name__}.{name} is not a property")
        else:
            have = _params(got)
            for pname, p in _params(want).items():
                q = have.get(pname)
                if q is None:
                    bad.append(f"{cls.__name__}.{name} lacks parameter {pname}")
                elif p.kind == p.KEYWORD_ONLY and q.kind not in (q.KEYWORD_ONLY,
                                                                 q.POSITIONAL_OR_KEYWORD):
                    bad.append(f"{cls.__name__}.{name}: {pname} is not a keyword")
                elif p.default is not p.empty and q.default is q.empty:
                    bad.append(f"{cls.__name__}.{name}: {pname} has no default")
    return bad


@pytest.mark.parametrize("cls", [MTPRuntime, RangedMTP], ids=lambda c: c.__name__)
def test_each_backend_implements_the_declared_interface(cls):
    assert _check(cls, Backend) == []


def test_the_ranged_backend_is_recoverable_and_the_whole_model_is_not():
    assert _check(RangedMTP, Recoverable) == []
    assert _check(MTPRuntime, Recoverable) != []  # it has no shards to lose


def test_the_check_fails_on_a_class_that_drifts():
    class Drifted:
        n_ctx = 4  # not a property

        def tokenize(self, text): ...

        def stream(self, prompt, n_new): ...  # no sampler

    bad = _check(Drifted, Backend)
    assert "Drifted.n_ctx is not a property" in bad
    assert "Drifted.stream lacks parameter sampler" in bad
    assert "Drifted.detokenize missing" in bad


def test_serve_types_against_the_protocol_not_any():
    for fn in (worker.GenerationWorker.__init__, worker.BatchWorker.__init__,
               faults.BackendHealth.__init__):
        assert inspect.signature(fn).parameters["backend"].annotation == "Backend", fn
