"""Continuous batching (issue 30 item 1) on the tiny V4 fixture: several sessions stepped in
one target batch each step, isolated as the DGR-066 rules require: each session's tokens
equal the same session run alone; no session sees another's tokens, epochs or state; a
rollback in one leaves the others' logits bit-identical; sessions join and leave between
steps (a reused sequence id starts clean)."""

from __future__ import annotations

import numpy as np
import pytest

from mtplib.contract.session import ForeignSessionError
from mtplib.lab.correctness import seeded_prompt
from mtplib.lab.quality import NOISE_BOUND
from mtplib.runtime.batch import BatchRun, batch_step
from mtplib.runtime.drafters import SyntheticDrafter
from mtplib.runtime.model import RuntimeInputError
from mtplib.runtime.sampling import Sampler
from mtplib.runtime.speculative import MTPRuntime

N_NEW = 24
SEEDS = (11, 12, 13, 14)


def _observed(seen: dict) -> Sampler:
    """A greedy sampler recording the last target logits it picked from, by position."""
    return Sampler(observe=lambda pos, lg: seen.__setitem__(pos, lg.copy()))


@pytest.fixture(scope="module")
def rt(pair):
    with MTPRuntime(str(pair.trunk), str(pair.sidecar), k=2, n_seq_max=4, n_ctx=512,
                    trace=True) as r:
        yield r


@pytest.fixture(scope="module")
def alone(rt):
    """Each prompt run alone (the one-session path): tokens, logits by position, steps."""
    out = {}
    for seed in SEEDS:
        seen: dict = {}
        toks, m = rt.generate(seeded_prompt(seed), N_NEW, sampler=_observed(seen))
        out[seed] = (toks, seen, m)
    return out


def _run(b: BatchRun, n_new: dict[int, int]) -> dict:
    """Join every seed (n_new[seed] tokens each), step until every slot finished; each
    seed's (tokens, logits by position, metrics)."""
    seen = {seed: {} for seed in n_new}
    slot_of, res = {}, {}
    for seed, n in n_new.items():
        slot_of[seed], _ = b.join(seeded_prompt(seed), n, sampler=_observed(seen[seed]))
    while len(res) < len(n_new):
        b.step()
        for seed, q in slot_of.items():
            if seed not in res and q not in b.active():
                res[seed] = (*b.leave(q), seen[seed])
    return {seed: (toks, seen[seed], m) for seed, (toks, m, _) in res.items()}


def test_batched_sessions_equal_alone(rt, alone):
    b = rt.batch()
    got = _run(b, {seed: N_NEW for seed in SEEDS})
    for seed in SEEDS:
        toks, seen, m = got[seed]
        a_toks, a_seen, a_m = alone[seed]
        assert toks == a_toks, seed
        # the same draft-and-accept history (a batch slot also drafts in its last step)
        n = len(a_m.steps)
        assert m.drafted > 0 and [x["accepted"] for x in m.steps[:n]] == \
            [x["accepted"] for x in a_m.steps]
        for pos, lg in a_seen.items():  # batch shapes differ from alone: float noise only
            assert np.abs(seen[pos] - lg).max() < NOISE_BOUND, (seed, pos)
    b.close()


def test_rollback_in_one_leaves_the_others_bit_identical(rt):
    """Session A beside B, then beside another B' (other prompt, other accepts and
    rollbacks; both outlast A, so every step of A has the same batch shape): A's logits,
    drafts and tokens are bit-identical in both runs."""
    runs = []
    for other in (21, 22):
        b = rt.batch()
        runs.append(_run(b, {5: N_NEW, other: 3 * N_NEW}))
        b.close()
    (t1, s1, m1), (t2, s2, m2) = runs[0][5], runs[1][5]
    assert t1 == t2 and m1.steps == m2.steps  # the same drafts and accepts per step
    assert s1.keys() == s2.keys()
    assert all(np.array_equal(s1[p], s2[p]) for p in s1)
    b1, b2 = runs[0][21][2], runs[1][22][2]
    assert b1.steps != b2.steps  # the neighbours really did differ
    assert sum(b1.rollbacks.values()) + sum(b2.rollbacks.values()) > 0


