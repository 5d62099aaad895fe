"""One run, one request: `build_request` checks every setting once and everything after it
reads the frozen `RunRequest`. Counted here, per run, in this process: the draft-length
check (`draft_problem`), the rule "no sidecar means k=0" (`draft_with`), the plan parse
(`parse_plan`), the policy gate (`policy_gate`) and the endpoint-count check
(`check_endpoints`), for `mtplib generate` (whole and ranged, MTP on and off), for serve's
backend, for two generations on one MTPRuntime / RangedMTP, and for the lab's WAN and bench
runs. Each counter wraps the function in every mtplib module that holds it by name."""

from __future__ import annotations

import dataclasses
import importlib
import pickle
import sys

import pytest

import mtplib.commands.serve as serve
import mtplib.distributed.client  # noqa: F401 - imported before the counters wrap names
import mtplib.distributed.ranged_mtp as ranged_mtp
from mtplib.cli import build_parser, main
from mtplib.contract.capabilities import RouteRefused
from mtplib.contract.types import NO_DRAFT, DraftLength
from mtplib.errors import InputError
from mtplib.lab.bench import measure as bench
from mtplib.lab.correctness import seeded_prompt
from mtplib.lab.wan import config as wan_config
from mtplib.lab.wan import measure as wan_measure
from mtplib.ownership.plan import PlanError, ShardPlan
from mtplib.runtime.engine_options import EngineOptions
from mtplib.runtime.links import WanLink
from mtplib.runtime.request import DraftRefused, RunRequest, build_request
from mtplib.runtime.routing import POLICY_ENV
from mtplib.runtime.settings import DecodeSettings
from mtplib.runtime.speculative import MTPRuntime

PROMPT = seeded_prompt(7, 10)
SETTINGS = DecodeSettings(n_ctx=256, n_threads=1)
#: what is counted: (module, function)
COUNTED = {"draft_problem": "mtplib.contract.types", "draft_with": "mtplib.contract.types",
           "parse_plan": "mtplib.ownership.plan", "policy_gate": "mtplib.runtime.routing",
           "check_endpoints": "mtplib.ownership.plan", "parse_wan": "mtplib.runtime.links"}


class Counts(dict):
    """Calls of each counted check since the last `reset`."""

    def reset(self) -> None:
        self.update(dict.fromkeys(self, 0))

    def now(self) -> dict:
        return dict(self)


@pytest.fixture
def counts(monkeypatch) -> Counts:
    """How often this process runs each counted check, from here on."""
    seen = Counts.fromkeys(COUNTED, 0)
    for name, home in COUNTED.items():
        real = getattr(importlib.import_module(home), name)

        def counting(*a, _real=real, _name=name, **kw):
            seen[_name] += 1
            return _real(*a, **kw)

        holders = [m for n, m in list(sys.modules.items())
                   if n.startswith("mtplib") and getattr(m, name, None) is real]
        assert holders, name
        for m in holders:
            monkeypatch.setattr(m, name, counting)
    monkeypatch.delenv(POLICY_ENV, raising=False)
    return seen


def _expect(*, mtp: bool, ranged: bool, policy: int = 1) -> dict:
    return {"draft_problem": int(mtp), "draft_with": 1, "parse_plan": int(ranged),
            "policy_gate": policy, "check_endpoints": int(ranged), "parse_wan": int(ranged)}


# -- mtplib generate ------------------------------------------------------------------------
@pytest.mark.parametrize(("mtp", "ranged"), [(True, False), (False, False), (True, True),
                                             (False, True)],
                         ids=["whole-mtp", "whole-plain", "ranged-mtp", "ranged-plain"])
def test_a_generate_run_checks_each_setting_once(pair, counts, capsys, mtp, ranged):
    extra = (["--mtp", str(pair.sidecar), "--draft", "2"] if mtp else []) + (
        ["--plan", "0-1,2-3"] if ranged else [])
    assert main(["generate", "--model", str(pair.trunk), "--tokens", "1,2,3", "--n", "4",
                 "--ctx", "256", "--threads", "1", "--json", *extra]) == 0
    assert '"tokens"' in capsys.readouterr().out
    assert counts.now() == _expect(mtp=mtp, ranged=ranged)


def test_given_endpoints_are_checked_once_by_the_request(pair, counts, capsys):
    from mtplib.distributed.processes import LocalShards

    with LocalShards(2) as shards:
        counts.reset()
        assert main(["generate", "--model", str(pair.trunk), "--tokens", "1,2,3", "--n", "4",
                     "--ctx", "256", "--threads", "1", "--json", "--mtp", str(pair.sidecar),
                     "--draft", "2", "--plan", "0-1,2-3", "--endpoints",
                     ",".join(shards.endpoints)]) == 0
    assert '"tokens"' in capsys.readouterr().out
    assert counts.now() == _expect(mtp=True, ranged=True)


