"""Hidden-state integrity: the trunk's `h_nextn` rows the MTP block drafts from.

With the pinned upstream, the rows `llama_get_embeddings_nextn` returns after a main-graph
decode are wrong in some context configurations while the logits of the same decode are
right (evidence/upstream-bugs/README.md). The tensor named ``h_nextn``, observed through
the context's eval callback once it is computed, is right. This module

* captures that tensor (`CapturedRows`, installed as the target context's ``cb_eval``),
* checks the API rows against the captured rows, and the captured rows against the
  logits of the same decode (`check_hidden`): the trunk's hc head, output_norm and output
  recomputed in numpy from the root tensors read from the GGUF must give upstream's
  logits, so ``capture_ok`` is a measured fact, not an assumption,
* decides per context configuration where the MTP loop takes its rows from
  (`choose_row_source`: "api", "captured", or "unsupported", fail-closed),
* runs a configuration matrix (`hidden_matrix`) and measures what capture costs
  (`capture_cost`).

Root cause found while writing this (see the write-up): `llama_set_embeddings_nextn`
marks `h_nextn` as a graph output but does not make the scheduler reserve again, so a
decode whose graph matches the reserved one reuses an allocation plan in which the last
layer's output memory is recycled by the hc head. `force_reserve` is a no-op API call
that makes upstream reserve again; the report says whether it repairs the API rows.
"""

from __future__ import annotations

import ctypes
import itertools
import os
import re
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path

import numpy as np

from mtplib import pins
from mtplib.errors import InputError, UpstreamFault
from mtplib.runtime import ggml_tensor as gt
from mtplib.runtime.model import Context, ContextConfig, Model, RuntimeInputError

HIDDEN_NODE = "h_nextn"
_NODE_KEY = HIDDEN_NODE.encode() + b"\0"  # compared against the tensor's name bytes
_NAME_OFFSET = gt.GGMLTensor.name.offset
#: Captured vs API rows: a row is bad when it differs by more than this, relative to the
#: row scale (max(1, max|row|)). Equal memory gives 0; a garbage row differs by O(1).
ROW_TOL = 1e-5
#: Captured rows vs logits: recomputed and upstream logits may differ by this much,
#: relative to max(1, max|logits|) (fixture: ~1e-7 relative; garbage rows: ~1).
LOGITS_RTOL = 1e-2
#: Above this vocabulary size the head recompute uses a deterministic subset of ids.
FULL_VOCAB_MAX = 8192
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


class CaptureError(UpstreamFault):
    """The eval callback did not deliver the rows of the last decode."""


# ---------------------------------------------------------------------------------------
# capture
# ---------------------------------------------------------------------------------------
class CapturedRows:
    """Captures the ``h_nextn`` node of every main-graph decode through ``cb_eval``.

    Install ``capture.callback`` as the target context's ``cb_eval`` (or use `open`).
    It answers "ask" with yes only for the node named ``h_nextn``, so the scheduler runs
    the graph in one piece up to that node and in one piece after it. Upstream computes a
    batch in ubatches and the callback fires once per ubatch: the parts are kept in order.
    After each decode, `take(n)` returns that decode's rows, float32 (n, hc*n_embd):
    one row per batch token with unmasked rows, one per output row with masked rows.
    """

    def __init__(self, width: int) -> None:
        if width < 1:
            raise InputError("width must be >= 1")
        self.width = int(width)
        self._parts: list[np.ndarray] = []
        self.errors: list[str] = []
        self.n_fired = 0
        self.callback = self._raw  # pass as Context(cb_eval=...)

    def open(self, model: Model, cfg: ContextConfig) -> Context:
        """A context on ``model`` with this capture installed."""
        if self.width != model.n_embd_out:
            raise RuntimeInputError(
                f"capture width {self.width} != the model's hc*n_embd {model.n_embd_out}")
        return Context(model, cfg, cb_eval=self.callback)

    def _raw(self, ptr: int | None, ask: bool, _user: int | None) -> bool:
        if not ptr:
            return False
        if ask:  # every node is asked: keep this path cheap (no struct, no decode)
            try:
                return ctypes.string_at(ptr + _NAME_OFFSET, len(_NODE_KEY)) == _NODE_KEY
            except Exception as e:  # noqa: BLE001 - nothing may cross into C
                self.errors.append(f"{type(e).__name__}: {e}")
                return False
        try:
            self.n_fired += 1
            t = gt.as_tensor(ptr)  # checks the struct layout on first use
            if gt.name(t) != HIDDEN_NODE:
                raise CaptureError(f"asked for {HIDDEN_NODE}, got {gt.name(t)!r}")
            a = gt.read_f32(t)
            if a.size % self.width:
                raise CaptureError(
                    f"{HIDDEN_NODE} has shape {a.shape}, not a multiple of width {self.width}")
            self._parts.append(a.reshape(-1, self.width).copy())
        except Exception as e:  # noqa: BLE001 - nothing may cross into C; take() reports it
            self.errors.append(f"{type(e).__name__}: {e}")
        return True  # never abort upstream's graph: the logits must still come out

    @property
    def pending(self) -> int:
        """Rows captured since the last `take`/`reset`."""
        return sum(p.shape[0] for p in self._parts)

    def reset(self) -> None:
        """Drop what was captured (call it after a failed decode)."""
        self._parts.clear()
        self.errors.clear()

    def take(self, n: int) -> np.ndarray:
        """The ``n`` rows of the last decode; raises `CaptureError` if they did not come."""
        parts, errors = self._parts, self.errors
        self._parts, self.errors = [], []
        if errors:
            raise CaptureError("capture failed: " + "; ".join(errors))
        got = sum(p.shape[0] for p in parts)
        if n < 1:
            raise CaptureError(f"take({n}): a decode has at least one row")
        if got != n:
            raise CaptureError(
                f"captured {got} {HIDDEN_NODE} rows, expected {n} (was the context created "
                f"with nextn rows on and this capture as cb_eval?)")
        rows = np.concatenate(parts) if len(parts) > 1 else parts[0]
        return np.ascontiguousarray(rows, dtype=np.float32)


