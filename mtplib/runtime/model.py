"""Models, contexts and batches over upstream's C API, validated before every call.

Upstream aborts the whole process (GGML_ASSERT) on some bad calls, e.g. a batch larger
than n_batch or a token id out of range, so every argument is checked here first and a
bad one raises `RuntimeInputError` with what to do instead.
"""

from __future__ import annotations

import ctypes
import hashlib
import numbers
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from mtplib import envs
from mtplib.errors import InputError
from mtplib.model.gguf_header import GGUFHeader, ModelFileError, read_header, require_deepseek4
from mtplib.model.validate import validate_header
from mtplib.runtime.lib import UpstreamError, extra_bufts_ok, load
from mtplib.runtime.settings import (
    FLASH_ATTN_MODES,
    KV_TYPE_NAMES,
    ContextSettings,
)

#: the allowed names come from mtplib.runtime.settings; a name without a ggml value here
#: fails at import, not in front of a user
_GGML_TYPE = {"f32": 0, "f16": 1, "bf16": 30, "q8_0": 8}
KV_TYPES = {t: _GGML_TYPE[t] for t in KV_TYPE_NAMES}
_FA_TYPE = {"auto": -1, "off": 0, "on": 1}
FLASH_ATTN = {m: _FA_TYPE[m] for m in FLASH_ATTN_MODES}


class RuntimeInputError(InputError):
    """A call the runtime refuses before upstream can abort on it."""


def _is_int(v: object) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def check_n_new(n_new: object) -> int:
    """How many tokens to generate: an int >= 0 (0 generates none, as llama.cpp's
    n_predict 0), else RuntimeInputError."""
    if not _is_int(n_new) or n_new < 0:
        raise RuntimeInputError(f"n_new (the number of tokens to generate, --n) must be an "
                                f"int >= 0, got {n_new!r}")
    return int(n_new)


def check_tokens(tokens: object, n_vocab: int, what: str = "prompt") -> list[int]:
    """``tokens`` as a list of ints in [0, n_vocab), else RuntimeInputError naming the
    first bad one: a float id (1.5) would otherwise be truncated silently, and an id out of
    range aborts upstream."""
    if isinstance(tokens, str | bytes) or not isinstance(tokens, Sequence | np.ndarray):
        raise RuntimeInputError(f"{what} must be a sequence of token ids, got "
                                f"{type(tokens).__name__}")
    for i, t in enumerate(tokens):
        if not _is_int(t):
            raise RuntimeInputError(f"{what} token {i} is {t!r} ({type(t).__name__}), not an "
                                    "integer token id")
        if not 0 <= t < n_vocab:
            raise RuntimeInputError(f"token id {t} out of range [0, {n_vocab}) ({what} token "
                                    f"{i})")
    return [int(t) for t in tokens]


def max_threads() -> int:
    """The most threads a context or a shard may use: this machine's CPU count."""
    return os.cpu_count() or 1


#: A CPU context whose model is smaller than this runs on one thread (threads by the work's
#: size). ggml's CPU backend ends every graph node in an OpenMP barrier: a small model's
#: nodes take a few microseconds each, so a second thread only adds a barrier wait per node,
#: and on a host whose cores are shared (shards beside the client) each wait can cost a
#: scheduler slice. Measured on this project's CPU (evidence/graph-reuse/README.md): the
#: trained pair's MTP block (3.6 MB) drafts faster on 1 thread than on 2 idle, and stays
#: within 2x of that with both cores busy; V4-Flash's MTP block (GBs) needs every thread.
SMALL_MODEL_BYTES = 64 << 20


def context_threads(model: Model, requested: int) -> int:
    """The threads a context on ``model`` computes with on this CPU: 1 when its layers run
    on RPC shards (the client's part of that graph is the token lookup; an MTP block on the
    tail runs there) or the model is below SMALL_MODEL_BYTES; else ``requested``."""
    if model.endpoints or model.size_bytes < SMALL_MODEL_BYTES:
        return 1
    return requested


def check_threads(n: object, what: str = "threads") -> int:
    """``n`` if it is an int in 1..max_threads(), else RuntimeInputError naming ``what``."""
    if not _is_int(n) or not 1 <= n <= max_threads():
        raise RuntimeInputError(f"{what} must be in 1..{max_threads()} (this machine's CPUs), "
                                f"got {n!r}")
    return n


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


