"""Craft bad GGUFs at test time from a good one: parse, edit, write back.

Tests never commit a GGUF. They take the tiny fixture, locate what to change by parsing
(never hard-coded byte offsets) and write a variant: a value patched in place (same
bytes elsewhere), a key retyped, removed or added, a tensor's dtype or shape changed, or
the file cut short. Pure struct; independent of mtplib's readers, so a bug there cannot
hide in the crafted files.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from pathlib import Path

SCALAR = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
          10: "<Q", 11: "<q", 12: "<d"}
STRING, ARRAY = 8, 9
U32, I32, F32, BOOL, U64 = 4, 5, 6, 7, 10


@dataclass
class KV:
    key: str
    vtype: int
    value: object  # scalar, str, or list
    etype: int | None = None  # element type of an array
    value_at: int = 0  # file offset of the value (of the first element for an array)
    count_at: int = 0  # file offset of an array's element count
    key_at: int = 0  # file offset of the key's length field
    type_at: int = 0  # file offset of the value type


@dataclass
class TensorInfo:
    name: str
    ne: list[int]
    ttype: int
    offset: int  # relative to the data region
    ne_at: int = 0  # file offset of ne[0]
    type_at: int = 0
    offset_at: int = 0
    name_at: int = 0  # file offset of the name's length field


@dataclass
class Gguf:
    version: int
    kvs: list[KV]
    tensors: list[TensorInfo]
    data: bytes  # the data region (from its aligned start to the end of the file)
    alignment: int = 32
    data_start: int = 0
    extra: dict = field(default_factory=dict)

    def kv(self, key: str) -> KV:
        for k in self.kvs:
            if k.key == key:
                return k
        raise KeyError(key)

    def tensor(self, name: str) -> TensorInfo:
        for t in self.tensors:
            if t.name == name:
                return t
        raise KeyError(name)


def parse(path: str | Path) -> Gguf:
    b = Path(path).read_bytes()
    pos = 4

    def take(fmt: str):
        nonlocal pos
        v = struct.unpack_from(fmt, b, pos)[0]
        pos += struct.calcsize(fmt)
        return v

    def string() -> str:
        nonlocal pos
        n = take("<Q")
        s = b[pos:pos + n].decode("utf-8")
        pos += n
        return s

    def value(t: int):
        return string() if t == STRING else take(SCALAR[t])

    version, n_t, n_kv = take("<I"), take("<Q"), take("<Q")
    kvs = []
    for _ in range(n_kv):
        key_at = pos
        key = string()
        type_at = pos
        vt = take("<I")
        if vt == ARRAY:
            et = take("<I")
            count_at = pos
            n = take("<Q")
            at = pos
            kvs.append(KV(key, vt, [value(et) for _ in range(n)], et, at, count_at, key_at,
                          type_at))
        else:
            at = pos
            kvs.append(KV(key, vt, value(vt), None, at, 0, key_at, type_at))
    tensors = []
    for _ in range(n_t):
        name_at = pos
        name = string()
        nd = take("<I")
        ne_at = pos
        ne = [take("<Q") for _ in range(nd)]
        type_at = pos
        tt = take("<I")
        off_at = pos
        tensors.append(TensorInfo(name, ne, tt, take("<Q"), ne_at, type_at, off_at, name_at))
    align = 32
    for k in kvs:
        if k.key == "general.alignment":
            align = int(k.value)
    start = (pos + align - 1) // align * align
    return Gguf(version, kvs, tensors, b[start:], align, start)


def _s(s: str) -> bytes:
    e = s.encode("utf-8")
    return struct.pack("<Q", len(e)) + e


def _v(t: int, v) -> bytes:
    return _s(v) if t == STRING else struct.pack(SCALAR[t], v)


def serialize(g: Gguf, *, alignment: int | None = None) -> bytes:
    """Header + tensor infos + padding + the data region, as a GGUF writer lays it out."""
    out = bytearray(b"GGUF" + struct.pack("<IQQ", g.version, len(g.tensors), len(g.kvs)))
    for k in g.kvs:
        out += _s(k.key) + struct.pack("<I", k.vtype)
        if k.vtype == ARRAY:
            out += struct.pack("<IQ", k.etype, len(k.value))
            for x in k.value:
                out += _v(k.etype, x)
        else:
            out += _v(k.vtype, k.value)
    for t in g.tensors:
        out += _s(t.name) + struct.pack("<I", len(t.ne))
        out += b"".join(struct.pack("<Q", x) for x in t.ne)
        out += struct.pack("<IQ", t.ttype, t.offset)
    align = alignment or g.alignment
    out += b"\0" * ((-len(out)) % align)
    return bytes(out) + g.data


def write(g: Gguf, dst: str | Path, **kw) -> Path:
    Path(dst).write_bytes(serialize(g, **kw))
    return Path(dst)


def patch(src: str | Path, dst: str | Path, edits: list[tuple[int, str, object]]) -> Path:
    """Copy ``src`` to ``dst`` with ``(offset, struct format, value)`` edits in place."""
    b = bytearray(Path(src).read_bytes())
    for at, fmt, v in edits:
        struct.pack_into(fmt, b, at, v)
    Path(dst).write_bytes(bytes(b))
    return Path(dst)


def set_scalar(src: str | Path, dst: str | Path, key: str, value) -> Path:
    """The file with scalar ``key`` set to ``value`` in place (its GGUF type kept)."""
    k = parse(src).kv(key)
    return patch(src, dst, [(k.value_at, SCALAR[k.vtype], value)])


def set_kv(src: str | Path, dst: str | Path, key: str, vtype: int, value,
           etype: int | None = None) -> Path:
    """The file with ``key`` replaced (or added) with another type / value / length."""
    g = parse(src)
    new = KV(key, vtype, value, etype)
    for i, k in enumerate(g.kvs):
        if k.key == key:
            g.kvs[i] = new
            break
    else:
        g.kvs.append(new)
    return write(g, dst)


def drop_kv(src: str | Path, dst: str | Path, key: str) -> Path:
    g = parse(src)
    g.kvs = [k for k in g.kvs if k.key != key]
    return write(g, dst)


# -- running the CLI on many crafted inputs at once -------------------------------------
@dataclass(frozen=True)
class CliResult:
    argv: tuple[str, ...]
    returncode: int  # negative: killed by that signal
    stdout: str
    stderr: str

    def one_line_error(self) -> str:
        """The error line, after asserting the contract: exit 2, one stderr line, no
        traceback, no signal."""
        assert self.returncode == 2, (self.argv, self.returncode, self.stderr[-2000:])
        lines = [x for x in self.stderr.splitlines() if x.strip()]
        assert len(lines) == 1 and "Traceback" not in self.stderr, (self.argv, self.stderr)
        assert " error: " in lines[0], lines[0]
        return lines[0]


def run_many(argvs: list[list[str]], *, timeout: float = 120, workers: int = 4
             ) -> list[CliResult]:
    """`python -m mtplib.cli ARGV` for each argv, a few at a time (each in its own process,
    so a crash is a result, not a dead test run); a hang is a timeout failure."""
    import subprocess
    import sys
    from concurrent.futures import ThreadPoolExecutor

    def one(argv: list[str]) -> CliResult:
        r = subprocess.run([sys.executable, "-m", "mtplib.cli", *argv], capture_output=True,
                           text=True, timeout=timeout)
        return CliResult(tuple(argv), r.returncode, r.stdout, r.stderr)

    with ThreadPoolExecutor(workers) as ex:
        return list(ex.map(one, [[str(x) for x in a] for a in argvs]))
