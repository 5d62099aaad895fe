"""One request object, validated and routed once per request: whole-model (MTPRuntime) and
ranged (RangedMTP, generate_ranged) count the trunk header's validations and the routing
decisions in this process."""

from __future__ import annotations

import pytest

import mtplib.distributed.ranged_mtp as ranged_mtp
import mtplib.model.validate as validate
import mtplib.runtime.model as model
import mtplib.runtime.routing as routing
from mtplib.contract.capabilities import RouteRefused
from mtplib.lab.correctness import seeded_prompt
from mtplib.runtime.engine_options import EngineOptions
from mtplib.runtime.settings import DecodeSettings
from mtplib.runtime.speculative import MTPRuntime

PROMPT = seeded_prompt(7, 10)
SETTINGS = DecodeSettings(n_ctx=256, n_threads=1)


@pytest.fixture
def counts(monkeypatch, pair):
    """Trunk validations and routing decisions, wherever this process makes them."""
    seen = {"validate": 0, "route": 0}
    real_validate, real_route = validate.validate_header, routing.route

    def counting_validate(h):
        if str(h.path) == str(pair.trunk):
            seen["validate"] += 1
        return real_validate(h)

    def counting_route(*a, **kw):
        seen["route"] += 1
        return real_route(*a, **kw)

    monkeypatch.setattr(validate, "validate_header", counting_validate)
    monkeypatch.setattr(model, "validate_header", counting_validate)
    monkeypatch.setattr(routing, "route", counting_route)
    monkeypatch.setattr(ranged_mtp, "route", counting_route)
    monkeypatch.delenv(routing.POLICY_ENV, raising=False)
    return seen


def test_build_is_the_one_way_to_make_options():
    o = EngineOptions.build(k=2, n_ctx=512, trace=True)
    assert (o.k, o.settings.n_ctx, o.trace) == (2, 512, True)
    assert EngineOptions.build(o, n_threads=1).settings.n_ctx == 512
    with pytest.raises(TypeError, match="unexpected keyword arguments \\['nope'\\]"):
        EngineOptions.build(nope=1)


def test_whole_model_request_validates_and_routes_once(pair, counts):
    with MTPRuntime(str(pair.trunk), str(pair.sidecar), opts=EngineOptions(
            k=2, settings=SETTINGS)) as rt:
        rt.generate(PROMPT, 4)
        rt.generate(PROMPT, 4)
    assert counts == {"validate": 1, "route": 1}


def test_ranged_request_validates_and_routes_once(pair, counts):
    out = ranged_mtp.generate_ranged(str(pair.trunk), PROMPT, 6, plan="0-1,2-3",
                                     sidecar=str(pair.sidecar),
                                     opts=EngineOptions(k=2, settings=SETTINGS))
    assert out.metrics.routing["recipe"] == "mtp.v4.draft2"
    assert counts == {"validate": 1, "route": 1}
    # another configuration on the same object is its own request: routed once more, and
    # a repeated one is not routed again; the files are not validated again
    with ranged_mtp.RangedMTP(str(pair.trunk), plan="0-1,2-3", sidecar=str(pair.sidecar),
                              opts=EngineOptions(k=2, settings=SETTINGS)) as r:
        counts.update(validate=0, route=0)
        for _ in range(2):
            toks, m = r.generate(PROMPT, 6, EngineOptions(k=1, settings=SETTINGS))
            assert m.routing["reason"] == "all 2 shards implement mtp.v4.draft1"
        r.generate(PROMPT, 6)
    assert counts == {"validate": 0, "route": 1}


def test_alpha_is_refused_before_any_shard_starts(pair, counts, monkeypatch):
    def no_shards(*a, **kw):
        raise AssertionError("a shard was started")

    monkeypatch.setattr("mtplib.distributed.processes.LocalShards", no_shards)
    with pytest.raises(RouteRefused, match="policy 'alpha'"):
        ranged_mtp.generate_ranged(str(pair.trunk), PROMPT, 6, plan="0-1,2-3",
                                   sidecar=str(pair.sidecar), policy="alpha",
                                   opts=EngineOptions(k=2, settings=SETTINGS))
    assert counts["route"] == 0