#: Keys that differ between a trunk and its sidecar by design (the sidecar counts its MTP
#: block); every other `deepseek4.*` and `tokenizer.*` key must agree.
PAIR_OWN_KEYS = ("deepseek4.block_count", "deepseek4.nextn_predict_layers")
#: Per-block keys: compared over the trunk's layers (the sidecar adds the MTP block's).
PER_BLOCK_KEYS = ("deepseek4.attention.compress_ratios", "deepseek4.expert_used_count",
                  "deepseek4.feed_forward_length", "deepseek4.attention.head_count",
                  "deepseek4.attention.head_count_kv", "deepseek4.expert_feed_forward_length",
                  "deepseek4.swiglu_clamp_exp", "deepseek4.swiglu_clamp_shexp")


def _blocks(v: object, n: int) -> list:
    """A per-block key's first ``n`` values (a scalar applies to every block)."""
    return list(v[:n]) if isinstance(v, list) else [v] * n


def _short(v: object) -> str:
    s = repr(v)
    return s if len(s) <= 60 else s[:57] + "..."


def check_pair(trunk: GGUFHeader, sidecar: GGUFHeader) -> None:
    """Refuse a trunk and an `mtp-` sidecar that do not belong together.

    Each file is validated on its own first (model/validate.py), then every hyper-parameter
    they share is compared: the MTP block runs on the trunk's hidden rows and token ids,
    and upstream sizes its caches and weights from the sidecar's own keys, so a sidecar key
    that differs (head_count_kv, value_length, ...) makes upstream abort mid-run.
    """
    require_deepseek4(trunk)
    require_deepseek4(sidecar)
    validate_header(trunk)
    validate_header(sidecar)
    if trunk.is_mtp_only:
        raise ModelFileError(f"{trunk.path} is an MTP sidecar, not a trunk; pass it as --mtp")
    if not sidecar.is_mtp_only:
        raise ModelFileError(
            f"{sidecar.path} is not an MTP sidecar (needs nextn_predict_layers > 0 and no "
            "trunk blocks; upstream's converter names it mtp-<model>.gguf)")
    a, p = "deepseek4.", sidecar.kv
    n_layer = int(trunk.kv[a + "block_count"]) - int(trunk.kv.get(a + "nextn_predict_layers", 0))
    n_side = int(p[a + "block_count"]) - int(p[a + "nextn_predict_layers"])
    diffs = []
    if n_side != n_layer:
        diffs.append(f"trunk has {n_layer} layers, sidecar expects {n_side}")
    keys = sorted(k for k in set(trunk.kv) | set(p)
                  if k.startswith((a, "tokenizer.")) and k not in PAIR_OWN_KEYS)
    for k in keys:
        tv, sv = trunk.kv.get(k, "<absent>"), p.get(k, "<absent>")
        if k in PER_BLOCK_KEYS and k in trunk.kv and k in p:  # the trunk's blocks only
            tv, sv = _blocks(tv, n_layer), _blocks(sv, n_layer)
        if tv != sv:
            diffs.append(f"{k.removeprefix(a)}: trunk {_short(tv)} vs sidecar {_short(sv)}")
    if trunk.n_vocab != sidecar.n_vocab:
        diffs.append(f"vocab: trunk {trunk.n_vocab} vs sidecar {sidecar.n_vocab}")
    if not diffs and embd_fingerprint(trunk) != embd_fingerprint(sidecar):
        diffs.append("token_embd data differs (different weights)")
    if diffs:
        more = f" (and {len(diffs) - 3} more)" if len(diffs) > 3 else ""
        raise ModelFileError(
            f"{sidecar.path} is not the MTP sidecar of {trunk.path}: " + "; ".join(diffs[:3])
            + more)


#: "1": let llama.cpp enable pipeline parallelism on a model split over several devices
#: (its default). mtplib turns it off there (`_never_matching_override`).
PIPELINE_ENV = envs.PIPELINE_PARALLEL


class _BuftOverride(ctypes.Structure):
    """llama.h's ``llama_model_tensor_buft_override``: a tensor-name regex, a buffer type."""

    _fields_ = [("pattern", ctypes.c_char_p), ("buft", ctypes.c_void_p)]


