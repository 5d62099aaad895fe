"""Drafting strategies behind one small interface (as in llama.cpp common/speculative.cpp).

The speculative loop calls, per sequence:
  ``prefill(seq, tokens, rows)``   after the target prefilled ``tokens`` (rows: its h_nextn)
  ``propose(seq, last, base, k)``  -> up to k draft tokens for positions base+1..base+k,
                                    where ``last`` sits at ``base`` and is not yet decoded
  ``commit(seq, base, tokens, rows)`` the target accepted ``tokens`` at base.. and these are
                                    its rows for them (rows[i] = h after tokens[i])
  ``truncate(seq, keep, last_row)`` tokens at positions >= keep are gone
and, for several sequences at once (a batch step; the default loops over the one-sequence
calls): ``propose_many([(seq, last, base, k), ...])`` and ``commit_many([(seq, base,
tokens, rows), ...])``.
`MTPDrafter` and `mtplib.runtime.dspark.drafter.DSparkDrafter` touch a model; the others
exist to prove the accounting exact.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from mtplib.errors import InputError
from mtplib.runtime.model import Context, RuntimeInputError


class Drafter:
    name = "none"
    needs_rows = False
    #: decode no single token alone (`BatchRun` sets it): upstream's CPU kernels give a
    #: one-token decode other floats (about 2e-6 on the MTP block) than a decode of two or
    #: more, while a token's floats in any decode of two or more are the same whatever its
    #: neighbours; padded, a sequence drafts the same alone as beside others
    pad_single = False
    #: where the rows of `needs_rows` come from: None = the target's h_nextn (MTP); else a
    #: ``rows(target_ctx, n)`` the engine reads after every target decode instead (DSpark:
    #: the target's layer-input features, `mtplib.runtime.dspark.context.TargetFeatures.rows`)
    target_rows: Callable[[Context, int], np.ndarray] | None = None
    #: `propose` may return fewer than k drafts (DSpark's confidence cut); none is a plain
    #: step. Others must return exactly k.
    may_stop_early = False

    def prefill(self, seq: int, tokens: Sequence[int], rows: np.ndarray | None) -> None:
        pass

    def propose(self, seq: int, last: int, base: int, k: int) -> list[int]:
        return []

    def commit(self, seq: int, base: int, tokens: Sequence[int], rows: np.ndarray | None) -> None:
        pass

    def truncate(self, seq: int, keep: int, last_row: np.ndarray | None) -> None:
        pass

    def propose_many(self, asks: Sequence[tuple[int, int, int, int]]) -> list[list[int]]:
        """`propose` for each (seq, last, base, k), in order."""
        return [self.propose(*a) for a in asks]

    def commit_many(self, feeds: Sequence[tuple]) -> None:
        """`commit` for each (seq, base, tokens, rows), in order."""
        for f in feeds:
            self.commit(*f)


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

    def _feed(self, seq: int, tokens: Sequence[int], positions: Sequence[int],
              rows: np.ndarray) -> None:
        for a in range(0, len(tokens), self.ctx.n_batch):
            b = a + self.ctx.n_batch
            self.ctx.decode(tokens[a:b], positions[a:b], seq_id=seq, rows=rows[a:b])

    def prefill(self, seq: int, tokens: Sequence[int], rows: np.ndarray | None) -> None:
        assert rows is not None and len(rows) == len(tokens)
        self.ctx.seq_rm(seq, 0, -1)
        n = len(tokens)
        if n > 1:  # entry p = (x_p, h_{p-1}) for p = 1..n-1
            self._feed(seq, list(tokens[1:]), list(range(1, n)), rows[: n - 1])
        self.pending[seq] = rows[n - 1].copy()
        self.n_fed[seq] = n

    def propose(self, seq: int, last: int, base: int, k: int) -> list[int]:
        if k <= 0:
            return []
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
        return drafts

    def commit(self, seq: int, base: int, tokens: Sequence[int], rows: np.ndarray | None) -> None:
        self.commit_many([(seq, base, tokens, rows)])

    def propose_many(self, asks: Sequence[tuple[int, int, int, int]]) -> list[list[int]]:
        """Every sequence's chain in one MTP decode per draft depth: depth i decodes one
        token of each sequence still drafting (k > i), as `propose` would alone."""
        out: list[list[int]] = [[] for _ in asks]
        cur: dict[int, tuple[int, np.ndarray]] = {}
        for j, (seq, last, base, k) in enumerate(asks):
            if k > 0 and self.n_fed[seq] != base:
                raise RuntimeInputError(f"MTP seq {seq} fed up to {self.n_fed[seq]}, draft at "
                                        f"{base}")
            cur[j] = (last, self.pending[seq])
        depth = max((a[3] for a in asks), default=0)
        for i in range(depth):
            live = [j for j, a in enumerate(asks) if a[3] > i]
            self._decode([cur[j][0] for j in live], [asks[j][2] + i for j in live],
                         [asks[j][0] for j in live], np.stack([cur[j][1] for j in live]),
                         logits=True)
            toks = np.argmax(self.ctx.logits_all(self.ctx.last_decode_len)[:len(live)],
                             axis=1)
            more = [n for n, j in enumerate(live) if i + 1 < asks[j][3]]
            nxt = self.ctx.nextn_rows(len(live)) if more else None
            for n, j in enumerate(live):
                out[j].append(int(toks[n]))
                if nxt is not None and i + 1 < asks[j][3]:
                    cur[j] = (int(toks[n]), nxt[n])
        for seq, _last, base, k in asks:
            if k > 0:  # entry `base` = (last, h_{base-1}) is committed data: drop the chain
                self.ctx.seq_rm(seq, base + 1, -1)
                self.n_fed[seq] = base + 1
        return out

    def commit_many(self, feeds: Sequence[tuple]) -> None:
        """Feed every sequence's accepted entries in one MTP decode (chunked by n_batch)."""
        toks: list[int] = []
        poss: list[int] = []
        seqs: list[int] = []
        prevs: list[np.ndarray] = []
        for seq, base, tokens, rows in feeds:
            assert rows is not None and len(rows) == len(tokens)
            start = self.n_fed[seq]  # base (plain step) or base+1 (after a draft)
            for p in range(start, base + len(tokens)):
                toks.append(tokens[p - base])
                poss.append(p)
                seqs.append(seq)
                prevs.append(self.pending[seq] if p == base else rows[p - base - 1])
        if toks:
            rows_in = np.stack(prevs)
            for a in range(0, len(toks), self.ctx.n_batch):
                b = a + self.ctx.n_batch
                self._decode(toks[a:b], poss[a:b], seqs[a:b], rows_in[a:b])
        for seq, base, tokens, rows in feeds:
            self.pending[seq] = rows[-1].copy()
            self.n_fed[seq] = base + len(tokens)

    def _decode(self, toks: list[int], poss: list[int], seqs: list[int], rows: np.ndarray,
                logits: bool = False) -> None:
        """One MTP decode of several sequences' tokens; with ``pad_single`` a lone token
        goes with a copy of itself one position on, removed again at once (the MTP cache
        keeps committed positions only), where the context has room for it."""
        if self.pad_single and len(toks) == 1 and poss[0] + 1 < self.ctx.n_ctx:
            self.ctx.decode([toks[0]] * 2, [poss[0], poss[0] + 1], seq_id=seqs * 2,
                            logits=logits, rows=np.concatenate([rows, rows]))
            self.ctx.seq_rm(seqs[0], poss[0] + 1, -1)
            return
        self.ctx.decode(toks, poss, seq_id=seqs, logits=logits, rows=rows)

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
    """Synthetic acceptance with upstream's `--spec-synth-rates P0,P1,...` semantics.

    Upstream (common/speculative.cpp `common_speculative_synth_rates_resolve`, tools/server
    `server_sample_and_accept_synth`): ``rates[i]`` is the *unconditional* probability that
    draft position i is accepted, i.e. that at least i+1 drafts are accepted; the rates
    must be in [0, 1] and non-increasing. Each verify step walks the draft in order and
    accepts position i with the conditional probability ``rates[i] / rates[i-1]`` (1 for
    i = 0; 0 after a zero rate), one uniform draw per position from a `std::mt19937`
    seeded with the request seed, stopping at the first rejection, where the target's own
    token is emitted. The draft tokens themselves are the drafter's (upstream: the MTP
    block's), accepted or not regardless of what the target would pick, so the output is
    not valid and is never used for quality numbers (runs carry ``synthetic: true,
    quality_valid: false``).

    Here: the draws are bit-identical to upstream's for the same seed (mt19937 +
    libstdc++'s ``uniform_real_distribution<double>``), so the same seed gives the same
    acceptance pattern. ``rates`` shorter than k is extended with its last value (upstream
    requires exactly n_max values). With ``inner`` (e.g. the MTPDrafter) the drafts are
    the inner drafter's, which is fed and drafts every step as upstream's does, and the
    engine takes the acceptance from `accept_len` (upstream's semantics exactly). Without
    ``inner`` the drafts are the target's own continuation (``reference``, the MTP-off
    output) up to the drawn length and a wrong token at it, so that plain matching in the
    engine accepts exactly the drawn length (no drafting cost).
    """

    name = "synthetic"
    synthetic = True

    def __init__(self, reference: Sequence[int], n_prompt: int, rates: Sequence[float],
                 n_vocab: int, seed: int = 0, *, inner: Drafter | None = None) -> None:
        super().__init__(reference, n_prompt, n_vocab=n_vocab)
        rates = [float(r) for r in rates]
        if not rates or any(not 0.0 <= r <= 1.0 for r in rates):
            raise InputError(f"synthetic rates must be in [0, 1], got {rates}")
        if any(b > a for a, b in zip(rates, rates[1:], strict=False)):
            raise InputError(f"synthetic rates must be non-increasing (unconditional "
                             f"per-position probabilities), got {rates}")
        self.rates = rates
        self.seed = int(seed) & 0xFFFFFFFF
        self.inner = inner
        self.needs_rows = bool(inner and inner.needs_rows)
        if inner is not None:
            self.name = f"synthetic+{inner.name}"
        self._mt = np.random.MT19937()
        self._mt._legacy_seeding(self.seed)  # = std::mt19937::seed(seed) (init_genrand)
        self.last_accept_len: int | None = None

    def conditional(self, k: int) -> list[float]:
        """Per-position conditional acceptance probabilities for a draft of k tokens."""
        rates = (self.rates + [self.rates[-1]] * k)[:k]
        out, prev = [], 1.0
        for r in rates:
            out.append(r / prev if prev > 0.0 else 0.0)
            prev = r
        return out

    def _uniform(self) -> float:
        """libstdc++ uniform_real_distribution<double>(0, 1) over mt19937: two draws."""
        lo, hi = (int(x) for x in self._mt.random_raw(2))
        u = (lo + hi * 2**32) / 2**64
        return u if u < 1.0 else float(np.nextafter(1.0, 0.0))

    def draw_accept_len(self, k: int) -> int:
        n = 0
        for c in self.conditional(k):
            if not self._uniform() < c:
                break
            n += 1
        return n

    def prefill(self, seq, tokens, rows) -> None:
        if self.inner is not None:
            self.inner.prefill(seq, tokens, rows)

    def propose(self, seq: int, last: int, base: int, k: int) -> list[int]:
        if k <= 0:
            return []
        n = self.last_accept_len = self.draw_accept_len(k)
        if self.inner is not None:
            return self.inner.propose(seq, last, base, k)
        right = super().propose(seq, last, base, k)
        return [t if i < n else (t + 1) % self.n_vocab for i, t in enumerate(right)]

    def accept_len(self, picks: Sequence[int], drafts: Sequence[int]) -> int:
        """The engine's acceptance for the last proposal: the drawn length (upstream)."""
        n = self.last_accept_len
        self.last_accept_len = None
        if n is None:
            raise RuntimeInputError("accept_len without a synthetic proposal")
        return min(n, len(drafts))

    def commit(self, seq, base, tokens, rows) -> None:
        if self.inner is not None:
            self.inner.commit(seq, base, tokens, rows)

    def truncate(self, seq, keep, last_row) -> None:
        if self.inner is not None:
            self.inner.truncate(seq, keep, last_row)
