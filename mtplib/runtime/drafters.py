"""Drafting strategies behind one small interface (as in llama.cpp common/speculative.cpp).

The speculative loop calls, per sequence:
  ``prefill(seq, tokens, rows)``   after the target prefilled ``tokens`` (rows: its h_nextn)
  ``propose(seq, last, base, k)``  -> up to k draft tokens for positions base+1..base+k,
                                    where ``last`` sits at ``base`` and is not yet decoded
  ``commit(seq, base, tokens, rows)`` the target accepted ``tokens`` at base.. and these are
                                    its rows for them (rows[i] = h after tokens[i])
  ``truncate(seq, keep, last_row)`` tokens at positions >= keep are gone
Only `MTPDrafter` touches a model; the others exist to prove the accounting exact.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import numpy as np

from mtplib.runtime.model import Context, RuntimeInputError


class Drafter:
    name = "none"
    needs_rows = False

    def prefill(self, seq: int, tokens: Sequence[int], rows: np.ndarray | None) -> None:
        pass

    def propose(self, seq: int, last: int, base: int, k: int) -> list[int]:
        return []

    def commit(self, seq: int, base: int, tokens: Sequence[int], rows: np.ndarray | None) -> None:
        pass

    def truncate(self, seq: int, keep: int, last_row: np.ndarray | None) -> None:
        pass


class MTPDrafter(Drafter):
    """DeepSeek-V4's MTP block in its own context (upstream's loop, reference §7).

    The MTP entry at position p pairs token x_p with the target's h_{p-1}. The MTP cache
    only ever holds committed positions: drafts chained through the MTP's own rows are
    removed right after drafting, and the committed ones are fed again with the target's
    rows once verified.
    """

    name = "mtp"
    needs_rows = True

    def __init__(self, ctx: Context) -> None:
        if not ctx.cfg.mtp or ctx.cfg.nextn_rows == "off":
            raise RuntimeInputError("MTPDrafter needs an MTP context with nextn rows on")
        self.ctx = ctx
        self.pending: dict[int, np.ndarray] = {}  # seq -> h_{n_fed-1}
        self.n_fed: dict[int, int] = {}  # seq -> next MTP position to feed
        self.t_feed = 0.0
        self.t_draft = 0.0

    def _feed(self, seq: int, tokens: Sequence[int], positions: Sequence[int],
              rows: np.ndarray) -> None:
        for a in range(0, len(tokens), self.ctx.n_batch):
            b = a + self.ctx.n_batch
            self.ctx.decode(tokens[a:b], positions[a:b], seq_id=seq, rows=rows[a:b])

    def prefill(self, seq: int, tokens: Sequence[int], rows: np.ndarray | None) -> None:
        assert rows is not None and len(rows) == len(tokens)
        t0 = time.perf_counter()
        self.ctx.seq_rm(seq, 0, -1)
        n = len(tokens)
        if n > 1:  # entry p = (x_p, h_{p-1}) for p = 1..n-1
            self._feed(seq, list(tokens[1:]), list(range(1, n)), rows[: n - 1])
        self.pending[seq] = rows[n - 1].copy()
        self.n_fed[seq] = n
        self.t_feed += time.perf_counter() - t0

    def propose(self, seq: int, last: int, base: int, k: int) -> list[int]:
        if k <= 0:
            return []
        t0 = time.perf_counter()
        if self.n_fed[seq] != base:
            raise RuntimeInputError(f"MTP seq {seq} fed up to {self.n_fed[seq]}, draft at {base}")
        drafts: list[int] = []
        tok, row = last, self.pending[seq]
        for i in range(k):
            self.ctx.decode([tok], [base + i], seq_id=seq, logits=True, rows=row[None, :])
            tok = int(np.argmax(self.ctx.logits(-1)))
            drafts.append(tok)
            if i + 1 < k:
                row = self.ctx.nextn_rows(1)[0]
        # entry `base` = (last, h_{base-1}) is committed data: keep it; drop the chain
        self.ctx.seq_rm(seq, base + 1, -1)
        self.n_fed[seq] = base + 1
        self.t_draft += time.perf_counter() - t0
        return drafts

    def commit(self, seq: int, base: int, tokens: Sequence[int], rows: np.ndarray | None) -> None:
        assert rows is not None and len(rows) == len(tokens)
        t0 = time.perf_counter()
        start = self.n_fed[seq]  # base (plain step) or base+1 (after a draft)
        positions = list(range(start, base + len(tokens)))
        if positions:
            prev = [self.pending[seq] if p == base else rows[p - base - 1] for p in positions]
            self._feed(seq, [tokens[p - base] for p in positions], positions, np.stack(prev))
        self.pending[seq] = rows[-1].copy()
        self.n_fed[seq] = base + len(tokens)
        self.t_feed += time.perf_counter() - t0

    def truncate(self, seq: int, keep: int, last_row: np.ndarray | None) -> None:
        # keep-1 is the new undecoded last token: its entry needs h_{keep-2} = last_row
        self.ctx.seq_rm(seq, keep - 1, -1)
        self.n_fed[seq] = keep - 1
        if last_row is not None:
            self.pending[seq] = last_row.copy()


class OracleDrafter(Drafter):
    """Proposes a known continuation (e.g. the MTP-off output): forced accept."""

    name = "oracle"

    def __init__(self, reference: Sequence[int], n_prompt: int, *, wrong: bool = False,
                 n_vocab: int | None = None) -> None:
        self.ref = list(reference)
        self.n_prompt = n_prompt
        self.wrong = wrong  # forced reject: always a token the target will not pick
        self.n_vocab = n_vocab

    def propose(self, seq: int, last: int, base: int, k: int) -> list[int]:
        out = []
        for p in range(base + 1, base + 1 + k):
            i = p - self.n_prompt
            t = self.ref[i] if 0 <= i < len(self.ref) else 0
            out.append((t + 1) % self.n_vocab if self.wrong else t)
        return out


class SyntheticDrafter(OracleDrafter):
    """Mixes the target's own continuation with wrong tokens at set per-position rates.

    ``rates[i]`` is the probability that draft position i is the right token, drawn
    independently per position (upstream's `--spec-synth-rates`: unconditional
    per-position probabilities). Output quality under it is meaningless by design.
    """

    name = "synthetic"

    def __init__(self, reference: Sequence[int], n_prompt: int, rates: Sequence[float],
                 n_vocab: int, seed: int = 0) -> None:
        super().__init__(reference, n_prompt, n_vocab=n_vocab)
        if not rates or any(not 0.0 <= r <= 1.0 for r in rates):
            raise ValueError(f"synthetic rates must be in [0, 1], got {list(rates)}")
        self.rates = list(rates)
        self.rng = np.random.default_rng(seed)

    def propose(self, seq: int, last: int, base: int, k: int) -> list[int]:
        right = super().propose(seq, last, base, k)
        rates = self.rates + [self.rates[-1]] * k
        return [t if self.rng.random() < rates[i] else (t + 1) % self.n_vocab
                for i, t in enumerate(right)]
