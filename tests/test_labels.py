"""Issue 23 item 2: one enum for step kinds and one for placements, in the contract layer,
used everywhere; the texts files hold are unchanged (StrEnum members are their text)."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

from mtplib.contract.labels import (
    DECODING_STEPS,
    PLACEMENT_CHOICES,
    PLACEMENTS,
    SEAM_CHOICES,
    SEAMS,
    STEP_KINDS,
    TIME_PARTS,
    Placement,
    StepKind,
)
from mtplib.errors import InputError
from mtplib.lab.projection.constants import STEP_KINDS as PROJECTED_KINDS
from mtplib.lab.projection.structure import MessageStructure
from mtplib.lab.projection.traffic import step_traffic
from mtplib.ownership.derivation import inventory_from_paths
from mtplib.ownership.plan import parse_plan

PKG = Path(__file__).resolve().parent.parent / "mtplib"
STEP_TEXTS = {k.value for k in StepKind}
PLACE_TEXTS = {p.value for p in Placement}


def test_members_are_their_texts():
    assert [str(k) for k in STEP_KINDS] == ["prefill", "decode", "draft", "verify", "feed",
                                           "rollback"]
    assert PLACEMENTS == ("tail", "client") and PLACEMENT_CHOICES == ("auto", "tail", "client")
    assert SEAMS == ("star", "ring") and SEAM_CHOICES == ("auto", "star", "ring")
    assert json.dumps({StepKind.VERIFY: Placement.TAIL}) == '{"verify": "tail"}'
    assert f"t_{StepKind.ROLLBACK}_s" == "t_rollback_s" and StepKind("decode") == "decode"
    assert set(TIME_PARTS) | set(DECODING_STEPS) == set(STEP_KINDS)


def _literal_label_sets() -> list[str]:
    """Tuples or lists of 2+ string literals, all of them step kinds or all placements."""
    found = []
    for p in PKG.rglob("*.py"):
        if p.name == "labels.py" and p.parent.name == "contract":
            continue
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.Tuple | ast.List | ast.Set) and len(node.elts) >= 2 and all(
                    isinstance(e, ast.Constant) and isinstance(e.value, str) for e in node.elts):
                vals = {e.value for e in node.elts}
                if vals <= STEP_TEXTS and len(vals) >= 3 or vals <= PLACE_TEXTS | {"auto"} \
                        and PLACE_TEXTS <= vals:
                    found.append(f"{p.relative_to(PKG.parent)}:{node.lineno} {sorted(vals)}")
    return found


def test_no_module_lists_the_labels_again():
    assert _literal_label_sets() == []


def test_projection_says_decode_and_still_takes_plain(pair):
    cfg = inventory_from_paths(pair.trunk, pair.sidecar).config
    plan = parse_plan("0-1,2-3", cfg.n_layer)
    a = step_traffic(cfg, plan, "plain")
    b = step_traffic(cfg, plan, StepKind.DECODE)
    assert a == b and a.kind == StepKind.DECODE
    assert StepKind.DECODE in PROJECTED_KINDS and "plain" not in PROJECTED_KINDS
    with pytest.raises(InputError, match="decode, verify, draft, feed"):
        step_traffic(cfg, plan, "prefill")
    s = MessageStructure.from_run({"n_shards": 2, "waits": {"decode": [2, 1]}})
    assert s == MessageStructure.from_run({"n_shards": 2, "waits": {"plain": [2, 1]}})
