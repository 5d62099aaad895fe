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
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import PurePath

from mtplib.contract import labels
from mtplib.contract.labels import Placement, StepKind
from mtplib.contract.seam import seam_bytes_per_token
from mtplib.contract.types import DType, ModelDims
from mtplib.errors import InputError
from mtplib.model.arch import HC, V4Config
from mtplib.ownership.derivation import (
    DSV4_CSA,
    DSV4_HCA,
    KV_TYPES,
    CacheParams,
    Inventory,
    balanced_plan,
    derive,
)
from mtplib.ownership.plan import ShardPlan, even_plan, parse_plan

# -- sourced constants --------------------------------------------------------------------
#: One H200's memory as NVIDIA states it (141 GB, decimal): the capacity a shard must fit.
H200_BYTES = 141 * 10**9
#: llama.cpp's V4 MTP PR (#25784, cited in `mtplib.lab.display.REFERENCES`): about 1.5x
#: with draft length 2 on a 16.4 tok/s baseline (hardware: a DGX Spark).
ANCHOR_TOK_S = 16.4
ANCHOR_SPEEDUP_K2 = 1.5
#: vLLM's V4 MTP per-position acceptance with 2 drafts (`mtplib.lab.display.REFERENCES`).
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
                  "mtplib.lab.display.REFERENCES); position 3 ASSUMED at the same "
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


def _pad(x: int, n: int) -> int:
    return (x + n - 1) // n * n


# -- the indexer's rotation matrix ---------------------------------------------------------
def hadamard_side(head_size: int) -> int:
    """Side of the Hadamard matrix upstream uploads as ``attn_inp_k_rot`` for a cache of
    head size ``head_size`` (src/llama-kv-cache.cpp build_input_k_rot at the pin): the
    largest power of two dividing it, found by doubling from 128, and 64 when 128 does not
    divide it (the loop starts at 64 and always doubles once)."""
    if isinstance(head_size, bool) or not isinstance(head_size, int) or head_size < 1:
        raise InputError(f"head size must be an int >= 1, got {head_size!r}")
    nrot = 64
    while True:
        nrot *= 2
        if head_size % nrot:
            break
    return nrot // 2


def rotation_constants(cfg: V4Config, type_k: str = "f16") -> dict[str, int]:
    """Bytes of each F32 rotation matrix upstream re-uploads on every graph, by the cache
    that owns it (a shard receives one when it holds a layer of that cache).

    Upstream (llama_kv_cache constructor) turns rotation on for a cache when its K type is
    quantized and its head size is a multiple of 64, and always for the DeepSeek lightning
    indexer (the `lid` cache: head size = indexer key length). V4's raw / CSA / HCA caches
    have head size head_dim (K only)."""
    if type_k not in KV_TYPES:
        raise InputError(f"type_k must be one of {sorted(KV_TYPES)}, got {type_k!r}")
    out = {"lid": hadamard_side(cfg.indexer_dim) ** 2 * 4}
    if type_k in QUANTIZED_K and cfg.head_dim % 64 == 0:
        side = hadamard_side(cfg.head_dim) ** 2 * 4
        out.update({"raw": side, "csa": side, "hca": side})
    return out


# -- the message structure (an input) ------------------------------------------------------
@dataclass(frozen=True)
class StepWaits:
    """Synchronous round trips (the client sends and waits for the answer) in one step.

    per_seam: waits on the upstream shard of every seam (the GETs of the boundary values:
        grows with the shard count);
    fixed: waits on non-tail shards that do not grow with the shard count (counted on
        shard 0);
    tail: waits answered by the tail shard (logits, hidden rows, h_nextn, draft outputs).
    """

    per_seam: float = 0.0
    fixed: float = 0.0
    tail: float = 0.0

    def __post_init__(self) -> None:
        for k, v in asdict(self).items():
            if isinstance(v, bool) or not isinstance(v, int | float) or v < 0:
                raise InputError(f"StepWaits.{k} must be a number >= 0, got {v!r}")

    def on_shards(self, n_shards: int) -> list[float]:
        """Waits per shard (plan order) for a plan of ``n_shards``."""
        if n_shards == 1:
            return [self.tail]
        w = [float(self.per_seam)] * (n_shards - 1) + [float(self.tail)]
        w[0] += self.fixed
        return w


