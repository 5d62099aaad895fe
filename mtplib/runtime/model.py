"""Models, contexts and batches over upstream's C API, validated before every call.

Upstream aborts the whole process (GGML_ASSERT) on some bad calls, e.g. a batch larger
than n_batch or a token id out of range, so every argument is checked here first and a
bad one raises `RuntimeInputError` with what to do instead.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from mtplib.errors import InputError
from mtplib.model.gguf_header import GGUFHeader, ModelFileError, read_header, require_deepseek4
from mtplib.runtime.lib import UpstreamError, load
from mtplib.runtime.settings import (
    FLASH_ATTN_MODES,
    KV_TYPE_NAMES,
    DecodeSettings,
    FlashAttn,
    KvType,
    choice_problem,
)

#: the allowed names come from mtplib.runtime.settings; a name without a ggml value here
#: fails at import, not in front of a user
_GGML_TYPE = {"f32": 0, "f16": 1, "bf16": 30, "q8_0": 8}
KV_TYPES = {t: _GGML_TYPE[t] for t in KV_TYPE_NAMES}
_FA_TYPE = {"auto": -1, "off": 0, "on": 1}
FLASH_ATTN = {m: _FA_TYPE[m] for m in FLASH_ATTN_MODES}


class RuntimeInputError(InputError):
    """A call the runtime refuses before upstream can abort on it."""


def embd_fingerprint(h: GGUFHeader, n_bytes: int = 1 << 16) -> str:
    """Hash of a sample of token_embd's bytes: tells apart files from different weights
    without reading a whole (possibly 1 GB) tensor."""
    t = h.tensor("token_embd.weight")
    if t is None:
        raise ModelFileError(f"{h.path}: no token_embd.weight")
    hs = hashlib.sha256()
    with open(h.path, "rb") as f:
        for frac in (0.0, 0.5):
            f.seek(t.offset + int(t.nbytes * frac) // 4096 * 4096)
            hs.update(f.read(min(n_bytes, t.nbytes)))
    return hs.hexdigest()[:16]


def check_pair(trunk: GGUFHeader, sidecar: GGUFHeader) -> None:
    """Refuse a trunk and an `mtp-` sidecar that do not belong together."""
    require_deepseek4(trunk)
    require_deepseek4(sidecar)
    if trunk.is_mtp_only:
        raise ModelFileError(f"{trunk.path} is an MTP sidecar, not a trunk; pass it as --mtp")
    if not sidecar.is_mtp_only:
        raise ModelFileError(
            f"{sidecar.path} is not an MTP sidecar (needs nextn_predict_layers > 0 and no "
            "trunk blocks; upstream's converter names it mtp-<model>.gguf)")
    a, p = "deepseek4.", sidecar.kv
    n_layer = int(trunk.kv[a + "block_count"])
    n_side = int(p[a + "block_count"]) - int(p[a + "nextn_predict_layers"])
    diffs = []
    if n_side != n_layer:
        diffs.append(f"trunk has {n_layer} layers, sidecar expects {n_side}")
    for k in ("embedding_length", "attention.head_count", "attention.key_length",
              "expert_count", "attention.q_lora_rank", "hyper_connection.count"):
        if trunk.kv.get(a + k) != p.get(a + k):
            diffs.append(f"{k}: trunk {trunk.kv.get(a + k)} vs sidecar {p.get(a + k)}")
    if trunk.n_vocab != sidecar.n_vocab:
        diffs.append(f"vocab: trunk {trunk.n_vocab} vs sidecar {sidecar.n_vocab}")
    if not diffs and embd_fingerprint(trunk) != embd_fingerprint(sidecar):
        diffs.append("token_embd data differs (different weights)")
    if diffs:
        raise ModelFileError(
            f"{sidecar.path} is not the MTP sidecar of {trunk.path}: " + "; ".join(diffs))


class Model:
    """A loaded `deepseek4` GGUF: a trunk, or an `mtp-` sidecar with ``load_mtp``."""

    def __init__(self, path: str | Path, *, load_mtp: bool = False,
                 header: GGUFHeader | None = None, devices: Sequence | None = None,
                 tensor_split: Sequence[float] | None = None) -> None:
        self.header = header or read_header(path)
        require_deepseek4(self.header)
        from mtplib.model.fixture import require_weights

        require_weights(self.header)
        if load_mtp and not self.header.is_mtp_only:
            raise ModelFileError(f"{path}: load_mtp needs an MTP sidecar (mtp-*.gguf)")
        if not load_mtp and self.header.is_mtp_only:
            raise ModelFileError(f"{path} is an MTP sidecar; load it with load_mtp=True / --mtp")
        self.llama, self.ext = load()
        self.path = Path(path)
        self.load_mtp = load_mtp
        mp = self.llama.llama_model_default_params()
        mp.load_mtp = load_mtp
        self._keep: list = []
        if devices:
            arr = (ctypes.c_void_p * (len(devices) + 1))(*devices, None)
            mp.devices = ctypes.cast(arr, ctypes.c_void_p)
            mp.n_gpu_layers = 0x7FFFFFFF
            mp.split_mode = 1  # LLAMA_SPLIT_MODE_LAYER
            self._keep.append(arr)
        if tensor_split:
            n_max = self.llama.LLAMA_MAX_DEVICES
            ts = (ctypes.c_float * n_max)(*[float(x) for x in tensor_split])
            mp.tensor_split = ts
            self._keep.append(ts)
        m = self.llama.llama_model_load_from_file(str(self.path).encode(), mp)
        if not m:
            raise UpstreamError(f"upstream failed to load {self.path} (see the log with --verbose)")
        self.ptr = m
        self.vocab = self.llama.llama_model_get_vocab(m)
        self.n_vocab = int(self.llama.llama_vocab_n_tokens(self.vocab))
        self.n_embd = int(self.llama.llama_model_n_embd(m))
        self.n_embd_out = int(self.llama.llama_model_n_embd_out(m))  # hc * n_embd for V4
        self.n_layer = int(self.llama.llama_model_n_layer(m))
        self.n_ctx_train = int(self.llama.llama_model_n_ctx_train(m))
        self.size_bytes = int(self.llama.llama_model_size(m))

    def tokenize(self, text: str, *, add_special: bool = True) -> list[int]:
        data = text.encode("utf-8")
        n_max = len(data) + 16
        buf = (self.llama.llama_token * n_max)()
        n = self.llama.llama_tokenize(self.vocab, data, len(data), buf, n_max, add_special, False)
        if n < 0:
            raise RuntimeInputError(f"prompt needs {-n} tokens, more than the buffer {n_max}")
        return list(buf[:n])

    def detokenize(self, tokens: Sequence[int]) -> str:
        out = []
        buf = ctypes.create_string_buffer(256)
        for t in tokens:
            n = self.llama.llama_token_to_piece(self.vocab, int(t), buf, len(buf), 0, False)
            out.append(buf.raw[: max(n, 0)].decode("utf-8", "replace"))
        return "".join(out)

    def close(self) -> None:
        if getattr(self, "ptr", None):
            self.llama.llama_model_free(self.ptr)
            self.ptr = None

    def __enter__(self) -> Model:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


@dataclass
class ContextConfig:
    """What a context is created with; recorded with every measurement."""

    n_ctx: int = 2048
    n_batch: int = 512
    n_ubatch: int = 512
    n_seq_max: int = 1
    n_rs_seq: int = 0  # tail-rollback depth (V4: set >= draft length)
    n_threads: int = field(default_factory=lambda: min(os.cpu_count() or 1, 8))
    kv_type: KvType = "f16"
    flash_attn: FlashAttn = "auto"
    mtp: bool = False  # LLAMA_CONTEXT_TYPE_MTP
    nextn_rows: str = "off"  # off | all | masked: after-decode h_nextn rows
    no_perf: bool = True
    swa_full: bool = True  # the C API default; upstream's tools (common_params) use false

    @classmethod
    def from_settings(cls, s: DecodeSettings, **extra) -> ContextConfig:
        """The context for ``s`` (hidden_rows is the loop's, not the context's); ``extra``
        sets the fields settings do not hold (mtp, nextn_rows, n_rs_seq, n_seq_max, ...)."""
        return cls(n_ctx=s.n_ctx, n_batch=s.n_batch, n_ubatch=s.n_ubatch,
                   n_threads=s.n_threads, kv_type=s.kv_type, flash_attn=s.flash_attn,
                   swa_full=s.swa_full, **extra)

    def validate(self) -> ContextConfig:
        errs = [e for e in (choice_problem("kv_type", self.kv_type, KV_TYPE_NAMES),
                            choice_problem("flash_attn", self.flash_attn, FLASH_ATTN_MODES))
                if e]
        if self.nextn_rows not in ("off", "all", "masked"):
            errs.append(f"nextn_rows {self.nextn_rows!r} not in off/all/masked")
        for k in ("n_ctx", "n_batch", "n_ubatch", "n_seq_max", "n_threads"):
            if int(getattr(self, k)) < 1:
                errs.append(f"{k} must be >= 1")
        if self.n_rs_seq < 0:
            errs.append("n_rs_seq must be >= 0")
        if self.mtp and self.nextn_rows == "all":
            # the MTP graph's h_nextn holds output rows only: upstream would read past it
            # (GGML_ASSERT "tensor read out of bounds" aborts the process)
            errs.append("an MTP context takes nextn_rows 'masked' (or 'off'), not 'all'")
        if errs:
            raise RuntimeInputError("bad context config: " + "; ".join(errs))
        return self


EvalCallback = Callable[[int, bool], bool]


def _copy_floats(p, n: int) -> np.ndarray:
    """A fresh float32 array holding the ``n`` floats at the C pointer ``p`` (the cheapest
    copy out of upstream's buffers; np.ctypeslib.as_array builds a ctypes type per call)."""
    src = (ctypes.c_float * n).from_address(ctypes.addressof(p.contents))
    return np.frombuffer(src, dtype=np.float32).copy()


class Context:
    """A llama_context plus one reusable batch; every call validated first."""

    def __init__(self, model: Model, cfg: ContextConfig | None = None, *,
                 cb_eval: Callable | None = None) -> None:
        cfg = self.cfg = (cfg or ContextConfig()).validate()
        self.model = model
        llama = self.llama = model.llama
        if cfg.mtp and not model.load_mtp:
            raise RuntimeInputError("an MTP context needs a model loaded with load_mtp")
        if cfg.n_ctx > model.n_ctx_train:
            raise RuntimeInputError(
                f"n_ctx {cfg.n_ctx} exceeds the model's context_length {model.n_ctx_train}")
        cp = llama.llama_context_default_params()
        cp.n_ctx = cfg.n_ctx
        cp.n_batch = min(cfg.n_batch, cfg.n_ctx)
        cp.n_ubatch = min(cfg.n_ubatch, cp.n_batch)
        cp.n_seq_max = cfg.n_seq_max
        cp.n_rs_seq = cfg.n_rs_seq
        cp.n_threads = cp.n_threads_batch = cfg.n_threads
        cp.type_k = cp.type_v = KV_TYPES[cfg.kv_type]
        cp.flash_attn_type = FLASH_ATTN[cfg.flash_attn]
        cp.no_perf = cfg.no_perf
        cp.swa_full = cfg.swa_full
        if cfg.mtp:
            cp.ctx_type = llama.LLAMA_CONTEXT_TYPE_MTP
        self._cb = None
        if cb_eval is not None:
            self._cb = llama.ggml_backend_sched_eval_callback(cb_eval)
            cp.cb_eval = self._cb
        ctx = llama.llama_init_from_model(model.ptr, cp)
        if not ctx:
            raise UpstreamError("upstream refused to create the context (see --verbose log)")
        self.ptr = ctx
        self.mem = llama.llama_get_memory(ctx)
        self.n_ctx = int(llama.llama_n_ctx(ctx))
        self.n_batch = int(llama.llama_n_batch(ctx))
        self.n_ubatch = int(llama.llama_n_ubatch(ctx))
        self.n_seq_max = int(llama.llama_n_seq_max(ctx))
        self.n_rs_seq = int(llama.llama_n_rs_seq(ctx))
        self.n_vocab = model.n_vocab
        self.width = model.n_embd_out
        if cfg.nextn_rows != "off":
            model.ext.llama_set_embeddings_nextn(ctx, True, cfg.nextn_rows == "masked")
        self._batch = llama.llama_batch_init(self.n_batch, self.width if cfg.mtp else 0, 1)
        if cfg.mtp:  # an embd batch has no token array: give it one (upstream's server does)
            self._tok = (llama.llama_token * self.n_batch)()
            self._batch.token = self._tok
            self._embd = np.ctypeslib.as_array(self._batch.embd,
                                               shape=(self.n_batch * self.width,))
        self.last_n_outputs = 0
        self.last_decode_len = 0

    # -- decoding -----------------------------------------------------------------------
    def decode(self, tokens: Sequence[int], positions: Sequence[int], *, seq_id: int = 0,
               logits: Sequence[bool] | bool = False, rows: np.ndarray | None = None) -> None:
        """Decode one batch for one sequence; ``logits`` marks the rows to output."""
        n = len(tokens)
        if n == 0:
            raise RuntimeInputError("empty batch")
        if n > self.n_batch:
            raise RuntimeInputError(
                f"batch of {n} tokens exceeds n_batch {self.n_batch}; split it (prefill chunks)")
        if len(positions) != n:
            raise RuntimeInputError(f"{n} tokens but {len(positions)} positions")
        if not 0 <= seq_id < self.n_seq_max:
            raise RuntimeInputError(f"seq_id {seq_id} outside [0, n_seq_max={self.n_seq_max})")
        # plain Python on the (small) per-step batches: cheaper than numpy round trips
        toks = [int(t) for t in tokens]
        if min(toks) < 0 or max(toks) >= self.n_vocab:
            bad = next(t for t in toks if t < 0 or t >= self.n_vocab)
            raise RuntimeInputError(f"token id {bad} out of range [0, {self.n_vocab})")
        pos = [int(q) for q in positions]
        if min(pos) < 0 or max(pos) >= self.n_ctx:
            raise RuntimeInputError(
                f"positions {min(pos)}..{max(pos)} outside the context "
                f"[0, {self.n_ctx}); the prompt plus generated tokens exceed n_ctx")
        flags = [bool(logits)] * n if isinstance(logits, bool) else [bool(x) for x in logits]
        if len(flags) != n:
            raise RuntimeInputError(f"{n} tokens but {len(flags)} logits flags")
        if self.cfg.mtp:
            if rows is None:
                raise RuntimeInputError("an MTP decode needs one hidden row per token")
            rows = np.asarray(rows, dtype=np.float32)
            if rows.shape != (n, self.width):
                raise RuntimeInputError(
                    f"hidden rows have shape {rows.shape}, expected ({n}, {self.width})")
            if not np.isfinite(rows).all():
                raise RuntimeInputError("hidden rows contain NaN or inf")
            self._embd[: n * self.width] = rows.reshape(-1)
        elif rows is not None:
            raise RuntimeInputError("hidden rows are only accepted by an MTP context")
        b = self._batch
        b_tok, b_pos, b_nseq, b_seq, b_lg = b.token, b.pos, b.n_seq_id, b.seq_id, b.logits
        for i in range(n):
            b_tok[i] = toks[i]
            b_pos[i] = pos[i]
            b_nseq[i] = 1
            b_seq[i][0] = seq_id
            b_lg[i] = flags[i]
        b.n_tokens = n
        rc = int(self.llama.llama_decode(self.ptr, b))
        if rc != 0:
            raise UpstreamError(f"llama_decode returned {rc} (1: no KV slot; <0: error)")
        self.last_n_outputs = sum(flags)
        self.last_decode_len = n

    def logits(self, i: int) -> np.ndarray:
        """Logits of batch token ``i`` of the last decode (upstream's index: the token's
        position in the batch, which must have been flagged; -1 = the last output)."""
        p = self.llama.llama_get_logits_ith(self.ptr, i)
        if not p:
            raise UpstreamError(f"no logits for output {i}")
        return _copy_floats(p, self.n_vocab)

    def logits_all(self, n: int) -> np.ndarray:
        """Logits of every token of the last decode, (n, n_vocab) in batch order, in one
        copy; only when all n tokens were flagged (so output row i is batch token i)."""
        if n != self.last_decode_len or self.last_n_outputs != n:
            raise RuntimeInputError(f"logits_all({n}) needs a decode of {n} tokens, all "
                                    f"flagged (last: {self.last_decode_len} tokens, "
                                    f"{self.last_n_outputs} outputs)")
        p = self.llama.llama_get_logits(self.ptr)
        if not p:
            raise UpstreamError("upstream returned no logits")
        return _copy_floats(p, n * self.n_vocab).reshape(n, self.n_vocab)

    def nextn_rows(self, n: int) -> np.ndarray:
        """The `h_nextn` rows of the last decode (n rows of hc*n_embd floats)."""
        if self.cfg.nextn_rows == "off":
            raise RuntimeInputError("context was created without nextn rows")
        p = self.model.ext.llama_get_embeddings_nextn(self.ptr)
        if not p:
            raise UpstreamError("upstream returned no nextn rows")
        return _copy_floats(p, n * self.width).reshape(n, self.width)

    # -- memory ---------------------------------------------------------------------------
    def seq_rm(self, seq_id: int, p0: int, p1: int = -1) -> bool:
        return bool(self.llama.llama_memory_seq_rm(self.mem, seq_id, p0, p1))

    def seq_pos_max(self, seq_id: int) -> int:
        return int(self.llama.llama_memory_seq_pos_max(self.mem, seq_id))

    def clear(self) -> None:
        self.llama.llama_memory_clear(self.mem, True)

    def state_get(self, seq_id: int) -> bytes:
        n = int(self.llama.llama_state_seq_get_size(self.ptr, seq_id))
        buf = (ctypes.c_uint8 * n)()
        got = int(self.llama.llama_state_seq_get_data(self.ptr, buf, n, seq_id))
        if got != n:
            raise UpstreamError(f"state_seq_get_data wrote {got} of {n} bytes")
        return bytes(buf)

    def state_set(self, seq_id: int, data: bytes) -> None:
        buf = (ctypes.c_uint8 * len(data)).from_buffer_copy(data)
        got = int(self.llama.llama_state_seq_set_data(self.ptr, buf, len(data), seq_id))
        if got == 0:
            raise UpstreamError("state_seq_set_data refused the checkpoint")

    def close(self) -> None:
        if getattr(self, "ptr", None):
            if self.cfg.mtp:  # the token array is ours, not upstream's
                self._batch.token = ctypes.POINTER(self.llama.llama_token)()
            self.llama.llama_batch_free(self._batch)
            self.llama.llama_free(self.ptr)
            self.ptr = None

    def __enter__(self) -> Context:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
