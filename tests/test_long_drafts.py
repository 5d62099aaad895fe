"""Draft lengths 4..8 on the committed trained pair: MTP on emits the tokens MTP off does.

Why: every shard advertises mtp.v4.draft1..8 as implemented (`build_advert`), while the
fixture's equality tests (tests/test_speculative.py) stop at k = 3. An advert offers only
what is tested, so the longer drafts get their own check here, on the pair whose drafter
is trained (held-out stdlib prompts): greedy tokens identical to MTP off for every prompt,
and verifies that accept 4 or more drafts (the rows past the third draft are exercised,
not only drafted and thrown away).
"""

from __future__ import annotations

import pytest

from mtplib.contract.types import MAX_DRAFT
from mtplib.model.trained import trained_paths

PAIR = trained_paths()
pytestmark = pytest.mark.skipif(
    not PAIR.exists(), reason=f"trained pair not committed under {PAIR.trunk.parent}")

LONG = tuple(range(4, MAX_DRAFT + 1))
N_PROMPTS, PROMPT_LEN, N_NEW = 4, 32, 48


@pytest.fixture(scope="module")
def runs():
    from mtplib.lab.trained_eval import heldout_modules, heldout_tokens, prompts_from
    from mtplib.runtime.speculative import MTPRuntime

    docs = heldout_tokens(PAIR.trunk, heldout_modules(PAIR.trunk.parent / "split.json"))
    prompts = prompts_from(docs, n=N_PROMPTS, length=PROMPT_LEN, seed=0)
    out = {}
    with MTPRuntime(str(PAIR.trunk), None, k=0, n_ctx=256, n_threads=1) as rt:
        out[0] = [rt.generate(p, N_NEW) for p in prompts]
    for k in LONG:
        with MTPRuntime(str(PAIR.trunk), str(PAIR.sidecar), k=k, n_ctx=256,
                        n_threads=1) as rt:
            out[k] = [rt.generate(p, N_NEW) for p in prompts]
    return out


def test_the_contract_advertises_up_to_eight():
    assert LONG[-1] == MAX_DRAFT == 8  # a new MAX_DRAFT needs this file's check too


@pytest.mark.parametrize("k", LONG)
def test_long_drafts_emit_the_tokens_of_mtp_off(runs, k):
    for (ref, _), (got, m) in zip(runs[0], runs[k], strict=True):
        assert got == ref and len(got) == N_NEW
        assert m.drafted > 0


@pytest.mark.parametrize("k", LONG)
def test_long_drafts_accept_past_the_third_position(runs, k):
    hist = [sum(m.accept_len_hist[str(i)] for _, m in runs[k]) for i in range(k + 1)]
    assert sum(hist[4:]) > 0, hist  # some verify accepted 4 or more drafts
    accepted = [sum(m.accepted_per_position_counts[i] for _, m in runs[k])
                for i in range(k)]
    assert accepted[3] > 0, accepted