@dataclass(frozen=True)
class MessageStructure:
    """How a ranged step talks to its shards: the waits per step kind and the shape of the
    seam. The projection's only measured input; plug in a WAN run's counts with
    `from_run`.

    plain: one MTP-off decode (one token through every shard, the sampler's rows back);
    verify_head_tail: one verify step of k+1 tokens with the output head on the tail (the
        client gets logits, and the trunk's h_nextn rows for the drafter);
    verify_head_client: the same with the head in the client (the tail returns hidden rows,
        which are also the drafter's rows);
    draft_on_tail: one MTP draft decode on the tail shard (a client drafter costs none);
    feed_on_tail: feeding one verify step's accepted rows to the tail's MTP context;
    seam_tensors: hc*n_embd-wide tensors crossing each seam per token (each one GET and one
        SET through the client);
    other_bytes_per_shard_pass: any other bytes per shard and pass (0: none);
    graph_bytes_per_pass: graph description bytes per shard pass of a decode or verify step
        when the shard reuses its graph (a recompute message; 0: not modelled);
    graph_bytes_per_layer_verify: graph bytes per layer the shard holds in a verify step,
        when it is sent whole every step (patches 0001-0004); 0: verify steps reuse it too
        (graph_bytes_per_pass);
    control_bytes_per_layer / control_bytes_per_pass: RPC control bytes (command headers,
        replies) of a verify step's shard pass, per layer the shard holds and per pass (a
        plain decode's: control_plain_scale x that; all 0: not modelled);
    constants_per_step: the rotation matrices (``attn_inp_k_rot``) are re-sent to their
        shards on every step (stock); False: uploaded once per context (patches/0003);
    source: where the numbers come from.
    """

    plain: StepWaits = StepWaits(per_seam=2, tail=1)
    verify_head_tail: StepWaits = StepWaits(per_seam=2, tail=2)
    verify_head_client: StepWaits = StepWaits(per_seam=2, tail=1)
    draft_on_tail: StepWaits = StepWaits(tail=2)
    feed_on_tail: StepWaits = StepWaits()
    seam_tensors: int = 2
    other_bytes_per_shard_pass: int = 0
    graph_bytes_per_pass: float = 0.0
    graph_bytes_per_layer_verify: float = 0.0
    control_bytes_per_layer: float = 0.0
    control_bytes_per_pass: float = 0.0
    control_plain_scale: float = 1.0
    constants_per_step: bool = True
    source: str = ("issue 14, trained pair, plan 0-1,2-3: MTP off 2 GETs on shard 0 (the "
                   "two 2,048 B hc*n_embd tensors of the seam) + 1 on shard 1 (logits) = 3 "
                   "waits per token; verify = plain + 1 (the separate h_nextn fetch) with "
                   "the head on the tail, + 0 with it in the client (the issue's targets); "
                   "about 2 GETs per MTP draft decode on the tail")

    def __post_init__(self) -> None:
        for k in ("plain", "verify_head_tail", "verify_head_client", "draft_on_tail",
                  "feed_on_tail"):
            if not isinstance(getattr(self, k), StepWaits):
                raise InputError(f"MessageStructure.{k} must be a StepWaits")
        if isinstance(self.seam_tensors, bool) or not isinstance(self.seam_tensors, int) \
                or self.seam_tensors < 1:
            raise InputError(f"seam_tensors must be an int >= 1, got {self.seam_tensors!r}")
        if not isinstance(self.other_bytes_per_shard_pass, int) \
                or self.other_bytes_per_shard_pass < 0:
            raise InputError("other_bytes_per_shard_pass must be an int >= 0")
        if not isinstance(self.constants_per_step, bool):
            raise InputError("constants_per_step must be a bool")
        for k in ("graph_bytes_per_pass", "graph_bytes_per_layer_verify",
                  "control_bytes_per_layer", "control_bytes_per_pass", "control_plain_scale"):
            v = getattr(self, k)
            if isinstance(v, bool) or not isinstance(v, int | float) or not v >= 0 \
                    or v == float("inf"):
                raise InputError(f"MessageStructure.{k} must be a finite number >= 0, "
                                 f"got {v!r}")

    def graph_bytes(self, kind: StepKind, n_layers: int) -> float:
        """Graph bytes of one shard pass holding ``n_layers`` layers."""
        if kind == StepKind.VERIFY and self.graph_bytes_per_layer_verify:
            return self.graph_bytes_per_layer_verify * n_layers
        return self.graph_bytes_per_pass

    def control_bytes(self, kind: StepKind, n_layers: int) -> float:
        """RPC control bytes of one shard pass holding ``n_layers`` layers."""
        verify = self.control_bytes_per_pass + self.control_bytes_per_layer * n_layers
        return verify * (self.control_plain_scale if kind == StepKind.DECODE else 1.0)

    def verify(self, head: str) -> StepWaits:
        return self.verify_head_client if head == "client" else self.verify_head_tail

    @classmethod
    def from_run(cls, run: Mapping, *, per_seam: float | None = None) -> MessageStructure:
        """The structure a WAN run measured, from a mapping of this form (one plan):

            {"n_shards": 2, "head": "tail",            # where the run's output head was
             "waits": {"plain":  [2, 1],               # waits per MTP-off decode, per shard
                       "verify": [2, 2],               # per verify step, per shard
                       "draft":  [0, 2],               # per MTP draft decode (tail drafter)
                       "feed":   [0, 0]},              # per verify step (optional)
             "seam_tensors": 2,                        # optional, default 2
             "other_bytes_per_shard_pass": 0,          # optional
             "source": "outputs/<run>/bench.json"}     # optional

        Lists are in plan order. The tail's count becomes ``tail``; the other shards'
        counts are split into ``per_seam`` (waits every non-tail shard has) and ``fixed``
        (the rest): with 3 or more shards per_seam is the smallest count of a middle shard;
        with 2 it cannot be told apart from fixed and is taken from ``per_seam`` (default:
        one wait per seam tensor). Kinds not given keep the defaults.
        """
        if not isinstance(run, Mapping):
            raise InputError(f"a measured structure is a mapping, got {type(run).__name__}")
        n = run.get("n_shards")
        waits = run.get("waits")
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise InputError(f"n_shards must be an int >= 1, got {n!r}")
        if not isinstance(waits, Mapping) or not waits:
            raise InputError("waits must map step kinds to per-shard counts")
        unknown = {w for w in waits if w != PLAIN and w not in STEP_KINDS}
        if unknown:
            raise InputError(f"unknown step kinds {sorted(unknown)} (known: "
                             f"{', '.join(STEP_KINDS)}; {PLAIN!r} = decode)")
        head = run.get("head", "tail")
        if head not in PLACEMENTS:
            raise InputError(f"head must be one of {PLACEMENTS}, got {head!r}")
        seam_tensors = run.get("seam_tensors", cls.seam_tensors)
        seam_w = float(seam_tensors if per_seam is None else per_seam)
        fields: dict = {}
        for kind, counts in waits.items():
            if not isinstance(counts, Sequence) or len(counts) != n or any(
                    isinstance(c, bool) or not isinstance(c, int | float) or c < 0
                    for c in counts):
                raise InputError(f"waits[{kind!r}] must list {n} counts >= 0, got {counts!r}")
            tail = float(counts[-1])
            if n == 1:
                sw = StepWaits(tail=tail)
            else:
                ps = 0.0 if kind in (StepKind.DRAFT, StepKind.FEED) else (
                    min(counts[1:-1]) if n >= 3 else seam_w)
                fixed = sum(counts[:-1]) - ps * (n - 1)
                if fixed < 0:
                    raise InputError(f"waits[{kind!r}] = {list(counts)}: fewer waits on the "
                                     f"non-tail shards than {ps:g} per seam")
                sw = StepWaits(per_seam=ps, fixed=fixed, tail=tail)
            key = {StepKind.DECODE: "plain", StepKind.DRAFT: "draft_on_tail",
                   StepKind.FEED: "feed_on_tail",
                   StepKind.VERIFY: f"verify_head_{head}"}[step_kind(kind)]
            fields[key] = sw
        return cls(**fields, seam_tensors=seam_tensors,
                   other_bytes_per_shard_pass=run.get("other_bytes_per_shard_pass", 0),
                   constants_per_step=run.get("constants_per_step", True),
                   source=str(run.get("source", "a WAN run (from_run)")))


