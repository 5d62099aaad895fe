"""What may cross a seam between shards, and the validator that refuses everything else.

Why: every shard keeps its own caches; only boundary values travel. Shipping cache state
across a seam would couple shards to each other's layout and break rollback isolation, so the
validator fails closed on forbidden or unknown kinds and on cache-like extra fields.
"""

from __future__ import annotations

import dataclasses
import enum
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from mtplib.contract.session import Session
from mtplib.contract.types import (
    FLOAT_DTYPES,
    MAX_DRAFT,
    CacheKind,
    ContractError,
    DType,
    ModelDims,
    check_identity,
    check_int,
    check_positions,
    fail,
)

INT_BYTES = DType.I32.itemsize
VERIFY_RESULT_WIDTH = 4
"""verify_result record: base_position, n_drafted, n_accepted, correction_token (int32)."""


class SeamViolation(ContractError):
    """A boundary message that must not cross a seam."""


@dataclass(frozen=True)
class SeamValue:
    """One kind of value allowed across a seam; width(dims) values of an allowed dtype each.

    per == "token": one row per position; per == "message": one fixed record per message.
    """

    kind: str
    width: Callable[[ModelDims], int]
    dtypes: frozenset[DType]
    per: str
    note: str

    def bytes_per_row(self, dims: ModelDims, dtype: DType) -> int:
        return self.width(dims) * dtype.itemsize


def _hidden(dims: ModelDims) -> int:
    return dims.hidden_width


def _one(dims: ModelDims) -> int:
    return 1


def _verify(dims: ModelDims) -> int:
    return VERIFY_RESULT_WIDTH


def _features(dims: ModelDims) -> int:
    return dims.feature_width


_I32 = frozenset({DType.I32})
_F32 = frozenset({DType.F32})
#: kinds of which a message carries one row per draft position (at most MAX_DRAFT)
PER_DRAFT_KINDS = frozenset({"draft_tokens", "dspark_confidences"})
SEAM_VALUES: Mapping[str, SeamValue] = MappingProxyType(
    {
        v.kind: v
        for v in (
            SeamValue(
                "boundary_hidden",
                _hidden,
                FLOAT_DTYPES,
                "token",
                "hc*n_embd residual stream handed from one layer range to the next (upstream: "
                "the range's last layer output l_last, mtplib.contract.wire.SEAM_TENSORS); the "
                "only value a plain step needs per seam",
            ),
            SeamValue("token_ids", _one, _I32, "token", "int32 token id per position"),
            SeamValue("positions", _one, _I32, "token", "int32 position per token"),
            SeamValue(
                "mtp_hidden",
                _hidden,
                FLOAT_DTYPES,
                "token",
                "trunk h rows for the MTP block; crosses only if MTP is not on the tail "
                "shard (zero extra bytes when it is)",
            ),
            SeamValue(
                "sampler_hidden",
                _hidden,
                FLOAT_DTYPES,
                "token",
                "the tail's pre-head hc*n_embd rows (h_nextn) for a client that runs the "
                "output head and the sampler (--head client): replaces logits, which never "
                "cross; with the MTP block in the client (--mtp-placement client) the same "
                "rows are its mtp_hidden input, sent once",
            ),
            SeamValue("draft_tokens", _one, _I32, "token", "int32 draft id per draft position"),
            SeamValue(
                "verify_result",
                _verify,
                _I32,
                "message",
                "fixed int32 record: base_position, n_drafted, n_accepted, correction_token",
            ),
            SeamValue(
                "dspark_features",
                _features,
                _F32,
                "token",
                "a DSpark draft's input: per committed token, one n_embd row per target "
                "layer (the hc-mean of the residual entering it), side by side in "
                "target_layers order, f32 as upstream's llama_get_embeddings_layer_inp "
                "gives them; crosses only where the draft is not beside the layers that "
                "produce them (client placement: once per committed token; rows of "
                "rejected positions never)",
            ),
            SeamValue(
                "dspark_confidences",
                _one,
                _F32,
                "token",
                "a DSpark draft's confidence head, one f32 sigmoid per draft position, "
                "from a drafter on the tail shard (with its draft_tokens)",
            ),
        )
    }
)

