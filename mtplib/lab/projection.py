"""Projection: ranged DeepSeek-V4-Flash MTP over a WAN, from its tensor table and a message
structure (issue 14 item 7).

Why: the WAN benchmark runs on a tiny trained pair; whether ranged MTP pays for the real
model depends on V4-Flash's sizes (hidden rows, vocabulary, masks, the indexer's rotation
matrix) and on how many times per step the client waits on a shard. This module puts the
two together with the cost model of the issue,

    t_step = compute + RTT x waits_on_remote_shards + bytes_on_remote_links / bandwidth,

and answers which shard plans fit one H200 each. Pure Python: it reads the weight-less
V4-Flash table (`mtplib fixture --preset v4-flash`) through `mtplib.ownership` and never
loads llama.cpp. Nothing here measures V4-Flash; every default names its source in
`DEFAULT_SOURCES` and evidence/wan/PROJECTION.md, and the measured inputs (the message
structures, the graph and control bytes per shard pass) name the runs they come from.

Topology (upstream's RPC backend, reference §8): a star. A boundary value goes shard i ->
client (GET_TENSOR: the client waits) -> shard i+1 (SET_TENSOR: fire-and-forget); graph
inputs are set from the client into every shard whose split reads them, once per step.

Acceptance convention (as `mtplib.lab.bench`): ``acceptance[i]`` is the unconditional
probability that draft position i+1 is accepted (it counts only when every earlier one
is), so the expected tokens per verify step are ``1 + sum(acceptance[:k])``.

This module is the projection's front door; the model lives by concern, and every name is
exported here as before: the sourced constants in `projection_constants`, the message
structure in `projection_structure`, the scenario and parameters in `projection_params`,
the compute inputs read from a layer-cost file in `projection_compute_inputs`, what a shard
receives per step in `projection_graph_inputs`, one step's traffic in `projection_traffic`,
the compute model in `projection_compute`, the tables in `projection_sweep`, the H200 fit
in `projection_fit` and the plot in `projection_plots`.
"""

from __future__ import annotations

from mtplib.contract.labels import Placement, StepKind
from mtplib.lab.projection_compute import ComputeModel, active_bytes, compute_model
from mtplib.lab.projection_compute_inputs import (
    ASSUMED_COMPUTE,
    LAYER_COST_SCHEMA,
    ComputeInputs,
    load_compute,
)
from mtplib.lab.projection_constants import (
    ANCHOR_SPEEDUP_K2,
    ANCHOR_TOK_S,
    CONTROL_BYTES_PER_LAYER_VERIFY,
    CONTROL_BYTES_PER_PASS_VERIFY,
    CONTROL_BYTES_PLAIN_4_LAYERS,
    CONTROL_BYTES_VERIFY_4_LAYERS,
    CONTROL_BYTES_VERIFY_6_LAYERS,
    CONTROL_PLAIN_OVER_VERIFY,
    DEFAULT_ACCEPTANCE,
    DEFAULT_SOURCES,
    GRAPH_BYTES_PER_LAYER_WHOLE,
    GRAPH_BYTES_SLOT_PER_PASS,
    GRAPH_BYTES_WHOLE_VERIFY_TRAINED,
    H200_BYTES,
    PLACEMENTS,
    PLAIN,
    QUANTIZED_K,
    STEP_KINDS,
    VLLM_ACCEPTANCE,
    WIRE_DTYPES,
    itemsize,
    step_kind,
)
from mtplib.lab.projection_fit import fit_rows
from mtplib.lab.projection_graph_inputs import (
    MTP_INPUT_TENSORS,
    ShardRole,
    constants,
    graph_inputs,
    hadamard_side,
    n_kv_comp,
    n_kv_raw,
    rotation_constants,
    shard_roles,
    state_index_inputs,
)
from mtplib.lab.projection_params import DEFAULT_SCENARIOS, ProjectionParams, Scenario
from mtplib.lab.projection_plots import plot_projection
from mtplib.lab.projection_structure import (
    CONTRACT,
    GRAPH_SLOTS,
    GRAPH_STRUCTURES,
    MEASURED,
    SEAM_ONCE,
    STRUCTURES,
    TODAY,
    WHOLE_GRAPH,
    MessageStructure,
    StepWaits,
)
from mtplib.lab.projection_sweep import cycle, plans_for, project, traffic_rows
from mtplib.lab.projection_traffic import CLASSES, StepTraffic, step_traffic

#: Placement and StepKind: the labels this module imported before its split, still here
__all__ = [
    "Placement", "StepKind",
    "ANCHOR_SPEEDUP_K2", "ANCHOR_TOK_S", "ASSUMED_COMPUTE", "CLASSES", "CONTRACT",
    "CONTROL_BYTES_PER_LAYER_VERIFY", "CONTROL_BYTES_PER_PASS_VERIFY",
    "CONTROL_BYTES_PLAIN_4_LAYERS", "CONTROL_BYTES_VERIFY_4_LAYERS",
    "CONTROL_BYTES_VERIFY_6_LAYERS", "CONTROL_PLAIN_OVER_VERIFY", "ComputeInputs", "ComputeModel",
    "DEFAULT_ACCEPTANCE", "DEFAULT_SCENARIOS", "DEFAULT_SOURCES", "GRAPH_BYTES_PER_LAYER_WHOLE",
    "GRAPH_BYTES_SLOT_PER_PASS", "GRAPH_BYTES_WHOLE_VERIFY_TRAINED", "GRAPH_SLOTS",
    "GRAPH_STRUCTURES", "H200_BYTES", "LAYER_COST_SCHEMA", "MEASURED", "MTP_INPUT_TENSORS",
    "MessageStructure", "PLACEMENTS", "PLAIN", "ProjectionParams", "QUANTIZED_K", "SEAM_ONCE",
    "STEP_KINDS", "STRUCTURES", "Scenario", "ShardRole", "StepTraffic", "StepWaits", "TODAY",
    "VLLM_ACCEPTANCE", "WHOLE_GRAPH", "WIRE_DTYPES", "active_bytes", "compute_model", "constants",
    "cycle", "fit_rows", "graph_inputs", "hadamard_side", "itemsize", "load_compute", "n_kv_comp",
    "n_kv_raw", "plans_for", "plot_projection", "project", "rotation_constants", "shard_roles",
    "state_index_inputs", "step_kind", "step_traffic", "traffic_rows",
]
