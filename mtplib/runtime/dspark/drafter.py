"""DSpark drafting behind the `Drafter` interface (upstream's loop: common/speculative.cpp,
``common_speculative_impl_draft_dflash`` with type DSPARK, reimplemented in Python).

Per sequence the draft cache holds the committed positions only: after every target
decode the engine hands over the target's layer-input features of the tokens it
committed (`TargetFeatures.rows`), and these are injected as one embd batch at their
positions. Upstream injects all k+1 verified rows and removes the rejected ones with
``seq_rm``; here rejected rows are never injected (the cache ends the same). A draft is
one pass over a block ``[last, mask x (k-1)]`` at positions base..base+k-1 (anchor-first,
non-causal inside the block): slot i's top-1 is the draft for base+i+1, and with ``p_min``
> 0 the draft stops at the first slot whose confidence is below it. The block's K is
removed right after. Several sequences draft in one pass: one sequence per block, blocks
of equal size (sequences are grouped by their k), at most n_ubatch tokens per pass.

Single tokens (`pad_single`, set by a batch): a lone committed row is injected with a copy
of itself one position on, removed at once (as `MTPDrafter` feeds), so a sequence's draft
cache holds the same floats alone as beside others. A block is not padded: k = 1 is a
one-token block as upstream decodes it (a padded block would change the draft, since the
block attends non-causally); a k >= 2 block is never a lone token.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence

import numpy as np

from mtplib.runtime.drafters import Drafter
from mtplib.runtime.dspark.context import DSparkContext, TargetFeatures
from mtplib.runtime.model import RuntimeInputError


def check_p_min(p_min: object, *, has_confidence_head: bool = True) -> float:
    """``p_min`` as a float in [0, 1] (llama.cpp's --spec-draft-p-min); > 0 needs the
    draft's confidence head (speculative.cpp:997-1005 refuses the same)."""
    try:
        p = float(p_min)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise RuntimeInputError(f"--draft-p-min must be a number in [0, 1], got {p_min!r}"
                                ) from None
    if isinstance(p_min, bool) or not (math.isfinite(p) and 0.0 <= p <= 1.0):
        raise RuntimeInputError(f"--draft-p-min must be in [0, 1], got {p_min!r}")
    if p > 0 and not has_confidence_head:
        raise RuntimeInputError("this DSpark draft has no confidence head: give "
                                "--draft-p-min 0")
    return p


class DSparkDrafter(Drafter):
    """A V4 DSpark draft in its own context next to the target's (module doc)."""

    name = "dspark"
    needs_rows = True
    may_stop_early = True  # the confidence head may stop a draft before k

    def __init__(self, ctx: DSparkContext, features: TargetFeatures, *,
                 p_min: float = 0.0) -> None:
        cfg = ctx.model.config
        self.ctx, self.features = ctx, features
        self.p_min = check_p_min(p_min, has_confidence_head=cfg.confidence_head)
        self.block_size = cfg.block_size
        self.mask = cfg.mask_token_id
        if features.width != ctx.width:
            raise RuntimeInputError(f"target features are {features.width} floats wide, the "
                                    f"draft's fc reads {ctx.width}")
        #: the engine reads these after every target decode, in place of h_nextn rows
        self.target_rows = features.rows
        self.n_fed: dict[int, int] = {}  # seq -> positions [0, n_fed) are injected
        #: blocks decoded, block passes (several blocks each in a batch), drafts proposed,
        #: drafts cut by the confidence head
        self.counts: Counter = Counter()
        #: each sequence's last block's confidences (p_min > 0 only), for inspection
        self.last_confidences: dict[int, list[float]] = {}

    # -- injection -----------------------------------------------------------------------
    def _inject(self, feeds: Sequence[tuple[int, int, np.ndarray]]) -> None:
        """Inject (seq, first position, rows) for several sequences, packed in order into
        decodes of at most n_ubatch rows."""
        rows, pos, seqs = [], [], []
        for seq, start, r in feeds:
            for i in range(len(r)):
                rows.append(r[i])
                pos.append(start + i)
                seqs.append(seq)
        step = self.ctx.n_ubatch
        for a in range(0, len(rows), step):
            b = min(a + step, len(rows))
            chunk = np.stack(rows[a:b])
            if self.pad_single and b - a == 1 and pos[a] + 1 < self.ctx.n_ctx:
                self.ctx.inject(np.concatenate([chunk, chunk]), [pos[a], pos[a] + 1],
                                [seqs[a]] * 2)
                self.ctx.seq_rm(seqs[a], pos[a] + 1, -1)
                continue
            self.ctx.inject(chunk, pos[a:b], seqs[a:b])

    def prefill(self, seq: int, tokens: Sequence[int], rows: np.ndarray | None) -> None:
        if rows is None or len(rows) != len(tokens):
            raise RuntimeInputError("DSpark prefill needs one feature row per prompt token")
        self.ctx.seq_rm(seq, 0, -1)
        self._inject([(seq, 0, rows)])
        self.n_fed[seq] = len(tokens)

    def commit(self, seq: int, base: int, tokens: Sequence[int], rows: np.ndarray | None) -> None:
        self.commit_many([(seq, base, tokens, rows)])

    def commit_many(self, feeds: Sequence[tuple]) -> None:
        """Inject every sequence's committed rows (positions base..) in shared decodes."""
        todo = []
        for seq, base, tokens, rows in feeds:
            if rows is None or len(rows) != len(tokens):
                raise RuntimeInputError("DSpark commit needs one feature row per token")
            if self.n_fed.get(seq) != base:
                raise RuntimeInputError(f"DSpark seq {seq} injected up to "
                                        f"{self.n_fed.get(seq)}, commit at {base}")
            todo.append((seq, base, rows))
        self._inject(todo)
        for seq, base, tokens, _ in feeds:
            self.n_fed[seq] = base + len(tokens)

    def truncate(self, seq: int, keep: int, last_row: np.ndarray | None) -> None:
        # token keep-1 becomes the undecoded last one: the cache keeps positions < keep-1
        self.ctx.seq_rm(seq, max(keep - 1, 0), -1)
        self.n_fed[seq] = max(keep - 1, 0)

    # -- drafting ------------------------------------------------------------------------
    def propose(self, seq: int, last: int, base: int, k: int) -> list[int]:
        return self.propose_many([(seq, last, base, k)])[0]

    def propose_many(self, asks: Sequence[tuple[int, int, int, int]]) -> list[list[int]]:
        """Each (seq, last, base, k)'s drafts: up to k tokens for base+1..base+k."""
        out: list[list[int]] = [[] for _ in asks]
        by_k: dict[int, list[int]] = {}
        for j, (seq, _last, base, k) in enumerate(asks):
            if k <= 0:
                continue
            if k > self.block_size:  # past it upstream skips the Markov head silently
                raise RuntimeInputError(f"DSpark drafts at most its block size "
                                        f"{self.block_size}, asked {k}")
            if self.n_fed.get(seq) != base:
                raise RuntimeInputError(f"DSpark seq {seq} injected up to "
                                        f"{self.n_fed.get(seq)}, draft at {base}")
            by_k.setdefault(k, []).append(j)
        for k, members in sorted(by_k.items()):
            per = max(1, self.ctx.n_ubatch // k)
            for a in range(0, len(members), per):
                self._blocks(asks, members[a:a + per], k, out)
        return out

    def _blocks(self, asks, members: list[int], k: int, out: list[list[int]]) -> None:
        """One pass over equal blocks of ``k`` tokens, one per member sequence."""
        toks, pos, seqs = [], [], []
        for j in members:
            seq, last, base, _ = asks[j]
            toks += [last] + [self.mask] * (k - 1)
            pos += range(base, base + k)
            seqs += [seq] * k
        n = len(toks)
        try:
            self.ctx.block(toks, pos, seqs, len(members))
            picks = np.argmax(self.ctx.logits_all(n), axis=1)
            conf = self.ctx.confidences(n) if self.p_min > 0 else None
        finally:  # the block's K is noise: the cache keeps committed positions only
            for j in members:
                self.ctx.seq_rm(asks[j][0], asks[j][2], -1)
        self.counts["blocks"] += len(members)
        self.counts["passes"] += 1
        for m, j in enumerate(members):
            drafts = [int(t) for t in picks[m * k:(m + 1) * k]]
            if conf is not None:
                c = [float(x) for x in conf[m * k:(m + 1) * k]]
                self.last_confidences[asks[j][0]] = c
                cut = next((i for i, x in enumerate(c) if x < self.p_min), k)
                self.counts["cut"] += k - cut
                drafts = drafts[:cut]
            self.counts["drafted"] += len(drafts)
            out[j] = drafts
