"""DGR-066 part 2: whole vs ranged (RPC shards on loopback), MTP off and on.

DGR-066 AC2 (MTP correctness) on the ranged path, compared with the whole model (whose
side of AC2 is tests/test_speculative.py):
- session and epoch isolation: `test_interleaved_sessions_on_ranged_equal_alone_and_whole`
- accept / reject / rollback: `test_forced_accept_reject_rollback_on_ranged_match_whole`
- truncation: `test_truncation_mid_generation_on_ranged_matches_whole`
"""

from dataclasses import replace

import numpy as np
import pytest
from session_ops import local, remote, reset_all

from mtplib.contract.session import ForeignSessionError, IllegalTransition, StaleEpochError
from mtplib.distributed.ranged_mtp import RangedMTP
from mtplib.lab.correctness import seeded_prompt
from mtplib.runtime import build_info
from mtplib.runtime.engine_options import EngineOptions
from mtplib.runtime.generation import expected_verify_steps
from mtplib.runtime.settings import DecodeSettings
from mtplib.runtime.speculative import MTPRuntime

PROMPT = seeded_prompt(7, 10)
N_NEW = 16


@pytest.fixture(scope="module")
def whole(pair):
    out = {}
    for k in (0, 1, 2, 3):
        with MTPRuntime(str(pair.trunk), str(pair.sidecar) if k else None, k=k) as rt:
            out[k] = rt.generate(PROMPT, N_NEW)
    return out


@pytest.mark.parametrize("plan", ["0-1,2-3", "0-0,1-2,3-3"])
def test_ranged_equals_whole_mtp_off_and_on(pair, whole, plan):
    # the MTP block on the tail shard, explicitly (the default is the client)
    with RangedMTP(str(pair.trunk), plan=plan, sidecar=str(pair.sidecar),
                   mtp_placement="tail") as r:
        tail = r.rt.endpoints[-1]
        for k in (0, 1, 2, 3):
            toks, m = r.generate(PROMPT, N_NEW, EngineOptions(k=k))
            assert toks == whole[k][0], (plan, k)
            assert toks == whole[0][0]
            if k:
                assert m.drafted == whole[k][1].drafted
                assert m.mtp_placement == "tail" and m.mtp_endpoints == [tail]  # on the tail
                assert {"prefill", "verify", "draft"} <= set(m.seam_bytes_per_token)
                # MTP runs on the tail: drafting moves far less than a verify step
                assert m.seam_bytes_per_token["draft"] < m.seam_bytes_per_token["verify"]
            else:
                assert "draft" not in m.seam_bytes_per_token
            assert m.seam_bytes > 0 and m.plan == plan
        owners = sorted(set(m.placement.values()), key=r.rt.endpoints.index)
        assert owners == r.rt.endpoints  # every shard owns some of the trunk's layers


# -- DGR-066 AC2 on the ranged path: sessions, epochs, accept/reject/rollback/truncation --
# Driven step by step from here: the ranged engine lives in the ranged client worker and is
# reached through `rt.call` (tests/session_ops.py), so every proposal and verify result
# crosses the process boundary as the pickled contract message. The same ops run on a
# whole-model engine, and every snapshot (tokens, session state and epoch, n_cached and the
# target cache's real extent, exact counts, rollback kinds, the MTP drafter's fed position,
# cache extent and pending row) must match it.
K = 3
N_SEQ = 2
N_GEN = 14
PA, PB = seeded_prompt(10, 12), seeded_prompt(11, 5)
PY = seeded_prompt(13, len(PA))  # as long as PA: its first proposal has PA's base
#: engines by (k, n_rs_seq): rollback within n_rs_seq is a tail removal; n_rs_seq 0 makes
#: every rollback a replay (on the ranged path from position 0: caches never move)
TAIL = {"k": K, "n_rs_seq": K}
DEEP = {"k": K, "n_rs_seq": 0}
RANGED = [("client", "0-1,2-3"), ("tail", "0-0,1-2,3-3")]
#: one thread per process: the shards, the worker and this process share two cores
ONE = DecodeSettings(n_threads=1)


def _opts(want: dict) -> EngineOptions:
    return EngineOptions(k=want["k"], n_rs_seq=want["n_rs_seq"], n_seq_max=N_SEQ, settings=ONE)


@pytest.fixture(scope="module", params=RANGED, ids=["client-2shards", "tail-3shards"])
def ranged(request, pair):
    """One ranged engine per (drafter placement, plan) with two sequences, shared by the
    tests below (and a second one that replays every rollback)."""
    placement, plan = request.param
    with RangedMTP(str(pair.trunk), plan=plan, sidecar=str(pair.sidecar),
                   mtp_placement=placement, opts=_opts(TAIL)) as r:
        assert r.rt.mtp_placement == placement and r.mtp_placed
        assert r.mtp_on_tail == (placement == "tail")  # only where the tail runs the block
        r.generate(PA, 1, _opts(DEEP))  # builds and warms the replaying engine
        yield r