_CACHE_REASON = "shard-local cache state never crosses a seam"
FORBIDDEN_KINDS: Mapping[str, str] = MappingProxyType(
    {
        **{k.value: _CACHE_REASON for k in CacheKind},
        "logits": "the tail shard samples locally; logits never cross a seam",
        "kv_cache": _CACHE_REASON,
        "compressed_rows": _CACHE_REASON,
        "indexer_keys": _CACHE_REASON,
        "compressor_state": _CACHE_REASON,
        "mtp_k": _CACHE_REASON,
        "indexer_state": _CACHE_REASON,
        "past_key_values": _CACHE_REASON,
        "sequence_state": "a llama_state_seq blob is shard-local cache state",
        "boundary_norm": "a function of boundary_hidden (upstream's weightless RMS norm of the "
                         "next layer's hc mix input): the receiving shard computes it; one "
                         "value per seam",
    }
)
"""Kind -> why it is refused."""

CACHE_MARKERS: tuple[str, ...] = (
    "cache",
    "kv",
    "state",
    "compress",
    "indexer",
    "swa",
    "mtp_k",
    "checkpoint",
    "logit",
    "past_key",
    "key_value",
)
"""Substrings that make a name count as cache state (fail closed on near-misses too)."""

_COMPACT_MARKERS = tuple(sorted(
    {k.replace("_", "") for k in FORBIDDEN_KINDS}
    | {c for c in (m.replace("_", "") for m in CACHE_MARKERS) if len(c) >= 5}
))
"""Sought with the separators removed ('pastKeyValues', 'mtpK'): every forbidden kind, and
the markers long enough not to match across a word boundary ('kv' in 'track_version')."""


def names_cache_state(name: object) -> bool:
    """True if a kind, key or attribute name names cache state, in any case or separator
    spelling ('KV-Cache', 'compressor.state', 'pastKeyValues')."""
    if not isinstance(name, str):
        return False
    norm = re.sub(r"[^a-z0-9]+", "_", name.lower())
    compact = norm.replace("_", "")
    return (
        norm.strip("_") in FORBIDDEN_KINDS
        or any(m in norm for m in CACHE_MARKERS)
        or any(m in compact for m in _COMPACT_MARKERS)
    )


@dataclass(frozen=True)
class BoundaryMessage:
    """One value crossing one seam; extra carries anything else so it can be policed."""

    session_id: str
    epoch: int
    seq_step: int
    kind: str
    positions: tuple[int, ...]
    width: int
    dtype: DType
    nbytes: int
    payload: bytes | None = None
    extra: Mapping[str, object] = field(default_factory=dict, hash=False)


def _violation(exc: ContractError) -> SeamViolation:
    return SeamViolation(str(exc))


MAX_EXTRA_DEPTH = 32
"""Deeper nesting than this in `extra` is refused rather than walked."""

_SCALARS = (str, int, float, bool, type(None))
_ARRAY_HOOKS = ("__array__", "__array_interface__", "__cuda_array_interface__", "__dlpack__")


def _raw_buffer(value: object) -> bool:
    """True for bytes-like data or an array: anything exposing a buffer or array hook."""
    if isinstance(value, bytes | bytearray | memoryview):
        return True
    if any(hasattr(type(value), h) for h in _ARRAY_HOOKS):
        return True
    try:
        memoryview(value)  # type: ignore[arg-type]
    except TypeError:
        return False
    except Exception:  # noqa: BLE001 - e.g. numpy's object arrays: a buffer that will not export
        return True
    return True


