"""Correctness scenarios of the MTP runtime as tables (notebook 03 and the evidence).

Each function runs one scenario on a trunk (+ sidecar) and returns plain rows (list of
dicts) so a notebook shows them with pandas and a test can assert on them.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from mtplib.contract.labels import STEP_KINDS, StepKind
from mtplib.distributed.results import RangedMetrics
from mtplib.lab.common.progress import bar as _bar
from mtplib.lab.quality import NOISE_BOUND, compare_streams
from mtplib.runtime.drafters import OracleDrafter
from mtplib.runtime.generate import prefill
from mtplib.runtime.generation import expected_verify_steps
from mtplib.runtime.model import Context, ContextConfig
from mtplib.runtime.sampling import Sampler
from mtplib.runtime.speculative import MTPRuntime


def seeded_prompt(seed: int, n: int = 12, n_vocab: int = 256) -> list[int]:
    return [int(x) for x in np.random.default_rng(seed).integers(0, n_vocab, n)]


def equality(trunk: str, sidecar: str, *, seeds: Sequence[int] = range(20),
             ks: Sequence[int] = (1, 2, 3), n_new: int = 32, n_threads: int = 2,
             progress: bool = False, **ctx) -> list[dict]:
    """MTP-on vs MTP-off greedy output per (prompt seed, k), with the near-tie audit.
    ``progress``: a bar over the (1 + len(ks)) * len(seeds) generations."""
    seeds = list(seeds)
    rows = []
    with _bar((1 + len(ks)) * len(seeds), "equality", progress) as bar:
        refs = {}
        with MTPRuntime(trunk, None, k=0, trace=True, n_threads=n_threads, **ctx) as rt:
            for s in seeds:
                refs[s] = rt.generate(seeded_prompt(s), n_new)
                bar.update()
        for k in ks:
            with MTPRuntime(trunk, sidecar, k=k, n_threads=n_threads, **ctx) as rt:
                for s in seeds:
                    ref, ref_m = refs[s]
                    got, m = rt.generate(seeded_prompt(s), n_new)
                    bar.update()
                    cmp = compare_streams(ref, got, ref_m.margins, n_prompt=12)
                    rows.append({"seed": s, "k": k, **cmp, "drafted": m.drafted,
                                 "accepted": m.accepted,
                                 "min_margin_off": min(ref_m.margins.values())})
    return rows


def forced(trunk: str, *, ks: Sequence[int] = (1, 2, 3), n_new: int = 32,
           n_rs_seqs: Sequence[int | None] = (None, 0), n_vocab: int = 256,
           n_threads: int = 2, progress: bool = False) -> list[dict]:
    """Forced accept (the target's own continuation) and forced reject, with accounting."""
    prompt = seeded_prompt(0)
    with MTPRuntime(trunk, None, k=0, n_threads=n_threads) as rt:
        ref, _ = rt.generate(prompt, n_new)
    rows = []
    cases = [(k, n_rs, wrong) for k in ks for n_rs in n_rs_seqs for wrong in (False, True)]
    with _bar(len(cases), "forced", progress) as bar:
        for k, n_rs, wrong in cases:
            d = OracleDrafter(ref, len(prompt), wrong=wrong, n_vocab=n_vocab)
            with MTPRuntime(trunk, None, k=k, drafter=d, n_rs_seq=n_rs,
                            n_threads=n_threads) as rt:
                out, m = rt.generate(prompt, n_new)
            bar.update()
            steps = m.verify_steps + m.plain_steps
            rows.append({
                "k": k, "mode": "reject" if wrong else "accept",
                "n_rs_seq": k if n_rs is None else n_rs, "same_output": out == ref,
                "drafted": m.drafted, "accepted": m.accepted,
                "target_steps": steps,
                "expected_steps": n_new - 1 if wrong else expected_verify_steps(n_new, k),
                "rollbacks": dict(m.rollbacks),
            })
    return rows


def rollback_noise(trunk: str, *, k: int = 3, steps: int = 6, seeds: Sequence[int] = (3, 5, 7),
                   n_threads: int = 2, progress: bool = False) -> list[dict]:
    """After rejected drafts are rolled back (tail or checkpoint), the next logits vs a
    fresh context fed the committed tokens: max |delta logit| and argmax agreement."""
    rows = []
    cases = [(n_rs, seed) for n_rs in (k, 0) for seed in seeds]
    with _bar(len(cases), "rollback", progress, unit="case") as bar:
        for n_rs, seed in cases:
            prompt = seeded_prompt(seed)
            d = OracleDrafter([0] * 256, len(prompt), wrong=True, n_vocab=256)
            with MTPRuntime(trunk, None, k=k, drafter=d, n_rs_seq=n_rs,
                            n_threads=n_threads) as rt:
                s = rt.engine.open(prompt)
                for _ in range(steps):
                    s.step()
                rt.target.decode([s.last], [s.base], seq_id=s.seq, logits=True)
                got = rt.target.logits(-1)
                with Context(rt.trunk, ContextConfig(n_ctx=512, n_threads=n_threads)) as c:
                    want = prefill(c, list(s.tokens))[0]
                kinds = dict(s.metrics.rollbacks)
            bar.update()
            diff = float(np.abs(got - want).max())
            rows.append({"n_rs_seq": n_rs, "seed": seed, "rollbacks": kinds,
                         "max_abs_dlogit": diff, "argmax_equal": int(got.argmax()) ==
                         int(want.argmax()), "within_noise_bound": diff < NOISE_BOUND})
    return rows


def sessions(trunk: str, sidecar: str, *, k: int = 2, n_new: int = 24,
             n_threads: int = 2, progress: bool = False) -> list[dict]:
    """Three interleaved sessions in one target and one MTP context vs each one alone."""
    prompts = [seeded_prompt(10), seeded_prompt(11, 5), seeded_prompt(12, 20)]
    solo = []
    with _bar(len(prompts) + 1, "sessions", progress, unit="run") as bar:
        for p in prompts:
            with MTPRuntime(trunk, sidecar, k=k, n_threads=n_threads) as rt:
                solo.append(rt.generate(p, n_new)[0])
            bar.update()
        with MTPRuntime(trunk, sidecar, k=k, n_seq_max=len(prompts),
                        n_threads=n_threads) as rt:
            ss = [rt.engine.open(p) for p in prompts]
            while any(s.metrics.n_generated < n_new for s in ss):
                for s in ss:
                    left = n_new - s.metrics.n_generated
                    if left > 0:
                        s.step(min(k, left - 1))
            bar.update()
            return [{"session": s.id, "seq_id": s.seq, "prompt_len": len(p),
                     "same_as_alone": s.tokens[len(p):] == want, "epoch": s.session.epoch,
                     "rollbacks": dict(s.metrics.rollbacks)}
                    for s, p, want in zip(ss, prompts, solo, strict=True)]


def sampling_agreement(trunk: str, sidecar: str, *, k: int = 2, n_seeds: int = 100,
                       n_new: int = 8, temperature: float = 1.0, top_p: float = 0.95,
                       n_threads: int = 2, progress: bool = False) -> dict:
    """Per seed, MTP-on and MTP-off sampled streams (sample-and-match): how many equal."""
    prompt = seeded_prompt(30, 8)
    equal = 0
    with MTPRuntime(trunk, sidecar, k=k, n_threads=n_threads) as on, \
            MTPRuntime(trunk, None, k=0, n_threads=n_threads) as off, \
            _bar(n_seeds, "sampling", progress, unit="seed") as bar:
        for seed in range(n_seeds):
            on.engine.sampler = off.engine.sampler = Sampler(temperature, top_p, seed)
            equal += on.generate(prompt, n_new)[0] == off.generate(prompt, n_new)[0]
            bar.update()
    return {"seeds": n_seeds, "equal_streams": equal, "k": k, "temperature": temperature,
            "top_p": top_p, "n_new": n_new}


def whole_vs_ranged(trunk: str, sidecar: str, *, plans: Sequence[str] = ("0-1,2-3", "0-0,1-2,3-3"),
                    ks: Sequence[int] = (0, 1, 2, 3), n_new: int = 16,
                    prompt_seed: int = 7, n_threads: int = 2, shard_threads: int = 1,
                    mtp_placement: str = "auto", progress: bool = False) -> list[dict]:
    """The same generation whole and on loopback RPC shards (the MTP block where
    ``mtp_placement`` puts it: "auto" = the client): tokens must agree (near-tie rule); seam
    bytes per token per step kind next to the contract's minimum. Each MTP row says where
    its MTP block ran (``mtp_placement``) and ``mtp_on_tail``: upstream placed all of it on
    the tail shard (None for MTP off)."""
    from mtplib.distributed.ranged_mtp import RangedMTP
    from mtplib.runtime.engine_options import EngineOptions
    from mtplib.runtime.settings import DecodeSettings

    prompt = seeded_prompt(prompt_seed, 10)
    whole = {}
    rows = []
    with _bar(len(ks) * (1 + len(plans)), "whole vs ranged", progress) as bar:
        for k in ks:
            with MTPRuntime(trunk, sidecar if k else None, k=k, trace=True,
                            n_threads=n_threads) as rt:
                whole[k] = rt.generate(prompt, n_new)
            bar.update()
        for plan in plans:
            with RangedMTP(trunk, plan=plan, sidecar=sidecar, shard_threads=shard_threads,
                           mtp_placement=mtp_placement) as r:
                for k in ks:
                    toks, m = r.generate(prompt, n_new, EngineOptions(
                        k=k, settings=DecodeSettings(n_threads=n_threads)))
                    bar.update()
                    ref, ref_m = whole[k]
                    cmp = compare_streams(ref, toks, ref_m.margins, n_prompt=len(prompt))
                    per = m.seam_bytes_per_token
                    rows.append({
                        "plan": plan, "k": k, "equal": cmp["equal"], "near_tie": cmp["near_tie"],
                        "drafted": m.drafted, "accepted": m.accepted,
                        "seam_bytes": m.seam_bytes,
                        **{f"bytes_per_token_{lab}": per.get(lab) for lab in STEP_KINDS},
                        "contract_min_decode": m.seam_contract_min_per_token.get(
                            StepKind.DECODE,
                            m.seam_contract_min_per_token.get(StepKind.PREFILL)),
                        **_mtp_where(m, r.rt.endpoints[-1], k),
                        "hidden_rows": m.hidden_rows,
                    })
    return rows


def _mtp_where(metrics: RangedMetrics, tail: str, k: int) -> dict:
    """Where a ranged generation's MTP block ran: its placement ("tail" or "client") and
    whether upstream put all of it on the ``tail`` endpoint (both None for MTP off)."""
    if not k:
        return {"mtp_placement": None, "mtp_on_tail": None}
    place = metrics.mtp_placement
    return {"mtp_placement": place,
            "mtp_on_tail": place == "tail" and metrics.mtp_endpoints == [tail]}
