"""Seam rules: only boundary values cross; cache state and malformed messages are refused."""

from __future__ import annotations

from dataclasses import dataclass, replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mtplib.contract import (
    FORBIDDEN_KINDS,
    SEAM_VALUES,
    TINY_DIMS,
    V4_FLASH_DIMS,
    BoundaryMessage,
    CacheKind,
    ContractError,
    DType,
    ForeignSessionError,
    SeamViolation,
    Session,
    StaleEpochError,
    State,
    check_seam_value,
    names_cache_state,
    seam_bytes_per_token,
    validate_boundary,
)

DIMS = TINY_DIMS
W = DIMS.hidden_width
SESSION = Session("s", State.DECODING, epoch=2, position=50)


def _pos(positions):
    """Ranges become tuples; anything else is passed through so bad shapes stay bad."""
    return tuple(positions) if isinstance(positions, range) else positions


def msg(kind="boundary_hidden", positions=(3, 4), dtype=DType.BF16, **kw) -> BoundaryMessage:
    spec = SEAM_VALUES.get(kind)
    width = spec.width(DIMS) if spec else W
    if spec is not None and dtype not in spec.dtypes:
        dtype = DType.F32 if spec.dtypes == {DType.F32} else DType.I32
    base = dict(
        session_id="s",
        epoch=2,
        seq_step=0,
        kind=kind,
        positions=_pos(positions),
        width=width,
        dtype=dtype,
        nbytes=len(positions) * width * dtype.itemsize,
    )
    base.update(kw)
    return BoundaryMessage(**base)


@pytest.mark.parametrize("kind", sorted(SEAM_VALUES))
def test_every_allowed_kind_accepts_a_well_formed_message(kind):
    positions = (7,) if kind == "verify_result" else (3, 4)
    validate_boundary(msg(kind, positions), DIMS, SESSION)


def test_forbidden_kinds_cover_every_cache_kind_and_logits():
    for k in CacheKind:
        assert k.value in FORBIDDEN_KINDS
    for k in (
        "logits",
        "kv_cache",
        "compressed_rows",
        "indexer_keys",
        "compressor_state",
        "mtp_k",
        "sequence_state",
    ):
        assert k in FORBIDDEN_KINDS
    assert "samples locally" in FORBIDDEN_KINDS["logits"]
    assert not set(FORBIDDEN_KINDS) & set(SEAM_VALUES)


@pytest.mark.parametrize("kind", sorted(FORBIDDEN_KINDS))
def test_forbidden_kind_refused(kind):
    with pytest.raises(SeamViolation, match=f"^kind: '{kind}' is forbidden"):
        validate_boundary(msg(kind), DIMS)


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(kind="attention_weights"), "^kind: expected one of"),
        (dict(kind="KV-Cache"), "^kind: 'KV-Cache' is forbidden"),
        (dict(extra={"kv_cache": 1}), r"^extra\['kv_cache'\]: names cache state"),
        (dict(extra={"meta": {"Indexer_K": 1}}), r"^extra\['meta'\]\['Indexer_K'\]"),
        (dict(extra={"blob": b"x"}), r"^extra\['blob'\]: expected no raw bytes"),
        (dict(extra={1: "x"}), "^extra: expected str keys"),
        (dict(session_id=""), "^session_id"),
        (dict(epoch=-1), "^epoch"),
        (dict(seq_step=-1), "^seq_step"),
        (dict(dtype=DType.I32, nbytes=2 * W * 4), "^dtype: expected bf16/f16/f32"),
        (dict(width=DIMS.n_embd), "^width: expected 256 for boundary_hidden, got 64"),
        (dict(positions=(3, 5)), r"^positions\[1\]: expected 4"),
        (dict(positions=(4, 3)), r"^positions\[1\]"),
        (dict(positions=(-1, 0)), r"^positions\[0\]: expected int >= 0"),
        (dict(positions=(), nbytes=0), "^positions: expected non-empty"),
        (dict(positions=[3, 4]), "^positions: expected non-empty tuple"),
        (dict(nbytes=W * 2), "^nbytes: expected len"),
        (dict(payload=bytes(7)), "^payload: expected 1024 bytes, got 7"),
    ],
)
def test_malformed_refused(kw, match):
    with pytest.raises(SeamViolation, match=match):
        validate_boundary(msg(**kw), DIMS)


def test_kind_specific_rules():
    with pytest.raises(SeamViolation, match="^dtype: expected i32 for token_ids, got f32"):
        validate_boundary(replace(msg("token_ids"), dtype=DType.F32), DIMS)
    with pytest.raises(SeamViolation, match="^positions: expected 1 position for verify_result"):
        validate_boundary(msg("verify_result", (3, 4)), DIMS)
    with pytest.raises(SeamViolation, match="^positions: expected <= 8 drafts"):
        validate_boundary(msg("draft_tokens", range(9)), DIMS)
    validate_boundary(msg(payload=bytes(2 * W * 2)), DIMS)