def read_rows(mode: str, ctx: Context, capture: CapturedRows | None, n: int) -> np.ndarray:
    """Rows of the last decode from the source `choose_row_source` picked."""
    if mode == "api":
        if capture is not None and capture.pending:
            capture.reset()  # a capture installed alongside must not pile up
        return ctx.nextn_rows(n)
    if mode == "captured":
        if capture is None:
            raise RuntimeInputError("row source 'captured' needs the CapturedRows of ctx")
        return capture.take(n)
    raise RuntimeInputError(f"no hidden rows from row source {mode!r}")


def force_reserve(ctx: Context) -> None:
    """Make upstream reserve its compute graph again before the next decode.

    `llama_set_embeddings_nextn` does not (upstream leaves `sched_need_reserve = true`
    commented out). Clearing the control vector (data = NULL) is a documented no-op for a
    context without one and sets that flag. Only for contexts that use no control vector.
    """
    rc = int(ctx.llama.llama_set_adapter_cvec(ctx.ptr, None, 0, ctx.model.n_embd, -1, -1))
    if rc != 0:
        raise UpstreamFault(f"llama_set_adapter_cvec(NULL) returned {rc}")


# ---------------------------------------------------------------------------------------
# the trunk's head in numpy (v4-graph-math.md §9)
# ---------------------------------------------------------------------------------------
def _split_siblings(path: Path) -> list[Path]:
    """The other files of a split GGUF (NAME-00001-of-00003.gguf), else []."""
    m = re.fullmatch(r"(.*)-(\d{5})-of-(\d{5})\.gguf", path.name)
    if not m:
        return []
    n = int(m.group(3))
    others = [path.with_name(f"{m.group(1)}-{i:05d}-of-{n:05d}.gguf") for i in range(1, n + 1)]
    return [p for p in others if p != path and p.exists()]