@pytest.fixture(scope="module")
def whole_rt(pair):
    args = (str(pair.trunk), str(pair.sidecar))
    with MTPRuntime(*args, k=K, n_seq_max=N_SEQ, settings=ONE) as tail, \
            MTPRuntime(*args, k=K, n_seq_max=N_SEQ, n_rs_seq=0, settings=ONE) as deep, \
            MTPRuntime(*args, k=K, settings=ONE) as solo:
        yield {"tail": tail, "deep": deep, "solo": solo}


@pytest.fixture
def drivers(ranged, whole_rt):
    """(ranged ops, whole-model ops) for an engine description; every session is closed and
    every forced acceptance undone afterwards (the engines are shared)."""
    def make(want: dict):
        rt = whole_rt["tail" if want == TAIL else "deep"]
        return (lambda op, *a: ranged.rt.call(remote, want, op, *a)), local(rt.engine)

    ranged.rt.reset_counts()
    yield make
    ranged.rt.call(reset_all)
    for rt in whole_rt.values():
        local(rt.engine)("reset")


def alone(whole_rt, prompt: list[int], n: int = N_GEN) -> list[int]:
    """The prompt run alone, on a fresh whole-model sequence."""
    return whole_rt["solo"].generate(prompt, n)[0]


def same(got: dict, want: dict, where) -> None:
    """A ranged snapshot equals the whole model's (session ids aside: each engine names
    its own sessions); the drafter's pending row to float noise: the KV caches are f16 (a
    relative step of 1e-3), and a replay from position 0 (ranged) recomputes them in other
    batch shapes than one from a checkpoint (whole), so the kernels sum in another order
    (1.1e-3 on one of 512 values seen on an AVX-512 host; the tokens stay exactly equal)."""
    for key, v in want.items():
        if key == "drafter_pending":
            np.testing.assert_allclose(got[key], v, rtol=5e-3, atol=5e-3, err_msg=str(where))
        elif key != "session_id":
            assert got[key] == v, (where, key, got[key], v)
    # the session's bookkeeping is the cache's real extent, on every shard and the drafter
    assert got["target_pos_max"] == got["n_cached"] - 1, where
    assert got["drafter_pos_max"] == got["drafter_n_fed"] - 1, where


def no_cache_bytes(r: RangedMTP) -> dict:
    """Nothing of a cache crossed a seam while the test ran (the patched build's promise;
    the stock build moves compressor state with n_rs_seq > 0, conftest opts in there)."""
    rep = r.rt.seam_report()
    assert rep["seam_bytes"] > 0
    if build_info()["build"] == "patched":
        assert rep["cache_bytes_crossing"] == 0 and rep["wire_violations"] == [], rep
    return rep


def interleaved(do) -> dict:
    """Two sessions stepped in turn with different draft lengths; foreign, stale and future
    proposals and foreign or repeated verify results refused; one closed mid-generation;
    its sequence reused by new sessions that a message of a closed one cannot reach.
    Returns the snapshots, C's prompt and A's last drafts."""
    snaps: dict[str, list] = {"a": [do("open", PA, 0)], "b": [do("open", PB, 1)]}
    ks = {"a": (0, K), "b": (1, 1)}

    def turn(names=("a", "b")):
        for n in names:
            seq, k = ks[n]
            left = N_GEN - snaps[n][-1]["counts"]["n_generated"]
            if left > 0:
                snaps[n].append(do("step", seq, min(k, left - 1)))

    for _ in range(2):
        turn()
    pa = do("propose", 0)
    with pytest.raises(ForeignSessionError):
        do("verify", 1, pa)  # A's proposal at B: refused, B untouched
    do("force", 0)  # reject every draft: the epoch advances, the output stays the target's
    res = do("verify", 0, pa)
    assert res.n_accepted == 0 and res.epoch == pa.epoch
    do("commit", 0, res)
    do("force", None)
    snaps["a"].append(do("snapshot", 0))
    assert snaps["a"][-1]["epoch"] == pa.epoch + 1
    with pytest.raises(StaleEpochError, match="stale"):
        do("verify", 0, pa)
    p2 = do("propose", 0)
    with pytest.raises(StaleEpochError, match="future"):
        do("verify", 0, replace(p2, epoch=p2.epoch + 1))
    do("commit", 0, do("verify", 0, p2))
    snaps["a"].append(do("snapshot", 0))
    # a verify result is a message too: B's at A, and B's twice, are refused before either
    # session changes (A took B's tokens before)
    rb = do("verify", 1, do("propose", 1, 1))
    with pytest.raises(ForeignSessionError):
        do("commit", 0, rb)
    do("commit", 1, rb)
    snaps["b"].append(do("snapshot", 1))
    with pytest.raises((StaleEpochError, IllegalTransition)):
        do("commit", 1, rb)
    for n, seq in (("a", 0), ("b", 1)):
        same(do("snapshot", seq), snaps[n][-1], f"{n} after a refused commit")
    turn()
    last_a = do("propose", 0)  # A is closed with a proposal in flight
    assert do("close", 0) == (-1, -1)  # its sequence is empty in both contexts
    assert do("live") == [1]
    turn(("b",))
    # a new session on A's sequence, its prompt as long as A's proposal's base
    pc = seeded_prompt(12, last_a.base_position)
    snaps["c"] = [do("open", pc, 0)]
    with pytest.raises(ForeignSessionError):
        do("verify", 0, last_a)
    ks["c"] = (0, 2)
    while any(snaps[n][-1]["counts"]["n_generated"] < N_GEN for n in ("b", "c")):
        turn(("b", "c"))
    # the worst case: a closed session's message at the same epoch and base as the new one's
    do("close", 0)
    x = do("open", PA, 0)
    stale = do("propose", 0)
    do("close", 0)
    y = do("open", PY, 0)
    own = do("propose", 0)  # the new session waits for its own drafts' verify
    assert (y["epoch"], own.base_position) == (x["epoch"], stale.base_position)
    with pytest.raises(ForeignSessionError):
        do("verify", 0, stale)  # (it was verified as the new session's before: same id)
    do("commit", 0, do("verify", 0, own))
    snaps["y"] = [y, do("snapshot", 0)]
    return {"snaps": snaps, "pc": pc, "a_drafts": last_a.drafts}