def test_a_refusing_policy_is_refused_once_with_its_message(pair, counts, capsys):
    assert main(["generate", "--model", str(pair.trunk), "--tokens", "1,2,3", "--mtp",
                 str(pair.sidecar), "--draft", "2", "--plan", "0-1,2-3", "--policy",
                 "alpha"]) == 2
    assert ("mtp.v4.draft2 refused under policy 'alpha': alpha policy: MTP disabled"
            in capsys.readouterr().err)
    assert counts["policy_gate"] == 1 and counts["parse_plan"] == 0  # before the plan


# -- serve's backend --------------------------------------------------------------------------
@pytest.mark.parametrize("ranged", [False, True], ids=["whole", "ranged"])
def test_serves_backend_is_built_from_one_request(pair, counts, ranged):
    """What `mtplib serve` does before it listens: its arguments checked, the backend
    loaded from their request, the HTTP config read from it; then two generations."""
    argv = ["serve", "--model", str(pair.trunk), "--mtp", str(pair.sidecar), "--draft", "2",
            "--ctx", "256", "--threads", "1"] + (["--plan", "0-1,2-3"] if ranged else [])
    a = build_parser().parse_args(argv)
    serve._check_serve_args(a)
    serve.check_engine_args(a)
    assert isinstance(a.request, RunRequest) and a.request.draft.k == 2
    with serve.open_backend(a, warm=True) as backend:
        cfg = serve._config(a, backend)
        assert cfg.k == 2 and cfg.n_vocab == a.request.trunk_header.n_vocab
        first, _ = backend.generate(PROMPT, 4)
        again, _ = backend.generate(PROMPT, 4)
    assert first == again
    assert counts.now() == _expect(mtp=True, ranged=ranged)


# -- one backend, two generations -------------------------------------------------------------
def test_two_generations_on_one_mtp_runtime_ask_the_policy_once(pair, counts):
    with MTPRuntime(str(pair.trunk), str(pair.sidecar), k=2, n_ctx=256, n_threads=1) as rt:
        a, m = rt.generate(PROMPT, 6)
        b, _ = rt.generate(PROMPT, 6)
    assert a == b and m.drafted > 0 and m.routing["recipe"] == "mtp.v4.draft2"
    assert counts.now() == _expect(mtp=True, ranged=False)
    assert rt.request.draft.k == 2 and type(rt.request.opts.k) is DraftLength


def test_two_generations_on_one_ranged_mtp_ask_the_policy_once(pair, counts):
    opts = EngineOptions(k=2, settings=SETTINGS)  # the caller's draft check: counted here
    other = EngineOptions(k=1, settings=SETTINGS)
    counts.reset()
    with ranged_mtp.RangedMTP(str(pair.trunk), plan="0-1,2-3", sidecar=str(pair.sidecar),
                              opts=opts) as r:
        a, m = r.generate(PROMPT, 6)
        b, _ = r.generate(PROMPT, 6)
        assert a == b and m.routing["recipe"] == "mtp.v4.draft2"
        assert counts.now() == _expect(mtp=False, ranged=True)  # k was checked by opts
        # a generation's own options: held to the stored verdict, the policy not asked
        _, m1 = r.generate(PROMPT, 6, other)
        assert m1.routing["recipe"] == "mtp.v4.draft1"
    assert counts["policy_gate"] == 1 and counts["parse_plan"] == 1
    assert counts["draft_with"] == 1  # the request's rule carried, not decided again


def test_a_generation_under_a_refusing_policy_is_refused_by_the_stored_verdict(pair,
                                                                              counts):
    with ranged_mtp.RangedMTP(str(pair.trunk), plan="0-1,2-3", sidecar=str(pair.sidecar),
                              policy="alpha", opts=EngineOptions(k=0, settings=SETTINGS)
                              ) as r:
        for _ in range(2):
            with pytest.raises(RouteRefused, match="^mtp.v4.draft2 refused under policy "
                               "'alpha': alpha policy: MTP disabled"):
                r.generate(PROMPT, 4, EngineOptions(k=2, settings=SETTINGS))
        toks, m = r.generate(PROMPT, 4)
        assert len(toks) == 4 and m.drafted == 0
    assert counts["policy_gate"] == 1


