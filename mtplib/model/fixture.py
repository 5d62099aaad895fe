"""Deterministic tiny DeepSeek-V4 trunk + `mtp-` sidecar GGUFs, in upstream's layout.

Upstream's converter writes V4's MTP block to a separate `mtp-<name>.gguf` (reference §5):
root tensors + `blk.{n_layer}.*`, block_count = n_layer + 1, nextn_predict_layers = 1.
Root tensors the sidecar shares with the trunk (token_embd, output, output_norm) hold the
same bytes; the sidecar's `output_hc_*` is the MTP's own hc head. Same seed, same bytes.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from mtplib.errors import InputError, WouldOverwrite
from mtplib.files import make_dirs, remove_dirs, short_write, write_error
from mtplib.model.arch import (
    ROOT_HC_HEAD,
    TensorSpec,
    V4Config,
    gguf_keys,
    sidecar_tensors,
    trunk_tensors,
)
from mtplib.model.presets import DEFAULT_PRESET, get_preset
from mtplib.stamps import sha256_file

#: Metadata key marking a weight-less file (header + tensor table, data region a sparse
#: hole of zeros). Such a file is for inventory and ownership derivation only.
WEIGHTLESS_KEY = "mtplib.weightless"


@dataclass(frozen=True)
class FixturePair:
    trunk: Path
    sidecar: Path | None  # None: written without its sidecar (write_fixture(sidecar=False))
    config: V4Config
    seed: int
    preset: str
    weightless: bool = False

    def summary(self) -> dict:
        def entry(path: Path) -> dict:
            if not self.weightless:
                return {"path": str(path), "sha256": sha256_file(path),
                        "bytes": path.stat().st_size}
            st = path.stat()
            # the data region is a hole of zeros: hash the header, report both sizes
            return {"path": str(path), "sha256_header": sha256_header(path),
                    "bytes": st.st_size, "disk_bytes": st.st_blocks * 512, "weightless": True}

        return {
            "preset": self.preset,
            "seed": self.seed,
            "trunk": entry(self.trunk),
            "sidecar": entry(self.sidecar) if self.sidecar is not None else None,
            "config": self.config.to_dict(),
        }


def data_start(path: Path) -> int:
    """Absolute offset of a GGUF's data region (header, KV and tensor infos come first)."""
    from mtplib.model.gguf_header import gguf_data_offset  # fast: never parses the token strings

    return gguf_data_offset(path)


def sha256_header(path: Path) -> str:
    """sha256 of everything before the data region (what a weight-less file holds)."""
    n = data_start(path)
    h = hashlib.sha256()
    with open(path, "rb") as f:
        h.update(f.read(n))
    return h.hexdigest()


def is_weightless(kv: dict) -> bool:
    """True for a file `write_fixture` wrote without weights (a GGUFHeader's ``kv``)."""
    return bool(kv.get(WEIGHTLESS_KEY, False))


def require_weights(header) -> None:
    """Refuse a weight-less file before upstream decodes it: it has no weights."""
    from mtplib.model.gguf_header import ModelFileError

    if is_weightless(header.kv):
        raise ModelFileError(
            f"{header.path} is a weight-less table (data region is a sparse hole of zeros, "
            f"{WEIGHTLESS_KEY}=true): use it for inventory/ownership derivation only, "
            "never for decoding")


def _rng(seed: int, key: str) -> np.random.Generator:
    # one stream per tensor key, so a tensor's bytes do not depend on the others
    return np.random.default_rng([seed, zlib.crc32(key.encode())])


def _init(spec: TensorSpec, cfg: V4Config, seed: int, key: str) -> np.ndarray:
    """Weights scaled so activations stay O(1) over the whole context."""
    rng = _rng(seed, key)
    shape = tuple(reversed(spec.ne))  # numpy order
    k = spec.kind
    if spec.dtype == "I32":  # ffn_gate_tid2eid: k distinct experts per token
        ids = np.argsort(rng.random((cfg.n_vocab, cfg.n_expert)), axis=1)[:, : cfg.n_expert_used]
        return np.ascontiguousarray(ids.astype(np.int32))
    if k == "token_embd":
        w = rng.standard_normal(shape)
    elif k in ("output",):
        w = rng.standard_normal(shape) * (3.0 / np.sqrt(cfg.n_embd))
    elif k.endswith("norm"):
        w = 1.0 + 0.1 * rng.standard_normal(shape)
    elif k == "attn_sinks":
        w = 0.5 * rng.standard_normal(shape)
    elif k.endswith("_scale"):
        w = 0.5 + 0.1 * rng.standard_normal(shape)
    elif k.endswith("_base") or k == "exp_probs_b":
        w = 0.3 * rng.standard_normal(shape)
    elif k.endswith("_ape"):
        w = 0.1 * rng.standard_normal(shape)
    elif k.endswith("_fn"):  # hc mixing: small, so comb stays close to uniform
        w = 0.5 * rng.standard_normal(shape) / np.sqrt(spec.ne[0])
    else:  # projection matrices: fan-in is ne[0]
        w = rng.standard_normal(shape) / np.sqrt(spec.ne[0])
    return np.ascontiguousarray(w.astype(np.float32))


