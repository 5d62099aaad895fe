"""`mtp_llama`: a `llama_cpp.Llama` that speculates with DeepSeek-V4's MTP block.

Plain ``Llama(draft_model=...)`` fails on V4: its rollback removes the KV tail, which the
V4 cache allows only when the context was created with ``n_rs_seq`` >= the draft length
(reference §6), and `Llama` has no way to set it. Nor does it turn on the `h_nextn` rows
the MTP block drafts from. `Llama` builds its context inside ``__init__``, so `mtp_llama`
lets it, then replaces ``llm._ctx`` before first use with a context made from the Llama's
own context parameters plus ``n_rs_seq = k``, nextn rows on (unmasked) and, where the API
rows are not proven right for that configuration, the eval-callback capture as
``cb_eval`` (`mtplib.runtime.row_source.choose_row_source`, run on the Llama's own model).
The replacement context reports every decode's rows to the `MTPDraftModel`.
"""

from __future__ import annotations

import contextlib
import inspect
from pathlib import Path
from typing import Any

from mtplib.contract.capabilities import Policy
from mtplib.contract.types import DEFAULT_DRAFT, DRAFT_BOUNDS
from mtplib.errors import InputError
from mtplib.llama.draft import K_RANGE, MTPDraftModel
from mtplib.model.fixture import require_weights
from mtplib.model.gguf_header import GGUFHeader, read_header
from mtplib.runtime.lib import UpstreamError, load
from mtplib.runtime.model import FLASH_ATTN, KV_TYPES, ContextConfig, Model, check_pair
from mtplib.runtime.routing import require_mtp
from mtplib.runtime.row_source import choose_row_source
from mtplib.runtime.rows import CapturedRows

#: Llama arguments `mtp_llama` owns or cannot honour, and why.
REFUSED = {
    "model_path": "the trunk is mtp_llama's first argument",
    "draft_model": "mtp_llama attaches the MTPDraftModel itself",
    "embedding": "an embedding context does not generate",
    "vocab_only": "a vocab-only model cannot decode",
    "lora_path": "a LoRA adapter is set on the context mtp_llama replaces",
    "lora_base": "a LoRA adapter is set on the context mtp_llama replaces",
}


def _llama_params() -> set[str]:
    from llama_cpp import Llama

    return set(inspect.signature(Llama.__init__).parameters) - {"self", "kwargs"}


def _int(kwargs: dict, key: str, default: int) -> int:
    v = kwargs.get(key, default)
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise InputError(f"{key} must be a non-negative integer, got {v!r}")
    return v


def check_inputs(trunk: str | Path, sidecar: str | Path, draft: int,
                 llama_kwargs: dict) -> tuple[GGUFHeader, GGUFHeader]:
    """Refuse what upstream or `Llama` would fail on (or silently ignore) before either
    runs: files, the pair, the draft length, and the Llama arguments."""
    if isinstance(draft, bool) or not isinstance(draft, int) or draft not in K_RANGE:
        raise InputError(f"draft must be an integer in {DRAFT_BOUNDS}, got {draft!r}")
    known = _llama_params()
    bad = sorted(set(llama_kwargs) - known)
    if bad:  # Llama swallows unknown keywords (**kwargs): a typo would pass silently
        raise InputError(f"unknown llama_cpp.Llama arguments: {', '.join(bad)}")
    for key, why in REFUSED.items():
        if llama_kwargs.get(key) not in (None, False):
            raise InputError(f"mtp_llama does not take {key}=: {why}")
    th, sh = read_header(trunk), read_header(sidecar)
    check_pair(th, sh)
    require_weights(th)
    require_weights(sh)
    n_train = int(th.kv["deepseek4.context_length"])
    n_ctx = _int(llama_kwargs, "n_ctx", 512) or n_train  # 0: Llama takes context_length
    if not 0 < n_ctx <= n_train:
        raise InputError(f"n_ctx {n_ctx} outside 1..{n_train} (the model's context_length)")
    n_batch = min(_int(llama_kwargs, "n_batch", 512), n_ctx)
    if draft + 1 > n_batch:
        raise InputError(f"draft {draft} + 1 exceeds n_batch {n_batch}: the verify batch "
                         f"[last, drafts...] must be one decode for V4's tail rollback")
    # unset: the C default, F16
    tk, tv = (llama_kwargs.get(t, None) for t in ("type_k", "type_v"))
    tk, tv = (KV_TYPES["f16"] if t is None else t for t in (tk, tv))
    if tk != tv or tk not in KV_TYPES.values():
        raise InputError(f"type_k/type_v must be equal and one of {KV_TYPES}, got {tk}/{tv}")
    return th, sh


def target_config(cp: Any, k: int) -> ContextConfig:
    """The mtplib `ContextConfig` of a Llama's context parameters, with ``n_rs_seq = k``
    and nextn rows on: what the row-source check decodes with."""
    kv = {v: n for n, v in KV_TYPES.items()}
    fa = {v: n for n, v in FLASH_ATTN.items()}
    if cp.type_k != cp.type_v or cp.type_k not in kv or cp.flash_attn_type not in fa:
        raise InputError(f"unsupported Llama context: type_k {cp.type_k}, type_v "
                         f"{cp.type_v}, flash_attn_type {cp.flash_attn_type}")
    return ContextConfig(n_ctx=cp.n_ctx, n_batch=cp.n_batch, n_ubatch=cp.n_ubatch,
                         n_seq_max=cp.n_seq_max, n_rs_seq=max(k, cp.n_rs_seq),
                         n_threads=cp.n_threads, kv_type=kv[cp.type_k],
                         flash_attn=fa[cp.flash_attn_type], nextn_rows="all",
                         no_perf=bool(cp.no_perf), swa_full=bool(cp.swa_full)).validate()