def _members(value: object) -> dict[str, object] | None:
    """Named members of a dataclass or plain object (fields, __dict__, __slots__), or None
    when `value` is neither."""
    names: dict[str, object] = {}
    if dataclasses.is_dataclass(value):
        names.update({f.name: getattr(value, f.name) for f in dataclasses.fields(value)})
    for cls in type(value).__mro__:
        slots = cls.__dict__.get("__slots__", ())
        for slot in (slots,) if isinstance(slots, str) else slots:
            if slot not in ("__dict__", "__weakref__") and hasattr(value, slot):
                names[slot] = getattr(value, slot)
    if hasattr(value, "__dict__"):
        names.update(vars(value))
    if names or dataclasses.is_dataclass(value) or hasattr(value, "__dict__"):
        return names
    return None


def check_seam_value(value: object, where: str = "extra") -> None:
    """Raise SeamViolation unless `value` is typed data free of cache state at every depth.

    Walked: mappings (keys must be str and must not name cache state), lists, tuples,
    sets, dataclasses and objects (their field/attribute names count as keys). Refused
    anywhere: a name from the cache vocabulary (`names_cache_state`), an enum member or
    type named like cache state, raw buffers (bytes, bytearray, memoryview, arrays: raw
    data crosses only as a message's payload), callables, self-references, and any value
    that is none of the above.
    """
    _walk(value, where, 0, set())


def _walk(value: object, where: str, depth: int, path: set[int]) -> None:
    if depth > MAX_EXTRA_DEPTH:
        raise SeamViolation(f"{where}: nested deeper than {MAX_EXTRA_DEPTH} levels")
    if isinstance(value, enum.Enum):
        if names_cache_state(value.name) or names_cache_state(value.value) or \
                names_cache_state(type(value).__name__):
            raise SeamViolation(f"{where}: {value!r} names cache state; {_CACHE_REASON}")
        return
    if isinstance(value, _SCALARS):
        return
    if _raw_buffer(value):
        raise SeamViolation(f"{where}: expected no raw bytes, got a {type(value).__name__} "
                            "(raw data crosses only as the message payload)")
    if isinstance(value, type) or callable(value):
        raise SeamViolation(f"{where}: expected a typed value, got {type(value).__name__}")
    if names_cache_state(type(value).__name__):
        raise SeamViolation(f"{where}: a {type(value).__name__} names cache state; "
                            f"{_CACHE_REASON}")
    if id(value) in path:
        raise SeamViolation(f"{where}: refers to itself")
    path = path | {id(value)}
    if isinstance(value, Mapping):
        items = list(value.items())
        for key, _ in items:
            if not isinstance(key, str):
                raise SeamViolation(f"{where}: expected str keys, got {key!r}")
        for key, v in sorted(items, key=lambda kv: kv[0]):
            if names_cache_state(key):
                raise SeamViolation(f"{where}[{key!r}]: names cache state; {_CACHE_REASON}")
            _walk(v, f"{where}[{key!r}]", depth + 1, path)
        return
    if isinstance(value, list | tuple):
        for i, v in enumerate(value):
            _walk(v, f"{where}[{i}]", depth + 1, path)
        return
    if isinstance(value, set | frozenset):
        for v in sorted(value, key=repr):
            _walk(v, f"{where}{{{v!r}}}", depth + 1, path)
        return
    members = _members(value)
    if members is None:
        raise SeamViolation(f"{where}: expected a typed value (str, int, float, bool, None, a "
                            f"mapping, sequence, set, dataclass or object), got "
                            f"{type(value).__name__}")
    for name in sorted(members):
        if names_cache_state(name):
            raise SeamViolation(f"{where}.{name}: names cache state; {_CACHE_REASON}")
        _walk(members[name], f"{where}.{name}", depth + 1, path)


def _check_extra(extra: object) -> None:
    if not isinstance(extra, Mapping):
        raise SeamViolation(f"extra: expected a mapping, got {extra!r}")
    check_seam_value(extra, "extra")


