"""Deterministic JSON fixtures of the contract, so any change to it shows up as a diff.

Usage: python -m mtplib.contract.golden OUT_DIR          (write)
       python -m mtplib.contract.golden --check OUT_DIR  (exit 1 listing differing files)
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

from mtplib.contract.capabilities import (
    ALPHA_POLICY,
    BETA_POLICY,
    CHECKS,
    Policy,
    ShardAdvert,
    Status,
    build_advert,
    negotiate,
)
from mtplib.contract.dspark import DSPARK_SHARD_LOCAL
from mtplib.contract.dspark_golden import dspark_doc
from mtplib.contract.seam import (
    FORBIDDEN_KINDS,
    SEAM_VALUES,
    BoundaryMessage,
    seam_bytes_per_token,
    validate_boundary,
)
from mtplib.contract.session import TRANSITIONS, Event, Session, State
from mtplib.contract.types import (
    CONTRACT_VERSION,
    DEFAULT_DRAFT,
    DRAFTERS,
    FLOAT_DTYPES,
    MAX_DRAFT,
    MIN_DRAFT,
    RECIPES,
    SHARD_LOCAL,
    TINY_DIMS,
    V4_FLASH_DIMS,
    ContractError,
    DraftProposal,
    DType,
    ModelDims,
    plan_rollback,
    verify_greedy,
)

Doc = dict[str, object]


def _version_doc() -> Doc:
    return {
        "contract_version": CONTRACT_VERSION,
        "recipes": list(RECIPES),
        "min_draft": MIN_DRAFT,
        "max_draft": MAX_DRAFT,
        "default_draft": DEFAULT_DRAFT,
        "drafters": list(DRAFTERS),
        "statuses": [s.label for s in Status],
        "shard_local_caches": sorted(k.value for k in SHARD_LOCAL),
        "dspark_shard_local_caches": sorted(k.value for k in DSPARK_SHARD_LOCAL),
        "dtypes": {d.value: d.itemsize for d in DType},
    }


def _seam_doc() -> Doc:
    tables = []
    for name, dims in (("tiny", TINY_DIMS), ("v4_flash", V4_FLASH_DIMS)):
        for dtype in (DType.F32, DType.BF16):
            values = {}
            for kind, v in SEAM_VALUES.items():
                wire = dtype if dtype in v.dtypes else DType.I32
                values[kind] = {
                    "width": v.width(dims),
                    "dtype": wire.value,
                    "allowed_dtypes": sorted(d.value for d in v.dtypes),
                    "bytes_per_row": v.bytes_per_row(dims, wire),
                    "per": v.per,
                    "note": v.note,
                }
            tables.append(
                {
                    "dims": {
                        "name": name,
                        "n_embd": dims.n_embd,
                        "hc": dims.hc,
                        "n_vocab": dims.n_vocab,
                        "hidden_width": dims.hidden_width,
                        "n_target_layers": dims.n_target_layers,
                        "feature_width": dims.feature_width,
                    },
                    "dtype": dtype.value,
                    "values": values,
                    "seam_bytes_per_token": seam_bytes_per_token(dims, dtype),
                }
            )
    return {
        "tables": tables,
        "forbidden_kinds": dict(FORBIDDEN_KINDS),
        "float_dtypes": sorted(d.value for d in FLOAT_DTYPES),
    }


def _session_doc() -> Doc:
    rows = [
        {"state": s.value, "event": e.value, "next": n.value}
        for (s, e), n in sorted(
            TRANSITIONS.items(), key=lambda kv: (kv[0][0].value, kv[0][1].value)
        )
    ]
    return {
        "states": [s.value for s in State],
        "events": [e.value for e in Event],
        "transitions": rows,
        "epoch_bumps": ["rollback", "truncate", "accept with n_accepted < n_drafted"],
    }


def _msg(
    dims: ModelDims, kind: str = "boundary_hidden", n: int = 2, **kw: object
) -> BoundaryMessage:
    spec = SEAM_VALUES.get(kind)
    width = spec.width(dims) if spec else dims.hidden_width
    allowed = spec.dtypes if spec else frozenset({DType.BF16})
    dtype = next(d for d in (DType.BF16, DType.F32, DType.I32) if d in allowed)
    base: dict[str, object] = dict(
        session_id="s1",
        epoch=3,
        seq_step=0,
        kind=kind,
        positions=tuple(range(10, 10 + n)),
        width=width,
        dtype=dtype,
        nbytes=n * width * dtype.itemsize,
    )
    base.update(kw)
    return BoundaryMessage(**base)  # type: ignore[arg-type]


def _msg_json(m: BoundaryMessage) -> Doc:
    return {
        "session_id": m.session_id,
        "epoch": m.epoch,
        "seq_step": m.seq_step,
        "kind": m.kind,
        "positions": list(m.positions) if isinstance(m.positions, tuple) else repr(m.positions),
        "width": m.width,
        "dtype": m.dtype.value if isinstance(m.dtype, DType) else repr(m.dtype),
        "nbytes": m.nbytes,
        "payload_len": None if m.payload is None else len(m.payload),
        "extra": {k: repr(v) for k, v in sorted(m.extra.items())},
    }


def boundary_cases(dims: ModelDims = TINY_DIMS) -> list[tuple[str, BoundaryMessage, Session]]:
    """Named example messages checked against a live session (s1, epoch 3)."""
    sess = Session("s1", State.DECODING, epoch=3, position=12)
    h = dims.hidden_width
    cases: list[tuple[str, BoundaryMessage]] = [
        ("ok_boundary_hidden", _msg(dims)),
        ("ok_boundary_hidden_with_payload", _msg(dims, n=1, payload=bytes(h * 2))),
        ("ok_token_ids", _msg(dims, "token_ids", n=3)),
        ("ok_draft_tokens", _msg(dims, "draft_tokens", n=3)),
        ("ok_verify_result", _msg(dims, "verify_result", n=1)),
        ("ok_extra_trace_id", _msg(dims, extra={"trace_id": "t-1", "shard_from": 0})),
    ]
    cases += [(f"forbidden_kind_{k}", _msg(dims, k)) for k in FORBIDDEN_KINDS]
    cases += [
        ("unknown_kind", _msg(dims, "attention_weights")),
        ("smuggled_extra_kv_cache", _msg(dims, extra={"kv_cache": "..."})),
        ("smuggled_extra_compressor_state", _msg(dims, extra={"Compressor-State": 1})),
        ("smuggled_nested_extra", _msg(dims, extra={"meta": {"indexer_k": 0}})),
        ("raw_bytes_in_extra", _msg(dims, extra={"blob": b"\x00"})),
        ("smuggled_kv_cache_in_list", _msg(dims, extra={"meta": [{"kv_cache": "..."}]})),
        ("smuggled_compressor_state_in_tuple",
         _msg(dims, extra={"meta": ({"compressor_state": "x"},)})),
        ("raw_bytes_in_list", _msg(dims, extra={"meta": [1, b"\x00"]})),
        ("smuggled_past_key_values", _msg(dims, extra={"past_key_values": None})),
        ("smuggled_camel_case_cache", _msg(dims, extra={"meta": {"pastKeyValues": 0}})),
        ("stale_epoch", _msg(dims, epoch=2)),
        ("future_epoch", _msg(dims, epoch=4)),
        ("foreign_session", _msg(dims, session_id="s2")),
        ("wrong_width", _msg(dims, width=dims.n_embd, nbytes=2 * dims.n_embd * 2)),
        ("wrong_dtype_for_tokens", _msg(dims, "token_ids", dtype=DType.F32)),
        ("positions_gap", _msg(dims, positions=(10, 12))),
        ("positions_negative", _msg(dims, positions=(-1, 0))),
        ("positions_empty", _msg(dims, positions=(), nbytes=0)),
        ("nbytes_mismatch", _msg(dims, nbytes=h * 2)),
        ("payload_mismatch", _msg(dims, n=1, payload=bytes(3))),
        ("verify_result_two_positions", _msg(dims, "verify_result", n=2)),
        ("too_many_drafts", _msg(dims, "draft_tokens", n=MAX_DRAFT + 1)),
        ("ok_dspark_features", _msg(dims, "dspark_features", n=3)),
        ("ok_dspark_features_with_payload",
         _msg(dims, "dspark_features", n=1, payload=bytes(dims.feature_width * 4))),
        ("dspark_features_bf16_option_not_built",
         _msg(dims, "dspark_features", dtype=DType.BF16,
              nbytes=2 * dims.feature_width * 2)),
        ("dspark_features_wrong_width",
         _msg(dims, "dspark_features", width=dims.hidden_width,
              nbytes=2 * dims.hidden_width * 4)),
        ("ok_dspark_confidences", _msg(dims, "dspark_confidences", n=5)),
        ("too_many_dspark_confidences", _msg(dims, "dspark_confidences", n=MAX_DRAFT + 1)),
        ("dspark_k_rows_option_not_built", _msg(dims, "dspark_k_rows")),
        ("smuggled_dspark_swa_k", _msg(dims, extra={"dspark_swa_k": 0})),
    ]
    return [(name, m, sess) for name, m in cases]


def _verdict(fn: Callable[[], None]) -> Doc:
    try:
        fn()
    except ContractError as exc:
        return {"verdict": "refused", "error": type(exc).__name__, "reason": str(exc)}
    return {"verdict": "accepted"}


def _messages_doc() -> Doc:
    return {
        "session": {"session_id": "s1", "state": "decoding", "epoch": 3, "position": 12},
        "dims": {"n_embd": TINY_DIMS.n_embd, "hc": TINY_DIMS.hc, "n_vocab": TINY_DIMS.n_vocab},
        "cases": [
            {
                "name": name,
                "message": _msg_json(m),
                **_verdict(lambda m=m, s=s: validate_boundary(m, TINY_DIMS, s)),
            }
            for name, m, s in boundary_cases()
        ],
    }


def _advert(i: int, **kw: object) -> ShardAdvert:
    base: dict[str, object] = dict(
        shard_index=i,
        contract_version=CONTRACT_VERSION,
        pin="v4flash-q8@abc123",
        has_mtp_sidecar=True,
        recipes={r: Status.CERTIFIED for r in RECIPES[1:]},
        has_dspark_draft=True,
    )
    base.update(kw)
    return ShardAdvert(**base)  # type: ignore[arg-type]


def _built(i: int, tail: int, dspark_block: int = 0) -> ShardAdvert:
    """A ranged run's advert as `shard_report.shard_adverts` builds it (the MTP block
    placed; a DSpark draft of ``dspark_block`` in the client, 0: none)."""
    return build_advert(i, pin="v4flash-q8@abc123", policy=BETA_POLICY,
                        has_mtp_sidecar=i == tail, has_dspark_draft=dspark_block > 0
                        and i == tail, dspark_block=dspark_block).advert


def advert_sets() -> dict[str, list[ShardAdvert]]:
    """Named shard line-ups exercising each negotiation cause."""
    return {
        "all_certified_2": [_advert(0), _advert(1)],
        "single_shard_certified": [_advert(0)],
        "no_adverts": [],
        "version_mismatch": [_advert(0), _advert(1, contract_version="mtp-contract/0")],
        "pin_mismatch": [_advert(0), _advert(1, pin="v4flash-q8@def456")],
        "tail_without_sidecar": [_advert(0), _advert(1, has_mtp_sidecar=False)],
        "head_without_sidecar": [_advert(0, has_mtp_sidecar=False), _advert(1)],
        "not_advertised": [_advert(0, recipes={}), _advert(1)],
        "implemented_only": [
            _advert(0),
            _advert(1, recipes={r: Status.IMPLEMENTED for r in RECIPES[1:]}),
        ],
        "disabled": [_advert(0, recipes={r: Status.DISABLED for r in RECIPES[1:]}), _advert(1)],
        "duplicate_index": [_advert(0), _advert(0)],
        "tail_without_dspark_draft": [_advert(0), _advert(1, has_dspark_draft=False)],
        "ranged_no_dspark_draft": [_built(0, 1), _built(1, 1)],
        "ranged_dspark_block3": [_built(0, 1, 3), _built(1, 1, 3)],
    }


def _advert_json(a: ShardAdvert) -> Doc:
    return {
        "shard_index": a.shard_index,
        "contract_version": a.contract_version,
        "pin": a.pin,
        "has_mtp_sidecar": a.has_mtp_sidecar,
        "has_dspark_draft": a.has_dspark_draft,
        "recipes": {r: s.label for r, s in sorted(a.recipes.items())},
    }


STRICT_EXAMPLE = Policy("certified-only", allow_mtp=True, min_status=Status.CERTIFIED)
"""Not a named policy: shows a policy that also wants every shard's certification run."""


