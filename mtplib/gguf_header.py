"""Read a GGUF's header (metadata + tensor table) without reading weights.

Used to validate files before upstream sees them (upstream aborts the process on some bad
inputs) and as the raw material of the ownership derivation. A 150 GB file takes seconds:
only the header is parsed; tensor data is never touched.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

GGUF_MAGIC = b"GGUF"


class ModelFileError(ValueError):
    """A model path that is missing, not a GGUF, or not the model we need."""


@dataclass(frozen=True)
class TensorRecord:
    """One tensor as the file stores it."""

    name: str
    ne: tuple[int, ...]  # ggml order
    dtype: str  # ggml type name, e.g. F32, BF16, Q8_0
    nbytes: int
    offset: int  # absolute file offset of the data
    block: int | None  # the N of blk.N.*, None for root tensors


@dataclass(frozen=True)
class GGUFHeader:
    path: Path
    kv: dict[str, object]
    tensors: tuple[TensorRecord, ...]

    @property
    def arch(self) -> str:
        return str(self.kv.get("general.architecture", ""))

    @property
    def n_vocab(self) -> int:
        toks = self.kv.get("tokenizer.ggml.tokens")
        if isinstance(toks, list):
            return len(toks)
        for t in self.tensors:
            if t.name == "token_embd.weight":
                return t.ne[1]
        return 0

    def names(self) -> set[str]:
        return {t.name for t in self.tensors}

    def tensor(self, name: str) -> TensorRecord | None:
        for t in self.tensors:
            if t.name == name:
                return t
        return None

    @property
    def is_mtp_only(self) -> bool:
        """Upstream's rule (deepseek4.cpp): nextn layers present and no blk.0.attn_norm."""
        n_nextn = int(self.kv.get(f"{self.arch}.nextn_predict_layers", 0) or 0)
        return n_nextn > 0 and "blk.0.attn_norm.weight" not in self.names()


def block_of(name: str) -> int | None:
    """The N of a `blk.N.*` tensor name; None for root tensors."""
    if name.startswith("blk."):
        try:
            return int(name.split(".")[1])
        except (IndexError, ValueError):
            return None
    return None


def _value(field) -> object:  # gguf.ReaderField -> python value
    import gguf

    types = field.types
    if not types:
        return None
    if types[0] == gguf.GGUFValueType.ARRAY:
        if len(types) > 1 and types[1] == gguf.GGUFValueType.STRING:
            return [bytes(field.parts[i]).decode("utf-8", "replace") for i in field.data]
        return [field.parts[i].tolist()[0] for i in field.data]
    if types[0] == gguf.GGUFValueType.STRING:
        return bytes(field.parts[field.data[0]]).decode("utf-8", "replace")
    return field.parts[field.data[0]].tolist()[0]


def read_header(path: str | Path, *, with_tokens: bool = True) -> GGUFHeader:
    """Parse the header; raise ModelFileError naming the problem for a bad file."""
    p = Path(path)
    if not p.exists():
        raise ModelFileError(f"model file not found: {p}")
    if not p.is_file():
        raise ModelFileError(f"model path is not a file: {p}")
    with open(p, "rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC:
        raise ModelFileError(f"{p} is not a GGUF file (magic {magic!r}, expected b'GGUF')")
    import gguf

    try:
        reader = gguf.GGUFReader(str(p), "r")
    except Exception as e:  # noqa: BLE001 - any parse failure is a bad file
        raise ModelFileError(f"{p}: cannot parse GGUF header ({type(e).__name__}: {e})") from e
    kv: dict[str, object] = {}
    for name, field in reader.fields.items():
        if name.startswith("GGUF."):
            continue
        if not with_tokens and name in ("tokenizer.ggml.tokens", "tokenizer.ggml.scores",
                                        "tokenizer.ggml.merges", "tokenizer.ggml.token_type"):
            kv[name] = f"<{len(field.data)} entries>"
            continue
        kv[name] = _value(field)
    tensors = tuple(
        TensorRecord(
            name=t.name,
            ne=tuple(int(x) for x in t.shape),
            dtype=t.tensor_type.name,
            nbytes=int(t.n_bytes),
            offset=int(t.data_offset),
            block=block_of(t.name),
        )
        for t in reader.tensors
    )
    return GGUFHeader(p, kv, tensors)


def require_deepseek4(h: GGUFHeader) -> None:
    if h.arch != "deepseek4":
        raise ModelFileError(
            f"{h.path}: architecture is {h.arch!r}, mtplib needs 'deepseek4' (DeepSeek-V4)")
