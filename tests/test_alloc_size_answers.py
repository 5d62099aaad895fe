"""A CPU shard's allocation-size queries are answered by the client's relay, not over the link.

Upstream's RPC client asks a shard, one blocking round trip each, the allocation size of
every new shape of some tensors (22-31 per new prompt width on the trained pair: most of a
cold generation's time to first token over a WAN). A shard serving its CPU says so in its
report (``device=cpu``), and its relay answers those queries itself with what the CPU
shard would answer (`mtplib.distributed.relay._AllocSizeAnswers`). These tests run real
shards (the build loaded, stock or patched): the tokens do not change, no query reaches a
CPU shard in loading, warm-up, prefill or decode, and $MTPLIB_FORWARD_ALLOC_SIZES=1 gives
the old behaviour back (the side-by-side the evidence uses).
"""

from __future__ import annotations

import pytest

from mtplib.distributed.ranged_mtp import RangedMTP
from mtplib.distributed.relay import WanLink
from mtplib.distributed.shard_report import (
    FORWARD_ALLOC_SIZES_ENV,
    ProbedShard,
    ShardReport,
    answers_alloc_sizes,
)
from mtplib.model.trained import trained_paths
from mtplib.runtime.engine_options import EngineOptions
from mtplib.runtime.rpc import ShardInfo
from mtplib.runtime.settings import DecodeSettings

PROMPT = list(range(100, 129))  # 29 tokens: a width the warm-up does not run


def _probed(device: str | None) -> ProbedShard:
    info = ShardInfo(version=(3, 7, 0), n_devices=1, alignment=32, max_size=1 << 40,
                     memory_free=1 << 30, memory_total=1 << 30)
    if device is None:
        return ProbedShard(**vars(info), endpoint="127.0.0.1:1", report_problem="no report")
    report = ShardReport("c", "0.3.36", "0c1e57098", "stock", "", device)
    return ProbedShard(**vars(info), endpoint="127.0.0.1:1", report=report)


def test_only_a_shard_that_reported_its_cpu_is_answered_here(monkeypatch):
    assert answers_alloc_sizes(_probed("cpu"))
    assert not answers_alloc_sizes(_probed("gpu"))
    assert not answers_alloc_sizes(_probed(""))  # an earlier mtplib's shard: said nothing
    assert not answers_alloc_sizes(_probed(None))  # no report at all
    monkeypatch.setenv(FORWARD_ALLOC_SIZES_ENV, "1")
    assert not answers_alloc_sizes(_probed("cpu"))


def _generate(k: int) -> dict:
    p = trained_paths()
    opts = EngineOptions(k=k, settings=DecodeSettings(n_ctx=256, n_threads=1), head="client")
    with RangedMTP(str(p.trunk), plan="0-1,2-3", sidecar=str(p.sidecar) if k else None,
                   seam="star") as r:
        relays = r.rt.relays
        for relay in relays.relays:  # pipelined requests then count as one wait
            relay.set_link(WanLink(10))
        toks, m = r.generate(PROMPT, 8, opts)
        labels = relays.labels()
        return {"tokens": toks, "ttft_s": m.ttft_s,
                "queries": {lb: sum(w.get("GET_ALLOC_SIZE", 0)
                                    for w in relays.waits_by_command(lb)) for lb in labels},
                "answered": {lb: sum(relays.answered_here(lb)) for lb in labels},
                "reports": [i.report.device for i in r.rt.shard_info]}


@pytest.mark.slow
@pytest.mark.parametrize("k", [0, 2])
def test_the_relay_answers_a_cpu_shards_queries_and_the_tokens_stay(monkeypatch, k):
    monkeypatch.setenv(FORWARD_ALLOC_SIZES_ENV, "1")
    before = _generate(k)
    monkeypatch.delenv(FORWARD_ALLOC_SIZES_ENV)
    after = _generate(k)
    assert after["tokens"] == before["tokens"]
    assert after["reports"] == ["cpu", "cpu"]
    # before: the prompt's new width asked the shards, over the link
    assert before["queries"]["prefill"] > 0 and not any(before["answered"].values())
    # after: not one query crossed, in any step; the prefill's were answered here
    assert not any(after["queries"].values()), after["queries"]
    assert after["answered"]["prefill"] >= before["queries"]["prefill"]
    # and the time to first token lost those round trips (10 ms each; the prefill itself
    # is a few ms on the trained pair)
    assert after["ttft_s"] < before["ttft_s"] - 0.1, (after["ttft_s"], before["ttft_s"])