# -- the lab ---------------------------------------------------------------------------------
def test_a_wan_run_builds_one_request_per_loaded_backend(pair, counts):
    """A warm WAN run: one RangedMTP (one request) for the plan, every cell and prompt on
    it; each draft length's options are checked once for the run, not per generation."""
    cfg = wan_config.WanConfig(rtts_ms=[0, 1], ks=[0, 2], plans=["0-1,2-3"], topologies=["remote"],
                               placements=["client"], n_prompts=2, prompt_len=6, n_new=3,
                               fit_rtts_ms=[0], n_ctx=64)
    cfg = wan_config.with_upstream(cfg)  # as `main` does: the config is checked before the run
    prompts = [seeded_prompt(i, 6) for i in range(2)]
    counts.reset()
    res = wan_measure.run_wan(str(pair.trunk), str(pair.sidecar), cfg, prompts)
    assert len(res["rows"]) == 2 * 2 * 2  # cells (RTT x k) x prompts
    assert counts["policy_gate"] == 1 and counts["parse_plan"] == 1
    assert counts["check_endpoints"] == 1
    assert counts["draft_problem"] == len(cfg.ks)
    assert counts["draft_with"] == 1  # "no sidecar means k=0": decided at build, carried


def test_a_bench_run_asks_the_policy_once_per_backend(pair, counts, monkeypatch):
    from mtplib.lab.bench import config as BC

    built = {"n": 0}
    for cls in (MTPRuntime, ranged_mtp.RangedMTP):
        init = cls.__init__

        def counted(self, *a, _init=init, **kw):
            built["n"] += 1
            _init(self, *a, **kw)

        monkeypatch.setattr(cls, "__init__", counted)
    cfg = BC.BenchConfig.from_dict({"ks": [2], "n_new": 4, "reps": 2, "warmup": 0,
                                   "threads": 1, "prompts": [{"seed": 0, "len": 6}],
                                   "sweep": None, "plans": ["whole", "0-1,2-3"],
                                   "wan": "0,1"})
    assert counts["parse_wan"] == 1  # parsed with the section, for its one ranged plan
    counts.reset()
    res = bench.run_bench(str(pair.trunk), str(pair.sidecar), cfg)
    assert len(res.runs) > built["n"] >= 3  # more generations than backends
    assert counts["policy_gate"] == built["n"]  # once per backend, none per generation
    assert counts["parse_plan"] == 1 and counts["check_endpoints"] == 1
    assert counts["draft_with"] == built["n"]  # once per backend's request, none per run
    assert counts["parse_wan"] == 0  # the plan's request got the parsed links


def test_the_bench_cli_parses_its_wan_once(counts, monkeypatch, tmp_path):
    """`mtplib bench --wan`: the value replaces the lane's and is parsed once, with the
    section, into each ranged plan's links, which the run gets."""
    from mtplib.paths import DEFAULT_LANE

    got = {}

    class Stop(Exception):
        pass

    def run_bench(trunk, sidecar, cfg, **kw):
        got["cfg"], got["parsed"] = cfg, counts["parse_wan"]
        raise Stop

    monkeypatch.setattr(bench, "run_bench", run_bench)
    with pytest.raises(Stop):
        main(["bench", "--params", str(DEFAULT_LANE), "--wan", "20,0", "--quiet", "--out",
              str(tmp_path / "b")])
    cfg = got["cfg"]
    assert cfg.wan == "20,0" and got["parsed"] == 1
    assert cfg.wan_links("0-1,2-3") == (WanLink(20.0), WanLink())


# -- the object -------------------------------------------------------------------------------
def test_the_request_is_frozen_and_pickles_as_the_worker_gets_it(pair, counts, tmp_path):
    from mtplib.runtime.tls_config import TlsConfig

    req = build_request(pair.trunk, sidecar=pair.sidecar, draft=2, plan="0-1,2-3",
                        wan="100,0", settings=SETTINGS, tls=TlsConfig(tmp_path))
    assert counts.now() == {"draft_problem": 1, "draft_with": 1, "parse_plan": 1,
                            "policy_gate": 1, "check_endpoints": 0,  # local shards: later
                            "parse_wan": 1}
    with pytest.raises(dataclasses.FrozenInstanceError):
        req.plan = None
    with pytest.raises(dataclasses.FrozenInstanceError):
        req.opts.k = 3
    again = pickle.loads(pickle.dumps(req))
    assert again == req and isinstance(again.plan, ShardPlan) and str(again.plan) == "0-1,2-3"
    assert again.wan == (WanLink(100.0), WanLink()) and type(again.opts.k) is DraftLength
    assert again.tls == TlsConfig(tmp_path) and again.allow_remote
    assert again.trunk_header.n_vocab == req.trunk_header.n_vocab
    assert counts.now()["draft_problem"] == 1  # unpickling checks nothing again
    plain = build_request(pair.trunk, draft=5)  # no sidecar: MTP off, 5 never checked
    assert plain.draft.k is NO_DRAFT and plain.opts.k == 0 and not plain.ranged
    with pytest.raises(TypeError, match="cannot change k"):
        req.with_options(k=1)
    assert req.with_options(trace=True).opts.trace and not req.opts.trace


