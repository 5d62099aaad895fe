"""The draft length is validated once per run: a `mtplib generate` with MTP in this
process (whole model and ranged) calls the one validator (`draft_problem`, through
`checked_draft`) once, and every floor after the CLI carries the checked `DraftLength`;
without --mtp there is no length to check (MTP off is the constant `NO_DRAFT`): 0 calls."""

from __future__ import annotations

import pickle

import pytest

import mtplib.contract.types as types
from mtplib.cli import main
from mtplib.contract.types import (
    NO_DRAFT,
    DraftLength,
    DraftRule,
    DraftSpec,
    checked_draft,
    draft_with,
)
from mtplib.runtime.engine_options import EngineOptions


@pytest.fixture
def draft_checks(monkeypatch):
    """How often this process validates a draft length."""
    seen = {"n": 0}
    real = types.draft_problem

    def counting(name, k):
        seen["n"] += 1
        return real(name, k)

    monkeypatch.setattr(types, "draft_problem", counting)
    monkeypatch.delenv("MTPLIB_POLICY", raising=False)
    return seen


def _generate(pair, *extra: str) -> int:
    return main(["generate", "--model", str(pair.trunk), "--tokens", "1,2,3", "--n", "4",
                 "--ctx", "256", "--threads", "1", "--json", *extra])


@pytest.mark.parametrize("extra", [
    ("--mtp", "S", "--draft", "2"),
    (),
    ("--mtp", "S", "--draft", "2", "--plan", "0-1,2-3"),
    ("--plan", "0-1,2-3"),
], ids=["whole-mtp", "whole-plain", "ranged-mtp", "ranged-plain"])
def test_a_generate_run_checks_its_draft_length_once(pair, draft_checks, capsys, extra):
    extra = tuple(str(pair.sidecar) if x == "S" else x for x in extra)
    assert _generate(pair, *extra) == 0
    assert '"tokens"' in capsys.readouterr().out
    assert draft_checks["n"] == (1 if "--mtp" in extra else 0)


def test_a_bad_draft_is_refused_by_that_one_check(pair, draft_checks, capsys):
    assert _generate(pair, "--mtp", str(pair.sidecar), "--draft", "9") == 2
    assert "--draft must be in 1..8, got 9" in capsys.readouterr().out  # --json: on stdout
    assert draft_checks["n"] == 1


def test_checked_values_are_carried_not_checked_again(draft_checks):
    k = checked_draft(2)
    assert type(k) is DraftLength and k == 2 and draft_checks["n"] == 1
    o = EngineOptions(k=k)
    spec = DraftSpec(o.k)
    again = pickle.loads(pickle.dumps(o))  # what the ranged worker gets
    assert (spec.recipe, type(again.k), o.under(DraftRule(True)) is o) == (
        "mtp.v4.draft2", DraftLength, True)
    assert o.under(DraftRule(False)).k is NO_DRAFT and draft_checks["n"] == 1
    EngineOptions(k=3)  # a plain int entering at this floor is checked here
    assert draft_checks["n"] == 2


def test_no_sidecar_means_mtp_off_in_one_rule(draft_checks):
    assert draft_with(5, has_sidecar=False) is NO_DRAFT
    assert draft_with(99, has_sidecar=False) is NO_DRAFT  # nothing to draft with: unread
    assert draft_with(5, has_sidecar=True) == 5
    with pytest.raises(types.ContractError, match="draft length k must be in 1..8"):
        draft_with(9, has_sidecar=True)
    assert DraftSpec.requested(4, mtp=False) == DraftSpec(0)


@pytest.fixture
def plan_and_headers(monkeypatch, pair):
    """Plan parses, endpoint-count checks and trunk-header reads in this process, and what
    the ranged worker is sent to open."""
    import mtplib.distributed.client as client
    import mtplib.model.gguf_header as gguf_header
    import mtplib.ownership.plan as plan
    import mtplib.runtime.rpc as rpc

    seen = {"parse": 0, "endpoints": 0, "read_header": 0, "read_header_fast": 0,
            "sent": []}
    real_parse, real_check = plan.parse_plan, plan.check_endpoints
    real_read, real_fast = gguf_header.read_header, gguf_header.read_header_fast
    real_request = client.RangedRuntime._request

    def parse(text, n_layer):
        seen["parse"] += 1
        return real_parse(text, n_layer)

    def check(p, eps):
        seen["endpoints"] += 1
        return real_check(p, eps)

    def reader(real):
        def read(path, *a, **kw):
            seen[real.__name__] += str(path) == str(pair.trunk)
            return real(path, *a, **kw)
        return read

    def request(self, msg, *a, **kw):
        if msg[0] == "open":
            seen["sent"].append(msg[1])
        return real_request(self, msg, *a, **kw)

    monkeypatch.setattr(plan, "parse_plan", parse)
    for mod in (client, rpc, plan):
        monkeypatch.setattr(mod, "check_endpoints", check)
    monkeypatch.setattr(gguf_header, "read_header", reader(real_read))
    monkeypatch.setattr(gguf_header, "read_header_fast", reader(real_fast))
    monkeypatch.setattr(client.RangedRuntime, "_request", request)
    monkeypatch.delenv("MTPLIB_POLICY", raising=False)
    return seen


@pytest.mark.parametrize("mtp", [True, False], ids=["mtp", "plain"])
def test_a_ranged_run_parses_its_plan_and_reads_its_header_once(pair, plan_and_headers,
                                                                capsys, mtp):
    from mtplib.ownership.plan import ShardPlan

    extra = ("--mtp", str(pair.sidecar), "--draft", "2") if mtp else ()
    assert _generate(pair, "--plan", "0-1,2-3", *extra) == 0
    capsys.readouterr()
    seen = plan_and_headers
    assert (seen["parse"], seen["endpoints"]) == (1, 1)
    # the trunk's header: read once by the backend (validated there) and sent to the
    # worker, which reads none; the CLI's --ctx default reads context_length's keys
    # (read_header_fast: no token list, milliseconds) before, not the header again
    assert (seen["read_header"], seen["read_header_fast"]) == (1, 1)
    (sent,) = seen["sent"]  # the worker gets the run's request: plan and headers in it
    req = sent["request"]
    assert isinstance(req.plan, ShardPlan) and str(req.plan) == "0-1,2-3"
    assert str(req.trunk_header.path) == str(pair.trunk)
    assert (req.sidecar_header is not None) == mtp


def test_a_wrong_endpoint_count_keeps_its_message(pair, capsys):
    assert _generate(pair, "--plan", "0-1,2-3", "--endpoints", "127.0.0.1:1") == 2
    assert "plan 0-1,2-3 has 2 shards but 1 endpoints were given" in capsys.readouterr().out


def test_a_whole_model_run_reads_its_trunk_header_once(pair, plan_and_headers, capsys):
    assert _generate(pair, "--mtp", str(pair.sidecar), "--draft", "2") == 0
    capsys.readouterr()
    # MTPRuntime reads it (the pair check), the Model takes that header; --ctx's default
    # read the keys first (read_header_fast)
    assert (plan_and_headers["read_header"], plan_and_headers["read_header_fast"]) == (1, 1)
