"""The context and decoding settings every entry point shares, in one frozen type.

mtplib's loop (`EngineOptions`), upstream's llama-server (`ServerConfig`) and the
side-by-side that runs both (`SideBySideConfig`) are built from the same handful of
options; listed once here, a comparison cannot give the two sides different settings by
a missed field, and each value is checked once, before anything reaches upstream (which
aborts the process on some bad context parameters). `ContextConfig.from_settings` turns
them into a context configuration. Pure: no ctypes, so the CLI and the notebooks can
build and validate settings without loading llama.cpp.

The allowed values live in the `Literal` types below; `ContextConfig` validates against
the same tuples.
"""

from __future__ import annotations

import operator
import os
from dataclasses import asdict, dataclass, field, fields
from typing import Literal, get_args

from mtplib.errors import InputError

#: KV cache element types (upstream's -ctk/-ctv names; mapped to ggml types in model.py)
KvType = Literal["f16", "f32", "bf16", "q8_0"]
#: flash attention: upstream's -fa values (auto lets upstream decide per device)
FlashAttn = Literal["auto", "on", "off"]
#: where the target's h_nextn rows come from (mtplib.runtime.row_source)
RowSource = Literal["auto", "api", "captured"]

KV_TYPE_NAMES: tuple[str, ...] = get_args(KvType)
FLASH_ATTN_MODES: tuple[str, ...] = get_args(FlashAttn)
ROW_SOURCES: tuple[str, ...] = get_args(RowSource)

#: the integer settings: each must be >= 1
COUNT_FIELDS = ("n_ctx", "n_batch", "n_ubatch", "n_threads")


class SettingsError(InputError):
    """Context / decoding settings that upstream would refuse or abort on."""


def choice_problem(name: str, value: object, allowed: tuple[str, ...]) -> str | None:
    """A message naming the field and its allowed values, or None if ``value`` is one."""
    if isinstance(value, str) and value in allowed:
        return None
    return f"{name} {value!r} not in {', '.join(allowed)}"


def count_problem(name: str, value: object) -> str | None:
    """A message if ``value`` is not an integer >= 1 (bools are not counts)."""
    try:
        ok = not isinstance(value, bool) and operator.index(value) >= 1
    except TypeError:
        ok = False
    return None if ok else f"{name} must be an integer >= 1, got {value!r}"


def default_threads() -> int:
    """The one n_threads default of every context and run: up to two CPU threads."""
    return min(2, os.cpu_count() or 1)


@dataclass(frozen=True)
class ContextSettings:
    """The seven options every llama context is made with, defined and checked once:
    `DecodeSettings` (a run's settings) and `mtplib.runtime.model.ContextConfig` (one
    context's) both extend it."""

    n_ctx: int = 2048
    n_batch: int = 512
    n_ubatch: int = 512
    n_threads: int = field(default_factory=default_threads)
    kv_type: KvType = "f16"
    flash_attn: FlashAttn = "auto"
    #: full-size SWA cache: true is the C API default (mtplib's); upstream's llama-server
    #: and llama-cli use false (a window-sized cache)
    swa_full: bool = True

    def context_problems(self) -> list[str]:
        """What is wrong with the seven shared options (messages name the field)."""
        errs = [count_problem(k, getattr(self, k)) for k in COUNT_FIELDS]
        errs += [choice_problem("kv_type", self.kv_type, KV_TYPE_NAMES),
                 choice_problem("flash_attn", self.flash_attn, FLASH_ATTN_MODES)]
        if not isinstance(self.swa_full, bool):
            errs.append(f"swa_full must be true or false, got {self.swa_full!r}")
        return [e for e in errs if e]

    def context_settings(self) -> dict:
        """The seven shared options by name (to build the other kind from this one)."""
        return {f.name: getattr(self, f.name) for f in fields(ContextSettings)}


@dataclass(frozen=True)
class DecodeSettings(ContextSettings):
    """The context and decoding options one run is made with (validated on creation;
    `dataclasses.replace` validates the copy too)."""
    #: where the target's h_nextn rows come from: "auto" checks this configuration once
    #: (upstream's API rows can be wrong, see mtplib.runtime.rows) and uses the API rows
    #: if right, else the eval-callback capture, else refuses MTP; or force "api"/"captured".
    #: mtplib only: upstream's tools have no such choice.
    hidden_rows: RowSource = "auto"

    def __post_init__(self) -> None:
        errs = self.context_problems()
        if e := choice_problem("hidden_rows", self.hidden_rows, ROW_SOURCES):
            errs.append(e)
        if errs:
            raise SettingsError("bad decode settings: " + "; ".join(errs))

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> DecodeSettings:
        """The inverse of `to_dict`; unknown keys are refused by name."""
        known = {f.name for f in fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise SettingsError(f"unknown decode settings {sorted(unknown)} "
                                f"(known: {sorted(known)})")
        return cls(**d)
