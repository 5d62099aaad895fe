"""Issue 39 item 1: `mtplib serve --parallel N` under seeded mixed traffic (tests/
serve_traffic.py: greedy probes streamed and not, sampled requests with seeds,
log-probabilities, ``n_predict: -1``, prompts at the context limit, bad input, clients that
abandon requests mid-generation). Every greedy probe is compared with the same request
served alone: with MTP on it must be equal, near-ties included (docs/serve.md); no 5xx and
no traceback in the service's log. The red team's probe is among the cases.

The red team's "wrong" list ([199, 460, 339, ...] for "def main(" as a chat message) is the
answer served alone on this host (stock and patched builds): position 34 is a near-tie
(test below), so another decode shape may flip it; nothing leaks between requests.

Measured on the trained pair (patched build, 2-core AMD EPYC, MTP off, with the decodes
the near-tie test makes): at position 34 tokens 460 and 3 lie 0.00041 apart from a
one-token decode and 0.00010 apart from a two-token window; a one-token decode and a
window differ by up to 0.00075 in that row, windows of two and three tokens by 0.0. The
service's resident memory under this traffic (`mtplib serve ... --parallel 4 --queue 16`,
`python tests/serve_traffic.py --url URL --seed 11`, VmRSS every 20 s): 154 MiB at the
start, 188 MiB after about 12 minutes, flat over the last 5 (the run was stopped there)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import serve_traffic
from test_serve import TRAINED, start, stop

from mtplib.lab.quality import NOISE_BOUND
from mtplib.runtime.sampling import Sampler
from mtplib.runtime.speculative import MTPRuntime

WHOLE = ("-m", str(TRAINED.trunk), "-md", str(TRAINED.sidecar), "--draft", "2")
#: the service's peak RSS under the stress test, MiB (issue 39 item 3; the module docstring
#: gives the measured figures); the red team saw 430-460 MB
RSS_CEILING_MB = 512


def _peak_rss_mb(pid: int) -> float:
    """The process's peak resident set (VmHWM), in MB."""
    with open(f"/proc/{pid}/status") as f:
        kb = next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))
    return kb / 1024


def _replay(args: tuple[str, ...], seed: int, n_bursts: int) -> serve_traffic.Report:
    served = start(*args, "--queue", "16")
    try:
        n_ctx = served.ready["n_ctx"]
        rep = asyncio.run(serve_traffic.run(served.url, seed, n_ctx, n_bursts))
        peak = _peak_rss_mb(served.proc.pid)
    finally:
        assert stop(served.proc) == 0, served.log()
    log = "".join(served.stderr)
    assert "Traceback" not in log, log[-3000:]
    assert not [c for c in rep.statuses if c >= 500], (rep.statuses, log[-2000:])
    assert not rep.errors, rep.errors[:5]
    assert not rep.mismatches, [(r.path, r.body, got, want)
                                for r, got, want in rep.mismatches[:3]]
    assert rep.compared >= n_bursts  # about 1.7 probes a burst
    assert not rep.near_ties, rep.near_ties  # a batch answers bitwise as alone
    assert peak < RSS_CEILING_MB, peak
    return rep


def test_generator_replays_the_same_sequence_and_holds_the_red_team_probe():
    def take(seed: int) -> list:
        it = serve_traffic.requests(seed, 512)
        return [[(r.kind, r.key(), r.cancel_after_s) for r in next(it)] for _ in range(30)]

    assert take(3) == take(3) and take(3) != take(4)
    kinds = {k for burst in take(3) for k, _, _ in burst}
    assert {"probe", "stream_probe", "cancel_nonstream", "bad", "ctx_limit"} <= kinds
    probe = serve_traffic.Req("probe", serve_traffic.RED_TEAM_PROBE["path"],
                              {**serve_traffic.RED_TEAM_PROBE["body"], "return_tokens": True,
                               "stream": False})
    assert probe.key() in {key for burst in take(3) for _, key, _ in burst}


def test_classify_counts_a_near_tie_only_where_the_margin_is_small():
    want, margins = [1, 2, 3, 4], [0.5, 1e-4, 0.3, 0.2]
    assert serve_traffic.classify([1, 2, 3, 4], want, margins) is None
    assert serve_traffic.classify([1, 9, 9, 9], want, margins) == (1, 1e-4)  # near-tie
    i, m = serve_traffic.classify([1, 2, 9, 9], want, margins)
    assert (i, m) == (2, 0.3) and m >= NOISE_BOUND  # a real mismatch
    assert serve_traffic.classify([1, 2], want, margins) == (2, 0.3)  # cut short


@pytest.mark.slow
def test_the_red_team_probe_parts_at_a_near_tie():
    """Position 34 of the red team's probe: 460 and 3 within float noise of each other,
    and the verify path (a two-token window) moves those logits by float noise only."""
    with MTPRuntime(str(TRAINED.trunk), None, k=0, n_seq_max=4, n_ctx=2048) as rt:
        prompt = rt.tokenize("<|im_start|>user\ndef main(<|im_end|>\n<|im_start|>"
                             "assistant\n")
        seen: dict = {}
        toks, _ = rt.generate(prompt, 2, sampler=Sampler(
            observe=lambda p, lg: seen.__setitem__(p, lg.copy())))
        lg = seen[len(prompt) + 1]
        top = np.sort(lg)[::-1]
        assert toks[0] == 199 and {int(np.argmax(lg))} <= {3, 460}
        assert set(np.argsort(-lg)[:2].tolist()) == {3, 460}
        assert top[0] - top[1] < NOISE_BOUND
        # the same position's logits from a two-token window (the verify path)
        ctx = rt.target
        ctx.seq_rm(0, 0, -1)
        ctx.decode(prompt, range(len(prompt)), seq_id=0)
        ctx.decode([199, 3], [len(prompt), len(prompt) + 1], seq_id=0, logits=True)
        two = ctx.logits_all(2)[0]
        assert 0 < np.abs(two - lg).max() < NOISE_BOUND


@pytest.mark.slow
@pytest.mark.parametrize("parallel,seed,n_bursts", [(4, 1, 40), (3, 3, 10), (2, 2, 15),
                                                    (1, 4, 8)])
def test_mixed_traffic_whole_model(parallel, seed, n_bursts):
    _replay((*WHOLE, "--parallel", str(parallel)), seed, n_bursts)


@pytest.mark.slow
def test_mixed_traffic_whole_model_mtp_off():
    """MTP off: a lone slot's one-token step is padded, so alone equals beside others."""
    _replay(("-m", str(TRAINED.trunk), "--parallel", "4"), 6, 15)


@pytest.mark.slow
def test_mixed_traffic_ranged():
    _replay((*WHOLE, "--parallel", "4", "--plan", "0-1,2-3"), 5, 12)
