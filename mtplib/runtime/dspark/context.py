"""A loaded DSpark draft, its context beside the target's, and the target's features.

Why apart from `mtplib.runtime.model`: a DSpark draft is arch `dflash`, not `deepseek4`;
its context borrows the target's token embeddings and output head (``ctx_other``), takes
two kinds of batch (an embd batch of features injects K into its stages' caches, a token
batch runs the noise block through the stages and the Markov / confidence heads), and
attends non-causally. Every argument is checked here first, as in `model.py`: upstream
aborts the process on a non-causal batch larger than n_ubatch, on unequal blocks, on
reading layer inputs it never extracted (src/llama-context.cpp:1045, 1787;
src/models/dflash.cpp:321-322).
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from mtplib.model.dspark.spec import DSparkConfig
from mtplib.model.dspark.validate import validate_dspark
from mtplib.model.gguf_header import GGUFHeader, read_header
from mtplib.runtime.dspark.ext import dspark_ext
from mtplib.runtime.lib import UpstreamError, extra_bufts_ok, load
from mtplib.runtime.model import (
    FLASH_ATTN,
    KV_TYPES,
    SMALL_MODEL_BYTES,
    Context,
    RuntimeInputError,
)
from mtplib.runtime.settings import ContextSettings


def _floats(p, n: int) -> np.ndarray:
    """A fresh float32 copy of the ``n`` floats at the C pointer ``p``."""
    src = (ctypes.c_float * n).from_address(ctypes.addressof(p.contents))
    return np.frombuffer(src, dtype=np.float32).copy()


class DSparkModel:
    """A loaded V4 DSpark draft (`dflash` + `markov_w1`), validated before upstream loads
    it (against ``trunk_header`` too, when given)."""

    kind = "dspark"

    def __init__(self, path: str | Path, *, header: GGUFHeader | None = None,
                 trunk_header: GGUFHeader | None = None, devices: Sequence | None = None,
                 n_gpu_layers: int | None = None) -> None:
        """``devices`` (upstream's device pointers) / ``n_gpu_layers``: where its weights
        go; default upstream's (every registered device, RPC shards included). A ranged
        client gives the tail shard's device with 0 layers: the weights stay on this CPU,
        and the context gets the tail's backend, where the target's output head lives
        (`mtplib.runtime.rpc.load_sidecar`)."""
        from mtplib.model.fixture import require_weights

        self.path = Path(path)
        self.header = header or read_header(self.path)
        require_weights(self.header)
        #: the draft's hyper-parameters, as validated (block size, mask token, layers)
        self.config: DSparkConfig = validate_dspark(self.header, trunk_header)
        self.llama, self.ext = load()
        ids_fn = dspark_ext()  # refuse a build without the four calls before loading
        mp = self.llama.llama_model_default_params()
        if not extra_bufts_ok():
            mp.use_extra_bufts = False
        keep = None
        if devices:
            keep = (ctypes.c_void_p * (len(devices) + 1))(*devices, None)
            mp.devices = ctypes.cast(keep, ctypes.c_void_p)
        if n_gpu_layers is not None:
            mp.n_gpu_layers = int(n_gpu_layers)
        m = self.llama.llama_model_load_from_file(str(self.path).encode(), mp)
        del keep  # upstream copied the device list while loading
        if not m:
            raise UpstreamError(f"upstream failed to load {self.path} (see --verbose log)")
        self.ptr = m
        try:
            self.vocab = self.llama.llama_model_get_vocab(m)
            self.n_vocab = int(self.llama.llama_vocab_n_tokens(self.vocab))
            self.n_embd = int(self.llama.llama_model_n_embd(m))
            self.size_bytes = int(self.llama.llama_model_size(m))
            self.n_ctx_train = int(self.llama.llama_model_n_ctx_train(m))
            ids = ids_fn.layer_ids(m)
            mask = int(self.llama.llama_vocab_mask(self.vocab))
            if ids != self.config.target_layers or mask != self.config.mask_token_id:
                raise UpstreamError(f"upstream read {self.path} as target layers {list(ids)}, "
                                    f"mask token {mask}; its header says "
                                    f"{list(self.config.target_layers)}, "
                                    f"{self.config.mask_token_id}")
        except BaseException:
            self.close()
            raise
        #: the shards holding it (none: DSpark on shards is not built)
        self.endpoints: list[str] = []

    @property
    def layer_ids(self) -> tuple[int, ...]:
        return self.config.target_layers

    def _live(self) -> None:
        if not getattr(self, "ptr", None):
            raise RuntimeInputError(f"model {self.path} is closed")

    def close(self) -> None:
        if getattr(self, "ptr", None):
            self.llama.llama_model_free(self.ptr)
            self.ptr = None

    def __enter__(self) -> DSparkModel:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class TargetFeatures:
    """The target's layer-input rows for a DSpark draft (`RowFn`-shaped: ``rows(ctx, n)``).

    Enabling extraction makes upstream reserve its graph again, and reading a layer never
    enabled aborts, so it is enabled here on a fresh target, before its first decode
    (llama-context.cpp:1235-1246)."""

    def __init__(self, target: Context, layer_ids: Sequence[int], n_embd: int) -> None:
        target._live()
        ids = tuple(int(x) for x in layer_ids)
        n_layer = target.model.n_layer
        if not ids or any(not 0 <= x <= n_layer for x in ids):
            raise RuntimeInputError(f"DSpark target layers {list(ids)} outside 0..{n_layer} "
                                    "(the trunk's layer inputs, n_layer = the last output)")
        if any(target.seq_pos_max(s) >= 0 for s in range(target.n_seq_max)):
            raise RuntimeInputError("layer-input extraction must be enabled before the "
                                    "target's first decode")
        self.ext = dspark_ext()
        self.target, self.ids, self.n_embd = target, ids, int(n_embd)
        for lid in ids:
            self.ext.set_layer_inp(target.ptr, lid, True)

    @property
    def width(self) -> int:
        return len(self.ids) * self.n_embd

    def rows(self, ctx: Context, n: int) -> np.ndarray:
        """(n, L*n_embd): the first ``n`` tokens of the target's last decode, each token's
        layer-input rows side by side in ``target_layers`` order (as upstream's
        speculative.cpp:1150-1160 lays them out for the draft's ``fc``)."""
        ctx._live()
        if ctx is not self.target:
            raise RuntimeInputError("DSpark features come from the context they were "
                                    "enabled on")
        if not isinstance(n, int) or not 1 <= n <= ctx.last_decode_len:
            raise RuntimeInputError(f"features of {n!r} tokens: the target's last decode "
                                    f"had {ctx.last_decode_len}")
        out = np.empty((n, self.width), dtype=np.float32)
        E = self.n_embd
        for k, lid in enumerate(self.ids):
            p = self.ext.get_layer_inp(ctx.ptr, lid)
            if not p:
                raise UpstreamError(f"upstream returned no layer-{lid} inputs")
            out[:, k * E:(k + 1) * E] = _floats(p, n * E).reshape(n, E)
        return out


class DSparkContext:
    """The draft's llama_context: ``ctx_other`` = the target, non-causal, one embd batch
    (feature injection) and one token batch (noise blocks), each at most n_ubatch tokens
    (a non-causal decode must fit one ubatch, llama-context.cpp:1787)."""

    def __init__(self, model: DSparkModel, target: Context, settings: ContextSettings, *,
                 n_threads: int | None = None) -> None:
        model._live()
        target._live()
        llama = self.llama = model.llama
        self.model, self.target = model, target
        cfg = model.config
        n_ctx = target.cfg.n_ctx
        if n_ctx > model.n_ctx_train:
            raise RuntimeInputError(f"n_ctx {n_ctx} exceeds the DSpark draft's "
                                    f"context_length {model.n_ctx_train}")
        if target.n_ubatch < cfg.block_size:
            raise RuntimeInputError(f"--ubatch {target.n_ubatch} is below the DSpark block "
                                    f"size {cfg.block_size}: a block must fit one ubatch")
        cp = llama.llama_context_default_params()
        cp.n_ctx = n_ctx
        cp.n_batch = target.n_batch
        cp.n_ubatch = target.n_ubatch
        cp.n_seq_max = target.n_seq_max
        threads = n_threads or (1 if model.size_bytes < SMALL_MODEL_BYTES else
                                settings.n_threads)
        cp.n_threads = cp.n_threads_batch = threads
        cp.type_k = cp.type_v = KV_TYPES[settings.kv_type]
        cp.flash_attn_type = FLASH_ATTN[settings.flash_attn]
        cp.swa_full = settings.swa_full
        cp.no_perf = True
        cp.ctx_other = target.ptr  # the draft has no token_embd / output of its own
        ctx = llama.llama_init_from_model(model.ptr, cp)
        if not ctx:
            raise UpstreamError("upstream refused to create the DSpark draft context "
                                "(see --verbose log)")
        self.ptr = ctx
        self.mem = llama.llama_get_memory(ctx)
        self.n_ctx = min(n_ctx, int(llama.llama_n_ctx_seq(ctx)))
        self.n_batch = int(llama.llama_n_batch(ctx))
        self.n_ubatch = int(llama.llama_n_ubatch(ctx))
        self.n_seq_max = int(llama.llama_n_seq_max(ctx))
        self.n_vocab = target.n_vocab
        self.width = cfg.feature_width
        causal = bool(model.header.kv.get("dflash.attention.causal", False))
        llama.llama_set_causal_attn(ctx, causal)  # anchor-first blocks see each other
        # the confidences arrive as E-wide rows of h_nextn, one per output (masked)
        model.ext.llama_set_embeddings_nextn(ctx, True, True)
        n_ub = self.n_ubatch
        self._emb = llama.llama_batch_init(n_ub, self.width, 1)
        self._embd = np.ctypeslib.as_array(self._emb.embd, shape=(n_ub * self.width,))
        self._tok = llama.llama_batch_init(n_ub, 0, 1)
        self.last_n = 0

    def _live(self) -> None:
        if not getattr(self, "ptr", None):
            raise RuntimeInputError("this DSpark context is closed")
        self.model._live()
        self.target._live()

    def _check(self, n: int, positions: Sequence[int], seqs: Sequence[int]) -> None:
        if n == 0:
            raise RuntimeInputError("empty batch")
        if n > self.n_ubatch:
            raise RuntimeInputError(f"a DSpark batch of {n} tokens exceeds n_ubatch "
                                    f"{self.n_ubatch} (non-causal: one ubatch)")
        if len(positions) != n or len(seqs) != n:
            raise RuntimeInputError(f"{n} tokens but {len(positions)} positions and "
                                    f"{len(seqs)} sequence ids")
        if min(positions) < 0 or max(positions) >= self.n_ctx:
            raise RuntimeInputError(f"positions {min(positions)}..{max(positions)} outside "
                                    f"the context [0, {self.n_ctx})")
        if any(not 0 <= q < self.n_seq_max for q in seqs):
            raise RuntimeInputError(f"sequence ids {sorted(set(seqs))} outside "
                                    f"[0, {self.n_seq_max})")
        last: dict[int, int] = {}
        for q, p in zip(seqs, positions, strict=True):
            if q in last and p != last[q] + 1:  # the batch allocator aborts on skips
                raise RuntimeInputError(f"sequence {q}'s positions in the batch are not "
                                        f"consecutive ({last[q]} then {p})")
            last[q] = p

    def _fill(self, b, positions: Sequence[int], seqs: Sequence[int], out: bool) -> None:
        for i, (p, q) in enumerate(zip(positions, seqs, strict=True)):
            b.pos[i] = int(p)
            b.n_seq_id[i] = 1
            b.seq_id[i][0] = int(q)
            b.logits[i] = out
        b.n_tokens = len(positions)

    def _decode(self, b, n: int, outputs: bool) -> None:
        self.last_n = 0
        rc = int(self.llama.llama_decode(self.ptr, b))
        if rc != 0:
            raise UpstreamError(f"DSpark llama_decode returned {rc} (1: no KV slot)")
        self.last_n = n if outputs else 0

    def inject(self, rows: np.ndarray, positions: Sequence[int], seqs: Sequence[int]) -> None:
        """Fuse the target's feature rows and write each stage's K at ``positions``
        (an embd batch: no attention, no logits; dflash.cpp:872-913)."""
        self._live()
        rows = np.asarray(rows, dtype=np.float32)
        n = len(rows)
        self._check(n, positions, seqs)
        if rows.shape != (n, self.width):
            raise RuntimeInputError(f"feature rows have shape {rows.shape}, expected "
                                    f"({n}, {self.width})")
        if not np.isfinite(rows).all():
            raise RuntimeInputError("feature rows contain NaN or inf")
        self._embd[: n * self.width] = rows.reshape(-1)
        self._fill(self._emb, positions, seqs, False)
        self._decode(self._emb, n, False)

    def block(self, tokens: Sequence[int], positions: Sequence[int], seqs: Sequence[int],
              n_blocks: int) -> None:
        """Decode ``n_blocks`` equal blocks (one sequence each, block-major) through the
        stages and both heads; every token is an output."""
        self._live()
        n = len(tokens)
        self._check(n, positions, seqs)
        if n_blocks < 1 or n % n_blocks or len(set(seqs)) != n_blocks:
            # dflash.cpp:321-322 GGML_ASSERT: equal-size blocks, one sequence per block
            raise RuntimeInputError(f"{n} tokens are not {n_blocks} equal blocks of "
                                    "distinct sequences")
        if any(not 0 <= int(t) < self.n_vocab for t in tokens):
            raise RuntimeInputError(f"a block token is outside [0, {self.n_vocab})")
        b = self._tok
        for i, t in enumerate(tokens):
            b.token[i] = int(t)
        self._fill(b, positions, seqs, True)
        self._decode(b, n, True)

    def logits_all(self, n: int) -> np.ndarray:
        """(n, n_vocab): the last block decode's logits, Markov bias included."""
        self._live()
        if n != self.last_n or n < 1:
            raise RuntimeInputError(f"logits of {n} tokens: the last block decode had "
                                    f"{self.last_n}")
        p = self.llama.llama_get_logits(self.ptr)
        if not p:
            raise UpstreamError("upstream returned no DSpark logits")
        return _floats(p, n * self.n_vocab).reshape(n, self.n_vocab)

    def confidences(self, n: int) -> np.ndarray:
        """(n,): the confidence head's sigmoid per block token (broadcast E-wide by
        upstream into the h_nextn rows; dflash.cpp:394-403)."""
        self._live()
        if not self.model.config.confidence_head:
            raise RuntimeInputError("this DSpark draft has no confidence head")
        if n != self.last_n or n < 1:
            raise RuntimeInputError(f"confidences of {n} tokens: the last block decode had "
                                    f"{self.last_n}")
        p = self.model.ext.llama_get_embeddings_nextn(self.ptr)
        if not p:
            raise UpstreamError("upstream returned no DSpark confidences")
        E = self.model.n_embd
        return _floats(p, n * E).reshape(n, E)[:, 0].copy()

    def seq_rm(self, seq_id: int, p0: int, p1: int = -1) -> bool:
        self._live()
        if not -1 <= seq_id < self.n_seq_max:
            raise RuntimeInputError(f"seq_id {seq_id} outside [0, {self.n_seq_max})")
        return bool(self.llama.llama_memory_seq_rm(self.mem, int(seq_id), int(p0), int(p1)))

    def seq_pos_max(self, seq_id: int) -> int:
        self._live()
        return int(self.llama.llama_memory_seq_pos_max(self.mem, int(seq_id)))

    def state_size(self, seq_id: int) -> int:
        """Bytes of the sequence's draft cache state."""
        self._live()
        return int(self.llama.llama_state_seq_get_size(self.ptr, int(seq_id)))

    def close(self) -> None:
        if getattr(self, "ptr", None):
            self.llama.llama_batch_free(self._emb)
            self.llama.llama_batch_free(self._tok)
            self.llama.llama_free(self.ptr)
            self.ptr = None

    def __enter__(self) -> DSparkContext:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
