"""The trained tiny DeepSeek-V4 pair measured on upstream llama.cpp, without torch.

Everything here runs the committed GGUFs (evidence/trained-v4/) through the pinned
upstream only: logits and `h_nextn` rows for parity checks against the logits stored at
export time, next-token accuracy of the trunk on held-out text, MTP acceptance per draft
position from the runtime (`MTPRuntime`), and MTP-off vs MTP-on decode speed.

Rows for the MTP graph come from the eval callback (the ``h_nextn`` node), never unchecked
from `llama_get_embeddings_nextn`, which can be wrong in some context configurations
(../shared/reference/upstream-v4-mtp.md §4).

Every function that runs the MTP block asks the deployment policy first
(`mtplib.runtime.routing.require_mtp`, through `negotiate()`): under alpha it raises
RouteRefused naming the policy before any model is loaded.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from mtplib import logs
from mtplib.contract.capabilities import Policy
from mtplib.errors import InputError, MtplibError
from mtplib.model.trained import EVIDENCE_DIR, TrainedPair, trained_paths
from mtplib.runtime.routing import require_mtp
from mtplib.runtime.rows import CapturedRows

log = logging.getLogger(__name__)

#: Parity configuration: F32 K/V, flash attention off (flash attention rounds K/V to F16).
PARITY_CTX = {"kv_type": "f32", "flash_attn": "off"}


# ---------------------------------------------------------------------------------------
# upstream logits and rows
# ---------------------------------------------------------------------------------------
def _ctx_len(n: int) -> int:
    return max(256, -(-n // 256) * 256)


def upstream_trunk(trunk: str | Path, tokens: Sequence[int], *, n_threads: int = 2,
                   kv_type: str = "f32", flash_attn: str = "off", n_ubatch: int = 512,
                   ) -> tuple[np.ndarray, np.ndarray]:
    """Logits (T, V) of every position and the trunk's h_nextn rows (T, hc*E), one pass
    at positions 0..T-1 (rows from the eval callback)."""
    from mtplib.runtime.model import Context, ContextConfig, Model

    T = len(tokens)
    with Model(trunk) as m:
        cap = CapturedRows(m.n_embd_out)
        cfg = ContextConfig(n_ctx=_ctx_len(T), n_batch=512, n_ubatch=n_ubatch,
                            n_threads=n_threads, kv_type=kv_type, flash_attn=flash_attn,
                            nextn_rows="all")
        with Context(m, cfg, cb_eval=cap.callback) as ctx:
            logits, rows = [], []
            for a in range(0, T, ctx.n_batch):
                chunk = list(tokens[a : a + ctx.n_batch])
                ctx.decode(chunk, range(a, a + len(chunk)), logits=True)
                logits += [ctx.logits(i) for i in range(len(chunk))]
                rows.append(cap.take(len(chunk)))
    return np.stack(logits), np.concatenate(rows)


def upstream_mtp(sidecar: str | Path, tokens: Sequence[int], rows: np.ndarray, *,
                 n_threads: int = 2, kv_type: str = "f32", flash_attn: str = "off",
                 policy: Policy | str | None = None) -> np.ndarray:
    """MTP logits for entries p = 1..T-1: token x_p at position p with the trunk's h_{p-1}.

    ``rows`` are the trunk's rows h_0..h_{T-1} (or at least h_0..h_{T-2}). Returns
    (T-1, V); row j predicts the token at position j+2.
    """
    from mtplib.runtime.model import Context, ContextConfig, Model

    require_mtp("upstream_mtp", policy=policy)
    T = len(tokens)
    with Model(sidecar, load_mtp=True) as m:
        cfg = ContextConfig(n_ctx=_ctx_len(T), n_batch=512, n_ubatch=512, n_threads=n_threads,
                            kv_type=kv_type, flash_attn=flash_attn, mtp=True)
        with Context(m, cfg) as ctx:
            out = []
            for a in range(1, T, ctx.n_batch):
                b = min(T, a + ctx.n_batch)
                ctx.decode(list(tokens[a:b]), range(a, b), logits=True, rows=rows[a - 1 : b - 1])
                out += [ctx.logits(i) for i in range(b - a)]
    return np.stack(out)


# ---------------------------------------------------------------------------------------
# parity against the logits stored at export time
# ---------------------------------------------------------------------------------------
def check_parity(pair: TrainedPair | None = None, *, n_threads: int = 2,
                 policy: Policy | str | None = None) -> dict:
    """Run upstream on the stored held-out tokens; compare with the stored torch logits."""
    pol = require_mtp("check_parity", policy=policy)  # before the trunk runs
    pair = pair or trained_paths()
    ref = np.load(pair.parity)
    tokens = [int(t) for t in ref["tokens"]]
    logits, rows = upstream_trunk(pair.trunk, tokens, n_threads=n_threads, **PARITY_CTX)
    mtp = upstream_mtp(pair.sidecar, tokens, rows, n_threads=n_threads, policy=pol,
                       **PARITY_CTX)
    tp, mp = ref["trunk_positions"], ref["mtp_positions"]
    d_trunk = np.abs(logits[tp] - ref["trunk_logits"])
    d_mtp = np.abs(mtp[mp - 1] - ref["mtp_logits"])
    return {
        "n_tokens": len(tokens),
        "trunk_rows": int(len(tp)),
        "mtp_rows": int(len(mp)),
        "trunk_max_abs": float(d_trunk.max()),
        "mtp_max_abs": float(d_mtp.max()),
        "trunk_logit_scale": float(np.abs(ref["trunk_logits"]).max()),
        "mtp_logit_scale": float(np.abs(ref["mtp_logits"]).max()),
        "trunk_argmax_agree": float((logits[tp].argmax(-1)
                                     == ref["trunk_logits"].argmax(-1)).mean()),
        "mtp_argmax_agree": float((mtp[mp - 1].argmax(-1) == ref["mtp_logits"].argmax(-1)).mean()),
        "config": dict(PARITY_CTX),
    }


# ---------------------------------------------------------------------------------------
# held-out text (tokenized by upstream's own tokenizer)
# ---------------------------------------------------------------------------------------
def heldout_modules(split_json: str | Path | None = None) -> list[dict]:
    """The held-out modules of split.json, read from this interpreter's stdlib directory.

    Each entry: module, text, and whether the file's sha256 matches the recorded one.
    """
    import hashlib
    import sysconfig

    split = json.loads(Path(split_json or EVIDENCE_DIR / "split.json").read_text())
    root = Path(sysconfig.get_paths()["stdlib"])
    out = []
    for e in split["heldout"]:
        path = root / f"{e['module']}.py"
        if not path.exists():
            continue
        b = path.read_bytes()
        out.append({"module": e["module"], "text": b.decode("utf-8"),
                    "sha256_ok": hashlib.sha256(b).hexdigest() == e["sha256"]})
    if not out:
        raise InputError(f"none of the held-out modules of the split is in {root}")
    return out


def heldout_tokens(trunk: str | Path, modules: list[dict]) -> list[list[int]]:
    from mtplib.runtime.model import Model

    with Model(trunk) as m:
        return [m.tokenize(e["text"]) for e in modules]


# ---------------------------------------------------------------------------------------
# measurements
# ---------------------------------------------------------------------------------------
def next_token_accuracy(trunk: str | Path, docs: list[list[int]], *, window: int = 256,
                        n_threads: int = 2, kv_type: str = "f16", flash_attn: str = "auto",
                        sidecar: str | Path | None = None,
                        policy: Policy | str | None = None) -> dict:
    """Top-1 accuracy of the trunk on every held-out token, in non-overlapping windows of
    ``window`` tokens decoded from position 0 (the training length).

    With ``sidecar``: also the MTP graph's top-1 accuracy on the token after next
    (teacher forced: entry p = (x_p, h_{p-1}) predicts x_{p+1}) and its agreement with the
    trunk's own next-token argmax at p, i.e. the first draft's acceptance on natural text;
    refused under a policy that disables MTP (without ``sidecar`` the trunk alone runs).
    """
    from mtplib.runtime.model import Context, ContextConfig, Model

    if sidecar:
        require_mtp("next_token_accuracy with a sidecar", policy=policy)
    n = hit = 0
    nll = 0.0
    m_n = m_hit = m_agree = 0
    t0 = time.perf_counter()
    with Model(trunk) as model:
        cap = CapturedRows(model.n_embd_out)
        cfg = ContextConfig(n_ctx=_ctx_len(window), n_batch=window, n_ubatch=window,
                            n_threads=n_threads, kv_type=kv_type, flash_attn=flash_attn,
                            nextn_rows="all" if sidecar else "off")
        side = mctx = None
        if sidecar:
            side = Model(sidecar, load_mtp=True)
            mctx = Context(side, ContextConfig(n_ctx=_ctx_len(window), n_batch=window,
                                               n_ubatch=window, n_threads=n_threads,
                                               kv_type=kv_type, flash_attn=flash_attn,
                                               mtp=True))
        try:
            with Context(model, cfg, cb_eval=cap.callback if sidecar else None) as ctx:
                for doc in docs:
                    for a in range(0, len(doc) - 1, window):
                        w = doc[a : a + window + 1]
                        if len(w) < 3:
                            continue
                        x, y = w[:-1], np.asarray(w[1:])
                        ctx.clear()
                        ctx.decode(x, range(len(x)), logits=True)
                        lg = np.stack([ctx.logits(i) for i in range(len(x))])
                        pred = lg.argmax(-1)
                        hit += int((pred == y).sum())
                        n += len(y)
                        z = lg - lg.max(-1, keepdims=True)
                        lse = np.log(np.exp(z).sum(-1))
                        nll += float((lse - z[np.arange(len(y)), y]).sum())
                        if mctx is None:
                            continue
                        rows = cap.take(len(x))
                        mctx.clear()
                        T = len(x)
                        mctx.decode(x[1:], range(1, T), logits=True, rows=rows[: T - 1])
                        mp = np.array([int(np.argmax(mctx.logits(i))) for i in range(T - 1)])
                        # entry p (row p-1) drafts position p+1: the truth is x_{p+1} = y[p],
                        # the trunk's choice there is pred[p]
                        m_hit += int((mp == y[1:]).sum())
                        m_agree += int((mp == pred[1:]).sum())
                        m_n += T - 1
        finally:
            if mctx is not None:
                mctx.close()
                side.close()
    out = {"tokens": n, "top1_accuracy": hit / n, "nll_nats": nll / n, "window": window,
           "kv_type": kv_type, "flash_attn": flash_attn, "seconds": time.perf_counter() - t0}
    if sidecar:
        out.update({"mtp_tokens": m_n, "mtp_top1_accuracy_token_after_next": m_hit / m_n,
                    "mtp_agrees_with_trunk_argmax": m_agree / m_n})
    return out


def prompts_from(docs: list[list[int]], *, n: int, length: int, seed: int = 0
                 ) -> list[list[int]]:
    """``n`` prompts of ``length`` tokens at seeded offsets, spread over the documents."""
    rng = np.random.default_rng(seed)
    long = [d for d in docs if len(d) > length + 1]
    out = []
    for i in range(n):
        d = long[i % len(long)]
        a = int(rng.integers(0, len(d) - length))
        out.append(list(d[a : a + length]))
    return out


def acceptance(trunk: str | Path, sidecar: str | Path, prompts: list[list[int]], *,
               ks: Sequence[int] = (1, 2, 3), n_new: int = 128, n_threads: int = 2,
               kv_type: str = "f16", flash_attn: str = "auto", rows: str = "api",
               policy: Policy | str | None = None) -> dict:
    """Greedy MTP decoding of every prompt for each k; acceptance per draft position.

    rows="api": `MTPRuntime` as shipped (rows from llama_get_embeddings_nextn);
    rows="captured": the same Engine and MTPDrafter, rows from the eval callback.
    """
    from mtplib.runtime.speculative import MTPRuntime

    pol = require_mtp("acceptance", ks, policy=policy)
    n_ctx = _ctx_len(max(len(p) for p in prompts) + n_new)
    out = {}
    for k in ks:
        acc = np.zeros(k)
        dr = np.zeros(k)
        hist = np.zeros(k + 1)
        outputs = []
        # "api": MTPRuntime as shipped; "captured": the same runtime, rows from cb_eval
        rt = MTPRuntime(str(trunk), str(sidecar), k=k, n_ctx=n_ctx, n_threads=n_threads,
                        kv_type=kv_type, flash_attn=flash_attn, hidden_rows=rows,
                        policy=pol)
        gen, close = rt.generate, rt.close
        try:
            for p in prompts:
                toks, m = gen(p, n_new)
                outputs.append(toks)
                acc += m.accepted_per_position_counts
                dr += m.drafted_per_position
                hist += [m.accept_len_hist[str(i)] for i in range(k + 1)]
        finally:
            close()
        steps = hist.sum()
        grams = [tuple(o[i : i + 4]) for o in outputs for i in range(len(o) - 3)]
        out[str(k)] = {
            "distinct_4gram_ratio": len(set(grams)) / max(len(grams), 1),
            "accepted_per_position": (acc / np.maximum(dr, 1)).tolist(),
            "accepted_counts": acc.astype(int).tolist(),
            "drafted_counts": dr.astype(int).tolist(),
            "accept_len_hist": hist.astype(int).tolist(),
            "mean_accepted_per_step": float((hist * np.arange(k + 1)).sum() / max(steps, 1)),
            "tokens_per_target_decode": float((hist * (np.arange(k + 1) + 1)).sum()
                                              / max(steps, 1)),
            "outputs": outputs,
        }
    return {"prompts": len(prompts), "prompt_tokens": len(prompts[0]), "n_new": n_new,
            "rows": rows, "kv_type": kv_type, "flash_attn": flash_attn, "by_k": out}


def speed(trunk: str | Path, sidecar: str | Path, prompts: list[list[int]], *,
          ks: Sequence[int] = (0, 1, 2, 3), n_new: int = 128, n_threads: int = 2,
          repeats: int = 3, policy: Policy | str | None = None) -> dict:
    """Decode tok/s, MTP off (k=0, no sidecar) vs on, interleaved over ``repeats`` rounds
    (the machine is shared: medians). Same runtime code for both (MTPRuntime)."""
    import os

    from mtplib.runtime.speculative import MTPRuntime

    pol = require_mtp("speed", [k for k in ks if k], policy=policy)
    n_ctx = _ctx_len(max(len(p) for p in prompts) + n_new)
    rts = {}
    try:
        for k in ks:
            rts[k] = MTPRuntime(str(trunk), str(sidecar) if k else None, k=k, n_ctx=n_ctx,
                                n_threads=n_threads, policy=pol)
    except BaseException:
        for rt in rts.values():
            rt.close()
        raise
    rates: dict[int, list[float]] = {k: [] for k in ks}
    same: dict[int, bool] = {k: True for k in ks}
    try:
        for _ in range(repeats):
            ref = None
            for k in ks:
                n_tok = dt = 0.0
                toks_all = []
                for p in prompts:
                    toks, m = rts[k].generate(p, n_new)
                    toks_all.append(toks)
                    n_tok += m.n_generated - 1
                    dt += m.decode_s
                rates[k].append(n_tok / dt)
                if ref is None:
                    ref = toks_all
                else:
                    same[k] &= toks_all == ref
    finally:
        for rt in rts.values():
            rt.close()
    med = {k: float(np.median(v)) for k, v in rates.items()}
    return {"decode_tok_s_median": {str(k): v for k, v in med.items()},
            "decode_tok_s_runs": {str(k): v for k, v in rates.items()},
            "speedup_vs_off": {str(k): med[k] / med[ks[0]] for k in ks},
            "same_tokens_as_off": {str(k): v for k, v in same.items()},
            "n_threads": n_threads, "n_new": n_new, "prompts": len(prompts),
            "loadavg_after": os.getloadavg()}


def measure_all(root: str | Path | None = None, *, n_threads: int = 1, n_prompts: int = 32,
                prompt_len: int = 64, n_new: int = 128, speed_repeats: int = 5,
                speed_threads: Sequence[int] = (1, 2),
                policy: Policy | str | None = None) -> dict:
    """Accuracy and acceptance (thread count cannot change them: ``n_threads``), then speed
    for each of ``speed_threads`` (on a loaded 2-core machine 2 threads can be slower:
    upstream's threads spin at every graph barrier while the other one is descheduled)."""
    import os

    def say(msg: str) -> None:
        log.info("[trained_eval] %s (load %.1f)", msg, os.getloadavg()[0])

    pol = require_mtp("trained_eval", (1, 2, 3), policy=policy)  # every k measured below
    pair = trained_paths(root)
    mods = heldout_modules(Path(pair.trunk).parent / "split.json")
    docs = heldout_tokens(pair.trunk, mods)
    res = {"heldout_modules": [m["module"] for m in mods],
           "heldout_sha256_ok": all(m["sha256_ok"] for m in mods),
           "heldout_tokens": sum(len(d) for d in docs)}
    say(f"{res['heldout_tokens']} held-out tokens: accuracy")
    res["accuracy"] = next_token_accuracy(pair.trunk, docs, n_threads=n_threads,
                                          sidecar=pair.sidecar, policy=pol)
    prompts = prompts_from(docs, n=n_prompts, length=prompt_len)
    for rows in ("api", "captured"):
        say(f"acceptance, {rows} rows")
        res[f"acceptance_{rows}_rows"] = acceptance(pair.trunk, pair.sidecar, prompts,
                                                    n_new=n_new, n_threads=n_threads,
                                                    rows=rows, policy=pol)
    res["speed"] = {}
    for nt in speed_threads:
        say(f"speed, {nt} threads")
        res["speed"][f"threads_{nt}"] = speed(pair.trunk, pair.sidecar, prompts[:16],
                                              n_new=n_new, n_threads=nt,
                                              repeats=speed_repeats, policy=pol)
    say("done")
    return res


def main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="python -m mtplib.lab.trained_eval",
                                 description="measure the trained pair on upstream (no torch)")
    ap.add_argument("--dir", default=str(EVIDENCE_DIR), help="where the trained pair lies")
    ap.add_argument("--out", help="write the metrics JSON here")
    ap.add_argument("--threads", type=int, default=1,
                    help="threads for parity, accuracy and acceptance (speed: 1 and 2)")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--n", type=int, default=128, help="tokens generated per prompt")
    ap.add_argument("--parity-only", action="store_true")
    ap.add_argument("--policy", choices=["alpha", "beta"], default=None,
                    help="deployment policy (default: $MTPLIB_POLICY, else beta); alpha "
                    "refuses: every measurement here runs the MTP block")
    a = ap.parse_args(argv)
    logs.configure()
    pair = trained_paths(a.dir)
    if not pair.exists():
        raise SystemExit(f"no trained pair in {a.dir}")
    try:
        pol = require_mtp("trained_eval", (1,) if a.parity_only else (1, 2, 3),
                          policy=a.policy)
        res = {"parity": check_parity(pair, n_threads=a.threads, policy=pol)}
        if not a.parity_only:
            res.update(measure_all(a.dir, n_threads=a.threads, n_prompts=a.prompts,
                                   n_new=a.n, policy=pol))
    except MtplibError as e:  # one line, exit 2, as the mtplib CLI says it
        log.error("%s: error: %s", ap.prog, e)
        return 2
    text = json.dumps(res, indent=2, sort_keys=True)
    if a.out:
        Path(a.out).write_text(text + "\n")
    print(text if a.parity_only else json.dumps(
        {k: res[k] for k in ("parity", "accuracy")}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())


def anchor_table(metrics_path: str | None = None) -> list[dict]:
    """Acceptance per position of the committed trained pair next to the reference anchors
    (mtplib.lab.common.display.REFERENCES), as rows for the benchmark notebook."""
    import json
    from pathlib import Path

    from mtplib.lab.common.display import REFERENCE_S9

    p = Path(metrics_path) if metrics_path else EVIDENCE_DIR / "metrics.json"
    m = json.loads(p.read_text())
    rows = []
    for k, d in sorted(m["acceptance_api_rows"]["by_k"].items()):
        acc = d["accepted_per_position"]
        rows.append({"source": "mtplib trained tiny V4 (held-out prompts)", "k": int(k),
                     **{f"pos{i + 1}": a for i, a in enumerate(acc)},
                     "speedup": m["speed"]["threads_1"]["decode_tok_s_median"][k] /
                     m["speed"]["threads_1"]["decode_tok_s_median"]["0"]})
    v3 = REFERENCE_S9["deepseek_v3"]
    rows.append({"source": v3["source"], "k": 1,
                 "pos1": (v3["second_token_acceptance_low"] + v3["second_token_acceptance_high"])
                 / 2, "speedup": v3["speedup"]})
    v = REFERENCE_S9["vllm_v4"]
    rows.append({"source": v["source"], "k": 2, "pos1": v["acceptance_per_position"][0],
                 "pos2": v["acceptance_per_position"][1]})
    return rows
