"""Where mtplib's time goes outside upstream's C calls (issue 7 profile notes).

    TRUNK=... MTP=... NT=2 python -m mtplib.reports.side_by_side.overhead MODE [K [RATES]]

MODE
  step   per decode step: wall time of SpecSession.step, time inside llama_decode (target
         and MTP contexts), the rest ("non-C": Python, ctypes, numpy, cold caches); medians
  parts  per-call medians of the loop's functions (Context.decode/logits/nextn_rows,
         Sampler.pick, MTPDrafter.propose/commit, SpecSession.verify/commit, ...)
  noop   the same loop with the target's llama_decode replaced by a no-op (the MTP
         context still decodes; its C time is subtracted): the pure Python cost per step
         with warm caches, plus the cProfile top 15
  cold   the first Python work after a real decode vs the same work repeated
  ab     the hot-path edits of issue 7 on/off, interleaved (OLD patches back the previous
         Context.decode / logits / nextn_rows and one logits call per verify row)
Prints one JSON object (the committed ones: evidence/side-by-side/profile/<mode>-*.json).
"""

from __future__ import annotations

import argparse
import cProfile
import ctypes  # noqa: F401  (the OLD implementations below use np.ctypeslib)
import io
import json
import os
import pstats
import statistics
import time
from collections import defaultdict
from dataclasses import dataclass

import numpy as np

import mtplib.runtime.drafters as DR
import mtplib.runtime.model as MD
import mtplib.runtime.sampling as SA
from mtplib.lab.correctness import seeded_prompt
from mtplib.lab.sidebyside.machine import loadavg
from mtplib.reports import common
from mtplib.runtime.engine import SpecSession
from mtplib.runtime.model import RuntimeInputError, UpstreamError
from mtplib.runtime.speculative import MTPRuntime
from mtplib.runtime.timing import DecodeTimer

MODULE = "mtplib.reports.side_by_side.overhead"
N_NEW = 128


@dataclass(frozen=True)
class Env:
    """What the environment names: the trunk, the MTP sidecar and the thread count."""
    trunk: str
    mtp: str
    nt: int

    @classmethod
    def read(cls) -> Env:
        missing = [k for k in ("TRUNK", "MTP") if k not in os.environ]
        if missing:
            raise SystemExit(f"{MODULE}: error: set {' and '.join(missing)} (the GGUFs)")
        return cls(os.environ["TRUNK"], os.environ["MTP"], int(os.environ.get("NT", "2")))


def med_us(xs):
    return round(1e6 * statistics.median(xs), 1) if xs else None


def runtime(env, k):
    rt = MTPRuntime(env.trunk, env.mtp if k else None, k=k, n_ctx=1024, n_threads=env.nt)
    return rt, rt.engine.drafter


def set_drafter(rt, mtp, rates):
    if rates:
        rt.engine.drafter = DR.SyntheticDrafter([0], 32, rates, rt.trunk.n_vocab, seed=0,
                                                inner=mtp)


def timers(rt):
    tt = DecodeTimer(rt.target.llama)
    rt.target.llama = tt
    mt = None
    if rt.mtp_ctx is not None:
        mt = DecodeTimer(rt.mtp_ctx.llama)
        rt.mtp_ctx.llama = mt
    return tt, mt


def step_hook(tt, mt, out):
    orig = SpecSession.step

    def step(self, k=None):
        n0, m0 = len(tt.times), len(mt.times) if mt else 0
        t0 = time.perf_counter()
        r = orig(self, k)
        dt = time.perf_counter() - t0
        c_t = sum(tt.times[n0:])
        c_m = sum(mt.times[m0:]) if mt else 0.0
        out.append((dt, c_t, c_m))
        return r

    SpecSession.step = step


def mode_step(env, k, rates):
    rt, mtp = runtime(env, k)
    tt, mt = timers(rt)
    steps = []
    step_hook(tt, mt, steps)
    p = seeded_prompt(0, 32, rt.trunk.n_vocab)
    res = []
    for rep in range(6):
        set_drafter(rt, mtp, rates)
        steps.clear()
        _, m = rt.generate(p, N_NEW)
        if rep:
            res.append((m.decode_tok_s, list(steps)))
    allsteps = [s for _, ss in res for s in ss]
    return {"decode_tok_s_median": round(statistics.median(t for t, _ in res), 2),
            "step_ms_median": round(1e3 * statistics.median(s[0] for s in allsteps), 3),
            "target_decode_ms_median": round(1e3 * statistics.median(s[1] for s in allsteps), 3),
            "mtp_decode_ms_per_step_median": round(1e3 * statistics.median(s[2] for s in allsteps),
                                                   3),
            "non_c_ms_per_step_median": round(1e3 * statistics.median(
                s[0] - s[1] - s[2] for s in allsteps), 3),
            "steps": len(allsteps)}


