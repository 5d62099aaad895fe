"""Read a GGUF's header (metadata + tensor table) without reading weights.

Used to validate files before upstream sees them (upstream aborts the process on some bad
inputs) and as the raw material of the ownership derivation. Tensor data is never
touched: `read_header` (gguf's reader) takes seconds on a 150 GB file, `read_header_fast`
(struct over an mmap, tokenizer arrays skipped) milliseconds.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass, field
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
    #: key -> (GGUF value type, element type of an array or None): upstream reads keys by
    #: exact type, so validation needs them (model/validate.py)
    kv_types: dict[str, tuple[int, int | None]] = field(default_factory=dict, compare=False)
    #: key -> element count of every array key (also of arrays kept as "<N entries>")
    array_lengths: dict[str, int] = field(default_factory=dict, compare=False)
    data_offset: int | None = None  # absolute file offset of the (aligned) data region

    @property
    def arch(self) -> str:
        return str(self.kv.get("general.architecture", ""))

    @property
    def n_vocab(self) -> int:
        toks = self.kv.get("tokenizer.ggml.tokens")
        if isinstance(toks, list):
            return len(toks)
        if "tokenizer.ggml.tokens" in self.array_lengths:
            return self.array_lengths["tokenizer.ggml.tokens"]
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
        n_nextn = self.kv.get(f"{self.arch}.nextn_predict_layers", 0)
        return (isinstance(n_nextn, int) and n_nextn > 0
                and "blk.0.attn_norm.weight" not in self.names())


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
    _read(p)  # mtplib's own structural checks first: one-line messages gguf-py lacks
    import gguf

    try:
        reader = gguf.GGUFReader(str(p), "r")
    except Exception as e:  # noqa: BLE001 - any parse failure is a bad file
        raise ModelFileError(f"{p}: cannot parse GGUF header ({_one_line(e)})") from e
    kv: dict[str, object] = {}
    types: dict[str, tuple[int, int | None]] = {}
    lengths: dict[str, int] = {}
    for name, field_ in reader.fields.items():
        if name.startswith("GGUF."):
            continue
        t = [int(x) for x in field_.types]
        types[name] = (t[0], t[1] if len(t) > 1 and t[0] == _ARRAY else None) if t else (-1, None)
        if t and t[0] == _ARRAY:
            lengths[name] = len(field_.data)
        if not with_tokens and name in COUNT_ONLY_KEYS:
            kv[name] = f"<{len(field_.data)} entries>"
            continue
        kv[name] = _value(field_)
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
    return GGUFHeader(p, kv, tensors, types, lengths, int(reader.data_offset))


# -- GGUF value types and ggml tensor types (ggml/src/gguf.cpp, ggml/include/ggml.h) ----
_SCALAR = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
           10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
GGUF_TYPE_NAMES = {0: "u8", 1: "i8", 2: "u16", 3: "i16", 4: "u32", 5: "i32", 6: "f32",
                   7: "bool", 8: "string", 9: "array", 10: "u64", 11: "i64", 12: "f64"}
#: ggml type id -> (name as gguf-py spells it, elements per block, bytes per block), from
#: ggml.c type_traits and ggml-common.h at the pin. Removed ids (4, 5, 31-33, 36-38) are
#: absent: gguf.cpp refuses them (blck_size 0), and so do mtplib's readers.
GGML_TYPES: dict[int, tuple[str, int, int]] = {
    0: ("F32", 1, 4), 1: ("F16", 1, 2), 2: ("Q4_0", 32, 18), 3: ("Q4_1", 32, 20),
    6: ("Q5_0", 32, 22), 7: ("Q5_1", 32, 24), 8: ("Q8_0", 32, 34), 9: ("Q8_1", 32, 40),
    10: ("Q2_K", 256, 84), 11: ("Q3_K", 256, 110), 12: ("Q4_K", 256, 144),
    13: ("Q5_K", 256, 176), 14: ("Q6_K", 256, 210), 15: ("Q8_K", 256, 292),
    16: ("IQ2_XXS", 256, 66), 17: ("IQ2_XS", 256, 74), 18: ("IQ3_XXS", 256, 98),
    19: ("IQ1_S", 256, 50), 20: ("IQ4_NL", 32, 18), 21: ("IQ3_S", 256, 110),
    22: ("IQ2_S", 256, 82), 23: ("IQ4_XS", 256, 136), 24: ("I8", 1, 1), 25: ("I16", 1, 2),
    26: ("I32", 1, 4), 27: ("I64", 1, 8), 28: ("F64", 1, 8), 29: ("IQ1_M", 256, 56),
    30: ("BF16", 1, 2), 34: ("TQ1_0", 256, 54), 35: ("TQ2_0", 256, 66),
    39: ("MXFP4", 32, 17), 40: ("NVFP4", 64, 36), 41: ("Q1_0", 128, 18), 42: ("Q2_0", 64, 18),
}
GGML_TYPE_BY_NAME = {name: (block, size) for name, block, size in GGML_TYPES.values()}
GGML_MAX_DIMS = 4  # ggml.h
GGML_MAX_NAME = 64  # ggml.h: gguf.cpp refuses a tensor name of 64 bytes or more
INT64_MAX = 2**63 - 1
#: Arrays kept only as their length (tokenizer vocabularies: 100k+ strings, not needed).
COUNT_ONLY_KEYS = ("tokenizer.ggml.tokens", "tokenizer.ggml.scores", "tokenizer.ggml.merges",
                   "tokenizer.ggml.token_type")


def tensor_nbytes(dtype: str, ne: tuple[int, ...]) -> int:
    """Bytes of a contiguous tensor of ``dtype`` (a GGML_TYPES name) and shape ``ne``."""
    block, size = GGML_TYPE_BY_NAME[dtype]
    n = 1
    for d in ne:
        n *= d
    return n // block * size


def layout_problem(h: GGUFHeader) -> tuple[str, str, str] | None:
    """(what, value, rule) of the first tensor whose data is not where upstream needs it,
    else None: the alignment (ggml/src/gguf.cpp:623-635), known types with whole blocks per
    row (gguf.cpp:729-744), tensors packed in order, each padded to the alignment
    (gguf.cpp:790-800), and data inside the file (src/llama-model-loader.h:47)."""
    align = h.kv.get("general.alignment", 32)
    if "general.alignment" in h.kv and h.kv_types.get("general.alignment", (4,))[0] != 4:
        return "general.alignment", repr(align), "must be a u32"
    if isinstance(align, bool) or not isinstance(align, int) or align <= 0 \
            or align & (align - 1):
        return "general.alignment", repr(align), "must be a non-zero power of 2"
    try:
        size = h.path.stat().st_size
    except OSError:
        size = None
    expected = 0
    for t in h.tensors:
        if t.dtype not in GGML_TYPE_BY_NAME:
            return f"tensor {t.name} dtype", repr(t.dtype), "not a ggml type"
        block, _ = GGML_TYPE_BY_NAME[t.dtype]
        if t.ne and t.ne[0] % block:
            return (f"tensor {t.name} ne[0]", str(t.ne[0]),
                    f"not a multiple of {t.dtype}'s block size {block}")
        nbytes = tensor_nbytes(t.dtype, t.ne)
        if h.data_offset is not None:
            rel = t.offset - h.data_offset
            if rel != expected:
                return (f"tensor {t.name} offset", str(rel), f"must be {expected} (tensors "
                        f"are packed in order, each padded to the alignment {align})")
            expected += (nbytes + align - 1) // align * align
        if size is not None and t.offset + nbytes > size:
            return (f"tensor {t.name} data", f"bytes {t.offset}..{t.offset + nbytes}",
                    f"runs past the end of the file ({size} bytes): truncated or corrupt")
    return None


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split())
    return f"{type(e).__name__}: {text[:240]}" + ("..." if len(text) > 240 else "")


def read_header_fast(path: str | Path) -> GGUFHeader:
    """`gguf_header.read_header(path, with_tokens=False)` in milliseconds instead of seconds.

    Parses the GGUF header with struct over a read-only mmap (the data region is never
    touched, so a sparse 150 GB file costs nothing). Tokenizer arrays are skipped and kept
    as "<N entries>", exactly like read_header(with_tokens=False). Refuses, with one line,
    what gguf.cpp's own reader refuses (unknown value or tensor types, a bad alignment,
    duplicate keys or tensor names, more than 4 dims, ...); what the values mean is
    model/validate.py's business.
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
                h, start = _parse(p, m)
        except _Bad as e:
            raise ModelFileError(f"{p}: cannot parse GGUF header ({e})") from None
        except (struct.error, ValueError, IndexError, OverflowError, MemoryError) as e:
            raise ModelFileError(f"{p}: cannot parse GGUF header ({_one_line(e)})") from e
    bad = layout_problem(h)
    if bad:
        what = bad[0] if bad[0].isprintable() else repr(bad[0])  # a name from the file
        raise ModelFileError(f"{p}: {what} = {bad[1]}: {bad[2]}")
    return h, start


