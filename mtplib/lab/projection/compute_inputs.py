"""The per-layer compute inputs of a projection (`mtplib.lab.projection`) and where they come
from: the published assumption (`ASSUMED_COMPUTE`) or a `mtplib layer-cost` result file
(`load_compute`, `ComputeInputs.from_layer_cost`).

Why apart: the only part of the projection that reads a file.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import PurePath

from mtplib.errors import InputError
from mtplib.lab.projection.constants import DEFAULT_SOURCES
from mtplib.lab.projection.params import ProjectionParams

# -- compute inputs: assumed or measured ---------------------------------------------------
#: What `mtplib layer-cost` writes (mtplib.lab.layer_cost): the schema it is read by.
LAYER_COST_SCHEMA = "mtplib.layer_cost/1"


@dataclass(frozen=True)
class ComputeInputs:
    """The per-layer compute inputs of a projection and where they come from (issue 24):
    the published assumption, or a measurement on the V4-Flash-width slice with its
    hardware. ``layer_s`` folds the head in (V4-Flash's plain decode / 43), as the
    assumption did; None for a cost means `compute_model` derives it (DEFAULT_SOURCES)."""

    name: str
    layer_s: float
    hardware: str
    source: str
    verify_token_cost: float | None = None
    draft_cost: float | None = None
    spread: dict = field(default_factory=dict, compare=False)
    steps: int | None = None

    def __post_init__(self) -> None:
        ProjectionParams(layer_s=self.layer_s, verify_token_cost=self.verify_token_cost,
                         draft_cost=self.draft_cost)  # the same checks as the params

    def params(self, base: ProjectionParams | None = None) -> ProjectionParams:
        """``base`` (default: the defaults) with these compute inputs."""
        return replace(base or ProjectionParams(), layer_s=self.layer_s,
                       verify_token_cost=self.verify_token_cost, draft_cost=self.draft_cost)

    @classmethod
    def from_layer_cost(cls, d: Mapping, *, name: str | None = None,
                        path: str | None = None) -> ComputeInputs:
        """The inputs a `mtplib layer-cost` result (its JSON, loaded) measured."""
        if not isinstance(d, Mapping) or d.get("schema") != LAYER_COST_SCHEMA:
            raise InputError(f"{path or 'the layer-cost result'} is not a "
                             f"{LAYER_COST_SCHEMA} result (mtplib layer-cost writes one)")
        try:
            basis = d.get("projection_basis", "wall")
            der = d["derived_cpu"] if basis == "cpu" else d["derived"]
            hw, cfg = d["hardware"], d["config"]
            gpu = bool(hw.get("gpus")) and bool(d.get("backend", {}).get("gpu_devices"))
            spread = {k: der[k] for k in ("layer_ms_p10_p90", "v4_flash_decode_ms_p10_p90",
                                          "verify_token_cost_p10_p90", "draft_cost_p10_p90",
                                          "draft_ms_p10_p90") if k in der}
            spread.update({k: der[k] for k in ("layer_ms", "v4_flash_decode_ms", "draft_ms")
                           if k in der})
            return cls(name=name or ("measured-gpu" if gpu else "measured-cpu"),
                       layer_s=float(der["layer_s"]), hardware=str(hw["label"]),
                       source=(f"measured on the V4-Flash-width slice by `{d.get('command')}`"
                               f" ({cfg['steps']} steps per series, {basis} time, threads "
                               f"{cfg['threads']}{', ' + PurePath(path).name if path else ''})"),
                       verify_token_cost=float(der["verify_token_cost"]),
                       draft_cost=float(der["draft_cost"]), spread=spread,
                       steps=int(cfg["steps"]))
        except (KeyError, TypeError, ValueError) as e:
            raise InputError(f"{path or 'the layer-cost result'} lacks a field the "
                             f"projection needs ({e})") from None


#: The assumption the measurements replace: the PR's DGX Spark baseline over 43 layers.
ASSUMED_COMPUTE = ComputeInputs(
    name="assumed", layer_s=ProjectionParams().layer_s,
    hardware="DGX Spark (llama.cpp PR #25784's baseline)", source=DEFAULT_SOURCES["layer_s"])


def load_compute(path) -> ComputeInputs:
    """`ComputeInputs.from_layer_cost` of a result file."""
    import json
    from pathlib import Path

    p = Path(path)
    try:
        d = json.loads(p.read_text())
    except (OSError, ValueError) as e:
        raise InputError(f"cannot read the layer-cost result {p}: {e}") from None
    return ComputeInputs.from_layer_cost(d, path=str(p))
