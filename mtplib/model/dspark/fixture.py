"""Deterministic random-weight V4 DSpark drafts (`dspark-<name>.gguf`) for the tiny trunks.

Why: the official DeepSeek-V4-Flash release drafts with DSpark only, and no small real
DSpark draft exists; a random one exercises the whole path (load, feature injection, the
block pass with the Markov and confidence heads, rollback) on CPU. Written as upstream's
converter writes one (conversion/deepseek.py): arch `dflash`, no token_embd / output (the
target's are used through ``ctx_other``), ``target_layers`` = layer ids + 1, block size 5,
the target's tokenizer plus ``tokenizer.ggml.mask_token_id``. Same seed, same bytes.
`write_dspark` also takes key and tensor changes, so tests make malformed drafts with the
same writer.
"""

from __future__ import annotations

import contextlib
import os
import zlib
from collections.abc import Iterable, Mapping
from pathlib import Path

import numpy as np

from mtplib.errors import InputError, WouldOverwrite
from mtplib.files import make_dirs, remove_dirs, write_error
from mtplib.model.arch import TensorSpec
from mtplib.model.dspark.spec import (
    ARCH,
    DSparkConfig,
    dspark_config_for,
    dspark_keys,
    dspark_tensors,
)
from mtplib.model.fixture import add_typed_keys, fixture_names
from mtplib.model.presets import DEFAULT_PRESET, get_preset
from mtplib.stamps import sha256_file

#: what `write_dspark`'s ``keys`` takes to remove a key
REMOVE = None


def dspark_name(preset: str, seed: int) -> str:
    """The draft's file name beside the pair: ``dspark-<trunk name>``."""
    return "dspark-" + fixture_names(preset, seed)[0]


def _init(spec: TensorSpec, seed: int) -> np.ndarray:
    """Weights scaled so the stages' activations stay O(1) (as the trunk fixture's)."""
    rng = np.random.default_rng([seed, zlib.crc32(("dspark/" + spec.name).encode())])
    shape = tuple(reversed(spec.ne))
    k = spec.kind
    if k.endswith("norm"):
        w = 1.0 + 0.1 * rng.standard_normal(shape)
    elif k == "attn_sinks":
        w = 0.5 * rng.standard_normal(shape)
    elif k.endswith("_scale"):
        w = 0.5 + 0.1 * rng.standard_normal(shape)
    elif k.endswith("_base") or k in ("exp_probs_b", "conf_proj_bias"):
        w = 0.3 * rng.standard_normal(shape)
    elif k.endswith("_fn"):
        w = 0.5 * rng.standard_normal(shape) / np.sqrt(spec.ne[0])
    elif k == "markov_w1":  # get_rows rows of the previous token
        w = rng.standard_normal(shape)
    else:  # projections (fan-in ne[0]), markov_w2 and conf_proj included
        w = rng.standard_normal(shape) / np.sqrt(spec.ne[0])
    return np.ascontiguousarray(w.astype(np.float32))


def write_dspark(path: str | Path, cfg: DSparkConfig, *, seed: int = 0,
                 keys: Mapping[str, object] | None = None, drop: Iterable[str] = (),
                 extra: Mapping[str, np.ndarray] | None = None, name: str | None = None
                 ) -> Path:
    """Write the draft of ``cfg`` to ``path`` (replaced atomically), named ``name``
    (default: the file's stem). ``keys``: metadata
    written over the draft's own (a value of `REMOVE` leaves the key out; a Python int is
    written as u32, a float as f32, a list as an i32 array), ``drop``: tensor names left
    out, ``extra``: tensors added (name -> F32/I32 array in numpy order)."""
    import gguf

    if not 0 <= seed < 2**32:
        raise InputError(f"seed must be in [0, 2**32), got {seed}")
    path = Path(path)
    all_keys = dict(dspark_keys(cfg))
    for k, v in (keys or {}).items():
        if v is REMOVE:
            all_keys.pop(k, None)
        else:
            all_keys[k] = v
    dropped = set(drop)
    tmp = path.with_name(path.name + ".tmp")
    try:
        w = gguf.GGUFWriter(str(tmp), arch=ARCH)
        w.add_name(name or path.stem)
        add_typed_keys(w, all_keys)
        w.add_tokenizer_model(cfg.tokenizer)
        w.add_token_list([f"tok_{i}" for i in range(cfg.n_vocab)])
        w.add_token_scores([0.0] * cfg.n_vocab)
        for spec in dspark_tensors(cfg):
            if spec.name not in dropped:
                w.add_tensor(spec.name, _init(spec, seed))
        for name, arr in (extra or {}).items():
            w.add_tensor(name, np.ascontiguousarray(arr))
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        os.replace(tmp, path)
    except OSError as e:
        with contextlib.suppress(OSError):
            tmp.unlink()
        told = write_error(path, e)
        if told is e:
            raise
        raise told from e
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    return path


def write_dspark_fixture(out_dir: str | Path, *, seed: int = 0, preset: str = DEFAULT_PRESET,
                         force: bool = False) -> Path:
    """The DSpark draft of the trunk `write_fixture` writes for ``preset``/``seed``, as
    ``dspark-<trunk name>`` in ``out_dir`` (reused when byte-identical; an existing file
    with other bytes is replaced only with ``force``). F32 presets only: a weight-less or
    converter-typed preset (v4-flash, v4-flash-slice) has no random DSpark writer."""
    cfg = get_preset(preset)
    if cfg.extra.get("weightless") or cfg.extra.get("dtype_policy", "f32") != "f32":
        raise InputError(f"--dspark writes F32 random weights; preset {preset!r} is "
                         "weight-less or converter-typed (no DSpark writer for it)")
    out = Path(out_dir)
    made = make_dirs(out)
    path = out / dspark_name(preset, seed)
    staged = out / (path.name + ".new")
    try:
        write_dspark(staged, dspark_config_for(cfg.validate()), seed=seed, name=path.stem)
        if path.exists() and not force and sha256_file(path) != sha256_file(staged):
            raise WouldOverwrite(f"{path} exists with different contents; remove it or pass "
                                 "--force")
        os.replace(staged, path)
    except BaseException:
        with contextlib.suppress(OSError):
            staged.unlink()
        remove_dirs(made)
        raise
    return path