class _Bad(Exception):
    """A header gguf.cpp would refuse (internal: _read turns it into ModelFileError)."""


def _parse(p: Path, m: mmap.mmap) -> tuple[GGUFHeader, int]:
    pos = 4
    size = len(m)

    def take(fmt: str):
        nonlocal pos
        v = struct.unpack_from(fmt, m, pos)[0]
        pos += struct.calcsize(fmt)
        return v

    def need(n: int, what: str) -> None:
        if n < 0 or pos + n > size:
            raise _Bad(f"{what} runs past the end of the file ({size} bytes)")

    def string(what: str) -> str:
        nonlocal pos
        n = take("<Q")
        need(n, what)
        s = bytes(m[pos:pos + n]).decode("utf-8", "replace")
        pos += n
        return s

    def value(vtype: int, what: str):
        if vtype == _STRING:
            return string(what)
        return take(_SCALAR[vtype])

    version = take("<I")
    if version not in (2, 3):  # gguf.cpp: version 1 and > GGUF_VERSION (3) are refused
        raise _Bad(f"unsupported GGUF version {version}")
    n_tensors, n_kv = take("<Q"), take("<Q")
    # every KV takes >= 13 bytes, every tensor info >= 24: a count beyond that is corrupt
    if n_kv * 13 > size or n_tensors * 24 > size:
        raise _Bad(f"{n_kv} keys / {n_tensors} tensors cannot fit in {size} bytes")
    kv: dict[str, object] = {}
    types: dict[str, tuple[int, int | None]] = {}
    lengths: dict[str, int] = {}
    for i in range(n_kv):
        key = string(f"key {i}")
        if not key:
            raise _Bad(f"key {i} is empty")
        if key in kv:
            raise _Bad(f"duplicate key {key!r}")
        vtype = take("<I")
        if vtype != _ARRAY:
            if vtype not in _SCALAR and vtype != _STRING:
                raise _Bad(f"key {key!r} has unknown GGUF value type {vtype}")
            types[key] = (vtype, None)
            kv[key] = value(vtype, key)
            continue
        etype, count = take("<I"), take("<Q")
        if etype not in _SCALAR and etype != _STRING:  # arrays of arrays included
            raise _Bad(f"array key {key!r} has unknown element type {etype}")
        item = 8 if etype == _STRING else struct.calcsize(_SCALAR[etype])
        need(count * item, f"array {key!r} ({count} elements)")
        types[key], lengths[key] = (_ARRAY, etype), count
        if key in COUNT_ONLY_KEYS:
            if etype == _STRING:
                for _ in range(count):
                    n = take("<Q")
                    need(n, f"string in {key!r}")
                    pos += n
            else:
                pos += count * item
            kv[key] = f"<{count} entries>"
        else:
            kv[key] = [value(etype, key) for _ in range(count)]
    align = kv.get("general.alignment", 32)
    if "general.alignment" in kv and types["general.alignment"][0] != 4:
        raise _Bad("general.alignment must be a u32, is "
                   f"{GGUF_TYPE_NAMES.get(types['general.alignment'][0])}")
    if align == 0 or align & (align - 1):
        raise _Bad(f"general.alignment = {align} is not a power of 2")
    infos = []
    seen: set[str] = set()
    for i in range(n_tensors):
        start = pos
        name = string(f"tensor name {i}")
        if pos - start - 8 >= GGML_MAX_NAME:
            raise _Bad(f"tensor name {name[:80]!r}... is longer than {GGML_MAX_NAME - 1} bytes")
        if name in seen:
            raise _Bad(f"duplicate tensor name {name!r}")
        seen.add(name)
        n_dims = take("<I")
        if n_dims > GGML_MAX_DIMS:
            raise _Bad(f"tensor {name!r} has {n_dims} dimensions (ggml allows {GGML_MAX_DIMS})")
        ne = tuple(take("<q") for _ in range(n_dims))
        if any(d < 0 for d in ne):
            raise _Bad(f"tensor {name!r} has a negative dimension: {ne}")
        n = 1
        for d in ne:
            n *= d
        if n > INT64_MAX:
            raise _Bad(f"tensor {name!r} has {n} elements, more than ggml can index")
        ttype = take("<I")
        if ttype not in GGML_TYPES:
            raise _Bad(f"tensor {name!r} has ggml type {ttype}, not a type ggml knows "
                       "(ids 0-3, 6-30, 34, 35, 39-42)")
        tname, block, _ = GGML_TYPES[ttype]
        if ne and ne[0] % block:
            raise _Bad(f"tensor {name!r} of type {tname} has {ne[0]} elements per row, "
                       f"not a multiple of its block size {block}")
        offset = take("<Q")
        infos.append((name, ne, tname, offset))
    data_start = (pos + align - 1) // align * align
    tensors = tuple(TensorRecord(name=name, ne=ne, dtype=tname, nbytes=tensor_nbytes(tname, ne),
                                 offset=data_start + offset, block=block_of(name))
                    for name, ne, tname, offset in infos)
    return GGUFHeader(p, kv, tensors, types, lengths, data_start), data_start


def require_deepseek4(h: GGUFHeader) -> None:
    if h.arch != "deepseek4":
        raise ModelFileError(
            f"{h.path}: architecture is {h.arch!r}, mtplib needs 'deepseek4' (DeepSeek-V4)")
