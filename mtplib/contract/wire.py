"""What the bytes on a shard connection are, and the rule that caches never cross.

The seam validator (`mtplib.contract.seam`) polices typed boundary messages. A ranged run on
upstream's RPC backend moves tensors, not messages, so this module classifies the tensor
traffic a counting relay saw on each shard connection (by direction and upstream's tensor
names) and checks it against the same rule: KV and V4 auxiliary caches (raw SWA K,
compressed CSA/HCA K, indexer K, compressor state) are shard-local and never cross.

Classes (every data byte gets exactly one):

- ``seam``: boundary values: an activation read out of one shard (GET) and the same tensor
  written into the next (SET), and the MTP block's hidden-row input (``mtp_h_state``);
- ``outputs``: what the sampler needs from the tail: logits (``result_output``) or the
  pre-head hidden rows (``h_nextn``);
- ``inputs``: per-step graph inputs the client builds: token ids, the token embedding,
  positions, masks, cache index vectors, output ids;
- ``constants``: inputs that are the same every step but re-sent as graph inputs
  (``attn_inp_k_rot``: the indexer's Hadamard rotation, llama-kv-cache.cpp; with
  patches/0003 it is uploaded once per context as ``attn_k_rot`` into each shard's cache
  buffer and no longer sent per step);
- ``cache``: KV and auxiliary cache tensors (``cache_*_l<N>``, ``dsv4_*_state_{kv,score}_l<N>``);
  forbidden on the wire while decoding;
- ``weights``: model tensors uploaded at load time.

On a peer link (patches/0007's ring: one shard pushes a boundary value into the next,
direction ``"peer"``) every data byte is ``seam``, except a cache tensor, which is ``cache``
there too: the rule holds on every link.

What crosses a seam of upstream's V4 graph (src/models/deepseek4.cpp at the pin), per token:

- ``l_last-<il>``: the last layer's output on the upstream shard, the hc*n_embd residual
  stream, the contract's ``boundary_hidden`` (`SEAM_TENSORS`);
- on the stock build also an unnamed ``node_<n>``, the same hc*n_embd values reshaped and
  RMS-normalised without a weight (``build_hc_pre``: ``rms_norm(reshape(x))``, the input of
  the next layer's ``hc_attn_fn`` mix): a function of ``l_last`` that the scheduler runs on
  the upstream shard because it reads no weight. It is redundant (the contract's
  ``boundary_norm``, forbidden; `seam_value` counts it as `OTHER`); patches/0004 keeps it
  on the layer's own shard, so one value per seam crosses, the contract's minimum.

Upstream's names at the pin: llama-kv-cache.cpp ``cache_%sk_l%d`` / ``cache_%sv_l%d``,
llama-kv-cache-dsv4.cpp ``dsv4_%s_state_kv_l%d`` / ``dsv4_%s_state_score_l%d``; the
scheduler names a copy of tensor T for backend B ``B#T#n`` (ggml-backend.c).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping

WIRE_CLASSES: tuple[str, ...] = ("seam", "outputs", "inputs", "constants", "cache", "weights")
SHARD_LOCAL_CLASSES = frozenset({"cache"})
"""Classes that must never appear on a shard connection after load."""

OUTPUT_TENSORS = frozenset({"result_output", "h_nextn", "result_norm"})
CONSTANT_INPUTS = frozenset({"attn_inp_k_rot", "attn_inp_v_rot", "attn_k_rot"})
MTP_SEAM_INPUTS = ("mtp_h_state",)
"""The MTP graph's hidden-row input (graph_mtp): the trunk's h rows, a boundary value."""

SEAM_TENSORS = {"l_last": "boundary_hidden", "mtp_h_state": "mtp_hidden"}
"""Upstream's boundary tensors (name without the ``-<layer>``) -> the contract's seam value."""
OTHER = "other"
"""Seam-class bytes of any other tensor: no contract value (stock: the weightless norm of
``l_last``, the contract's forbidden ``boundary_norm``; with ``n_rs_seq > 0`` also
compressor-state rows, evidence/upstream-bugs bug 4)."""

_CACHE = re.compile(r"^(cache_\w*?[kvrs]_l\d+|dsv4_[a-z]+_state_(kv|score)_l\d+)$")
_WEIGHT = re.compile(r"(^blk\.\d+\.|^token_embd|^output|\.weight$|\.bias$)")
_SUFFIX = re.compile(r"( \((view|reshaped|permuted|transposed|cont|copy)\))+$")


def base_name(name: str) -> str:
    """Upstream's own name of a tensor seen on the wire: without the scheduler's
    ``BACKEND#...#n`` copy wrapper, the ``-<layer>`` of a per-layer input, and view/reshape
    suffixes."""
    if name.count("#") >= 2:
        name = name.split("#", 1)[1].rsplit("#", 1)[0]
    return _SUFFIX.sub("", name)


def is_cache_tensor(name: str) -> bool:
    """True for a KV or V4 auxiliary cache tensor (any view or scheduler copy of one)."""
    return bool(_CACHE.match(base_name(name)))


def classify(direction: str, name: str, fetched: set[str]) -> str:
    """The class of one tensor's data bytes. ``direction``: "up" (client -> shard, set),
    "down" (shard -> client, get) or "peer" (shard -> shard, a push); ``fetched``: base
    names read out of any shard in the same step (what is written back elsewhere is then a
    boundary value)."""
    b = base_name(name)
    if _CACHE.match(b):
        return "cache"
    if direction == "peer":
        return "seam"
    if b in CONSTANT_INPUTS:
        return "constants"
    if direction == "down":
        return "outputs" if b in OUTPUT_TENSORS else "seam"
    if b in fetched or b.startswith(MTP_SEAM_INPUTS):
        return "seam"
    if _WEIGHT.search(b):
        return "weights"
    return "inputs"


def classify_step(per_relay: Iterable[Mapping[tuple[str, str], int]]) -> dict[str, int]:
    """Data bytes of one step kind on all shard connections, by class."""
    out = dict.fromkeys(WIRE_CLASSES, 0)
    for link in classify_by_direction(per_relay):
        for cls, ways in link.items():
            out[cls] += sum(ways.values())
    return out


def classify_by_direction(per_relay: Iterable[Mapping[tuple[str, str], int]]
                          ) -> list[dict[str, dict[str, int]]]:
    """Per connection: class -> direction -> data bytes of one step kind (what crossed
    which way on each link; `classify_step` adds them up over the links and directions)."""
    per_relay = list(per_relay)
    fetched = {base_name(n) for d in per_relay for (dr, n) in d if dr == "down"}
    out: list[dict[str, dict[str, int]]] = []
    for d in per_relay:
        link: dict[str, dict[str, int]] = {}
        for (direction, name), n in d.items():
            way = link.setdefault(classify(direction, name, fetched), {})
            way[direction] = way.get(direction, 0) + n
        out.append({c: dict(sorted(w.items())) for c, w in sorted(link.items())})
    return out


def seam_value(name: str) -> str:
    """The contract's seam value (`mtplib.contract.seam.SEAM_VALUES`) a seam-class tensor
    carries, or `OTHER`."""
    return SEAM_TENSORS.get(re.sub(r"-\d+$", "", base_name(name)), OTHER)


def seam_by_value(per_relay: Iterable[Mapping[tuple[str, str], int]]) -> dict[str, int]:
    """Seam-class data bytes of one step kind on all connections, by contract value."""
    per_relay = list(per_relay)
    fetched = {base_name(n) for d in per_relay for (dr, n) in d if dr == "down"}
    out = dict.fromkeys((*sorted(set(SEAM_TENSORS.values())), OTHER), 0)
    for d in per_relay:
        for (direction, name), n in d.items():
            if classify(direction, name, fetched) == "seam":
                out[seam_value(name)] += n
    return out


def cache_tensors_on_wire(per_relay: Iterable[Mapping[tuple[str, str], int]]) -> dict[str, int]:
    """Cache tensor name -> bytes that crossed (all connections, both directions)."""
    out: dict[str, int] = {}
    for d in per_relay:
        for (_, name), n in d.items():
            if is_cache_tensor(name):
                b = base_name(name)
                out[b] = out.get(b, 0) + n
    return out


def wire_violations(by_step: Mapping[str, Mapping[str, int]],
                    exempt: Iterable[str] = ("load",)) -> list[str]:
    """One message per step kind in which shard-local classes crossed (empty: clean).
    ``by_step``: step label -> class -> bytes; ``exempt``: labels not checked (loading
    uploads weights only, but is exempt from nothing else)."""
    skip = set(exempt)
    out = []
    for label, classes in sorted(by_step.items()):
        if label in skip:
            continue
        for cls in sorted(SHARD_LOCAL_CLASSES):
            if classes.get(cls, 0):
                out.append(f"{label}: {classes[cls]} bytes of {cls} tensors crossed a shard "
                           "connection (KV and V4 auxiliary caches are shard-local)")
    return out
