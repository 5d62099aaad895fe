"""What a WAN benchmark run measures (`mtplib.lab.wan`): its grid and per-run settings
(`WanConfig`, a lane's ``wan:`` section), checked where it is built, and the build this
process loads recorded in it (`with_upstream`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

from mtplib.contract import labels
from mtplib.contract.labels import DECODING_STEPS
from mtplib.errors import InputError
from mtplib.lab.common import checks as C
from mtplib.runtime.engine_options import HEADS
from mtplib.runtime.links import MAX_RTT_MS
from mtplib.runtime.request import DEFAULT_CTX, DEFAULT_SEAM

TOPOLOGIES = ("remote", "tail_local")
MODES = ("warm", "cold")
#: where a cold run's shards come from: started by each CLI process, or external
#: `mtplib shard serve` processes on this host (started once, given as --endpoints)
COLD_SHARDS = ("local", "endpoints")
#: the step kinds of the decoding phase (after the prompt), whose waits a token pays
DECODE_PHASES = DECODING_STEPS
PLACEMENTS = labels.PLACEMENTS
LOG = Callable[[str], None]

_RTTS = C.list_of(C.number(0, MAX_RTT_MS), what=f"RTTs in ms 0..{MAX_RTT_MS}")
_THREADS = C.threads()


def _choices(choices: tuple[str, ...], noun: str, nouns: str) -> C.Check:
    return C.list_of(C.text(choices, unknown=noun), what=f"{nouns} ({', '.join(choices)})")


#: each `WanConfig` field's one rule: the config checks its values with it (strict, at
#: construction), and `mtplib.records.parameters` a lane's ``wan:`` and notebook 05's
#: parameters (lenient for -p strings); the cross-field rules are `WanConfig.__post_init__`'s
WAN_RULES: dict[str, C.Check] = {
    "rtts_ms": _RTTS,
    "mbits": C.says(C.list_of(C.bandwidth(), what="link bandwidths (Mbit/s > 0 or null)"),
                    "a non-empty list of Mbit/s > 0 or None (unlimited)"),
    "ks": C.drafts(0),
    "plans": C.plans(),
    "topologies": _choices(TOPOLOGIES, "topology", "topologies"),
    "placements": _choices(PLACEMENTS, "placement", "placements"),
    "head": C.text(HEADS),
    "n_prompts": C.integer(1, C.MAX_REPEATS),
    "prompt_len": C.integer(1, C.MAX_PROMPT_TOKENS),
    "n_new": C.integer(1, C.MAX_NEW_TOKENS),
    "reps": C.integer(1, C.MAX_REPEATS),
    "warmup": C.integer(0, C.MAX_REPEATS),
    "n_ctx": C.optional(C.context_size()),
    "modes": _choices(MODES, "mode", "modes"),
    "cold_rtts_ms": _RTTS,
    "cold_ks": C.drafts(0),
    "cold_shards": C.text(COLD_SHARDS, unknown="cold_shards"),
    "threads": _THREADS,
    "shard_threads": _THREADS,
    "fit_rtts_ms": _RTTS,
    "cost_model_tolerance": C.number(0, 1),  # a fraction of the measurement
    "upstream": C.text(what="a build name (MTPLIB_UPSTREAM)"),
    "seam": C.text(labels.SEAM_CHOICES),
}


@dataclass
class WanConfig:
    """What `run_wan` measures (a lane's ``wan:`` section; every key optional)."""

    rtts_ms: list[float] = field(default_factory=lambda: [0, 10, 25, 50, 100, 200])
    #: link bandwidths (Mbit/s per direction of each WAN link; None: unlimited), crossed
    #: with the RTTs of both modes
    mbits: list[float | None] = field(default_factory=lambda: [None])
    ks: list[int] = field(default_factory=lambda: [0, 1, 2, 3])  # 0 = MTP off
    plans: list[str] = field(default_factory=lambda: ["0-1,2-3", "0-0,1-2,3-3"])
    topologies: list[str] = field(default_factory=lambda: list(TOPOLOGIES))
    placements: list[str] = field(default_factory=lambda: list(PLACEMENTS))
    head: str = "auto"  # where the output head runs (EngineOptions.head; auto: client)
    n_prompts: int = 4  # held-out prompts of the trained pair (prompts_from, seed 0)
    prompt_len: int = 48
    n_new: int = 24
    reps: int = 1
    #: untimed warm-mode generations per draft length before the sweep, on a held-out
    #: prompt that is not measured (engines are warmed at load anyway: default 0)
    warmup: int = 0
    #: None: the CLI's default (min(2048, the model's context_length)), in both modes
    n_ctx: int | None = None
    modes: list[str] = field(default_factory=lambda: ["warm"])
    #: the cold mode's grid (one CLI process per generation costs seconds of start-up each)
    cold_rtts_ms: list[float] = field(default_factory=lambda: [100])
    cold_ks: list[int] = field(default_factory=lambda: [0, 2])
    cold_shards: str = "local"  # COLD_SHARDS
    threads: int = 1  # client threads (the shards get shard_threads)
    shard_threads: int = 1
    fit_rtts_ms: list[float] = field(default_factory=lambda: [0, 10, 25, 50])
    #: a cost-model prediction is good when within this fraction of the measurement
    cost_model_tolerance: float = 0.15
    upstream: str = "stock"  # which build ran (recorded; chosen by MTPLIB_UPSTREAM)
    #: how boundary values reach the next shard in both modes (`SEAM_CHOICES`, as
    #: `generate --seam`; default the request's, `DEFAULT_SEAM`); each row's ``seam`` says
    #: which ran and why, per shard pair
    seam: str = DEFAULT_SEAM

    def __post_init__(self) -> None:
        C.check_fields(self, WAN_RULES, "wan")  # each field's one rule
        if len(set(self.mbits)) != len(self.mbits):
            raise InputError(f"wan: mbits lists a bandwidth twice: {self.mbits}")
        n_ctx = self.n_ctx or DEFAULT_CTX  # None: the CLI's default, at most DEFAULT_CTX
        if self.prompt_len + self.n_new + 8 > n_ctx:
            raise InputError(f"wan: prompt_len + n_new ({self.prompt_len + self.n_new}) do not "
                             f"fit n_ctx {n_ctx}" + ("" if self.n_ctx else " (the default)"))

    @classmethod
    def from_dict(cls, d: dict | None) -> WanConfig:
        d = dict(d or {})
        unknown = set(d) - {f for f in cls.__dataclass_fields__}
        if unknown:
            raise InputError(f"wan: unknown keys {sorted(unknown)}; known: "
                             f"{sorted(cls.__dataclass_fields__)}")
        return cls(**d)


def with_upstream(cfg: WanConfig) -> WanConfig:
    """``cfg`` with the build this process loads recorded in it (``cfg`` itself where it
    is: a checked config is not checked again)."""
    from mtplib.runtime import selected_upstream

    which = selected_upstream()
    return cfg if cfg.upstream == which else replace(cfg, upstream=which)
