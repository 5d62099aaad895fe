"""Where things run (`Scenario`) and the cost model's parameters (`ProjectionParams`) of
`mtplib.lab.projection`, each checked where it is built (InputError naming the field).
"""

from __future__ import annotations

from dataclasses import dataclass

from mtplib.errors import InputError
from mtplib.lab.projection.constants import ANCHOR_TOK_S, DEFAULT_ACCEPTANCE, PLACEMENTS, itemsize
from mtplib.ownership.derivation import KV_TYPES


# -- scenario and parameters ---------------------------------------------------------------
@dataclass(frozen=True)
class Scenario:
    """Where things run. placement: the MTP drafter (tail shard or client CPU); head: the
    output head (tail shard: logits cross; client: hidden rows cross and the client runs
    hc head + norm + output); tail_local: the tail shard is co-located with the client (its
    waits and bytes cost no RTT or WAN bandwidth); boundary_dtype: the seam and hidden-row
    values on the wire (f32: what upstream sends today; bf16: what the contract allows)."""

    placement: str = "client"
    head: str = "client"
    tail_local: bool = False
    boundary_dtype: str = "f32"

    def __post_init__(self) -> None:
        if self.placement not in PLACEMENTS:
            raise InputError(f"placement must be one of {PLACEMENTS}, got {self.placement!r}")
        if self.head not in PLACEMENTS:
            raise InputError(f"head must be one of {PLACEMENTS}, got {self.head!r}")
        if not isinstance(self.tail_local, bool):
            raise InputError(f"tail_local must be a bool, got {self.tail_local!r}")
        itemsize(self.boundary_dtype)

    @property
    def name(self) -> str:
        return (f"draft@{self.placement}, head@{self.head}, {self.boundary_dtype}"
                + (", tail local" if self.tail_local else ""))


DEFAULT_SCENARIOS = (
    Scenario(placement="tail", head="tail"),
    Scenario(placement="client", head="tail"),
    Scenario(placement="client", head="client"),
)


@dataclass(frozen=True)
class ProjectionParams:
    """Everything the cost model takes besides the table, the plan and the structure.

    layer_s: seconds one trunk layer takes for one token (the plain decode compute is
        n_layer x layer_s); acceptance: unconditional per-position acceptance (needs k
        entries for draft length k); bandwidth_bps: bits/s of the client's WAN link;
    context: tokens in the cache at the step (masks grow with it); n_ctx, swa_full,
        n_ubatch, type_k, flash_attn, fused_lid: the llama_context settings the mask and
        rotation shapes depend on (flash attention and the fused indexer make F16 masks);
    draft_cost / verify_token_cost: a draft decode on the tail, and each extra verified
        token, as fractions of one plain decode (None: derived, see DEFAULT_SOURCES);
    client_bw: bytes/s the client reads weights at when it runs the head or the drafter.
    """

    layer_s: float = 1.0 / (ANCHOR_TOK_S * 43)
    acceptance: tuple[float, ...] = DEFAULT_ACCEPTANCE
    bandwidth_bps: float = 1e9
    context: int = 32768
    n_ctx: int = 131072
    swa_full: bool = True
    n_ubatch: int = 512
    type_k: str = "f16"
    flash_attn: bool = True
    fused_lid: bool = True
    draft_cost: float | None = None
    verify_token_cost: float | None = None
    client_bw: float = 50e9

    def __post_init__(self) -> None:
        errs = []

        def pos(name: str, v: object, allow_zero: bool = False) -> None:
            if isinstance(v, bool) or not isinstance(v, int | float) or v < 0 \
                    or (v == 0 and not allow_zero) or v != v:
                errs.append(f"{name} must be a number {'>=' if allow_zero else '>'} 0, "
                            f"got {v!r}")

        pos("layer_s", self.layer_s)
        pos("bandwidth_bps", self.bandwidth_bps)
        pos("client_bw", self.client_bw)
        for name in ("draft_cost", "verify_token_cost"):
            if getattr(self, name) is not None:
                pos(name, getattr(self, name), allow_zero=True)
        for name in ("context", "n_ctx", "n_ubatch"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                errs.append(f"{name} must be an int >= 1, got {v!r}")
        if not errs and self.context > self.n_ctx:
            errs.append(f"context ({self.context}) must be <= n_ctx ({self.n_ctx})")
        a = self.acceptance
        if not isinstance(a, tuple) or any(
                isinstance(x, bool) or not isinstance(x, int | float) or not 0 <= x <= 1
                for x in a):
            errs.append(f"acceptance must be a tuple of probabilities in [0, 1], got {a!r}")
        elif any(a[i + 1] > a[i] for i in range(len(a) - 1)):
            errs.append(f"acceptance is unconditional per position, so it cannot grow along "
                        f"the draft: got {a}")
        if self.type_k not in KV_TYPES:
            errs.append(f"type_k must be one of {sorted(KV_TYPES)}, got {self.type_k!r}")
        for name in ("swa_full", "flash_attn", "fused_lid"):
            if not isinstance(getattr(self, name), bool):
                errs.append(f"{name} must be a bool")
        if errs:
            raise InputError("bad projection params: " + "; ".join(errs))

    def tokens_per_verify(self, k: int) -> float:
        if k > len(self.acceptance):
            raise InputError(f"k={k} needs {k} acceptance values, got {len(self.acceptance)}")
        return 1.0 + sum(self.acceptance[:k])