def test_session_checks():
    validate_boundary(msg(), DIMS, SESSION)
    with pytest.raises(StaleEpochError):
        validate_boundary(msg(epoch=1), DIMS, SESSION)
    with pytest.raises(ForeignSessionError):
        validate_boundary(msg(session_id="t"), DIMS, SESSION)
    validate_boundary(msg(epoch=1), DIMS)  # without a session only the shape is checked


def test_seam_bytes():
    v4 = seam_bytes_per_token(V4_FLASH_DIMS, DType.BF16)
    assert v4["boundary_hidden"] == 16384 * 2
    assert v4["decode_token"] == v4["prefill_token"] == 16384 * 2 + 8
    assert v4["draft_step"] == 4
    assert v4["verify_k2"] == 3 * (16384 * 2 + 8) + 16
    assert seam_bytes_per_token(V4_FLASH_DIMS, DType.F32)["boundary_hidden"] == 65536
    with pytest.raises(ContractError, match="^dtype"):
        seam_bytes_per_token(DIMS, DType.I32)


CACHE_NAMES = sorted(FORBIDDEN_KINDS)
affix = st.text(alphabet="abcxyz_-.", max_size=4)


@st.composite
def cache_names(draw):
    name = draw(st.sampled_from(CACHE_NAMES))
    name = "".join(c.upper() if draw(st.booleans()) else c for c in name)
    return draw(affix) + name + draw(affix)


@given(name=cache_names(), as_kind=st.booleans(), nested=st.booleans())
@settings(max_examples=200, deadline=None)
def test_cache_state_always_refused(name, as_kind, nested):
    assert names_cache_state(name)
    if as_kind:
        m = msg(name)
    else:
        m = msg(extra={"meta": {name: 0}} if nested else {name: 0})
    with pytest.raises(SeamViolation):
        validate_boundary(m, DIMS, SESSION)


@given(
    start=st.integers(0, 10_000),
    n=st.integers(1, 64),
    dtype=st.sampled_from([DType.F32, DType.F16, DType.BF16]),
    step=st.integers(0, 1000),
    with_payload=st.booleans(),
)
@settings(max_examples=200, deadline=None)
def test_well_formed_boundary_hidden_accepted(start, n, dtype, step, with_payload):
    nbytes = n * W * dtype.itemsize
    m = msg(
        positions=range(start, start + n),
        dtype=dtype,
        seq_step=step,
        payload=bytes(nbytes) if with_payload else None,
        extra={"trace_id": "t"},
    )
    assert m.nbytes == nbytes
    validate_boundary(m, DIMS, SESSION)


# -- nested values: the validator walks every type, at any depth ---------------------------
@dataclass
class Meta:
    """A typed record a shard might attach to a message."""

    label: str = "x"
    items: tuple = ()


class Obj:
    """A plain object: its attributes count as keys."""

    def __init__(self, **kw):
        self.__dict__.update(kw)


class Slotted:
    __slots__ = ("a", "b")

    def __init__(self, a, b):
        self.a, self.b = a, b


VOCAB = sorted({*FORBIDDEN_KINDS, *(k.value for k in CacheKind), "past_key_values",
                "kv_cache", "compressor_state", "indexer_state", "k_cache", "v_cache"})


@st.composite
def spelled_cache_names(draw):
    """A cache-vocabulary name in some spelling, possibly inside a longer name."""
    name = draw(st.sampled_from(VOCAB))
    style = draw(st.sampled_from(["plain", "upper", "title", "camel", "kebab", "dotted"]))
    parts = name.split("_")
    name = {
        "plain": name,
        "upper": name.upper(),
        "title": "_".join(p.title() for p in parts),
        "camel": parts[0] + "".join(p.title() for p in parts[1:]),
        "kebab": "-".join(parts),
        "dotted": ".".join(parts),
    }[style]
    return draw(st.sampled_from(["", "meta_", "x."])) + name + draw(st.sampled_from(["", "_1"]))


CLEAN_KEYS = st.text(alphabet="abdfghjmnopqruwyz_", min_size=1, max_size=8).filter(
    lambda k: not names_cache_state(k)
)
SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.floats(allow_nan=False),
    st.text(max_size=8),
    st.sampled_from(list(DType)),
)


def _containers(children):
    return st.one_of(
        st.lists(children, max_size=3),
        st.lists(children, max_size=3).map(tuple),
        st.dictionaries(CLEAN_KEYS, children, max_size=3),
        st.frozensets(st.one_of(st.integers(), st.text(max_size=4)), max_size=3),
        st.builds(Meta, label=st.text(max_size=4),
                  items=st.lists(children, max_size=2).map(tuple)),
        st.dictionaries(CLEAN_KEYS, children, max_size=2).map(lambda d: Obj(**d)),
        st.tuples(children, children).map(lambda ab: Slotted(*ab)),
    )