def mode_parts(env, k, rates):
    rt, mtp = runtime(env, k)
    tt, mt = timers(rt)
    acc = defaultdict(list)

    def wrap(cls, name):
        f = getattr(cls, name)

        def w(*a, **kw):
            t0 = time.perf_counter()
            r = f(*a, **kw)
            acc[f"{cls.__name__}.{name}"].append(time.perf_counter() - t0)
            return r

        setattr(cls, name, w)

    for cls, name in ((MD.Context, "decode"), (MD.Context, "logits"),
                      (MD.Context, "logits_all"), (MD.Context, "nextn_rows"),
                      (MD.Context, "seq_rm"), (SA.Sampler, "pick"),
                      (DR.MTPDrafter, "propose"), (DR.MTPDrafter, "commit"),
                      (SpecSession, "propose"), (SpecSession, "verify"),
                      (SpecSession, "commit"), (SpecSession, "_rollback_target"),
                      (SpecSession, "step")):
        wrap(cls, name)
    p = seeded_prompt(0, 32, rt.trunk.n_vocab)
    for _ in range(3):
        set_drafter(rt, mtp, rates)
        acc.clear()
        tt.times.clear()
        if mt:
            mt.times.clear()
        _, m = rt.generate(p, N_NEW)
    out = {name: {"calls": len(v), "median_us": med_us(v)} for name, v in acc.items()}
    out["C llama_decode target"] = {"calls": len(tt.times), "median_us": med_us(tt.times)}
    if mt:
        out["C llama_decode mtp"] = {"calls": len(mt.times), "median_us": med_us(mt.times)}
    return {"decode_tok_s": round(m.decode_tok_s, 2), "per_call": out}


class _Noop:
    def __init__(self, llama):
        self._llama = llama

    def __getattr__(self, name):
        return getattr(self._llama, name)

    def llama_decode(self, ctx, batch):
        return 0


def mode_noop(env, k, rates):
    rt, mtp = runtime(env, k)
    p = seeded_prompt(0, 32, rt.trunk.n_vocab)
    rt.generate(p, 16)  # real decodes first, so every buffer exists
    rt.target.llama = _Noop(rt.target.llama)
    mt = None
    if rt.mtp_ctx is not None:  # the MTP context keeps decoding (its logits are read);
        mt = DecodeTimer(rt.mtp_ctx.llama)  # its C time is subtracted
        rt.mtp_ctx.llama = mt
    n = 900
    ts = []
    for _ in range(6):
        set_drafter(rt, mtp, rates)
        if mt:
            mt.times.clear()
        t0 = time.perf_counter()
        _, m = rt.generate(p, n)
        ts.append(time.perf_counter() - t0 - (sum(mt.times) if mt else 0.0))
    steps = m.verify_steps + m.plain_steps
    set_drafter(rt, mtp, rates)
    pr = cProfile.Profile()
    pr.enable()
    rt.generate(p, n)
    pr.disable()
    buf = io.StringIO()
    pstats.Stats(pr, stream=buf).sort_stats("tottime").print_stats(15)
    return {"python_us_per_step_min": round(1e6 * min(ts) / steps, 1), "steps": steps,
            "cprofile_top15": buf.getvalue().splitlines()[4:26]}


def mode_cold(env, k, rates):
    from mtplib.runtime.model import Context, ContextConfig, Model

    with Model(env.trunk) as mdl, Context(mdl, ContextConfig(n_ctx=1024,
                                                              n_threads=env.nt)) as c:
        p = seeded_prompt(0, 32, mdl.n_vocab)
        c.decode(p, range(32), logits=[False] * 31 + [True])
        r = defaultdict(list)
        tok = 5
        for i in range(100):
            c.decode([tok], [32 + i], logits=True)
            for label in ("sum(range(50)) 1st", "sum(range(50)) 2nd"):
                t0 = time.perf_counter()
                sum(range(50))
                r[label].append(time.perf_counter() - t0)
            for label in ("llama_get_logits_ith 1st", "llama_get_logits_ith 2nd"):
                t0 = time.perf_counter()
                c.llama.llama_get_logits_ith(c.ptr, 0)
                r[label].append(time.perf_counter() - t0)
            for label in ("Context.logits 1st", "Context.logits 2nd", "Context.logits 3rd"):
                t0 = time.perf_counter()
                lg = c.logits(0)
                r[label].append(time.perf_counter() - t0)
            tok = int(np.argmax(lg))
    return {"median_us_after_a_real_decode": {k_: med_us(v) for k_, v in r.items()}}