class HeadWeights:
    """The trunk's root tensors: hc head, output_norm, output (read through gguf)."""

    def __init__(self, path: str | Path, *, vocab_ids: np.ndarray | None = None,
                 full: bool = False, dtype: type = np.float64) -> None:
        """``full``: every vocab id (a head that samples); else a subset above
        FULL_VOCAB_MAX (a check). ``dtype``: float64 for checks, float32 to run."""
        import gguf

        r = gguf.GGUFReader(str(path))
        tensors = {t.name: t for t in r.tensors}
        for other in _split_siblings(Path(path)):  # a split GGUF: root tensors may be anywhere
            tensors.update({t.name: t for t in gguf.GGUFReader(str(other)).tensors})
        need = ("output_hc_fn.weight", "output_hc_base.weight", "output_hc_scale.weight",
                "output_norm.weight", "output.weight")
        missing = [n for n in need if n not in tensors]
        if missing:
            raise CaptureError(f"{path} lacks {', '.join(missing)}: cannot recompute the head")

        def field(key: str) -> float:
            f = r.fields.get("deepseek4." + key)
            if f is None:
                raise CaptureError(f"{path} lacks deepseek4.{key}")
            return float(f.parts[f.data[0]][0])

        def dense(name: str, rows: np.ndarray | None = None) -> np.ndarray:
            t = tensors[name]
            data = np.asarray(t.data)
            if rows is not None:
                data = data[rows]
            if t.tensor_type not in (gguf.GGMLQuantizationType.F32,
                                     gguf.GGMLQuantizationType.F16):
                data = gguf.quants.dequantize(data, t.tensor_type)
            return np.asarray(data, dtype=dtype)

        self.eps = field("attention.layer_norm_rms_epsilon")
        self.hc_eps = field("hyper_connection.epsilon")
        self.hc_fn = dense("output_hc_fn.weight")  # (hc, hc*E)
        self.hc_base = dense("output_hc_base.weight").reshape(-1)
        self.hc_scale = dense("output_hc_scale.weight").reshape(-1)
        self.norm = dense("output_norm.weight").reshape(-1)
        self.hc = self.hc_fn.shape[0]
        self.n_embd = self.norm.shape[0]
        self.n_vocab = int(tensors["output.weight"].shape[-1])
        self.dtype = dtype
        if vocab_ids is None and not full and self.n_vocab > FULL_VOCAB_MAX:
            rng = np.random.default_rng(0)
            vocab_ids = np.sort(rng.choice(self.n_vocab, FULL_VOCAB_MAX, replace=False))
        self.vocab_ids = None if vocab_ids is None else np.asarray(vocab_ids, dtype=np.int64)
        self.out = dense("output.weight", self.vocab_ids)  # (V or |ids|, E)

    def logits(self, rows: np.ndarray) -> np.ndarray:
        """hc head -> output_norm -> output for hidden rows (n, hc*E), in self.dtype."""
        x = np.asarray(rows, dtype=self.dtype)
        n = x.shape[0]

        def rms(v: np.ndarray) -> np.ndarray:
            return v / np.sqrt((v * v).mean(-1, keepdims=True) + self.eps)

        mix = rms(x) @ self.hc_fn.T
        pre = 1.0 / (1.0 + np.exp(-(mix * self.hc_scale[0] + self.hc_base))) + self.hc_eps
        y = (pre[:, :, None] * x.reshape(n, self.hc, self.n_embd)).sum(1)
        return (rms(y) * self.norm) @ self.out.T

    def compare(self, rows: np.ndarray, logits: np.ndarray) -> tuple[float, float]:
        """(max |recomputed - upstream|, max |upstream|) over the compared vocab ids."""
        if rows.shape[0] == 0:
            return 0.0, 0.0
        ref = logits if self.vocab_ids is None else logits[:, self.vocab_ids]
        return (float(np.abs(self.logits(rows) - ref).max()), float(np.abs(ref).max()))


_HEADS: dict[tuple, HeadWeights] = {}


def client_head(path: str | Path) -> HeadWeights:
    """The full-vocabulary float32 head of a trunk file, read once per file version: a
    runtime that runs the output head itself builds an engine per generation (ranged), and
    the head's weights (for V4-Flash about a gigabyte) need not be read again each time."""
    p = Path(path).resolve()
    st = p.stat()
    key = (str(p), st.st_size, st.st_mtime_ns)
    if key not in _HEADS:
        _HEADS.clear()  # one trunk at a time in a process
        _HEADS[key] = HeadWeights(p, full=True, dtype=np.float32)
    return _HEADS[key]


def logits_consistent(diff: float, scale: float) -> bool:
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


# ---------------------------------------------------------------------------------------
# the decision
# ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class RowSourceDecision:
    mode: str  # "api" | "captured" | "unsupported"
    reason: str
    report: dict

    def to_dict(self) -> dict:
        return asdict(self)


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


_DECISIONS: dict[str, RowSourceDecision] = {}
#: bump when the check itself changes, so decisions cached on disk are made again
CHECK_VERSION = 2


def clear_cache(*, disk: bool = False) -> None:
    """Forget the decisions made in this process (and, ``disk``, those on disk)."""
    _DECISIONS.clear()
    if disk:
        for p in _cache_dir().glob("*.json"):
            p.unlink(missing_ok=True)


def _cache_dir() -> Path:
    root = os.environ.get("MTPLIB_CACHE_DIR") or Path.home() / ".cache" / "mtplib"
    return Path(root) / "row-source"


def _cache_key(path: Path, c: ContextConfig, reserve: bool,
               followups: Sequence[tuple[int, str]]) -> dict:
    """Everything the decision depends on: the pinned upstream, the model file, every
    context parameter (swa_full and n_seq_max change the graph and the cache layout, so a
    check made with one setting says nothing about the other), masking, the reserve fix
    and the decode shapes checked."""
    p = path.resolve()
    st = p.stat()
    return {"check": CHECK_VERSION, "upstream": pins.LLAMA_CPP_COMMIT, "model": str(p),
            "size": st.st_size, "mtime_ns": st.st_mtime_ns,
            "context": {f.name: getattr(c, f.name) for f in fields(ContextConfig)
                        if f.name != "no_perf"},
            "reserve": bool(reserve), "followups": [list(f) for f in followups]}


