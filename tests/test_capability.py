"""Capability advertisement is fail-closed; certified needs a passing run for this hash."""

import json

from mtplib.contract.capabilities import ALPHA_POLICY, BETA_POLICY, Policy, Status, negotiate
from mtplib.contract.types import MTP_RECIPES
from mtplib.runtime.capability import advertise, certify, model_key


def test_no_sidecar_is_unsupported(pair, tmp_path):
    cap = advertise(pair.trunk, None, cert_dir=tmp_path)
    rec = cap.advert.recipes
    assert rec["mtp.off"] == Status.IMPLEMENTED
    assert all(rec[f"mtp.v4.draft{k}"] == Status.UNSUPPORTED for k in (1, 2, 3))
    assert cap.reasons["mtp.v4.draft1"] == "no MTP sidecar"


def test_mismatched_sidecar_is_unsupported(pair, other_pair, tmp_path):
    cap = advertise(pair.trunk, other_pair.sidecar, cert_dir=tmp_path)
    assert cap.advert.recipes["mtp.v4.draft2"] == Status.UNSUPPORTED
    assert "token_embd data differs" in cap.reasons["mtp.v4.draft2"]


def test_implemented_then_certified_only_for_this_hash(pair, other_pair, tmp_path):
    cap = advertise(pair.trunk, pair.sidecar, cert_dir=tmp_path)
    assert {cap.advert.recipes[r] for r in MTP_RECIPES} == {Status.IMPLEMENTED}
    rec = certify(str(pair.trunk), str(pair.sidecar), cert_dir=tmp_path, n_new=16)
    assert all(r["passed"] for r in rec["recipes"].values())
    cap = advertise(pair.trunk, pair.sidecar, cert_dir=tmp_path)
    assert {cap.advert.recipes[r] for r in MTP_RECIPES} == {Status.CERTIFIED}
    # the record names one model hash: another pair is not certified by it
    other = advertise(other_pair.trunk, other_pair.sidecar, cert_dir=tmp_path)
    assert {other.advert.recipes[r] for r in MTP_RECIPES} == {Status.IMPLEMENTED}
    # a tampered (failing) record certifies nothing
    p = tmp_path / f"{model_key(pair.trunk, pair.sidecar)}.json"
    data = json.loads(p.read_text())
    data["recipes"]["mtp.v4.draft2"]["passed"] = False
    p.write_text(json.dumps(data))
    cap = advertise(pair.trunk, pair.sidecar, cert_dir=tmp_path)
    assert cap.advert.recipes["mtp.v4.draft2"] == Status.IMPLEMENTED
    # negotiation: alpha never routes MTP; beta routes a recipe every shard implements; a
    # certified-only policy wants the passing certification run too
    strict = Policy("strict", allow_mtp=True, min_status=Status.CERTIFIED)
    assert not negotiate("mtp.v4.draft1", [cap.advert], ALPHA_POLICY).mtp
    assert negotiate("mtp.v4.draft1", [cap.advert], strict).mtp
    assert negotiate("mtp.v4.draft2", [cap.advert], BETA_POLICY).mtp
    assert not negotiate("mtp.v4.draft2", [cap.advert], strict).mtp