CLEAN = st.recursive(SCALARS, _containers, max_leaves=12)


def _buffers():
    import array

    import numpy as np

    return st.sampled_from([
        b"x", bytearray(b"xy"), memoryview(b"abc"), array.array("f", [1.0]),
        np.zeros(2, np.float32), np.array([1, None], dtype=object), np.float32(1.0),
    ])


@st.composite
def poisoned(draw, depth=0):
    """A clean structure with one cache-bearing key, attribute or raw buffer somewhere."""
    if depth >= 6 or draw(st.integers(0, 3)) == 0:
        bad = draw(st.sampled_from(["key", "attr", "field", "buffer", "set_buffer"]))
        name = draw(spelled_cache_names())
        value = draw(CLEAN)
        if bad == "key":
            return {**draw(st.dictionaries(CLEAN_KEYS, CLEAN, max_size=2)), name: value}
        if bad == "attr":
            return Obj(**{name: value})
        if bad == "field":
            return Obj(ok=1, **{name.replace(".", "_").replace("-", "_"): value})
        if bad == "set_buffer":
            return frozenset({b"raw", 1})
        return draw(_buffers())
    inner = draw(poisoned(depth + 1))
    wrap = draw(st.sampled_from(["list", "tuple", "dict", "meta", "obj", "slots"]))
    sibling = draw(CLEAN)
    pos = draw(st.integers(0, 1))
    pair = [sibling, inner] if pos else [inner, sibling]
    if wrap == "list":
        return pair
    if wrap == "tuple":
        return tuple(pair)
    if wrap == "dict":
        return {"a_" + str(pos): pair[0], "b": pair[1]}
    if wrap == "meta":
        return Meta(items=tuple(pair))
    if wrap == "obj":
        return Obj(a=pair[0], b=pair[1])
    return Slotted(*pair)


@given(name=spelled_cache_names())
@settings(max_examples=300, deadline=None)
def test_every_spelling_of_the_cache_vocabulary_names_cache_state(name):
    assert names_cache_state(name), name


@given(value=poisoned(), top=CLEAN_KEYS)
@settings(max_examples=400, deadline=None)
def test_cache_content_refused_at_any_depth(value, top):
    with pytest.raises(SeamViolation):
        check_seam_value(value)
    with pytest.raises(SeamViolation):
        validate_boundary(msg(extra={top: value}), DIMS, SESSION)


@given(value=CLEAN, top=CLEAN_KEYS)
@settings(max_examples=400, deadline=None)
def test_clean_typed_values_pass(value, top):
    check_seam_value(value)
    validate_boundary(msg(extra={top: value, "trace_id": "t"}), DIMS, SESSION)


def _nested(n: int) -> list:
    out: list = [1]
    for _ in range(n):
        out = [out]
    return out


@pytest.mark.parametrize(
    "extra, match",
    [
        ({"meta": [{"kv_cache": 1}]}, r"^extra\['meta'\]\[0\]\['kv_cache'\]: names cache state"),
        ({"m": ({"compressor_state": b"x"},)}, r"^extra\['m'\]\[0\]\['compressor_state'\]"),
        ({"m": [1, b"x"]}, r"^extra\['m'\]\[1\]: expected no raw bytes, got a bytes"),
        ({"past_key_values": ()}, r"^extra\['past_key_values'\]: names cache state"),
        ({"m": {"pastKeyValues": 0}}, r"pastKeyValues'\]: names cache state"),
        ({"m": Obj(kv_cache=None)}, r"^extra\['m'\]\.kv_cache: names cache state"),
        ({"m": Meta(items=(Slotted(1, bytearray(1)),))},
         r"^extra\['m'\]\.items\[0\]\.b: expected no raw bytes"),
        ({"m": {1: 2}}, r"^extra\['m'\]: expected str keys"),
        ({"m": CacheKind.INDEXER_K}, r"names cache state"),
        ({"m": type("DynamicCache", (), {})()}, "a DynamicCache names cache state"),
        ({"m": print}, "expected a typed value, got builtin_function_or_method"),
        ({"m": iter([1])}, "expected a typed value"),
        ({"m": {"n": _nested(40)}}, "deeper than 32 levels"),
    ],
)
def test_nested_cache_content_refused(extra, match):
    with pytest.raises(SeamViolation, match=match):
        validate_boundary(msg(extra=extra), DIMS)


def test_self_reference_refused():
    loop: list = [1]
    loop.append(loop)
    with pytest.raises(SeamViolation, match="refers to itself"):
        validate_boundary(msg(extra={"m": loop}), DIMS)
