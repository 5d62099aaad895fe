"""The projection's sourced constants (`mtplib.lab.projection`): the anchors it is calibrated
on, the published acceptance, the measured graph and control bytes per shard pass, and
where each default comes from (`DEFAULT_SOURCES`).

Why a module of their own: every other part of the projection reads them, and a reader
checking a figure against its source finds all of them in one place.
"""

from __future__ import annotations

from mtplib.contract import labels
from mtplib.contract.labels import StepKind
from mtplib.contract.types import DType
from mtplib.errors import InputError

# -- sourced constants --------------------------------------------------------------------
#: One H200's memory as NVIDIA states it (141 GB, decimal): the capacity a shard must fit.
H200_BYTES = 141 * 10**9
#: llama.cpp's V4 MTP PR (#25784, cited in `mtplib.lab.common.display.REFERENCES`): about 1.5x
#: with draft length 2 on a 16.4 tok/s baseline (hardware: a DGX Spark).
ANCHOR_TOK_S = 16.4
ANCHOR_SPEEDUP_K2 = 1.5
#: vLLM's V4 MTP per-position acceptance with 2 drafts (`mtplib.lab.common.display.REFERENCES`).
VLLM_ACCEPTANCE = (0.77, 0.37)
#: Position 3 is not published: assumed to keep position 2's conditional rate
#: (0.37 / 0.77), i.e. 0.37 * 0.37 / 0.77.
DEFAULT_ACCEPTANCE = (0.77, 0.37, round(0.37 * 0.37 / 0.77, 4))
WIRE_DTYPES = {"f32": DType.F32, "bf16": DType.BF16, "f16": DType.F16}
QUANTIZED_K = {"q8_0"}  # the KV_TYPES upstream counts as quantized (ggml_is_quantized)
PLACEMENTS = labels.PLACEMENTS
#: the step kinds a projection models (`mtplib.contract.labels.StepKind`): a plain (MTP-off)
#: decode, a verify, a draft, a feed
STEP_KINDS: tuple[StepKind, ...] = (StepKind.DECODE, StepKind.VERIFY, StepKind.DRAFT,
                                    StepKind.FEED)
#: the projection's older name of a plain decode step, still accepted for StepKind.DECODE
PLAIN = "plain"


def step_kind(kind: str) -> StepKind:
    """``kind`` as a StepKind (``"plain"``: the decode step); InputError naming the kinds."""
    if kind == PLAIN:
        return StepKind.DECODE
    if kind not in STEP_KINDS:
        raise InputError(f"step kind must be one of {', '.join(STEP_KINDS)} (or {PLAIN!r} "
                         f"for decode), got {kind!r}")
    return StepKind(kind)

# -- graph and control bytes per shard pass (issue 29), measured ---------------------------
# Counted by the relays per step on the trained pair (4 layers, plan 0-1,2-3, k=2, the drafter
# in the client, CPU RPC shards) and on a 6-layer fixture with V4-Flash's layer kinds (plan
# 0-2,3-5); the runs and their counts: evidence/graph-reuse/.
#: graph bytes per verify step on both shards with patches 0001-0004: each shard's whole
#: graph (GRAPH_COMPUTE) on every step (its split uids alternate, issue 29)
GRAPH_BYTES_WHOLE_VERIFY_TRAINED = 329_064
#: ... per layer a shard holds and pass (329,064 B / 4 layers, about 82 KB)
GRAPH_BYTES_PER_LAYER_WHOLE = GRAPH_BYTES_WHOLE_VERIFY_TRAINED / 4
#: graph bytes per shard pass with patches 0005+0006 (graph slots): 16 B per verify step on
#: 2 shards, one GRAPH_RECOMPUTE_SLOT each, once each width has been seen
GRAPH_BYTES_SLOT_PER_PASS = 16 / 2
#: control bytes (RPC command headers and replies) per verify step, 2 shards: 4 layers
#: (trained pair) and 6 layers (the fixture)
CONTROL_BYTES_VERIFY_4_LAYERS = 13_864
CONTROL_BYTES_VERIFY_6_LAYERS = 20_772
#: control bytes per plain decode step (MTP off), trained pair
CONTROL_BYTES_PLAIN_4_LAYERS = 10_410
#: an ESTIMATE from those two points (both 2 shards): control per verify step grows by
#: (20,772 - 13,864) / 2 = 3,454 B per layer, i.e. per layer its shard holds, plus
#: (13,864 - 4 x 3,454) / 2 = 24 B per shard pass
CONTROL_BYTES_PER_LAYER_VERIFY = (CONTROL_BYTES_VERIFY_6_LAYERS
                                  - CONTROL_BYTES_VERIFY_4_LAYERS) / 2
CONTROL_BYTES_PER_PASS_VERIFY = (CONTROL_BYTES_VERIFY_4_LAYERS
                                 - 4 * CONTROL_BYTES_PER_LAYER_VERIFY) / 2
#: a plain decode's control against a verify step's (one point: the trained pair)
CONTROL_PLAIN_OVER_VERIFY = CONTROL_BYTES_PLAIN_4_LAYERS / CONTROL_BYTES_VERIFY_4_LAYERS

DEFAULT_SOURCES: dict[str, str] = {
    "layer_s": "1 / (16.4 tok/s x 43 layers) = 1.418 ms: the baseline of llama.cpp's V4 MTP PR "
               "(#25784) spread evenly over the 43 trunk layers; an ASSUMPTION (the "
               "PR measured on a DGX Spark, not an H200, and the head's share is folded in)",
    "acceptance": "vLLM V4 MTP per-position acceptance 0.77 / 0.37 (cited in "
                  "mtplib.lab.common.display.REFERENCES); position 3 ASSUMED at the same "
                  "conditional rate (0.178)",
    "draft_cost": "memory-bound: bytes one MTP draft reads (block 43 with 6 of 256 routed "
                  "experts, the MTP's hc head and its 129,280 x 4096 output head) over the "
                  "bytes one trunk token reads, both from the weight-less V4-Flash table",
    "verify_token_cost": "calibrated so that the whole model at RTT 0 with k=2 and the vLLM "
                         "acceptance gives the PR's 1.5x (llama.cpp PR #25784)",
    "bandwidth_bps": "1 Gbit/s per client, shared by all shard links: an ASSUMPTION",
    "client_bw": "50 GB/s of DRAM read bandwidth on the client (CPU head / drafter): an "
                 "ASSUMPTION, not measured",
    "structure": "waits counted per RPC command on the trained pair, plan 0-1,2-3 (issue 14)",
    "capacity": "one H200 = 141 GB (NVIDIA's figure, decimal)",
    "reserve": "8 GiB per shard for compute buffers and the CUDA context: an ASSUMPTION",
}


def itemsize(dtype: str) -> int:
    try:
        return WIRE_DTYPES[dtype].itemsize
    except KeyError:
        raise InputError(f"boundary dtype must be one of {sorted(WIRE_DTYPES)}, "
                         f"got {dtype!r}") from None


def pad_to(x: int, n: int) -> int:
    return (x + n - 1) // n * n