def test_interleaved_sessions_on_ranged_equal_alone_and_whole(ranged, whole_rt, drivers):
    """DGR-066 AC2 (session and epoch isolation) on the ranged path: two sessions on one
    ranged engine, interleaved step by step with their own draft lengths and epochs, each
    equal to its prompt run alone (whole model and ranged); a proposal of one session sent
    to the other, a stale one and a future one, a verify result of one session committed to
    the other or twice, are refused in the ranged worker with both sessions unchanged;
    closing one leaves the other intact; a sequence reused after close starts empty and a message of
    the closed session cannot reach its successor; every step's state equals the whole
    model's. No cache byte crosses a seam."""
    for p in (PA, PB):
        assert ranged.generate(p, N_GEN)[0] == alone(whole_rt, p)
    ranged.rt.reset_counts()
    r_do, w_do = drivers(TAIL)
    got, want = interleaved(r_do), interleaved(w_do)
    assert got["pc"] == want["pc"] and got["a_drafts"] == want["a_drafts"]
    for name, snaps in want["snaps"].items():
        assert len(got["snaps"][name]) == len(snaps), name
        for i, (g, w) in enumerate(zip(got["snaps"][name], snaps, strict=True)):
            same(g, w, (name, i))
    for name, prompt in (("b", PB), ("c", got["pc"])):
        last = got["snaps"][name][-1]
        assert last["tokens"][len(prompt):] == alone(whole_rt, prompt), name
    # A was closed mid-generation, Y after one step: what they had is the alone prefix
    for name, prompt in (("a", PA), ("y", PY)):
        toks = got["snaps"][name][-1]["tokens"][len(prompt):]
        assert 0 < len(toks) < N_GEN and toks == alone(whole_rt, prompt)[:len(toks)], name
    for name, snaps in got["snaps"].items():  # each epoch counts its own rollbacks only
        assert snaps[-1]["epoch"] == sum(snaps[-1]["counts"]["rollbacks"].values()), name
    assert got["snaps"]["a"][-1]["epoch"] >= 1
    assert {s[-1]["seq"] for s in got["snaps"].values()} == {0, 1}
    rep = no_cache_bytes(ranged)
    assert {"prefill", "draft", "verify", "feed"} <= set(rep["steps"])


def forced_run(do, n_acc: int | None, prompt: list[int] = PA) -> list[dict]:
    """One session generating N_GEN tokens with every verify's accepted length forced
    (the warm-up's hook: min(n_acc, k) of the MTP drafter's real drafts), a snapshot per
    step."""
    do("force", n_acc)
    snaps = [do("open", prompt, 0)]
    while (done := snaps[-1]["counts"]["n_generated"]) < N_GEN:
        snaps.append(do("step", 0, min(K, N_GEN - done - 1)))
    return snaps


@pytest.mark.parametrize("mode", ["accept", "reject", "partial", "reject_replay",
                                  "partial_replay"])
