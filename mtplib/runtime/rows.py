"""The trunk's `h_nextn` rows an MTP step drafts from: where each decode's rows are read.

With the pinned upstream, the rows `llama_get_embeddings_nextn` returns after a main-graph
decode are wrong in some context configurations while the logits of the same decode are
right (evidence/upstream-bugs/README.md). The tensor named ``h_nextn``, observed through
the context's eval callback once it is computed, is right. What the engines and the llama
adapter use every step lives here:

* `CapturedRows`: captures that tensor (installed as the target context's ``cb_eval``),
* `read_rows`: a decode's rows from the source `mtplib.runtime.row_source` chose,
* `force_reserve`: the scheduler workaround (below),
* `HeadWeights` / `client_head`: the trunk's hc head, output_norm and output in numpy (a
  runtime that runs the output head itself, and the check that verifies captured rows).

Which source a configuration gets is decided in `mtplib.runtime.row_source`, by the check
in `mtplib.runtime.hidden_check`.

Root cause found while writing the check (see the write-up): `llama_set_embeddings_nextn`
marks `h_nextn` as a graph output but does not make the scheduler reserve again, so a
decode whose graph matches the reserved one reuses an allocation plan in which the last
layer's output memory is recycled by the hc head. `force_reserve` is a no-op API call
that makes upstream reserve again; the check says whether it repairs the API rows.
"""

from __future__ import annotations

import ctypes
import re
from pathlib import Path

import numpy as np

from mtplib.errors import InputError, UpstreamFault
from mtplib.runtime import ggml_tensor as gt
from mtplib.runtime.model import Context, ContextConfig, Model, RuntimeInputError

HIDDEN_NODE = "h_nextn"
_NODE_KEY = HIDDEN_NODE.encode() + b"\0"  # compared against the tensor's name bytes
_NAME_OFFSET = gt.GGMLTensor.name.offset
#: Above this vocabulary size the head recompute uses a deterministic subset of ids.
FULL_VOCAB_MAX = 8192


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
