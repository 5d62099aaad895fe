"""Diagnostics of the trunk's `h_nextn` rows: are upstream's API rows right?

* `check_hidden` decodes on throwaway contexts and checks the API rows against the rows
  captured through the eval callback (`mtplib.runtime.rows.CapturedRows`), and the
  captured rows against the logits of the same decode: the trunk's hc head, output_norm
  and output recomputed in numpy from the root tensors read from the GGUF must give
  upstream's logits, so ``capture_ok`` is a measured fact, not an assumption;
* `decide` turns a report into a row source ("api", "captured" or "unsupported",
  fail-closed): `mtplib.runtime.row_source.choose_row_source` runs the check once per
  context configuration and keeps that verdict;
* `hidden_matrix` runs the check over a configuration matrix and `capture_cost` measures
  what capture costs (`mtplib check-hidden --matrix/--cost`, evidence/upstream-bugs).
"""

from __future__ import annotations

import itertools
import os
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, fields, replace
from pathlib import Path

import numpy as np

from mtplib import pins
from mtplib.errors import InputError
from mtplib.runtime.model import Context, ContextConfig, Model, RuntimeInputError
from mtplib.runtime.rows import CapturedRows, CaptureError, HeadWeights, force_reserve, read_rows

#: Captured vs API rows: a row is bad when it differs by more than this, relative to the
#: row scale (max(1, max|row|)). Equal memory gives 0; a garbage row differs by O(1).
ROW_TOL = 1e-5
#: Captured rows vs logits: recomputed and upstream logits may differ by this much,
#: relative to max(1, max|logits|) (fixture: ~1e-7 relative; garbage rows: ~1).
LOGITS_RTOL = 1e-2
#: Decodes after the prompt, (tokens, logits): what the MTP loop decodes (a token, verify
#: batches of k+1 for k = 1..3, a prefill chunk with logits on its last token only).
FOLLOWUPS = ((1, "all"), (2, "all"), (3, "all"), (4, "all"), (8, "last"))
#: With unmasked rows a loop that runs the output head itself decodes with no logits at
#: all (a plain token, a verify batch of k+1): those graphs differ, so they are checked too.
ROWS_ONLY_FOLLOWUPS = ((1, "none"), (3, "none"), (4, "none"))
MATRIX_DEFAULTS = {
    "kv_types": ("f16", "f32"),
    "flash_attn": ("on", "off", "auto"),
    "ubatches": (7, 64, 512),
    "masked": (False, True),
    "prompt_lengths": (7, 300),
    "n_ctxs": (512, 1024, 2048),
}
#: bump when the check itself changes, so decisions cached on disk are made again
CHECK_VERSION = 2


def logits_consistent(diff: float, scale: float) -> bool:
    """Recomputed and upstream logits agree (`LOGITS_RTOL` of the logits' scale)."""
    return bool(np.isfinite(diff) and diff <= LOGITS_RTOL * max(1.0, scale))


# ---------------------------------------------------------------------------------------
# the check
# ---------------------------------------------------------------------------------------
CONFIG_FIELDS = ("kv_type", "flash_attn", "n_ctx", "n_batch", "n_ubatch", "n_threads")


def as_config(cfg: ContextConfig | dict | None, masked: bool) -> ContextConfig:
    """A target-context config with nextn rows on (all, or masked)."""
    if cfg is None:
        base = ContextConfig()
    elif isinstance(cfg, ContextConfig):
        base = ContextConfig(**{f.name: getattr(cfg, f.name) for f in fields(ContextConfig)})
    else:
        unknown = set(cfg) - {f.name for f in fields(ContextConfig)}
        if unknown:
            raise RuntimeInputError(f"unknown context config fields: {sorted(unknown)}")
        base = ContextConfig(**cfg)
    # ContextConfig is frozen (its shared fields are ContextSettings'): a changed copy
    return replace(base, mtp=False, nextn_rows="masked" if masked else "all").validate()


