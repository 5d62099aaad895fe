"""A DSpark draft beside a ranged trunk (issue 40 point 3): where it loads, and what its
features cost on the wire.

Why its own module: an MTP sidecar is a `deepseek4` `Model`; a DSpark draft is `dflash`
and borrows the target's token embeddings and output head (``ctx_other``). On a ranged
trunk the embeddings are on this process's CPU (upstream keeps the input layer there) and
the output head is on the tail shard, so where the draft's context can run its head
decides the bytes:

- the draft on this CPU with no shard backend: upstream's scheduler finds no backend for
  the tail's ``output`` buffer and aborts the process at the first block pass
  ("pre-allocated tensor (output.weight) in a buffer (RPC0[...]) that cannot run the
  operation", ggml-backend.cpp:947; seen in the ranged worker);
- the draft's weights on this CPU, loaded with the tail's device and 0 layers offloaded
  (what `load_dspark` does for placement "client"): its context gets the tail's backend,
  so the head's matmul runs on the tail next to its weight; per block pass the block's
  rows go up and its logits come back.

Placement "tail" (the draft's context on the tail shard, features kept there) needs an
upstream change and is refused (`TAIL_NOT_BUILT`; design: docs/shards-and-tls.md).
"""

from __future__ import annotations

from pathlib import Path

from mtplib.contract.labels import Placement
from mtplib.runtime.model import RuntimeInputError

TAIL_NOT_BUILT = ("DSpark on the tail shard is not built yet (the features would leave "
                  "the tail twice: docs/shards-and-tls.md); use mtp_placement client or auto")
#: upstream's name of a layer-input feature (src/models/deepseek4.cpp: cb "layer_inp", il)
FEATURE_TENSOR = "layer_inp"


def load_dspark(trunk, path: str | Path, placement: str, *, header=None, trunk_header=None):
    """The DSpark draft of a ranged ``trunk`` (`mtplib.runtime.rpc.open_ranged`'s Model),
    its weights on this process's CPU (placement "client"), its context able to reach the
    tail's backend for the target's output head. Carries ``.endpoints`` ([]: in the
    client) and ``.placement`` ({}) as an MTP sidecar does; `mtplib.runtime.rpc` checks
    upstream's load log (no weight buffer on a shard)."""
    from mtplib.runtime.dspark.context import DSparkModel

    if placement == Placement.TAIL:
        raise RuntimeInputError(TAIL_NOT_BUILT)
    side = DSparkModel(path, header=header,
                       trunk_header=trunk_header or getattr(trunk, "header", None),
                       devices=[trunk.devices[-1]], n_gpu_layers=0)
    side.endpoints, side.placement, side.load_buffers = [], {}, []
    side.device_endpoints = trunk.device_endpoints
    return side


def feature_bytes(per_relay, layer_ids=None) -> dict[str, int]:
    """Data bytes of the target's layer-input features on the shard connections of one
    step kind, by direction ("down": read to the client, "up": written to a shard),
    from a relay set's ``by_tensor_dir`` (`mtplib.distributed.relay.RelaySet`)."""
    from mtplib.contract.wire import base_name

    out = {"down": 0, "up": 0}
    for d in per_relay:
        for (direction, name), n in d.items():
            b = base_name(name)
            if b.startswith(FEATURE_TENSOR + "-") and direction in out:
                if layer_ids is None or int(b.rsplit("-", 1)[1]) in layer_ids:
                    out[direction] += n
    return out


def feature_row_bytes(n_layers: int, n_embd: int, dtype_bytes: int = 4) -> int:
    """Bytes of one committed token's features: one hc-mean row of n_embd per target layer
    (F32 at the pin; BF16 would halve it)."""
    return int(n_layers) * int(n_embd) * int(dtype_bytes)


def choose_dspark_placement(*, k: int, n_layers: int, n_embd: int, n_vocab: int,
                            rtt_s: float, bandwidth_bps: float | None,
                            requested: str = "auto", tail_built: bool = False):
    """Where a ranged run's DSpark drafter runs, with the inputs the choice read (a
    `mtplib.runtime.placement.Choice`). Per verify cycle of k drafts the client pays
    (k+1) feature rows read at the pin (only committed ones are the contract's minimum)
    and one block pass whose head matmul runs on the tail (k rows up, k logits rows
    down, one wait); the tail would pay 0 feature bytes and one wait for k ids. Until
    the tail placement is built the choice is the client, and says so."""
    from mtplib.runtime.placement import Choice

    row = feature_row_bytes(n_layers, n_embd)
    client_bytes = (k + 1) * row + k * (n_embd + n_vocab) * 4
    tail_bytes = 2 * k * 4 + 4  # anchor + accept count in, k ids (+ confidences) out

    def secs(n: int) -> float:
        return rtt_s + (n * 8 / bandwidth_bps if bandwidth_bps else 0.0)

    costs = {Placement.CLIENT.value: secs(client_bytes),
             Placement.TAIL.value: secs(tail_bytes) if tail_built else None}
    if not tail_built:
        why = ("the tail placement is not built (the pin reads the features to the client "
               "and would write them back to the tail: docs/shards-and-tls.md)")
    elif costs[Placement.TAIL.value] < costs[Placement.CLIENT.value]:
        return Choice("dspark_placement", Placement.TAIL, costs, "the tail moves fewer bytes")
    else:
        why = "the client is no slower"
    return Choice("dspark_placement", Placement.CLIENT, costs,
                  f"client ({requested} asked): {why}; per cycle of k={k}: {client_bytes} B "
                  f"on the tail link in the client ({row} B of features per row, read for "
                  f"k+1 rows), {tail_bytes} B on the tail")