def test_a_step_holds_one_rollback_phase_however_many_slots_roll_back(rt):
    """A phase is a labelled step (ranged: two pipe round trips to the parent): a batch
    step enters the rollback phase once, also when several of its slots roll back."""
    import contextlib

    from mtplib.contract.labels import StepKind

    b = rt.batch()
    e = b.engine
    entered: list[str] = []

    @contextlib.contextmanager
    def phase(label, n):
        entered.append(label)
        yield

    ids = [b.join(seeded_prompt(s), N_NEW)[0] for s in SEEDS]
    old, e.phase = e.phase, phase
    most = 0
    try:
        while b.active():
            live = [b.slots[q].session for q in b.active()]
            before = [sum(s.metrics.rollbacks.values()) for s in live]
            entered.clear()
            b.step()
            rolled = sum(sum(s.metrics.rollbacks.values()) > n
                         for s, n in zip(live, before, strict=True))
            assert entered.count(StepKind.ROLLBACK) == (1 if rolled else 0), entered
            most = max(most, rolled)
    finally:
        e.phase = old
        for q in ids:
            b.leave(q)
        b.close()
    assert most >= 2  # a step where several slots rolled back did occur


def test_sessions_join_and_leave_mid_run(rt, alone):
    """A starts alone; B joins at step 3, C at step 5; D joins after B left, on B's
    sequence id: every one's tokens equal its run alone."""
    b = rt.batch()
    s11, _ = b.join(seeded_prompt(11), N_NEW)
    for _ in range(3):
        b.step()
    s12, _ = b.join(seeded_prompt(12), 6)  # a short one: it leaves early
    b.step()
    b.step()
    s13, _ = b.join(seeded_prompt(13), N_NEW)
    while s12 in b.active():
        b.step()
    toks12, _m = b.leave(s12)
    assert toks12 == alone[12][0][:6]
    s14, _ = b.join(seeded_prompt(14), N_NEW)
    assert s14 == s12  # the freed sequence, reused: it must start clean
    while b.active():
        b.step()
    for seed, q in ((11, s11), (13, s13), (14, s14)):
        toks, _m = b.leave(q)
        assert toks == alone[seed][0], seed
    b.close()


def test_no_session_takes_another_sessions_messages(rt):
    e = rt.engine
    a = e.open(seeded_prompt(1), seq_id=0)
    c = e.open(seeded_prompt(2), seq_id=1)
    try:
        p = a.propose()
        before = (list(c.tokens), c.session)
        with pytest.raises(ForeignSessionError):
            c.verify(p)  # another session's proposal (its id), refused
        assert (c.tokens, c.session) == before  # and nothing of C changed
    finally:
        e.close(a)
        e.close(c)
    # a step holds each sequence once, and only open sessions
    s = e.open(seeded_prompt(3), seq_id=2)
    with pytest.raises(RuntimeInputError, match="each sequence once"):
        batch_step(e, [s, s], [None, None])
    e.close(s)
    with pytest.raises(RuntimeInputError, match="not open"):
        batch_step(e, [s], [None])


def test_truncate_one_session_leaves_the_others(rt, alone):
    """A truncation (a new epoch) in one session between steps: the other continues as
    alone, and the truncated one continues as if it had only the kept tokens."""
    e = rt.engine
    x = e.open(seeded_prompt(11), seq_id=0)
    y = e.open(seeded_prompt(12), seq_id=1)
    try:
        for _ in range(3):
            batch_step(e, [x, y], [None, None])
        ex, ey = x.session.epoch, y.session.epoch
        y.truncate(len(y.tokens) - 2)
        assert y.session.epoch == ey + 1 and x.session.epoch == ex
        while x.metrics.n_generated < N_NEW:
            batch_step(e, [x, y], [None, None])
        assert x.tokens[x.metrics.n_prompt:][:N_NEW] == alone[11][0]
        got = y.tokens[len(seeded_prompt(12)):]
        assert got[:N_NEW] == alone[12][0][:len(got)]
    finally:
        e.close(x)
        e.close(y)