class _LlamaTrunk(Model):
    """The Llama's own llama_model seen as an mtplib `Model`, so that the row-source check
    decodes on the very model (placement, backends, overrides) the Llama decodes on.
    Borrowed: `close` leaves it to the Llama."""

    def __init__(self, llm: Any, header: GGUFHeader) -> None:  # no file load: borrowed
        self.header = header
        self.llama, self.ext = load()
        self.path = Path(llm.model_path)
        self.load_mtp = False
        self._keep: list = []
        m = self.ptr = llm.model
        lib = self.llama
        self.vocab = lib.llama_model_get_vocab(m)
        self.n_vocab = int(lib.llama_vocab_n_tokens(self.vocab))
        self.n_embd = int(lib.llama_model_n_embd(m))
        self.n_embd_out = int(lib.llama_model_n_embd_out(m))
        self.n_layer = int(lib.llama_model_n_layer(m))
        self.n_ctx_train = int(lib.llama_model_n_ctx_train(m))
        self.size_bytes = int(lib.llama_model_size(m))

    def close(self) -> None:
        self.ptr = None  # not ours to free


def _tapped_context_class():
    from llama_cpp import _internals

    class TappedContext(_internals.LlamaContext):
        """A llama_cpp context that hands every decode's batch to the draft model."""

        def __init__(self, *, model, params, verbose, draft: MTPDraftModel, keep) -> None:
            super().__init__(model=model, params=params, verbose=verbose)
            self.draft = draft
            self.keep = keep  # the eval callback upstream holds a pointer to

        def decode(self, batch) -> None:
            try:
                super().decode(batch)
            except BaseException:
                self.draft.record_failed()
                raise
            b = batch.batch
            n = int(b.n_tokens)
            self.draft.record(n, b.token[:n], b.pos[:n])

    return TappedContext


def _replace_context(llm: Any, cfg: ContextConfig, draft: MTPDraftModel,
                     capture: CapturedRows | None) -> None:
    """Swap the Llama's (still unused) context for one MTP can roll back and read rows of."""
    lib, ext = load()
    if llm.n_tokens != 0:
        raise InputError("the Llama's context is already in use")
    old = llm.context_params
    cp = type(old).from_buffer_copy(old)
    cp.n_rs_seq = cfg.n_rs_seq
    keep = None
    if capture is not None:
        keep = lib.ggml_backend_sched_eval_callback(capture.callback)
        cp.cb_eval = keep
        cp.cb_eval_user_data = None
    llm._ctx.close()  # free the first one before allocating its replacement
    ctx = _tapped_context_class()(model=llm._model, params=cp, verbose=llm.verbose,
                                  draft=draft, keep=keep)
    llm._ctx = llm._stack.enter_context(contextlib.closing(ctx))
    llm.context_params = cp
    if int(lib.llama_n_rs_seq(ctx.ctx)) < cfg.n_rs_seq:
        raise UpstreamError(f"upstream created the context with n_rs_seq "
                            f"{lib.llama_n_rs_seq(ctx.ctx)} < {cfg.n_rs_seq}")
    ext.llama_set_embeddings_nextn(ctx.ctx, True, False)


def mtp_llama(trunk: str | Path, sidecar: str | Path, draft: int = DEFAULT_DRAFT, *,
              policy: Policy | str | None = None, **llama_kwargs: Any):
    """A `llama_cpp.Llama` on ``trunk`` that drafts ``draft`` tokens per step with the MTP
    block of ``sidecar`` (its `mtp-` file). ``llama_kwargs`` go to `Llama` (defaults:
    ``verbose=False``; ``logits_all`` is forced on, see below). ``llm.draft_model`` is the
    `MTPDraftModel`; ``llm.draft_model.stats`` counts drafted and accepted tokens.

    Raises `InputError` for bad input, and when the trunk's rows cannot be trusted for
    this context configuration (row source "unsupported": no MTP rather than wrong drafts).
    ``policy`` (default $MTPLIB_POLICY, else beta) is negotiated first: RouteRefused under
    one that disables MTP (alpha).
    """
    th, sh = check_inputs(trunk, sidecar, draft, llama_kwargs)
    require_mtp("mtp_llama", (draft,), policy=policy)
    load()  # the pinned build, upstream's logs routed through mtplib
    from llama_cpp import Llama

    kwargs = {"verbose": False, **llama_kwargs}
    # a draft model makes every row an output, but Llama sizes its score buffer from this
    # argument: without it, decoding past n_batch tokens fails
    kwargs["logits_all"] = True
    dm = MTPDraftModel(sidecar, draft, header=sh)
    llm = None
    try:
        llm = Llama(str(trunk), draft_model=dm, **kwargs)
        llm._stack.callback(dm.close)  # closed with the Llama, before its model
        cfg = target_config(llm.context_params, draft)
        trunk_model = _LlamaTrunk(llm, th)
        decision = choose_row_source(trunk_model, cfg)
        if decision.mode == "unsupported":
            raise InputError(f"MTP is unsupported for this context configuration: "
                             f"{decision.reason}")
        capture = (CapturedRows(trunk_model.n_embd_out)
                   if decision.mode == "captured" else None)
        _replace_context(llm, cfg, dm, capture)
        dm.attach(llm, cfg, decision, capture)
    except BaseException:
        if llm is not None:
            llm.close()
        else:
            dm.close()
        raise
    return llm


def plain_llama(trunk: str | Path, **llama_kwargs: Any):
    """The baseline `mtp_llama` is measured against: a plain `llama_cpp.Llama` on the same
    pinned build (``verbose=False`` unless given), with no draft model."""
    load()
    from llama_cpp import Llama

    return Llama(str(trunk), **{"verbose": False, **llama_kwargs})
