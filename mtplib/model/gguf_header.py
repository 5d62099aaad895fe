"""Read a GGUF's header (metadata + tensor table) without reading weights.

Used to validate files before upstream sees them (upstream aborts the process on some bad
inputs) and as the raw material of the ownership derivation. Tensor data is never
touched: `read_header` (gguf's reader) takes seconds on a 150 GB file, `read_header_fast`
(struct over an mmap, tokenizer arrays skipped) milliseconds.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

from mtplib.errors import InputError

GGUF_MAGIC = b"GGUF"


class ModelFileError(InputError):
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


def _gguf_path(path: str | Path) -> Path:
    """The path, once it is known to be an existing file starting with GGUF's magic."""
    p = Path(path)
    if not p.exists():
        raise ModelFileError(f"model file not found: {p}")
    if not p.is_file():
        raise ModelFileError(f"model path is not a file: {p}")
    with open(p, "rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC:
        raise ModelFileError(f"{p} is not a GGUF file (magic {magic!r}, expected b'GGUF')")
    return p


def read_header(path: str | Path, *, with_tokens: bool = True) -> GGUFHeader:
    """Parse the header; raise ModelFileError naming the problem for a bad file."""
    p = _gguf_path(path)
    import gguf

    try:
        reader = gguf.GGUFReader(str(p), "r")
    except Exception as e:  # noqa: BLE001 - any parse failure is a bad file
        raise ModelFileError(f"{p}: cannot parse GGUF header ({type(e).__name__}: {e})") from e
    kv: dict[str, object] = {}
    for name, field in reader.fields.items():
        if name.startswith("GGUF."):
            continue
        if not with_tokens and name in COUNT_ONLY_KEYS:
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


# -- the fast reader: struct over a read-only mmap -------------------------------------
_SCALAR = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
           10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
#: Arrays kept only as their length (tokenizer vocabularies: 100k+ strings, not needed).
COUNT_ONLY_KEYS = ("tokenizer.ggml.tokens", "tokenizer.ggml.scores", "tokenizer.ggml.merges",
                   "tokenizer.ggml.token_type")


def read_header_fast(path: str | Path) -> GGUFHeader:
    """`gguf_header.read_header(path, with_tokens=False)` in milliseconds instead of seconds.

    Parses the GGUF header with struct over a read-only mmap (the data region is never
    touched, so a sparse 150 GB file costs nothing). Tokenizer arrays are skipped and kept
    as "<N entries>", exactly like read_header(with_tokens=False).
    """
    return _read(path)[0]


def gguf_data_offset(path: str | Path) -> int:
    """Absolute file offset where a GGUF's data region starts (after the tensor infos)."""
    return _read(path)[1]


def _read(path: str | Path) -> tuple[GGUFHeader, int]:
    p = _gguf_path(path)
    with open(p, "rb") as f:
        try:
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
                return _parse(p, m)
        except (struct.error, ValueError, IndexError, UnicodeDecodeError) as e:
            raise ModelFileError(f"{p}: cannot parse GGUF header ({type(e).__name__}: {e})") from e


def _parse(p: Path, m: mmap.mmap) -> tuple[GGUFHeader, int]:
    import gguf

    pos = 4

    def take(fmt: str):
        nonlocal pos
        v = struct.unpack_from(fmt, m, pos)[0]
        pos += struct.calcsize(fmt)
        return v

    def string() -> str:
        nonlocal pos
        n = take("<Q")
        if pos + n > len(m):
            raise InputError("string runs past the end of the file")
        s = bytes(m[pos:pos + n]).decode("utf-8", "replace")
        pos += n
        return s

    def skip_string() -> None:
        nonlocal pos
        n = struct.unpack_from("<Q", m, pos)[0]
        pos += 8 + n

    def value(vtype: int):
        if vtype == _STRING:
            return string()
        if vtype in _SCALAR:
            return take(_SCALAR[vtype])
        raise InputError(f"unknown GGUF value type {vtype}")

    version = take("<I")
    if version not in (2, 3):
        raise InputError(f"unsupported GGUF version {version}")
    n_tensors, n_kv = take("<Q"), take("<Q")
    kv: dict[str, object] = {}
    for _ in range(n_kv):
        key = string()
        vtype = take("<I")
        if vtype != _ARRAY:
            kv[key] = value(vtype)
            continue
        etype, count = take("<I"), take("<Q")
        if key in COUNT_ONLY_KEYS:
            if etype == _STRING:
                for _ in range(count):
                    skip_string()
            else:
                pos += count * struct.calcsize(_SCALAR[etype])
            kv[key] = f"<{count} entries>"
        else:
            kv[key] = [value(etype) for _ in range(count)]
    infos = []
    for _ in range(n_tensors):
        name = string()
        n_dims = take("<I")
        ne = tuple(take("<Q") for _ in range(n_dims))
        ttype = take("<I")
        offset = take("<Q")
        infos.append((name, ne, ttype, offset))
    align = int(kv.get("general.alignment", 32))
    data_start = (pos + align - 1) // align * align
    tensors = []
    for name, ne, ttype, offset in infos:
        qt = gguf.GGMLQuantizationType(ttype)
        block, size = gguf.GGML_QUANT_SIZES[qt]
        n = 1
        for d in ne:
            n *= d
        tensors.append(TensorRecord(name=name, ne=ne, dtype=qt.name, nbytes=n // block * size,
                                    offset=data_start + offset, block=block_of(name)))
    return GGUFHeader(p, kv, tuple(tensors)), data_start


def require_deepseek4(h: GGUFHeader) -> None:
    if h.arch != "deepseek4":
        raise ModelFileError(
            f"{h.path}: architecture is {h.arch!r}, mtplib needs 'deepseek4' (DeepSeek-V4)")