@pytest.mark.parametrize(("kw", "msg"), [
    ({"sidecar": "S", "draft": 9}, "^draft must be in 1..8"),
    ({"plan": "0-1,3-3"}, "^plan '0-1,3-3': gap before range 1"),
    ({"plan": "  "}, "^plan is empty"),
    ({"plan": "0-1,2-3", "endpoints": ["127.0.0.1:1"]},
     "plan 0-1,2-3 has 2 shards but 1 endpoints were given"),
    ({"plan": "0-1,2-3", "wan": "abc"}, "^--wan 'abc'"),
    ({"plan": "0-1,2-3", "wan": [WanLink()]}, "^wan: 1 WAN links for 2 shards"),
    ({"plan": "0-1,2-3", "mtp_placement": "moon"}, "^mtp_placement must be one of"),
    ({"plan": "0-1,2-3", "shard_threads": 0}, "^shard_threads must be in 1.."),
    ({"wan": "100"}, "^wan needs plan"),
    ({"endpoints": ["127.0.0.1:1"], "allow_cache_crossing": True},
     "^endpoints, allow_cache_crossing need plan"),
    ({"n_ctx": 0}, "n_ctx must be an integer >= 1"),
    ({"plan": "0-1,2-3", "seam": "mesh"}, "^seam must be one of auto, star, ring"),
    ({"seam": "ring"}, "^seam needs plan"),
    ({"peer_wan": "10"}, "^peer_wan needs plan"),
    ({"plan": "0-1,2-3", "peer_wan": "10,10"}, "^peer_wan '10,10': give one .* peer link"),
    ({"plan": "0-1,2-3", "peer_wan": [WanLink(), WanLink()]},
     "^peer_wan: 2 WAN links for 1 peer links"),
    ({"plan": "0-3", "peer_wan": "10"}, "^peer_wan needs at least 2 shards"),
    ({"plan": "0-1,2-3", "peer_wan": "10", "insecure_plaintext": True,
      "endpoints": ["127.0.0.1:5001", "10.1.2.3:5002"]}, "^peer_wan: shard 1 at 10.1.2.3:5002 "
     "is remote"),
])
def test_bad_input_is_refused_naming_the_field(pair, kw, msg):
    kw = {k: str(pair.sidecar) if v == "S" else v for k, v in kw.items()}
    with pytest.raises(InputError, match=msg):
        build_request(pair.trunk, **kw)


def test_peer_wan_is_one_link_per_shard_pair_checked_once(pair, capsys):
    req = build_request(pair.trunk, plan="0-0,1-2,3-3", wan="100", peer_wan="10")
    assert req.peer_wan == (WanLink(10.0), WanLink(10.0)) and req.wan == (WanLink(100.0),) * 3
    assert build_request(pair.trunk, plan="0-1,2-3").peer_wan is None
    two = build_request(pair.trunk, plan="0-0,1-2,3-3", peer_wan=[WanLink(5), WanLink(7)])
    assert two.peer_wan == (WanLink(5), WanLink(7))
    # loopback endpoints pass their relays here: the peer links can be delayed there
    loop = build_request(pair.trunk, plan="0-1,2-3", peer_wan="10",
                         endpoints=["127.0.0.1:5001", "127.0.0.1:5002"])
    assert loop.peer_wan == (WanLink(10.0),)
    assert main(["generate", "--model", str(pair.trunk), "--tokens", "1,2", "--n", "1",
                 "--peer-wan", "10"]) == 2
    assert "--peer-wan, --mtp-placement" in capsys.readouterr().err
    assert main(["generate", "--model", str(pair.trunk), "--tokens", "1,2", "--n", "1",
                 "--plan", "0-1,2-3", "--peer-wan", "5,5"]) == 2
    assert "--peer-wan '5,5': give one RTT_MS[:MBIT] for every peer link" in \
        capsys.readouterr().err


def test_a_refused_draft_has_its_own_type_and_the_cli_its_own_words(pair):
    with pytest.raises(DraftRefused):
        build_request(pair.trunk, sidecar=pair.sidecar, draft=9, names={"draft": "--draft"})
    with pytest.raises(PlanError):
        build_request(pair.trunk, plan=ShardPlan.parse("0-4", 5))  # the trunk has 4 layers


def test_the_backends_take_a_request_or_its_fields_not_both(pair):
    req = build_request(pair.trunk, sidecar=pair.sidecar, draft=2, settings=SETTINGS)
    with pytest.raises(TypeError, match="the request holds"):
        MTPRuntime(req, k=1)
    with pytest.raises(TypeError, match="the request holds"):
        ranged_mtp.RangedMTP(req, plan="0-1,2-3")
    with pytest.raises(InputError, match="whole-model request"):
        ranged_mtp.RangedMTP(req)
    ranged = build_request(pair.trunk, plan="0-1,2-3")
    with pytest.raises(InputError, match="runs in RangedMTP"):
        MTPRuntime(ranged)