def test_decode_validates_per_token_sequence_ids(rt):
    t = rt.target
    with pytest.raises(RuntimeInputError, match="2 tokens but 1 sequence ids"):
        t.decode([1, 2], [0, 1], seq_id=[0])
    with pytest.raises(RuntimeInputError, match="outside"):
        t.decode([1, 2], [0, 0], seq_id=[0, 9])
    with pytest.raises(RuntimeInputError, match="not consecutive"):
        t.decode([1, 2, 3], [0, 0, 2], seq_id=[0, 1, 0])


def test_batch_refuses_what_it_cannot_split(pair, rt):
    b = rt.batch()
    for _ in range(4):
        b.join(seeded_prompt(1), 2)
    with pytest.raises(RuntimeInputError, match="all 4 slots are in use"):
        b.join(seeded_prompt(1), 2)
    with pytest.raises(RuntimeInputError, match="per slot"):
        BatchRun(rt.engine).join(seeded_prompt(1), 10_000)
    b.close()
    synth = SyntheticDrafter([], 1, [1.0], n_vocab=256)
    with MTPRuntime(str(pair.trunk), None, k=0, n_seq_max=2) as plain:
        plain.engine.drafter = synth
        with pytest.raises(RuntimeInputError, match="cannot be batched"):
            plain.batch()


def test_prompts_prefilled_together_equal_alone(rt, alone):
    """join_many: the four prompts in one prefill batch; each slot then equals alone."""
    b = rt.batch()
    joined = b.join_many([(seeded_prompt(seed), N_NEW, None) for seed in SEEDS])
    assert [j[1] for j in joined] == [[alone[seed][0][0]] for seed in SEEDS]
    while b.active():
        b.step()
    for seed, (q, _) in zip(SEEDS, joined, strict=True):
        assert b.leave(q)[0] == alone[seed][0], seed
    # a refused ask takes no slot and does not stop the others
    ok, bad = b.join_many([(seeded_prompt(1), 4, None), ([], 4, None)])
    assert isinstance(bad, RuntimeInputError) and ok[0] in b.slots and len(b.slots) == 1
    b.close()


def test_a_slot_that_leaves_between_others_fills_the_gap(rt, alone):
    """fill_gaps (ranged's default): slot 1 leaves first, between slots 0 and 2; it keeps
    decoding as a filler (one ubatch of consecutive seq ids) without changing the
    others' tokens, and is closed once the gap closes."""
    b = BatchRun(rt.engine, fill_gaps=True)
    q11, _ = b.join(seeded_prompt(11), N_NEW)
    q12, _ = b.join(seeded_prompt(12), 4)
    q13, _ = b.join(seeded_prompt(13), N_NEW)
    assert (q11, q12, q13) == (0, 1, 2)
    seen_filler = False
    while b.active():
        b.step()
        if q12 in b.slots and q12 not in b.active():
            assert b.leave(q12)[0] == alone[12][0][:4]
        seen_filler |= q12 in b.fillers
        if seen_filler and q13 in b.slots and q13 not in b.active():
            assert b.leave(q13)[0] == alone[13][0]
    assert seen_filler and not b.fillers  # closed once no gap is left
    assert b.leave(q11)[0] == alone[11][0]
    # a slot leaving with nothing live on both sides is closed at once
    q, _ = b.join(seeded_prompt(12), 2)
    b.step()
    b.leave(q)
    assert not b.fillers and not rt.engine.sessions
    b.close()