#: The issue's measured counts with the issue's verify targets (the default).
MEASURED = MessageStructure()
#: Today's verify as counted in the issue (k=2): 3 GETs on shard 0 and 4 on shard 1 (the
#: eval-callback capture of h_nextn splits the graph). With 2 shards the extra shard-0
#: wait cannot be told from a per-seam one: counted as fixed.
TODAY = replace(MEASURED, verify_head_tail=StepWaits(per_seam=2, fixed=1, tail=4),
                verify_head_client=StepWaits(per_seam=2, fixed=1, tail=4),
                source="issue 14 as measured today: verify k=2 = 3 GETs on shard 0 + 4 on "
                       "shard 1; plain and draft as MEASURED")
#: The contract's minimum: one boundary row per seam and token, one wait per seam.
CONTRACT = replace(MEASURED, plain=StepWaits(per_seam=1, tail=1),
                   verify_head_tail=StepWaits(per_seam=1, tail=2),
                   verify_head_client=StepWaits(per_seam=1, tail=1), seam_tensors=1,
                   source="mtplib.contract.seam: one hc*n_embd row per seam and token, one "
                          "wait per seam; output and draft waits as MEASURED")
#: Measured on the patched build (patches/0002-0004; evidence/upstream-patches/README.md):
#: one round trip per seam, one boundary tensor per seam, no constant re-sent.
SEAM_ONCE = replace(MEASURED, plain=StepWaits(per_seam=1, tail=1),
                    verify_head_tail=StepWaits(per_seam=1, tail=2),
                    verify_head_client=StepWaits(per_seam=1, tail=1), seam_tensors=1,
                    constants_per_step=False,
                    source="patches/0002-0004, trained pair, plans 0-1,2-3 and 0-0,1-2,3-3, "
                           "every shard behind a WAN link, head and drafter in the client: "
                           "1 wait per shard per plain decode and per verify step (2 and 3), "
                           "l_last alone crosses each seam, attn_inp_k_rot 0 B per step; "
                           "verify with the head on the tail and tail drafts as MEASURED")
STRUCTURES = {"measured": MEASURED, "today": TODAY, "seam_once": SEAM_ONCE,
              "contract": CONTRACT}
#: SEAM_ONCE with the graph and control bytes counted (issue 29; evidence/graph-reuse/):
#: patches 0001-0004 send each shard's whole graph on every verify step (MTP off reuses it);
_GRAPH_CONTROL = {"graph_bytes_per_pass": GRAPH_BYTES_SLOT_PER_PASS,
                  "control_bytes_per_layer": CONTROL_BYTES_PER_LAYER_VERIFY,
                  "control_bytes_per_pass": CONTROL_BYTES_PER_PASS_VERIFY,
                  "control_plain_scale": CONTROL_PLAIN_OVER_VERIFY}
WHOLE_GRAPH = replace(SEAM_ONCE, **_GRAPH_CONTROL,
                      graph_bytes_per_layer_verify=GRAPH_BYTES_PER_LAYER_WHOLE,
                      source="seam_once + patches 0001-0004's graph bytes: the whole graph "
                             "(about 82 KB per layer) on every verify step; control bytes "
                             "per layer (estimate); evidence/graph-reuse/")
#: ... and with patches 0005+0006 every step reuses its graph slot (8 B per shard pass)
GRAPH_SLOTS = replace(SEAM_ONCE, **_GRAPH_CONTROL,
                      source="seam_once + patches 0005+0006 (graph slots): 8 B of graph per "
                             "shard pass on every step; control bytes per layer (estimate); "
                             "evidence/graph-reuse/")
#: the structures with graph and control bytes (beside STRUCTURES, whose tables they leave
#: as they are)
GRAPH_STRUCTURES = {"whole_graph": WHOLE_GRAPH, "graph_slots": GRAPH_SLOTS}


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


# -- plans and shards ----------------------------------------------------------------------
@dataclass(frozen=True)
class ShardRole:
    """What a shard's layer range implies for the messages it gets."""

    index: int
    layers: tuple[int, int]
    first: bool
    last: bool
    has_csa: bool
    has_hca: bool
    has_hash: bool


