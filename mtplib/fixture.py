"""Deterministic tiny DeepSeek-V4 trunk + `mtp-` sidecar GGUFs, in upstream's layout.

Upstream's converter writes V4's MTP block to a separate `mtp-<name>.gguf` (reference §5):
root tensors + `blk.{n_layer}.*`, block_count = n_layer + 1, nextn_predict_layers = 1.
Root tensors the sidecar shares with the trunk (token_embd, output, output_norm) hold the
same bytes; the sidecar's `output_hc_*` is the MTP's own hc head. Same seed, same bytes.
"""

from __future__ import annotations

import hashlib
import os
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from mtplib.v4.arch import (
    ROOT_HC_HEAD,
    TensorSpec,
    V4Config,
    gguf_keys,
    sidecar_tensors,
    trunk_tensors,
)
from mtplib.v4.presets import DEFAULT_PRESET, get_preset


@dataclass(frozen=True)
class FixturePair:
    trunk: Path
    sidecar: Path
    config: V4Config
    seed: int
    preset: str

    def summary(self) -> dict:
        return {
            "preset": self.preset,
            "seed": self.seed,
            "trunk": {"path": str(self.trunk), "sha256": sha256_file(self.trunk),
                      "bytes": self.trunk.stat().st_size},
            "sidecar": {"path": str(self.sidecar), "sha256": sha256_file(self.sidecar),
                        "bytes": self.sidecar.stat().st_size},
            "config": self.config.to_dict(),
        }


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while b := f.read(chunk):
            h.update(b)
    return h.hexdigest()


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


def _tensor_key(spec: TensorSpec, sidecar: bool) -> str:
    # the sidecar's hc head is the MTP's own; every other root tensor is shared data
    if sidecar and spec.kind in ROOT_HC_HEAD:
        return "mtp/" + spec.name
    return spec.name


def _write(path: Path, cfg: V4Config, specs: list[TensorSpec], seed: int, sidecar: bool,
           name: str) -> None:
    import gguf  # registry package; knows nothing of deepseek4 but writes any names

    tmp = path.with_name(path.name + ".tmp")
    w = gguf.GGUFWriter(str(tmp), arch="deepseek4")
    w.add_name(name)
    for key, val in gguf_keys(cfg, sidecar=sidecar).items():
        if isinstance(val, bool):
            w.add_bool(key, val)
        elif isinstance(val, int):
            w.add_uint32(key, val)
        elif isinstance(val, float):
            w.add_float32(key, val)
        elif isinstance(val, list):
            w.add_array(key, val)
        else:
            raise TypeError(f"unsupported key type for {key}: {type(val)}")
    # upstream's own fixture tokenizer: ids <-> "tok_<i>", zero scores
    w.add_tokenizer_model("test")
    w.add_token_list([f"tok_{i}" for i in range(cfg.n_vocab)])
    w.add_token_scores([0.0] * cfg.n_vocab)
    for spec in specs:
        arr = _init(spec, cfg, seed, _tensor_key(spec, sidecar))
        w.add_tensor(spec.name, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    os.replace(tmp, path)


def fixture_names(preset: str, seed: int) -> tuple[str, str]:
    base = f"v4-{preset}-s{seed}"
    return f"{base}.gguf", f"mtp-{base}.gguf"


def write_fixture(out_dir: str | Path, *, seed: int = 0, preset: str = DEFAULT_PRESET,
                  force: bool = False) -> FixturePair:
    """Write (or reuse, when byte-identical) the trunk and sidecar for ``preset``/``seed``.

    An existing file with the same name but other bytes is never overwritten without
    ``force``: it may be someone's model.
    """
    if seed < 0 or seed >= 2**32:
        raise ValueError(f"seed must be in [0, 2**32), got {seed}")
    cfg = get_preset(preset).validate()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    trunk_name, side_name = fixture_names(preset, seed)
    paths = []
    for fname, specs, sidecar in ((trunk_name, trunk_tensors(cfg), False),
                                  (side_name, sidecar_tensors(cfg), True)):
        path = out / fname
        staged = out / (fname + ".new")
        _write(staged, cfg, specs, seed, sidecar, fname[: -len(".gguf")])
        if path.exists() and not force and sha256_file(path) != sha256_file(staged):
            staged.unlink()
            raise FileExistsError(
                f"{path} exists with different contents; remove it or pass --force")
        os.replace(staged, path)
        paths.append(path)
    return FixturePair(paths[0], paths[1], cfg, seed, preset)