def _negotiation_doc() -> Doc:
    requests = (
        "mtp.off",
        "mtp.v4.draft1",
        "mtp.v4.draft3",
        "mtp.v4.draft5",
        "mtp.v4.draft9",
        "mtp.v4.draft02",
        "eagle3",
        "dspark.v4.draft1",
        "dspark.v4.draft3",
        "dspark.v4.draft5",
        "dspark.v4.draft9",
    )
    policies: tuple[Policy, ...] = (ALPHA_POLICY, BETA_POLICY, STRICT_EXAMPLE)
    sets = advert_sets()
    rows = []
    for set_name, adverts in sets.items():
        for policy in policies:
            for req in requests:
                d = negotiate(req, adverts, policy)
                rows.append(
                    {
                        "adverts": set_name,
                        "policy": policy.name,
                        "requested": req,
                        "routed": d.recipe_routed,
                        "reason": d.reason,
                        "per_shard": [
                            {
                                "shard_index": v.shard_index,
                                "status": v.status.label,
                                "ok": v.ok,
                                "reason": v.reason,
                            }
                            for v in d.per_shard
                        ],
                    }
                )
    return {
        "policies": {
            p.name: {"allow_mtp": p.allow_mtp, "min_status": p.min_status.label}
            for p in policies
        },
        "checks_in_order": [c.__name__.lstrip("_") for c in CHECKS],
        "advert_sets": {k: [_advert_json(a) for a in v] for k, v in sets.items()},
        "matrix": rows,
    }


