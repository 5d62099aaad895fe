"""The message structure of a ranged step (`mtplib.lab.projection`): the waits per step kind
(`StepWaits`), the seam's shape and the graph and control bytes (`MessageStructure`), and
the named structures (measured, today, contract, seam_once, whole_graph, graph_slots).

Why apart: it is the projection's only measured input, plugged in from a WAN run's counts
(`MessageStructure.from_run`); the rest of the model takes it as given.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, replace

from mtplib.contract.labels import StepKind
from mtplib.errors import InputError
from mtplib.lab.projection.constants import (
    CONTROL_BYTES_PER_LAYER_VERIFY,
    CONTROL_BYTES_PER_PASS_VERIFY,
    CONTROL_PLAIN_OVER_VERIFY,
    GRAPH_BYTES_PER_LAYER_WHOLE,
    GRAPH_BYTES_SLOT_PER_PASS,
    PLACEMENTS,
    PLAIN,
    STEP_KINDS,
    step_kind,
)


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
