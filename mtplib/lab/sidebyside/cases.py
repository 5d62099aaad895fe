"""What a side-by-side run runs (`mtplib.lab.sidebyside`): its config (`SideBySideConfig`, the same
settings on both engines), its cases (plain, real MTP drafts, synthetic rates) and the
interleaved A/B order of their runs (`ab_order`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from mtplib.errors import InputError
from mtplib.runtime.settings import DecodeSettings

LOG = Callable[[str], None]
ENGINES = ("upstream", "mtplib")


# -- cases ------------------------------------------------------------------------------
def parse_rates(text: str) -> list[float]:
    """``"0.77,0.37"`` -> [0.77, 0.37]; validated as upstream does (in [0, 1],
    non-increasing)."""
    try:
        rates = [float(x) for x in text.replace(" ", "").split(",") if x != ""]
    except ValueError:
        raise InputError(f"rates must be comma-separated numbers, got {text!r}") from None
    if not rates or any(not 0.0 <= r <= 1.0 for r in rates):
        raise InputError(f"rates must be in [0, 1], got {text!r}")
    if any(b > a for a, b in zip(rates, rates[1:], strict=False)):
        raise InputError(f"rates must be non-increasing (unconditional per position): {text!r}")
    return rates


def rates_for_k(rates: Sequence[float], k: int) -> list[float]:
    """Exactly k rates (upstream requires n_max values): cut, or pad with the last one."""
    rates = list(rates)
    return (rates + [rates[-1]] * k)[:k]


@dataclass(frozen=True)
class Case:
    """One configuration: k = 0 plain decoding; rates None = real MTP drafts."""

    k: int
    rates: tuple[float, ...] | None = None

    @property
    def label(self) -> str:
        if self.k == 0:
            return "plain"
        if self.rates is None:
            return f"k={self.k} mtp"
        return f"k={self.k} synth {','.join(f'{r:g}' for r in self.rates)}"

    @property
    def synthetic(self) -> bool:
        return self.rates is not None


def make_cases(ks: Sequence[int], rate_sets: Sequence[Sequence[float]], *,
               real_mtp: bool = True) -> list[Case]:
    """Plain decoding, then per k: real MTP drafts (optional) and each synthetic rate set
    (padded / cut to k values)."""
    out = [Case(0)]
    for k in ks:
        if k < 1:
            raise InputError(f"k must be >= 1 for MTP cases, got {k}")
        if real_mtp:
            out.append(Case(k))
        for rs in rate_sets:
            out.append(Case(k, tuple(rates_for_k(rs, k))))
    return out


def ab_order(runs: int, warmup: int = 1) -> list[tuple[int | None, str]]:
    """The interleaved run order within one case: (rep or None for warm-up, engine).

    Warm-ups of both engines first (excluded from summaries), then the measured
    repetitions alternating which engine goes first (U M, M U, U M, ...), so a slow drift
    in machine load hits both sides alike.
    """
    if runs < 1 or warmup < 0:
        raise InputError("runs must be >= 1 and warmup >= 0")
    order: list[tuple[int | None, str]] = []
    for _ in range(warmup):
        order += [(None, "upstream"), (None, "mtplib")]
    for rep in range(runs):
        pair = ENGINES if rep % 2 == 0 else tuple(reversed(ENGINES))
        order += [(rep, e) for e in pair]
    return order


# -- the side-by-side ----------------------------------------------------------------------
#: the context both sides run with unless told otherwise: the SWA cache as llama-server
#: has it by default (false, a window-sized cache; true is the C API default and
#: mtplib's). Runs before swa_full was recorded had false on the server and true in mtplib.
SIDE_BY_SIDE_SETTINGS = DecodeSettings(n_ctx=1024, swa_full=False)
#: the settings recorded in a result's ``config`` (``threads`` is n_threads; the key
#: predates DecodeSettings and the committed results and plots read it)
_RECORDED = (("threads", "n_threads"), ("n_ctx", "n_ctx"), ("n_batch", "n_batch"),
             ("n_ubatch", "n_ubatch"))


@dataclass
class SideBySideConfig:
    ks: tuple[int, ...] = (1, 2, 3)
    rate_sets: tuple[tuple[float, ...], ...] = ((0.0,), (0.77, 0.37), (1.0,))
    real_mtp: bool = True
    runs: int = 5
    warmup: int = 1
    #: the same settings on both sides (hidden_rows is mtplib's only)
    settings: DecodeSettings = SIDE_BY_SIDE_SETTINGS
    n_new: int = 128
    n_prompt: int = 32
    prompt_seed: int = 0
    synth_seed: int = 0

    def to_dict(self) -> dict:
        """The recorded config: the keys and order of the committed results."""
        s = self.settings
        return {"ks": list(self.ks), "rate_sets": [list(r) for r in self.rate_sets],
                "real_mtp": self.real_mtp, "runs": self.runs, "warmup": self.warmup,
                **{key: getattr(s, f) for key, f in _RECORDED},
                "n_new": self.n_new, "n_prompt": self.n_prompt,
                "prompt_seed": self.prompt_seed, "synth_seed": self.synth_seed,
                "kv_type": s.kv_type, "flash_attn": s.flash_attn, "swa_full": s.swa_full}