def _key_id(key: dict) -> str:
    import hashlib
    import json

    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:32]


def _load_decision(key: dict) -> RowSourceDecision | None:
    import json

    p = _cache_dir() / f"{_key_id(key)}.json"
    try:
        d = json.loads(p.read_text())
    except (OSError, ValueError):
        return None
    if d.get("key") != key or d.get("mode") not in ("api", "captured", "unsupported"):
        return None
    return RowSourceDecision(d["mode"], d["reason"], d.get("report", {}))


def _store_decision(key: dict, d: RowSourceDecision) -> None:
    from mtplib.files import write_json

    p = _cache_dir() / f"{_key_id(key)}.json"
    try:
        p.parent.mkdir(parents=True, exist_ok=True)
        write_json(p, {"key": key, **d.to_dict()}, indent=None, default=str, end="")
    except OSError:  # a read-only home: the decision is still made, just not kept
        pass


def check_length(c: ContextConfig, followups: Sequence[tuple[int, str]] = FOLLOWUPS) -> int:
    """A prompt that spans about three ubatches and fits the context with the follow-ups."""
    n_ub = min(c.n_ubatch, c.n_batch, c.n_ctx)
    room = c.n_ctx // max(1, c.n_seq_max) - sum(n for n, _ in followups)  # one sequence's share
    return max(1, min(2 * n_ub + 3, room))


def choose_row_source(model: str | Path | Model, ctx_cfg: ContextConfig | dict, *,
                      n_tokens: int | None = None, reserve: bool = False,
                      use_cache: bool = True) -> RowSourceDecision:
    """Where the MTP loop takes the target's rows from, for this context configuration.

    Runs `check_hidden` once per complete key (`_cache_key`: pin, model file, every context
    parameter, masked, reserve) on throwaway contexts, and keeps the decision in this
    process and on disk (``~/.cache/mtplib/row-source``, or ``$MTPLIB_CACHE_DIR``), so a
    new process, a notebook kernel or a shard worker does not check again. A model loaded
    across RPC shards is checked on a local CPU load of the same file: the answer never
    costs shard round trips. Masked comes from ``ctx_cfg.nextn_rows``.
    "api": the API rows were right; "captured": they were wrong but the captured rows
    check out against the logits; "unsupported": neither can be trusted (do not draft).
    ``reserve``: the caller calls `force_reserve` on its target context; the check does too.
    The check samples decode shapes (a multi-ubatch prompt, 1-4 tokens, an 8-token chunk);
    "api" is as good as that sample (on the fixture the outcome was the same for every
    decode length 1..64 of a configuration).
    """
    cfg = ctx_cfg if isinstance(ctx_cfg, ContextConfig) else ContextConfig(**ctx_cfg)
    masked = cfg.nextn_rows == "masked"
    c = as_config(cfg, masked)
    path = model.path if isinstance(model, Model) else Path(model)
    fups = FOLLOWUPS + (() if masked else ROWS_ONLY_FOLLOWUPS)
    key = _cache_key(path, c, reserve, fups)
    kid = _key_id(key)
    if use_cache:
        if kid in _DECISIONS:
            return _DECISIONS[kid]
        d = _load_decision(key)
        if d is not None:
            _DECISIONS[kid] = d
            return d
    if isinstance(model, Model) and getattr(model, "endpoints", None):
        model = path  # ranged: check a local CPU load, not through the shards
    n = n_tokens or check_length(c, fups)
    local = None
    try:
        if not isinstance(model, Model):  # CPU only: a process with RPC shards registered
            from mtplib.runtime.rpc import cpu_device  # would spread a default load on them

            model = local = Model(model, devices=[cpu_device()])
        report = check_hidden(model, c, n, masked, reserve=reserve, followups=fups)
    except Exception as e:  # noqa: BLE001 - any failure of the check is fail-closed
        report = {"error": f"{type(e).__name__}: {e}", "capture_ok": False,
                  "config": {f: getattr(c, f) for f in CONFIG_FIELDS} | {"masked": masked}}
    finally:
        if local is not None:
            local.close()
    mode, reason = decide(report)
    d = RowSourceDecision(mode, reason, report)
    if use_cache and "error" not in report:
        _DECISIONS[kid] = d
        _store_decision(key, d)
    return d


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