def _flags(n: int, pattern: str) -> list[bool]:
    if pattern == "all":
        return [True] * n
    if pattern == "last":
        return [False] * (n - 1) + [True]
    if pattern == "every3":  # output rows at 2, 5, 8, ... and the last token
        return [i % 3 == 2 or i == n - 1 for i in range(n)]
    if pattern == "none":  # rows only: the output head runs elsewhere (in the client)
        return [False] * n
    raise InputError(f"unknown logits pattern {pattern!r}")


def _plan(n_tokens: int, n_batch: int, masked: bool,
          followups: Sequence[tuple[int, str]]) -> list[tuple[int, str]]:
    """The decodes of a check: the prompt in n_batch chunks, then the follow-ups."""
    first = "every3" if masked else "all"
    out = []
    for a in range(0, n_tokens, n_batch):
        out.append((min(n_batch, n_tokens - a), first))
    return out + [(int(n), str(p)) for n, p in followups]


@dataclass
class _Decoded:
    api: list[np.ndarray]
    captured: list[np.ndarray]
    logits: list[np.ndarray]
    n_ubatch: int
    n_ctx: int
    n_batch: int


def _run(model: Model, cfg: ContextConfig, tokens: Sequence[int], plan, masked: bool, *,
         capture: bool, fix: bool = False) -> _Decoded:
    cap = CapturedRows(model.n_embd_out) if capture else None
    ctx = cap.open(model, cfg) if cap else Context(model, cfg)
    with ctx:
        if fix:
            force_reserve(ctx)
        api, captured, logits = [], [], []
        pos = 0
        for n, pattern in plan:
            flags = _flags(n, pattern)
            ctx.decode(tokens[pos:pos + n], range(pos, pos + n), logits=flags)
            n_rows = sum(flags) if masked else n
            api.append(ctx.nextn_rows(n_rows))
            if cap is not None:
                try:
                    captured.append(cap.take(n_rows))
                except CaptureError as e:
                    captured.append(e)
            rows = [ctx.logits(i) for i, f in enumerate(flags) if f]
            logits.append(np.stack(rows) if rows else np.zeros((0, model.n_vocab), np.float32))
            pos += n
        return _Decoded(api, captured, logits, ctx.n_ubatch, ctx.n_ctx, ctx.n_batch)