def _rollback_verify_doc() -> Doc:
    plans = []
    for args in (
        (10, 10, 4, 3),
        (10, 8, 4, 3),
        (10, 7, 4, 3),
        (10, 6, 4, 3),
        (10, 8, 1, 3),
        (10, 2, 4, 3),
        (10, 8, 0, 3),
        (10, 0, 4, 10),
    ):
        p = plan_rollback(*args)
        plans.append(
            {
                "n_cached": args[0],
                "keep_until": args[1],
                "n_rs_seq": args[2],
                "last_decode_len": args[3],
                "kind": p.kind,
                "drop": p.drop,
                "replay_from": p.replay_from,
            }
        )
    prop = DraftProposal(
        "s1", 3, base_position=11, drafts=(5, 6, 7), head_index=0, recipe="mtp.v4.draft3"
    )
    verifies = []
    for target in ((5, 6, 7, 8), (5, 6, 9, 1), (9, 6, 7, 8), (5, 9, 7, 8)):
        r = verify_greedy(prop, target)
        verifies.append(
            {
                "drafts": list(prop.drafts),
                "target_argmax": list(target),
                "n_accepted": r.n_accepted,
                "correction_token": r.correction_token,
                "emitted": list(r.emitted),
                "next_position": r.next_position,
            }
        )
    return {
        "position_rule": "MTP row at position p pairs token x_p with trunk h_{p-1}",
        "base_position": prop.base_position,
        "rollback_plans": plans,
        "greedy_verify": verifies,
    }