def _never_matching_override() -> ctypes.Array:
    """A tensor override list whose one pattern matches no tensor name (``^$``): no
    tensor moves, but llama.cpp (llama-context.cpp, "pipeline_parallel") enables pipeline
    parallelism only on models without overrides, so a split model's scheduler keeps one
    copy of each split input (n_copies 1, not 4). With 4 copies every rebuilt graph takes
    the next copy's input tensors, so a step of a width seen before serializes to other
    bytes and ggml-rpc re-sends the whole graph (2-6 graphs per generation on the trained
    pair over 2 shards, even with patches/0006's slots); with one copy it never does. The
    cost: no overlap of a long prompt's ubatches across devices (docs/limitations.md)."""
    import llama_cpp

    g = ctypes.CDLL(str(Path(llama_cpp.__file__).parent / "lib" / "libggml.so"))
    g.ggml_backend_dev_by_type.argtypes = [ctypes.c_int]
    g.ggml_backend_dev_by_type.restype = ctypes.c_void_p
    g.ggml_backend_dev_buffer_type.argtypes = [ctypes.c_void_p]
    g.ggml_backend_dev_buffer_type.restype = ctypes.c_void_p
    cpu = g.ggml_backend_dev_by_type(0)  # GGML_BACKEND_DEVICE_TYPE_CPU
    if not cpu:
        raise UpstreamError("upstream has no CPU device")
    # the buffer type is never used (nothing matches); a valid one all the same
    return (_BuftOverride * 2)(_BuftOverride(b"^$", g.ggml_backend_dev_buffer_type(cpu)),
                               _BuftOverride(None, None))


class Model:
    """A loaded `deepseek4` GGUF: a trunk, or an `mtp-` sidecar with ``load_mtp``."""

    def __init__(self, path: str | Path, *, load_mtp: bool = False,
                 header: GGUFHeader | None = None, devices: Sequence | None = None,
                 tensor_split: Sequence[float] | None = None, validated: bool = False
                 ) -> None:
        """``validated``: ``header`` was validated for this request already (`check_pair`
        validates both files), so it is not validated again."""
        self.header = header or read_header(path)
        require_deepseek4(self.header)
        from mtplib.model.fixture import require_weights

        require_weights(self.header)
        if not (validated and header is not None):
            validate_header(self.header)  # every constraint upstream would abort on
        if load_mtp and not self.header.is_mtp_only:
            raise ModelFileError(f"{path}: load_mtp needs an MTP sidecar (mtp-*.gguf)")
        if not load_mtp and self.header.is_mtp_only:
            raise ModelFileError(f"{path} is an MTP sidecar; load it with load_mtp=True / --mtp")
        self.llama, self.ext = load()
        self.path = Path(path)
        self.load_mtp = load_mtp
        mp = self.llama.llama_model_default_params()
        mp.load_mtp = load_mtp
        if not extra_bufts_ok():  # an AMX host: upstream would abort on V4's Q8_0 weights
            mp.use_extra_bufts = False
        self._keep: list = []
        if devices:
            arr = (ctypes.c_void_p * (len(devices) + 1))(*devices, None)
            mp.devices = ctypes.cast(arr, ctypes.c_void_p)
            mp.n_gpu_layers = 0x7FFFFFFF
            mp.split_mode = 1  # LLAMA_SPLIT_MODE_LAYER
            self._keep.append(arr)
            if len(devices) > 1 and not envs.pipeline_parallel():
                ov = _never_matching_override()
                mp.tensor_buft_overrides = ctypes.cast(ov, ctypes.c_void_p)
                self._keep.append(ov)
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
        #: the RPC shards holding this model's layers (set by runtime.rpc; [] = this process)
        self.endpoints: list[str] = []

    def _live(self) -> None:
        """Refuse use after close(): upstream would read freed memory (a segfault)."""
        if not getattr(self, "ptr", None):
            raise RuntimeInputError(f"model {self.path} is closed")

    def tokenize(self, text: str, *, add_special: bool = True) -> list[int]:
        self._live()
        try:
            data = text.encode("utf-8")
        except UnicodeEncodeError as e:
            raise RuntimeInputError(f"the prompt is not valid UTF-8 text (undecodable byte "
                                    f"at character {e.start})") from None
        n_max = len(data) + 16
        buf = (self.llama.llama_token * n_max)()
        n = self.llama.llama_tokenize(self.vocab, data, len(data), buf, n_max, add_special, False)
        if n < 0:
            raise RuntimeInputError(f"prompt needs {-n} tokens, more than the buffer {n_max}")
        return list(buf[:n])

    def detokenize(self, tokens: Sequence[int]) -> str:
        self._live()
        toks = [int(t) for t in tokens]
        bad = [t for t in toks if not 0 <= t < self.n_vocab]
        if bad:  # upstream's id_to_token.at() throws through the C API (abort)
            raise RuntimeInputError(f"token id {bad[0]} out of range [0, {self.n_vocab})")
        out = []
        buf = ctypes.create_string_buffer(256)
        for t in toks:
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


