"""Issue 23 item 7: a step with nothing to roll back is no rollback step. Before the fix
every commit entered the "rollback" phase and timed it, so a ranged MTP-off run (whose
``rollbacks`` is ``{}``) showed the phase's labelling round trips as 8.2 ms/token of
"rollback" in the bench's time split, and counted one "rollback" seam step per token."""

from __future__ import annotations

import contextlib
from collections import Counter

import pytest

from mtplib.distributed.ranged_mtp import RangedMTP
from mtplib.lab.correctness import seeded_prompt
from mtplib.runtime.drafters import OracleDrafter
from mtplib.runtime.engine_options import EngineOptions
from mtplib.runtime.speculative import MTPRuntime

PROMPT = seeded_prompt(3, 8)
N_NEW = 12


class _Phases:
    """A phase function that counts each step kind it brackets."""

    def __init__(self) -> None:
        self.labels: Counter = Counter()

    def __call__(self, label: str, n_tokens: int):
        self.labels[label] += 1
        return contextlib.nullcontext()


def _run(trunk: str, k: int, drafter=None, n_rs_seq=None, checkpoints="replay"
         ) -> tuple[dict, Counter]:
    """One generation; "replay" (the ranged path's setting) saves no state checkpoints,
    whose saving is labelled rollback too."""
    phases = _Phases()
    with MTPRuntime(trunk, None, k=k, drafter=drafter, n_rs_seq=n_rs_seq,
                    checkpoints=checkpoints) as rt:
        rt.engine.phase = phases
        _, m = rt.generate(PROMPT, N_NEW)
    return m, phases.labels


def test_plain_decoding_has_no_rollback_steps_or_time(pair):
    m, labels = _run(str(pair.trunk), 0)
    assert m.rollbacks == {} and m.plain_steps == N_NEW - 1
    assert labels["rollback"] == 0 and labels["decode"] == N_NEW - 1
    assert m.time_s["rollback"] == 0.0


def test_all_drafts_accepted_has_no_rollback_steps(pair):
    with MTPRuntime(str(pair.trunk), None, k=0) as rt:
        ref, _ = rt.generate(PROMPT, N_NEW)
    d = OracleDrafter(ref, len(PROMPT), wrong=False, n_vocab=256)
    m, labels = _run(str(pair.trunk), 2, d)
    assert m.accepted == m.drafted > 0 and m.rollbacks == {}
    assert labels["rollback"] == 0 and m.time_s["rollback"] == 0.0


@pytest.mark.parametrize(("n_rs_seq", "checkpoints", "kind"), [
    (None, "replay", "tail"),  # tail removal
    (0, "replay", "checkpoint_replay"),  # replay from position 0
    (0, "state", "checkpoint_replay")])  # from a saved state
def test_rejected_drafts_are_one_timed_rollback_step_each(pair, n_rs_seq, checkpoints, kind):
    d = OracleDrafter([0] * 256, len(PROMPT), wrong=True, n_vocab=256)
    m, labels = _run(str(pair.trunk), 2, d, n_rs_seq, checkpoints)
    n = m.verify_steps
    assert n > 0 and m.rollbacks == {kind: n}  # every verify rejected its drafts
    assert n + m.plain_steps == N_NEW - 1  # one token (the target's) per step
    # state checkpoints: one saved after the prefill and one before each verify (labelled
    # rollback too: what they cost belongs to rolling back)
    saves = 1 + n if checkpoints == "state" else 0
    assert labels["rollback"] == n + saves
    assert m.time_s["rollback"] > 0.0


def test_ranged_mtp_off_has_no_rollback_time_or_seam_step(pair):
    with RangedMTP(str(pair.trunk), plan="0-1,2-3") as r:
        _, m = r.generate(PROMPT, N_NEW, EngineOptions(k=0))
    assert m.rollbacks == {}
    assert m.time_s["rollback"] == 0.0
    assert "rollback" not in m.steps_by_label
    assert m.seam_report["steps"].get("rollback", {}).get("steps", 0) == 0