def _row_diff(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Per-row max |a - b| relative to the row scale; inf where a row is not finite."""
    d = np.abs(a.astype(np.float64) - b.astype(np.float64)).max(axis=1)
    scale = np.maximum(1.0, np.abs(b).max(axis=1))
    d = d / scale
    d[~np.isfinite(a).all(axis=1) | ~np.isfinite(b).all(axis=1)] = np.inf
    return d


def _output_rows(rows: np.ndarray, flags: list[bool], masked: bool) -> np.ndarray:
    return rows if masked else rows[[i for i, f in enumerate(flags) if f]]


def _open_model(model: str | Path | Model) -> tuple[Model, bool]:
    if isinstance(model, Model):
        return model, False
    return Model(model), True


def check_hidden(model: str | Path | Model, cfg: ContextConfig | dict | None = None,
                 n_tokens: int = 7, masked: bool = False, *,
                 followups: Iterable[tuple[int, str]] = FOLLOWUPS, probe_fix: bool = True,
                 reserve: bool = False, seed: int = 0,
                 head: HeadWeights | None = None) -> dict:
    """Decode on throwaway contexts and compare the API rows with the captured rows.

    Decodes: the ``n_tokens`` prompt (chunks of n_batch; logits on every row unmasked, on
    every third row + the last masked), then ``followups`` (1 token, 4 tokens, 8 tokens
    with logits on the last only: the kinds of decode the MTP loop makes). Three contexts
    of the same configuration decode the same tokens: one plain (its API rows are what
    row source "api" reads), one with `CapturedRows` (its captured rows are checked
    against its logits through the trunk's head in numpy), and with ``probe_fix`` one
    plain context after `force_reserve`. With ``reserve`` every context gets
    `force_reserve` first: the verdict is then about a target context that does the same.
    """
    t0 = time.perf_counter()
    m, owned = _open_model(model)
    try:
        c = as_config(cfg, masked)
        fups = [(int(n), str(p)) for n, p in followups]
        if n_tokens < 1 or any(n < 1 for n, _ in fups):
            raise RuntimeInputError("every decode needs at least one token")
        total = n_tokens + sum(n for n, _ in fups)
        if total > c.n_ctx:
            raise RuntimeInputError(
                f"the check decodes {total} tokens ({n_tokens} + follow-ups), more than "
                f"n_ctx {c.n_ctx}; lower --tokens or raise --ctx")
        n_batch = min(c.n_batch, c.n_ctx)
        plan = _plan(n_tokens, n_batch, masked, fups)
        rng = np.random.default_rng(seed)
        tokens = [int(x) for x in rng.integers(0, m.n_vocab, total)]

        plain = _run(m, c, tokens, plan, masked, capture=False, fix=reserve)
        withcb = _run(m, c, tokens, plan, masked, capture=True, fix=reserve)
        probe_fix = probe_fix and not reserve
        fixed = _run(m, c, tokens, plan, masked, capture=False, fix=True) if probe_fix else None

        head_err = None
        if head is None:
            try:
                head = HeadWeights(m.path)
            except CaptureError as e:
                head_err = str(e)

        decodes, problems = [], []
        bad = n_rows = 0
        max_diff = 0.0
        cap_logit = api_logit = logits_xctx = 0.0
        bad_cb = bad_fix = 0
        for k, (n, pattern) in enumerate(plan):
            flags = _flags(n, pattern)
            api, cap, lg = plain.api[k], withcb.captured[k], withcb.logits[k]
            entry = {"n_tokens": n, "logits": pattern, "n_rows": int(api.shape[0])}
            if lg.size:
                logits_xctx = max(logits_xctx, float(np.abs(plain.logits[k] - lg).max()))
            if isinstance(cap, Exception):
                problems.append(f"decode {k}: {cap}")
                entry["capture_error"] = str(cap)
                decodes.append(entry)
                continue
            if cap.shape != (api.shape[0], m.n_embd_out):
                problems.append(f"decode {k}: captured shape {cap.shape}")
            elif not np.isfinite(cap).all():
                problems.append(f"decode {k}: captured rows not finite")
            else:
                d = _row_diff(api, cap)
                nb = int((d > ROW_TOL).sum())
                bad += nb
                n_rows += int(d.size)
                max_diff = max(max_diff, float(np.abs(api.astype(np.float64) - cap).max()))
                bad_cb += int((_row_diff(withcb.api[k], cap) > ROW_TOL).sum())
                if fixed is not None:
                    bad_fix += int((_row_diff(fixed.api[k], cap) > ROW_TOL).sum())
                entry.update(bad_rows=nb, max_abs_diff=float(
                    np.abs(api.astype(np.float64) - cap).max()))
                if head is not None:
                    dc, scale = head.compare(_output_rows(cap, flags, masked), lg)
                    da, _ = head.compare(_output_rows(api, flags, masked), plain.logits[k])
                    cap_logit, api_logit = max(cap_logit, dc), max(api_logit, da)
                    entry.update(capture_logits_diff=dc, api_logits_diff=da, logits_scale=scale)
                    if not logits_consistent(dc, scale):
                        problems.append(
                            f"decode {k}: logits recomputed from the captured rows differ from "
                            f"upstream's by {dc:.3g} (scale {scale:.3g})")
            decodes.append(entry)
        if head_err:
            problems.append(head_err)
        capture_ok = not problems
        report = {
            "api_rows_ok": bool(capture_ok and bad == 0),
            "bad_rows": bad,
            "n_rows": n_rows,
            "max_abs_diff": max_diff,
            "capture_ok": capture_ok,
            "capture_problems": problems,
            "capture_logits_max_diff": cap_logit,
            "api_logits_max_diff": api_logit,
            "logits_max_diff_across_contexts": logits_xctx,
            "api_rows_ok_with_callback": bool(capture_ok and bad_cb == 0),
            "reserve_fix_ok": (bool(capture_ok and bad_fix == 0) if probe_fix else None),
            "config": {
                "model": str(m.path), "kv_type": c.kv_type, "flash_attn": c.flash_attn,
                "n_ctx": plain.n_ctx, "n_batch": plain.n_batch, "n_ubatch": plain.n_ubatch,
                "n_threads": c.n_threads, "masked": masked, "n_tokens": n_tokens,
                "reserve": reserve,
                "followups": [list(f) for f in fups], "seed": seed,
            },
            "decodes": decodes,
            "upstream": pins.LLAMA_CPP_COMMIT,
            "elapsed_s": round(time.perf_counter() - t0, 3),
        }
        return report
    finally:
        if owned:
            m.close()



def decide(report: dict) -> tuple[str, str]:
    """(mode, reason) from a `check_hidden` report; anything unverified is unsupported."""
    if report.get("error"):
        return "unsupported", f"the check failed: {report['error']}"
    if not report.get("capture_ok"):
        probs = "; ".join(report.get("capture_problems") or ["not verified"])
        return "unsupported", f"captured rows could not be verified ({probs})"
    if report.get("n_rows", 0) < 1:
        return "unsupported", "the check compared no rows"
    if report.get("api_rows_ok"):
        return "api", (f"API rows equal the verified captured rows ({report['n_rows']} rows, "
                       f"max |diff| {report['max_abs_diff']:.3g})")
    return "captured", (f"API rows wrong ({report['bad_rows']}/{report['n_rows']} rows, max "
                        f"|diff| {report['max_abs_diff']:.3g}); captured rows verified against "
                        f"the logits (max |diff| {report['capture_logits_max_diff']:.3g})")



# ---------------------------------------------------------------------------------------
# the matrix and the cost
# ---------------------------------------------------------------------------------------
def hidden_matrix(model: str | Path | Model, *, kv_types=MATRIX_DEFAULTS["kv_types"],
                  flash_attn=MATRIX_DEFAULTS["flash_attn"], ubatches=MATRIX_DEFAULTS["ubatches"],
                  masked=MATRIX_DEFAULTS["masked"],
                  prompt_lengths=MATRIX_DEFAULTS["prompt_lengths"],
                  n_ctxs=MATRIX_DEFAULTS["n_ctxs"], n_batch: int = 512,
                  n_threads: int | None = None, probe_fix: bool = True,
                  progress: Callable[[dict], None] | None = None) -> list[dict]:
    """`check_hidden` over kv type x flash attention x n_ubatch x masked x prompt length
    x n_ctx.

    One compact row per configuration (the full reports are large); the prompt's own
    decodes and the follow-ups are counted together in bad_rows/n_rows, and separately
    in bad_rows_prompt.
    """
    m, owned = _open_model(model)
    try:
        head = HeadWeights(m.path)
        out = []
        combos = itertools.product(n_ctxs, kv_types, flash_attn, ubatches, masked,
                                   prompt_lengths)
        for n_ctx, kv, fa, ub, mk, n in combos:
            cfg = {"kv_type": kv, "flash_attn": fa, "n_ubatch": ub,
                   "n_ctx": n_ctx, "n_batch": n_batch}
            if n_threads:
                cfg["n_threads"] = n_threads
            r = check_hidden(m, cfg, n, mk, probe_fix=probe_fix, head=head)
            n_prompt = len(r["decodes"]) - len(FOLLOWUPS)
            row = {
                "n_ctx": n_ctx, "kv_type": kv, "flash_attn": fa, "n_ubatch": ub,
                "masked": mk, "n_tokens": n, "api_rows_ok": r["api_rows_ok"],
                "bad_rows": r["bad_rows"], "n_rows": r["n_rows"],
                "bad_rows_prompt": sum(d.get("bad_rows", 0) for d in r["decodes"][:n_prompt]),
                "n_rows_prompt": sum(d["n_rows"] for d in r["decodes"][:n_prompt]),
                "max_abs_diff": r["max_abs_diff"],
                "capture_ok": r["capture_ok"],
                "capture_logits_max_diff": r["capture_logits_max_diff"],
                "api_logits_max_diff": r["api_logits_max_diff"],
                "reserve_fix_ok": r["reserve_fix_ok"],
                "mode": decide(r)[0],
            }
            out.append(row)
            if progress:
                progress(row)
        return out
    finally:
        if owned:
            m.close()


def capture_cost(model: str | Path | Model, cfg: ContextConfig | dict | None = None, *,
                 n_prompt: int = 32, n_decode: int = 256, repeats: int = 7,
                 seed: int = 0) -> dict:
    """Decode tokens/s with rows read from the API vs through `CapturedRows`.

    Same configuration, same tokens: a prompt, then ``n_decode`` single-token decodes
    (greedy), reading the step's row after every decode. Runs alternate between the two
    paths ``repeats`` times; the best run of each counts.
    """
    m, owned = _open_model(model)
    try:
        c = as_config(cfg, False)
        if n_prompt + n_decode > c.n_ctx:
            raise RuntimeInputError("n_prompt + n_decode exceed n_ctx")
        prompt = [int(x) for x in np.random.default_rng(seed).integers(0, m.n_vocab, n_prompt)]

        def one(captured: bool) -> tuple[float, float, list[int]]:
            cap = CapturedRows(m.n_embd_out) if captured else None
            mode = "captured" if captured else "api"
            with (cap.open(m, c) if cap else Context(m, c)) as ctx:
                t0 = time.perf_counter()
                for a in range(0, n_prompt, ctx.n_batch):
                    chunk = prompt[a:a + ctx.n_batch]
                    ctx.decode(chunk, range(a, a + len(chunk)),
                               logits=[False] * (len(chunk) - 1) + [True])
                    read_rows(mode, ctx, cap, len(chunk))
                t1 = time.perf_counter()
                toks = []
                tok = int(np.argmax(ctx.logits(-1)))
                for i in range(n_decode):
                    toks.append(tok)
                    ctx.decode([tok], [n_prompt + i], logits=True)
                    read_rows(mode, ctx, cap, 1)
                    tok = int(np.argmax(ctx.logits(-1)))
                t2 = time.perf_counter()
            return n_prompt / (t1 - t0), n_decode / (t2 - t1), toks

        runs = {"api": [], "captured": []}
        for _ in range(max(1, repeats)):
            runs["api"].append(one(False))
            runs["captured"].append(one(True))
        same = runs["api"][0][2] == runs["captured"][0][2]
        best = {k: (max(r[0] for r in v), max(r[1] for r in v)) for k, v in runs.items()}
        return {
            "decode_tok_s_api": best["api"][1],
            "decode_tok_s_captured": best["captured"][1],
            "decode_overhead_pct": 100.0 * (best["api"][1] / best["captured"][1] - 1.0),
            "decode_overhead_ms": 1e3 * (1.0 / best["captured"][1] - 1.0 / best["api"][1]),
            "prefill_tok_s_api": best["api"][0],
            "prefill_tok_s_captured": best["captured"][0],
            "same_tokens": same,
            "config": {"model": str(m.path), "kv_type": c.kv_type, "flash_attn": c.flash_attn,
                       "n_ctx": c.n_ctx, "n_batch": c.n_batch, "n_ubatch": c.n_ubatch,
                       "n_threads": c.n_threads, "n_prompt": n_prompt, "n_decode": n_decode,
                       "repeats": repeats, "cpu_count": os.cpu_count()},
        }
    finally:
        if owned:
            m.close()