#: RMS of an MXFP4 value's code (kvalues_mxfp4 of ggml-common.h: 0,1,2,3,4,6,8,12 and their
#: negatives, uniform nibbles), before the block scale 2^(e - 128) (GGML_E8M0_TO_FP32_HALF).
_MXFP4_CODE_RMS = float(np.sqrt(np.mean(np.square(
    [0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12]))))
#: Bytes generated at a time for one quantized tensor: a 1 GB BF16 head never sits in memory.
_CHUNK_BYTES = 64 << 20


def _scale(spec: TensorSpec, cfg: V4Config) -> float:
    """The standard deviation `_init` gives a matrix of this kind."""
    if spec.kind == "token_embd":
        return 1.0
    if spec.kind == "output":
        return 3.0 / np.sqrt(cfg.n_embd)
    return 1.0 / np.sqrt(spec.ne[0])


def _raw_chunks(spec: TensorSpec, cfg: V4Config, seed: int, key: str):
    """The bytes of a BF16 / Q8_0 / MXFP4 tensor, row chunk by row chunk, as ggml lays them
    out (ggml-common.h: block_q8_0 = fp16 d + 32 int8; block_mxfp4 = e8m0 e + 16 bytes of
    nibbles), with the scale `_init` would give it. Random codes, not quantized normals:
    the cost of decoding them is the same, and writing 1 GB takes seconds, not minutes."""
    rng = _rng(seed, key)
    ne0 = spec.ne[0]
    n_rows = spec.n_elements // ne0
    row_bytes = spec.nbytes // n_rows
    per = max(1, _CHUNK_BYTES // row_bytes)
    sd = _scale(spec, cfg)
    for r0 in range(0, n_rows, per):
        rows = min(per, n_rows - r0)
        if spec.dtype == "BF16":
            w = rng.standard_normal(rows * ne0, dtype=np.float32) * np.float32(sd)
            yield (w.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
        elif spec.dtype == "Q8_0":
            nb = rows * ne0 // 32
            blk = np.empty((nb, 34), np.uint8)
            d = np.float16(sd / (127 / np.sqrt(3)))  # uniform int8 in [-127, 127]: sd 73.3
            blk[:, :2] = np.frombuffer(d.tobytes(), np.uint8)
            blk[:, 2:] = rng.integers(-127, 128, (nb, 32), dtype=np.int8).view(np.uint8)
            yield blk.reshape(-1)
        elif spec.dtype == "MXFP4":
            nb = rows * ne0 // 32
            blk = np.empty((nb, 17), np.uint8)
            blk[:, 0] = int(round(128 + np.log2(sd / _MXFP4_CODE_RMS)))
            blk[:, 1:] = np.frombuffer(rng.bytes(nb * 16), np.uint8).reshape(nb, 16)
            yield blk.reshape(-1)
        else:
            raise InputError(f"no raw writer for dtype {spec.dtype} ({spec.name})")


def _tensor_key(spec: TensorSpec, sidecar: bool) -> str:
    # the sidecar's hc head is the MTP's own; every other root tensor is shared data
    if sidecar and spec.kind in ROOT_HC_HEAD:
        return "mtp/" + spec.name
    return spec.name


def add_typed_keys(w, keys: dict) -> None:
    """Write metadata keys with the GGUF types upstream reads them as (u32, f32, ...)."""
    for key, val in keys.items():
        if isinstance(val, bool):
            w.add_bool(key, val)
        elif isinstance(val, int):
            w.add_uint32(key, val)
        elif isinstance(val, float):
            w.add_float32(key, val)
        elif isinstance(val, list):
            w.add_array(key, val)
        elif isinstance(val, str):
            w.add_string(key, val)
        else:
            raise TypeError(f"unsupported key type for {key}: {type(val)}")


def _add_keys(w, cfg: V4Config, sidecar: bool, name: str) -> None:
    w.add_name(name)
    add_typed_keys(w, gguf_keys(cfg, sidecar=sidecar))
    # upstream's own fixture tokenizer: ids <-> "tok_<i>", zero scores
    w.add_tokenizer_model("test")
    w.add_token_list([f"tok_{i}" for i in range(cfg.n_vocab)])
    w.add_token_scores([0.0] * cfg.n_vocab)


@contextlib.contextmanager
def _removed_on_failure(tmp: Path, path: Path | None = None) -> Iterator[None]:
    """A half-written temporary file (a full disk, an interrupt) is deleted, not left. A
    failed write gets its cause first (`short_write`: numpy's short write, behind gguf's
    writer, says none) and, with ``path``, names that file (`write_error`; without it, the
    caller names the file it stages this one for)."""
    try:
        yield
    except OSError as e:
        # before the unlink frees the room the write lacked
        told = short_write(e, tmp.parent) if path is None else write_error(path, e)
        with contextlib.suppress(OSError):
            tmp.unlink()
        if told is e:
            raise
        raise told from e
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise


def write_gguf(path: Path, cfg: V4Config, specs: list[TensorSpec], seed: int, sidecar: bool,
               name: str) -> None:
    """One F32 fixture file of ``specs`` under ``cfg``, written as given: nothing here
    validates ``cfg`` (`mtplib.reports.upstream_bugs.repro_crashes` writes configurations
    `V4Config.validate` refuses, for upstream to see as they are)."""
    import gguf  # registry package; knows nothing of deepseek4 but writes any names

    tmp = path.with_name(path.name + ".tmp")
    with _removed_on_failure(tmp):
        w = gguf.GGUFWriter(str(tmp), arch="deepseek4")
        _add_keys(w, cfg, sidecar, name)
        for spec in specs:
            arr = _init(spec, cfg, seed, _tensor_key(spec, sidecar))
            w.add_tensor(spec.name, arr)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        os.replace(tmp, path)


def _write_typed(path: Path, cfg: V4Config, specs: list[TensorSpec], seed: int,
                 sidecar: bool, name: str) -> None:
    """A file in the dtypes the specs name (the converter's policy), streamed: tensor infos
    first, then each tensor's bytes chunk by chunk, so a multi-GB slice needs little RAM.
    F32 and I32 tensors get `_init`'s values; BF16 / Q8_0 / MXFP4 `_raw_chunks`'."""
    import gguf

    tmp = path.with_name(path.name + ".tmp")
    with _removed_on_failure(tmp):
        w = gguf.GGUFWriter(str(tmp), arch="deepseek4")
        _add_keys(w, cfg, sidecar, name)
        for spec in specs:
            raw = None if spec.dtype in ("F32", "I32") else gguf.GGMLQuantizationType[spec.dtype]
            w.add_tensor_info(spec.name, tuple(reversed(spec.ne)),
                              np.dtype(np.int32 if spec.dtype == "I32" else np.float32),
                              spec.nbytes, raw_dtype=raw)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        f = w.fout[0]
        for spec in specs:
            w.write_padding(f, f.tell())
            key = _tensor_key(spec, sidecar)
            if spec.dtype in ("F32", "I32"):
                _init(spec, cfg, seed, key).tofile(f)
            else:
                for chunk in _raw_chunks(spec, cfg, seed, key):
                    chunk.tofile(f)
            w.write_padding(f, spec.nbytes)
        w.close()
        os.replace(tmp, path)


def _write_sparse(path: Path, cfg: V4Config, specs: list[TensorSpec], sidecar: bool,
                  name: str) -> None:
    """Header + tensor infos only; the data region is extended with truncate, so it is a
    hole that reads as zeros and takes no disk (a 150 GB table takes a few MB)."""
    import gguf

    tmp = path.with_name(path.name + ".tmp")
    with _removed_on_failure(tmp):
        w = gguf.GGUFWriter(str(tmp), arch="deepseek4")
        _add_keys(w, cfg, sidecar, name)
        w.add_bool(WEIGHTLESS_KEY, True)
        total = 0
        for spec in specs:
            nbytes = spec.nbytes
            w.add_tensor_info(spec.name, tuple(reversed(spec.ne)), np.dtype(np.float32),
                              nbytes, raw_dtype=gguf.GGMLQuantizationType[spec.dtype])
            total += gguf.GGUFWriter.ggml_pad(nbytes, w.data_alignment)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        start = gguf.GGUFWriter.ggml_pad(w.fout[0].tell(), w.data_alignment)
        w.close()
        os.truncate(tmp, start + total)
        os.replace(tmp, path)


def _same_file(a: Path, b: Path, weightless: bool) -> bool:
    if weightless:
        return a.stat().st_size == b.stat().st_size and sha256_header(a) == sha256_header(b)
    return sha256_file(a) == sha256_file(b)


def fixture_names(preset: str, seed: int) -> tuple[str, str]:
    if get_preset(preset).extra.get("weightless"):
        base = f"{preset}-weightless"  # no weights, so no seed in the name
    else:
        base = f"v4-{preset}-s{seed}"
    return f"{base}.gguf", f"mtp-{base}.gguf"


def write_fixture(out_dir: str | Path, *, seed: int = 0, preset: str = DEFAULT_PRESET,
                  force: bool = False, sidecar: bool = True) -> FixturePair:
    """Write (or reuse, when byte-identical) the trunk and sidecar for ``preset``/``seed``.

    An existing file with the same name but other bytes is never overwritten without
    ``force``: it may be someone's model. A weight-less preset (``v4-flash``) writes the
    header and tensor table only, with a sparse data region (seed unused). ``sidecar=False``
    writes the trunk alone (the pair's ``sidecar`` is None): a multi-GB slice's partner
    needs no MTP block of its own.
    """
    if seed < 0 or seed >= 2**32:
        raise InputError(f"seed must be in [0, 2**32), got {seed}")
    cfg = get_preset(preset).validate()
    weightless = bool(cfg.extra.get("weightless"))
    out = Path(out_dir)
    made = make_dirs(out)
    trunk_name, side_name = fixture_names(preset, seed)
    paths: list[Path] = []
    new: list[Path] = []  # files this call created (not replaced): removed if it fails
    jobs = [(trunk_name, trunk_tensors(cfg), False)]
    if sidecar:
        jobs.append((side_name, sidecar_tensors(cfg), True))
    try:
        for fname, specs, is_sidecar in jobs:
            path = out / fname
            staged = out / (fname + ".new")
            try:
                if weightless:
                    _write_sparse(staged, cfg, specs, is_sidecar, fname[: -len(".gguf")])
                elif cfg.extra.get("dtype_policy", "f32") != "f32":
                    _write_typed(staged, cfg, specs, seed, is_sidecar, fname[: -len(".gguf")])
                else:
                    write_gguf(staged, cfg, specs, seed, is_sidecar,
                               fname[: -len(".gguf")])
                if path.exists() and not force and not _same_file(path, staged, weightless):
                    raise WouldOverwrite(
                        f"{path} exists with different contents; remove it or pass --force")
            except OSError as e:  # named as the file it would have been (not *.new)
                with contextlib.suppress(OSError):
                    staged.unlink()
                told = write_error(path, e)
                if told is e:
                    raise
                raise told from e
            except BaseException:
                with contextlib.suppress(OSError):
                    staged.unlink()
                raise
            existed = path.exists()
            os.replace(staged, path)
            paths.append(path)
            if not existed:
                new.append(path)
    except BaseException:  # a full or read-only disk: no half pair, no folder left behind
        for f in new:
            with contextlib.suppress(OSError):
                f.unlink()
        remove_dirs(made)
        raise
    return FixturePair(paths[0], paths[1] if sidecar else None, cfg, seed, preset, weightless)


def write_combined(trunk: str | Path, sidecar: str | Path, out_dir: str | Path) -> Path:
    """One file holding the trunk and the MTP block (upstream loads either layout).

    Root tensors and blocks 0..n_layer-1 come from the trunk (so the root output_hc_* is
    the trunk's hc head), blk.{n_layer}.* from the sidecar; the keys are the sidecar's
    (block_count = n_layer + n_mtp, nextn_predict_layers = n_mtp). Used to check the
    single-file ownership rules against upstream.
    """
    import gguf

    from mtplib.model.arch import config_from_keys
    from mtplib.model.gguf_header import read_header

    trunk, sidecar = Path(trunk), Path(sidecar)
    side = read_header(sidecar, with_tokens=False)
    for h in (read_header(trunk, with_tokens=False), side):
        require_weights(h)
    cfg = config_from_keys(side.kv, side.n_vocab)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / ("combined-" + trunk.name)
    tensors = [(t.name, np.array(t.data)) for t in gguf.GGUFReader(str(trunk)).tensors]
    tensors += [(t.name, np.array(t.data)) for t in gguf.GGUFReader(str(sidecar)).tensors
                if t.name.startswith("blk.") and int(t.name.split(".")[1]) >= cfg.n_layer]
    tmp = path.with_name(path.name + ".tmp")
    with _removed_on_failure(tmp, path):
        w = gguf.GGUFWriter(str(tmp), arch="deepseek4")
        _add_keys(w, cfg, True, path.stem)
        for name, arr in tensors:
            w.add_tensor(name, arr)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        os.replace(tmp, path)
    return path


def trained_pair() -> FixturePair | None:
    """The committed trained tiny V4 pair (evidence/trained-v4/: trunk + `mtp-` sidecar
    trained on Python stdlib source, gpt2 BPE tokenizer), or None where it is absent.

    Unlike the random presets it is not generated: the files are the evidence, read in
    place (do not write to them). Preset name "trained", seed = the training seed.
    """
    from mtplib.model.arch import config_from_keys
    from mtplib.model.gguf_header import read_header
    from mtplib.model.trained import trained_paths

    p = trained_paths()
    if not (p.trunk.exists() and p.sidecar.exists()):
        return None
    h = read_header(p.sidecar)
    return FixturePair(p.trunk, p.sidecar, config_from_keys(h.kv, h.n_vocab), 0, "trained")