DOCS: dict[str, Callable[[], Doc]] = {
    "contract_version.json": _version_doc,
    "seam_values.json": _seam_doc,
    "session_transitions.json": _session_doc,
    "boundary_messages.json": _messages_doc,
    "negotiation_matrix.json": _negotiation_doc,
    "rollback_and_verify.json": _rollback_verify_doc,
    "dspark_values.json": dspark_doc,
}


def render(doc: Doc) -> bytes:
    return (json.dumps(doc, sort_keys=True, indent=2, ensure_ascii=True) + "\n").encode("ascii")


def write_golden(out_dir: Path) -> list[Path]:
    """Write every fixture into out_dir; returns the paths in a fixed order."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, build in sorted(DOCS.items()):
        path = out_dir / name
        path.write_bytes(render(build()))
        paths.append(path)
    return paths


def check_golden(out_dir: Path) -> list[str]:
    """Names of fixtures that are missing, different, or unexpected in out_dir."""
    out_dir = Path(out_dir)
    with tempfile.TemporaryDirectory() as tmp:
        fresh = {p.name: p.read_bytes() for p in write_golden(Path(tmp))}
    bad = [
        n
        for n, data in fresh.items()
        if not (out_dir / n).is_file() or (out_dir / n).read_bytes() != data
    ]
    extra = sorted(p.name for p in out_dir.glob("*.json") if p.name not in fresh)
    return sorted(bad) + extra


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m mtplib.contract.golden", description=__doc__)
    ap.add_argument("--check", action="store_true", help="compare instead of writing")
    ap.add_argument("out_dir", type=Path)
    args = ap.parse_args(argv)
    if args.check:
        bad = check_golden(args.out_dir)
        for name in bad:
            print(f"differs: {name}")
        return 1 if bad else 0
    for path in write_golden(args.out_dir):
        print(path.name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
