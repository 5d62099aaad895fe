"""Acceptance of a draft from its teacher-forced correctness on greedy text (numpy only).

On a sequence the target decoded greedily, the draft made at anchor position a is
accepted up to its first slot that differs from the sequence. While slots 0..i-1 are
right, upstream's Markov chain (prev(i) = argmax of slot i-1) feeds exactly the true
tokens, so the teacher-forced correctness ``corr[a, i]`` gives the accepted length of the
real loop exactly; the loop's anchors are a0 = prompt length, a_{j+1} = a_j + accepted + 1
(the verify step commits the accepted drafts and the target's own next token).
"""

from __future__ import annotations

import numpy as np


def leading(corr: np.ndarray) -> np.ndarray:
    """Number of leading True values along the last axis."""
    return np.cumprod(corr.astype(np.int64), -1).sum(-1)


def slot_stats(corr: np.ndarray, valid: np.ndarray) -> dict:
    """corr, valid (..., n): per slot accuracy (every anchor), acceptance conditional on the
    slots before being right, and the mean accepted length over every anchor."""
    n = corr.shape[-1]
    c = corr.reshape(-1, n) & valid.reshape(-1, n)
    v = valid.reshape(-1, n)
    full = v.all(-1)  # anchors whose whole block lies inside the text
    acc = [float(c[v[:, i], i].mean()) if v[:, i].any() else None for i in range(n)]
    lead = leading(c[full])
    cond = []
    for i in range(n):
        reach = lead >= i  # slots 0..i-1 right
        cond.append(float((lead[reach] > i).mean()) if reach.any() else None)
    return {"slot_accuracy": acc, "conditional_acceptance": cond,
            "mean_accepted_all_anchors": float(lead.mean()) if len(lead) else None,
            "anchors": int(full.sum())}


def simulate_loop(corr: np.ndarray, first: int, n_max: int) -> tuple[int, int, list[int]]:
    """One sequence: corr (T, n) correctness of the block at anchor row a (rows < first or
    past the text are ignored). Returns (verify steps, tokens committed, accepted per step).

    The step at anchor a drafts min(n_max, T-1-a) tokens (the text ends at T-1)."""
    T = corr.shape[0]
    a, steps, toks, hist = first, 0, 0, []
    while a < T - 1:
        k = min(n_max, T - 1 - a, corr.shape[1])
        acc = int(leading(corr[a, :k]))
        steps += 1
        toks += acc + 1
        hist.append(acc)
        a += acc + 1
    return steps, toks, hist


def loop_stats(corr: np.ndarray, first: int, n_max: int) -> dict:
    """corr (N, T, n) over N sequences: the greedy loop's tokens per verify step."""
    steps = toks = 0
    hist = np.zeros(n_max + 1, dtype=np.int64)
    per_seq = []
    for c in corr:
        s, t, h = simulate_loop(c, first, n_max)
        steps += s
        toks += t
        per_seq.append(t / s)
        hist += np.bincount(h, minlength=n_max + 1)[: n_max + 1]
    return {"n_max": n_max, "verify_steps": int(steps), "tokens": int(toks),
            "tokens_per_verify_step": toks / max(steps, 1),
            "accept_len_hist": hist.tolist(),
            "tokens_per_verify_step_per_sequence": per_seq}