# -- ab: the previous hot path -------------------------------------------------------------
def _old_decode(self, tokens, positions, *, seq_id=0, logits=False, rows=None):
    n = len(tokens)
    if n == 0 or n > self.n_batch or len(positions) != n or not 0 <= seq_id < self.n_seq_max:
        raise RuntimeInputError("bad batch")
    toks = np.asarray(tokens, dtype=np.int64)
    if toks.min() < 0 or toks.max() >= self.n_vocab:
        raise RuntimeInputError("token out of range")
    pos = np.asarray(positions, dtype=np.int64)
    if pos.min() < 0 or pos.max() >= self.n_ctx:
        raise RuntimeInputError("position out of range")
    flags = [bool(logits)] * n if isinstance(logits, bool) else [bool(x) for x in logits]
    if self.cfg.mtp:
        rows = np.asarray(rows, dtype=np.float32)
        if rows.shape != (n, self.width) or not np.isfinite(rows).all():
            raise RuntimeInputError("bad rows")
        self._embd[: n * self.width] = rows.reshape(-1)
    b = self._batch
    for i in range(n):
        b.token[i] = int(toks[i])
        b.pos[i] = int(pos[i])
        b.n_seq_id[i] = 1
        b.seq_id[i][0] = seq_id
        b.logits[i] = flags[i]
    b.n_tokens = n
    if int(self.llama.llama_decode(self.ptr, b)) != 0:
        raise UpstreamError("llama_decode failed")
    self.last_n_outputs = sum(flags)
    self.last_decode_len = n


def _old_logits(self, i):
    p = self.llama.llama_get_logits_ith(self.ptr, i)
    return np.ctypeslib.as_array(p, shape=(self.n_vocab,)).copy()


def _old_nextn_rows(self, n):
    p = self.model.ext.llama_get_embeddings_nextn(self.ptr)
    return np.ctypeslib.as_array(p, shape=(n, self.width)).copy()


def _old_logits_all(self, n):  # the previous verify: one logits() call per row
    return [self.logits(i) for i in range(n)]


def mode_ab(env, k, rates):
    new = {n: getattr(MD.Context, n) for n in ("decode", "logits", "nextn_rows", "logits_all")}
    old = {"decode": _old_decode, "logits": _old_logits, "nextn_rows": _old_nextn_rows,
           "logits_all": _old_logits_all}
    rt, mtp = runtime(env, k)
    tt, mt = timers(rt)
    steps = []
    step_hook(tt, mt, steps)
    p = seeded_prompt(0, 32, rt.trunk.n_vocab)
    res = {"old": [], "new": []}
    tps = {"old": [], "new": []}
    for rep in range(8):
        for variant in (("old", "new") if rep % 2 == 0 else ("new", "old")):
            for name, f in (old if variant == "old" else new).items():
                setattr(MD.Context, name, f)
            set_drafter(rt, mtp, rates)
            steps.clear()
            _, m = rt.generate(p, N_NEW)
            if rep:
                res[variant].append(statistics.median(s[0] - s[1] - s[2] for s in steps))
                tps[variant].append(m.decode_tok_s)
    return {v: {"non_c_ms_per_step_median": round(1e3 * statistics.median(res[v]), 3),
                "decode_tok_s_median": round(statistics.median(tps[v]), 2),
                "runs": len(res[v])} for v in res}


MODES = {"step": mode_step, "parts": mode_parts, "noop": mode_noop, "cold": mode_cold,
         "ab": mode_ab}

def main(argv: list[str] | None = None) -> int:
    ap = common.parser(MODULE, __doc__, epilog="\n\n".join(__doc__.split("\n\n")[1:]),
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("mode", choices=list(MODES))
    ap.add_argument("k", nargs="?", type=int, default=0, help="draft length (default 0)")
    ap.add_argument("rates", nargs="?", help="synthetic acceptance rates, ','-separated")
    a = ap.parse_args(argv)
    rates = [float(x) for x in a.rates.split(",")] if a.rates else None
    env = Env.read()
    la0 = loadavg()
    out = MODES[a.mode](env, a.k, rates)
    print(json.dumps({"mode": a.mode, "k": a.k, "rates": rates, "threads": env.nt,
                      "loadavg_before": la0, "loadavg_after": loadavg(), **out}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