def test_forced_accept_reject_rollback_on_ranged_match_whole(ranged, whole_rt, drivers, mode):
    """DGR-066 AC2 (accept / reject / rollback at the MTP level) on the ranged path: full
    acceptance, full rejection and partial acceptance forced on the MTP drafter's real
    drafts, with rollback by tail removal (n_rs_seq = k) and by replay (n_rs_seq = 0: on the
    ranged path from position 0, on the whole model from its checkpoint): tokens, counts,
    rollback kinds, epochs, n_cached (= the caches' real extent) and the drafter's state
    equal the whole model's after every step; no cache byte crosses a seam."""
    n_acc = {"accept": K, "reject": 0, "partial": 1}[mode.split("_")[0]]
    want = DEEP if mode.endswith("replay") else TAIL
    r_do, w_do = drivers(want)
    got, ref = forced_run(r_do, n_acc), forced_run(w_do, n_acc)
    assert len(got) == len(ref)
    for i, (g, w) in enumerate(zip(got, ref, strict=True)):
        same(g, w, (mode, i))
    c, epoch = got[-1]["counts"], got[-1]["epoch"]
    assert c["n_generated"] == N_GEN and c["plain_steps"] == 1  # the last step is plain
    kind = "tail" if want is TAIL else "checkpoint_replay"
    assert epoch == sum(c["rollbacks"].values())  # every rollback is one epoch
    if n_acc == K:
        assert c["accepted"] == c["drafted"] and c["rollbacks"] == {} and epoch == 0
        assert c["verify_steps"] + c["plain_steps"] == expected_verify_steps(N_GEN, K)
    elif n_acc == 0:
        assert c["accepted"] == 0 and c["rollbacks"] == {kind: c["verify_steps"]}
        assert c["verify_steps"] == N_GEN - 2
        # rejected drafts never change the output: it is the prompt's own continuation
        assert got[-1]["tokens"][len(PA):] == alone(whole_rt, PA)
    else:
        assert c["accept_len_hist"]["1"] == c["verify_steps"] == c["accepted"]
        # a rollback wherever more than one token was drafted (one is always accepted)
        assert c["rollbacks"] == {kind: c["drafted_per_position"][1]} and epoch > 0
    rep = no_cache_bytes(ranged)
    if want is DEEP and n_acc < K:  # the replays ran on the shards, labelled rollback
        assert rep["steps"]["rollback"]["bytes"] > 0


@pytest.mark.parametrize("want", [TAIL, DEEP], ids=["tail", "replay"])
def test_truncation_mid_generation_on_ranged_matches_whole(ranged, whole_rt, drivers, want):
    """DGR-066 AC2 (truncation at the MTP level) on the ranged path: after a fully accepted
    verify, truncated by one token (a tail removal within n_rs_seq = k; a replay with
    n_rs_seq = 0), continued, truncated deep (before the forced tokens, beyond n_rs_seq: a
    replay) and continued again: every snapshot (epoch + 1 per truncation, position,
    n_cached, the drafter fed up to the new last token) equals the whole model's, and what
    is generated after the deep cut is the prompt's own continuation."""
    def run(do) -> list[dict]:
        snaps = [do("open", PA, 0)]
        for _ in range(3):
            snaps.append(do("step", 0))
        do("force", K)  # a verify that keeps all of its k+1 positions
        snaps.append(do("step", 0))
        do("force", None)
        snaps.append(do("truncate", 0, len(snaps[-1]["tokens"]) - 1))
        for _ in range(2):
            snaps.append(do("step", 0))
        snaps.append(do("truncate", 0, len(PA) + 3))
        while (have := len(snaps[-1]["tokens"]) - len(PA)) < N_GEN:
            snaps.append(do("step", 0, min(K, N_GEN - have - 1)))
        return snaps

    r_do, w_do = drivers(want)
    got, ref = run(r_do), run(w_do)
    assert len(got) == len(ref)
    for i, (g, w) in enumerate(zip(got, ref, strict=True)):
        same(g, w, i)
    assert len(got[4]["tokens"]) > len(PA) + 3 + K  # the forced tokens lie after the deep cut
    cuts = [i for i, s in enumerate(got) if i and s["position"] < got[i - 1]["position"]]
    assert cuts == [5, 8]
    for i in cuts:
        s = got[i]
        assert s["epoch"] == got[i - 1]["epoch"] + 1 and s["state"] == "decoding"
        assert s["position"] == len(s["tokens"]) and s["n_cached"] == len(s["tokens"]) - 1
        assert s["drafter_n_fed"] == len(s["tokens"]) - 1
    kinds = {k: v for k, v in got[-1]["counts"]["rollbacks"].items() if "truncate" in k}
    assert kinds == ({"truncate_tail": 1, "truncate_checkpoint_replay": 1} if want is TAIL
                     else {"truncate_checkpoint_replay": 2})
    assert got[-1]["tokens"][len(PA):] == alone(whole_rt, PA)  # N_GEN tokens again
    no_cache_bytes(ranged)
