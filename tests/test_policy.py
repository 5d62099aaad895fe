"""The deployment policy is negotiated on every MTP path: under alpha MTP is refused (exit 2
on the command line, naming the policy), whole and ranged; plain decoding always runs;
advertise() reports DISABLED; beta runs MTP as before."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mtplib.contract.capabilities import (
    ALPHA_POLICY,
    BETA_POLICY,
    RouteRefused,
    Status,
    negotiate,
)
from mtplib.contract.types import DSPARK_RECIPES, MTP_RECIPES
from mtplib.errors import InputError
from mtplib.lab.bench import config as BC
from mtplib.lab.correctness import seeded_prompt
from mtplib.records.lanes import LaneError, load_lane, run_lane
from mtplib.runtime.capability import advertise
from mtplib.runtime.engine_options import EngineOptions
from mtplib.runtime.routing import POLICY_ENV, local_advert, resolve_policy, route
from mtplib.runtime.speculative import MTPRuntime

REPO = Path(__file__).resolve().parent.parent
PROMPT = seeded_prompt(3, 8)
SMALL = {"n_ctx": 256, "n_threads": 1}
ALPHA_MSG = "refused under policy 'alpha': alpha policy: MTP disabled"


@pytest.fixture(autouse=True)
def _no_policy_env(monkeypatch):
    monkeypatch.delenv(POLICY_ENV, raising=False)


def cli(*args, timeout=120, env=None):
    return subprocess.run([sys.executable, "-m", "mtplib.cli", *map(str, args)],
                          capture_output=True, text=True, timeout=timeout, cwd=REPO,
                          env={**os.environ, **(env or {})})


# -- routing: the policy and the run's adverts through negotiate() ----------------------
def test_route_refuses_mtp_under_alpha_only():
    assert route(0, policy="alpha").recipe_routed == "mtp.off"
    for k in (1, 3, 8):
        with pytest.raises(RouteRefused, match=f"^mtp.v4.draft{k} {ALPHA_MSG}"):
            route(k, policy="alpha")
        assert route(k, policy="beta").recipe_routed == f"mtp.v4.draft{k}"
    with pytest.raises(RouteRefused, match="policy 'beta': unknown recipe"):
        route(9, policy="beta")
    with pytest.raises(RouteRefused, match="shard 0: tail shard has no MTP sidecar"):
        route(1, policy="beta", has_sidecar=False)
    assert isinstance(RouteRefused("x"), InputError)


def test_local_advert_disables_mtp_under_alpha():
    beta = local_advert(has_sidecar=True, policy=BETA_POLICY)
    alpha = local_advert(has_sidecar=True, policy=ALPHA_POLICY)
    assert beta.has_mtp_sidecar and alpha.has_mtp_sidecar
    assert {beta.recipes[r] for r in ("mtp.off", *MTP_RECIPES)} == {Status.IMPLEMENTED}
    assert alpha.recipes["mtp.off"] == Status.IMPLEMENTED
    assert {alpha.recipes[r] for r in MTP_RECIPES} == {Status.DISABLED}
    # no DSpark draft in an MTP run: its recipes cannot run (unsupported says more)
    assert {alpha.recipes[r] for r in DSPARK_RECIPES} == {Status.UNSUPPORTED}
    # even a policy allowing MTP does not route a recipe an advert says is disabled
    assert not negotiate("mtp.v4.draft1", [alpha], BETA_POLICY).mtp


def test_policy_default_is_beta_or_the_environment(monkeypatch):
    assert resolve_policy() is BETA_POLICY
    monkeypatch.setenv(POLICY_ENV, "alpha")
    assert resolve_policy() is ALPHA_POLICY and resolve_policy("beta") is BETA_POLICY
    monkeypatch.setenv(POLICY_ENV, "gamma")
    with pytest.raises(InputError, match="^policy: expected one of alpha, beta, got 'gamma'"):
        resolve_policy()


# -- advertise ----------------------------------------------------------------------------
def test_advertise_reports_disabled_under_alpha(pair, tmp_path):
    cap = advertise(pair.trunk, pair.sidecar, cert_dir=tmp_path, policy="alpha")
    rec = cap.advert.recipes
    assert rec["mtp.off"] == Status.IMPLEMENTED
    assert all(rec[f"mtp.v4.draft{k}"] == Status.DISABLED for k in (1, 2, 3))
    assert cap.reasons["mtp.v4.draft2"] == "alpha policy: MTP disabled"
    assert cap.to_dict()["recipes"]["mtp.v4.draft1"] == "disabled"
    d = negotiate("mtp.v4.draft1", [cap.advert], BETA_POLICY)
    assert d.reason == "shard 0: recipe 'mtp.v4.draft1' is disabled, need implemented"
    beta = advertise(pair.trunk, pair.sidecar, cert_dir=tmp_path, policy="beta", probe=False)
    assert {beta.advert.recipes[r] for r in ("mtp.off", *MTP_RECIPES)} == {Status.IMPLEMENTED}
    # what cannot run at all stays unsupported (that says more than disabled)
    none = advertise(pair.trunk, None, cert_dir=tmp_path, policy="alpha")
    assert none.advert.recipes["mtp.v4.draft1"] == Status.UNSUPPORTED


# -- MTPRuntime ---------------------------------------------------------------------------
def test_mtp_runtime_refuses_mtp_under_alpha(pair, monkeypatch):
    for policy in ("alpha", ALPHA_POLICY):
        with pytest.raises(RouteRefused, match=f"^mtp.v4.draft2 {ALPHA_MSG}"):
            MTPRuntime(str(pair.trunk), str(pair.sidecar), k=2, policy=policy)
    with MTPRuntime(str(pair.trunk), str(pair.sidecar), k=0, policy="alpha", **SMALL) as rt:
        plain, m = rt.generate(PROMPT, 8)  # plain decoding is always allowed
        assert rt.mtp_ctx is None and m.drafted == 0
        assert m.routing["policy"] == "alpha" and m.routing["recipe"] == "mtp.off"
    with MTPRuntime(str(pair.trunk), str(pair.sidecar), k=2, policy="beta", **SMALL) as rt:
        toks, m = rt.generate(PROMPT, 8)
        assert toks == plain and m.drafted > 0
        assert m.routing == {"policy": "beta", "recipe": "mtp.v4.draft2",
                                "reason": "all 1 shards implement mtp.v4.draft2"}
    monkeypatch.setenv(POLICY_ENV, "alpha")  # a lane's policy reaches code that names none
    with pytest.raises(RouteRefused, match="policy 'alpha'"):
        MTPRuntime(str(pair.trunk), str(pair.sidecar), k=1)


# -- the command line ---------------------------------------------------------------------
def test_generate_cli_alpha_refuses_mtp_whole_and_ranged(pair):
    base = ["generate", "--model", pair.trunk, "--tokens", "1,2,3", "--n", 4]
    for extra in ([], ["--plan", "0-1,2-3"]):
        r = cli(*base, *extra, "--mtp", pair.sidecar, "--draft", 2, "--policy", "alpha")
        assert r.returncode == 2, r.stderr
        assert f"mtplib generate: error: mtp.v4.draft2 {ALPHA_MSG}" in r.stderr
        assert "Traceback" not in r.stderr
    r = cli(*base, "--mtp", pair.sidecar, env={POLICY_ENV: "alpha"})
    assert r.returncode == 2 and "policy 'alpha'" in r.stderr
    r = cli(*base, "--json", "--policy", "alpha")  # plain decoding runs under alpha
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["metrics"]["routing"]["recipe"] == "mtp.off"
    r = cli(*base, "--policy", "gamma")
    assert r.returncode == 2 and "invalid choice: 'gamma'" in r.stderr


def test_generate_cli_beta_runs_mtp_whole_and_ranged(pair):
    """Beta (the default) routes MTP; the ranged run negotiates with the shards' adverts
    (the tail's: the MTP block was placed on it)."""
    base = ["generate", "--model", pair.trunk, "--tokens", ",".join(map(str, PROMPT)),
            "--n", 8, "--ctx", 256, "--threads", 1, "--json", "--mtp", pair.sidecar,
            "--draft", 2]
    outs = []
    for extra in ([], ["--policy", "beta", "--plan", "0-1,2-3"]):
        r = cli(*base, *extra)
        assert r.returncode == 0, r.stderr
        outs.append(json.loads(r.stdout))
    whole, ranged = outs
    assert whole["tokens"] == ranged["tokens"]
    for out in outs:
        assert out["metrics"]["drafted"] > 0
        assert out["metrics"]["routing"]["policy"] == "beta"
        assert out["metrics"]["routing"]["recipe"] == "mtp.v4.draft2"
    assert ranged["metrics"]["routing"]["reason"] == "all 2 shards implement mtp.v4.draft2"


def test_ranged_mtp_refuses_mtp_under_alpha_but_decodes_plainly(pair, monkeypatch):
    from mtplib.distributed.ranged_mtp import RangedMTP

    def no_shards(*a, **kw):
        raise AssertionError("a shard was started")

    # its default drafting (k = DEFAULT_DRAFT with a sidecar) is refused when the request
    # is built, before any shard starts
    with monkeypatch.context() as m:
        m.setattr("mtplib.distributed.processes.LocalShards", no_shards)
        with pytest.raises(RouteRefused, match=f"^mtp.v4.draft3 {ALPHA_MSG}"):
            RangedMTP(str(pair.trunk), plan="0-1,2-3", sidecar=str(pair.sidecar),
                      policy="alpha")
    with RangedMTP(str(pair.trunk), plan="0-1,2-3", sidecar=str(pair.sidecar),
                   policy="alpha", opts=EngineOptions(k=0)) as r:
        # the MTP block sits next to the sampler (placement auto = the client), not on the tail
        assert r.mtp_placed and not r.mtp_on_tail
        with pytest.raises(RouteRefused, match=f"^mtp.v4.draft1 {ALPHA_MSG}"):
            r.generate(PROMPT, 4, EngineOptions(k=1))
        toks, m = r.generate(PROMPT, 4, EngineOptions(k=0))
        assert len(toks) == 4 and m.drafted == 0
        assert m.routing["recipe"] == "mtp.off"


# -- bench and lanes ----------------------------------------------------------------------
def test_bench_refuses_under_alpha_before_anything_runs(tmp_path):
    cfg = BC.BenchConfig.from_dict({"ks": [1]}, policy="alpha")
    assert cfg.policy == "alpha"
    with pytest.raises(RouteRefused, match=f"^bench: mtp.v4.draft1 {ALPHA_MSG}"):
        BC.check_requirements(cfg)
    BC.check_requirements(BC.BenchConfig.from_dict({"ks": [1]}))  # beta, the default
    assert BC.BenchConfig.from_dict({}).policy == "beta"
    with pytest.raises(BC.BenchConfigError, match="differs from the lane's policy 'alpha'"):
        BC.BenchConfig.from_dict({"policy": "beta"}, policy="alpha")
    with pytest.raises(BC.BenchConfigError, match="^bench: policy: expected one of"):
        BC.BenchConfig.from_dict({"policy": "gamma"})
    out = tmp_path / "b"
    r = cli("bench", "--params", REPO / "params" / "cpu-fixture.yaml", "--out", out,
            "--policy", "alpha")
    assert r.returncode == 2, r.stderr
    assert f"mtp.v4.draft1 {ALPHA_MSG}" in r.stderr and "Traceback" not in r.stderr
    assert not out.exists()  # refused before the run folder was made


def test_lane_policy_key(tmp_path, monkeypatch):
    assert load_lane(REPO / "params" / "cpu-fixture.yaml").policy == "beta"
    lane = tmp_path / "a.yaml"
    head = "lane: a\nfixture: {preset: tiny}\nnotebooks: [04_benchmark.ipynb]\n"
    lane.write_text(head + "policy: gamma\n")
    with pytest.raises(LaneError, match="policy: expected one of alpha, beta, got 'gamma'"):
        load_lane(lane)
    lane.write_text(head + "policy: alpha\nbench: {ks: [1]}\n")
    with pytest.raises(LaneError, match=f"mtp.v4.draft1 {ALPHA_MSG}"):
        run_lane(lane, out_root=tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()

    # without a bench the lane runs; its notebooks' kernels get the policy
    import papermill

    seen = []

    def fake_execute(src, dst, **kw):
        seen.append(os.environ.get(POLICY_ENV))
        Path(dst).write_text("{}")

    monkeypatch.setattr(papermill, "execute_notebook", fake_execute)
    lane.write_text("lane: a\nfixture: {preset: tiny}\nnotebooks: [00_fixture_smoke.ipynb]\n"
                    "policy: alpha\n")
    run_dir = run_lane(lane, out_root=tmp_path / "out2", run_id="r", progress=False)
    assert seen == ["alpha"] and POLICY_ENV not in os.environ
    rec = json.loads((run_dir / "run_record.json").read_text())
    assert rec["policy"] == "alpha" and rec["status"] == "ok"