def shard_roles(cfg: V4Config, plan: ShardPlan) -> list[ShardRole]:
    out = []
    for i, (a, b) in enumerate(plan.ranges):
        rs = cfg.compress_ratios[a:b + 1]
        out.append(ShardRole(i, (a, b), i == 0, i == plan.n_shards - 1, DSV4_CSA in rs,
                             DSV4_HCA in rs, a < cfg.n_hash_layers))
    return out


def plans_for(inv: Inventory, n_shards: Iterable[int],
              kinds: Sequence[str] = ("even", "balanced")) -> list[tuple[str, ShardPlan]]:
    """(kind, plan) for every shard count: even layer counts (`even_plan`) and byte-balanced
    ranges (`balanced_plan`); a kind that gives the same ranges as an earlier one is kept
    (both rows say so) so tables stay rectangular."""
    out = []
    for n in n_shards:
        for kind in kinds:
            if kind == "even":
                out.append((kind, even_plan(inv.config.n_layer, n)))
            elif kind == "balanced":
                out.append((kind, balanced_plan(inv, n)))
            else:
                raise InputError(f"plan kind must be 'even' or 'balanced', got {kind!r}")
    return out


# -- per-step graph inputs (src/llama-graph.cpp, src/llama-kv-cache*.cpp at the pin) -------
def n_kv_raw(cfg: V4Config, params: ProjectionParams, context: int) -> int:
    """Width of the raw SWA mask: llama_kv_cache::get_n_kv = min(cells, max(256,
    PAD(used_max_p1, 256))); one sequence fills cells in order, so used_max_p1 = context
    until the ring wraps (swa_full: n_ctx_seq cells; else PAD(min(n_ctx_seq, n_swa +
    n_ubatch), 256))."""
    e = CacheParams(n_ctx=params.n_ctx, n_ubatch=params.n_ubatch).effective()
    cells = e["n_ctx_seq"] if params.swa_full else _pad(
        min(e["n_ctx_seq"], cfg.sliding_window + e["n_ubatch"]), 256)
    return min(cells, max(256, _pad(context, 256)))


