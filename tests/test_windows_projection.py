"""The windows-in-flight projection (`mtplib.reports.upstream_patches.windows_projection`):
its chain formula on known inputs, and the committed JSON and note against the module."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from mtplib.errors import InputError
from mtplib.reports.upstream_patches import windows_projection

REPO = Path(__file__).resolve().parent.parent
HERE = REPO / "evidence" / "upstream-patches"
A3 = (0.73, 0.48, 0.31)


@pytest.fixture(scope="module")
def wp():
    return windows_projection


@pytest.mark.parametrize("k", [0, 1, 2, 3])
def test_one_window_in_flight_is_ordinary_speculation(wp, k):
    r = wp.pipeline(A3, k, 1, 0.2)
    assert r["tokens_per_traversal"] == pytest.approx(1 + sum(A3[:k]))
    assert r["tok_s"] == pytest.approx((1 + sum(A3[:k])) / 0.2)
    assert r["wasted_windows_per_chain"] == 0 and r["period_s"] == 0.2


@pytest.mark.parametrize("k", [0, 1, 3])
def test_more_windows_never_help_without_acceptance(wp, k):
    zero = (0.0, 0.0, 0.0)
    one = wp.pipeline(zero, k, 1, 0.15, 0.01)["tok_s"]
    for W in range(2, 33):
        r = wp.pipeline(zero, k, W, 0.15, 0.01)
        assert r["tokens_per_chain"] == 1.0 and r["tok_s"] <= one + 1e-12
        assert r["wasted_windows_per_chain"] == pytest.approx(r["w_eff"] - 1)


def test_more_windows_never_hurt_with_acceptance_and_fill_the_pipe(wp):
    A = wp.depth_profile(A3)
    rates = [wp.pipeline(A, 0, W, 0.15, 0.0)["tok_s"] for W in range(2, 200)]
    assert all(b >= a for a, b in zip(rates, rates[1:], strict=False))
    # with no stage bound, the limit is every draft of the chain per traversal
    assert rates[-1] * 0.15 == pytest.approx(1 + sum(A), rel=0.02)
    # a stage bound caps the useful windows at traversal / stage
    capped = wp.pipeline(A, 0, 64, 0.15, 0.01)
    assert capped["w_eff"] == pytest.approx(15) and capped["period_s"] == 0.01


@pytest.mark.parametrize("k", [0, 1, 2, 4])
def test_the_closed_form_is_the_chain_distribution(wp, k):
    """E[J] = sum_j A_{j(k+1)} against the distribution of the accepted run, enumerated."""
    A = wp.depth_profile(A3, tail=0.5, max_depth=40)
    s = k + 1
    p = [1.0, *A, 0.0]
    prob = [p[n] - p[n + 1] for n in range(len(A) + 1)]  # P(N = n)
    assert sum(prob) == pytest.approx(1)
    c = wp.chain(A, k, in_flight=True)
    assert c.tokens == pytest.approx(sum(q * (n + 1) for n, q in enumerate(prob)))
    assert c.windows == pytest.approx(sum(q * math.ceil((n + 1) / s) for n, q in enumerate(prob)))


def test_shards_published_dspark_profile_gives_their_tokens_per_cycle(wp):
    """Shard's per-depth conditional acceptance (docs/V4_TREE_VERDICT.md) -> their 4.52."""
    A = wp.cumulative(wp.SHARD_DSPARK_CONDITIONAL)
    assert wp.chain(A, 0, in_flight=True).tokens == pytest.approx(4.52, abs=0.005)


def test_depth_profile_extrapolates_at_the_last_conditional_rate(wp):
    A = wp.depth_profile((0.8, 0.4))
    assert A[2] == pytest.approx(0.2) and A[3] == pytest.approx(0.1)
    assert wp.depth_profile((0.8, 0.4), tail=0.0) == (0.8, 0.4)


@pytest.mark.parametrize("bad", [dict(W=0), dict(k=-1), dict(traversal_s=0.0)])
def test_bad_input_is_one_clear_error(wp, bad):
    args = {"A": A3, "k": 1, "W": 2, "traversal_s": 0.1} | bad
    with pytest.raises(InputError):
        wp.pipeline(**args)
    with pytest.raises(InputError, match="non-increasing"):
        wp.depth_profile((0.3, 0.5))


def test_committed_json_and_note_are_what_the_module_gives(wp, tmp_path):
    d = wp.project()
    assert json.loads((HERE / "windows_projection.json").read_text()) == d
    note = (HERE / "windows-in-flight.md").read_text()
    assert wp.render(d) in note
    assert "not built" in note.lower()
    # and its command writes those bytes, wherever it runs from
    assert wp.main(["--out", str(tmp_path)]) == 0
    assert (tmp_path / wp.OUT_NAME).read_bytes() == (HERE / "windows_projection.json").read_bytes()