@dataclass(frozen=True)
class ContextConfig(ContextSettings):
    """What a context is created with; recorded with every measurement. The seven options
    it shares with `DecodeSettings` (n_ctx, n_batch, n_ubatch, n_threads, kv_type,
    flash_attn, swa_full) are `ContextSettings`' (defaults and rules defined once); the
    rest is this context's own. Checked by `validate` (a Context validates its config)."""

    n_seq_max: int = 1
    n_rs_seq: int = 0  # tail-rollback depth (V4: set >= draft length)
    mtp: bool = False  # LLAMA_CONTEXT_TYPE_MTP
    nextn_rows: str = "off"  # off | all | masked: after-decode h_nextn rows
    no_perf: bool = True

    @classmethod
    def from_settings(cls, s: ContextSettings, **extra) -> ContextConfig:
        """The context for ``s`` (hidden_rows is the loop's, not the context's); ``extra``
        sets the fields settings do not hold (mtp, nextn_rows, n_rs_seq, n_seq_max, ...)."""
        return cls(**{**s.context_settings(), **extra})

    def validate(self) -> ContextConfig:
        errs = self.context_problems()
        if self.nextn_rows not in ("off", "all", "masked"):
            errs.append(f"nextn_rows {self.nextn_rows!r} not in off/all/masked")
        if not _is_int(self.n_seq_max) or self.n_seq_max < 1:
            errs.append(f"n_seq_max must be an integer >= 1, got {self.n_seq_max!r}")
        if _is_int(self.n_threads) and self.n_threads > max_threads():
            # thousands of threads crash upstream's thread pool (seen: a segfault at 100000)
            errs.append(f"n_threads {self.n_threads} exceeds this machine's "
                        f"{max_threads()} CPUs")
        if not _is_int(self.n_rs_seq) or self.n_rs_seq < 0:
            errs.append(f"n_rs_seq must be an int >= 0, got {self.n_rs_seq!r}")
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


def check_n_ctx(model: Model, n_ctx: int) -> None:
    """Refuse a context longer than the model was trained for (named as such, before any
    other check could blame something else, e.g. MTP support)."""
    if n_ctx > model.n_ctx_train:
        raise RuntimeInputError(
            f"n_ctx {n_ctx} exceeds the model's context_length {model.n_ctx_train}")


