"""`MTPDraftModel`: DeepSeek-V4's MTP block as a llama-cpp-python draft model.

`llama_cpp.Llama` speculates through ``draft_model(input_ids) -> draft ids``: after it
sampled a token it calls the draft model with every token so far (the last one sampled but
not yet decoded), decodes [last, drafts...] in one batch, keeps the drafts while its own
samples equal them and removes the rest of its KV tail. The MTP block needs more than token
ids: the trunk's `h_nextn` row of every decoded position. So the draft model also taps the
Llama's context: after each target decode it records that decode's rows by position, from
the source `mtplib.runtime.row_source.choose_row_source` proved right for the context's
configuration (`mtp_llama` wires this up). Drafting itself is mtplib's `MTPDrafter`
(upstream's loop, reference §7); this module only keeps the MTP context in step with what
the Llama kept, by diffing the ids it is called with against what was fed.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from mtplib.contract.types import DEFAULT_DRAFT, DRAFT_BOUNDS, DRAFT_RANGE
from mtplib.errors import InputError
from mtplib.model.gguf_header import GGUFHeader
from mtplib.runtime import choose_upstream
from mtplib.runtime.drafters import MTPDrafter
from mtplib.runtime.lib import UpstreamError
from mtplib.runtime.model import Context, ContextConfig, Model
from mtplib.runtime.row_source import RowSourceDecision
from mtplib.runtime.rows import CapturedRows, read_rows
from mtplib.runtime.spec_metrics import DraftCounts

# MTPDraftModel subclasses llama_cpp's class, so this module imports llama_cpp itself: the
# build is chosen first, explicitly (the adapter's import is the one that loads upstream)
choose_upstream()
from llama_cpp.llama_speculative import LlamaDraftModel  # noqa: E402

#: Draft lengths `mtp_llama` accepts: the contract's recipes (mtp.v4.draft1..8)
K_RANGE = DRAFT_RANGE
_SEQ = 0  # llama_cpp.Llama decodes one sequence, id 0
_EMPTY = np.zeros(0, dtype=np.intc)


@dataclass
class DraftStats(DraftCounts):
    """What the MTP block proposed and what the Llama kept.

    A proposal counts once its verification is seen: the next call of the draft model
    follows exactly one target decode of [last, drafts...] at the drafted positions. Drafts
    whose outcome never came (the completion stopped first) count as ``unresolved``.
    """

    hidden_rows: str = "off"
    proposals: int = 0
    unresolved: int = 0
    skipped: Counter = field(default_factory=Counter)  # reason -> calls that drafted nothing
    t_draft: float = 0.0

    def to_dict(self) -> dict:
        return {
            "k": self.k, "hidden_rows": self.hidden_rows, "proposals": self.proposals,
            **self.counts_dict(),
            "unresolved": self.unresolved, "skipped": dict(self.skipped),
            "time_s": {"draft": self.t_draft},
        }


class _ApiRows:
    """`read_rows`' "api" source over a llama_cpp context: upstream's
    `llama_get_embeddings_nextn`, one row per token of the last decode (unmasked)."""

    def __init__(self, ext: Any, ctx: Any, width: int) -> None:
        self.ext, self.ctx, self.width = ext, ctx, width

    def nextn_rows(self, n: int) -> np.ndarray:
        p = self.ext.llama_get_embeddings_nextn(self.ctx)
        if not p:
            raise UpstreamError("upstream returned no nextn rows (context without them?)")
        return np.ctypeslib.as_array(p, shape=(n * self.width,)).reshape(n, self.width).copy()


class MTPDraftModel(LlamaDraftModel):
    """Drafts up to ``k`` tokens with the MTP block of an `mtp-` sidecar.

    Build it through `mtplib.llama.mtp_llama`, which also creates the Llama's context the
    way MTP needs it (``n_rs_seq >= k``, nextn rows on) and connects the row tap. A bare
    ``Llama(draft_model=MTPDraftModel(...))`` has no trunk rows to draft from and is
    refused on its first call.
    """

    def __init__(self, sidecar: str | Path, k: int = DEFAULT_DRAFT, *,
                 header: GGUFHeader | None = None) -> None:
        if isinstance(k, bool) or not isinstance(k, int) or k not in K_RANGE:
            raise InputError(f"draft length must be an integer in {DRAFT_BOUNDS}, got {k!r}")
        self.k = k
        self.stats = DraftStats(k)
        self.sidecar = Model(sidecar, load_mtp=True, header=header)
        self.ctx: Context | None = None
        self.drafter: MTPDrafter | None = None
        self.row_source: RowSourceDecision | None = None
        self._llm: Any = None
        self._read = None  # n -> the last target decode's rows
        self._capture: CapturedRows | None = None
        # the trunk's rows by position, and the token decoded there (-1: none yet)
        self._rows = np.zeros((0, self.sidecar.n_embd_out), dtype=np.float32)
        self._tok = np.zeros(0, dtype=np.int64)
        self._fed: list[int] = []  # the ids the MTP context stands for (positions 0..)
        self._proposal: tuple[int, list[int]] | None = None  # (base, [last, *drafts])
        self._since: list[tuple[int, list[int]]] = []  # target decodes since: (pos0, ids)
        #: set to a list to log every verified proposal as the runtime's trace does:
        #: {"pos": base, "drafts": [...], "accepted": n}
        self.trace: list[dict] | None = None

    # -- wiring (mtp_llama) ---------------------------------------------------------------
    def attach(self, llm: Any, target: ContextConfig, decision: RowSourceDecision,
               capture: CapturedRows | None) -> None:
        """Bind to ``llm``, whose context decodes with ``target`` and calls `record` after
        every decode; ``decision`` says where its rows come from."""
        if decision.mode not in ("api", "captured"):
            raise InputError(f"no MTP from row source {decision.mode!r}: {decision.reason}")
        if (decision.mode == "captured") != (capture is not None):
            raise InputError("row source 'captured' needs the context's CapturedRows")
        if target.n_rs_seq < self.k:
            raise InputError(f"the target's n_rs_seq {target.n_rs_seq} < draft length {self.k}")
        if self.k + 1 > target.n_batch:
            raise InputError(f"draft length {self.k} + 1 exceeds the Llama's n_batch "
                             f"{target.n_batch}: the verify batch must be one decode")
        # as mtplib's runtime builds it: masked rows (the MTP graph outputs only those)
        cfg = ContextConfig(n_ctx=target.n_ctx, n_batch=target.n_batch,
                            n_ubatch=target.n_ubatch, n_seq_max=1, n_threads=target.n_threads,
                            kv_type=target.kv_type, flash_attn=target.flash_attn,
                            swa_full=target.swa_full, mtp=True, nextn_rows="masked")
        self.ctx = Context(self.sidecar, cfg)
        self.drafter = MTPDrafter(self.ctx)
        self.row_source, self._capture = decision, capture
        self.stats.hidden_rows = decision.mode
        width = self.sidecar.n_embd_out
        if capture is not None:
            self._read = lambda n: read_rows("captured", None, capture, n)
        else:
            api = _ApiRows(self.sidecar.ext, llm.ctx, width)
            self._read = lambda n: read_rows("api", api, None, n)
        cap = int(llm.n_ctx())  # upstream pads n_ctx (to 256): positions go up to it
        self._rows = np.zeros((cap, width), dtype=np.float32)
        self._tok = np.full(cap, -1, dtype=np.int64)
        self._llm = llm

    def close(self) -> None:
        if self.ctx is not None:
            self.ctx.close()
            self.ctx = None
        self.sidecar.close()
        self._llm = None

    # -- the tap: after every target decode -----------------------------------------------
    def record(self, n: int, tokens: Sequence[int], positions: Sequence[int]) -> None:
        """Store the rows of the target decode that just ran (``n`` tokens)."""
        rows = self._read(n)
        pos = np.asarray(positions[:n], dtype=np.int64)
        if pos.size and (pos.min() < 0 or pos.max() >= len(self._tok)):
            raise InputError(f"target positions {pos.min()}..{pos.max()} outside the "
                             f"context of {len(self._tok)}")
        self._rows[pos] = rows
        self._tok[pos] = np.asarray(tokens[:n], dtype=np.int64)
        if self._proposal is not None:
            self._since.append((int(pos[0]), [int(t) for t in tokens[:n]]))

    def record_failed(self) -> None:
        """A target decode failed: what the capture holds of it is not a decode's rows."""
        if self._capture is not None:
            self._capture.reset()

    # -- LlamaDraftModel --------------------------------------------------------------------
    def __call__(self, input_ids: npt.NDArray[np.intc], /, **kwargs: Any
                 ) -> npt.NDArray[np.intc]:
        if self._llm is None or self.drafter is None:
            raise InputError("MTPDraftModel is not attached to a Llama: build the Llama with "
                             "mtplib.llama.mtp_llama(trunk, sidecar, draft=K)")
        t0 = time.perf_counter()
        try:
            return self._draft(np.asarray(input_ids, dtype=np.int64))
        finally:
            self.stats.t_draft += time.perf_counter() - t0

    def _skip(self, why: str) -> npt.NDArray[np.intc]:
        self.stats.skipped[why] += 1
        return _EMPTY

    def _draft(self, ids: np.ndarray) -> npt.NDArray[np.intc]:
        n_c = int(self._llm.n_tokens)  # the Llama's KV holds ids[:n_c]
        self._resolve(ids, n_c)
        if n_c < 1 or len(ids) != n_c + 1:
            # more than one undecoded token (generate().send(...)): no row for its parent
            return self._skip("not one pending token")
        # the MTP context holds positions base..base+k-1 while drafting; the Llama drops
        # drafts beyond its context anyway
        k = min(self.k, int(self._llm.n_ctx()) - len(ids))
        if k < 1:
            return self._skip("context full")
        head = ids[:n_c]
        fed = np.asarray(self._fed[:n_c], dtype=np.int64)
        diff = np.flatnonzero(fed != head[: len(fed)])
        m = int(diff[0]) if diff.size else len(fed)  # MTP entries 1..m-1 still hold
        lo = max(m - 1, 0)  # rows needed: h_{lo} .. h_{n_c-1}
        if not np.array_equal(self._tok[lo:n_c], head[lo:]):
            # the tap has no row for a position the Llama holds (e.g. a loaded state)
            self._reset_mtp()
            return self._skip("no trunk rows")
        d = self.drafter
        if m == 0:
            d.prefill(_SEQ, head.tolist(), self._rows[:n_c])
        else:
            if m < d.n_fed[_SEQ]:
                d.truncate(_SEQ, m + 1, None)  # entries >= m go
            d.commit(_SEQ, m - 1, head[m - 1:].tolist(), self._rows[m - 1:n_c])
        drafts = d.propose(_SEQ, int(ids[n_c]), n_c, k)
        self._fed = ids[: n_c + 1].tolist()
        self._proposal = (n_c, [int(ids[n_c]), *drafts])
        self._since = []
        self.stats.proposals += 1
        return np.asarray(drafts, dtype=np.intc)

    def _resolve(self, ids: np.ndarray, n_c: int) -> None:
        """Count the last proposal's outcome if the Llama verified it since."""
        if self._proposal is None:
            return
        base, batch = self._proposal
        drafts = batch[1:]
        self._proposal, since, self._since = None, self._since, []
        n_acc = n_c - base - 1
        verified = (len(since) == 1 and since[0] == (base, batch)
                    and 0 <= n_acc <= len(drafts) and len(ids) > n_c
                    and ids[base + 1:n_c].tolist() == drafts[:n_acc])
        if not verified:
            self.stats.unresolved += len(drafts)
            return
        self.stats.count(len(drafts), n_acc)
        if self.trace is not None:
            self.trace.append({"pos": base, "drafts": list(drafts), "accepted": n_acc})

    def _reset_mtp(self) -> None:
        if self.ctx is not None:
            self.ctx.seq_rm(_SEQ, 0, -1)
        self._fed = []
        if self.drafter is not None:
            self.drafter.n_fed[_SEQ] = 0