def validate_boundary(
    msg: BoundaryMessage, dims: ModelDims, session: Session | None = None
) -> None:
    """Raise SeamViolation (or a session error) unless msg is a well-formed boundary value."""
    kind = msg.kind
    if isinstance(kind, str) and kind in FORBIDDEN_KINDS:
        raise SeamViolation(f"kind: {kind!r} is forbidden: {FORBIDDEN_KINDS[kind]}")
    if names_cache_state(kind):
        raise SeamViolation(f"kind: {kind!r} is forbidden: {_CACHE_REASON}")
    spec = SEAM_VALUES.get(kind) if isinstance(kind, str) else None
    if spec is None:
        raise SeamViolation(f"kind: expected one of {sorted(SEAM_VALUES)}, got {kind!r}")
    _check_extra(msg.extra)
    try:
        check_identity(msg.session_id, msg.epoch)
        check_int("seq_step", msg.seq_step, minimum=0)
    except ContractError as exc:
        raise _violation(exc) from None
    if not isinstance(msg.dtype, DType) or msg.dtype not in spec.dtypes:
        allowed = "/".join(sorted(d.value for d in spec.dtypes))
        got = msg.dtype.value if isinstance(msg.dtype, DType) else repr(msg.dtype)
        raise SeamViolation(f"dtype: expected {allowed} for {kind}, got {got}")
    want_width = spec.width(dims)
    if isinstance(msg.width, bool) or msg.width != want_width:
        raise SeamViolation(f"width: expected {want_width} for {kind}, got {msg.width!r}")
    try:
        positions = check_positions("positions", msg.positions)
    except ContractError as exc:
        raise _violation(exc) from None
    if spec.per == "message" and len(positions) != 1:
        raise SeamViolation(f"positions: expected 1 position for {kind}, got {len(positions)}")
    if kind in PER_DRAFT_KINDS and len(positions) > MAX_DRAFT:
        raise SeamViolation(
            f"positions: expected <= {MAX_DRAFT} drafts, got {len(positions)}"
        )
    want_bytes = len(positions) * spec.bytes_per_row(dims, msg.dtype)
    if isinstance(msg.nbytes, bool) or msg.nbytes != want_bytes:
        raise SeamViolation(
            f"nbytes: expected len(positions)*width*itemsize={want_bytes}, got {msg.nbytes!r}"
        )
    if msg.payload is not None:
        if not isinstance(msg.payload, bytes):
            raise SeamViolation(f"payload: expected bytes or None, got {type(msg.payload)}")
        if len(msg.payload) != want_bytes:
            raise SeamViolation(f"payload: expected {want_bytes} bytes, got {len(msg.payload)}")
    if session is not None:
        session.check_message(msg.session_id, msg.epoch)


def seam_bytes_per_token(dims: ModelDims, dtype: DType) -> dict[str, int]:
    """Minimum bytes crossing ONE seam per step (multiply by n_shards-1 for a pipeline).

    With H = hc*n_embd*itemsize and I = 4 (int32), MTP on the tail shard:
      prefill_token = decode_token = H + 2I  (hidden row + position + token id; the token id
        rides along because the tail's MTP block embeds x_p next to h_{p-1})
      draft_step = I                          (one draft id back to the head shard)
      verify_k<k> = (k+1)*(H + 2I) + 4I       (batch [last, d1..dk] + one verify_result)
      mtp_hidden_remote = H                   (extra per MTP row only if MTP is off the tail)
    """
    if dtype not in FLOAT_DTYPES:
        raise fail("dtype", "one of f32/f16/bf16", getattr(dtype, "value", dtype))
    h = dims.hidden_width * dtype.itemsize
    token = h + 2 * INT_BYTES
    out = {
        "boundary_hidden": h,
        "prefill_token": token,
        "decode_token": token,
        "draft_step": INT_BYTES,
        "mtp_hidden_remote": h,
    }
    for k in range(1, MAX_DRAFT + 1):
        out[f"verify_k{k}"] = (k + 1) * token + VERIFY_RESULT_WIDTH * INT_BYTES
    return out