def n_kv_comp(ratio: int, context: int) -> int:
    """Width of a compressed mask (dsv4_build_comp_plan): max(PAD(max n_visible, 256), 256)
    with n_visible = (pos + 1) / ratio."""
    return max(_pad(context // ratio, 256), 256)


def state_index_inputs(name: str, ratio: int, n_tok: int, n_rs_seq: int) -> dict[str, int]:
    """The I32/I64 index tensors of one compressor per ubatch of one sequence
    (dsv4_build_comp_plan; a tensor of size 0 is not built): state_pos; persist src/dst
    (one per state row touched); read (2*ratio per block for the overlapping CSA/indexer
    compressor, ratio for HCA); write idx (I64) and pos, one per block, at least one (the
    dummy block); restore src/dst (state rows) and snapshot src/dst (n_rs_seq planes of
    them) when n_rs_seq > 0."""
    state = 2 * ratio if ratio == DSV4_CSA else ratio
    reads = 2 * ratio if ratio == DSV4_CSA else ratio
    blocks = max(1, -(-n_tok // ratio))
    p = f"dsv4_{name}_state_"
    d = {p + "pos": 4 * n_tok, p + "persist_src_idxs": 4 * min(n_tok, state),
         p + "persist_dst_idxs": 4 * min(n_tok, state), p + "read_idxs": 4 * blocks * reads,
         p + "write_idxs": 8 * blocks, p + "write_pos": 4 * blocks}
    if n_rs_seq:
        d.update({p + "restore_src_idxs": 4 * state, p + "restore_dst_idxs": 4 * state,
                  p + "snapshot_src_idxs": 4 * n_rs_seq * state,
                  p + "snapshot_dst_idxs": 4 * n_rs_seq * state})
    return d


def graph_inputs(cfg: V4Config, role: ShardRole, params: ProjectionParams, *, n_tok: int,
                 n_out: int, n_rs_seq: int, context: int | None = None) -> dict[str, int]:
    """Bytes of every per-step graph input one shard receives for a trunk pass of ``n_tok``
    tokens (one entry per tensor, named as upstream names it: each is one SET_TENSOR).
    Masks are n_kv x n_tokens (no padding of n_tokens at the pin); F16 with flash
    attention (the indexer's with the fused indexer), else F32. out_ids is always built at
    the pin (build_inp_out_ids), so the tail always gets it."""
    L = params.context if context is None else context
    m = 2 if params.flash_attn else 4
    m_lid = 2 if params.fused_lid else 4
    d = {"inp_pos": 4 * n_tok, "attn_inp_k_idxs": 8 * n_tok,
         "attn_inp_kq_mask": n_kv_raw(cfg, params, L) * n_tok * m}
    if role.first:  # token_embd lives on the client's CPU: its rows are an input here
        d["inp_embd"] = cfg.n_embd * 4 * n_tok
    if role.has_hash:
        d["inp_tokens"] = 4 * n_tok
    if role.last:
        d["out_ids"] = 4 * n_out
    if role.has_csa:
        d["dsv4_csa_kq_mask"] = n_kv_comp(DSV4_CSA, L) * n_tok * m
        d.update(state_index_inputs("csa", DSV4_CSA, n_tok, n_rs_seq))
        d["dsv4_lid_kq_mask"] = n_kv_comp(DSV4_CSA, L) * n_tok * m_lid
        d.update(state_index_inputs("lid", DSV4_CSA, n_tok, n_rs_seq))
    if role.has_hca:
        d["dsv4_hca_kq_mask"] = n_kv_comp(DSV4_HCA, L) * n_tok * m
        d.update(state_index_inputs("hca", DSV4_HCA, n_tok, n_rs_seq))
    return d


def constants(cfg: V4Config, role: ShardRole, params: ProjectionParams) -> dict[str, int]:
    """Constant tensors re-sent to one shard on every step: the rotation matrices of the
    caches it holds layers of (``attn_inp_k_rot``)."""
    rot = rotation_constants(cfg, params.type_k)
    out = {}
    if "raw" in rot:
        out["attn_inp_k_rot(raw)"] = rot["raw"]
    if role.has_csa:
        out["attn_inp_k_rot(lid)"] = rot["lid"]
        if "csa" in rot:
            out["attn_inp_k_rot(csa)"] = rot["csa"]
    if role.has_hca and "hca" in rot:
        out["attn_inp_k_rot(hca)"] = rot["hca"]
    return out


MTP_INPUT_TENSORS = 7  # tokens, positions, K and V slot indices, SWA mask, embd rows, out_ids


def _mtp_inputs(cfg: V4Config, params: ProjectionParams, n_tok: int) -> int:
    """One MTP-context decode of n_tok rows on the tail: token ids, positions, K and V slot
    indices (its cache is an ordinary iswa cache with V allocated), its SWA mask, and the
    trunk rows in batch.embd (F32)."""
    m = 2 if params.flash_attn else 4
    return n_tok * (4 + 4 + 8 + 8 + HC * cfg.n_embd * 4) \
        + n_kv_raw(cfg, params, params.context) * n_tok * m


# -- one step's traffic --------------------------------------------------------------------
CLASSES = ("seam", "graph_inputs", "constants", "output", "mtp_rows", "draft", "graph",
           "control", "other")


@dataclass
class StepTraffic:
    """Bytes (by class) and waits on each shard connection for one step."""

    kind: str
    n_tok: int
    bytes: list[dict[str, int]]  # per shard: class -> bytes (both directions)
    waits: list[float]  # per shard
    detail: list[dict[str, int]] = field(default_factory=list)  # per shard: tensor -> bytes
    sets: list[int] = field(default_factory=list)  # per shard: SET_TENSOR messages (no wait)

    def total(self, shards: Iterable[int] | None = None) -> dict[str, int]:
        idx = range(len(self.bytes)) if shards is None else shards
        return {c: sum(self.bytes[i].get(c, 0) for i in idx) for c in CLASSES}


def step_traffic(cfg: V4Config, plan: ShardPlan, kind: str, *, k: int = 0,
                 scenario: Scenario | None = None, structure: MessageStructure = MEASURED,
                 params: ProjectionParams | None = None,
                 tokens_fed: float | None = None) -> StepTraffic:
    """Traffic of one step kind (`step_kind`). decode (or "plain"): one MTP-off decode;
    verify: k+1 tokens; draft: one MTP draft decode (nothing crosses with a client
    drafter); feed: the verify step's accepted rows (``tokens_fed``, default k+1) into the
    tail's MTP context."""
    scenario = scenario or Scenario()
    params = params or ProjectionParams()
    kind = step_kind(kind)
    if kind != StepKind.DECODE and (isinstance(k, bool) or not isinstance(k, int) or k < 1):
        raise InputError(f"a {kind} step needs a draft length k >= 1, got {k!r}")
    roles = shard_roles(cfg, plan)
    n = plan.n_shards
    H = HC * cfg.n_embd
    isz = itemsize(scenario.boundary_dtype)
    per_shard = [dict.fromkeys(CLASSES, 0) for _ in roles]
    detail: list[dict[str, int]] = [{} for _ in roles]
    sets = [0] * n
    tail = n - 1
    if kind in (StepKind.DRAFT, StepKind.FEED):
        if scenario.placement == Placement.CLIENT:
            return StepTraffic(kind, 0, per_shard, [0.0] * n, detail, sets)
        sets[tail] = MTP_INPUT_TENSORS
        if kind == StepKind.DRAFT:
            b = _mtp_inputs(cfg, params, 1) + cfg.n_vocab * 4 + H * 4  # logits + own row
            per_shard[tail]["draft"] = b
            detail[tail] = {"mtp_inputs": _mtp_inputs(cfg, params, 1),
                            "mtp_logits": cfg.n_vocab * 4, "mtp_h_nextn": H * 4}
            return StepTraffic(kind, 1, per_shard, structure.draft_on_tail.on_shards(n), detail,
                               sets)
        fed = float(k + 1 if tokens_fed is None else tokens_fed)
        per_shard[tail]["mtp_rows"] = round(_mtp_inputs(cfg, params, 1) * fed)
        detail[tail] = {"mtp_inputs(fed rows)": per_shard[tail]["mtp_rows"]}
        return StepTraffic(kind, 0, per_shard, structure.feed_on_tail.on_shards(n), detail, sets)
    n_tok = 1 if kind == StepKind.DECODE else k + 1
    n_out = n_tok
    n_rs = 0 if kind == StepKind.DECODE else k
    for r in roles:
        gi = graph_inputs(cfg, r, params, n_tok=n_tok, n_out=n_out, n_rs_seq=n_rs)
        co = constants(cfg, r, params) if structure.constants_per_step else {}
        detail[r.index].update(gi)
        detail[r.index].update(co)
        per_shard[r.index]["graph_inputs"] = sum(gi.values())
        per_shard[r.index]["constants"] = sum(co.values())
        per_shard[r.index]["other"] = structure.other_bytes_per_shard_pass
        held = r.layers[1] - r.layers[0] + 1
        per_shard[r.index]["graph"] = round(structure.graph_bytes(kind, held))
        per_shard[r.index]["control"] = round(structure.control_bytes(kind, held))
        sets[r.index] = len(gi) + len(co) + (0 if r.first else structure.seam_tensors)
        seam = structure.seam_tensors * H * isz * n_tok
        if not r.last:  # GET the boundary values of this shard's seam
            per_shard[r.index]["seam"] += seam
        if not r.first:  # SET them into the next shard
            per_shard[r.index]["seam"] += seam
    if scenario.head == "client":
        out = H * isz * n_out
        detail[tail]["hidden_rows(out)"] = out
    else:
        out = cfg.n_vocab * 4 * n_out
        detail[tail]["logits"] = out
    per_shard[tail]["output"] = out
    if kind == StepKind.VERIFY and scenario.head == Placement.TAIL:
        per_shard[tail]["mtp_rows"] = H * 4 * n_out  # the trunk's h_nextn rows (F32) to the client
        detail[tail]["h_nextn"] = H * 4 * n_out
    waits = (structure.plain if kind == StepKind.DECODE else structure.verify(scenario.head))
    return StepTraffic(kind, n_tok, per_shard, waits.on_shards(n), detail, sets)


def _remote(plan: ShardPlan, scenario: Scenario) -> list[int]:
    last = plan.n_shards - 1
    return [i for i in range(plan.n_shards) if not (scenario.tail_local and i == last)]


# -- compute ------------------------------------------------------------------------------
def active_bytes(inv: Inventory) -> dict[str, int]:
    """Weight bytes one token reads (memory-bound view): routed experts count
    n_expert_used / n_expert of their bytes, an embedding one row, everything else whole.
    trunk: the main graph (blocks 0..n_layer-1, hc head, norm, output head); mtp: one draft
    (the sidecar's block n_layer, its hc head, norm and output head); head: the trunk's hc
    head + norm + output head (what a client-side head reads per step)."""
    cfg = inv.config
    frac = cfg.n_expert_used / cfg.n_expert
    out = {"trunk": 0, "mtp": 0, "head": 0}
    for t in inv.tensors:
        if "main" not in t.read_by and "mtp" not in t.read_by:
            continue
        b = t.bytes
        if "_exps" in t.name:
            b = round(b * frac)
        elif t.name == "token_embd.weight":
            b = t.bytes // cfg.n_vocab
        if t.file == "trunk" and "main" in t.read_by:
            out["trunk"] += b
            if t.block is None and t.name != "token_embd.weight":
                out["head"] += b
        if "mtp" in t.read_by and (t.file == "mtp" or inv.layout != "pair"):
            out["mtp"] += b
    return out


@dataclass(frozen=True)
class ComputeModel:
    """Seconds of compute per step kind (derived in `compute_model`)."""

    decode_s: float
    verify_token_cost: float
    draft_tail_s: float
    draft_client_s: float
    head_client_s: float
    draft_cost: float

    def step_s(self, kind: str, k: int, scenario: Scenario) -> float:
        kind = step_kind(kind)
        head = self.head_client_s if scenario.head == Placement.CLIENT else 0.0
        if kind == StepKind.DECODE:
            return self.decode_s + head
        if kind == StepKind.VERIFY:
            return self.decode_s * (1 + self.verify_token_cost * k) + head
        if kind == StepKind.DRAFT:
            return (self.draft_client_s if scenario.placement == Placement.CLIENT
                    else self.draft_tail_s)
        return 0.0  # feed: folded into the drafts (upstream feeds, then drafts from its rows)


def compute_model(inv: Inventory, params: ProjectionParams | None = None) -> ComputeModel:
    """Compute per step: a plain decode is n_layer x layer_s on the shards (the pipeline is
    serial for one sequence, so the shard count does not change it); a tail draft is
    draft_cost decodes; a client draft or client head reads its weights at client_bw."""
    params = params or ProjectionParams()
    ab = active_bytes(inv)
    decode = inv.config.n_layer * params.layer_s
    draft_cost = params.draft_cost if params.draft_cost is not None \
        else ab["mtp"] / ab["trunk"]
    if params.verify_token_cost is not None:
        beta = params.verify_token_cost
    else:  # whole model, RTT 0, k=2, vLLM acceptance -> the PR's 1.5x
        t2 = 1 + sum(VLLM_ACCEPTANCE)
        beta = max(0.0, (t2 / ANCHOR_SPEEDUP_K2 - 1 - 2 * draft_cost) / 2)
    return ComputeModel(decode_s=decode, verify_token_cost=beta,
                        draft_tail_s=draft_cost * decode,
                        draft_client_s=ab["mtp"] / params.client_bw,
                        head_client_s=ab["head"] / params.client_bw, draft_cost=draft_cost)


# -- the projection ------------------------------------------------------------------------
def cycle(inv: Inventory, plan: ShardPlan, k: int, scenario: Scenario,
          structure: MessageStructure, params: ProjectionParams, cm: ComputeModel
          ) -> dict:
    """One generation cycle at RTT 0: MTP off, a plain decode (1 token); MTP on, one verify
    step + k drafts + one feed (1 + sum(acceptance[:k]) tokens). Returns compute seconds,
    waits and bytes by class on remote links, all per cycle."""
    cfg = inv.config
    if k == 0:
        steps = [(step_traffic(cfg, plan, StepKind.DECODE, scenario=scenario,
                               structure=structure, params=params), 1,
                  cm.step_s(StepKind.DECODE, 0, scenario))]
        tokens = 1.0
    else:
        tokens = params.tokens_per_verify(k)
        kw = {"k": k, "scenario": scenario, "structure": structure, "params": params}
        steps = [(step_traffic(cfg, plan, StepKind.VERIFY, **kw), 1,
                  cm.step_s(StepKind.VERIFY, k, scenario)),
                 (step_traffic(cfg, plan, StepKind.DRAFT, **kw), k,
                  cm.step_s(StepKind.DRAFT, k, scenario)),
                 (step_traffic(cfg, plan, "feed", tokens_fed=tokens, **kw), 1, 0.0)]
    remote = _remote(plan, scenario)
    waits, compute = 0.0, 0.0
    by_class = dict.fromkeys(CLASSES, 0)
    for st, times, comp in steps:
        compute += comp * times
        waits += sum(st.waits[i] for i in remote) * times
        for c, v in st.total(remote).items():
            by_class[c] += v * times
    return {"tokens": tokens, "compute_s": compute, "waits": waits, "bytes": by_class}


def project(inv: Inventory, *, n_shards: Iterable[int] = range(2, 9),
            plan_kinds: Sequence[str] = ("even", "balanced"),
            plans: Sequence[str | ShardPlan] | None = None,
            ks: Sequence[int] = (0, 1, 2, 3),
            rtts_ms: Sequence[float] = tuple(range(0, 201, 10)),
            scenarios: Sequence[Scenario] = DEFAULT_SCENARIOS,
            structure: MessageStructure = MEASURED,
            params: ProjectionParams | None = None) -> list[dict]:
    """Projected decode speed of V4-Flash (or any inventory) over a WAN, one row per (plan,
    scenario, k, RTT): tokens/s, the speed-up over MTP off of the same plan, scenario and
    RTT, the RTT-bound ideal (tokens per verify step), and per generated token: waits,
    bytes on remote links by class, compute. ``plans`` (strings or ShardPlans) replaces
    the even/balanced plans of ``n_shards``. DataFrame-ready."""
    params = params or ProjectionParams()
    if not ks or any(isinstance(k, bool) or not isinstance(k, int) or k < 0 for k in ks):
        raise InputError(f"ks must be draft lengths >= 0 (0 = MTP off), got {list(ks)}")
    for k in ks:
        params.tokens_per_verify(k)
    if not rtts_ms or any(isinstance(r, bool) or not isinstance(r, int | float) or r < 0
                          or r != r for r in rtts_ms):
        raise InputError(f"rtts_ms must be numbers >= 0, got {list(rtts_ms)}")
    if not scenarios or not all(isinstance(s, Scenario) for s in scenarios):
        raise InputError("scenarios must be a non-empty list of Scenario")
    if not isinstance(structure, MessageStructure):
        raise InputError("structure must be a MessageStructure")
    if plans is not None:
        chosen = [("given", parse_plan(p, inv.config.n_layer) if isinstance(p, str) else p)
                  for p in plans]
    else:
        chosen = plans_for(inv, n_shards, plan_kinds)
    cm = compute_model(inv, params)
    bw = params.bandwidth_bps / 8
    rows = []
    for kind, plan in chosen:
        for sc in scenarios:
            cycles = {k: cycle(inv, plan, k, sc, structure, params, cm)
                      for k in sorted(set(ks) | {0})}
            for rtt in rtts_ms:
                rtt_s = rtt / 1000

                def t_token(c: dict, rtt_s: float = rtt_s) -> float:
                    return (c["compute_s"] + rtt_s * c["waits"]
                            + sum(c["bytes"].values()) / bw) / c["tokens"]

                off = t_token(cycles[0])
                for k in ks:
                    c = cycles[k]
                    t = t_token(c)
                    rows.append({
                        "plan": str(plan), "plan_kind": kind, "n_shards": plan.n_shards,
                        "scenario": sc.name, "placement": sc.placement, "head": sc.head,
                        "tail_local": sc.tail_local, "boundary_dtype": sc.boundary_dtype,
                        "structure": next((n for n, s in {**STRUCTURES,
                                                          **GRAPH_STRUCTURES}.items()
                                           if s == structure), "custom"),
                        "k": k, "mode": "mtp" if k else "off", "rtt_ms": float(rtt),
                        "context": params.context, "tokens_per_verify": c["tokens"],
                        "waits_per_token": c["waits"] / c["tokens"],
                        "bytes_per_token": sum(c["bytes"].values()) / c["tokens"],
                        **{f"bytes_{cl}_per_token": v / c["tokens"]
                           for cl, v in c["bytes"].items()},
                        "compute_s_per_token": c["compute_s"] / c["tokens"],
                        "t_token_s": t, "tok_s": 1.0 / t, "speedup": off / t,
                        "speedup_over_ideal": off / t / c["tokens"],
                    })
    return rows


def traffic_rows(inv: Inventory, plans: Sequence[str | ShardPlan], *,
                 ks: Sequence[int] = (0, 2), contexts: Sequence[int] = (4096, 32768, 131072),
                 scenario: Scenario | None = None, structure: MessageStructure = MEASURED,
                 params: ProjectionParams | None = None) -> list[dict]:
    """Per plan, step kind and context: waits and bytes by class summed over all shard
    connections (k=0: a plain decode; k>0: one verify step of k+1 tokens), bytes per seam
    (f32 and bf16 boundary rows) and the contract's minimum per seam and token."""
    scenario = scenario or Scenario(placement="tail", head="tail")
    params = params or ProjectionParams()
    cfg = inv.config
    dims = ModelDims(n_embd=cfg.n_embd, n_vocab=cfg.n_vocab)
    rows = []
    for p in plans:
        plan = parse_plan(p, cfg.n_layer) if isinstance(p, str) else p
        for L in contexts:
            prm = replace(params, context=L, n_ctx=max(params.n_ctx, L))
            for k in ks:
                kind = StepKind.VERIFY if k else StepKind.DECODE
                st = step_traffic(cfg, plan, kind, k=k, scenario=scenario,
                                  structure=structure, params=prm)
                tot = st.total()
                row = {"plan": str(plan), "n_shards": plan.n_shards, "context": L,
                       "step": f"verify k={k}" if k else "plain decode", "tokens": st.n_tok,
                       "waits": sum(st.waits), "waits_per_shard": st.waits,
                       **{f"bytes_{c}": v for c, v in tot.items()},
                       "bytes_total": sum(tot.values())}
                for dt in ("bf16", "f32"):
                    row[f"seam_bytes_per_seam_{dt}"] = (
                        structure.seam_tensors * HC * cfg.n_embd * itemsize(dt) * st.n_tok * 2)
                row["contract_min_per_seam_bf16"] = seam_bytes_per_token(
                    dims, DType.BF16)["decode_token" if not k else f"verify_k{k}"]
                row["k_rot_bytes_per_step"] = sum(
                    v for d in st.detail for n_, v in d.items() if n_.startswith("attn_inp_k_rot"))
                row["mask_bytes_per_step"] = sum(
                    v for d in st.detail for n_, v in d.items() if n_.endswith("kq_mask"))
                rows.append(row)
    return rows


# -- which plans fit one H200 --------------------------------------------------------------
def fit_rows(inv: Inventory, plans: Sequence[str | ShardPlan], *,
             contexts: Sequence[int] = (32768, 131072), swa_full: bool = True,
             n_rs_seq: int = 3, capacity: int = H200_BYTES, reserve: int = 8 * 2**30
             ) -> list[dict]:
    """Per plan and context: each shard's weights (its files' tensors: the tail holds the
    trunk's head and the whole MTP sidecar) + caches (`ownership.derive` at that context,
    n_rs_seq compressor planes for MTP rollback) + ``reserve`` (compute buffers, CUDA
    context), against ``capacity``. The first shard's count includes token_embd (1.06 GB),
    which upstream keeps in host memory: an over-count there, on the safe side."""
    if capacity <= 0 or reserve < 0:
        raise InputError("capacity must be > 0 and reserve >= 0")
    rows = []
    for p in plans:
        plan = parse_plan(p, inv.config.n_layer) if isinstance(p, str) else p
        for L in contexts:
            own = derive(inv, plan, CacheParams(n_ctx=L, swa_full=swa_full, n_rs_seq=n_rs_seq))
            need = [s.bytes + s.caches["total"] + reserve for s in own.shards]
            worst = max(range(len(need)), key=need.__getitem__)
            rows.append({
                "plan": str(plan), "n_shards": plan.n_shards, "n_ctx": L,
                "swa_full": swa_full, "largest_shard": worst,
                "weights_bytes": own.shards[worst].bytes,
                "cache_bytes": own.shards[worst].caches["total"], "reserve_bytes": reserve,
                "need_bytes": need[worst], "capacity_bytes": capacity,
                "headroom_bytes": capacity - need[worst], "fits": need[worst] <= capacity,
                "need_per_shard": need})
    return rows


# -- plot ---------------------------------------------------------------------------------
def plot_projection(rows: Sequence[dict], ax=None, *, plan: str | None = None,
                    scenario: str | None = None, metric: str = "tok_s"):
    """Tokens/s (or ``metric="speedup"``) against RTT for one plan and scenario (default:
    the first row's), one line per draft length; the legend sits outside the axes."""
    import matplotlib.pyplot as plt

    from mtplib.lab.display import data_colour

    if not rows:
        raise InputError("no rows to plot")
    if metric not in ("tok_s", "speedup"):
        raise InputError(f"metric must be 'tok_s' or 'speedup', got {metric!r}")
    plan = plan or rows[0]["plan"]
    scenario = scenario or rows[0]["scenario"]
    sel = [r for r in rows if r["plan"] == plan and r["scenario"] == scenario]
    if not sel:
        raise InputError(f"no rows for plan {plan!r} and scenario {scenario!r}")
    if ax is None:
        _, ax = plt.subplots(figsize=(7, 4))
    for i, k in enumerate(sorted({r["k"] for r in sel})):
        pts = sorted((r["rtt_ms"], r[metric]) for r in sel if r["k"] == k)
        label = "MTP off" if k == 0 else f"MTP k={k}"
        ax.plot([x for x, _ in pts], [y for _, y in pts], marker="o", markersize=3,
                color=data_colour(i), label=label)
        if metric == "speedup" and k:
            ideal = next(r["tokens_per_verify"] for r in sel if r["k"] == k)
            ax.axhline(ideal, color=data_colour(i), linestyle=":", linewidth=1,
                       label=f"k={k} ideal ({ideal:.2f} tokens/verify)")
    ax.set_xlabel("round-trip time to each remote shard (ms)")
    ax.set_ylabel("decode speed (tokens/s)" if metric == "tok_s"
                  else "speed-up over MTP off (x)")
    n = sel[0]["n_shards"]
    ax.set_title(f"V4-Flash projection: plan {plan} ({n} shards)\n{scenario}", fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.legend(loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0, fontsize=8)
    return ax