def test_a_lone_drafter_decode_has_a_batched_ones_floats(rt):
    """Issue 39 item 1: upstream's kernels give a one-token decode other floats than a
    decode of two or more (any two or more agree bitwise on a token's row). With
    ``pad_single`` (set by every BatchRun) a lone MTP decode is padded, so a sequence's
    draft logits are the same drafting alone as beside another."""
    e = rt.engine
    d = e.drafter
    s0 = e.open(seeded_prompt(11), seq_id=0)
    s1 = e.open(seeded_prompt(12), seq_id=1)
    n0, n1 = len(s0.tokens) - 1, len(s1.tokens) - 1

    def draft_logits(pairs: list[tuple]) -> np.ndarray:
        d._decode([s.last for s, _ in pairs], [n for _, n in pairs],
                  [s.seq for s, _ in pairs], np.stack([d.pending[s.seq] for s, _ in pairs]),
                  logits=True)
        lg = d.ctx.logits_all(d.ctx.last_decode_len)[0].copy()
        for s, n in pairs:
            d.ctx.seq_rm(s.seq, n, -1)
        assert d.ctx.seq_pos_max(0) == n0 - 1  # the pad is gone again
        return lg

    saved = d.pad_single
    try:
        beside = draft_logits([(s0, n0), (s1, n1)])
        d.pad_single = False
        unpadded = draft_logits([(s0, n0)])
        d.pad_single = True
        padded = draft_logits([(s0, n0)])
    finally:
        d.pad_single = saved
        e.close(s0)
        e.close(s1)
    assert np.array_equal(padded, beside)
    assert not np.array_equal(unpadded, beside)  # what the pad is for


def _beside_others_equals_alone(r: MTPRuntime) -> None:
    """Every target logit a slot's sampler sees, and every draft, equal bitwise whether
    the slot runs alone in a batch or beside others that join together, leave early
    (abandoned) and end (a one-token prompt among them): no near-tie can part them."""
    prompts = {11: seeded_prompt(11), 13: [7], 14: seeded_prompt(14)}

    def solo(seed: int) -> tuple:
        b = BatchRun(r.engine)
        seen: dict = {}
        q, _ = b.join(prompts[seed], N_NEW, sampler=_observed(seen))
        while q in b.active():
            b.step()
        toks, m = b.leave(q)
        b.close()
        return toks, seen, [x["drafts"] for x in m.steps]

    want = {seed: solo(seed) for seed in prompts}
    b = BatchRun(r.engine)
    assert r.engine.pad_single and r.engine.drafter.pad_single  # set by every batch
    seen = {seed: {} for seed in prompts}
    joined = b.join_many([(prompts[s], N_NEW, _observed(seen[s])) for s in prompts])
    slot = dict(zip(prompts, (q for q, _ in joined), strict=True))
    q_gone, _ = b.join(seeded_prompt(15), N_NEW)  # abandoned after two steps
    out: dict = {}
    n_steps = 0
    while len(out) < len(prompts):
        b.step()
        n_steps += 1
        if n_steps == 2:
            assert b.leave(q_gone) is None  # unfinished
            q_short, _ = b.join(seeded_prompt(16), 3)  # joins mid-run, ends early
        if n_steps > 2 and q_short in b.slots and q_short not in b.active():
            b.leave(q_short)
        for seed, q in slot.items():
            if seed not in out and q not in b.active():
                toks, m = b.leave(q)
                out[seed] = (toks, seen[seed], [x["drafts"] for x in m.steps])
    b.close()
    for seed in prompts:
        toks, lgs, drafts = out[seed]
        w_toks, w_lgs, w_drafts = want[seed]
        assert toks == w_toks and drafts == w_drafts, seed
        assert lgs.keys() == w_lgs.keys()
        assert all(np.array_equal(lgs[p], w_lgs[p]) for p in w_lgs), seed


def test_a_slot_beside_others_is_bitwise_the_slot_alone(rt):
    _beside_others_equals_alone(rt)


def test_a_plain_slot_beside_others_is_bitwise_the_slot_alone(pair):
    """MTP off: a lone slot's one-token step is padded (the whole model's contexts of
    several sequences keep one position of tail removal for it), so it steps as beside
    others."""
    with MTPRuntime(str(pair.trunk), None, k=0, n_seq_max=4, n_ctx=512, trace=True) as plain:
        assert plain.target.n_rs_seq == 1
        _beside_others_equals_alone(plain)