class Context:
    """A llama_context plus one reusable batch; every call validated first."""

    def __init__(self, model: Model, cfg: ContextConfig | None = None, *,
                 cb_eval: Callable | None = None) -> None:
        cfg = self.cfg = (cfg or ContextConfig()).validate()
        model._live()
        self.model = model
        llama = self.llama = model.llama
        if cfg.mtp and not model.load_mtp:
            raise RuntimeInputError("an MTP context needs a model loaded with load_mtp")
        check_n_ctx(model, cfg.n_ctx)
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
        #: upstream pads n_ctx up to a multiple of 256 (src/llama-context.cpp, GGML_PAD)
        #: and gives each of n_seq_max sequences n_ctx_seq cells of it (padded again)
        self.n_ctx_upstream = int(llama.llama_n_ctx(ctx))
        self.n_ctx_seq = int(llama.llama_n_ctx_seq(ctx))
        #: positions one sequence may use: what was asked, within its share of the cache
        #: (a --ctx 64 context holds 256 cells, but positions stop at 64; with n_seq_max 2
        #: a sequence past its share would fail mid-generation with "no KV slot")
        self.n_ctx = min(cfg.n_ctx, self.n_ctx_seq)
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
        self._last_flags: list[bool] = []

    def _live(self) -> None:
        """Refuse use after close() (of this context or its model): upstream would read
        freed memory and crash the process."""
        if not getattr(self, "ptr", None):
            raise RuntimeInputError("this context is closed")
        if not getattr(self.model, "ptr", None):
            raise RuntimeInputError(f"the model of this context ({self.model.path}) is closed")

    def _seq(self, seq_id: int, *, allow_all: bool = False) -> int:
        """A sequence id upstream accepts: 0..n_seq_max-1 (and -1 = all, where allowed);
        upstream asserts seq_id < n_seq_max (src/llama-kv-cache.cpp, -dsv4.cpp)."""
        if not _is_int(seq_id) or not (0 <= seq_id < self.n_seq_max
                                       or (allow_all and seq_id == -1)):
            allowed = f"[0, {self.n_seq_max})" + (" or -1 (all)" if allow_all else "")
            raise RuntimeInputError(f"seq_id {seq_id!r} outside {allowed}: the context was "
                                    f"created with n_seq_max={self.n_seq_max}")
        return int(seq_id)

    # -- decoding -----------------------------------------------------------------------
    def decode(self, tokens: Sequence[int], positions: Sequence[int], *,
               seq_id: int | Sequence[int] = 0, logits: Sequence[bool] | bool = False,
               rows: np.ndarray | None = None) -> None:
        """Decode one batch; ``logits`` marks the rows to output. ``seq_id``: the one
        sequence of every token, or one id per token (several sequences in one batch,
        each token in one sequence; positions increase within each)."""
        self._live()
        n = len(tokens)
        if n == 0:
            raise RuntimeInputError("empty batch")
        if n > self.n_batch:
            raise RuntimeInputError(
                f"batch of {n} tokens exceeds n_batch {self.n_batch}; split it (prefill chunks)")
        if len(positions) != n:
            raise RuntimeInputError(f"{n} tokens but {len(positions)} positions")
        if _is_int(seq_id):
            seqs = [self._seq(seq_id)] * n
        else:
            seqs = [self._seq(q) for q in seq_id]
            if len(seqs) != n:
                raise RuntimeInputError(f"{n} tokens but {len(seqs)} sequence ids")
        # plain Python on the (small) per-step batches: cheaper than numpy round trips
        if not all(_is_int(t) for t in tokens):  # int(1.5) would silently decode id 1
            bad = next(t for t in tokens if not _is_int(t))
            raise RuntimeInputError(f"token id {bad!r} is not an integer")
        toks = [int(t) for t in tokens]
        if min(toks) < 0 or max(toks) >= self.n_vocab:
            bad = next(t for t in toks if t < 0 or t >= self.n_vocab)
            raise RuntimeInputError(f"token id {bad} out of range [0, {self.n_vocab})")
        pos = [int(q) for q in positions]
        if min(pos) < 0 or max(pos) >= self.n_ctx:
            raise RuntimeInputError(
                f"positions {min(pos)}..{max(pos)} outside the context "
                f"[0, {self.n_ctx}); the prompt plus generated tokens exceed n_ctx")
        if len(set(seqs)) > 1:  # upstream's batch allocator aborts on positions that skip
            last: dict[int, int] = {}
            for q, p in zip(seqs, pos, strict=True):
                if q in last and p != last[q] + 1:
                    raise RuntimeInputError(f"sequence {q}'s positions in the batch are not "
                                            f"consecutive ({last[q]} then {p})")
                last[q] = p
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
            b_seq[i][0] = seqs[i]
            b_lg[i] = flags[i]
        b.n_tokens = n
        self.last_n_outputs = self.last_decode_len = 0  # nothing to read if it fails
        self._last_flags = []
        rc = int(self.llama.llama_decode(self.ptr, b))
        if rc != 0:
            raise UpstreamError(f"llama_decode returned {rc} (1: no KV slot; <0: error)")
        self.last_n_outputs = sum(flags)
        self.last_decode_len = n
        self._last_flags = flags

    def logits(self, i: int) -> np.ndarray:
        """Logits of batch token ``i`` of the last decode (upstream's index: the token's
        position in the batch, which must have been flagged; -1 = the last output)."""
        self._live()
        ok = _is_int(i) and ((-self.last_n_outputs <= i < 0) if i < 0 else (
            i < self.last_decode_len and self._last_flags[i]))
        if not ok:
            raise RuntimeInputError(
                f"no logits for batch token {i!r}: the last decode had {self.last_decode_len} "
                f"tokens, {self.last_n_outputs} flagged for output")
        p = self.llama.llama_get_logits_ith(self.ptr, int(i))
        if not p:
            raise UpstreamError(f"no logits for output {i}")
        return _copy_floats(p, self.n_vocab)

    def logits_all(self, n: int) -> np.ndarray:
        """Logits of every token of the last decode, (n, n_vocab) in batch order, in one
        copy; only when all n tokens were flagged (so output row i is batch token i)."""
        self._live()
        if n != self.last_decode_len or self.last_n_outputs != n:
            raise RuntimeInputError(f"logits_all({n}) needs a decode of {n} tokens, all "
                                    f"flagged (last: {self.last_decode_len} tokens, "
                                    f"{self.last_n_outputs} outputs)")
        p = self.llama.llama_get_logits(self.ptr)
        if not p:
            raise UpstreamError("upstream returned no logits")
        return _copy_floats(p, n * self.n_vocab).reshape(n, self.n_vocab)

    def nextn_rows(self, n: int) -> np.ndarray:
        """The `h_nextn` rows of the last decode (n rows of hc*n_embd floats): one per
        batch token ("all"), or one per flagged token ("masked")."""
        self._live()
        if self.cfg.nextn_rows == "off":
            raise RuntimeInputError("context was created without nextn rows")
        have = self.last_decode_len if self.cfg.nextn_rows == "all" else self.last_n_outputs
        if not _is_int(n) or not 1 <= n <= have:
            # upstream's buffer holds exactly the last decode's rows: more reads past it
            raise RuntimeInputError(
                f"nextn_rows({n!r}): the last decode left {have} row(s) "
                f"({self.cfg.nextn_rows}: {self.last_decode_len} tokens, "
                f"{self.last_n_outputs} flagged)")
        p = self.model.ext.llama_get_embeddings_nextn(self.ptr)
        if not p:
            raise UpstreamError("upstream returned no nextn rows")
        return _copy_floats(p, n * self.width).reshape(n, self.width)

    # -- memory ---------------------------------------------------------------------------
    def seq_rm(self, seq_id: int, p0: int, p1: int = -1) -> bool:
        """Remove positions [p0, p1) of ``seq_id`` (-1: every sequence; p1 -1: to the end)."""
        self._live()
        seq_id = self._seq(seq_id, allow_all=True)
        if not (_is_int(p0) and _is_int(p1)):
            raise RuntimeInputError(f"seq_rm positions must be ints, got {p0!r}, {p1!r}")
        return bool(self.llama.llama_memory_seq_rm(self.mem, seq_id, int(p0), int(p1)))

    def seq_pos_max(self, seq_id: int) -> int:
        self._live()
        return int(self.llama.llama_memory_seq_pos_max(self.mem, self._seq(seq_id)))

    def clear(self) -> None:
        self._live()
        self.llama.llama_memory_clear(self.mem, True)

    def state_size(self, seq_id: int) -> int:
        """Bytes of the sequence's cache state (what `state_get` would return)."""
        self._live()
        return int(self.llama.llama_state_seq_get_size(self.ptr, self._seq(seq_id)))

    def state_get(self, seq_id: int) -> bytes:
        self._live()
        seq_id = self._seq(seq_id)
        n = int(self.llama.llama_state_seq_get_size(self.ptr, seq_id))
        buf = (ctypes.c_uint8 * n)()
        got = int(self.llama.llama_state_seq_get_data(self.ptr, buf, n, seq_id))
        if got != n:
            raise UpstreamError(f"state_seq_get_data wrote {got} of {n} bytes")
        return bytes(buf)

    def state_set(self, seq_id: int, data: bytes) -> None:
        self._live()
        seq_id = self._seq(seq_id)
        if not isinstance(data, (bytes, bytearray, memoryview)) or not len(data):
            raise RuntimeInputError("state_set needs the non-empty bytes of a state_get")
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
