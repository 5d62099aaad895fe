"""Shard plans: contiguous layer ranges, one per shard, covering the trunk in order.

The one plan type of mtplib: the ownership derivation, the RPC loader and the ranged
runtime all take it. The first shard holds the head, the last (tail) shard the output
head and the MTP block.
"""

from __future__ import annotations

import bisect
import re
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from mtplib.errors import InputError


class PlanError(InputError):
    """A shard plan that is malformed, has gaps or overlaps, or leaves the layer range."""


@dataclass(frozen=True)
class ShardPlan:
    """Contiguous, gap-free layer ranges covering 0..n_layer-1, in order."""

    ranges: tuple[tuple[int, int], ...]
    n_layer: int

    def __post_init__(self) -> None:
        check_plan(self.ranges, self.n_layer)

    @property
    def n_shards(self) -> int:
        return len(self.ranges)

    def shard_of(self, layer: int) -> int:
        """The shard index of a trunk layer 0..n_layer-1."""
        for i, (a, b) in enumerate(self.ranges):
            if a <= layer <= b:
                return i
        raise PlanError(f"layer {layer} is outside the plan (0..{self.n_layer - 1})")

    def owner(self, layer: int) -> int:
        """Like `shard_of`, and layer == n_layer (upstream's output layer) is the tail's."""
        return self.n_shards - 1 if layer == self.n_layer else self.shard_of(layer)

    @classmethod
    def parse(cls, text: str, n_layer: int) -> ShardPlan:
        return parse_plan(text, n_layer)

    def tensor_split(self) -> list[float]:
        """Integer weights for upstream's tensor_split: layer counts, +1 on the tail for
        the output layer."""
        w = [float(b - a + 1) for a, b in self.ranges]
        w[-1] += 1.0
        return w

    def upstream_assignment(self) -> dict[int, int]:
        """Which device upstream's formula (llama-model.cpp load_tensors) picks for every
        layer 0..n_layer (the last = output), computed in float32 like upstream."""
        w = np.asarray(self.tensor_split(), dtype=np.float32)
        splits = list(np.cumsum(w, dtype=np.float32) / np.float32(w.sum()))
        n_all = self.n_layer + 1
        return {il: bisect.bisect_right(splits, float(np.float32(il) / np.float32(n_all)))
                for il in range(n_all)}

    def __str__(self) -> str:
        return ",".join(f"{a}-{b}" for a, b in self.ranges)


def check_endpoints(plan: ShardPlan, endpoints: Sequence[str]) -> list[str]:
    """``endpoints`` as a list, one per shard of ``plan`` (PlanError otherwise): the one
    place the shard count is checked against the endpoints given."""
    endpoints = list(endpoints)
    if len(endpoints) != plan.n_shards:
        raise PlanError(f"plan {plan} has {plan.n_shards} shards but {len(endpoints)} "
                        "endpoints were given")
    return endpoints


def check_plan(ranges: Sequence[tuple[int, int]], n_layer: int) -> None:
    """Raise PlanError naming the first problem: empty, reversed, gap, overlap, range."""
    if n_layer < 1:
        raise PlanError(f"the model has no trunk layers (n_layer={n_layer})")
    if not ranges:
        raise PlanError("a shard plan needs at least one range")
    starts = [a for a, _ in ranges]
    if starts != sorted(starts):
        raise PlanError(f"ranges are not in increasing layer order ({starts}); list them from "
                        "layer 0 up, the first shard holds the head and the last the tail")
    expect = 0
    for i, (a, b) in enumerate(ranges):
        if a > b:
            raise PlanError(f"range {i} ({a}-{b}) is reversed: first layer > last layer")
        if a < expect:
            raise PlanError(f"range {i} ({a}-{b}) overlaps the previous range (which ends at "
                            f"{expect - 1}); ranges must be contiguous and in order")
        if a > expect:
            raise PlanError(f"gap before range {i} ({a}-{b}): layers {expect}-{a - 1} belong "
                            "to no shard")
        if b >= n_layer:
            raise PlanError(f"range {i} ({a}-{b}) is out of range: the trunk has layers "
                            f"0-{n_layer - 1}")
        expect = b + 1
    if expect != n_layer:
        raise PlanError(f"layers {expect}-{n_layer - 1} belong to no shard; the last range "
                        f"must end at {n_layer - 1}")


_RANGE_RE = re.compile(r"^\s*(\d+)\s*(?:-\s*(\d+))?\s*$")


def parse_plan(text: str, n_layer: int) -> ShardPlan:
    """Parse "0-20,21-42" (a single layer may be written "7"). Errors name the problem."""
    if not isinstance(text, str) or not text.strip():
        raise PlanError("empty shard plan; write ranges like 0-20,21-42")
    ranges = []
    for part in text.split(","):
        m = _RANGE_RE.match(part)
        if not m:
            raise PlanError(f"cannot parse range {part.strip()!r} in {text!r}: write "
                            "FIRST-LAST with non-negative integers, e.g. 0-20,21-42")
        a = int(m.group(1))
        b = int(m.group(2)) if m.group(2) is not None else a
        ranges.append((a, b))
    return ShardPlan(tuple(ranges), n_layer)


def even_plan(n_layer: int, n_shards: int) -> ShardPlan:
    """Equal layer counts (earlier shards take the remainder)."""
    if not 1 <= n_shards <= n_layer:
        raise PlanError(f"n_shards must be in 1..{n_layer}, got {n_shards}")
    q, r = divmod(n_layer, n_shards)
    ranges, a = [], 0
    for i in range(n_shards):
        n = q + (1 if i < r else 0)
        ranges.append((a, a + n - 1))
        a += n
    return ShardPlan(tuple(ranges), n_layer)
